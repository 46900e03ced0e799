"""``autopar.data_parallel`` on two logical CPU workers: real runs, compared with eager.

Each test runs a step eagerly on one copy of the tensors and through autopar on another, and
compares losses, parameters and gradients (reductions are summed in another order: float
tolerance).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import autopar
from _steps import bn_inputs, bn_step, mlp_inputs
from autopar.bench.workloads import w6_train_step

CPUS = "cpu:0,cpu:1"


def twin(tensors: tuple) -> tuple:
    return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)


def assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.detach(), w.detach(), rtol=1e-5, atol=1e-6)


def optimizer_step(o: torch.optim.Optimizer):
    """A step of ``o`` on its argument ``w``: loss, backward, ``o.step()``, ``o.zero_grad()``."""
    def step(w, x):
        loss = (x @ w).square().sum()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()
    return step


def test_twenty_w6_steps_on_a_batch_of_seven_equal_eager():
    ref = mlp_inputs(batch=7)
    mine = twin(ref)
    params = mine[:4]
    step = autopar.data_parallel(w6_train_step, devices=CPUS, shards=2)
    for _ in range(20):
        torch.testing.assert_close(step(*mine), w6_train_step(*ref), rtol=1e-5, atol=1e-6)
    assert step.last is not None and step.last.sharded.sizes == (4, 3)
    assert_same(mine, ref)
    assert all(p is q for p, q in zip(params, mine[:4]))  # updated in place, same tensors
    assert all(p.grad is None for p in mine[:4])


def test_uneven_batches_on_three_workers():
    ref = mlp_inputs(batch=10, seed=3)
    mine = twin(ref)
    step = autopar.data_parallel(w6_train_step, devices="cpu:0,cpu:1,cpu:2", shards=3)
    for _ in range(3):
        torch.testing.assert_close(step(*mine), w6_train_step(*ref), rtol=1e-5, atol=1e-6)
    assert step.last.sharded.sizes == (4, 3, 3)
    assert_same(mine, ref)


def test_batch_norm_steps_equal_eager():
    ref = bn_inputs()
    mine = twin(ref)
    step = autopar.data_parallel(bn_step, devices=CPUS, shards=2)
    for _ in range(20):
        torch.testing.assert_close(step(*mine), bn_step(*ref), rtol=1e-5, atol=1e-5)
    assert step.last.sharded.unsplit == {}  # split exactly (see test_shard)
    assert_same(mine, ref)


def test_gradients_the_step_leaves_are_set_then_a_held_grad_runs_eagerly():
    def grads_only(w, x):
        loss = (x @ w).square().mean()
        loss.backward()
        return loss.detach()

    g = torch.Generator().manual_seed(2)
    ref = (torch.randn(3, 2, generator=g).requires_grad_(), torch.randn(9, 3, generator=g))
    mine = twin(ref)
    step = autopar.data_parallel(grads_only, devices=CPUS, shards=2)
    torch.testing.assert_close(step(*mine), grads_only(*ref))
    torch.testing.assert_close(mine[0].grad, ref[0].grad)
    assert step.last is not None
    step(*mine)  # .grad is set now: accumulating runs eagerly, as written
    grads_only(*ref)
    assert step.last is None
    torch.testing.assert_close(mine[0].grad, ref[0].grad)


def test_inference_splits_the_named_batch_arguments():
    def predict(x, w):
        return F.softmax(x @ w, dim=1), (x @ w).sum()

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(11, 5, generator=g), torch.randn(5, 3, generator=g)
    step = autopar.data_parallel(predict, devices=CPUS, batch_argnums=(0,), shards=2)
    probs, total = step(x, w)
    want = predict(x, w)
    torch.testing.assert_close(probs, want[0])
    torch.testing.assert_close(total, want[1])
    assert probs.shape == (11, 3) and step.last.sharded.sizes == (6, 5)
    with pytest.raises(TypeError, match="batch_argnums"):
        autopar.data_parallel(predict, devices=CPUS)(x, w)


def test_steps_that_cannot_be_captured_run_eagerly_with_a_warning(caplog):
    def reads_a_value(w, x):
        loss = (x @ w).sum() * float((x > 0).sum())  # data-dependent Python number
        loss.backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
            w.grad = None
        return loss.detach()

    g = torch.Generator().manual_seed(5)
    ref = (torch.randn(3, 2, generator=g).requires_grad_(), torch.randn(4, 3, generator=g))
    mine = twin(ref)
    step = autopar.data_parallel(reads_a_value, devices=CPUS)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        torch.testing.assert_close(step(*mine), reads_a_value(*ref))
    assert "running reads_a_value unsplit" in caplog.text
    assert step.last is None
    assert step._unsplit.compiled is not None  # unsplit calls go through autopar.compile
    assert_same(mine, ref)


def test_an_optimizer_that_steps_an_argument_is_traced_with_it():
    w = torch.randn(3, 2, requires_grad=True)
    ref_w = w.detach().clone().requires_grad_()
    opt, ref_opt = torch.optim.SGD([w], lr=0.1), torch.optim.SGD([ref_w], lr=0.1)

    step = autopar.data_parallel(optimizer_step(opt), devices=CPUS, batch_argnums=(1,), shards=2)
    for k in range(3):
        x = torch.randn(4, 3)
        torch.testing.assert_close(step(w, x), optimizer_step(ref_opt)(ref_w, x))
        assert (step.last is not None) == (k > 0) and w.grad is None  # the first: as written
    torch.testing.assert_close(w.detach(), ref_w.detach())


def test_shards_must_fit_the_devices():
    with pytest.raises(ValueError, match="shards must be a positive int"):
        autopar.data_parallel(w6_train_step, devices=CPUS, shards=0)
    step = autopar.data_parallel(w6_train_step, devices=CPUS, shards=3)
    with pytest.raises(ValueError, match="shards=3: between 1 and 2"):
        step(*mlp_inputs())


@pytest.mark.parametrize("weighted", [False, True])
def test_mean_cross_entropy_with_ignored_targets_and_class_weights_equals_eager(weighted):
    def step_fn(w, x, t, cw):
        loss = F.cross_entropy(x @ w, t, weight=cw if weighted else None, ignore_index=1)
        loss.backward()
        with torch.no_grad():
            w -= 0.5 * w.grad
            w.grad = None
        return loss.detach()

    g = torch.Generator().manual_seed(6)
    w = torch.randn(4, 3, generator=g).requires_grad_()
    x, t = torch.randn(9, 4, generator=g), torch.tensor([1, 0, 2, 1, 1, 0, 2, 2, 1])
    cw = torch.tensor([0.2, 1.0, 3.0])
    ref, mine = (w, x, t, cw), twin((w, x, t, cw))
    step = autopar.data_parallel(step_fn, devices=CPUS, batch_argnums=(1, 2), shards=2)
    for _ in range(3):
        torch.testing.assert_close(step(*mine), step_fn(*ref), rtol=1e-5, atol=1e-6)
    assert step.last.sharded.unsplit == {}
    assert_same(mine, ref)


def test_a_modules_own_parameters_updated_by_hand_are_traced():
    torch.manual_seed(0)
    lin, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref.load_state_dict(lin.state_dict())

    def step_of(model):
        def step(x):
            loss = model(x).sum()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            return loss.detach()
        return step

    step = autopar.data_parallel(step_of(lin), devices=CPUS, batch_argnums=(0,), shards=2)
    for _ in range(3):
        x = torch.randn(4, 3)
        torch.testing.assert_close(step(x), step_of(ref)(x))
        assert step.last is not None
    assert_same(list(lin.parameters()), list(ref.parameters()))
    assert all(p.grad is None for p in lin.parameters())


def test_the_step_that_makes_an_optimizers_state_runs_as_written(caplog):
    """AdamW's first step makes its moments: that call runs the step itself (not a compile of
    it: dynamo's trace of a real model's whole step costs seconds and is never used again), no
    warning; the second is traced and split."""
    w = torch.randn(3, 2, requires_grad=True)
    ref_w = w.detach().clone().requires_grad_()
    opt, ref_opt = torch.optim.AdamW([w], lr=0.1), torch.optim.AdamW([ref_w], lr=0.1)

    step = autopar.data_parallel(optimizer_step(opt), devices=CPUS, batch_argnums=(1,), shards=2)
    with caplog.at_level(logging.INFO, logger="autopar"):
        x = torch.randn(4, 3)
        torch.testing.assert_close(step(w, x), optimizer_step(ref_opt)(ref_w, x))
    assert step.last is None and step._unsplit.compiled is None
    assert "the step's first call, no parameter holding a .grad: runs as written" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    for _ in range(2):
        x = torch.randn(4, 3)
        torch.testing.assert_close(step(w, x), optimizer_step(ref_opt)(ref_w, x))
        assert step.last is not None
    assert step._unsplit.compiled is None
    torch.testing.assert_close(w.detach(), ref_w.detach())
    torch.testing.assert_close(opt.state[w]["exp_avg"], ref_opt.state[ref_w]["exp_avg"])


def test_a_step_whose_code_tests_for_fake_tensors_is_traced_twice_and_split():
    """Code that skips a data-dependent check for ``FakeTensor``s (Hugging Face's mask code on
    some versions) fails the functional trace, which wraps them: the step is traced plain,
    then functionalized, and split as before."""
    from torch._subclasses.fake_tensor import FakeTensor

    def checked_step(w1, b1, w2, b2, x, y):
        if not isinstance(x, FakeTensor) and bool((x > -1e9).all()):
            x = x + 0  # what a real tensor takes: a data-dependent branch
        return w6_train_step(w1, b1, w2, b2, x, y)

    ref = mlp_inputs(batch=8)
    mine = twin(ref)
    step = autopar.data_parallel(checked_step, devices=CPUS, shards=2)
    for _ in range(3):
        torch.testing.assert_close(step(*mine), checked_step(*ref), rtol=1e-5, atol=1e-6)
    assert step.last is not None and step.last.sharded.sizes == (4, 4)
    assert_same(mine, ref)


def test_a_step_that_changes_an_arguments_shape_in_place_is_refused_by_name():
    """A functional graph can't replay ``x.unsqueeze_(0)`` (a metadata write into an input):
    the capture refuses it, naming the tensor."""
    from autopar.capture.fx import Unsupported
    from autopar.capture.step import capture_step

    def reshaping_step(w, x):
        x.unsqueeze_(0)
        loss = (x[0] @ w).sum()
        loss.backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
        w.grad = None
        return loss.detach()

    w = torch.randn(3, 2, requires_grad=True)
    with pytest.raises(Unsupported, match="changes the shape, strides or storage of argument "
                                          "tensor 1 in place"):
        capture_step(reshaping_step, (w, torch.randn(4, 3)))
