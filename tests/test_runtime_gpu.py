"""The executor on real GPUs: two GPUs at once, copies hidden behind compute, no host syncs on
GPU->GPU paths, no memory growth. Skips cleanly without CUDA (without two GPUs where needed)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost import CostModel
from autopar.graph import Graph, TensorMeta
from autopar.machine import preset
from autopar.place import place
from autopar.plan import make_plan
from autopar.runtime import Executor, SequentialRunner

aten = torch.ops.aten
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def chains(n: int, size: int, device: str = "cuda:0", to_host: bool = False) -> Graph:
    """Two chains of ``n`` matmuls on ``device`` inputs (W4); optionally each result to the host
    (W5)."""
    g = Graph("chains")
    xs = [g.input(TensorMeta.make((size, size), device=device), f"x{i}") for i in range(2)]
    outs = []
    for x in xs:
        y = x
        for _ in range(n):
            y = g.call(aten.mm.default, (y, x))
            y = g.call(aten.mul.Tensor, (y, 1.0 / size))
            outs.append(g.call(aten._to_copy.default, (y,), {"device": torch.device("cpu")})
                        if to_host else y)
    g.set_outputs(outs)
    return g


def run_both(g: Graph, plan, args):
    ex = Executor(plan, trace=True)
    ex(args)
    got = ex(args)
    torch.cuda.synchronize()
    want = SequentialRunner(g)(args)
    for a, b in zip(got, want):
        assert a.device == b.device
        torch.testing.assert_close(a, b)
    return ex.last_timeline


@two_gpus
def test_two_chains_use_both_gpus_at_once():
    g = chains(8, 2048)
    cost = CostModel(preset("h200x2"))
    plan = make_plan(place(g, cost, devices=["cuda:0", "cuda:1"]), cost)
    assert {"cuda:0", "cuda:1"} <= set(plan.programs)
    x = [torch.randn(2048, 2048, device="cuda:0") for _ in range(2)]
    tl = run_both(g, plan, x)
    a, b = tl.on("cuda:0/compute"), tl.on("cuda:1/compute")
    assert a and b
    overlap = min(a[-1].end, b[-1].end) - max(a[0].start, b[0].start)
    assert overlap > 0.5 * min(a[-1].end - a[0].start, b[-1].end - b[0].start)


@two_gpus
def test_gpu_to_gpu_paths_never_sync_the_host():
    g = chains(4, 1024)
    cost = CostModel(preset("h200x2"))
    plan = make_plan(place(g, cost, devices=["cuda:0", "cuda:1"]), cost)
    ex = Executor(plan)
    x = [torch.randn(1024, 1024, device="cuda:0") for _ in range(2)]
    ex(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ex(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    torch.testing.assert_close(out[-1], SequentialRunner(g)(x)[-1])


@cuda
def test_copies_to_the_host_overlap_compute():
    g = chains(6, 2048, to_host=True)
    cost = CostModel(preset("h200x2"))
    plan = make_plan(place(g, cost, devices=["cpu:0", "cuda:0"]), cost)
    x = [torch.randn(2048, 2048, device="cuda:0") for _ in range(2)]
    tl = run_both(g, plan, x)
    copies = tl.on("cuda:0/d2h")
    compute = tl.on("cuda:0/compute")
    assert len(copies) == 12
    hidden = sum(max(0.0, min(c.end, k.end) - max(c.start, k.start))
                 for c in copies for k in compute)
    assert hidden > 0.5 * sum(c.duration for c in copies[:-1])


@cuda
def test_no_memory_growth_over_many_calls():
    g = chains(3, 256, to_host=True)
    cost = CostModel(preset("h200x2"))
    plan = make_plan(place(g, cost, devices=["cpu:0", "cuda:0"]), cost)
    ex = Executor(plan)
    x = [torch.randn(256, 256, device="cuda:0") for _ in range(2)]
    for _ in range(20):
        ex(x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    for _ in range(1000):
        out = ex(x)
    del out
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before
    assert torch.cuda.memory_reserved() <= reserved


@cuda
def test_compile_on_gpu_matches_eager_with_heft_over_all_devices():
    def f(x, w, b):
        h = torch.relu(x @ w + b)
        return h.sum(dim=1).cpu(), (h @ w.t()).softmax(-1)

    x = torch.randn(512, 256, device="cuda:0")
    w = torch.randn(256, 256, device="cuda:0")
    b = torch.randn(256, device="cuda:0")
    compiled = autopar.compile(f)
    for _ in range(2):
        got = compiled(x, w, b)
    want = f(x, w, b)
    for a, e in zip(got, want):
        assert a.device == e.device
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


@cuda
def test_a_failing_gpu_op_raises_the_original_error():
    g = Graph("bad")
    x = g.input(TensorMeta.make((4, 3), device="cuda:0"), "x")
    bad = g.call(aten.mm.default, (x, x), meta=TensorMeta.make((4, 4), device="cuda:0"))
    g.set_outputs([bad])
    cost = CostModel(preset("h200x2"))
    ex = Executor(make_plan(place(g, cost, policy="single"), cost))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        ex([torch.randn(4, 3, device="cuda:0")])
