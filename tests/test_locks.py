"""Threads: a compiled call made while another thread traces (FX's process-wide flag and
patches) waits for the trace, and autopar's own traces hold dynamo's compile lock."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.fx._symbolic_trace as fx_trace

import autopar
from _torch_versions import dynamo_calls_beside_other_threads_compiles
from autopar.ir.locks import enter, tracing

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _another_thread_traces(seconds: float) -> tuple[threading.Thread, threading.Event]:
    """A thread holding the tracing lock with FX's flag up for ``seconds``, as a trace does."""
    started = threading.Event()

    def trace() -> None:
        with tracing():
            was, fx_trace._is_fx_tracing_flag = fx_trace._is_fx_tracing_flag, True
            started.set()
            try:
                threading.Event().wait(seconds)
            finally:
                fx_trace._is_fx_tracing_flag = was

    t = threading.Thread(target=trace)
    t.start()
    started.wait(5)
    return t, started


def test_a_compiled_call_waits_out_another_threads_trace():
    f = autopar.compile(lambda x: x.sin() + 1, candidates=["autopar"])  # through dynamo
    x = torch.randn(4)
    torch.testing.assert_close(f(x), x.sin() + 1)
    t, _ = _another_thread_traces(0.3)
    try:
        torch.testing.assert_close(f(x), x.sin() + 1)  # dynamo's entry refused it before
        assert not fx_trace._is_fx_tracing_flag  # it waited for the trace
    finally:
        t.join()


def test_a_call_refused_at_dynamos_entry_is_made_again_once_the_trace_ends(monkeypatch):
    """The flag rose after ``enter`` looked: dynamo's entry refuses the call, which ran
    nothing, and it is made again once the trace is over."""
    import autopar.ir.locks as locks

    class Racing:  # FX's flag, seen down by enter; a trace starts right after the look
        def __init__(self) -> None:
            self.holder: list[threading.Thread] = []

        @property
        def _is_fx_tracing_flag(self) -> bool:
            if not self.holder:
                self.holder.append(_another_thread_traces(0.2)[0])
            return False

    racing = Racing()
    monkeypatch.setattr(locks, "_fx", racing)
    compiled = torch.compile(lambda x: x * 2, backend="eager")
    x = torch.ones(3)
    try:
        torch.testing.assert_close(enter(compiled, (x,), {}), x * 2)
        assert racing.holder and not fx_trace._is_fx_tracing_flag
    finally:
        for t in racing.holder:
            t.join()


def test_a_trace_in_the_calling_thread_is_refused_as_dynamo_refuses_it():
    compiled = torch.compile(lambda x: x + 1, backend="eager")
    was, fx_trace._is_fx_tracing_flag = fx_trace._is_fx_tracing_flag, True
    try:
        with pytest.raises(RuntimeError, match="symbolically trace a dynamo-optimized"):
            enter(compiled, (torch.ones(2),), {})
    finally:
        fx_trace._is_fx_tracing_flag = was


def test_autopars_traces_hold_dynamos_compile_lock(monkeypatch):
    """A training step's trace runs holding the lock torch.compile compiles under."""
    from torch._dynamo.convert_frame import compile_lock

    import autopar.capture.step as step_module

    held = []
    real = step_module.make_fx

    def watching(*a, **k):
        held.append(compile_lock._is_owned())
        return real(*a, **k)
    monkeypatch.setattr(step_module, "make_fx", watching)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    split = autopar.data_parallel(step, devices="cpu:0,cpu:1", shards=2)
    for _ in range(3):
        split(torch.randn(8, 4))
    assert held and all(held)


def test_threads_share_dynamos_scalar_capture_and_the_last_one_out_switches_it_off():
    """One thread's call leaving no longer switches ``capture_scalar_outputs`` off under
    another's compile; set by the user, it is never switched off."""
    from autopar.capture.dynamo import scalars_captured

    config = torch._dynamo.config
    assert not config.capture_scalar_outputs
    with scalars_captured():
        def other() -> None:
            with scalars_captured():
                pass
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert config.capture_scalar_outputs  # the other thread's exit left it on
    assert not config.capture_scalar_outputs
    config.capture_scalar_outputs = True
    try:
        with scalars_captured():
            pass
        assert config.capture_scalar_outputs
    finally:
        config.capture_scalar_outputs = False


def _in_threads(work, n: int) -> list[str]:
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            work(i)
        except Exception as e:  # every thread's failure is reported
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def test_threads_calling_one_compiled_module_from_its_first_call_get_eagers_results():
    """Eight threads, each its own batch size, call one compiled module from the start:
    captures, trials and verdicts of overlapping signatures are one thread's at a time (two
    threads ending one trial raised KeyError in ``Dispatcher._verdict``, 2026-12-05)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    c = autopar.compile(m.eval(), candidates=("eager", "inductor"))  # a trial each
    xs = [torch.randn(2 + i, 16) for i in range(8)]
    got: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        with torch.no_grad():
            for _ in range(60):
                got[i] = c(xs[i])
    assert _in_threads(work, 8) == []
    with torch.no_grad():
        for i, x in enumerate(xs):
            torch.testing.assert_close(got[i], m(x))


def test_a_splits_capture_leaves_other_threads_calls_and_the_module_alone():
    """On two CPU workers a new signature's split is captured by swapping the module's
    parameters for fake ones: other threads' calls wait for it, and the module keeps its own
    parameters (before, every thread raised "Attempting to use FunctionalTensor on its own"
    and the module was left holding FunctionalTensors for good)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(),
                            torch.nn.Linear(1024, 512)).eval()
    want = copy.deepcopy(m)
    c = autopar.compile(m, devices="cpu:0,cpu:1", candidates=("eager", "autopar", "split"))
    xs = [torch.randn(256, 512) for _ in range(4)]

    def work(i: int) -> None:
        with torch.no_grad():
            for _ in range(20):
                torch.testing.assert_close(c(xs[i]), want(xs[i]))
    assert _in_threads(work, 4) == []
    assert {type(p) for p in m.state_dict().values()} == {torch.Tensor}
    with torch.no_grad():
        torch.testing.assert_close(c(xs[0]), m(xs[0]))


@dynamo_calls_beside_other_threads_compiles
def test_the_backend_called_from_threads_with_new_sizes_refuses_no_call():
    """``torch.compile(fn, backend="autopar")`` (no autopar wrapper to wait out a trace) from
    four threads, sizes varying: each new size's static graph is made without an FX trace,
    so no thread's call meets dynamo's "symbolically trace a dynamo-optimized function"
    (26 of 120 calls did, 2026-12-05)."""
    def f(x, y):
        return torch.relu(x @ y).sin() + x.sum(-1, keepdim=True)

    c = torch.compile(f, backend="autopar")

    def work(i: int) -> None:
        for k in range(30):
            x, y = torch.randn(2 + (i * 30 + k) % 50, 8), torch.randn(8, 8)
            torch.testing.assert_close(c(x, y), f(x, y))
    assert _in_threads(work, 4) == []
