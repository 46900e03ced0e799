"""The compiled ways of one shared trace on a GPU: Inductor's form and its CUDA-graph form
(``mode="reduce-overhead"``'s) equal eager, and a CUDA-graph replay does not overwrite a
result the caller still holds. Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

import autopar
from _fakes import adamw_pair, adamw_step
from autopar.api import dispatcher_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(8, 4)).cuda().eval()


def test_inductor_and_cuda_graph_forms_equal_eager_and_keep_earlier_results():
    model = _net()
    compiled = autopar.compile(model, candidates="auto")
    d = dispatcher_of(compiled)
    x1, x2 = (torch.randn(1, 3, 16, 16, device="cuda") for _ in range(2))
    with torch.no_grad():
        want1, want2 = model(x1), model(x2)
        torch.testing.assert_close(compiled(x1), want1)  # autopar's way: both forms built
        assert d.switch is not None and d.switch.failed is None
        torch.testing.assert_close(d.way("inductor")(x2), want2)
        graphed = d.way("cudagraphs")
        held = [graphed(x) for x in (x1, x2, x1, x2, x1)]  # warm-up, record, replays
    torch.cuda.synchronize()
    assert d.switch.graphed == 1
    for got, want in zip(held, [want1, want2] * 3):
        torch.testing.assert_close(got, want)  # earlier results intact after later replays


def test_a_model_without_grad_has_a_cuda_graph_form_under_grad_mode():
    """Parameters that require no grad make aot_autograd's graph an inference one under grad
    mode too (what ``mode="reduce-overhead"`` graphs): the CUDA-graph form is built, equals
    eager, and its results need no grad."""
    model = _net().requires_grad_(False)
    compiled = autopar.compile(model, candidates="auto")
    d = dispatcher_of(compiled)
    x = torch.randn(1, 3, 16, 16, device="cuda")
    want = model(x)
    torch.testing.assert_close(compiled(x), want)
    graphed = d.way("cudagraphs")
    held = [graphed(x) for _ in range(3)]
    torch.cuda.synchronize()
    assert d.switch.graphed == 1 and d._inference()
    for got in held:
        torch.testing.assert_close(got, want)
        assert not got.requires_grad


@pytest.mark.parametrize("kept", ["eager", "inductor"])
def test_a_training_steps_eager_way_runs_adamw_as_built(kept):
    """Dynamo's trace of an AdamW step on GPU parameters makes the groups capturable and the
    step counts GPU tensors (``autopar.capture.optim``). The eager way runs the optimizer as
    built: capturable off, counts on the host; a compiled way runs dynamo's form, its very
    count tensors; the counts carry over between the two, and the steps equal eager's."""
    torch.manual_seed(0)
    model, ref, opt, ref_opt = adamw_pair(torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).cuda())
    g = autopar.compile(adamw_step(model, opt), candidates="eager,inductor")
    d = dispatcher_of(g)
    ref_step = adamw_step(ref, ref_opt)
    xs = [torch.randn(64, 16, device="cuda") for _ in range(12)]
    torch.testing.assert_close(g(xs[0]), ref_step(xs[0]), rtol=1e-4, atol=1e-5)  # captured
    assert d.forms is not None and opt.param_groups[0]["capturable"] is True
    compiled_counts = [opt.state[p]["step"] for p in model.parameters()]
    assert all(c.is_cuda for c in compiled_counts)
    torch.testing.assert_close(g(xs[1]), ref_step(xs[1]), rtol=1e-4, atol=1e-5)  # the trial
    d.trials.clear()
    d._keep(d._key((xs[0],), {}), kept)
    for x in xs[2:]:
        torch.testing.assert_close(g(x), ref_step(x), rtol=1e-4, atol=1e-5)
    counts = [opt.state[p]["step"] for p in model.parameters()]
    if kept == "eager":
        assert opt.param_groups[0]["capturable"] is False
        assert all(c.device.type == "cpu" and c.item() == len(xs) for c in counts)
        assert "AdamW as built" in d.explain()
        x = torch.randn(64, 16, device="cuda")
        d.way("inductor")(x)  # and back: the same objects
        ref_step(x)
        counts = [opt.state[p]["step"] for p in model.parameters()]
        assert all(c is k for c, k in zip(counts, compiled_counts))
        assert all(c.item() == len(xs) + 1 for c in counts)
    else:
        assert opt.param_groups[0]["capturable"] is True
        assert all(c is k and c.item() == len(xs) for c, k in zip(counts, compiled_counts))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_under_guards_arguments_the_cuda_graph_way_is_reduce_overhead_with_results_kept():
    """No shared trace under ``guards="arguments"``: the cudagraphs way is
    ``torch.compile(mode="reduce-overhead")`` of its own; its results equal eager and a later
    replay does not overwrite one the caller still holds."""
    model = _net()
    d = dispatcher_of(autopar.compile(model, candidates="auto", guards="arguments"))
    x1, x2 = (torch.randn(1, 3, 16, 16, device="cuda") for _ in range(2))
    with torch.no_grad():
        want1, want2 = model(x1), model(x2)
        graphed = d.way("cudagraphs")
        held = [graphed(x) for x in (x1, x2, x1, x2, x1)]
    torch.cuda.synchronize()
    for got, want in zip(held, [want1, want2] * 3):
        torch.testing.assert_close(got, want)


def test_a_training_steps_cuda_graph_way_is_cudagraph_trees_and_steps_as_eager():
    """A training call's cudagraphs way is ``torch.compile(mode="reduce-overhead")`` of its
    own (forward, backward and the AdamW step as cudagraph trees): ten steps of it equal
    eager's, losses and parameters, and a loss the caller kept from an early step keeps its
    value after later replays (outputs are cloned out of the graphs' memory)."""
    torch.manual_seed(0)
    model, ref, opt, ref_opt = adamw_pair(torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).cuda())
    g = autopar.compile(adamw_step(model, opt), candidates="eager,inductor,cudagraphs")
    d = dispatcher_of(g)
    ref_step = adamw_step(ref, ref_opt)
    x = torch.randn(64, 16, device="cuda")
    torch.testing.assert_close(g(x), ref_step(x), rtol=1e-4, atol=1e-5)  # captured
    graphed = d.way("cudagraphs")
    assert "cudagraphs (training)" in d._built
    losses, want = [], []
    for _ in range(10):
        x = torch.randn(64, 16, device="cuda")
        losses.append(graphed(x))
        want.append(ref_step(x))
    torch.testing.assert_close(torch.stack(losses), torch.stack(want), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    counts = {opt.state[p]["step"].item() for p in model.parameters()}
    assert counts == {11.0}  # one optimizer: every step counted, whichever way took it
