"""The compiled ways of one shared trace on a GPU: Inductor's form and its CUDA-graph form
(``mode="reduce-overhead"``'s) equal eager, and a CUDA-graph replay does not overwrite a
result the caller still holds. Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

import autopar
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
