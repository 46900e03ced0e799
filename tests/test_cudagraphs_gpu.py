"""Fusion and CUDA-graph replay on real GPUs (skipped without CUDA).

    python -m pytest -q tests/test_cudagraphs_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch

from autopar.api import Options, Runner
from autopar.capture.dynamo import make_backend
from autopar.runtime import executor as executor_module
from autopar.runtime.cudagraphs import CudaGraphBackend

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              # the sanitizer is a TorchDispatchMode, and dynamo runs no frame under one
              # ("non-infra torch dispatch mode present"): nothing would be compiled
              pytest.mark.skipif(os.environ.get("TORCH_CUDA_SANITIZER") == "1",
                                 reason="torch.compile traces nothing under the sanitizer"),
              pytest.mark.usefixtures("fresh_dynamo")]


def compiled(fn, **options):
    """``torch.compile(fn)`` through autopar with ``options``, and the executors it builds."""
    runner = Runner(Options.parse(options))
    executors = []

    def build(graph, phase):
        run = runner(graph, phase)
        executors.append(run)
        return run

    return torch.compile(fn, backend=make_backend(build), dynamic=False), executors


def tiny_chain(x):
    for _ in range(100):
        x = x * 1.0001 + 0.001
    return x


def test_tiny_chain_is_one_fused_kernel_equal_to_eager():
    f, executors = compiled(tiny_chain, devices="cuda:0")
    for k in range(3):
        x = torch.randn(64, device="cuda") + k
        torch.testing.assert_close(f(x), tiny_chain(x))
    (ex,) = executors
    assert [r.kernel.status for r in ex.fused] == ["compiled"]
    assert ex.solo == "cuda:0"  # one program, nothing to order: no per-call machinery


def test_tiny_chain_replayed_as_a_cuda_graph_is_identical_to_eager():
    f, executors = compiled(tiny_chain, devices="cuda:0", fuse=False, cuda_graphs=True)
    outs = []
    for k in range(4):
        x = torch.randn(64, device="cuda") + k
        out = f(x)
        assert torch.equal(out, tiny_chain(x))
        outs.append((x, out))
    (ex,) = executors
    assert [s.status for s in ex.segments] == ["captured"]
    for x, out in outs:  # outputs are clones: later replays did not overwrite them
        assert torch.equal(out, tiny_chain(x))


def test_fused_and_captured_together():
    f, executors = compiled(tiny_chain, devices="cuda:0", cuda_graphs=True)
    for k in range(3):
        x = torch.randn(64, device="cuda") + k
        torch.testing.assert_close(f(x), tiny_chain(x))
    (ex,) = executors
    assert [s.status for s in ex.segments] == ["captured"]


class SyncingDuringCapture(CudaGraphBackend):
    """A segment that syncs with the host under capture: a real capture failure."""

    def capture(self, run, static_in, device):
        def syncing(xs):
            out = run(xs)
            torch.cuda.synchronize()  # not permitted while a stream is capturing
            return out
        return super().capture(syncing, static_in, device)


def test_a_failed_capture_falls_back_to_streams(monkeypatch):
    monkeypatch.setattr(executor_module, "_GRAPH_BACKEND", SyncingDuringCapture())
    f, executors = compiled(tiny_chain, devices="cuda:0", fuse=False, cuda_graphs=True)
    for k in range(4):
        x = torch.randn(64, device="cuda") + k
        assert torch.equal(f(x), tiny_chain(x))
    (ex,) = executors
    assert [s.status for s in ex.segments] == ["streams"]
    assert ex.segments[0].reason.startswith("capture failed:")
    y = torch.randn(1000, device="cuda")  # the process's CUDA (and its RNG) still work
    assert torch.equal(y * 2, y + y)


def random_chain(x):
    y = x * 2 + torch.rand_like(x)
    for _ in range(10):
        y = y.sin() * 1.5
    return y


def test_random_ops_run_between_graphs():
    """rand_like runs on the stream between graphs: the ops around it are captured."""
    f, executors = compiled(random_chain, devices="cuda:0", fuse=False, cuda_graphs=True)
    x = torch.randn(256, device="cuda")
    for _ in range(3):
        y = f(x)
        assert y.shape == x.shape and y.abs().max() <= 1.5
    (ex,) = executors
    assert 1 <= len(ex.segments) <= 2  # x * 2 may be ordered before or after rand_like
    assert all(s.status == "captured" for s in ex.segments)
    assert all("rand" not in s.program.source for s in ex.segments)
    assert "rand_like" in ex.programs["cuda:0"].source


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_replay_their_segments_ordered_by_events():
    def two_chains(a, b):
        for _ in range(8):
            a = torch.tanh(a @ a) * 0.5
            b = torch.tanh(b @ b) * 0.5
        return a + b.to(a.device)

    f, executors = compiled(two_chains, devices="cuda:0,cuda:1", policy="round_robin",
                            cuda_graphs=True)
    for k in range(4):
        a = torch.randn(256, 256, device="cuda:0") / 16 + k
        b = torch.randn(256, 256, device="cuda:0") / 16
        torch.testing.assert_close(f(a, b), two_chains(a, b), rtol=1e-4, atol=1e-4)
    (ex,) = executors
    assert ex.segments and all(s.status in ("captured", "streams") for s in ex.segments)
    assert any(s.status == "captured" for s in ex.segments)
