"""A plan that puts ops on the host beside another device learns their times from its first
calls (autopar.runtime.learn): history fed, saved, used by later plans; results unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
import autopar.runtime.learn as learn_mod
from autopar.api import dispatcher_of
from autopar.machine.detect import load_machine

# each test compiles _f anew: dynamo's entries for one code object stop at its recompile limit
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _f(x, y):
    a = torch.relu(x @ y) * 2
    b = torch.tanh(x - 1).sum(0)
    return a + b, (x * 3).mean()


def _machine(tmp_path, source: str = "measured-quick"):
    """This host's numbers (defaults here) with two CPU workers, called measured by ``source``
    and with its files in ``tmp_path``."""
    m = load_machine(None, cpu_workers=2)
    return dataclasses.replace(m, profile=dataclasses.replace(m.profile, source=source),
                               profile_path=tmp_path / "profile-test.json")


def _compiled(machine, devices="cpu:0,cpu:1"):
    return autopar.compile(_f, devices=devices, policy="round_robin", machine=machine,
                           fuse=False, candidates=("autopar",))


def _calls(compiled, n):
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    for _ in range(n):
        out, ref = compiled(x, y), _f(x, y)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out, ref))


def test_a_plan_over_two_workers_learns_its_ops_times_in_its_first_calls(tmp_path):
    compiled = _compiled(_machine(tmp_path))
    _calls(compiled, 1)
    runner = dispatcher_of(compiled).runner
    (executor,) = runner.executors
    assert {executor.plan.placement.device[n] for n in executor.plan.graph.ops} == \
        {"cpu:0", "cpu:1"}
    cost = runner.cost_model()
    assert executor.learning is not None and not cost.history._samples  # the first call warms
    _calls(compiled, learn_mod.LEARN_CALLS)
    assert executor.learning is None  # detached: later calls pay nothing
    keys = {cost.history_key(n, "cpu:0") for n in executor.plan.graph.ops}
    learned = cost.history._samples
    assert set(learned) == keys
    for n in executor.plan.graph.ops:  # each op once per traced call (none repeats here)
        assert len(learned[cost.history_key(n, "cpu:0")]) == learn_mod.LEARN_CALLS
    assert all(t > 0 for xs in learned.values() for t in xs)
    files = list(tmp_path.glob("history-*.json"))  # beside the profile, named by fingerprint
    assert len(files) == 1 and all(k in files[0].read_text() for k in keys)
    _calls(compiled, 2)
    assert all(len(xs) == learn_mod.LEARN_CALLS for xs in learned.values())


def test_a_later_plan_prices_learned_ops_by_their_measured_median(tmp_path):
    compiled = _compiled(_machine(tmp_path))
    _calls(compiled, 1)
    runner = dispatcher_of(compiled).runner
    runner.cost_model().history.min_samples = 1  # trusted whatever this host's jitter
    _calls(compiled, learn_mod.LEARN_CALLS)
    (executor,) = runner.executors
    cost = runner.cost_model()
    mm = next(n for n in executor.plan.graph.ops if "mm" in str(n.op))
    priced = cost.op_cost(mm, "cpu:1")
    assert priced.source == "history"
    assert priced.host_s == cost.history.estimate(cost.history_key(mm, "cpu:0")) > 0


@pytest.mark.parametrize("why", ["one device", "defaults profile", "traced", "preset"])
def test_no_learning_where_the_host_prices_decide_nothing_or_are_stopgaps(tmp_path, why,
                                                                         monkeypatch):
    machine = _machine(tmp_path, "defaults" if why == "defaults profile" else "measured-quick")
    if why == "preset":  # another machine's numbers: this host's times are not its
        from autopar.machine.presets import preset
        machine = preset("cpu-only", cpu_workers=2)
    if why == "traced":
        compiled = autopar.compile(_f, devices="cpu:0,cpu:1", policy="round_robin",
                                   machine=machine, fuse=False, trace=True)
    else:
        compiled = _compiled(machine, "cpu:0" if why == "one device" else "cpu:0,cpu:1")
    learned = []
    monkeypatch.setattr(learn_mod.Learner, "__init__", lambda *a, **k: learned.append(a))
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    for _ in range(5):
        out, ref = compiled(x, y), _f(x, y)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(out, ref))
    assert not learned and not list(tmp_path.glob("history-*.json"))


def test_a_twin_that_cannot_be_built_ends_learning_and_the_call_runs(tmp_path, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("no twin")

    compiled = _compiled(_machine(tmp_path))
    _calls(compiled, 1)
    (executor,) = dispatcher_of(compiled).runner.executors
    monkeypatch.setattr(executor.learning, "_make_twin", broken.__get__(executor.learning))
    _calls(compiled, 3)
    assert executor.learning is None
    assert not dispatcher_of(compiled).runner.cost_model().history._samples


def test_saves_of_one_history_file_merge_rather_than_overwrite(tmp_path):
    from autopar.cost.model import History

    path = tmp_path / "history-x.json"
    a, b = History.load(path, "x"), History.load(path, "x")  # two compiled functions' models
    a.add("cpu|aten.mm(f32[2,2], f32[2,2])", 1e-6)
    a.save()
    a.save()  # nothing new: nothing appended twice
    b.add("cpu|aten.relu(f32[2,2])", 2e-6)
    b.save()
    on_disk = History.load(path, "x")
    assert on_disk.samples("cpu|aten.mm(f32[2,2], f32[2,2])") == [1e-6]
    assert on_disk.samples("cpu|aten.relu(f32[2,2])") == [2e-6]
    assert b.samples("cpu|aten.mm(f32[2,2], f32[2,2])") == [1e-6]  # b holds the union now


def test_two_compiled_functions_keep_each_others_learning(tmp_path):
    machine = _machine(tmp_path)

    def g(x, y):
        return torch.sigmoid(x + y) * 5, (y - 2).abs().sum()

    first = _compiled(machine)
    second = autopar.compile(g, devices="cpu:0,cpu:1", policy="round_robin", machine=machine,
                             fuse=False, candidates=("autopar",))
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    first(x, y)
    second(x, y)  # both read the (empty) file
    for _ in range(learn_mod.LEARN_CALLS):
        first(x, y)
    for _ in range(learn_mod.LEARN_CALLS):
        second(x, y)
    (path,) = tmp_path.glob("history-*.json")
    text = path.read_text()
    assert "aten.mm" in text and "aten.sigmoid" in text


def test_a_traced_call_still_running_when_the_last_begins_is_saved_too(tmp_path, monkeypatch):
    import threading

    from autopar.cost.model import History

    compiled = _compiled(_machine(tmp_path))
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    compiled(x, y)
    (executor,) = dispatcher_of(compiled).runner.executors
    learner = executor.learning
    slow = threading.Event()
    observe = learner._observe

    def late(twin):  # the thread's traced call observes after the main thread's last one
        if threading.current_thread() is not threading.main_thread():
            slow.wait(10)
        observe(twin)
    monkeypatch.setattr(learner, "_observe", late)
    other = threading.Thread(target=compiled, args=(x, y))
    other.start()  # turn 2, held
    while learner.calls < 2:
        pass
    for _ in range(learn_mod.LEARN_CALLS - 1):  # turns 3-6
        compiled(x, y)
    slow.set()
    other.join()
    (path,) = tmp_path.glob("history-*.json")
    saved = History.load(path)
    keys = saved.keys()
    assert keys and {len(saved.samples(k)) for k in keys} == {learn_mod.LEARN_CALLS}


def test_the_twin_is_let_go_with_its_last_traced_call(tmp_path):
    import gc
    import weakref

    compiled = _compiled(_machine(tmp_path))
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    compiled(x, y)
    compiled(x, y)
    (executor,) = dispatcher_of(compiled).runner.executors
    twin = weakref.ref(executor.learning._twin)
    for _ in range(learn_mod.LEARN_CALLS - 1):
        compiled(x, y)
    gc.collect()
    assert twin() is None  # no further call needed to free it (a worker kept its last job)
