"""``autopar.data_parallel`` on training steps as users write them: an ``nn.Module``'s own
parameters and buffers, a ``torch.optim`` optimizer, ``zero_grad``/``backward``/``clip``/
``step``, schedulers. Two logical CPU workers; after every step the loss, parameters, their
``.grad``, the buffers and the optimizer's state are eager's (float tolerance: reductions are
summed in another order)."""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.capture.state import find_state

CPUS = "cpu:0,cpu:1"
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # no bias before batch norm: its gradient is zero up to rounding,
    # which Adam would scale up to lr-sized noise (both ways, differently)
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True,
                                               weight_decay=1e-3),
    # fused kernels: the trace holds eager's own (autopar.capture.fused); without amsgrad or
    # momentum a list they write is empty, which functionalization alone fails on
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, fused=True),
    "adam-fused-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, fused=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, fused=True),
    "sgd-fused-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adagrad-fused": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
}


def _step_of(model, opt, clip: float | None = 1.0, set_to_none: bool = True,
             out=torch.Tensor.detach, loss_fn=F.cross_entropy):
    def step(x, y, scale: float = 1.0):
        opt.zero_grad(set_to_none=set_to_none)
        loss = loss_fn(model(x), y)
        if scale != 1.0:
            loss = loss * scale
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return out(loss)
    return step


def _batches(n: int, batch: int = 10, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(n)]


def assert_same_training(model, ref, opt, ref_opt) -> None:
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, **TOL, msg=name)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"{name}.grad")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert opt.state[p].keys() == ref_opt.state[q].keys()
        for key, value in ref_opt.state[q].items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(opt.state[p][key], value, **TOL, msg=key)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_twenty_module_steps_with_torch_optim_split_over_two_workers_equal_eager(optimizer):
    model, ref = _net(), _net()
    opt, ref_opt = OPTIMIZERS[optimizer](model.parameters()), \
        OPTIMIZERS[optimizer](ref.parameters())
    step = autopar.data_parallel(_step_of(model, opt), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt)
    for i, (x, y) in enumerate(_batches(20)):
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
        # the first call makes the optimizer's state: it runs eagerly; the rest are split
        assert (step.last is None) == (i == 0), i
    assert step.last.sharded.devices == ("cpu:0", "cpu:1")
    assert_same_training(model, ref, opt, ref_opt)


@pytest.mark.parametrize(("options", "error"), [
    ({"shards": 3}, "shards=3: between 1 and 2"),
    ({"shards": 2, "batch_argnums": (5,)}, "batch_argnums names argument 5")])
def test_a_mistake_in_the_options_is_raised_before_any_step_is_applied(options, error):
    """The first call makes the optimizer's state and runs as written; the options were
    checked only where a call is traced, so that call applied a step and the next raised."""
    model = _net()
    opt = OPTIMIZERS["adamw"](model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = autopar.data_parallel(_step_of(model, opt), devices=CPUS, **options)
    for x, y in _batches(2):
        with pytest.raises((ValueError, TypeError), match=error):
            step(x, y)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not opt.state


@pytest.mark.parametrize("optimizer", ["adamw-fused", "sgd-fused"])
def test_a_fused_optimizer_in_a_step_traced_twice_equals_eager(optimizer, caplog):
    """The plain trace, then ``torch.func.functionalize`` over it (code that tests for
    ``FakeTensor``s fails the functional trace): the fused kernel's functional form there too."""
    from torch._subclasses.fake_tensor import FakeTensor

    model, ref = _net(), _net()
    opt, ref_opt = OPTIMIZERS[optimizer](model.parameters()), \
        OPTIMIZERS[optimizer](ref.parameters())

    def checked_of(m, o):
        def step(x, y):
            if not isinstance(x, FakeTensor) and bool((x > -1e9).all()):
                x = x + 0  # a data-dependent branch the functional trace can't take
            return _step_of(m, o)(x, y)
        return step

    step = autopar.data_parallel(checked_of(model, opt), devices=CPUS, shards=2)
    ref_step = checked_of(ref, ref_opt)
    with caplog.at_level(logging.INFO, logger="autopar.capture.step"):
        for x, y in _batches(4):
            torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
    assert "traced plain, then functionalized" in caplog.text
    assert step.last is not None and step.last.sharded.devices == ("cpu:0", "cpu:1")
    assert any("_fused_" in str(n.op) for n in step.last.step.graph.ops)
    assert_same_training(model, ref, opt, ref_opt)


@pytest.mark.parametrize("kind", ["grad", "post-accumulate"])
def test_hooks_on_parameters_are_traced(kind):
    """A hook on a parameter's gradient (``register_hook``: halved) or on its accumulated
    ``.grad`` (``register_post_accumulate_grad_hook``: a row frozen) runs in the split step as
    eagerly: the trace's own leaves carry the user's hooks (they had been skipped, silently)."""
    def hooked() -> torch.nn.Module:
        m = _net()
        if kind == "grad":
            m[0].weight.register_hook(lambda g: g * 0.5)
        else:
            def freeze_row(p):
                p.grad[0] = 0.0
            m[3].weight.register_post_accumulate_grad_hook(freeze_row)
        return m

    model, ref = hooked(), hooked()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = autopar.data_parallel(_step_of(model, opt, None), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt, None)
    for x, y in _batches(4):
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
    assert step.last is not None
    assert_same_training(model, ref, opt, ref_opt)
    if kind != "grad":
        assert not model[3].weight.grad[0].any()


def test_held_gradients_zeroed_in_place_are_traced():
    model, ref = _net(), _net()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), \
        torch.optim.SGD(ref.parameters(), lr=0.1)
    step = autopar.data_parallel(_step_of(model, opt, None, set_to_none=False), devices=CPUS,
                                 shards=2)
    ref_step = _step_of(ref, ref_opt, None, set_to_none=False)
    grads = None
    for k, (x, y) in enumerate(_batches(4)):
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
        assert (step.last is not None) == (k > 0)  # the first call holds no .grad: as written
        if grads is None:
            grads = [p.grad for p in model.parameters()]
    # zero_grad(set_to_none=False) and backward wrote into the same .grad tensors, as eagerly
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert_same_training(model, ref, opt, ref_opt)


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1),
                                  lambda ps: torch.optim.Adagrad(ps, lr=0.1)],
                         ids=["sgd", "adagrad"])
def test_an_optimizer_with_its_state_made_is_captured_once(make):
    """SGD without momentum and Adagrad have their state before the first step, whose
    parameters hold no ``.grad`` (backward then leaves them, for every later call): that call
    runs as written, and one capture serves the rest (there were two, each a plan)."""
    model, ref = _net(), _net()
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    step = autopar.data_parallel(_step_of(model, opt), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt)
    for k, (x, y) in enumerate(_batches(5)):
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
        assert (step.last is not None) == (k > 0)
    assert_same_training(model, ref, opt, ref_opt)
    assert len(step._compiled) == 1


def test_a_first_call_holding_grads_whose_optimizer_makes_its_state_runs_as_written(caplog):
    """Parameters holding a ``.grad`` on the first call (a backward before it) are traced,
    and AdamW makes its moments in that call: the trace is refused (``StateNotReady``), the
    call runs as written, the next is captured; all equal to eager."""
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    x = torch.randn(4, 8)
    for m in (model, ref):
        m(x).sum().backward()
    step = autopar.data_parallel(_step_of(model, opt), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt)
    with caplog.at_level(logging.INFO, logger="autopar"):
        for k, (x, y) in enumerate(_batches(3)):
            torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
            assert (step.last is not None) == (k > 0)
    assert "makes its state in this call" in caplog.text
    assert_same_training(model, ref, opt, ref_opt)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
    lambda ps: torch.optim.NAdam(ps, lr=1e-2), lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    lambda ps: torch.optim.RAdam(ps, lr=1e-2), lambda ps: torch.optim.ASGD(ps, lr=1e-2)],
    ids=["rmsprop", "nadam", "adamax", "radam", "asgd"])
def test_other_optimizers_split_or_say_why_not(make, caplog):
    """RMSprop, NAdam and Adamax split with one capture; RAdam and ASGD branch on a number
    computed from their state (RAdam's ``rho_t > 5``, ASGD's ``mu != 1``), which no trace
    decides: they run unsplit and say where. All equal to eager."""
    model, ref = _net(), _net()
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    step = autopar.data_parallel(_step_of(model, opt), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        for x, y in _batches(4):
            torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
    assert_same_training(model, ref, opt, ref_opt)
    if isinstance(opt, torch.optim.RAdam | torch.optim.ASGD):
        assert step.last is None
        assert f"torch/optim/{type(opt).__name__.lower()}.py:" in caplog.text and \
            "branches on a number computed from tensors, which a trace can't decide" in caplog.text
        assert "runs unsplit, through autopar.compile: can't trace the step at" in \
            step.explain()  # explain says why, not only the log
    else:
        assert step.last is not None and len(step._compiled) == 1


def _followed_by_one_capture(make_opt, make_sched, steps: int, key: str) -> tuple[set, Any]:
    """``steps`` steps split on two CPU workers and eagerly, ``make_sched(opt)`` stepped
    outside the step after each: every step equal to eager's, training equal after, one
    capture. The values of param group 0's ``key`` the steps saw, and the optimizer."""
    model, ref = _net(), _net()
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    sched, ref_sched = make_sched(opt), make_sched(ref_opt)
    step = autopar.data_parallel(_step_of(model, opt), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt)
    seen = set()
    for x, y in _batches(steps):
        seen.add(opt.param_groups[0][key])
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
        sched.step()
        ref_sched.step()
    assert_same_training(model, ref, opt, ref_opt)
    assert sum(c is not None for c in step._compiled.values()) == 1
    return seen, opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_scheduler_stepped_outside_the_step_is_followed_by_one_capture(name):
    """Linear warm-up then decay, a new float ``lr`` every step (what Hugging Face's trainer
    steps): the ``lr`` is an input of the trace, so one capture serves every value, and every
    step equals eager's."""
    def warm_then_decay(k: int) -> float:
        return (k + 1) / 3 if k < 3 else 0.9 ** (k - 2)

    rates, opt = _followed_by_one_capture(
        OPTIMIZERS[name], lambda o: torch.optim.lr_scheduler.LambdaLR(o, warm_then_decay), 8,
        "lr")
    assert len(rates) == 8 and type(opt.param_groups[0]["lr"]) is float


def test_a_value_is_baked_in_until_it_changes_then_an_input():
    """Constant hyperparameters stay constants of the trace (a host number a step can't be in
    a CUDA graph); ``StepLR`` changes ``lr`` at the fourth call: one more capture, with ``lr``
    an input, serves every later value; all equal to eager."""
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (model, ref))
    sched, ref_sched = (torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)
                        for o in (opt, ref_opt))
    step = autopar.data_parallel(_step_of(model, opt), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt)
    for k, (x, y) in enumerate(_batches(9)):
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
        assert step.varying == (set() if k < 3 else {(0, 0, "lr", None)})
        sched.step()
        ref_sched.step()
    assert_same_training(model, ref, opt, ref_opt)
    assert sum(c is not None for c in step._compiled.values()) == 2
    assert "inputs of the trace, having changed between calls: opt.param_groups[0]['lr']" \
        in step.explain()


def test_one_cycle_learning_rate_and_betas_need_one_capture():
    """``OneCycleLR`` steps AdamW's ``lr`` and its ``beta1`` every step (cycle_momentum):
    both are inputs of the trace, one capture serves every step, equal to eager's."""
    betas, _ = _followed_by_one_capture(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=10), 7,
        "betas")
    assert len(betas) == 7


def test_one_cycle_with_a_fused_adamw_lifts_lr_and_captures_each_beta1():
    """A fused kernel takes ``lr`` as a tensor and ``beta1`` only as a float: under
    ``OneCycleLR`` the ``lr`` is an input of the trace, each new ``beta1`` a capture of its
    own; every step equal to eager's."""
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, ref))
    sched, ref_sched = (torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=10)
                        for o in (opt, ref_opt))
    step = autopar.data_parallel(_step_of(model, opt), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt)
    for x, y in _batches(4):
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
        sched.step()
        ref_sched.step()
    assert_same_training(model, ref, opt, ref_opt)
    assert step.varying == {(0, 0, "lr", None)}  # beta1 is in the signature instead
    captured = [c for c in step._compiled.values() if c is not None]
    assert len(captured) == 3  # the first call runs as written; then one beta1 each
    assert any(n.op.overloadpacket is torch.ops.aten._fused_adamw and "tensor_lr" in str(n.op)
               for n in captured[-1].step.graph.ops if hasattr(n.op, "overloadpacket"))


@pytest.mark.parametrize("nesterov", [False, True])
def test_one_cycle_momentum_of_sgd_needs_one_capture(nesterov):
    """``OneCycleLR`` steps SGD's ``momentum`` every step (0.95 down to 0.85 and back), and
    SGD branches on ``momentum != 0``: the value is an input of the trace, its sign known to
    it, so one capture serves every step, equal to eager's (each value was a capture, and
    past the eighth the step ran unsplit)."""
    momenta, _ = _followed_by_one_capture(
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=nesterov),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=10), 7,
        "momentum")
    assert len(momenta) == 7


def test_a_momentum_set_to_zero_is_another_capture_equal_to_eager():
    """The trace knows momentum's sign: a group whose momentum becomes 0 (SGD then skips its
    buffer) is another signature, traced again, never the graph of a nonzero momentum."""
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (model, ref))
    step = autopar.data_parallel(_step_of(model, opt, clip=None), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt, clip=None)
    for k, (x, y) in enumerate(_batches(6)):
        if k == 3:
            for o in (opt, ref_opt):
                o.param_groups[0]["momentum"] = 0.0
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
    assert_same_training(model, ref, opt, ref_opt)
    assert sum(c is not None for c in step._compiled.values()) == 2


def test_a_tuple_lifted_in_part_keeps_its_baked_items_in_the_signature():
    """Only ``beta1`` lifted (``OneCycleLR`` cycles it): another ``beta1`` is the same
    signature, another ``beta2`` (baked into the trace) is another."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = _step_of(model, opt)
    args = next(iter(_batches(1)))

    def signature(betas):
        opt.param_groups[0]["betas"] = betas
        return find_state(step, args, {(0, 0, "betas", 0)}).signature

    assert signature((0.9, 0.999)) == signature((0.5, 0.999)) != signature((0.9, 0.9))


def test_a_step_returning_loss_item_splits_and_returns_eagers_numbers():
    """``return loss.item(), k``, as hand-written loops log the loss: the graph reads the loss
    on the host, the step returns a Python float (and the constant), and it is split."""
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))

    def logged(model, opt):
        return _step_of(model, opt, clip=None, out=lambda loss: (loss.item(), 3))

    step = autopar.data_parallel(logged(model, opt), devices=CPUS, shards=2)
    ref_step = logged(ref, ref_opt)
    for x, y in _batches(5):
        (got, k), (want, _) = step(x, y), ref_step(x, y)
        assert type(got) is float and k == 3
        assert got == pytest.approx(want, rel=1e-5)
    assert_same_training(model, ref, opt, ref_opt)
    assert "split over cpu:0, cpu:1" in step.explain()


def test_past_the_signature_limit_new_signatures_run_unsplit_and_say_so(monkeypatch, caplog):
    """A float argument that changes every call is baked into each capture: past
    MAX_SIGNATURES captures, a new one runs unsplit (one warning, in explain too) and every
    step still equals eager's."""
    import autopar.dataparallel

    monkeypatch.setattr(autopar.dataparallel, "MAX_SIGNATURES", 2)
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (model, ref))

    step = autopar.data_parallel(_step_of(model, opt, clip=None), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt, clip=None)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        for k, (x, y) in enumerate(_batches(6)):
            scale = 1.0 + k / 8
            torch.testing.assert_close(step(x, y, scale), ref_step(x, y, scale), **TOL)
    assert_same_training(model, ref, opt, ref_opt)
    assert len(step._compiled) == 2
    full = [r for r in caplog.records if "2 signatures captured" in r.getMessage()]
    assert len(full) == 1 and "2 signatures captured" in step.explain()


def test_a_tensor_learning_rate_is_an_input_not_a_new_capture():
    model, ref = _net(), _net()
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=torch.tensor(0.1), momentum=0.9)
    step = autopar.data_parallel(_step_of(model, opt), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt)
    for k, (x, y) in enumerate(_batches(6)):
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
        for o in (opt, ref_opt):
            o.param_groups[0]["lr"].fill_(0.1 / (k + 2))
    assert_same_training(model, ref, opt, ref_opt)
    assert sum(c is not None for c in step._compiled.values()) == 1


def test_a_scheduler_stepped_inside_the_step_runs_eagerly_and_says_why(caplog):
    model, ref = _net(), _net()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), \
        torch.optim.SGD(ref.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)

    def with_scheduler(inner, s):
        def step(x, y):
            loss = inner(x, y)
            s.step()
            return loss
        return step

    step = autopar.data_parallel(with_scheduler(_step_of(model, opt), sched), devices=CPUS)
    ref_step = with_scheduler(_step_of(ref, ref_opt), ref_sched)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        for x, y in _batches(3):
            torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
    assert "the step changes lr of opt's param group 0" in caplog.text
    assert step.last is None
    assert_same_training(model, ref, opt, ref_opt)


def test_a_module_the_step_cannot_see_is_named_and_the_step_runs_eagerly(caplog):
    model, ref = _net(), _net()
    holder = types.SimpleNamespace(model=model)  # not a module, dict, list or optimizer

    def step(x, y):
        loss = F.cross_entropy(holder.model(x), y)
        loss.backward()
        with torch.no_grad():
            for p in holder.model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        return loss.detach()

    def ref_step(x, y):
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        return loss.detach()

    dp = autopar.data_parallel(step, devices=CPUS, batch_argnums=(0, 1))
    (x, y), = _batches(1)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        torch.testing.assert_close(dp(x, y), ref_step(x, y), **TOL)
    assert "running step unsplit" in caplog.text and dp.last is None
    assert "reads a tensor that is not its argument" in caplog.text
    assert f"test_dataparallel_modules.py:{step.__code__.co_firstlineno + 1}" in caplog.text


def _gelu_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def test_a_bf16_autocast_step_is_split_and_stays_within_bf16_rounding_of_eager():
    model, ref = _gelu_net(), _gelu_net()
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), \
        torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def step_of(m, o):
        def step(x, y):
            o.zero_grad()
            with torch.autocast("cpu", torch.bfloat16):
                loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            return loss.detach()
        return step

    step = autopar.data_parallel(step_of(model, opt), devices=CPUS, shards=2)
    ref_step = step_of(ref, ref_opt)
    for x, y in _batches(6):
        # bf16 partial sums of the weight gradients are rounded per shard: bf16's tolerance
        torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=2e-2, atol=2e-2)
    assert step.last is not None and step.last.sharded.devices == ("cpu:0", "cpu:1")
    assert any(n.meta.dtype == torch.bfloat16 for n in step.last.step.graph.ops
               if hasattr(n.meta, "dtype"))  # the casts autocast made are in the graph
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)


def _scaled_step_of(m, o, s, clip: bool):
    def step(x, y):
        o.zero_grad()
        with torch.autocast("cpu", torch.float16):
            loss = F.cross_entropy(m(x), y)
        s.scale(loss).backward()
        if clip:
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        s.step(o)
        s.update()
        return loss.detach()
    return step


SCALED = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize(("optimizer", "clip"), [("adamw-fused", False), ("adamw-fused", True),
                                                 ("adamw", True), ("sgd-momentum", False)])
def test_a_grad_scaler_step_splits_and_equals_eager(optimizer, clip):
    """fp16 autocast with a ``GradScaler`` (its scale and growth tracker are state of the
    trace). A fused kernel checks for infs and skips itself on the device; another optimizer's
    step runs, and what it wrote keeps its old value where ``found_inf`` says so (eager reads
    ``found_inf`` on the host and branches). A batch holding an inf skips its update and
    halves the scale, as eagerly; with ``unscale_`` and clipping too."""
    model, ref = _gelu_net(), _gelu_net()
    opt, ref_opt = (SCALED[optimizer](m.parameters()) for m in (model, ref))
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) for _ in range(2))
    step = autopar.data_parallel(_scaled_step_of(model, opt, scaler, clip), devices=CPUS,
                                 shards=2)
    ref_step = _scaled_step_of(ref, ref_opt, ref_scaler, clip)
    for k, (x, y) in enumerate(_batches(6)):
        if k == 3:
            x = x.clone()
            x[0, 0] = float("inf")
        torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=1e-3, atol=1e-3,
                                   equal_nan=True)
        assert (step.last is not None) == (k > 0), k  # the first call makes the scale
        assert scaler.get_scale() == ref_scaler.get_scale()
    assert scaler.get_scale() == 2.0 ** 7  # the inf's step backed off
    assert torch.equal(scaler._growth_tracker, ref_scaler._growth_tracker)
    fp16 = {"rtol": 1e-3, "atol": 1e-4}  # fp16 partial sums, rounded per shard, then the update
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **fp16)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-3)
        assert opt.state[p].keys() == ref_opt.state[q].keys()
        for key, value in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=1e-2, atol=1e-3,
                                       msg=key)  # moments and momentum: sums of gradients
    if "step" in ref_opt.state[next(ref.parameters())]:
        assert float(opt.state[next(model.parameters())]["step"]) == 5  # 6 steps, 1 skipped


@pytest.mark.parametrize("first_overflows", [False, True])
def test_a_grad_scaler_step_traced_again_finds_its_stages_as_eager_left_them(first_overflows):
    """A trace runs the step's ``unscale_`` and ``step`` on the GradScaler, which mark its
    per-optimizer stage in place; a second trace (a smaller last batch: a new signature), or
    the call after a first step that overflowed, ran on marks left by the first and raised
    ``unscale_() is being called after step()``, which eager never raises."""
    model, ref = _gelu_net(), _gelu_net()
    opt, ref_opt = (SCALED["adamw"](m.parameters()) for m in (model, ref))
    init = 2.0 ** (18 if first_overflows else 8)  # 2 ** 18: the first step overflows, not after
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=init) for _ in range(2))
    step = autopar.data_parallel(_scaled_step_of(model, opt, scaler, True), devices=CPUS,
                                 shards=2)
    ref_step = _scaled_step_of(ref, ref_opt, ref_scaler, True)
    sizes = [10, 10, 10, 7, 10]
    for k, ((x, y), size) in enumerate(zip(_batches(len(sizes)), sizes)):
        x, y = x[:size], y[:size]
        torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=1e-3, atol=1e-3,
                                   equal_nan=True)
        assert scaler.get_scale() == ref_scaler.get_scale(), k
        assert not scaler._per_optimizer_states  # update() left it empty, as eagerly
    assert step.last is not None and step.last.sharded is not None
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


def test_gradients_of_channels_last_weights_come_back_in_their_layout():
    """Autograd gives a parameter's ``.grad`` its strides (a channels-last convolution's weight:
    channels last); the split's gradient is a sum of the shards', compact. It is handed back in
    eager's layout, with eager's values, and the momentum built from it too."""
    def conv_net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GELU(),
                                   torch.nn.Conv2d(8, 4, 3), torch.nn.Flatten(),
                                   torch.nn.Linear(100, 2)).to(memory_format=torch.channels_last)
    model, ref = conv_net(), conv_net()
    x = torch.randn(6, 3, 9, 9).contiguous(memory_format=torch.channels_last)
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    opt, ref_opt = (OPTIMIZERS["sgd-momentum"](m.parameters()) for m in (model, ref))
    step = autopar.data_parallel(_step_of(model, opt, clip=None), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt, clip=None)
    for _ in range(3):
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
    assert step.last is not None and step.last.sharded is not None
    weights = [(p, q) for p, q in zip(model.parameters(), ref.parameters()) if p.ndim == 4]
    assert weights and all(not p.is_contiguous() for p, _ in weights)
    for p, q in weights:
        assert p.grad.stride() == q.grad.stride() == p.stride()
        torch.testing.assert_close(p.grad, q.grad, **TOL)
        assert opt.state[p]["momentum_buffer"].stride() == \
            ref_opt.state[q]["momentum_buffer"].stride()


def test_train_and_eval_are_separate_captures():
    """Batch norm computes differently in eval(): a graph traced in train() must not serve it."""
    model, ref = _net(), _net()

    def infer_of(m):
        def infer(x):
            return m(x)
        return infer

    step = autopar.data_parallel(infer_of(model), devices=CPUS, shards=2, batch_argnums=(0,))
    (x, _), = _batches(1)
    with torch.no_grad():
        torch.testing.assert_close(step(x), infer_of(ref)(x), **TOL)  # train(): batch stats
        model.eval()
        ref.eval()
        torch.testing.assert_close(step(x), infer_of(ref)(x), **TOL)  # eval(): running stats
    assert sum(c is not None for c in step._compiled.values()) == 2


def test_the_step_counts_torch_optim_keeps_on_the_host_are_found():
    """State.host_step_counts: Adam's step counts (one a parameter), found among the state's
    tensors by identity; none where the optimizer is capturable (its counts live on the
    parameters' device)."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()

    def step(x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    state = find_state(step, (torch.randn(4, 3),))
    counts = state.host_step_counts()
    assert sorted(id(state.tensors[j]) for j in counts) == \
        sorted(id(s["step"]) for s in opt.state.values())
    assert all(state.names[j].endswith("['step']") for j in counts) and len(counts) == 2
    opt.param_groups[0]["capturable"] = True
    assert find_state(step, (torch.randn(4, 3),)).host_step_counts() == []


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum"])
def test_steps_with_segments_replayed_as_graphs_equal_eager(optimizer, monkeypatch):
    """Each worker's segments replayed as CUDA graphs (a stand-in with their memory semantics,
    on the CPU): parameters, replicas and optimizer state are read where they live, never
    copied in, and the .grads, new values and replicas' next values are written back out of
    the graphs' static buffers (which the next replay overwrites); every step equals eager's."""
    from autopar.runtime import executor as executor_module
    from test_cudagraphs import StandInGraphs

    backend = StandInGraphs()
    monkeypatch.setattr(executor_module, "graph_devices",
                        lambda devices, rule: [] if rule is None else list(devices))
    monkeypatch.setattr(executor_module, "_GRAPH_BACKEND", backend)
    model, ref = _net(), _net()
    opt, ref_opt = OPTIMIZERS[optimizer](model.parameters()), \
        OPTIMIZERS[optimizer](ref.parameters())
    step = autopar.data_parallel(_step_of(model, opt), devices=CPUS, shards=2,
                                 cuda_graphs=True)
    ref_step = _step_of(ref, ref_opt)
    for x, y in _batches(8):
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
        assert_same_training(model, ref, opt, ref_opt)
    segs = step.last.run.segments
    assert {s.program.device for s in segs} == {"cpu:0", "cpu:1"}
    assert all(s.status == "captured" for s in segs) and backend.captures == len(segs)
    read = {d: {s._static_in[k].data_ptr() for s in segs if s.program.device == d
                for k in s.in_place} for d in ("cpu:0", "cpu:1")}
    held = {p.data_ptr() for p in model.parameters()}
    assert read["cpu:0"] & held and read["cpu:1"] & held  # one pool: no replicas
    def storages(ts) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in ts}
    # ...or views of them, or of an earlier graph's static outputs
    assert storages(s._static_in[k] for s in segs for k in s.in_place) <= \
        storages(model.parameters()) | storages(model.buffers()) | \
        storages(_optimizer_state(opt)) | storages(o for s in segs for o in s._static_out)


def _optimizer_state(opt) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


_SEEN = {"calls": 0}
_LOSSES: list = []


def test_a_step_that_changes_python_state_runs_as_written_and_says_why(caplog):
    """A counter in a global dict and a list of losses, changed by the step: a replayed graph
    would not change them again, and its trace ran the step's Python on fake tensors. The
    trace is refused once (not again per signature), what it changed put back: every call
    runs as written, so the counter, the list and the training are eager's."""
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

    def counting_of(m, o):
        inner = _step_of(m, o)

        def step(x, y):
            loss = inner(x, y)
            _SEEN["calls"] += 1
            _LOSSES.append(loss)
            return loss
        return step

    _SEEN["calls"], _LOSSES[:] = 0, []
    step = autopar.data_parallel(counting_of(model, opt), devices=CPUS, shards=2)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        for x, y in _batches(4):
            step(x, y)
    assert _SEEN["calls"] == 4 and len(_LOSSES) == 4
    assert all(type(v) is torch.Tensor for v in _LOSSES)  # no fake tensor left behind
    assert caplog.text.count("in Python as it runs") == 1
    assert "_SEEN['calls'], _LOSSES in Python as it runs" in caplog.text
    ref_step = _step_of(ref, ref_opt)
    for x, y in _batches(4):
        ref_step(x, y)
    assert_same_training(model, ref, opt, ref_opt)


def test_a_module_that_keeps_a_tensor_from_its_forward_is_left_with_a_real_one():
    """A module that stores an auxiliary loss as an attribute in forward (as mixture-of-experts
    layers do), read by the step: the trace's fake tensor is not left there."""
    class Aux(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)
            self.aux = None

        def forward(self, x):
            h = self.lin(x)
            self.aux = h.pow(2).mean()
            return h

    torch.manual_seed(0)
    model = Aux()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y) + 0.1 * model.aux
        loss.backward()
        opt.step()
        return loss.detach()

    split = autopar.data_parallel(step, devices=CPUS, shards=2)
    for x, y in _batches(3):
        split(x, y)
    assert split.last is None and "model.aux" in split.never
    assert type(model.aux) is torch.Tensor and float(model.aux.detach()) > 0


def test_a_python_value_the_step_reads_is_part_of_its_signature():
    """A float in a dict the step reads (``cfg["scale"]``), changed between calls: each value
    is a capture of its own, as dynamo guards it, never the graph of the old value."""
    cfg = {"scale": 1.0}
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

    def scaled_loss(out, y):
        return F.cross_entropy(out, y) * cfg["scale"]

    step = autopar.data_parallel(_step_of(model, opt, None, loss_fn=scaled_loss), devices=CPUS,
                                 shards=2)
    ref_step = _step_of(ref, ref_opt, None, loss_fn=scaled_loss)
    for k, (x, y) in enumerate(_batches(5)):
        cfg["scale"] = 1.0 + (k >= 3)
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
    assert step.last is not None
    assert sum(c is not None for c in step._compiled.values()) == 2
    assert_same_training(model, ref, opt, ref_opt)


def test_a_step_that_returns_nothing_splits():
    """The most common way to write a step: no ``return``."""
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    inner, ref_inner = _step_of(model, opt), _step_of(ref, ref_opt)

    def step(x, y):
        inner(x, y)

    split = autopar.data_parallel(step, devices=CPUS, shards=2)
    for x, y in _batches(4):
        assert split(x, y) is None
        ref_inner(x, y)
    assert split.last is not None
    assert_same_training(model, ref, opt, ref_opt)


class _Report:
    """A result object no pytree knows (a user's plain class, as HF's ``DynamicCache``)."""

    def __init__(self, loss, logits, note):
        self.loss, self.parts, self.note = loss, {"logits": logits}, note


def test_a_plain_object_the_step_returns_is_a_new_one_holding_eagers_values():
    from torch._subclasses.fake_tensor import FakeTensor

    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))

    def step_of(m, o):
        def step(x, y):
            o.zero_grad()
            logits = m(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            o.step()
            return _Report(loss.detach(), logits.detach(), "made in the step")
        return step

    split = autopar.data_parallel(step_of(model, opt), devices=CPUS, shards=2)
    ref_step = step_of(ref, ref_opt)
    got = [split(x, y) for x, y in _batches(4)]
    want = [ref_step(x, y) for x, y in _batches(4)]
    assert split.last is not None and split.last.sharded is not None
    for g, w in zip(got, want):
        assert type(g) is _Report and g.note == "made in the step"
        torch.testing.assert_close(g.loss, w.loss, **TOL)
        torch.testing.assert_close(g.parts["logits"], w.parts["logits"], **TOL)
    assert got[2] is not got[3] and got[2].parts is not got[3].parts
    assert not any(isinstance(t, FakeTensor) or type(t) is not torch.Tensor
                   for t in (got[3].loss, got[3].parts["logits"]))
    assert_same_training(model, ref, opt, ref_opt)


def test_a_step_returning_what_no_graph_can_give_back_runs_unsplit_and_says_why(caplog):
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

    def step_of(m, o):
        def step(x, y):
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            return loss.detach(), m  # a module: not rebuilt from a graph's tensors
        return step

    split = autopar.data_parallel(step_of(model, opt), devices=CPUS, shards=2)
    ref_step = step_of(ref, ref_opt)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        for x, y in _batches(3):
            (loss, m), (ref_loss, _) = split(x, y), ref_step(x, y)
            assert m is model
            torch.testing.assert_close(loss, ref_loss, **TOL)
    assert split.last is None
    assert "the step returns a Sequential, which holds what a graph can't give back" in \
        caplog.text


def test_one_hot_targets_split_and_an_out_of_range_class_still_raises():
    """``F.one_hot`` checks its classes with ``_assert_async`` (an op that makes no tensor,
    which had stopped the capture: "has no output metadata"); it runs as eager's does. (No
    batch norm: the failing call's forward, as written, updates its statistics eagerly and
    under torch.compile not.)"""
    model, ref = (torch.nn.Sequential(*(list(_net())[k] for k in (0, 2, 3))) for _ in range(2))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

    def one_hot_loss(out, y):
        return F.mse_loss(out.softmax(-1), F.one_hot(y, 4).float())

    step = autopar.data_parallel(_step_of(model, opt, None, loss_fn=one_hot_loss),
                                 devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt, None, loss_fn=one_hot_loss)
    for x, y in _batches(3):
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
    assert step.last is not None
    assert_same_training(model, ref, opt, ref_opt)
    if torch.__version__ < "2.13":  # its decomposition of one_hot (eq with an arange) has no
        return  # range check at all, under torch.compile too: a class out of range is a zero row
    x, y = _batches(1)[0]
    y[2] = 4
    for s in (step, ref_step):  # the plan fails, then the step as written, as eagerly
        with pytest.raises(RuntimeError):
            s(x, y)
    assert_same_training(model, ref, opt, ref_opt)  # what eager's failed call left (no .grad)
    assert model[0].weight.grad is None
    for x, y in _batches(2, seed=3):  # a failure that is the user's keeps the plan
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
        assert step.last is not None
    assert_same_training(model, ref, opt, ref_opt)


def test_a_step_that_logs_still_splits():
    """A logger's level cache fills as the step logs: not state of the step's (loggers are not
    looked into), so the step still splits."""
    log = logging.getLogger("autopar-test-train")
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    inner = _step_of(model, opt)

    def step(x, y):
        loss = inner(x, y)
        log.debug("a step")
        return loss

    split = autopar.data_parallel(step, devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt)
    for x, y in _batches(3):
        log.setLevel(logging.WARNING)  # (clears the caches: the next call's trace fills them)
        torch.testing.assert_close(split(x, y), ref_step(x, y), **TOL)
    assert split.last is not None and split.never is None


def test_a_plan_that_fails_runs_its_signature_unsplit_and_applies_nothing_twice(caplog):
    """A plan's program that raises (a kernel refusing what the plan hands it) after it ran:
    nothing of the call was written back, so the call runs as written, once, and so does
    every later call of the signature; the reason is logged once and ``explain`` names it."""
    model, ref = _net(), _net()
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    step = autopar.data_parallel(_step_of(model, opt), devices=CPUS, shards=2)
    ref_step = _step_of(ref, ref_opt)
    batches = _batches(6)
    for x, y in batches[:3]:
        torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
    compiled = step.last
    assert compiled is not None
    run = compiled.run

    def fails(args):
        run(args)  # the whole program ran; what it made is dropped
        raise RuntimeError("expected scalar type Float but found Double")
    compiled.run = fails
    with caplog.at_level(logging.WARNING, logger="autopar"):
        for x, y in batches[3:]:
            torch.testing.assert_close(step(x, y), ref_step(x, y), **TOL)
            assert step.last is None
    failed = [r for r in caplog.records if "its plan failed" in r.getMessage()]
    assert len(failed) == 1 and "expected scalar type Float" in failed[0].getMessage()
    assert "runs unsplit: its plan failed: RuntimeError" in step.explain()
    assert_same_training(model, ref, opt, ref_opt)


def test_a_plan_failing_where_the_step_fails_too_raises_the_users_error():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = autopar.data_parallel(_step_of(model, opt), devices=CPUS, shards=2)
    for x, y in _batches(2):
        step(x, y)
    compiled = step.last

    def fails(args):
        raise RuntimeError("the plan's own failure")
    compiled.run = fails
    x, y = _batches(1)[0]
    with pytest.raises(IndexError, match="out of bounds"):
        step(x, y + 4)  # a class past the model's 4: eager's error, not the plan's
