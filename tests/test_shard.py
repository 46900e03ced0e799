"""The sharding pass on CPU: exact shard shapes, replicas, reductions, what is left unsplit.

Graphs come from :func:`autopar.capture.step.capture_step` (a whole training step traced on
fake tensors); those meant for GPUs are captured on the CPU and relabelled to ``cuda:0``.
"""

from __future__ import annotations

import operator

import pytest
import torch

from _steps import bn_inputs, bn_step, mlp_inputs
from autopar.bench.workloads import WORKLOADS, w6_train_step
from autopar.capture.fake import relabel_devices
from autopar.capture.step import capture_step
from autopar.cost.model import CostModel
from autopar.ir.graph import Graph, TensorMeta, op_name
from autopar.ir.units import fmt_seconds
from autopar.machine.presets import preset
from autopar.passes.dataparallel import choose
from autopar.passes.shard import NotShardable, even_sizes, shard
from autopar.schedule.place import place

aten = torch.ops.aten


def batch_of(step) -> dict:
    """The W6-style step's batch inputs: x and t (arguments 4 and 5), split along dim 0."""
    return {step.graph.inputs[4]: 0, step.graph.inputs[5]: 0}


def ops_named(g: Graph, name: str) -> list:
    return [n for n in g.ops if op_name(n.op) == name]


def test_even_sizes_put_the_remainder_first():
    assert even_sizes(7, 2) == (4, 3)
    assert even_sizes(8, 3) == (3, 3, 2)
    with pytest.raises(NotShardable, match="batch of 2 into 3"):
        even_sizes(2, 3)


def test_batch_of_seven_over_two_cpu_workers_has_exact_shard_shapes():
    step = capture_step(w6_train_step, mlp_inputs(batch=7))
    s = shard(step.graph, batch_of(step), ["cpu:0", "cpu:1"], bucket_bytes=0)
    assert s.sizes == (4, 3)
    slices = ops_named(s.graph, "aten.slice.Tensor")
    assert [(n.args[0].name, n.args[2:], n.meta.shape) for n in slices] == [
        ("arg4_1", (0, 4), (4, 6)), ("arg4_1", (4, 7), (3, 6)),
        ("arg5_1", (0, 4), (4,)), ("arg5_1", (4, 7), (3,))]
    first_layer = ops_named(s.graph, "aten.addmm")[:2]
    assert [n.meta.shape for n in first_layer] == [(4, 5), (3, 5)]
    assert [s.pins[n] for n in first_layer] == ["cpu:0", "cpu:1"]
    # CPU workers share memory: no replicas, no copies
    assert s.replicas == []
    assert [n.kwargs for n in ops_named(s.graph, "aten._to_copy")] == [
        {"dtype": torch.float32}]  # only the target count's cast
    assert s.unsplit == {}


def test_weight_gradients_are_partial_products_summed_on_home():
    step = capture_step(w6_train_step, mlp_inputs(batch=8))
    s = shard(step.graph, batch_of(step), ["cpu:0", "cpu:1"],
              bucket_bytes=0)
    sums = ops_named(s.graph, "aten.add.Tensor")
    # loss sum, then dW2, db2, dW1, db1: one add of two partials each
    shapes = [n.meta.shape for n in sums]
    assert shapes == [(), (3, 5), (1, 3), (5, 6), (1, 5)]
    for n in sums:
        a, b = n.args
        assert {s.pins[a], s.pins[b]} == {"cpu:0", "cpu:1"}
        assert op_name(a.op) in ("aten.mm", "aten.sum.dim_IntList", "getitem")


def test_mean_loss_is_the_sum_of_shard_sums_over_the_total_weight():
    step = capture_step(w6_train_step, mlp_inputs(batch=7))
    s = shard(step.graph, batch_of(step), ["cpu:0", "cpu:1"])
    nll = ops_named(s.graph, "aten.nll_loss_forward")
    assert [n.args[3] for n in nll] == [2, 2]  # per shard: reduction=sum
    (div,) = ops_named(s.graph, "aten.div.Tensor")
    total, weight = div.args
    assert [op_name(a.op) for a in total.args] == ["getitem", "getitem"]
    # the total weight counts the targets not ignored, from the whole targets alone, where
    # they are (the home device: never a copy of them to the host on the launching thread)
    assert op_name(weight.op) == "aten._to_copy" and s.pins[weight] == s.devices[0]
    (count,) = weight.args
    (kept,) = count.args
    assert op_name(kept.op) == "aten.ne.Scalar" and kept.args == (s.graph.inputs[5], -100)
    backward = ops_named(s.graph, "aten.nll_loss_backward")
    assert [n.args[6] for n in backward] == [weight, weight]
    assert [n.args[4] for n in backward] == [1, 1]  # each shard's rows with the global mean


def test_sharded_graph_computes_what_the_original_does():
    """Run both graphs op by op (one device) and compare every output."""
    from autopar.runtime import SequentialRunner

    inputs = mlp_inputs(batch=7)
    step = capture_step(w6_train_step, inputs)
    s = shard(step.graph, batch_of(step), ["cpu:0", "cpu:1"], sizes=(2, 5))
    args = [t.detach() for t in inputs]
    want = SequentialRunner(step.graph)(args)
    got = SequentialRunner(s.graph)(args)
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_relabelled_code_keeps_what_eager_keeps_on_the_host():
    """relabel_devices' ``keep``: a kept input (a step count) and what is computed from it
    alone stay on the host; a value mixing it with a moved one, and a factory, move."""
    g = Graph("steps")
    count = g.input(TensorMeta.make((), device="cpu"), "count")
    x = g.input(TensorMeta.make((4,), device="cpu"), "x")
    bumped = g.call(aten.add.Tensor, (count, 1), name="bumped")
    scaled = g.call(aten.mul.Tensor, (x, bumped), name="scaled")
    made = g.call(aten.zeros.default, ([4],), {"device": torch.device("cpu")}, name="made")
    g.set_outputs([scaled, made, bumped])
    relabel_devices(g, "cpu", "cuda:0", keep=[count])
    assert {n.name: n.device for n in g.nodes} == {
        "count": "cpu", "x": "cuda:0", "bumped": "cpu", "scaled": "cuda:0", "made": "cuda:0"}
    assert made.kwargs["device"] == torch.device("cuda:0")


def test_on_gpus_parameters_are_replicated_and_gradients_all_reduced():
    step = capture_step(w6_train_step, mlp_inputs(batch=8))
    relabel_devices(step.graph, "cpu", "cuda:0")
    s = shard(step.graph, batch_of(step), ["cuda:0", "cuda:1"], updates=step.updates,
              bucket_bytes=0)
    assert sorted(s.replicas) == [(0, "cuda:1"), (1, "cuda:1"), (2, "cuda:1"), (3, "cuda:1")]
    replicas = s.graph.inputs[6:]
    assert [(n.name, n.device) for n in replicas] == [
        (f"arg{i}_1@cuda:1", "cuda:1") for i, _ in s.replicas]
    # to cuda:1 go the batch halves and partial results, never a whole parameter
    moved = [n.args[0] for n in ops_named(s.graph, "aten._to_copy")
             if n.kwargs.get("device") == torch.device("cuda:1")]
    assert [n.name for n in moved[:2]] == ["arg4_1_s1", "arg5_1_s1"]
    assert all(s.pins.get(n) == "cuda:0" or n.name.endswith("_s1") for n in moved)
    # every gradient is summed on both GPUs, shard 0's partial first on each
    for dev in ("cuda:0", "cuda:1"):
        adds = [n for n in ops_named(s.graph, "aten.add.Tensor") if n.device == dev]
        assert sorted(n.meta.shape for n in adds if n.meta.shape) == [
            (1, 3), (1, 5), (3, 5), (5, 6)]
        for n in adds:
            first = n.args[0].args[0] if op_name(n.args[0].op) == "aten._to_copy" else n.args[0]
            assert first.name.endswith("_s0") or s.pins.get(first) == "cuda:0"
    # the replicas' next values: the update repeated on cuda:1
    assert sorted(s.replica_outputs) == sorted(s.replicas)
    nexts = s.graph.outputs[5:]
    assert [(op_name(n.op), n.device) for n in nexts] == [("aten.sub.Tensor", "cuda:1")] * 4
    assert [n.args[0] for n in nexts] == [s.graph.inputs[6 + k] for k in range(4)]


def test_placement_obeys_the_shard_pins():
    step = capture_step(w6_train_step, mlp_inputs(batch=8))
    relabel_devices(step.graph, "cpu", "cuda:0")
    s = shard(step.graph, batch_of(step), ["cuda:0", "cuda:1"])
    cost = CostModel(preset("h200x2"))
    placed = place(s.graph, cost, pins=s.pins)
    assert {n: placed.device[n] for n in s.pins} == s.pins
    single = place(s.graph, cost, policy="single", pins=s.pins)
    assert {n: single.device[n] for n in s.pins} == s.pins


def test_place_rejects_pins_to_devices_the_machine_lacks():
    step = capture_step(w6_train_step, mlp_inputs(batch=8))
    node = step.graph.ops[0]
    with pytest.raises(ValueError, match=r"pins name devices \['cuda:7'\]"):
        place(step.graph, CostModel(preset("h200x2")), pins={node: "cuda:7"})


def test_batch_norm_is_split_with_the_whole_batchs_statistics():
    """As SyncBatchNorm: per-shard sums reduced to the batch's mean, then centred squares to
    its variance; no shard normalizes with its own statistics, nothing is gathered."""
    step = capture_step(bn_step, bn_inputs())
    s = shard(step.graph, {step.graph.inputs[3]: 0}, ["cpu:0", "cpu:1"])
    assert not any("batch_norm" in name for name in s.unsplit)
    norms = [n for n in s.graph.ops if "batch_norm" in op_name(n.op)]
    assert norms and all(n in s.pins for n in norms)  # one per shard, none on the whole batch
    # each shard normalizes with the batch's statistics (eval form) and its backward kernel
    # makes only the per-shard sums (weight and bias gradients)
    assert all(n.args[5] is False or n.args[9] == [False, True, True] for n in norms)
    assert not any(op_name(n.op) == "aten.cat" and n.meta.shape[:1] == (7,)
                   for n in s.graph.ops)  # no gather of the batch
    bn = next(n for n in step.graph.ops if "batch_norm" in op_name(n.op))  # the forward's
    stats = [n for n in s.graph.ops if n.name.startswith(f"{bn.name}_vm")]
    assert [s.pins[n] for n in stats] == ["cpu:0", "cpu:1"]
    assert [n.args[0].meta.shape for n in stats] == [(4, 4), (3, 4)]  # each shard's rows
    mean = next(n for n in s.graph.ops if n.name == f"{bn.name}_mean64_s0")
    assert op_name(mean.op) == "aten.div.Tensor" and mean.args[1] == 7  # the whole batch
    assert mean.meta.dtype == torch.float64  # the shards' statistics combined in float64


def test_non_functional_graphs_and_bad_batches_are_refused():
    g = Graph("inplace")
    x = g.input(TensorMeta.make((4, 2)), "x")
    y = g.input(TensorMeta.make((4, 2)), "y")
    g.set_outputs([g.call(aten.add_.Tensor, (x, y))])
    with pytest.raises(NotShardable, match="writes %x in place"):
        shard(g, {y: 0}, ["cpu:0", "cpu:1"])
    step = capture_step(w6_train_step, mlp_inputs(batch=8))
    with pytest.raises(NotShardable, match="disagree on the batch size"):
        shard(step.graph, {step.graph.inputs[4]: 0, step.graph.inputs[0]: 0},
              ["cpu:0", "cpu:1"])
    with pytest.raises(NotShardable, match="sizes"):
        shard(step.graph, batch_of(step), ["cpu:0", "cpu:1"], sizes=(8, 0))


def test_cost_model_splits_w6_over_two_h200s_and_not_a_tiny_batch():
    """Predictions on the h200x2 preset (deterministic numbers, no timing)."""
    from autopar.bench.workloads import _w6_inputs

    cost = CostModel(preset("h200x2"))
    devices = [d.name for d in cost.machine.devices]
    big = capture_step(w6_train_step, _w6_inputs(["cpu"], "full"))
    relabel_devices(big.graph, "cpu", "cuda:0")
    choice = choose(big, batch_of(big), cost, devices)
    assert choice.sharded is not None and choice.sharded.devices == ("cuda:0", "cuda:1")
    assert choice.placement.predicted_s < 0.6 * choice.predicted["unsplit"]
    # dW1's 128 MB partial sum reduced in row chunks, or at once: the faster predicted runs
    assert set(choice.predicted) == {"unsplit", "cuda:0,cuda:1", "cuda:0,cuda:1 at once"}
    assert choice.predicted[choice.label] == min(choice.predicted.values())
    chunked = bool([n for n in choice.sharded.graph.ops if op_name(n.op) == "aten.cat.default"])
    p = choice.predicted
    assert chunked == (p["cuda:0,cuda:1"] < p["cuda:0,cuda:1 at once"])
    assert sorted(choice.sharded.replica_outputs) == [(i, "cuda:1") for i in range(4)]
    tiny = capture_step(w6_train_step, mlp_inputs(batch=8))
    relabel_devices(tiny.graph, "cpu", "cuda:0")
    choice = choose(tiny, batch_of(tiny), cost, devices)
    assert choice.sharded is None and set(choice.predicted) == {"unsplit", "cuda:0,cuda:1"}


def test_a_split_whose_launches_alone_exceed_the_fastest_is_not_placed():
    """On h200x8 a tiny batch's step is launch-bound: once a split over two GPUs is placed, a
    split over more devices (more launches on the one issuing thread) whose launches alone,
    at the pair's seconds per op, exceed the fastest candidate is not placed, and says why."""
    cost = CostModel(preset("h200x8"))
    devices = [d.name for d in cost.machine.devices]
    tiny = capture_step(w6_train_step, mlp_inputs(batch=8))
    relabel_devices(tiny.graph, "cpu", "cuda:0")
    choice = choose(tiny, batch_of(tiny), cost, devices)
    assert choice.sharded is None
    assert set(choice.predicted) == {"unsplit", "cuda:0,cuda:1"}
    assert list(choice.pruned) == ["cuda:0,cuda:1,cuda:2,cuda:3"]
    assert "its launches alone, about" in choice.pruned["cuda:0,cuda:1,cuda:2,cuda:3"]
    forced = choose(tiny, batch_of(tiny), cost, devices, shards=4)  # the estimate's a floor
    issue = forced.predicted["cuda:0,cuda:1,cuda:2,cuda:3"]
    assert issue > min(choice.predicted.values())
    assert not forced.pruned


def test_once_a_split_pays_the_largest_is_placed_next_and_a_share_too_slow_is_not():
    """W6 at full size on h200x8: two GPUs beat unsplit, so all eight are placed next; four
    are then not placed, their share of the unsplit prediction (1/4 of it) already slower
    than eight's prediction, and forced they predict slower still (the share is a floor)."""
    from autopar.bench.workloads import _w6_inputs

    cost = CostModel(preset("h200x8"))
    devices = [d.name for d in cost.machine.devices]
    big = capture_step(w6_train_step, _w6_inputs(["cpu"], "full"))
    relabel_devices(big.graph, "cpu", "cuda:0")
    choice = choose(big, batch_of(big), cost, devices)
    gpus = [d for d in devices if d.startswith("cuda")]
    four, eight = ",".join(gpus[:4]), ",".join(gpus)
    assert list(choice.predicted) == ["unsplit", "cuda:0,cuda:1", eight]
    assert choice.label == eight and list(choice.pruned) == [four]
    assert "its share of the unsplit prediction (1/4 of" in choice.pruned[four]
    share = choice.predicted["unsplit"] / 4
    assert share >= choice.predicted[eight]
    # explain's line: the issuing thread's seconds and the busiest lane's, the kept
    # prediction at least either
    assert 0 < choice.issue_s <= choice.predicted[eight]
    assert choice.bound().startswith(f"of its {fmt_seconds(choice.predicted[eight])}: "
                                     "the issuing thread ")
    assert "the busiest lane (cuda:" in choice.bound()
    forced = choose(big, batch_of(big), cost, devices, shards=4).predicted[four]
    assert forced >= share


def test_the_at_once_form_is_placed_only_where_the_chunked_one_is_near_the_fastest(
        monkeypatch):
    """The pair's form with every sum reduced at once is a second placement of the same
    split: placed only where the chunked form is predicted within AT_ONCE_SLACK of the
    fastest candidate (the W6 step on h200x2 above is; with no slack it is not)."""
    from autopar.bench.workloads import _w6_inputs
    from autopar.passes import dataparallel

    cost = CostModel(preset("h200x2"))
    devices = [d.name for d in cost.machine.devices]
    big = capture_step(w6_train_step, _w6_inputs(["cpu"], "full"))
    relabel_devices(big.graph, "cpu", "cuda:0")
    monkeypatch.setattr(dataparallel, "AT_ONCE_SLACK", -0.5)
    choice = choose(big, batch_of(big), cost, devices)
    assert set(choice.predicted) == {"unsplit", "cuda:0,cuda:1"}
    assert choice.sharded is not None and choice.sharded.reduced_in_chunks


def test_capture_step_outputs_loss_then_grads_then_updates():
    def no_update(w, x):
        loss = (x @ w).square().mean()
        loss.backward()
        return loss.detach()

    w = torch.randn(3, 2, requires_grad=True)
    step = capture_step(no_update, (w, torch.randn(5, 3)))
    assert (step.n_outputs, step.grads, step.mutated, step.params) == (1, [0], [], [0])
    assert w.grad is None  # tracing ran on fake tensors
    step = capture_step(w6_train_step, mlp_inputs())
    assert (step.n_outputs, step.grads, step.mutated) == (1, [], [0, 1, 2, 3])
    assert all(op_name(n.op) != "aten.copy_" for n in step.graph.ops)
    assert [o.op for o in step.graph.outputs[:1]] != [operator.getitem]


def test_gpu_sharded_graph_run_on_the_cpu_gives_eager_values_and_identical_replicas():
    """The two-GPU graph's arithmetic, run op by op with both GPUs relabelled to the host."""
    from autopar.runtime import SequentialRunner

    inputs = mlp_inputs(batch=9)
    step = capture_step(w6_train_step, inputs)
    want = SequentialRunner(step.graph)([t.detach() for t in inputs])
    relabel_devices(step.graph, "cpu", "cuda:0")
    s = shard(step.graph, batch_of(step), ["cuda:0", "cuda:1"], updates=step.updates)
    run_on_the_cpu_like_eager(s, step, inputs, want)


def test_benchmark_simulation_of_w6_goes_through_the_data_parallel_pass():
    """W6 at full size on the h200x2 preset: the predicted speed-up meets the goal (1.8x)."""
    from autopar.bench import harness as bench
    from autopar.bench.workloads import WORKLOADS

    sim, timeline = bench.simulate(WORKLOADS["W6"], "h200x2")
    assert sim.error is None and sim.speedup >= 1.8
    assert {"cuda:0/compute", "cuda:1/compute"} <= set(timeline.lanes())


@pytest.fixture
def small_chunks(monkeypatch):
    """Partial sums over 48 bytes reduced in row chunks of about 48 bytes, at most 2 (as
    W6's 128 MB dW1 is at full size): dW1 (5 x 6 floats, 120 bytes) in 2, dW2 (3 x 5) too."""
    import autopar.passes.shard as mod

    monkeypatch.setattr(mod, "REDUCE_CHUNK_BYTES", 48)
    monkeypatch.setattr(mod, "MAX_REDUCE_CHUNKS", 2)


def test_big_partial_sums_are_made_and_all_reduced_in_row_chunks(small_chunks):
    """dW1 becomes per shard 2 mm of row slices (3 and 2 rows), each chunk's partials summed
    on both GPUs, shard 0's first, and one cat of the sums per GPU; the arithmetic gives
    eager's values and the replicas the same bits as home."""
    from autopar.runtime import SequentialRunner

    inputs = mlp_inputs(batch=9)
    step = capture_step(w6_train_step, inputs)
    want = SequentialRunner(step.graph)([t.detach() for t in inputs])
    relabel_devices(step.graph, "cpu", "cuda:0")
    s = shard(step.graph, batch_of(step), ["cuda:0", "cuda:1"], updates=step.updates,
              bucket_bytes=0)
    assert s.reduced_in_chunks == 2  # dW1 and dW2
    chunks = [n for n in ops_named(s.graph, "aten.mm") if n.name.startswith("mm_2_c")]
    assert sorted((n.name, n.meta.shape, n.device) for n in chunks) == sorted(
        (f"mm_2_c{c}_s{i}", (rows, 6), f"cuda:{i}") for c, rows in enumerate((3, 2))
        for i in (0, 1))
    for n in chunks:  # each a row slice of the shard's activation-gradient^T
        (rows_of, _) = n.args
        assert op_name(rows_of.op) == "aten.slice.Tensor" and rows_of.device == n.device
    for dev in ("cuda:0", "cuda:1"):
        cats = [n for n in ops_named(s.graph, "aten.cat") if n.device == dev]
        assert sorted(n.meta.shape for n in cats) == [(3, 5), (5, 6)]  # dW2, dW1
        (cat,) = [n for n in cats if n.meta.shape == (5, 6)]
        parts, dim = cat.args
        assert dim == 0 and [p.meta.shape for p in parts] == [(3, 6), (2, 6)]
        for p in parts:  # shard 0's chunk + shard 1's, added on this GPU
            assert op_name(p.op) == "aten.add.Tensor" and p.device == dev
            first = p.args[0].args[0] if op_name(p.args[0].op) == "aten._to_copy" else p.args[0]
            assert first.name.endswith("_s0")
    run_on_the_cpu_like_eager(s, step, inputs, want)


def test_small_partial_sums_are_reduced_at_once():
    step = capture_step(w6_train_step, mlp_inputs(batch=9))
    s = shard(step.graph, batch_of(step), ["cpu:0", "cpu:1"], bucket_bytes=0)
    assert not ops_named(s.graph, "aten.cat") and not ops_named(s.graph, "aten.slice.Tensor")[4:]
    assert s.reduced_in_chunks == 0


def run_on_the_cpu_like_eager(s, step, inputs, want) -> None:
    """Run the GPUs' sharded graph op by op with every GPU relabelled to the host: eager's
    values, and each replica's next value the same bits as home's (all-reduced)."""
    from autopar.runtime import SequentialRunner

    for dev in s.devices:
        relabel_devices(s.graph, dev, "cpu")
    args = [t.detach() for t in inputs]
    got = SequentialRunner(s.graph)(args + [args[j].clone() for j, _ in s.replicas])
    for g, w in zip(got[:5], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    updated = dict(zip(step.mutated, got[1:5]))
    for (j, _), replica in zip(s.replica_outputs, got[5:], strict=True):
        assert torch.equal(replica, updated[j])


def test_big_sums_over_more_than_two_gpus_are_reduced_scattered():
    """Three GPUs without collectives: dW1 (1024 x 1024, 4 MB) is summed in row chunks, chunk
    c on cuda:c from the three shards' slices, and each GPU gathers the chunks from their
    owners; no GPU receives a whole partial. Two GPUs keep the all-to-all form."""
    step = capture_step(w6_train_step, mlp_inputs(batch=12, d_in=1024, hidden=1024, classes=3))
    relabel_devices(step.graph, "cpu", "cuda:0")
    gpus = ["cuda:0", "cuda:1", "cuda:2"]
    s = shard(step.graph, batch_of(step), gpus, updates=step.updates, bucket_bytes=0,
              collectives=False)
    ops = [n for n in s.graph.ops if isinstance(n.meta, TensorMeta)]
    chunk_adds = [n for n in ops if op_name(n.op) == "aten.add.Tensor"
                  and n.meta.shape in ((342, 1024), (341, 1024))]
    assert sorted({s.pins[n] for n in chunk_adds}) == gpus  # each GPU owns a chunk
    moved = [n for n in ops if op_name(n.op) == "aten._to_copy"
             and n.meta.shape[-1:] == (1024,) and n.meta.shape[0] > 12]
    assert moved and all(n.meta.shape[0] <= 342 for n in moved)  # slices move, not partials
    two = shard(step.graph, batch_of(step), gpus[:2], updates=step.updates)
    assert not any(isinstance(n.meta, TensorMeta) and n.meta.shape == (512, 1024)
                   and op_name(n.op) == "aten.add.Tensor" for n in two.graph.ops)


def test_small_gradients_are_reduced_in_one_bucket():
    """W6's four gradients (each far below a bucket) are flattened and concatenated per shard
    and reduced once; each gradient is a view of the bucket's sum. With buckets off, one
    reduction per gradient."""
    step = capture_step(w6_train_step, mlp_inputs(batch=8))
    s = shard(step.graph, batch_of(step), ["cpu:0", "cpu:1"], updates=step.updates)
    cats = [n for n in s.graph.ops if op_name(n.op) == "aten.cat" and n in s.pins]
    assert sorted(s.pins[n] for n in cats) == ["cpu:0", "cpu:1"]
    sizes = {5 * 6, 5, 3 * 5, 3}  # w1, b1, w2, b2
    assert cats[0].meta.shape == (sum(sizes),)
    adds = [n for n in s.graph.ops if op_name(n.op) == "aten.add.Tensor"
            and n.args[0] is not None and getattr(n.args[0], "meta", None) is not None
            and n.args[0].meta.shape == (sum(sizes),)]
    assert len(adds) == 1  # the bucket's one reduction
    alone = shard(step.graph, batch_of(step), ["cpu:0", "cpu:1"], updates=step.updates,
                  bucket_bytes=0)
    assert not any(op_name(n.op) == "aten.cat" and n in alone.pins for n in alone.graph.ops)


def test_a_split_that_would_not_fit_a_gpus_memory_is_not_chosen():
    """W6 at full size splits over h200x2's GPUs; with cuda:1 given 100 MB (less than the
    replica of w1 alone), the split is refused with the reason and the step stays unsplit."""
    import dataclasses

    from autopar.dataparallel import predict_step
    from autopar.machine.model import GiB

    w = WORKLOADS["W6"]
    full = preset("h200x2")
    got = predict_step(w.eager, w.make_inputs(("cpu",), "full"), full)
    assert got.choice.sharded is not None and not got.choice.refused
    gpu1 = dataclasses.replace(full.profile.devices["cuda:1"], memory_bytes=int(0.1 * GiB))
    small = dataclasses.replace(full, profile=dataclasses.replace(
        full.profile, devices={**full.profile.devices, "cuda:1": gpu1}))
    got = predict_step(w.eager, w.make_inputs(("cpu",), "full"), small)
    assert got.choice.sharded is None
    (why,) = [v for k, v in got.choice.refused.items() if k.startswith("cuda:0,cuda:1")][:1]
    assert "on cuda:1, which has 0.10 GiB" in why


def test_capture_step_drops_what_nothing_reads_but_keeps_random_draws():
    """Dead ops (batch norm's eval form returns empty statistics) leave the step; a random
    draw nothing reads stays, since eager's generator advances by it."""
    def step(x):
        x * 3  # nothing reads it
        torch.empty(5)
        torch.rand(2)
        return x + 1

    ops = [op_name(n.op) for n in capture_step(step, (torch.randn(4),)).graph.ops]
    assert "aten.mul.Tensor" not in ops and not any("empty" in o for o in ops)
    assert "aten.rand" in ops and "aten.add.Tensor" in ops


def test_on_gpus_batch_norms_factors_are_made_on_each_gpu_from_the_sums():
    """Over two GPUs, each GPU makes the batch's mean and ``invstd`` (and backward's
    per-channel factors) from the reduced sums and its parameter replicas, as home does,
    instead of receiving them: nothing but the batch's rows, the loss's parts and the sums'
    partials crosses, each direction's pair of sums as one value; the step equals eager with
    the replicas' bits home's."""
    from autopar.runtime import SequentialRunner

    inputs = bn_inputs(batch=9)
    step = capture_step(bn_step, inputs)
    want = SequentialRunner(step.graph)([t.detach() for t in inputs])
    relabel_devices(step.graph, "cpu", "cuda:0")
    s = shard(step.graph, {step.graph.inputs[3]: 0}, ["cuda:0", "cuda:1"],
              updates=step.updates)
    # cuda:1's ops read only what is on cuda:1 (the pass's own moves bring the rest): no
    # value of home's is read across, which the plan would copy every step
    far = [(n, v) for n in s.graph.ops if s.pins.get(n) == "cuda:1"
           and op_name(n.op) != "aten._to_copy"
           for v in n.inputs if v.device not in (None, "cuda:1")]
    assert not far
    # each direction's two per-channel sums (mean and mean square; Σdy·x̂ and Σdy) cross as
    # one value: home's partial pair, concatenated
    moved = [n.args[0].name for n in ops_named(s.graph, "aten._to_copy")
             if n.kwargs.get("device") == torch.device("cuda:1")
             and op_name(n.args[0].op) == "aten.cat" and n.args[0].meta.shape == (8,)]
    assert sorted(moved) == ["_native_batch_norm_legit_moments_0_s0",
                             "native_batch_norm_backward_dsums_0_s0"]
    for dev in s.devices:
        relabel_devices(s.graph, dev, "cpu")
    args = [t.detach() for t in inputs]
    got = SequentialRunner(s.graph)(args + [args[j].clone() for j, _ in s.replicas])
    for g, w in zip(got[:len(want)], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    updated = dict(zip(step.mutated, got[1:len(want)]))
    for (j, _), replica in zip(s.replica_outputs, got[len(want):], strict=True):
        assert torch.equal(replica, updated[j])
