"""Fusion of a device's regions by Inductor: which ops form regions, and results equal eager.

Inductor compiles take seconds on a CPU: the tests that compile share one graph each and the
corpus runs with fusion only under AUTOPAR_SLOW=1 (tests/test_corpus.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

import autopar
from _fakes import FakeCost, by_hand, machine, w4
from autopar.cost.model import CostModel
from autopar.ir.graph import Graph, Node, TensorMeta
from autopar.ir.routing import GraphIndex
from autopar.machine.host import cpu_fusion_unavailable
from autopar.machine.presets import preset
from autopar.passes.fusion import (
    fused_regions,
    fusible,
    fusion_devices,
    prefer_fused,
    regions,
    regions_to_fuse,
)
from autopar.runtime import Executor, SequentialRunner
from autopar.runtime import fuse as fuse_module
from autopar.runtime.fuse import Fused, FusedKernel, build_gm, fuse_program
from autopar.schedule.place import Placement, place
from autopar.schedule.plan import make_plan
from autopar.schedule.steps import Free, Record, Send, Wait
from corpus import autopar_compile, case, run_case

aten = torch.ops.aten
needs_cxx = pytest.mark.skipif(cpu_fusion_unavailable() is not None,
                               reason=f"{cpu_fusion_unavailable()}")


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel(preset("cpu-only", cpu_workers=2))


def mixed() -> Graph:
    """Two pointwise ops, an escaping view, a lone exp, a random op, then mul/sum/neg.

        x -> a=mul -> b=add -> v=view ............... out
                      b -> c=exp -> d=rand_like
                           c, d -> e=mul -> f=sum -> g=neg -> out
    """
    g = Graph("mixed")
    x = g.input(TensorMeta.make((4, 4)), "x")
    a = g.call(aten.mul.Tensor, (x, 2.0), name="a")
    b = g.call(aten.add.Tensor, (a, 1.0), name="b")
    v = g.call(aten.view.default, (b, [16]), name="v")
    c = g.call(aten.exp.default, (b,), name="c")
    d = g.call(aten.rand_like.default, (c,), name="d")
    e = g.call(aten.mul.Tensor, (c, d), name="e")
    f = g.call(aten.sum.default, (e,), name="f")
    out = g.call(aten.neg.default, (f,), name="g")
    g.set_outputs([v, out])
    return g


def names(groups: list[list[Node]]) -> list[list[str]]:
    return [[n.name for n in g] for g in groups]


def program_regions(graph: Graph, placement: Placement, device: str, cost) -> list[list[str]]:
    plan = make_plan(placement, cost)
    ix = GraphIndex.of(graph)
    ok = lambda n: fusible(n, device, lambda v: True, placement.device)  # noqa: E731
    return names(regions(plan.programs[device], ok, ix.users, set(graph.output_nodes)))


def test_regions_skip_escaping_views_random_ops_and_lone_ops(cost):
    """The view of ``b`` escapes (an output) so it runs plain; ``rand_like`` is never fused;
    ``exp`` alone between them does not pay."""
    g = mixed()
    assert program_regions(g, by_hand(g, {}), "cpu:0", cost) == [["a", "b"], ["e", "f", "g"]]


def test_regions_end_at_cross_device_points(cost):
    """``c`` on cpu:1: cpu:0 records ``b`` for it and waits for ``c``: a region never spans
    a Record or a Wait; the view still runs plain."""
    g = mixed()
    placement = by_hand(g, {"c": "cpu:1"})
    steps = make_plan(placement, cost).programs["cpu:0"]
    kinds = [type(s).__name__ for s in steps if not isinstance(s, Free)]
    assert kinds == ["Run", "Run", "Record", "Run", "Wait", "Run", "Run", "Run", "Run"]
    assert program_regions(g, placement, "cpu:0", cost) == [["a", "b"], ["e", "f", "g"]]


def test_mutations_and_lone_matmuls_are_not_fused(cost):
    """x -> mm -> relu -> copy_ into x: the copy_ writes, and mm + relu has one pointwise op."""
    g = Graph("mutating")
    x = g.input(TensorMeta.make((4, 4)), "x")
    m = g.call(aten.mm.default, (x, x), name="m")
    r = g.call(aten.relu.default, (m,), name="r")
    t = g.call(aten.tanh.default, (r,), name="t")
    w = g.call(aten.copy_.default, (x, t), name="w")
    g.set_outputs([w])
    assert program_regions(g, by_hand(g, {}), "cpu:0", cost) == [["m", "r", "t"]]
    g2 = Graph("lone")
    y = g2.input(TensorMeta.make((4, 4)), "y")
    g2.set_outputs([g2.call(aten.relu.default, (g2.call(aten.mm.default, (y, y)),))])
    assert program_regions(g2, by_hand(g2, {}), "cpu:0", cost) == []


def test_fuse_program_keeps_frees_of_outside_values_and_drops_internal_ones(cost):
    g = mixed()
    placement = by_hand(g, {})
    plan = make_plan(placement, cost)
    ix, outputs = GraphIndex.of(g), set(g.output_nodes)
    found = regions(plan.programs["cpu:0"],
                    lambda n: fusible(n, "cpu:0", lambda v: True, placement.device), ix.users,
                    outputs)
    steps = fuse_program("cpu:0", plan.programs["cpu:0"], found, ix, outputs)
    shown = [f"fused {[n.name for n in s.nodes]} -> {[n.name for n in s.outputs]}"
             if isinstance(s, Fused) else f"{type(s).__name__.lower()} {s.value.name}"
             if isinstance(s, Free) else f"run {s.node.name}" for s in steps]
    assert shown == ["fused ['a', 'b'] -> ['b']", "run v", "run c", "free b", "run d",
                     "fused ['e', 'f', 'g'] -> ['g']", "free c", "free d"]
    assert not any(isinstance(s, Send | Record | Wait) for s in steps)


def test_fusion_devices_by_option():
    devices = ["cpu:0", "cuda:0", "cuda:1"]
    assert fusion_devices(devices, False) == []
    assert fusion_devices(devices, "auto") == ["cuda:0", "cuda:1"]
    expect = devices if cpu_fusion_unavailable() is None else devices[1:]
    assert fusion_devices(devices, True) == expect


def test_fuse_false_leaves_the_programs_as_they_were(cost):
    g = mixed()
    plan = make_plan(by_hand(g, {"c": "cpu:1"}), cost)
    assert Executor(plan, fuse=regions_to_fuse(plan, False)).source() == Executor(plan).source()
    auto = Executor(plan, fuse=regions_to_fuse(plan, "auto"))
    assert "fused" not in auto.source()  # no GPU here: nothing fused


def test_options_validate_fuse_and_cuda_graphs():
    with pytest.raises(ValueError, match="fuse must be 'auto', True or False, not 'yes'"):
        autopar.compile(lambda x: x, fuse="yes")
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        autopar.compile(lambda x: x, cuda_graphs=1)


def pointwise_graph() -> Graph:
    """Two workers: cpu:1 computes ``c`` between two regions of cpu:0.

        x -> a=mul -> b=add -> c=exp (cpu:1) -> e=mul(c, b) -> f=sum -> out
                              b ............... /             e -> out
    """
    g = Graph("two_regions")
    x = g.input(TensorMeta.make((8, 8)), "x")
    a = g.call(aten.mul.Tensor, (x, 0.5), name="a")
    b = g.call(aten.add.Tensor, (a, 1.0), name="b")
    c = g.call(aten.exp.default, (b,), name="c")
    e = g.call(aten.mul.Tensor, (c, b), name="e")
    f = g.call(aten.sum.dim_IntList, (e, [1]), name="f")
    g.set_outputs([f, e])
    return g


@needs_cxx
def test_fused_regions_on_two_workers_equal_sequential(cost, caplog, monkeypatch):
    g = pointwise_graph()
    plan = make_plan(by_hand(g, {"c": "cpu:1"}), cost)
    ex = Executor(plan, fuse=regions_to_fuse(plan, True))
    assert [[n.name for n in f.nodes] for f in ex.fused] == [["a", "b"], ["e", "f"]]
    x = torch.randn(8, 8)
    with caplog.at_level(logging.INFO, logger="autopar"):
        got = ex([x])
    want = SequentialRunner(g)([x])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert [f.kernel.status for f in ex.fused] == ["compiled", "compiled"]
    assert all(f.kernel.compile_s > 0 for f in ex.fused)
    assert sum("compiled fused region" in r.getMessage() for r in caplog.records) == 2
    again = ex([x * 2])  # compiled once: the second call reuses it
    torch.testing.assert_close(again[0], SequentialRunner(g)([x * 2])[0])
    def unused(gm, inputs):
        raise AssertionError("compiled twice")

    monkeypatch.setattr(fuse_module, "_inductor", unused)
    same = Executor(plan, fuse=regions_to_fuse(plan, True))  # served by the cache
    same([x])
    assert [f.kernel.status for f in same.fused] == ["compiled", "compiled"]


def test_a_failed_compile_runs_the_region_op_by_op(cost, monkeypatch, caplog):
    def broken(gm, inputs):
        raise RuntimeError("no compiler today\nsecond line")

    monkeypatch.setattr(fuse_module, "_inductor", broken)
    monkeypatch.setattr(fuse_module, "_CACHE", {})  # not the region an earlier test compiled
    g = pointwise_graph()
    plan = make_plan(by_hand(g, {"c": "cpu:1"}), cost)
    ex = Executor(plan, fuse=regions_to_fuse(plan, True))
    x = torch.randn(8, 8)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        for _ in range(2):
            for a, b in zip(ex([x]), SequentialRunner(g)([x])):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [f.kernel.status for f in ex.fused] == ["fallback", "fallback"]
    assert ex.fused[0].kernel.reason == "Inductor failed: RuntimeError: no compiler today"
    assert sum("runs op by op" in r.getMessage() for r in caplog.records) == 2  # once each


def test_inputs_of_another_layout_run_op_by_op(monkeypatch):
    """Inductor's code checks strides; when they changed, the region runs op by op."""
    def strict(gm, inputs):
        want = [t.stride() for t in inputs]

        def run(args):
            assert [t.stride() for t in args] == want, "stride changed"
            return tuple(gm(*args))
        return run

    monkeypatch.setattr(fuse_module, "_inductor", strict)
    monkeypatch.setattr(fuse_module, "_CACHE", {})
    g = Graph("layout")
    x = g.input(TensorMeta.make((3, 5)), "x")
    a = g.call(aten.mul.Tensor, (x, 3.0))
    b = g.call(aten.sub.Tensor, (a, x))
    kernel = FusedKernel(build_gm([a, b], [x], [b], "cpu:0"), "cpu:0", "test region")
    y = torch.randn(3, 5)
    torch.testing.assert_close(kernel([y])[0], y * 2)
    assert kernel.status == "compiled"
    z = torch.randn(5, 3).t()
    torch.testing.assert_close(kernel([z])[0], z * 2)
    assert kernel.status == "fallback" and "layout changed" in kernel.reason


@needs_cxx
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", ["mutate_then_use", "returns_views_of_intermediate"])
def test_corpus_cases_with_fusion(name):
    """Mutation and aliasing through autopar.compile with fusion on the host (the whole corpus
    runs so under AUTOPAR_SLOW=1)."""
    run_case(case(name), autopar_compile(devices="cpu:0", fuse=True))


# -- fusion-aware placement -------------------------------------------------------------------
def tiny_chain(n: int = 100) -> Graph:
    """x (64 floats on cuda:0) -> (mul -> add) * n -> out: tiny ops HEFT prices one by one."""
    g = Graph("tiny_chain")
    x = g.input(TensorMeta.make((64,), device="cuda:0"), "x")
    for _ in range(n):
        x = g.call(aten.add.Tensor, (g.call(aten.mul.Tensor, (x, 1.0001)), 0.001))
    g.set_outputs([x])
    return g


@pytest.fixture(scope="module")
def h200x2() -> CostModel:
    return CostModel(preset("h200x2"))


def placed_on(plan) -> set[str]:
    return {plan.placement.device[n] for n in plan.graph.ops}


def test_a_tiny_chain_stays_on_its_gpu_when_fused():
    """HEFT moves 200 tiny ops to the host (each cheaper there than a launch; the preset's copies
    here cost the link's time alone); fused on cuda:0 they are one kernel, predicted faster, so
    eager's placement is kept."""
    m = preset("h200x2")
    h200x2 = CostModel(dataclasses.replace(
        m, profile=dataclasses.replace(m.profile, crossing_s=0.0)))
    g = tiny_chain()
    devices = tuple(d.name for d in h200x2.machine.devices)
    heft = make_plan(place(g, h200x2, devices=devices), h200x2)
    assert placed_on(heft) <= {"cpu:0", "cpu:1"}
    chosen = prefer_fused(heft, g, h200x2, devices, ["cuda:0", "cuda:1"])
    assert placed_on(chosen) == {"cuda:0"}
    assert [len(r) for r in fused_regions(chosen, ["cuda:0"])["cuda:0"]] == [200]
    assert prefer_fused(heft, g, h200x2, devices, []) is heft  # no fusion: HEFT as it was


def test_big_matmuls_keep_their_heft_plan_on_two_gpus(h200x2):
    g = w4(n=6, side=4000)
    devices = tuple(d.name for d in h200x2.machine.devices)
    heft = make_plan(place(g, h200x2, devices=devices), h200x2)
    assert placed_on(heft) == {"cuda:0", "cuda:1"}
    assert prefer_fused(heft, g, h200x2, devices, ["cuda:0", "cuda:1"]) is heft


def test_regions_with_ops_inductor_decomposes_compile():
    """``t``, ``flip`` and ``linalg_vector_norm`` have decompositions and no lowering of their
    own: the region is decomposed with Inductor's table first, as aot_autograd does."""
    from autopar.api import Options, Runner
    from autopar.capture.dynamo import make_backend

    def f(x, y):
        a = (x.t() + 1.0) * 2.0
        b = torch.flip(y, [0]).relu() / 3.0
        n = torch.linalg.vector_norm(a, dim=1, keepdim=True).clamp_min(1e-6)
        return a / n, b

    runner = Runner(Options.parse({"devices": "cpu:0", "fuse": True}))
    g = torch.compile(f, backend=make_backend(runner), dynamic=False)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for got, want in zip(g(x, y), f(x, y), strict=True):
        torch.testing.assert_close(got, want)
    (ex,) = runner.executors
    assert ex.fused and [k.kernel.status for k in ex.fused] == ["compiled"] * len(ex.fused)


def whole_chain(x):
    for _ in range(10):
        x = x * 1.01 + 0.5
    return x


@needs_cxx
@pytest.mark.parametrize("with_random", [False, True])
def test_a_graph_that_is_one_region_calls_inductors_function_directly(with_random):
    """One device, one region taking the inputs in order and giving the outputs: the executor
    hands the call to Inductor's function (what ``torch.compile`` runs). A graph with an op
    outside the region (a random op is never fused) needs the program."""
    from autopar.api import Options, Runner
    from autopar.capture.dynamo import make_backend

    def f(x, z):
        y = whole_chain(x) + z
        return y + torch.rand_like(y) * 0 if with_random else y

    runner = Runner(Options.parse({"devices": "cpu:0", "fuse": True}))
    g = torch.compile(f, backend=make_backend(runner), dynamic=False)
    x, z = torch.randn(16), torch.randn(16)
    first, second = g(x, z), g(x, z)
    (ex,) = runner.executors
    assert {k.kernel.status for k in ex.fused} == {"compiled"}
    assert (ex._whole is None) == with_random
    for got in (first, second):
        torch.testing.assert_close(got, f(x, z))


@needs_cxx
def test_the_direct_call_falls_back_to_the_program_when_inductors_function_raises(monkeypatch):
    from autopar.api import Options, Runner
    from autopar.capture.dynamo import make_backend

    runner = Runner(Options.parse({"devices": "cpu:0", "fuse": True}))
    g = torch.compile(whole_chain, backend=make_backend(runner), dynamic=False)
    x = torch.randn(16)
    g(x)
    (ex,) = runner.executors
    assert ex._whole is not None
    calls = []

    def boom(args):
        calls.append(len(args))
        raise RuntimeError("kernel refused")

    monkeypatch.setattr(ex._whole, "_fn", boom)
    # tried directly, then through the program, which raises too; the graph writes nothing,
    # so it runs as eager's sequence: eager's result, and from then on without the plan
    torch.testing.assert_close(g(x), whole_chain(x))
    assert calls == [1, 1]
    torch.testing.assert_close(g(x), whole_chain(x))
    assert calls == [1, 1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_math_is_never_fused(cost, dtype):
    """Inductor rounds float16/bfloat16 intermediates where eager's kernels don't: such ops run
    op by op; a cast up to float32 and the float32 math after it may still be fused."""
    g = Graph("half")
    x = g.input(TensorMeta.make((8, 8), dtype=dtype), "x")
    a = g.call(aten.mul.Tensor, (x, 0.5), name="a")
    b = g.call(aten.add.Tensor, (a, 1.0), name="b")
    c = g.call(aten._to_copy.default, (b,), {"dtype": torch.float32},
               meta=TensorMeta.make((8, 8)), name="c")
    d = g.call(aten.exp.default, (c,), name="d")
    e = g.call(aten.mul.Tensor, (d, 2.0), name="e")
    g.set_outputs([e])
    want = [["a", "b", "c", "d", "e"]] if dtype == torch.float32 else [["d", "e"]]
    assert program_regions(g, by_hand(g, {}), "cpu:0", cost) == want


def test_a_regions_outputs_keep_eagers_strides(monkeypatch):
    """Inductor may lay an output out otherwise than eager (here: a fake compile that returns
    every output contiguous); the region hands on eager's strides, so that a ``view`` or an
    attention kernel's alignment check downstream sees what it sees eagerly (T5 under
    ``fuse=True`` failed with "view size is not compatible" before)."""
    def contiguous(gm, inputs):
        return lambda args: tuple(o.contiguous() for o in gm(*args))

    monkeypatch.setattr(fuse_module, "_inductor", contiguous)
    monkeypatch.setattr(fuse_module, "_CACHE", {})
    g = Graph("strides")
    x = g.input(TensorMeta.make((4, 6)), "x")
    a = g.call(aten.mul.Tensor, (x, 2.0))
    t = g.call(aten.t.default, (a,))
    b = g.call(aten.add.Tensor, (t, 1.0))  # eager: b has t's strides, (1, 6)
    assert b.meta.stride == (1, 6)
    kernel = FusedKernel(build_gm([a, t, b], [x], [b], "cpu:0"), "cpu:0", "test region",
                         [b.meta])
    y = torch.randn(4, 6)
    for _ in range(2):  # found at the first call, applied at every call
        (out,) = kernel([y])
        assert out.stride() == (1, 6)
        torch.testing.assert_close(out, (y * 2).t() + 1)


@needs_cxx
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_fused_region_keeps_the_precision_autocast_gave_its_graph():
    """Under autocast the captured graph already holds autocast's casts; a region compiled
    from it must not be autocast again: a matmul the code ran in float32 (autocast switched
    off around it) stays float32 inside a fused region, as in eager."""
    def fn(x, w):
        h = (x * 2).tanh()
        with torch.autocast("cpu", enabled=False):
            y = h.float() @ w
        return (y + 1).relu()

    x, w = torch.randn(16, 32), torch.randn(32, 16)
    compiled = autopar.compile(fn, devices="cpu:0", fuse=True, candidates=["autopar"])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = fn(x, w)
        got = compiled(x, w)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert autopar.api.dispatcher_of(compiled).runner.executors[0].fused


def test_a_candidate_is_predicted_as_the_executor_runs_it():
    """passes.dataparallel.predicted_run: a chain of four pointwise ops on cuda:0 (1 ms each
    in the table) is 4 ms op by op and one region's 1 ms fused; the calling thread's issue
    time bounds the prediction from below."""
    from autopar.passes.dataparallel import predicted_run

    g = Graph("chain4")
    x = g.input(TensorMeta.make((64,), device="cuda:0"), "x")
    for i in range(4):
        x = g.call(aten.mul.Tensor, (x, 1.5), name=f"m{i}")
    g.set_outputs([x])
    cost = FakeCost(machine(cpus=1, gpus=1), default=1e-3)
    placed = by_hand(g, {f"m{i}": "cuda:0" for i in range(4)})
    _, timeline, predicted, _ = predicted_run(placed, cost, fusing=())
    assert round(timeline.makespan * 1e3, 6) == 4 and round(predicted * 1e3, 6) == 4
    _, timeline, predicted, _ = predicted_run(placed, cost, fusing=["cuda:0"])
    assert round(timeline.makespan * 1e3, 6) == 1 and round(predicted * 1e3, 6) == 1


def test_a_normalization_fuses_with_its_pointwise_neighbours_and_is_priced_as_one_kernel():
    """conv -> eval batch norm -> relu on a GPU: Inductor decomposes the batch norm into
    pointwise ops, so it and the relu form a region (two paying ops; the conv stays a library
    call before it) priced as one kernel (the longer of the two), not as a library call and
    a kernel."""
    from autopar.passes.fusion import FusedCost
    g = Graph("conv_bn_relu")
    x = g.input(TensorMeta.make((64, 64, 56, 56)), "x")
    w = g.input(TensorMeta.make((64, 64, 3, 3)), "w")
    stats = [g.input(TensorMeta.make((64,)), s) for s in ("gamma", "beta", "mean", "var")]
    y = g.call(aten.convolution.default, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
               name="conv")
    bn = g.call(aten._native_batch_norm_legit_no_training.default, (y, *stats, 0.1, 1e-5),
                name="bn")
    z = g.call(__import__("operator").getitem, (bn, 0), name="z")
    r = g.call(aten.relu.default, (z,), name="relu")
    g.set_outputs([r])
    cost = CostModel(preset("h200x2"))
    placement = by_hand(g, {n.name: "cuda:0" for n in g.nodes})
    plan = make_plan(placement, cost)
    regions_found = fused_regions(plan, ["cuda:0"])["cuda:0"]
    assert names(regions_found) == [["bn", "z", "relu"]]
    fused = FusedCost(cost, {"cuda:0": regions_found})
    bn_node, relu = (next(n for n in g.nodes if n.name == k) for k in ("bn", "relu"))
    each = {n.name: cost.op_cost(n, "cuda:0").device_s for n in (bn_node, relu)}
    region = fused.node_time(bn_node, "cuda:0")
    assert region == pytest.approx(max(each.values()), rel=1e-6)
    assert region < cost.node_time(bn_node, "cuda:0") + cost.node_time(relu, "cuda:0")
    assert fused.node_time(relu, "cuda:0") == 0.0


def test_every_normalization_priced_as_fused_is_one_inductor_decomposes():
    """The list behind that pricing is checked against Inductor's own decomposition table."""
    from torch._inductor.decomposition import select_decomp_table

    from autopar.passes.fusion import NORMALIZATIONS
    table = {op._schema.name.partition("::")[2] for op in select_decomp_table()
             if isinstance(op, torch._ops.OpOverload)}
    assert not NORMALIZATIONS - table, NORMALIZATIONS - table


@needs_cxx
def test_fused_regions_in_a_backward_graph_give_eagers_gradients():
    """A small model's training graphs with their regions compiled by Inductor on the host
    (the forward's and the backward's: layer norm, GELU and their gradients)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                torch.nn.GELU(), torch.nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    compiled = autopar.compile(model, devices="cpu:0", fuse=True, candidates="autopar")
    x = torch.randn(8, 16)
    compiled(x).square().mean().backward()
    ref(x).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    from autopar.api import dispatcher_of
    runner = dispatcher_of(compiled).runner
    fused = {e.plan.graph.name.split("_")[1] for e in runner.executors if e.fused}
    assert fused == {"forward", "backward"}, fused
