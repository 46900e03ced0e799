"""Test doubles for placement, plans and simulation: small machines and a table-driven cost model.

``FakeCost`` answers the :class:`autopar.cost.model.CostModel` questions the scheduler asks from a
table, so that every planned time in a test can be checked by hand.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch

from autopar.ir.graph import Graph, Node, TensorMeta
from autopar.machine.model import Device, Machine
from autopar.schedule.place import Placement

aten = torch.ops.aten
MM = aten.mm.default
RELU = aten.relu.default
CAT = aten.cat.default


def machine(cpus: int = 1, gpus: int = 2, name: str = "fake") -> Machine:
    """``cpu:0..`` then ``cuda:0..``, with the default profile (16 GiB per pool)."""
    devices = [Device(f"cpu:{i}", "cpu", i) for i in range(cpus)]
    devices += [Device(f"cuda:{i}", "cuda", i) for i in range(gpus)]
    return Machine(name, tuple(devices))


Times = dict[tuple[str, str], float]


class FakeCost:
    """Op times from a table, copies at ``latency + bytes / bandwidth``.

    ``times[(node name, device)]`` or ``times[(node name, "cpu" | "cuda")]``: seconds; anything
    else takes ``default`` (a number, or ``fn(node, device)``). ``only[node name]``: the devices
    that can run it (all others by default). Copies between CPU workers are free.
    """

    def __init__(self, machine: Machine, times: Times | None = None,
                 default: float | Callable[[Node, str], float] = 1e-3,
                 bandwidth: float = 1e9, latency: float = 0.0,
                 only: dict[str, Iterable[str]] | None = None) -> None:
        self.machine = machine
        self.times = dict(times or {})
        self.default = default
        self.bandwidth = bandwidth
        self.latency = latency
        self.only = {k: set(v) for k, v in (only or {}).items()}

    def node_time(self, node: Node, device: str) -> float:
        if node.is_input:
            return 0.0
        kind = device.split(":")[0]
        for key in ((node.name, device), (node.name, kind)):
            if key in self.times:
                return self.times[key]
        return self.default(node, device) if callable(self.default) else self.default

    def transfer_time(self, nbytes: int, src: str, dst: str, pinned: bool = True) -> float:
        if src == dst or (src.startswith("cpu") and dst.startswith("cpu")):
            return 0.0
        return self.latency + nbytes / self.bandwidth

    def can_run(self, node: Node, device: str) -> bool:
        allowed = self.only.get(node.name)
        return allowed is None or device in allowed


def tensor(shape: tuple[int, ...], device: str, dtype: torch.dtype = torch.float32) -> TensorMeta:
    return TensorMeta.make(shape, dtype, device)


def op(g: Graph, name: str, inputs: list[Node], nbytes: int, device: str | None = None) -> Node:
    """An op with the given inputs and a float32 output of ``nbytes`` (cat of its inputs)."""
    device = device or inputs[0].device or "cpu"
    meta = tensor((max(nbytes // 4, 1),), device)
    return g.call(CAT, (list(inputs),), meta=meta, name=name)


def by_name(g: Graph) -> dict[str, Node]:
    return {n.name: n for n in g.nodes}


def by_hand(graph: Graph, devices: dict[str, str]) -> Placement:
    """Op ``name`` on ``devices[name]`` (cpu:0 otherwise), in graph order."""
    device = {n: devices.get(n.name, "cpu:0") for n in graph.nodes}
    order: dict[str, list[Node]] = {}
    for n in graph.ops:
        order.setdefault(device[n], []).append(n)
    return Placement(graph=graph, device=device, order=order, policy="by_hand", notes={},
                     predicted_s=0.0)


def devices_of(placement: Any) -> dict[str, str]:
    """node name -> device, ops only."""
    return {n.name: d for n, d in placement.device.items() if not n.is_input}


def order_of(placement: Any) -> dict[str, list[str]]:
    return {d: [n.name for n in ops] for d, ops in placement.order.items()}


# -- named graphs shared by the tests ---------------------------------------------------------
def scalar_times_matrix() -> tuple[Graph, FakeCost]:
    """``out = A * s``: A a 100x100 input on cuda:0, s a 0-dim ``scalar_tensor`` (5 us on the
    host or the GPU); out takes 1 ms on the GPU and 1 s on the host."""
    us, ms = 1e-6, 1e-3
    g = Graph("scalar")
    a = g.input(tensor((100, 100), "cuda:0"), name="A")
    s = g.call(torch.ops.aten.scalar_tensor.default, (2.0,), {"device": torch.device("cuda:0")},
               name="s")
    out = g.call(torch.ops.aten.mul.Tensor, (a, s), name="out")
    g.set_outputs([out])
    cost = FakeCost(machine(cpus=1, gpus=1), {("s", "cpu"): 5 * us, ("s", "cuda"): 5 * us,
                                              ("out", "cuda"): 1 * ms, ("out", "cpu"): 1.0})
    return g, cost


def two_chains() -> Graph:
    g = Graph("two_chains")
    x = g.input(tensor((1000, 1000), "cuda:0"), name="x")  # 4 MB each
    y = g.input(tensor((1000, 1000), "cuda:0"), name="y")
    a1 = g.call(MM, (x, x), name="a1")
    a2 = g.call(MM, (a1, a1), name="a2")
    b1 = g.call(MM, (y, y), name="b1")
    b2 = g.call(MM, (b1, b1), name="b2")
    g.set_outputs([a2, b2])
    return g


def chains_cost(m: Machine | None = None) -> FakeCost:
    """mm: 10 ms on a GPU, 100 ms on the host; 4 MB copies take 1 ms."""
    times = {(name, "cuda"): 10e-3 for name in ("a1", "a2", "b1", "b2")}
    return FakeCost(m or machine(cpus=1, gpus=2), times, default=100e-3, bandwidth=4e9)


def w4(n: int = 50, side: int = 4000) -> Graph:
    """W4: two lists of x.mm(x), both inputs on cuda:0, all 2n results returned."""
    g = Graph("w4")
    x1 = g.input(tensor((side, side), "cuda:0"), name="x1")
    x2 = g.input(tensor((side, side), "cuda:0"), name="x2")
    outs = [g.call(MM, (x, x), name=f"{k}{i}") for k, x in (("a", x1), ("b", x2))
            for i in range(n)]
    g.set_outputs(outs)
    return g


def w5(n: int = 50, side: int = 4000) -> Graph:
    """W5: n results of x.mm(x), each then copied to the host with .cpu()."""
    g = Graph("w5")
    x = g.input(tensor((side, side), "cuda:0"), name="x")
    outs = []
    for i in range(n):
        y = g.call(MM, (x, x), name=f"y{i}")
        outs.append(g.call(torch.ops.aten._to_copy.default, (y,),
                           {"dtype": torch.float32, "layout": torch.strided,
                            "device": torch.device("cpu")}, name=f"z{i}"))
    g.set_outputs(outs)
    return g


# -- a plan checker: the invariants of autopar.schedule.plan, asserted step by step ----------------
def check_plan(plan: Any) -> None:
    """Assert every invariant listed in autopar.schedule.plan's docstring (dependencies, events,
    copies, frees, outputs) on the plan's programs alone."""
    from autopar.ir.routing import GraphIndex, home_device, pool, route
    from autopar.schedule.steps import Free, Record, Run, Send, Wait

    placement = plan.placement
    dev = placement.device
    graph = plan.graph
    ix = GraphIndex.of(graph)
    producers: dict[int, tuple[str, Any]] = {}
    for device, steps in plan.programs.items():
        for step in steps:
            if isinstance(step, Send | Record):
                assert step.event not in producers, f"event {step.event} produced twice"
                producers[step.event] = (device, step)
    assert sorted(producers) == list(range(plan.n_events))
    runs = [(d, s.node) for d, steps in plan.programs.items() for s in steps
            if isinstance(s, Run)]
    assert sorted(n.id for _, n in runs) == [n.id for n in graph.ops], "one Run per op"
    for device, ops in placement.order.items():
        assert [s.node for s in plan.programs[device] if isinstance(s, Run)] == ops
    sends = {}
    for s in plan.copies():
        key = (s.value, pool(s.dst))
        assert key not in sends, f"two copies of {s.value!r} into {pool(s.dst)}"
        sends[key] = s
        assert s.src == dev[s.value] and pool(s.src) != pool(s.dst)
    for device, steps in plan.programs.items():
        produced: set[Any] = set()
        freed: set[Any] = set()
        waited: set[int] = set()
        for step in steps:
            if isinstance(step, Wait):
                src_dev, made = producers[step.event]
                assert src_dev != device, f"{device} waits for its own event {step.event}"
                assert made.value is step.value and src_dev == step.src
                waited.add(step.event)
            elif isinstance(step, Run):
                n = step.node
                assert dev[n] == device
                for v in ix.ins[n]:
                    assert v not in freed, f"{n!r} on {device} reads {v!r} after its Free"
                    how = route(v, dev[v], device, ix)
                    if how == "local" or (v.is_input and how == "event"):
                        assert v.is_input or v in produced, f"{n!r} reads {v!r} before it"
                    else:
                        event = (sends[(v, pool(device))].event if how == "copy" else
                                 next(e for e, (_, s) in producers.items()
                                      if isinstance(s, Record) and s.value is v))
                        assert event in waited, f"{n!r} on {device} reads {v!r} unwaited"
                produced.add(n)
            elif isinstance(step, Send):
                assert step.value.is_input or step.value in produced, f"{step} before producer"
                assert step.value not in freed, f"{step} after the value's Free"
            elif isinstance(step, Record):
                assert step.value in produced
            elif isinstance(step, Free):
                v = step.value
                assert step.device == device and v not in freed
                assert not (v.is_input and pool(dev[v]) == pool(device)), f"frees input {v!r}"
                freed.add(v)
    for o, d in plan.outputs:
        if isinstance(o, Node) and d is not None and o.tensor_metas:
            assert d == home_device(o.device)
            assert pool(dev[o]) == pool(d) or (o, pool(d)) in sends, f"{o!r} never delivered"
            freed_there = any(isinstance(s, Free) and s.value is o and pool(s.device) == pool(d)
                              for _, s in plan.steps())
            assert not freed_there, f"output {o!r} freed where it is read"


def adamw_pair(model: torch.nn.Module) -> tuple:
    """``model``, a copy of it, and an AdamW (lr 1e-2) for each: the way under test and eager's."""
    ref = copy.deepcopy(model)
    return (model, ref, torch.optim.AdamW(model.parameters(), lr=1e-2),
            torch.optim.AdamW(ref.parameters(), lr=1e-2))


def adamw_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    """A training step as users write it: zero_grad, a squared-mean loss, backward, step."""
    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()
    return step
