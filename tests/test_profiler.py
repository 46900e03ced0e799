"""autopar under torch.profiler: calls, programs, trials and plans as named ranges."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import autopar
from autopar import choose


def branches(x, y):
    return (x @ x).relu().sum() + (y @ y).tanh().sum()


def _all_threads() -> dict:
    """torch.profiler records other threads' ops (a CPU worker's) when told to."""
    try:
        return {"experimental_config": torch._C._profiler._ExperimentalConfig(
            profile_all_threads=True)}
    except TypeError:  # a torch without it: the caller's thread only
        return {}


def test_calls_programs_plans_and_trials_are_ranges_on_their_threads(monkeypatch):
    monkeypatch.setattr(choose, "TRIAL_CALLS", 2)
    monkeypatch.setattr(choose, "TRIAL_MIN_S", 0.0)
    x, y = torch.randn(48, 48), torch.randn(48, 48)
    compiled = autopar.compile(branches, devices="cpu:0,cpu:1", policy="round_robin",
                               candidates=["eager", "autopar"])
    every_thread = _all_threads()
    with profile(activities=[ProfilerActivity.CPU], **every_thread) as prof:
        for _ in range(10):  # the capture, then per way an untimed call and two timed ones
            torch.testing.assert_close(compiled(x, y), branches(x, y))
    events = prof.events()
    names = {e.name for e in events}
    graph = "autopar:branches_inference_1"
    assert graph in names, sorted(n for n in names if n.startswith("autopar"))
    assert f"{graph}:cpu:0" in names
    assert f"{graph}:cpu:1" in names or not every_thread
    assert any(n.startswith("autopar:plan branches_inference_1: ") for n in names)
    assert {"autopar:trial branches eager", "autopar:trial branches autopar"} <= names
    assert any(n.startswith("autopar:verdict branches ") for n in names)
    threads = {e.name: e.thread for e in events if e.name.startswith(graph)}
    if every_thread:  # cpu:1's program ran on its worker thread, cpu:0's on the caller's
        assert threads[f"{graph}:cpu:1"] != threads[graph] == threads[f"{graph}:cpu:0"]
    assert any(k.key == graph for k in prof.key_averages())


def test_calls_outside_the_profiler_mark_nothing(monkeypatch):
    from autopar.runtime import executor

    made = []
    monkeypatch.setattr(executor, "_range", lambda name: made.append(name))
    x = torch.randn(8, 8)
    compiled = autopar.compile(branches, devices="cpu:0,cpu:1", policy="round_robin",
                               trace=True)  # trace: every call through the executor
    for _ in range(3):
        compiled(x, x)
    assert made == []
