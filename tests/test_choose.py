"""The measured choice (autopar.choose): candidates, trials, verdicts, failures."""

from __future__ import annotations

import copy
import logging
import re
import shutil

import pytest
import torch

import autopar
import autopar.api
import autopar.dispatch
from _fakes import adamw_pair, adamw_step
from autopar import choose
from autopar.choose import OWN_SIGNATURES, TRIAL_CALLS, TURN_CALLS, Trial, candidates

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                               reason="Inductor's CPU code needs a C++ compiler")


def test_candidates_are_pruned_by_what_capture_found():
    assert candidates(autopar_differs=False, inductor_can=False) == ("eager",)
    assert candidates(autopar_differs=True, inductor_can=False) == ("eager", "autopar")
    assert candidates(autopar_differs=False, inductor_can=True) == ("eager", "inductor")
    assert candidates(autopar_differs=True, inductor_can=True) == ("eager", "inductor",
                                                                   "autopar")
    assert not choose.inductor_compiles_for(["cuda:0"], fuse=False)
    assert choose.inductor_compiles_for(["cpu:0", "cuda:0"], fuse="auto")


def test_candidates_option_is_checked():
    assert autopar.Options.parse({"candidates": "autopar,eager"}).candidates == ("eager",
                                                                                  "autopar")
    assert autopar.Options.parse({"candidates": "auto"}).candidates == choose.WAYS
    with pytest.raises(ValueError, match=r"^candidates must be 'auto' or some of eager"):
        autopar.Options.parse({"candidates": ["eager", "tvm"]})


def test_a_bad_candidates_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv("AUTOPAR_CANDIDATES", "bogus")
    with pytest.raises(ValueError, match=r"^AUTOPAR_CANDIDATES must be 'auto' or some of"):
        autopar.Options.parse({})
    assert autopar.Options.parse({"candidates": "eager"}).candidates == ("eager",)



def _unsettled(text: str) -> str:
    """``explain``'s text without the calls and seconds each verdict took (they vary)."""
    return re.sub(r"; settled in \d+ calls?, [\d.]+ s", "", text)

def _timed(trial: Trial, seconds: list[float]) -> None:
    """Fill ``trial`` with calls of the given host seconds, in the order it asks for them."""
    for t in seconds:
        trial.calls.append((trial.next_way(), t, [], None))


def test_a_trial_goes_round_the_ways_and_keeps_the_fastest_median():
    trial = Trial({"eager": (), "inductor": (), "autopar": ()})
    assert trial.verdict() is None
    # round the ways, counted calls only (a turn's untimed first call is not in ``calls``)
    per_way = {"eager": [3.0, 3.0, 3.0, 3.0, 3.0], "inductor": [2.0, 2.0, 9.0, 2.0, 2.0],
               "autopar": [0.5, 9.0, 9.0, 9.0, 9.0]}
    order = [w for i in range(TRIAL_CALLS) for w in per_way]
    for i, way in enumerate(order):
        assert trial.next_way() == way
        trial.calls.append((way, per_way[way][i // 3], [], None))
    assert trial.next_way() is None
    assert trial.verdict() == "inductor"  # medians: eager 3, inductor 2, autopar 9
    assert trial.summary() == "eager 3 s, inductor 2 s, autopar 9 s"


def test_after_a_switch_a_call_is_not_timed(monkeypatch):
    """A call that follows another way's runs in caches and memory that way left (a compiled
    BERT step: 2.5 ms a call alone, 6.3 ms right after an eager one): it is not timed; the
    way's next ``TURN_CALLS`` calls, one after another, are."""
    ran: list[tuple[str, bool]] = []
    monkeypatch.setattr(choose, "_clock", _fake_clock(eager=1.0, autopar=1.0))
    trial = Trial({"eager": (), "autopar": ()})

    def way_of(w):
        return lambda: ran.append((w, len(trial.calls)))
    for _ in range(2 * (1 + TURN_CALLS)):
        trial.run(way_of, (), {})
    # eager untimed, eager timed TURN_CALLS times, autopar untimed, autopar timed as often
    assert ran == [("eager", 0), *(("eager", i) for i in range(TURN_CALLS)),
                   ("autopar", TURN_CALLS),
                   *(("autopar", TURN_CALLS + i) for i in range(TURN_CALLS))]
    assert [c[0] for c in trial.calls] == ["eager"] * TURN_CALLS + ["autopar"] * TURN_CALLS


def test_fast_calls_are_timed_for_a_while_but_not_for_ever():
    """Five samples of a 1 ms call are not trusted: a way is timed until its counted calls add
    up to ``TRIAL_MIN_S``, or ``TRIAL_MAX_CALLS`` of them."""
    trial = Trial({"eager": (), "autopar": ()})
    _timed(trial, [0.009] * (2 * TRIAL_CALLS))
    assert trial.next_way() == "eager"  # 5 counted calls of 9 ms: 50 ms is not yet reached
    _timed(trial, [0.009] * 2)
    assert trial.next_way() is None and trial.verdict() == "eager"
    quick = Trial({"eager": (), "autopar": ()})
    _timed(quick, [1e-6] * (2 * choose.TRIAL_MAX_CALLS))
    assert quick.next_way() is None


def test_a_tie_keeps_the_earlier_way():
    trial = Trial({"eager": (), "autopar": ()})
    _timed(trial, [1.0] * (2 * TRIAL_CALLS))
    assert trial.verdict() == "eager"


class _Costly(torch.autograd.Function):
    """Identity whose backward moves a fake clock by ``seconds``."""

    @staticmethod
    def forward(ctx, x, clock, seconds):
        ctx.clock, ctx.seconds = clock, seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock[0] += ctx.seconds
        return grad, None, None


def _training_trial(monkeypatch):
    """A fake clock (the trial's), ways of ``x -> x * w`` whose forward moves it by 1 s
    (eager) and 2 (inductor) and whose backward by 5 and 1, and a trial of the two."""
    clock = [0.0]
    monkeypatch.setattr(choose, "_clock", lambda: clock[0])
    w = torch.ones(3, requires_grad=True)
    forward, backward = {"eager": 1.0, "inductor": 2.0}, {"eager": 5.0, "inductor": 1.0}

    def way_of(name):
        def call(x):
            clock[0] += forward[name]
            return _Costly.apply(x * w, clock, backward[name])
        return call
    return clock, way_of, Trial({"eager": (), "inductor": ()})


def test_a_call_whose_outputs_autograd_records_is_timed_with_its_backward(monkeypatch):
    """A module's forward in a training loop commits to its backward, run later by the
    caller's ``backward()``: eager's forward takes 1 s and its backward 5, inductor's 2 and 1.
    Timed by their forwards, eager would win; each counted call is its forward plus its
    backward (from its outputs' gradients to the end of the pass), and inductor wins."""
    clock, way_of, trial = _training_trial(monkeypatch)
    while trial.verdict() is None:
        out = trial.run(way_of, (torch.randn(3),), {})
        clock[0] += 100.0  # the caller's own work between the call and backward: not counted
        out.sum().backward()
    assert trial.verdict() == "inductor"
    assert trial.times == {"eager": [6.0] * COUNTED, "inductor": [3.0] * COUNTED}
    assert all(back is not None and back.host is not None for *_, back in trial.calls)


def test_a_call_whose_outputs_are_never_differentiated_counts_its_forward(monkeypatch):
    """Outputs that autograd records but no ``backward()`` reaches: a counted call's backward
    is waited for until ``BACKWARD_WAIT_CALLS`` more calls have begun, then its forward
    counts alone (the untimed calls made while waiting go to the way called last)."""
    _, way_of, trial = _training_trial(monkeypatch)
    calls = 0
    while trial.verdict() is None:
        trial.run(way_of, (torch.randn(3),), {})
        calls += 1
    assert trial.verdict() == "eager" and trial.times["eager"] == [1.0] * COUNTED
    # the first switch waits for a first backward, as a long first step would, until
    # _FIRST_STEP_CALLS calls have begun: the first turn's later calls run eager, untimed
    assert calls == 2 * CALLS + choose.BACKWARD_WAIT_CALLS + \
        choose._FIRST_STEP_CALLS - (TURN_CALLS + 1)


def test_a_backward_that_raises_does_not_hold_the_trial_open(monkeypatch):
    """A counted call's backward that begins and raises (a user's hook rejecting a batch)
    never reaches the engine's final callback: it is waited for until
    ``BACKWARD_WAIT_CALLS`` more calls have begun, then that call counts its forward alone,
    and the trial ends as the others' backwards say (it had waited for good, every later call
    untimed on the way called last)."""
    _, way_of, trial = _training_trial(monkeypatch)
    calls = 0
    while trial.verdict() is None and calls < 200:
        x = torch.randn(3, requires_grad=True)
        out = trial.run(way_of, (x,), {})
        calls += 1
        if calls == 3:  # a counted call of eager's first turn
            x.register_hook(lambda g: (_ for _ in ()).throw(ValueError("bad batch")))
            with pytest.raises(ValueError, match="bad batch"):
                out.sum().backward()
            continue
        out.sum().backward()
    assert trial.verdict() == "inductor"
    assert sorted(trial.times["eager"]) == [1.0] + [6.0] * (COUNTED - 1)


@pytest.mark.parametrize("forwards", [2, 3])
def test_a_steps_forwards_run_one_way(monkeypatch, forwards):
    """Gradient accumulation: ``forwards`` calls, then one backward of their summed outputs.
    Once a step was seen to span several calls, a switch of ways waits for the step's
    backward, so every later step's calls ran one way; the trial still ends, each counted
    call timed with its backward (forward 1 s or 2, backward 5 or 1)."""
    _, way_of, trial = _training_trial(monkeypatch)
    steps = []
    while trial.verdict() is None and len(steps) < 200:
        outs, ran = [], []
        for _ in range(forwards):
            outs.append(trial.run(way_of, (torch.randn(3),), {}))
            ran.append(trial.ran)
        sum(o.sum() for o in outs).backward()
        steps.append(ran)
    assert trial.verdict() == "inductor"
    assert all(len(set(ran)) == 1 for ran in steps[1:]), steps


def test_a_step_longer_than_any_seen_runs_one_way(monkeypatch):
    """Steps of 2, 5, 1 and 3 forwards: a switch waits for the step's backward however many
    forwards came before it (a step longer than any seen was split at the span seen so far),
    and a verdict comes as a step begins, never within one."""
    _, way_of, trial = _training_trial(monkeypatch)
    steps = []
    while trial.verdict() is None and len(steps) < 400:
        outs, ran = [], []
        for _ in range((2, 5, 1, 3)[len(steps) % 4]):
            outs.append(trial.run(way_of, (torch.randn(3),), {}))
            ran.append(trial.ran)
            assert trial.verdict() is None
        sum(o.sum() for o in outs).backward()
        steps.append(ran)
    assert trial.verdict() == "inductor"
    assert all(len(set(ran)) == 1 for ran in steps), steps


def test_calls_never_differentiated_after_accumulated_steps_end_the_trial(monkeypatch):
    """Steps of two forwards each, then calls whose outputs are never differentiated (an
    eval loop under grad): those are one long step that ends once a step's calls have
    begun, so the trial still switches ways and decides (it had waited for good)."""
    _, way_of, trial = _training_trial(monkeypatch)
    for _ in range(3):
        sum(trial.run(way_of, (torch.randn(3),), {}).sum() for _ in range(2)).backward()
    calls = 0
    while trial.verdict() is None and calls < 500:
        trial.run(way_of, (torch.randn(3),), {})
        calls += 1
    assert trial.verdict() is not None and calls < 50


@pytest.mark.parametrize("forwards", [2, 3, 8])
def test_a_trials_verdict_comes_between_steps(monkeypatch, forwards):
    """The verdict is kept at once, so it must not come within a step: the step's later
    forwards would run the winner, its first ones the trial's last way."""
    _, way_of, trial = _training_trial(monkeypatch)
    while trial.verdict() is None:
        outs = []
        for _ in range(forwards):
            outs.append(trial.run(way_of, (torch.randn(3),), {}))
            assert trial.verdict() is None or len(outs) == forwards or len(outs) < 0, \
                f"decided after forward {len(outs)} of {forwards}"
        sum(o.sum() for o in outs).backward()
    assert trial.verdict() == "inductor"  # each counted call timed with its own step's backward


def _same(model, twin, **tol):
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **tol)
    for b, c in zip(model.buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b, c, **tol)


@needs_cxx
def test_accumulated_steps_of_a_batch_norm_model_equal_eager():
    """Two compiled forwards of a model with batch norm in training, one backward: a step
    whose first forward ran eagerly and second compiled failed in the backward (eager's node
    saved the running statistics the compiled form's update then wrote). Over the trial and
    after, every step's gradients and buffers equal eager's."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
                                   torch.nn.ReLU(), torch.nn.Flatten(),
                                   torch.nn.Linear(8 * 6 * 6, 1)).train()
    model, twin = net(), net()
    g = autopar.compile(model, candidates="eager,inductor")
    d = autopar.api.dispatcher_of(g)
    for _ in range(200):
        xs = [torch.randn(4, 3, 8, 8) for _ in range(2)]
        for m, f in ((twin, twin), (model, g)):
            m.zero_grad(set_to_none=True)
            sum(f(x).square().mean() for x in xs).backward()
        _same(model, twin, rtol=1e-4, atol=1e-5)
        if d.kept_way((xs[0],)) is not None:
            break
    assert d.kept_way((xs[0],)) is not None


class _Cell(torch.nn.Module):
    """An RNN cell with batch norm: its first call of a sequence takes ``h0`` without grad, the
    next ones the last call's output (another signature). Its linear layers feed batch norm,
    so they have no bias: its gradient is zero, and two ways' float noise differ."""

    def __init__(self):
        super().__init__()
        self.i = torch.nn.Linear(6, 8, bias=False)
        self.h = torch.nn.Linear(8, 8, bias=False)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x, h):
        return torch.tanh(self.bn(self.i(x) + self.h(h)))


@needs_cxx
@pytest.mark.parametrize("case", ["smaller last micro-batch", "steps of 2, 5 and 1", "rnn cell"])
@pytest.mark.parametrize("winner", ["measured", "inductor"])
def test_a_steps_forwards_of_several_signatures_run_one_way(monkeypatch, case, winner):
    """A step whose forwards have different signatures (gradient accumulation whose last
    micro-batch is smaller, or steps of several lengths; an RNN cell unrolled, its first call
    taking ``h0``): each
    signature had a trial and a verdict of its own, so steps mixed an eager forward and a
    compiled one, and with batch norm every such step's backward raised (eager's node saved
    the running statistics the compiled update then wrote). Now the step's calls run its first
    call's way over the trial, and one way after: every step's gradients and buffers equal
    eager's, and the signatures end on one way (the measured one, eager's on this host, or
    Inductor's, made to win)."""
    if winner != "measured":
        verdict = Trial.verdict
        monkeypatch.setattr(Trial, "verdict", lambda self: verdict(self) and winner)
    torch.manual_seed(0)
    if case == "rnn cell":
        model = _Cell().train()
    else:
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                    torch.nn.ReLU(), torch.nn.Flatten(),
                                    torch.nn.Linear(4 * 6 * 6, 1)).train()
    twin = copy.deepcopy(model)
    g = autopar.compile(model, candidates="eager,inductor")
    d = autopar.api.dispatcher_of(g)

    def loss_of(f, xs):
        if case == "rnn cell":
            h, loss = torch.zeros(3, 8), 0
            for x in xs:
                h = f(x, h)
                loss = loss + h.square().mean()
            return loss
        return sum(f(x).square().mean() for x in xs)

    # (four tanh steps through batch norm over 3 samples: a fused kernel's rounding grows)
    tol = {"rtol": 1e-3, "atol": 1e-4} if case == "rnn cell" else {"rtol": 1e-4, "atol": 1e-5}
    decided = None
    for step in range(300):
        sizes = ((4, 4), (4, 4, 4, 4, 3), (3,))[step % 3] if case.startswith("steps") else \
            (4, 4, 3)
        xs = [torch.randn(3, 6) for _ in range(4)] if case == "rnn cell" else \
            [torch.randn(b, 3, 8, 8) for b in sizes]
        for m, f in ((twin, twin), (model, g)):
            m.zero_grad(set_to_none=True)
            loss_of(f, xs).backward()
        _same(model, twin, **tol)
        if not d.trials and (len(d.kept) == 2 or d.only is not None):
            decided = step if decided is None else decided
            if step == decided + 3:  # and some steps after
                break
    # both kept, or one compiled way serves every call (``only``: not keyed)
    assert not d.trials and (len(d.kept) == 2 or d.only is not None), d.explain()
    assert len(set(d.kept.values())) == 1
    assert winner == "measured" or set(d.kept.values()) == {winner}
    assert d.only is not None or "the way of every forward of this function's steps" in \
        d.explain()


def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 1)).train()


def test_a_signature_kept_as_its_only_candidate_gives_its_way_to_the_steps():
    """A signature kept at its capture (eager, the only candidate: autopar's plan pruned as
    eager's, no Inductor) is not followed by the steps; a smaller last micro-batch after it
    was captured, compiled code after an eager forward of the step, and with batch norm the
    step's backward raised. Its way is now every grad-mode signature's."""
    model = _bn_net()
    twin = copy.deepcopy(model)
    g = autopar.compile(model, candidates="eager,autopar")
    d = autopar.api.dispatcher_of(g)
    for _ in range(4):
        xs = [torch.randn(b, 6) for b in (4, 3)]
        for m, f in ((twin, twin), (model, g)):
            m.zero_grad(set_to_none=True)
            sum(f(x).square().mean() for x in xs).backward()
        _same(model, twin, rtol=1e-4, atol=1e-5)
    assert set(d.kept.values()) == {"eager"} and d.step_way == "eager"


@needs_cxx
@pytest.mark.parametrize("winner", ["measured", "inductor"])
def test_calls_under_no_grad_within_a_step_do_not_end_it(monkeypatch, winner):
    """Calls under ``no_grad`` between a step's forwards (batch norm in training: they write
    its running statistics) counted towards the calls a step may span before a switch stops
    waiting for its backward, so the step's next forward switched ways, and the backward
    raised. They now run the step's way (a compiled one's writes after an eager forward fail
    alike) without counting, and take the steps' way once it is kept: every step's gradients
    and buffers equal eager's, and the trials end (the measured winner, or Inductor's form
    made to win)."""
    if winner != "measured":
        verdict = Trial.verdict
        monkeypatch.setattr(Trial, "verdict", lambda self: verdict(self) and winner)
    model = _bn_net()
    twin = copy.deepcopy(model)
    g = autopar.compile(model, candidates="eager,inductor")
    d = autopar.api.dispatcher_of(g)
    for _ in range(120):
        a, b, evals = torch.randn(4, 6), torch.randn(4, 6), torch.randn(20, 2, 6)
        for m, f in ((twin, twin), (model, g)):
            m.zero_grad(set_to_none=True)
            loss = f(a).square().mean()
            with torch.no_grad():
                for x in evals:
                    f(x)
            (loss + f(b).square().mean()).backward()
        _same(model, twin, rtol=1e-4, atol=1e-5)
        if not d.trials and (len(d.kept) == 2 or d.only is not None):
            break  # (one compiled way serving every call: ``only``, no keys)
    assert not d.trials and (len(d.kept) == 2 or d.only is not None), d.explain()


@needs_cxx
def test_a_no_grad_signature_of_a_module_in_training_takes_the_steps_way(monkeypatch):
    """A batch-norm module in training whose calls under ``no_grad`` kept Inductor's form
    (tried between steps) and whose training forwards kept eager: once a no_grad call came
    between a step's forward and its backward, its compiled update of the running statistics
    failed that backward. A module's signatures in training mode take the steps' way, so
    every step's gradients and buffers equal eager's."""
    verdict = Trial.verdict  # Inductor's form wins the no_grad calls' trial, eager the others
    monkeypatch.setattr(Trial, "verdict", lambda self: verdict(self) and (
        "eager" if self.recorded else "inductor"))
    model = _bn_net()
    twin = copy.deepcopy(model)
    g = autopar.compile(model, candidates="eager,inductor")
    d = autopar.api.dispatcher_of(g)
    for step in range(400):
        x, y = torch.randn(8, 6), torch.randn(4, 6)
        for m, f in ((twin, twin), (model, g)):
            m.zero_grad(set_to_none=True)
            if step < 300:  # the no_grad call between steps, then within them
                with torch.no_grad():
                    f(y)
            loss = f(x).square().mean()
            if step >= 300:
                with torch.no_grad():
                    f(y)
            loss.backward()
        _same(model, twin, rtol=1e-4, atol=1e-5)
    assert not d.trials and set(d.kept.values()) == {"eager"} and len(d.kept) == 2, d.explain()


@needs_cxx
def test_where_no_graph_writes_in_place_each_signature_of_a_step_keeps_its_own_way():
    """Ways mix in a step safely where no graph writes in place (layer norm, no running
    statistics): a smaller last micro-batch is captured and tried on its own, as a new
    length of a text model would be, and the results equal eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 1))
    twin = copy.deepcopy(model)
    g = autopar.compile(model, candidates="eager,inductor")
    d = autopar.api.dispatcher_of(g)
    for _ in range(300):
        xs = [torch.randn(b, 6) for b in (4, 4, 3)]
        for m, f in ((twin, twin), (model, g)):
            m.zero_grad(set_to_none=True)
            sum(f(x).square().mean() for x in xs).backward()
        _same(model, twin, rtol=1e-4, atol=1e-5)  # (layer norm: no buffers)
        if not d.trials and len(d.kept) == 2:
            break
    assert not d.runner.writes and d.step_way is None
    assert not d.trials and len(d.kept) == 2 and len(d.verdicts) == 2, d.explain()
    assert all("medians" not in v[-1] and "(eager " in v[-1] for v in d.verdicts.values()), \
        d.verdicts


class _FakeEvent:
    """A CUDA event on a fake stream whose clock the test moves."""

    done = False

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = None

    def record(self, stream) -> None:
        self.at = stream.now

    def query(self) -> bool:
        return _FakeEvent.done

    def elapsed_time(self, end) -> float:  # milliseconds, as torch's
        return (end.at - self.at) * 1e3


class _Stream:
    now = 0.0


TURNS = -(-TRIAL_CALLS // TURN_CALLS)  # a way's turns in a trial (of calls over 50 ms)
COUNTED = TRIAL_CALLS  # ...its counted calls (its last turn ends there)
CALLS = TURNS + TRIAL_CALLS  # ...and all its calls, the untimed first of each turn too


def _fake_clock(**seconds: float):
    """The host clock of a trial whose ways take turns in ``WAYS``' order (each turn
    ``TURN_CALLS`` counted calls, a way's last turn cut at ``TRIAL_CALLS``), each counted call
    taking ``seconds[way]`` (two reads a call)."""
    ways = [w for w in choose.WAYS if w in seconds]
    order = [w for t in range(TURNS) for w in ways
             for _ in range(min(TURN_CALLS, TRIAL_CALLS - t * TURN_CALLS))]

    def clock() -> float:
        i = clock.reads
        clock.reads += 1
        if i % 2:
            k = i // 2
            way = order[k] if k < len(order) else \
                ways[((k - len(order)) // TURN_CALLS) % len(ways)]
            clock.now += seconds[way]
        return clock.now

    clock.reads, clock.now = 0, 0.0
    return clock


def _gpu_trial(monkeypatch, host: dict[str, float], gpu: dict[str, float],
               done: bool) -> Trial:
    """A trial of ways on cuda:0 (fake events on a fake stream) whose calls take ``host``
    seconds of host time and queue ``gpu`` seconds of GPU work, every turn made."""
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda i: stream)
    monkeypatch.setattr(choose, "_clock", _fake_clock(**host))
    monkeypatch.setattr(_FakeEvent, "done", done)

    def way(name: str):
        def call():
            stream.now += gpu[name]
        return call

    trial = Trial({w: (0,) for w in host})
    for _ in range(len(host) * CALLS):  # per way and turn: an untimed call, then timed ones
        trial.run(way, (), {})
    return trial


def test_a_call_is_timed_by_the_longer_of_host_and_queued_gpu_work(monkeypatch):
    """No verdict while an event has not completed (no sync is made); then eager's 5 s of GPU
    work a call (1 s of host time) loses to autopar's 2 s."""
    trial = _gpu_trial(monkeypatch, {"eager": 1.0, "autopar": 2.0},
                       {"eager": 5.0, "autopar": 2.0}, done=False)
    assert trial.verdict() is None  # the GPU work is still queued
    monkeypatch.setattr(_FakeEvent, "done", True)
    assert trial.verdict() == "autopar"
    # the log and explain say which clock decided
    assert trial.summary() == "eager 5 s (host 1 s, GPU 5 s), autopar 2 s (host 2 s, GPU 2 s)"


def test_calls_are_launch_bound_where_the_gpu_waited_on_the_host(monkeypatch):
    """Inductor's calls with 1 s of host time and 1.1 s of GPU work (the GPU ran as fast as
    it was launched) are launch-bound, eager's 1 s against 5 s of queued GPU work are not, and
    host-only calls never are: only then is a second trial against CUDA graphs worth it."""
    trial = _gpu_trial(monkeypatch, {"eager": 1.0, "inductor": 1.0},
                       {"eager": 5.0, "inductor": 1.1}, done=True)
    assert trial.verdict() == "inductor"
    assert choose.launch_bound(trial, "inductor") and not choose.launch_bound(trial, "eager")
    host = Trial({"eager": (), "autopar": ()})
    _timed(host, [1.0] * (2 * TRIAL_CALLS))
    assert host.verdict() == "eager" and not choose.launch_bound(host, "eager")


def test_a_trial_waits_for_a_gpu_one_call_behind_without_timing_more_calls(monkeypatch):
    """The events of a call complete only once the next call has recorded its own: after its
    timed calls the trial runs the way timed last, untimed, until they complete (timing every
    call while waiting would record new pending events each call: no verdict, ever)."""
    class Event:
        recorded = 0

        def __init__(self, enable_timing: bool = False) -> None:
            self.index = None

        def record(self, stream) -> None:
            self.index = Event.recorded
            Event.recorded += 1

        def query(self) -> bool:
            return Event.recorded > self.index + 2

        def elapsed_time(self, end) -> float:
            return 0.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda i: None)
    monkeypatch.setattr(choose, "_clock", _fake_clock(eager=1.0, autopar=2.0))
    ran: list[str] = []
    ways = {"eager": lambda: ran.append("eager"), "autopar": lambda: ran.append("autopar")}
    trial = Trial({"eager": (0,), "autopar": (0,)})
    verdict = None
    for _ in range(8 * TRIAL_CALLS):
        trial.run(ways.__getitem__, (), {})
        verdict = trial.verdict()
        if verdict is not None:
            break
        if Event.recorded == 4 * COUNTED:  # the GPU catches up once the host waits
            Event.recorded += 2
    assert verdict == "eager"
    assert len(trial.calls) == 2 * COUNTED  # counted; an untimed one before each turn's
    assert ran[2 * CALLS:] == ["autopar"] * (len(ran) - 2 * CALLS)
    assert len(ran) > 2 * CALLS


def test_a_trial_times_only_the_gpus_each_way_touches(monkeypatch):
    recorded: list[int] = []

    class Event(_FakeEvent):
        def record(self, stream) -> None:
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda i: i)
    trial = Trial({"eager": (0,), "autopar": ()})
    trial.run(lambda w: (lambda: None), (), {})  # eager's first call: untimed
    assert recorded == []
    for _ in range(TURN_CALLS):
        trial.run(lambda w: (lambda: None), (), {})  # eager: before and after, on cuda:0
    assert recorded == [0, 0] * TURN_CALLS
    trial.run(lambda w: (lambda: None), (), {})  # autopar, untimed
    trial.run(lambda w: (lambda: None), (), {})  # autopar, host only: no event
    assert recorded == [0, 0] * TURN_CALLS


def test_a_way_that_fails_compiling_is_left_out_and_the_call_runs_eagerly(monkeypatch, caplog):
    """Inductor's way raising dynamo's error (here: an internal error) is dropped for that
    signature, logged once; the call that failed runs eagerly and the trial goes on."""
    def f(x):
        return (x * 2).sin() + 1

    def broken_inductor(name):
        def fail(*args, **kwargs):
            raise torch._dynamo.exc.InternalTorchDynamoError("the backend failed")
        return fail

    monkeypatch.setattr(choose, "_clock", _fake_clock(eager=1.0, inductor=0.5, autopar=2.0))
    g = autopar.compile(f, candidates="eager,inductor")
    g._make_way = broken_inductor
    x = torch.randn(8)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        for _ in range(1 + 4 * TRIAL_CALLS):
            torch.testing.assert_close(g(x), f(x))
    failed = [r.getMessage() for r in caplog.records if "failed where eager does not" in
              r.getMessage()]
    assert len(failed) == 1 and "the inductor way" in failed[0]
    assert g.kept_way((x,)) == "eager"


@needs_cxx
def test_inductor_is_a_candidate_and_wins_where_it_measures_faster(monkeypatch):
    """``candidates="auto"`` on this host (a C++ compiler: Inductor compiles CPU code): a
    chain of pointwise ops runs eager, Inductor (torch.compile's default) and nothing of
    autopar's own (one worker, nothing placed); with Inductor faster on the (fake) clock it is
    kept, and every call equals eager."""
    def chain(x):
        for _ in range(8):
            x = torch.tanh(x) * 0.5 + x
        return x

    monkeypatch.setattr(choose, "_clock", _fake_clock(eager=2.0, inductor=1.0))
    g = autopar.compile(chain, candidates="auto")
    x = torch.randn(64)
    for _ in range(2 + 4 * TRIAL_CALLS):
        torch.testing.assert_close(g(x), chain(x))
    assert g.kept_way((x,)) == "inductor"
    assert g.only is not None  # settled: calls go straight to Inductor's function


@needs_cxx
def test_autopar_and_inductor_ways_share_one_trace(monkeypatch):
    """With Inductor a candidate, dynamo traces the function once: its graph gets autopar's
    form and Inductor's (one ``compile_fx``, not a second ``torch.compile`` tracing again);
    the inductor way runs Inductor's form, the autopar way autopar's, both equal to eager."""
    from torch._inductor import compile_fx as inductor

    real, built, ran = inductor.compile_fx, [], []

    def counted(gm, example_inputs, *args, **kwargs):
        fn = real(gm, example_inputs, *args, **kwargs)
        built.append(gm)

        def call(*a):
            ran.append(1)
            return fn(*a)
        return call

    def chain(x):
        for _ in range(4):
            x = torch.tanh(x) * 0.5 + x
        return x

    monkeypatch.setattr(inductor, "compile_fx", counted)
    monkeypatch.setattr(choose, "_clock", _fake_clock(eager=2.0, inductor=1.0, autopar=3.0))
    g = autopar.compile(chain, devices="cpu:0,cpu:1", policy="round_robin", candidates="auto")
    x = torch.randn(64)
    for _ in range(2 + 6 * TRIAL_CALLS):
        torch.testing.assert_close(g(x), chain(x))
    assert g.kept_way((x,)) == "inductor" and len(built) == 1
    assert _unsettled(g.explain()) == (
        "chain, shapes (64,): runs inductor: inductor (eager 2 s, inductor 1 s, autopar 3 s)")
    before = len(ran)
    torch.testing.assert_close(g.way("autopar")(x), chain(x))
    assert len(ran) == before  # autopar's own form
    torch.testing.assert_close(g(x), chain(x))
    assert len(ran) == before + 1  # the kept way: Inductor's form


@needs_cxx
def test_sizes_that_vary_share_one_trial_and_are_not_captured_each(monkeypatch):
    """A new length each call. The first ``OWN_SIGNATURES`` lengths are captured (a graph and
    a plan each, here on two workers) and open trials of their own. Every later length is of
    their family (equal but for sizes): none is captured or planned; they go round eager and
    inductor (the trace dynamo made dynamic at the second length, compiled once by Inductor
    for every size), and the verdict runs each new length after. Every call equals eager."""
    def chain(x):
        for _ in range(4):
            x = torch.tanh(x) * 0.5 + x
        return x

    monkeypatch.setattr(choose, "_clock", _fake_clock(eager=2.0, inductor=1.0))
    g = autopar.compile(chain, devices="cpu:0,cpu:1", policy="round_robin", candidates="auto")
    xs = [torch.randn(3, n) for n in range(5, 5 + OWN_SIGNATURES + 2 * CALLS + 3)]
    for x in xs[:OWN_SIGNATURES]:
        torch.testing.assert_close(g(x), chain(x))
    planned = len(g.runner.executors)
    assert planned == OWN_SIGNATURES  # one static graph, placed, per length
    for x in xs[OWN_SIGNATURES:]:
        torch.testing.assert_close(g(x), chain(x))
    assert len(g.runner.executors) == planned
    torch.testing.assert_close(g(xs[0]), chain(xs[0]))  # a captured length, back once
    family = choose.family_of(g._key((xs[-1],), {}))
    assert g.kept[family] == "inductor" and g.kept_way((xs[-1],)) == "inductor"
    # the first lengths' own trials, which their sizes never came back to end, take the
    # family's verdict: no trial is left, and one way serves every call
    assert g.kept_way((xs[0],)) == g.kept_way((xs[1],)) == "inductor"
    assert g.trials == {} and g.only is not None
    said = g.explain()
    assert "chain, shapes (3, 5.." in said and " signatures ran its verdict): runs inductor: " \
        "inductor (eager 2 s, inductor 1 s)" in said
    assert "chain: every call runs inductor (one way for all" in said


def test_sizes_that_vary_run_eager_at_once_where_no_other_way_serves_any_size():
    """With Inductor not a candidate, the family's one way for any size is eager: a third
    length runs it without a trial (nothing captured), and so does every later one."""
    def f(x):
        return (x * 2).sum(-1)

    g = autopar.compile(f, devices="cpu:0,cpu:1", policy="round_robin",
                        candidates="eager,autopar")
    for n in range(4, 9):
        x = torch.randn(2, n)
        torch.testing.assert_close(g(x), f(x))
    assert len(g.runner.executors) == OWN_SIGNATURES
    assert g.kept_way((torch.randn(2, 8),)) == "eager"
    assert "shapes (2, 4..8) that vary (3 signatures ran its verdict): runs eager: eager " \
        "(the only way for any size)" in g.explain()


@pytest.mark.parametrize("writes", ["an input", "a buffer"])
def test_a_call_that_writes_in_place_is_never_repeated_to_check_it(writes):
    """The results check runs eager again on a way's first call only where that call wrote
    nothing: ``B.add_(A)`` (aot_autograd's epilogue copies the functional graph's value into
    ``B``) or a module updating a buffer is applied once a call, as eagerly."""
    if writes == "an input":
        def f(B, A):
            B.add_(A)
            return B.sum()
        g = autopar.compile(f, devices="cpu:0,cpu:1", policy="round_robin",
                            candidates="eager,autopar")
        B, A = torch.zeros(8), torch.ones(8)
        with torch.no_grad():
            for _ in range(4 * TRIAL_CALLS):
                g(B, A)
        assert torch.equal(B, torch.full((8,), 4.0 * TRIAL_CALLS))
    else:
        class Counting(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("calls", torch.zeros(()))
                self.lin = torch.nn.Linear(4, 4)

            def forward(self, x):
                self.calls += 1
                return self.lin(x).relu()
        model = Counting()
        g = autopar.compile(model, devices="cpu:0,cpu:1", policy="round_robin",
                            candidates="eager,autopar")
        with torch.no_grad():
            for _ in range(4 * TRIAL_CALLS):
                g(torch.randn(3, 4))
        assert model.calls.item() == 4 * TRIAL_CALLS


def test_a_module_gets_the_measured_choice_too(monkeypatch):
    """``autopar.compile(module)``: the module's forward is the dispatcher; its training flag
    is part of the signature (train and eval trace other graphs)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 2))
    monkeypatch.setattr(choose, "_clock", _fake_clock(eager=1.0, autopar=2.0))
    compiled = autopar.compile(model, devices="cpu:0,cpu:1", policy="round_robin")
    d = autopar.api.dispatcher_of(compiled)
    assert d is compiled.forward
    x = torch.randn(4, 8)
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x))
    model.train()
    compiled(x).sum().backward()
    assert len({k[-1] for k in [*d.kept, *d.trials]}) == 2  # eval and train apart


def _model_and_input():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval(), torch.randn(4, 8)


@pytest.mark.parametrize("mode", ["no_grad", "frozen parameters"])
def test_a_way_whose_results_are_not_eagers_is_left_out(monkeypatch, caplog, mode):
    """Inference (grad off, or grad on with nothing requiring it; nothing written): a way's
    first call is checked against eager on the same arguments; a way that is off is dropped,
    says why, and the call gets eager's."""
    import contextlib
    import logging

    from autopar.api import Dispatcher

    model, x = _model_and_input()
    if mode == "frozen parameters":
        model.requires_grad_(False)
    compiled = autopar.compile(model, devices="cpu:0,cpu:1", policy="round_robin",
                               candidates=["eager", "autopar"])
    wrong = Dispatcher.way

    def off_by_one(self, name):
        way = wrong(self, name)
        return (lambda *a, **k: way(*a, **k) + 1) if name == "autopar" else way

    monkeypatch.setattr(Dispatcher, "way", off_by_one)
    grad = torch.no_grad() if mode == "no_grad" else contextlib.nullcontext()
    with grad, caplog.at_level(logging.WARNING, logger="autopar"):
        for _ in range(12):
            torch.testing.assert_close(compiled(x), model(x))
    assert "the autopar way is left out: its results differ from eager's" in caplog.text
    assert "relative error" in caplog.text
    d = autopar.api.dispatcher_of(compiled)
    assert set(d.kept.values()) == {"eager"}
    # explain says why the one way left runs
    assert "runs eager: eager (autopar left out (its results differ from eager's: " \
        in d.explain()


def test_a_winner_whose_results_drift_is_left_out_when_kept(monkeypatch, caplog):
    """A way right on its first call (the check passes) and off later is checked again when
    the trial keeps it: dropped, the next fastest kept, every call eager's result or within
    the tolerance but the unchecked ones the trial timed."""
    import logging

    from autopar.api import Dispatcher

    model, x = _model_and_input()
    monkeypatch.setattr(choose, "TRIAL_MIN_S", 0.0)
    monkeypatch.setattr(choose, "_clock", _fake_clock(eager=2.0, autopar=1.0))
    compiled = autopar.compile(model, devices="cpu:0,cpu:1", policy="round_robin",
                               candidates=["eager", "autopar"])
    wrong = Dispatcher.way
    calls = {"n": 0}

    def drifting(self, name):
        way = wrong(self, name)
        if name != "autopar":
            return way

        def call(*a, **k):
            calls["n"] += 1
            return way(*a, **k) + (calls["n"] > 2)  # its first call and a repeat right
        return call

    monkeypatch.setattr(Dispatcher, "way", drifting)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autopar"):
        for _ in range(40):
            compiled(x)
        d = autopar.api.dispatcher_of(compiled)
        assert set(d.kept.values()) == {"eager"}
        torch.testing.assert_close(compiled(x), model(x))
    assert "the autopar way is left out at the end of its trial: its results differ from " \
        "eager's" in caplog.text
    assert "autopar left out (when kept, its results differ from eager's" in d.explain()


def test_a_way_whose_results_vary_from_call_to_call_is_left_out(monkeypatch, caplog):
    """Under autocast a way may be 5e-2 off eager (another rounding), but two of its calls on
    the same arguments must agree to 2e-3 where the outputs are float32: a way that varies more
    (a race in a kernel) is dropped at its first call."""
    import logging

    from autopar.api import Dispatcher

    class Float(torch.nn.Module):  # a float32 output, as HF ViT's layer norm gives on a GPU
        def forward(self, y):
            return y.float()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Float()).eval()
    x = torch.randn(4, 8)
    compiled = autopar.compile(model, devices="cpu:0,cpu:1", policy="round_robin",
                               candidates=["eager", "autopar"])
    wrong = Dispatcher.way

    def noisy(self, name):
        way = wrong(self, name)
        if name != "autopar":
            return way
        return lambda *a, **k: (lambda o: o + 0.01 * torch.randn_like(o))(way(*a, **k))

    monkeypatch.setattr(Dispatcher, "way", noisy)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
            caplog.at_level(logging.WARNING, logger="autopar"):
        want = model(x)
        assert want.dtype == torch.float32
        for _ in range(12):
            torch.testing.assert_close(compiled(x), want)
    assert "its results vary from call to call on the same arguments" in caplog.text
    assert set(autopar.api.dispatcher_of(compiled).kept.values()) == {"eager"}


def test_a_call_drawing_random_numbers_is_not_repeated_to_check_it(monkeypatch, caplog):
    """Dropout in a module left in training mode, under no_grad: each call draws other numbers,
    eager's too, so a way is not checked against a second call (it would be dropped for
    differing) and stays in the trial."""
    import logging

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).train()
    x = torch.randn(4, 8)
    monkeypatch.setattr(choose, "TRIAL_MIN_S", 0.0)
    compiled = autopar.compile(model, devices="cpu:0,cpu:1", policy="round_robin",
                               candidates=["eager", "autopar"])
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autopar"):
        for _ in range(30):
            compiled(x)
    d = autopar.api.dispatcher_of(compiled)
    assert d.runner.random and d.kept
    assert "left out" not in caplog.text


def test_a_way_within_the_tolerance_is_kept_in_the_trial(monkeypatch, caplog):
    import logging

    model, x = _model_and_input()
    monkeypatch.setattr(choose, "TRIAL_MIN_S", 0.0)
    compiled = autopar.compile(model, devices="cpu:0,cpu:1", policy="round_robin",
                               candidates=["eager", "autopar"])
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autopar"):
        for _ in range(30):
            torch.testing.assert_close(compiled(x), model(x))
    assert "left out" not in caplog.text
    assert autopar.api.dispatcher_of(compiled).kept  # a verdict, between both ways


def test_results_differ_by_dtype_and_structure():
    a = torch.ones(10)
    assert choose.results_differ(a, a.clone()) is None
    assert "relative error" in choose.results_differ(a * 1.01, a)
    assert choose.results_differ(a * 1.01, a, low_precision=True) is None  # under autocast
    half = torch.ones(10, dtype=torch.bfloat16)
    assert choose.results_differ(half * 1.01, half) is None
    assert "structure" in choose.results_differ((a, a), [a, a])
    assert "shape" in choose.results_differ(a[:5], a)
    assert "differs" in choose.results_differ(torch.arange(3), torch.arange(3) + 1)


@needs_cxx
def test_the_eager_way_of_a_training_step_runs_the_optimizer_as_built(monkeypatch):
    """Dynamo, tracing AdamW on GPU parameters, makes its param groups capturable for good
    (``autopar.capture.optim``; made by hand here, as on the host dynamo leaves them alone).
    The trial's eager turns, and every call once eager is kept, run the optimizer as built:
    eager AdamW refuses ``capturable=True`` on CPU parameters, so a call in dynamo's form
    raises. Every step's loss, and the parameters after, equal eager's."""
    monkeypatch.setattr(autopar.dispatch, "dynamo_changes_optimizers", lambda: True)
    monkeypatch.setattr(choose, "_clock", _fake_clock(eager=1.0, inductor=2.0))
    torch.manual_seed(0)
    model, ref, opt, ref_opt = adamw_pair(torch.nn.Linear(8, 4))
    g = autopar.compile(adamw_step(model, opt), candidates="eager,inductor")
    made = g._make_way

    def as_dynamo_on_a_gpu(name):
        way = made(name)

        def traced(*args, **kwargs):
            for group in opt.param_groups:
                group["capturable"] = True
            return way(*args, **kwargs)
        return traced

    g._make_way = as_dynamo_on_a_gpu
    ref_step = adamw_step(ref, ref_opt)
    for _ in range(2 + 4 * TRIAL_CALLS):
        x = torch.randn(16, 8)
        torch.testing.assert_close(g(x), ref_step(x), rtol=1e-4, atol=1e-5)
    assert g.kept_way((x,)) == "eager"
    assert opt.param_groups[0]["capturable"] is False
    assert "AdamW as built" in g.explain()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def _stood_in_step(monkeypatch, failing: str | None = None, alone_s: float = 0.5):
    """An AdamW step compiled with candidates eager, inductor and cudagraphs whose eager calls
    take 2 s of the trial's clock, its compiled ways stood in for (the host has no CUDA
    graphs): the shared trace's (``_make_way``) 1 s a call, a torch.compile of its own
    (``_make_alone``) ``alone_s``; the way named ``failing`` raises as dynamo would. Returns
    the compiled step, the eager pair to compare with and the ways made, in order."""
    clock, cost = [0.0], {"now": 2.0}
    monkeypatch.setattr(choose, "_clock", lambda: clock[0])
    torch.manual_seed(0)
    model, ref, opt, ref_opt = adamw_pair(torch.nn.Linear(8, 4))
    inner = adamw_step(model, opt)

    def step(x):
        if not torch.compiler.is_compiling():
            clock[0] += cost["now"]
        return inner(x)

    g = autopar.compile(step, candidates="eager,inductor,cudagraphs")
    made = []

    def stand_in(maker: str, seconds: float):
        def make(name):
            made.append((maker, name))

            def way(*args):
                if name == failing:
                    raise torch._dynamo.exc.Unsupported(f"no {name} here")
                cost["now"] = seconds
                try:
                    return step(*args)
                finally:
                    cost["now"] = 2.0
            return way
        return make

    g._make_way, g._make_alone = stand_in("shared trace", 1.0), stand_in("its own", alone_s)
    return g, (model, ref, adamw_step(ref, ref_opt)), made


def _steps_equal_eager(g, pair) -> torch.Tensor:
    """Enough steps for three trials, each loss equal to eager's; then the parameters."""
    model, ref, ref_step = pair
    for _ in range(1 + 6 * (TRIAL_CALLS + TURN_CALLS)):
        x = torch.randn(16, 8)
        torch.testing.assert_close(g(x), ref_step(x), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    return x


@needs_cxx
def test_a_launch_bound_training_step_is_timed_against_cuda_graph_trees(monkeypatch):
    """After a training step's trial in which Inductor's calls were launch-bound, a second
    trial times the winner against the cudagraphs way, which for a training call is a
    ``torch.compile(mode="reduce-overhead")`` of its own (``_make_alone``; here a stand-in
    taking 0.5 s a call, as the host has no CUDA graphs), not the shared trace's replay
    (``_make_way``), which replays inference graphs only. Kept where faster; every step's
    loss, and the parameters after, equal eager's."""
    monkeypatch.setattr(autopar.dispatch, "launch_bound", lambda trial, way: way == "inductor")
    g, pair, made = _stood_in_step(monkeypatch)
    x = _steps_equal_eager(g, pair)
    assert g.kept_way((x,)) == "cudagraphs"
    assert made == [("shared trace", "inductor"), ("its own", "cudagraphs")]
    assert _unsettled(g.explain()) == (
        "step, shapes (16, 8): runs cudagraphs: inductor (eager 2 s, inductor 1 s); then "
        "cudagraphs (inductor 1 s, cudagraphs 500 ms)")
    with torch.no_grad():  # an inference call's CUDA graphs are the shared trace's replay
        g._way("cudagraphs")
    assert made[-1] == ("shared trace", "cudagraphs")


@needs_cxx
@pytest.mark.parametrize("case", ["launch-bound", "gpu-bound", "graphs fail", "graphs lose"])
def test_a_training_step_on_a_gpu_is_tried_without_inductor_first(monkeypatch, case):
    """A training call on a GPU is timed first without Inductor: where eager's calls were
    launch-bound, the next trial is CUDA graphs (cudagraph trees, a torch.compile of their
    own), and Inductor's form of the shared trace is never built, so never lowered; where
    they were not, Inductor's form; where the CUDA graphs fail or lose, Inductor's form, and
    the CUDA graphs are not tried again after it (the GPU stood in for by fake events: this
    host has none). Every step's loss, and the parameters after, equal eager's."""
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda i: stream)
    monkeypatch.setattr(_FakeEvent, "done", True)
    gpus = (frozenset({0}), frozenset({0}))
    monkeypatch.setattr(autopar.api.Dispatcher, "_trial_gpus", lambda self, a, k: gpus)
    bound = {"launch-bound": ("eager",), "gpu-bound": ()}.get(case, ("eager", "inductor"))
    monkeypatch.setattr(autopar.dispatch, "launch_bound", lambda trial, way: way in bound)
    g, pair, made = _stood_in_step(monkeypatch,
                                   failing="cudagraphs" if case == "graphs fail" else None,
                                   alone_s=3.0 if case == "graphs lose" else 0.5)
    x = _steps_equal_eager(g, pair)
    if case == "launch-bound":
        assert g.kept_way((x,)) == "cudagraphs"
        assert made == [("its own", "cudagraphs")]  # Inductor's form never built
        assert _unsettled(g.explain()) == (
            "step, shapes (16, 8): runs cudagraphs: eager (eager 2 s); then cudagraphs "
            "(eager 2 s, cudagraphs 500 ms)")
    elif case == "gpu-bound":
        assert g.kept_way((x,)) == "inductor"
        assert made == [("shared trace", "inductor")]
    else:
        assert g.kept_way((x,)) == "inductor"
        assert made == [("its own", "cudagraphs"), ("shared trace", "inductor")]
        if case == "graphs fail":
            assert "cudagraphs left out (Unsupported: no cudagraphs here)" in g.explain()
        else:
            assert "then eager (eager 2 s, cudagraphs 3 s); then inductor" in g.explain()


def test_a_trial_times_each_way_as_a_kept_call_enters_it(monkeypatch):
    """Tiny calls are decided by fractions of a microsecond, so a trial times each way by the
    path a kept call takes: under ``guards="arguments"`` autopar's way at its Direct's head
    (the Dispatcher's route, past the Direct's frame), eager's after the check a repeated
    plain call pays (its tensors against the latest plain call's)."""
    from autopar import dispatch as api

    given: list[tuple[str, object]] = []
    as_kept = api.Dispatcher._as_kept
    monkeypatch.setattr(api.Dispatcher, "_as_kept",
                        lambda self, name: given.append((name, as_kept(self, name)))
                        or given[-1][1])
    checks = []
    same = api._same_signature
    monkeypatch.setattr(api, "_same_signature", lambda *a: checks.append(1) or same(*a))

    def one_op(x, y):
        return x @ y

    f = autopar.compile(one_op, guards="arguments", candidates="eager,autopar")
    x, y = torch.randn(5, 10), torch.randn(10, 5)
    for _ in range(1 + 4 * TRIAL_CALLS):
        torch.testing.assert_close(f(x, y), one_op(x, y))
    ways = {name for name, _ in given}
    assert ways == {"eager", "autopar"}
    direct = f.compiled
    assert all(got is direct.entries[0] for name, got in given if name == "autopar")
    eager = [got for name, got in given if name == "eager"]
    assert eager and all(g == f._plain_checked for g in eager)
    assert len(checks) >= len(eager)  # each eager turn paid the plain call's check


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # eager's fast path
def test_the_capturing_call_of_an_inference_is_checked_against_eager(caplog):
    """The first call of a signature runs autopar's way as it captures: where the call can be
    repeated, its results are compared with eager's before they are returned.
    ``nn.TransformerEncoder`` in eval under ``no_grad`` with a padding mask takes eager's fast
    path (nested tensors: padded rows are zeros), which dynamo's trace doesn't (they are
    not): every call, the first too, gets eager's results, even with autopar's way the only
    candidate."""
    import logging

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()

    def f(x, mask):
        return model(x, src_key_padding_mask=mask)

    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[1, -2:] = mask[2, -4:] = True
    x = torch.randn(3, 7, 16)
    compiled = autopar.compile(f, devices="cpu:0,cpu:1", candidates=["autopar"])
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autopar"):
        want = f(x, mask)
        for _ in range(3):
            torch.testing.assert_close(compiled(x, mask), want)
    assert "the capturing call's results are not eager's" in caplog.text
    assert "autopar left out (the capturing call's results differ from eager's" in \
        autopar.api.dispatcher_of(compiled).explain()


class _Stateful(torch.nn.Module):
    """Keeps state between calls: its output feeds the next call (an attribute or a buffer
    assigned anew, not written in place)."""

    def __init__(self, buffer: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)
        if buffer:
            self.register_buffer("state", torch.zeros(4))
        else:
            self.state = torch.zeros(4)

    def forward(self, x):
        out = self.fc(x) + self.state
        self.state = out.detach().mean(0)
        return out


@pytest.mark.parametrize("buffer", [False, True])
def test_a_module_that_keeps_state_between_calls_is_never_called_twice(buffer):
    """The measured choice checks a way by calling again on the same arguments; a call that
    changed Python state (here the module's) can't be repeated: every call equals eager's,
    the state too."""
    model, ref = _Stateful(buffer), _Stateful(buffer)
    compiled = autopar.compile(model, devices="cpu:0,cpu:1")
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(8):
            torch.testing.assert_close(compiled(x), ref(x))
    torch.testing.assert_close(model.state, ref.state)
    assert autopar.api.dispatcher_of(compiled).impure is not None


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")  # random.random
def test_hooks_python_random_and_generators_run_once_a_call():
    """A forward hook collecting features, ``random.random()`` and a ``torch.Generator``
    argument: each call runs them once, as eager does (the checks had called the function
    again: 13 hook calls for 10, other random numbers than eager's)."""
    import random

    feats: list = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    model[0].register_forward_hook(lambda m, i, o: feats.append(o))
    compiled = autopar.compile(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(10):
            compiled(x)
    assert len(feats) == 10

    def jitter(x):
        return x * random.random()

    def noisy(x, g):
        return x + torch.randn(x.shape, generator=g)

    for f, extra in ((jitter, ()), (noisy, (torch.Generator().manual_seed(1),))):
        compiled = autopar.compile(f)
        twin = [torch.Generator().manual_seed(1)] if extra else []
        random.seed(0)
        got = [compiled(x, *extra) for _ in range(5)]
        random.seed(0)
        want = [f(x, *twin) for _ in range(5)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


class _Cache:
    """A KV cache a call appends to, as Hugging Face's ``DynamicCache`` is (its tensors a few
    levels down: ``cache.layers[0].keys``)."""

    class Layer:
        def __init__(self) -> None:
            self.keys: torch.Tensor | None = None

    def __init__(self) -> None:
        self.layers = [self.Layer()]


def _attend(x, cache):
    layer = cache.layers[0]
    layer.keys = x if layer.keys is None else torch.cat([layer.keys, x], 1)
    return layer.keys.sum(1)


def test_a_call_that_appends_to_a_cache_among_its_arguments_runs_once():
    """The capturing call had been checked by calling eager again on the cache it had already
    appended to: the cache grew twice a call and eager's results of the wrong cache were
    returned. A Python object among the arguments that the call changes makes the function
    one whose calls are never repeated."""
    compiled = autopar.compile(_attend)
    cache, ref = _Cache(), _Cache()
    torch.manual_seed(0)
    xs = [torch.randn(2, 4 if k == 0 else 1) for k in range(4)]
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(compiled(x, cache), _attend(x, ref))
    assert cache.layers[0].keys.shape == ref.layers[0].keys.shape == (2, 7)
    assert autopar.api.dispatcher_of(compiled).impure is not None


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # 5.x's name
def test_gpt2_decoding_with_its_kv_cache_equals_eager():
    """HF's GPT-2 (eager attention) called with ``past_key_values``: each step's logits are
    eager's, and the cache holds each token once."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=32, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    compiled = autopar.compile(model)
    ids = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = compiled(ids, use_cache=True), model(ids, use_cache=True)
        for step in range(3):
            nxt = got.logits[:, -1:].argmax(-1)
            torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
            got = compiled(nxt, past_key_values=got.past_key_values, use_cache=True)
            want = model(nxt, past_key_values=want.past_key_values, use_cache=True)
            assert got.past_key_values.get_seq_length() == 5 + step
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)


def test_a_call_in_which_a_plan_traced_to_learn_is_not_counted(monkeypatch):
    """A plan's first calls may run traced to learn its host ops' times
    (autopar.runtime.learn): such a call syncs and times every copy, so a trial does not
    count it; the way's turn goes on until it has its counted calls."""
    import autopar.runtime.learn as learn_mod

    monkeypatch.setattr(choose, "_clock", _fake_clock(eager=1.0, autopar=1.0))
    trial = Trial({"eager": (), "autopar": ()})
    autopar_calls = []

    def way_of(w):
        def call():
            if w == "autopar":
                autopar_calls.append(1)
                if 2 <= len(autopar_calls) <= 3:  # its second and third calls traced
                    learn_mod._traced[0] += 1
        return call
    for _ in range(2 * (1 + TURN_CALLS) + 2):
        trial.run(way_of, (), {})
    assert [c[0] for c in trial.calls] == ["eager"] * TURN_CALLS + ["autopar"] * TURN_CALLS
    assert len(autopar_calls) == 1 + 2 + TURN_CALLS  # untimed, two traced, three counted


def test_explain_says_how_many_calls_and_seconds_a_verdict_took():
    """The trial's price, per signature: the calls from its first to its way kept (a kept
    call adds none) and their wall time, compiles included."""
    def f(x, y):
        return (x @ y).relu() + x.sum(1, keepdim=True)

    compiled = autopar.compile(f, devices="cpu:0", candidates=["eager", "inductor"])
    d = autopar.api.dispatcher_of(compiled)
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    calls = 0
    while not d.kept and calls < 500:
        compiled(x, y)
        calls += 1
    (key,) = d.kept
    assert calls > 1 and d.settled[key][0] == calls and d.settled[key][1] > 0
    assert f"; settled in {calls} calls, " in d.explain()
    compiled(x, y)
    assert d.settled[key][0] == calls


def test_a_trial_of_quick_calls_stops_at_its_bound_unless_asked_for_a_long_one(monkeypatch):
    """Each way gets its ``TRIAL_CALLS`` counted calls; past them, a trial stops at
    ``TRIAL_BUDGET_CALLS`` calls (untimed ones too). ``AUTOPAR_LONG_TRIAL=1`` times quick
    calls up to ``TRIAL_MAX_CALLS`` a way."""
    def made(trial: Trial) -> int:
        calls = 0
        while trial.next_way() is not None and calls < 1000:
            trial.run(lambda way: (lambda x: x + 1), (torch.ones(2),), {})
            calls += 1
        return calls

    monkeypatch.delenv("AUTOPAR_LONG_TRIAL", raising=False)
    bounded = Trial({"eager": (), "autopar": ()})
    calls = made(bounded)
    counted = [w for w, *_ in bounded.calls]
    assert choose.TRIAL_BUDGET_CALLS <= calls <= choose.TRIAL_BUDGET_CALLS + TURN_CALLS + 1
    assert min(counted.count("eager"), counted.count("autopar")) >= TRIAL_CALLS
    monkeypatch.setenv("AUTOPAR_LONG_TRIAL", "1")
    long = Trial({"eager": (), "autopar": ()})
    made(long)
    assert [w for w, *_ in long.calls].count("eager") == choose.TRIAL_MAX_CALLS
