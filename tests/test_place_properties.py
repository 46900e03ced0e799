"""Properties of place -> plan -> simulate on random DAGs of up to 200 ops with random costs.

Hypothesis draws the machine, the sizes and the memory limits; a seeded generator draws the
graph itself (ops, views, device moves, random ops, 0-dim reductions, scalar-times-tensor
kernels) and a time for every (op, device), so one example stays small for hypothesis however
big the graph.
"""

from __future__ import annotations

import random
from itertools import pairwise

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _fakes import CAT, FakeCost, check_plan, machine, tensor
from autopar.ir.graph import Graph, Node
from autopar.ir.routing import GraphIndex, pool, route
from autopar.schedule.place import POLICIES, lower_bound, place
from autopar.schedule.plan import make_plan
from autopar.schedule.simulate import peak_memory, simulate

aten = torch.ops.aten
TIMES = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2)
SIZES = (4, 4_000, 400_000, 4_000_000)


def random_graph(rng: random.Random, n_ops: int, homes: list[str]) -> Graph:
    g = Graph("random")
    nodes: list[Node] = [g.input(tensor((rng.choice(SIZES) // 4,), rng.choice(homes)),
                                 name=f"in{i}") for i in range(rng.randint(1, 3))]
    scalars: list[Node] = []
    for i in range(n_ops):
        tensors = [n for n in nodes[-12:] if n.tensor_metas and n.tensor_metas[0].shape != ()]
        kind = rng.choice(["op"] * 6 + ["view", "sum", "scale", "move", "rand"])
        name = f"n{i}"
        if kind == "view" and tensors:
            node = g.call(aten.alias.default, (rng.choice(tensors),), name=name)
        elif kind == "sum" and tensors:
            node = g.call(aten.sum.default, (rng.choice(tensors),), name=name)
            scalars.append(node)
        elif kind == "scale" and tensors and scalars:
            node = g.call(aten.mul.Tensor, (rng.choice(tensors), rng.choice(scalars)), name=name)
        elif kind == "rand" and tensors:
            node = g.call(aten.rand_like.default, (rng.choice(tensors),), name=name)
        elif kind == "move" and tensors:
            to = torch.device(rng.choice(homes))
            node = g.call(aten._to_copy.default, (rng.choice(tensors),), {"device": to},
                          name=name)
        else:
            recent = nodes[-8:]
            ins = rng.sample(recent, rng.randint(1, min(3, len(recent))))
            device = ins[0].device or "cpu"
            node = g.call(CAT, (ins,), meta=tensor((rng.choice(SIZES) // 4,), device), name=name)
        nodes.append(node)
    ops = g.ops
    outs = {ops[-1], *rng.sample(ops, rng.randint(0, min(4, len(ops))))}
    g.set_outputs(sorted(outs, key=lambda n: n.id))
    return g


@st.composite
def problems(draw):
    cpus, gpus = draw(st.integers(1, 2)), draw(st.integers(0, 2))
    m = machine(cpus, gpus)
    names = [d.name for d in m.devices]
    homes = ["cpu"] + [f"cuda:{i}" for i in range(gpus)]
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    g = random_graph(rng, draw(st.integers(1, 200)), homes)
    times = {(n.name, d): rng.choice(TIMES) for n in g.ops for d in names}
    only = {n.name: {home(n), *rng.sample(names, rng.randint(0, len(names)))}
            for n in g.ops if rng.random() < 0.1}  # eager's device can always run it
    cost = FakeCost(m, times, bandwidth=draw(st.sampled_from([1e8, 1e9, 1e10])),
                    latency=draw(st.sampled_from([0.0, 1e-5])), only=only)
    limits = None
    if draw(st.booleans()):
        inputs = {p: sum(x.out_bytes for x in g.inputs if pool(home(x)) == p)
                  for p in {pool(d) for d in names}}
        spare = draw(st.sampled_from([400_000, 4_000_000, 40_000_000, 400_000_000]))
        limits = {p: b + spare for p, b in inputs.items()}
    return g, cost, limits


def home(x: Node) -> str:
    d = x.device or "cpu"
    return "cpu:0" if d.startswith("cpu") else d


def check_timeline(plan, tl) -> None:
    """Every op starts after its inputs are on its device; no lane runs two things at once."""
    dev = plan.placement.device
    ix = GraphIndex.of(plan.graph)
    ends = {(s.node, s.lane.split("/")[0]): s.end for s in tl.spans if s.kind == "op"}
    landed = {(s.node, pool(s.dst)): s.end for s in tl.spans if s.kind == "copy"}
    for s in tl.spans:
        if s.kind != "op":
            continue
        n = plan.graph.nodes[s.node]
        d = s.lane.split("/")[0]
        for v in ix.ins[n]:
            how = route(v, dev[v], d, ix)
            ready = (0.0 if v.is_input and how != "copy" else
                     landed[(v.id, pool(d))] if how == "copy" else ends[(v.id, dev[v])])
            assert s.start >= ready - 1e-12, f"{n!r} on {d} starts before {v!r} is there"
    for lane in tl.lanes():
        spans = tl.on(lane)
        for a, b in pairwise(spans):
            assert b.start >= a.end - 1e-12, f"{lane}: {a} overlaps {b}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_plans_are_valid_exact_and_no_slower_than_eager(problem):
    g, cost, limits = problem
    bound = lower_bound(g, cost)
    ends: dict[str, float] = {}
    fits: dict[str, bool] = {}
    for policy in POLICIES:
        p = place(g, cost, policy, memory=limits)
        plan = make_plan(p)
        check_plan(plan)
        tl = simulate(plan, cost)  # raises if any program waits forever
        check_timeline(plan, tl)
        end = max(s.end for s in tl.spans)
        assert abs(end - p.predicted_s) <= 1e-9 * max(end, 1e-9), "simulation != plan"
        assert end >= bound * (1 - 1e-9)
        peaks = peak_memory(plan, tl)
        fits[p.policy] = limits is None or all(peaks[w] <= limits[w] for w in peaks)
        if p.policy == "heft":
            assert fits["heft"], (peaks, limits)
        ends[p.policy] = end
    if "heft" in ends and fits["single"]:  # HEFT never plans slower than eager
        assert ends["heft"] <= ends["single"] * (1 + 1e-9)
