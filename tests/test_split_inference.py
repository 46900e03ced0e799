"""Batch-split inference through ``autopar.compile``: the ``split`` way (an inference call with
its batch split over the named devices of its kind) on two logical CPU workers, the same shard
pass and executor as GPUs. Its results are eager's; it is tried only for inference calls the
model predicts long enough, and kept only when measured faster (or when it is the lone
candidate, as these tests ask, to check the kept path)."""

from __future__ import annotations

import logging

import pytest
import torch

import autopar
from autopar.api import dispatcher_of

CPUS = "cpu:0,cpu:1"


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 8)).eval()


@pytest.fixture
def any_size(monkeypatch):
    """Every inference call long enough to try a split (the tests' models are small)."""
    monkeypatch.setattr(autopar.dispatch, "SPLIT_MIN_S", 0.0)


@pytest.mark.parametrize("batch", [64, 65])
def test_a_module_kept_split_equals_eager_and_explains_the_split(any_size, batch):
    model = _mlp()
    compiled = autopar.compile(model, devices=CPUS, candidates="split")
    d = dispatcher_of(compiled)
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(batch, 64, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
            # the first call of a signature is autopar's capture; the next ones are split
            assert (d.split.last is not None) == (seed > 0)
        assert d.kept_way((x,)) == "split"  # (grad mode is part of the signature)
    assert sum(d.split.last.sharded.sizes) == batch and len(d.split.last.sharded.sizes) == 2
    text = d.explain()
    assert "runs split" in text and "split over cpu:0, cpu:1" in text


def test_explain_says_why_a_call_over_two_workers_is_not_split(monkeypatch):
    """A call the model predicts too short for a split, and one with grad on, keep another
    way; ``explain`` names why the split was not tried (it had said "the only candidate")."""
    model = _mlp()
    compiled = autopar.compile(model, devices=CPUS, candidates="split")
    d = dispatcher_of(compiled)
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert d.split.last is None
    assert "split not tried (the call is predicted at" in d.explain()
    assert "a split needs to pay for its copies" in d.explain()
    monkeypatch.setattr(autopar.dispatch, "SPLIT_MIN_S", 0.0)  # long enough, but with grad on:
    compiled = autopar.compile(model, devices=CPUS, candidates="split")
    compiled(x).sum().backward()  # the model's parameters require grad
    assert "split not tried (not an inference call" in dispatcher_of(compiled).explain()


def test_keyword_arguments_and_a_padding_mask_split_with_the_batch(any_size):
    """A Hugging Face encoder called with ``attention_mask=``: both split along the batch."""
    pytest.importorskip("transformers")
    from autopar.bench.models import MODELS, inputs_for

    m = MODELS["bert"]
    model = m.make("tiny").eval()
    compiled = autopar.compile(model, devices=CPUS, candidates="split")
    d = dispatcher_of(compiled)
    with torch.no_grad():
        for seed in range(2):
            kwargs = inputs_for(m, "tiny", batch=5, seed=seed)[1]
            got = compiled(**kwargs).last_hidden_state
            torch.testing.assert_close(got, model(**kwargs).last_hidden_state,
                                       rtol=1e-5, atol=1e-5)
    assert d.split.last.sharded.sizes in ((3, 2), (2, 3))


def test_the_split_is_timed_against_eager_and_the_faster_kept(any_size, caplog):
    model = _mlp()
    compiled = autopar.compile(model, devices=CPUS, candidates="eager,split")
    d = dispatcher_of(compiled)
    x = torch.randn(64, 64)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="autopar.trials"):
        for _ in range(400):  # a trial: up to 50 counted calls a way
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
            if d.kept:
                break
        assert d.kept_way((x,)) in ("eager", "split")
    assert "timing calls eager, split" in caplog.text
    assert "split" in d.verdicts[next(iter(d.kept))][0]


def test_no_split_with_grad_on_one_device_or_for_a_short_call(monkeypatch):
    model = _mlp()
    x = torch.randn(64, 64)
    with torch.no_grad():  # predicted shorter than SPLIT_MIN_S: not worth a capture
        monkeypatch.setattr(autopar.dispatch, "SPLIT_MIN_S", 1e3)
        d = dispatcher_of(autopar.compile(model, devices=CPUS, candidates="eager,split"))
        d(x)
        assert d.kept_way((x,)) == "eager" and not d.split._compiled
        monkeypatch.setattr(autopar.dispatch, "SPLIT_MIN_S", 0.0)
        one = dispatcher_of(autopar.compile(model, devices="cpu:0", candidates="eager,split"))
        assert one.split is None  # one device of the kind: nothing to split over
    d = dispatcher_of(autopar.compile(model, devices=CPUS, candidates="eager,split"))
    d(x)  # grad on: a forward for training is not split by this way
    assert d.kept_way((x,)) == "eager" and not d.split._compiled


def test_a_frozen_model_under_grad_mode_splits_and_its_results_need_no_grad(any_size):
    """Grad mode on, no parameter requiring grad (a frozen encoder, eval code that forgot
    ``no_grad``): the call is an inference one, so it splits like one under ``no_grad``."""
    model = _mlp().requires_grad_(False)
    compiled = autopar.compile(model, devices=CPUS, candidates="split")
    d = dispatcher_of(compiled)
    for seed in range(3):
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))
        got = compiled(x)
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
        assert not got.requires_grad
    assert d.kept_way((x,)) == "split" and d.split.last is not None


def test_a_split_whose_results_differ_is_dropped(any_size, monkeypatch, caplog):
    """The results check covers the split way like every way: made wrong on purpose, it is
    left out and the call returns eager's result."""
    from autopar.dataparallel import DataParallelStep

    run = DataParallelStep._run
    monkeypatch.setattr(DataParallelStep, "_run", lambda self, c, t: run(self, c, t) + 1.0)
    model = _mlp()
    compiled = autopar.compile(model, devices=CPUS, candidates="eager,split")
    d = dispatcher_of(compiled)
    x = torch.randn(64, 64)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autopar.trials"):
        for _ in range(6):
            torch.testing.assert_close(compiled(x), model(x))
        assert d.kept_way((x,)) == "eager"
    assert "the split way is left out: its results differ" in caplog.text


def test_eval_batch_norm_splits_per_row_with_the_running_statistics(any_size):
    """A convolutional model in ``eval()``: batch norm reads its running statistics, so each
    shard normalizes its own rows with them: nothing is left unsplit, the statistics are not
    touched, the result is eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 4))
    with torch.no_grad():  # running statistics that are not the defaults
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model.eval()
    before = [b.clone() for b in model.buffers()]
    compiled = autopar.compile(model, devices=CPUS, candidates="split")
    d = dispatcher_of(compiled)
    x = torch.randn(9, 3, 16, 16)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    sharded = d.split.last.sharded
    assert sharded.sizes == (5, 4) and not sharded.unsplit
    for b, was in zip(model.buffers(), before):
        assert torch.equal(b, was)
