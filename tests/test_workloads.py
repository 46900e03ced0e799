"""The workload registry: eager and hand-tuned forms agree, inputs are fixed, selection works."""

from __future__ import annotations

import pytest
import torch

from autopar.bench.workloads import SIZES, WORKLOADS, Workload, home_of, select

HAS_CUDA = torch.cuda.is_available()
N_GPUS = torch.cuda.device_count()


def _run(fn, inputs, calls):
    out = None
    for _ in range(calls):
        out = fn(*inputs)
    return out


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


@pytest.mark.parametrize("name", [w.name for w in select(None, "small")])
def test_hand_agrees_with_eager(name):
    """The hand-tuned form computes what eager computes (CPU stand-ins for GPUs without CUDA)."""
    w = WORKLOADS[name]
    if w.min_gpus > N_GPUS:
        pytest.skip(f"{name} needs {w.min_gpus} GPU(s)")
    if w.hand is None:
        pytest.skip(f"{name} has no hand-tuned form")
    if w.hand_cuda_only and not HAS_CUDA:
        pytest.skip(f"{name}'s hand-tuned form needs CUDA")
    devices = ("cpu",) if not HAS_CUDA else tuple(f"cuda:{i}" for i in range(N_GPUS))
    gpus = list(devices) if w.hand_gpus <= N_GPUS else ["cpu"] * w.hand_gpus
    ref = _run(w.eager, w.make_inputs(devices, "small"), w.calls)
    hand_inputs = w.prepare_hand(w.make_inputs(devices, "small"), gpus)
    out = _run(w.hand, hand_inputs, w.calls)
    w.check(out, ref)


@pytest.mark.parametrize("name", [w.name for w in select(None, "small", n_gpus=0)])
def test_inputs_are_seeded_and_not_zero(name):
    w = WORKLOADS[name]
    a, b = w.make_inputs(("cpu",), "small"), w.make_inputs(("cpu",), "small")
    ta, tb = list(_tensors(a)), list(_tensors(b))
    assert ta, f"{name} has no tensor inputs"
    for x, y in zip(ta, tb, strict=True):
        assert torch.equal(x, y)
        if x.is_floating_point() and x.numel() > 1:
            assert bool((x != 0).all()), f"{name} has zeros in a float input"


def test_check_rejects_a_wrong_result():
    w = WORKLOADS["W2"]
    inputs = w.make_inputs(("cpu",), "small")
    ref = w.eager(*inputs)
    w.check(ref.clone(), ref)
    with pytest.raises(AssertionError, match="W2"):
        w.check(ref + 1, ref)
    with pytest.raises(AssertionError, match="sequence"):
        WORKLOADS["W4"].check([ref], [ref, ref])


def test_training_step_changes_the_next_loss():
    """W6 is compared after two calls: the second loss sees the first update."""
    w = WORKLOADS["W6"]
    inputs = w.make_inputs(("cpu",), "small")
    first, second = w.eager(*inputs), w.eager(*inputs)
    assert w.calls == 2
    assert not torch.equal(first, second)
    assert all(p.grad is None for p in inputs[:4])


def test_select_by_name_group_size_and_gpus():
    w3_small = select(["W3"], "small", n_gpus=0)
    assert [w.name for w in w3_small] == [
        "W3/5x10x5/resident", "W3/100x200x100/resident", "W3/512x512x512/resident"]
    assert len(select(["W3"], "full", n_gpus=1)) == 12
    assert [w.name for w in select(["W1,W4", "rnn_cell"], "small")] == ["W1", "W4", "rnn_cell"]
    everything = select(None, "full", n_gpus=2)
    assert {w.group for w in everything} == {
        "W1", "W2", "W3", "W4", "W5", "W6", "ensemble4", "two_tower", "cpu_preprocess",
        "rnn_cell"}
    with pytest.raises(ValueError, match=r"unknown workload.*W7.*valid names: W1, W2"):
        select(["W7"])
    with pytest.raises(ValueError, match="unknown size"):
        select(None, "huge")


def test_registry_is_consistent():
    for w in WORKLOADS.values():
        assert isinstance(w, Workload)
        assert set(w.sizes) <= set(SIZES)
        assert w.hand is not None or w.hand_gpus == 0
        assert w.explain_inputs_on is not None or w.explain_note
        assert w.hand_goal == (w.group in ("W1", "W2", "W3", "W4", "W5", "W6")
                               and not w.name.endswith("/resident")), w.name


def test_home_is_the_first_gpu_named():
    assert home_of(("cpu:0", "cpu:1")) == "cpu"
    assert home_of(("cpu:0", "cuda:1", "cuda:0")) == "cuda:1"
    assert home_of(("cuda",)) == "cuda:0"


@pytest.mark.skipif(N_GPUS < 2, reason="needs 2 GPUs")
def test_hand_forms_use_both_gpus():
    for name in ("W4", "W6", "ensemble4", "two_tower"):
        w = WORKLOADS[name]
        inputs = w.prepare_hand(w.make_inputs(("cuda:0", "cuda:1"), "small"),
                                ["cuda:0", "cuda:1"])
        assert {str(t.device) for t in _tensors(inputs)} >= {"cuda:0", "cuda:1"}, name
