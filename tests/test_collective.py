"""Collectives (autopar.ir.collective): a split step's gradient sums as one all-reduce per
bucket over three or more GPUs, placed on the collectives' own lane, priced as a ring,
planned, simulated and run; and an optimizer's update made on every GPU (no broadcast).

The GPUs' graphs are captured on the CPU and relabelled; their arithmetic runs on the host
(the collective's function adds the parts in order). The executor's path runs for real on two
logical CPU workers with collectives forced; its NCCL path: tests/test_dataparallel_gpu.py.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import pytest
import torch

from _steps import mlp_inputs, module_step
from autopar.bench.workloads import w6_train_step
from autopar.capture.fake import relabel_devices
from autopar.capture.state import find_state
from autopar.capture.step import capture_step
from autopar.cost.model import COLLECTIVE_LATENCY_S, CostModel
from autopar.dataparallel import relabel_step
from autopar.ir.collective import COMM, all_reduce, inline, take
from autopar.ir.graph import op_name
from autopar.machine.presets import preset
from autopar.passes.shard import shard
from autopar.runtime import Executor, SequentialRunner
from autopar.schedule.place import place
from autopar.schedule.plan import make_plan
from autopar.schedule.simulate import issue_s, simulate
from autopar.schedule.steps import Record, Run, Send, Wait

GPUS = ["cuda:0", "cuda:1", "cuda:2"]


def w6_on(devices, batch=12, **kw):
    inputs = mlp_inputs(batch=batch)
    step = capture_step(w6_train_step, inputs)
    want = SequentialRunner(step.graph)([t.detach() for t in inputs])
    if devices[0].startswith("cuda"):
        relabel_devices(step.graph, "cpu", "cuda:0")
    g = step.graph
    s = shard(g, {g.inputs[4]: 0, g.inputs[5]: 0}, devices, updates=step.updates, **kw)
    return inputs, step, want, s


def ops(s, name):
    return [n for n in s.graph.ops if op_name(n.op) == name]


def run_relabelled_on_the_cpu(s, args):
    """The sharded graph's arithmetic op by op, every GPU relabelled to the host."""
    for dev in s.devices:
        relabel_devices(s.graph, dev, "cpu")
    return SequentialRunner(s.graph)(list(args) + [args[j].clone() for j, _ in s.replicas])


def test_over_three_gpus_each_bucket_is_one_collective_on_its_lane():
    """W6 over three GPUs: its four gradients in one bucket, reduced by one all_reduce of the
    three shards' flattened partials (pinned to COMM), taken on each GPU; the loss's total
    weight likewise; no partial sum is copied between GPUs. Two GPUs keep copies and adds."""
    _, _, _, s = w6_on(GPUS)
    reduces = ops(s, "all_reduce")
    assert len(reduces) == 2 and all(s.pins[n] == COMM for n in reduces)
    bucket = max(reduces, key=lambda n: n.meta[0].numel)
    assert [p.device for p in bucket.args] == GPUS
    assert [op_name(p.op) for p in bucket.args] == ["aten.cat"] * 3  # each shard's bucket
    assert [m.device for m in bucket.meta] == GPUS
    takes = [n for n in ops(s, "take") if n.args[0] is bucket]
    assert sorted((n.args[1], s.pins[n], n.device) for n in takes) == [
        (i, d, d) for i, d in enumerate(GPUS)]
    moved = [n.args[0] for n in ops(s, "aten._to_copy")
             if str(n.kwargs.get("device", "")).startswith("cuda:") and n.args[0].device
             != str(n.kwargs["device"])]
    assert {n.name.rsplit("_s", 1)[0] for n in moved} <= {"arg4_1", "arg5_1"}  # the batch
    _, _, _, two = w6_on(GPUS[:2])
    assert not ops(two, "all_reduce") and ops(two, "aten.add.Tensor")
    _, _, _, off = w6_on(GPUS, collectives=False)
    assert not ops(off, "all_reduce")


def test_collective_graph_computes_eager_values_with_identical_replicas():
    from test_shard import run_on_the_cpu_like_eager

    inputs, step, want, s = w6_on(GPUS, batch=13)
    run_on_the_cpu_like_eager(s, step, inputs, want)


def test_collective_is_placed_on_its_lane_planned_and_simulated_as_placed():
    _, _, _, s = w6_on(GPUS)
    cost = CostModel(preset("h200x8"))
    placed = place(s.graph, cost, pins=s.pins)
    for n in ops(s, "all_reduce"):
        assert placed.device[n] == COMM
    plan = make_plan(placed)
    comm = plan.programs[COMM]
    kinds = [type(x).__name__ for x in comm]
    assert kinds.count("Run") == 2 and kinds.count("Record") == 2
    assert not any(isinstance(x, Send) for x in comm)
    # each GPU waits on the bucket's collective (home on the loss's total weight's too);
    # no partial crosses between GPUs by a copy
    bucket = max(ops(s, "all_reduce"), key=lambda n: n.meta[0].numel)
    for d in GPUS:
        waits = {x.value for x in plan.programs[d] if isinstance(x, Wait) and x.src == COMM}
        assert waits == (set(ops(s, "all_reduce")) if d == "cuda:0" else {bucket})
    between = [x.value for x in plan.copies() if x.src in GPUS and x.dst in GPUS
               and x.value.meta.shape]  # (the loss's total weight, 0-dim, goes to each GPU)
    assert between and {v.name.rsplit("_s", 1)[0] for v in between} <= {"arg4_1", "arg5_1"}
    timeline = simulate(plan, cost)
    assert timeline.makespan == pytest.approx(placed.predicted_s)
    assert "comm" in timeline.lanes()
    off = w6_on(GPUS, collectives=False)[3]
    off_plan = make_plan(place(off.graph, cost, pins=off.pins))
    assert issue_s(plan, cost) < issue_s(off_plan, cost)


def test_an_all_reduce_is_priced_as_a_ring_over_the_gpus():
    """8 parts of 32 MB on h200x8: 2 * 7/8 of 32 MB at the slowest link's bandwidth, plus the
    collective's fixed latency; the issuing thread: per GPU a copy-kind launch and one and a
    half event waits."""
    machine = preset("h200x8")
    cost = CostModel(machine)
    from autopar.ir.graph import Graph, TensorMeta

    g = Graph("ring")
    parts = [g.input(TensorMeta.make((8 << 20,), torch.float32, f"cuda:{i}"), f"p{i}")
             for i in range(8)]
    small = [g.input(TensorMeta.make((4096,), torch.float64, f"cuda:{i}"), f"s{i}")
             for i in range(8)]
    node = g.call(all_reduce, tuple(parts), meta=tuple(p.meta for p in parts), flops=0)
    got = cost.op_cost(node, COMM)
    bandwidth = min(machine.profile.link(f"cuda:{i}", f"cuda:{(i + 1) % 8}").bandwidth
                    for i in range(8))
    assert got.device_s == pytest.approx(COLLECTIVE_LATENCY_S + 2 * 7 / 8 * (32 << 20) / bandwidth)
    per_gpu = machine.profile.device("cuda:0").launch("copy") + \
        1.5 * machine.profile.event_wait_s
    assert got.host_s == pytest.approx(8 * per_gpu)
    assert cost.can_run(node, COMM) and not cost.can_run(node, "cuda:0")
    item = g.call(take, (node, 3), meta=node.meta[3], flops=0)
    assert cost.node_time(item, "cuda:3") == 0.0 and not cost.can_run(item, COMM)
    # a small one (batch norm's sums of 2 x 2048 channels in float64: 32 KB) runs on the
    # compute streams: per GPU its launch alone, no event on either side
    assert inline(small[0].meta.nbytes) and not inline(parts[0].meta.nbytes)
    node = g.call(all_reduce, tuple(small), meta=tuple(p.meta for p in small), flops=0)
    got = cost.op_cost(node, COMM)
    assert got.host_s == pytest.approx(8 * machine.profile.device("cuda:0").launch("copy"))
    assert got.device_s == pytest.approx(COLLECTIVE_LATENCY_S + 2 * 7 / 8 * 32768 / bandwidth)


def test_a_gpus_wait_for_a_small_collective_costs_the_thread_nothing(monkeypatch):
    """W6 over three GPUs: the loss's total weight (a few bytes) is reduced on the compute
    streams, so the GPUs' waits for it issue no event; the gradient bucket's (on the comm
    streams, here where the bound is set below its size) each cost half an event record and
    wait."""
    import autopar.ir.collective

    monkeypatch.setattr(autopar.ir.collective, "INLINE_BYTES", 64)
    _, _, _, s = w6_on(GPUS)
    cost = CostModel(preset("h200x8"))
    plan = make_plan(place(s.graph, cost, pins=s.pins))
    waits = [(d, x) for d in GPUS for x in plan.programs[d]
             if isinstance(x, Wait) and x.src == COMM]
    small = [w for w in waits if inline(w[1].value.args[0].meta.nbytes)]
    assert small and len(small) < len(waits)
    half = cost.machine.profile.event_wait_s / 2

    def without(which) -> Any:  # the plan with those waits left out of its programs
        gone = {id(x) for _, x in which}
        return dataclasses.replace(plan, programs={
            d: [x for x in steps if id(x) not in gone] for d, steps in plan.programs.items()})
    assert issue_s(without(small), cost) == pytest.approx(issue_s(plan, cost))
    big = [w for w in waits if w not in small]
    assert issue_s(without(big), cost) == pytest.approx(issue_s(plan, cost) - len(big) * half)


def test_on_gpus_a_small_all_reduce_runs_on_the_compute_streams_a_big_one_on_the_comm(
        monkeypatch):
    """The executor's GPU path, its CUDA pieces stood in for: parts of at most INLINE_BYTES
    are reduced on each GPU's compute stream with no stream ordered after another; bigger
    ones on each GPU's comm stream, ordered after its compute stream. Either way the sums
    come back (a small one's had been left unset)."""
    import types

    from autopar.ir.collective import INLINE_BYTES
    from autopar.runtime import executor as ex

    class Stream:
        def __init__(self, name):
            self.name, self.waited = name, []

        def wait_stream(self, other):
            self.waited.append(other.name)

    comm = {d: Stream(f"{d}/comm") for d in GPUS}
    monkeypatch.setattr(ex._Streams, "of", classmethod(
        lambda cls, d: types.SimpleNamespace(comm=comm[d])))
    reduced = []

    def on(parts, devices, streams, into):
        reduced.append([s.name for s in streams])
        return tuple(f"sum on {d}" for d in devices)

    monkeypatch.setattr(ex, "_all_reduce_on", on)
    compute = {d: Stream(f"{d}/compute") for d in GPUS}
    call = ex._Call(0, 0, compute)
    for nbytes, lane in ((INLINE_BYTES, "compute"), (INLINE_BYTES + 1, "comm")):
        parts = [types.SimpleNamespace(device=d, nbytes=nbytes, shape=(1,)) for d in GPUS]
        assert call.all_reduce(parts) == tuple(f"sum on {d}" for d in GPUS)
        assert reduced.pop() == [f"{d}/{lane}" for d in GPUS]
    assert all(not s.waited for s in compute.values())
    assert [s.waited for s in comm.values()] == [[f"{d}/compute"] for d in GPUS]


def test_collectives_run_through_the_executor_on_cpu_workers_like_eager():
    """Collectives forced on two CPU workers (one memory: the lane adds the parts once): the
    executor runs the lane's program with the host's and every step equals eager."""
    inputs, _, want, s = w6_on(["cpu:0", "cpu:1"], batch=9, collectives=True)
    assert ops(s, "all_reduce")
    cost = CostModel(preset("cpu-only", cpu_workers=2))
    plan = make_plan(place(s.graph, cost, pins=s.pins))
    assert any(isinstance(x, Run) for x in plan.programs[COMM])
    assert any(isinstance(x, Record) for x in plan.programs[COMM])
    ex = Executor(plan)
    assert ex.merged is not None and COMM in ex.merged
    args = [t.detach() for t in inputs]
    for _ in range(2):
        got = ex(args)
        for g, w in zip(got[:5], want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def adamw_step_on_gpus(k: int):
    """A two-layer model's AdamW (foreach) step, captured on the CPU and relabelled to
    cuda:0 with Adam's step counts kept on the host (what predict_step does), split over k."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    return step_on_gpus(model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True), k)


def step_on_gpus(model: torch.nn.Module, opt: torch.optim.Optimizer, k: int):
    """``model``'s cross-entropy step with ``opt`` (stepped once first, so its state exists),
    captured on the CPU, relabelled to cuda:0 and split over k GPUs: (the capture, the split,
    the arguments, eager's outputs)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    x, t = torch.randn(12, 6), torch.randint(0, 3, (12,))

    step = module_step(model, opt)
    state = find_state(step, (x, t))
    state = find_state(step, (x, t), state.floats.keys())  # lr, betas: inputs (as scheduled)
    captured = capture_step(step, (x, t), state=state)
    args = [x, t, *(v.detach().clone() for v in state.tensors), *captured.constants]
    want = SequentialRunner(captured.graph)(args)
    relabel_step(captured, state, "cuda:0")
    g = captured.graph
    s = shard(g, {g.inputs[0]: 0, g.inputs[1]: 0}, [f"cuda:{i}" for i in range(k)],
              updates=captured.updates)
    return captured, s, args, want


def test_a_lifted_learning_rate_stays_on_the_host_when_the_step_moves_to_a_gpu():
    """``relabel_step`` (what predict_step does) keeps AdamW's float ``lr`` and ``betas``
    inputs on the host, where the call makes them: their ``.item()`` is a host read, not a
    GPU sync."""
    _, s, _, _ = adamw_step_on_gpus(2)
    reads = [n for n in s.graph.ops if op_name(n.op) == "aten._local_scalar_dense"]
    lifted = [n.args[0] for n in reads if n.args[0].meta.dtype == torch.float64]
    assert len(lifted) == 3 and all(x.is_input and x.device == "cpu" for x in lifted)
    assert all(r.args[0].device == "cpu" for r in reads)


@pytest.mark.parametrize("k", [2, 3])
def test_an_optimizers_update_runs_on_every_gpu_reading_the_hosts_numbers(k):
    """AdamW's bias corrections are numbers the host computes from its step counts: every
    GPU reads them as they are, runs the update on its replicas and makes their next values
    itself (no parameter or moment broadcast from home); the arithmetic gives eager's values
    and every replica home's bits."""
    captured, s, args, want = adamw_step_on_gpus(k)
    host_reads = [n for n in s.graph.ops if op_name(n.op) == "aten._local_scalar_dense"]
    assert len(host_reads) == len([n for n in captured.graph.ops
                                   if op_name(n.op) == "aten._local_scalar_dense"])
    n_real = len(s.graph.outputs) - len(s.replica_outputs)
    for (_, device), nxt in zip(s.replica_outputs, s.graph.outputs[n_real:], strict=True):
        made = nxt.args[0] if nxt.op is operator.getitem else nxt
        assert s.pins.get(made) == device and made.device == device
    got = run_relabelled_on_the_cpu(s, args)
    for g, w in zip(got[:n_real], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    updated = dict(zip(captured.mutated, got[captured.n_outputs + len(captured.grads):n_real]))
    for (j, _), replica in zip(s.replica_outputs, got[n_real:], strict=True):
        assert torch.equal(replica, updated[j])


@pytest.mark.parametrize("k", [2, 3])
def test_batch_norms_parameter_gradients_are_taken_on_every_gpu_for_its_update(k):
    """Batch norm's weight and bias gradients are slices of its reduced sums: each GPU's
    update (SGD with momentum, foreach) reads its own slices, made from its own item of the
    reduction, not home's gradients copied across (106 of them to each GPU a ResNet-50 step);
    the step equals eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5),
                                torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    _, s, args, want = step_on_gpus(model, opt, k)
    updates = [n for n in s.graph.ops if op_name(n.op).startswith("aten._foreach_")
               and s.pins.get(n, "cuda:0") != "cuda:0"]
    assert len({s.pins[n] for n in updates}) == k - 1
    far = [(n, v) for n in updates for v in n.inputs  # (None: a host number, its lr)
           if v.device not in (None, "cpu", s.pins[n])]
    assert not far
    n_real = len(s.graph.outputs) - len(s.replica_outputs)
    # every op home's value lives on runs there: batch norm's num_batches_tracked += 1 (a
    # GPU scalar) is not sent to the host and back, which HEFT chose with home's lane busy
    assert all(s.pins.get(n) == ("comm" if n.op is all_reduce else "cuda:0")
               for n in s.graph.ops if n.device == "cuda:0")
    cost = CostModel(preset("h200x8"))
    placed = place(s.graph, cost, pins=s.pins)
    assert not [n for n in s.graph.ops if placed.device[n].startswith("cpu")
                and n.device not in ("cpu", None)]  # (None: a host number)
    got = run_relabelled_on_the_cpu(s, args)
    for g, w in zip(got[:n_real], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_under_graphs_a_collectives_sums_stay_in_place_and_segments_read_them_there(
        monkeypatch):
    """With segments replayed (a stand-in for CUDA graphs on CPU workers), each collective's
    sums land in the same buffers every call, so the segments that read them (views of the
    bucket: the gradients) take them in place, without copies, and stay captured; every
    call equals eager."""
    from autopar.passes.cudagraphs import capture_rule
    from autopar.runtime import executor as executor_module
    from test_cudagraphs import StandInGraphs

    backend = StandInGraphs()
    monkeypatch.setattr(executor_module, "graph_devices",
                        lambda devices, rule: [] if rule is None else
                        [d for d in devices if d != COMM])
    monkeypatch.setattr(executor_module, "_GRAPH_BACKEND", backend)
    inputs, _, want, s = w6_on(["cpu:0", "cpu:1"], batch=9, collectives=True)
    cost = CostModel(preset("cpu-only", cpu_workers=2))
    ex = Executor(make_plan(place(s.graph, cost, pins=s.pins)), cuda_graphs=capture_rule(True))
    assert ex.keep_sums
    node_of = {slot: s.graph.nodes[nid] for (nid, _), slot in ex.slots.index.items()}

    def from_take(v) -> bool:  # an item of a collective, or a view of one
        while v.op is not take and v.args and getattr(v.args[0], "op", None) is not None \
                and v.aliases:
            v = v.args[0]
        return v.op is take

    readers = [seg for seg in ex.segments
               if any(from_take(node_of[seg.input_slots[k]]) for k in seg.in_place)]
    assert readers
    args = [t.detach() for t in inputs]
    sums = []
    for _ in range(4):
        got = ex(args)
        for g, w in zip(got[:5], want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        sums.append({k: v[0].data_ptr() for k, v in ex._events.sums.items()})
    assert sums[0] and all(x == sums[0] for x in sums)  # the same buffers every call
    assert backend.captures and all(seg.status == "captured" for seg in readers)


def test_data_parallel_with_collectives_on_cpu_workers_equals_eager_and_says_so(monkeypatch):
    """The front door with every sum a collective (forced: CPU workers share memory, where
    ``"auto"`` keeps adds): five W6 steps equal eager's, and ``explain`` counts the
    all-reduces."""
    import autopar
    import autopar.passes.dataparallel as pdp

    def with_collectives(*args, **kwargs):
        return shard(*args, **{**kwargs, "collectives": True})

    monkeypatch.setattr(pdp, "shard", with_collectives)
    ref, mine = mlp_inputs(batch=64, d_in=32, hidden=64), mlp_inputs(batch=64, d_in=32,
                                                                     hidden=64)
    step = autopar.data_parallel(w6_train_step, devices="cpu:0,cpu:1", shards=2)
    for _ in range(5):
        torch.testing.assert_close(step(*mine), w6_train_step(*ref), rtol=1e-5, atol=1e-6)
    for m, r in zip(mine[:4], ref[:4], strict=True):
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)
    assert "; 2 all-reduces" in step.explain()
    assert "cpu:0,cpu:1 bound: of its " in step.explain()


def test_a_buckets_collective_starts_while_backward_goes_on():
    """Each W6 gradient its own collective (``bucket_bytes=0``) over three GPUs on
    ``h200x8``: dW2's GEMM and its collective are taken as soon as they can run, so dW2's
    collective starts before the last backward GEMM (dW1's) ends; by upward rank alone the ops
    that only feed the update came last (dW2's collective after dW1's GEMM: 0.82 ms predicted
    against 0.71)."""
    inputs = mlp_inputs(batch=3072, d_in=1024, hidden=2048, classes=512)
    step = capture_step(w6_train_step, inputs)
    relabel_devices(step.graph, "cpu", "cuda:0")
    g = step.graph
    s = shard(g, {g.inputs[4]: 0, g.inputs[5]: 0}, GPUS, updates=step.updates, bucket_bytes=0)
    placed = place(s.graph, CostModel(preset("h200x8")), pins=s.pins)
    slots = placed.slots
    (dw2,) = [n for n in ops(s, "all_reduce") if n.meta[0].shape == (512, 2048)]
    (dw1,) = [n for n in ops(s, "aten.mm") if placed.device[n] == "cuda:1"
              and n.meta.shape == (2048, 1024)]
    assert slots[dw2].start < slots[dw1].end


def test_a_value_of_no_elements_is_made_on_each_gpu_not_copied():
    """HF's attention concatenates an empty constant (``torch.tensor([])``) with each
    shard's keys: every GPU makes its own empty tensor, none is copied from the host."""

    def step(w, x):
        y = torch.cat([torch.tensor([]), x @ w], dim=-1)
        loss = y.relu().sum()
        loss.backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
            w.grad = None
        return loss.detach()

    g0 = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 3, generator=g0).requires_grad_(), torch.randn(9, 4, generator=g0)
    captured = capture_step(step, (w, x))
    args = [w.detach(), x, *captured.constants]
    want = SequentialRunner(captured.graph)(args)
    relabel_devices(captured.graph, "cpu", "cuda:0",
                    keep=captured.graph.inputs[len(captured.graph.inputs)
                                               - len(captured.constants):])
    g = captured.graph
    s = shard(g, {g.inputs[1]: 0}, GPUS, updates=captured.updates)
    moved = [n.args[0] for n in ops(s, "aten._to_copy")]
    assert not any(v.meta.numel == 0 for v in moved)
    empties = ops(s, "aten.empty_strided")
    assert sorted(n.device for n in empties) == GPUS
    got = run_relabelled_on_the_cpu(s, args)
    for a, b in zip(got[:len(want)], want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
