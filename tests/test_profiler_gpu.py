"""autopar under torch.profiler on a GPU: the graph's range, its per-device programs, the copies
between devices as named ranges, and the kernels they launched in the same trace."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import autopar

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def branches(x, w):
    return (x @ w).relu().sum() + (x * 2).tanh().sum()


def test_copies_programs_and_kernels_are_in_one_trace():
    x = torch.randn(64, 256, device="cuda:0")
    w = torch.randn(256, 256, device="cuda:0")
    # round_robin deals the ops to the host and the GPU in turn: values cross both ways
    compiled = autopar.compile(branches, devices="cpu:0,cuda:0", policy="round_robin",
                               candidates=["autopar"], trace=True)
    want = branches(x, w)
    # the capture, outside the profiler
    torch.testing.assert_close(compiled(x, w), want, rtol=1e-4, atol=1e-3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            torch.testing.assert_close(compiled(x, w), want, rtol=1e-4, atol=1e-3)
        torch.cuda.synchronize()
    events = prof.events()
    names = {e.name for e in events}
    ours = sorted(n for n in names if n.startswith("autopar"))
    graph = "autopar:branches_inference_1"
    assert graph in names, ours
    assert f"{graph}:cuda:0" in names, ours
    assert any(n.startswith("autopar:copy ") for n in names), ours
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels, "no CUDA kernel in the trace"
