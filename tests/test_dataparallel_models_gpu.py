"""``autopar.data_parallel`` on Hugging Face training steps on GPUs: on one GPU, the captured
step (module state and torch.optim lifted into the trace, CUDA optimizers' defaults) run by
autopar's executor equals eager, and the default keeps the step as written; on two GPUs the
split equals eager on one. Skips cleanly without CUDA (and the two-GPU case without two)."""

from __future__ import annotations

import copy

import pytest
import torch

import autopar

pytest.importorskip("transformers")

from autopar.bench.models import MODELS, inputs_for, train_step, without_dropout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {"rtol": 1e-4, "atol": 1e-4}
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),  # foreach on CUDA
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


@pytest.fixture(autouse=True)
def _no_tf32():
    was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was


def _pair(name: str, optimizer: str):
    model = without_dropout(MODELS[name].make("tiny").train().cuda())
    ref = copy.deepcopy(model)
    return model, ref, OPTIMIZERS[optimizer](model.parameters()), \
        OPTIMIZERS[optimizer](ref.parameters())


def _run(name, optimizer, steps, **options):
    m = MODELS[name]
    model, ref, opt, ref_opt = _pair(name, optimizer)
    keys = list(inputs_for(m, "tiny", batch=4)[1])
    step = autopar.data_parallel(train_step(model, opt, keys),
                                 batch_argnums=tuple(range(len(keys))), **options)
    ref_step = train_step(ref, ref_opt, keys)
    for i in range(steps):
        kwargs = inputs_for(m, "tiny", batch=4, seed=i, device="cuda:0")[1]
        got, want = step(*kwargs.values()), ref_step(*kwargs.values())
        assert got.device == want.device
        torch.testing.assert_close(got, want, **TOL)
    for (key, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        assert got.device == want.device and got.shape == want.shape
        # in norm, per tensor: AdamW turns a gradient that is zero but for summation order
        # into a step of up to lr either way (BERT's word embeddings on an H200, 2026-12-01:
        # one element of 16,384 off by 1.3e-4 after six steps, 5e-5 of the tensor's norm)
        err = torch.linalg.vector_norm((got - want).float())
        assert err <= TOL["rtol"] * torch.linalg.vector_norm(want.float()) + TOL["atol"], \
            f"{key}: relative error in norm {err / torch.linalg.vector_norm(want.float()):.2e}"
    for p, q in zip(model.parameters(), ref.parameters()):
        for key, value in ref_opt.state[q].items():
            got = opt.state[p][key]
            if key == "step":  # a dynamo way moves Adam's step count to the parameter's
                got = got.to(value.device)  # device, as torch.compile does (move_step_if_cpu)
            torch.testing.assert_close(got, value, **TOL, msg=key)
    return step


@pytest.mark.parametrize(("name", "optimizer"), [("gpt2", "adamw"), ("bert", "adamw"),
                                                 ("hf-resnet", "sgd-momentum")])
def test_captured_step_on_one_gpu_equals_eager(name, optimizer):
    step = _run(name, optimizer, 6, devices="cuda:0", shards=1)  # autopar's plan, unsplit
    assert step.last is not None and step.last.sharded is None


def test_the_default_on_one_gpu_keeps_the_step_as_written():
    step = _run("gpt2", "adamw", 4)  # devices="auto": the host and one GPU: nothing to split
    assert step.last is None
    assert "unsplit (autopar.compile's choice)" in step.explain()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(("name", "optimizer"), [("gpt2", "adamw"),
                                                 ("hf-resnet", "sgd-momentum")])
def test_split_over_two_gpus_equals_eager_on_one(name, optimizer):
    step = _run(name, optimizer, 10, devices="cuda:0,cuda:1", shards=2)
    assert step.last.sharded.devices == ("cuda:0", "cuda:1")
