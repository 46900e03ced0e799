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


def _as_close_as_eager(what: str, got: torch.Tensor, want: torch.Tensor,
                       truth: torch.Tensor) -> None:
    """``got`` (autopar's) equals ``want`` (eager's) within ``TOL`` in norm, or is no further
    from ``truth`` (the same steps in float64) than 3x eager is: AdamW turns a gradient that is
    zero but for summation order into a step of up to lr either way, so two correct float32
    runs differ there by rounding that AdamW amplified (BERT's word embeddings on an H200,
    2026-12-01/02: 5e-5, then 7e-4 of the tensor's norm after six steps)."""
    got, want, truth = got.double(), want.double(), truth.to(got.device).double()
    err = torch.linalg.vector_norm(got - want)
    if err <= TOL["rtol"] * torch.linalg.vector_norm(want) + TOL["atol"]:
        return
    ours, eagers = (torch.linalg.vector_norm(t - truth) for t in (got, want))
    assert ours <= 3 * eagers, (f"{what}: {err / torch.linalg.vector_norm(want):.2e} of its "
                                f"norm off eager's, and {ours:.3g} off float64's where eager "
                                f"is {eagers:.3g} off")


def _run(name, optimizer, steps, **options):
    m = MODELS[name]
    model, ref, opt, ref_opt = _pair(name, optimizer)
    truth = copy.deepcopy(ref).double()  # the referee where float32 runs may differ
    truth_opt = OPTIMIZERS[optimizer](truth.parameters())
    keys = list(inputs_for(m, "tiny", batch=4)[1])
    step = autopar.data_parallel(train_step(model, opt, keys),
                                 batch_argnums=tuple(range(len(keys))), **options)
    ref_step, truth_step = train_step(ref, ref_opt, keys), train_step(truth, truth_opt, keys)
    for i in range(steps):
        kwargs = inputs_for(m, "tiny", batch=4, seed=i, device="cuda:0")[1]
        got, want = step(*kwargs.values()), ref_step(*kwargs.values())
        truth_step(*(t.double() if t.is_floating_point() else t for t in kwargs.values()))
        assert got.device == want.device
        torch.testing.assert_close(got, want, **TOL)
    for (key, got), want, true in zip(model.state_dict().items(), ref.state_dict().values(),
                                      truth.state_dict().values()):
        assert got.device == want.device and got.shape == want.shape
        _as_close_as_eager(key, got, want, true)
    for p, q, r in zip(model.parameters(), ref.parameters(), truth.parameters()):
        for key, value in ref_opt.state[q].items():
            got = opt.state[p][key]
            if key == "step":  # a dynamo way moves Adam's step count to the parameter's
                got = got.to(value.device)  # device, as torch.compile does (move_step_if_cpu)
            _as_close_as_eager(key, got, value, truth_opt.state[r][key])
    return step


def test_a_cuda_batch_norm_is_traced_with_its_running_statistics_written_back():
    """The step's trace records torch's decomposition of a CUDA batch norm (new running
    statistics as outputs, written back after the call), not ``cudnn_batch_norm``, whose
    kernel updates them in place unseen: a CUDA graph's warm-up and replay both did (one
    H200, 2026-12-05: every running mean of hf-resnet 0.1-0.5 of its norm off eager's)."""
    from autopar.capture.state import find_state
    from autopar.capture.step import capture_step
    bn = torch.nn.BatchNorm2d(3).cuda()

    def fn(x):
        return bn(x).sum()

    args = [torch.randn(4, 3, 5, 5, device="cuda", requires_grad=True)]
    state = find_state(fn, args)
    step = capture_step(fn, args, state=state)
    names = {str(n.op) for n in step.graph.ops}
    assert not any("cudnn" in name for name in names), names
    assert {state.names[j - 1] for j in step.mutated} == {"bn.running_mean", "bn.running_var",
                                                          "bn.num_batches_tracked"}


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


def test_scheduled_lr_and_momentum_under_cuda_graphs_on_one_gpu_equal_eager():
    """``OneCycleLR`` steps SGD's ``lr`` and ``momentum`` every call: inputs of the trace from
    the first capture, numbers the host reads each call, which no CUDA graph may bake in
    (their ops stay on streams). Ten steps with ``cuda_graphs=True`` equal eager's, one
    capture."""
    from _steps import batches_on, module_step, small_net

    model, ref = small_net("cuda:0"), small_net("cuda:0")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (model, ref))
    sched, ref_sched = (torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=12)
                        for o in (opt, ref_opt))
    step = autopar.data_parallel(module_step(model, opt), devices="cuda:0", shards=1,
                                 cuda_graphs=True)
    ref_step = module_step(ref, ref_opt)
    for x, y in batches_on("cuda:0", 10):
        torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=1e-4, atol=1e-4)
        sched.step()
        ref_sched.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                   ref_opt.state[q]["momentum_buffer"], rtol=1e-4, atol=1e-4)
    assert len(step._compiled) == 1 and step.varying


@pytest.mark.parametrize("scheduled", [False, True])
def test_a_fused_adamw_step_under_cuda_graphs_on_one_gpu_equals_eager(scheduled):
    """``fused=True``: the trace holds the fused kernel's functional form. With ``lr``
    constant the update is in a CUDA graph (its step counts live on the GPU); under a
    scheduler ``lr`` is a host tensor the kernel reads (its ``tensor_lr`` overload), which
    no graph may bake in. Eight steps equal eager's, one capture."""
    from _steps import batches_on, module_step, small_net

    model, ref = small_net("cuda:0"), small_net("cuda:0")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, ref))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.8 ** k) for o in (opt, ref_opt)] \
        if scheduled else []
    step = autopar.data_parallel(module_step(model, opt), devices="cuda:0", shards=1,
                                 cuda_graphs=True)
    ref_step = module_step(ref, ref_opt)
    for x, y in batches_on("cuda:0", 8):
        torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=1e-4, atol=1e-4)
        for s in scheds:
            s.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key],
                                       rtol=1e-4, atol=1e-4)
    assert len([c for c in step._compiled.values() if c is not None]) == 1
    assert any("_fused_adamw" in str(n.op) for n in step.last.step.graph.ops)


@pytest.mark.parametrize("fused", [True, False])
def test_fp16_with_a_grad_scaler_under_cuda_graphs_equals_eager(fused):
    """fp16 autocast and a ``GradScaler``. Fused: the inf check and the skip stay on the GPU
    (the kernel's ``found_inf``). Foreach: the step runs and a ``where`` keeps what it wrote
    where ``found_inf`` is set (the host step counts read it). A batch with an inf skips its
    update and halves the scale, as eagerly."""
    from _steps import batches_on, scaler_step, small_net

    model, ref = small_net("cuda:0"), small_net("cuda:0")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)
                    for m in (model, ref))
    scaler, ref_scaler = (torch.amp.GradScaler("cuda", init_scale=2.0 ** 8) for _ in range(2))

    step = autopar.data_parallel(scaler_step(model, opt, scaler, "cuda"), devices="cuda:0",
                                 shards=1, cuda_graphs=True)
    ref_step = scaler_step(ref, ref_opt, ref_scaler, "cuda")
    for k, (x, y) in enumerate(batches_on("cuda:0", 8)):
        if k == 4:
            x = x.clone()
            x[0, 0] = float("inf")
        torch.testing.assert_close(step(x, y), ref_step(x, y), rtol=1e-3, atol=1e-3,
                                   equal_nan=True)
        assert scaler.get_scale() == ref_scaler.get_scale()
    assert scaler.get_scale() == 2.0 ** 7 and step.last is not None
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
