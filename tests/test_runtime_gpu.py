"""The executor on real GPUs: two GPUs at once, copies hidden behind compute, no host syncs on
GPU->GPU paths, no memory growth. Skips cleanly without CUDA (without two GPUs where needed)."""

from __future__ import annotations

import operator

import pytest
import torch

import autopar
from _fakes import by_hand
from autopar.cost.model import CostModel
from autopar.ir.graph import Graph, TensorMeta
from autopar.machine.presets import preset
from autopar.runtime import Executor, SequentialRunner
from autopar.schedule.place import place
from autopar.schedule.plan import make_plan

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


@cuda
def test_an_attention_bias_made_on_the_host_reaches_the_gpu_with_eager_strides():
    """SDPA's padded, expanded bias (``pad``, ``slice``, ``expand``) made on the host: the GPU's
    efficient-attention kernel gets it with eager's strides (head stride 0, rows of 16), not
    the contiguous copy ``.to()`` would make (``attn_bias is not correctly aligned``)."""
    g = Graph("bias")
    meta = TensorMeta.make((4, 4, 11, 16), device="cuda:0")
    q, k, v = (g.input(meta, name) for name in "qkv")
    m = g.input(TensorMeta.make((4, 1, 11, 11), device="cuda:0"), "m")
    padded = g.call(aten.constant_pad_nd.default, (m, [0, 5]), name="pad")
    sliced = g.call(aten.slice.Tensor, (padded, -1, 0, 11), name="cut")
    bias = g.call(aten.expand.default, (sliced, [4, 4, 11, 11]), name="wide")
    att = g.call(aten._scaled_dot_product_efficient_attention.default, (q, k, v, bias, False),
                 name="att")
    g.set_outputs([g.call(operator.getitem, (att, 0), name="out")])
    devices = {"att": "cuda:0", "out": "cuda:0", **{n: "cuda:0" for n in "qkvm"}}
    cost = CostModel(preset("h200x2"))
    plan = make_plan(by_hand(g, devices), cost)  # pad, cut and wide on cpu:0
    args = [torch.randn(4, 4, 11, 16, device="cuda:0") for _ in range(3)]
    args.append(torch.randn(4, 1, 11, 11, device="cuda:0"))
    got = Executor(plan)(args)
    torch.testing.assert_close(got, SequentialRunner(g)(args))


def matmul_via_gpu(side: int) -> Graph:
    """``(x.to("cuda") @ y.to("cuda")).cpu()`` with x, y on the host: W3's host case."""
    g = Graph("via_gpu")
    ins = [g.input(TensorMeta.make((side, side), device="cpu"), name) for name in "xy"]
    moved = [g.call(aten._to_copy.default, (v,), {"device": torch.device("cuda:0")},
                    meta=TensorMeta.make((side, side), device="cuda:0")) for v in ins]
    mm = g.call(aten.mm.default, tuple(moved))
    g.set_outputs([g.call(aten._to_copy.default, (mm,), {"device": torch.device("cpu")},
                          meta=TensorMeta.make((side, side), device="cpu"))])
    return g


@cuda
@pytest.mark.parametrize("side", [5, 1024])
def test_a_matmul_written_for_the_gpu_runs_where_it_is_faster(side):
    """5x5: the moves hand x and y on and the host runs it all; 1024: the GPU. Eager's values,
    a result of its own (handing on never makes it share the inputs' storage), inputs kept."""
    g = matmul_via_gpu(side)
    cost = CostModel(preset("h200x2"))
    devices = ["cpu:0", "cuda:0"]
    placement = place(g, cost, devices=devices)
    on = {placement.device[n] for n in g.ops if n.op is aten.mm.default}
    assert on == ({"cpu:0"} if side == 5 else {"cuda:0"})
    x, y = (torch.randn(side, side) for _ in range(2))
    keep = (x.clone(), y.clone())
    ex = Executor(make_plan(placement, cost))
    for _ in range(2):
        (got,) = ex([x, y])
    (want,) = SequentialRunner(g)([x, y])
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.data_ptr() not in (x.data_ptr(), y.data_ptr())
    torch.testing.assert_close((x, y), keep, rtol=0, atol=0)
    compiled = autopar.compile(lambda a, b: (a.to("cuda") @ b.to("cuda")).cpu())
    for _ in range(2):
        torch.testing.assert_close(compiled(x, y), want, rtol=1e-4, atol=1e-4)
