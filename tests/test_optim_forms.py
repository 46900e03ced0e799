"""``OptimizerForms``: the eager way's optimizer as built, the compiled way's as dynamo left it.

Dynamo's own change (``capturable=True``, step counts on the parameters' GPU) is made by hand
here: on the host dynamo changes nothing, and eager AdamW refuses ``capturable=True`` on CPU
parameters, so a switch that failed to undo the flag fails the eager step."""

from __future__ import annotations

import torch

from _fakes import adamw_pair
from autopar.capture.optim import OptimizerForms


def _step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_the_eager_form_has_the_flags_as_built_the_compiled_one_dynamos():
    """Switching back and forth, each form sees its own flag, and the steps taken in both
    forms add up to eager's (the moving of step counts between devices: test_ways_gpu)."""
    torch.manual_seed(0)
    model, ref, opt, ref_opt = adamw_pair(torch.nn.Linear(4, 3))
    forms = OptimizerForms.of(lambda x: _step(model, opt, x), (torch.randn(2, 4),))
    assert forms is not None and forms.optimizers == [opt]
    xs = [torch.randn(2, 4) for _ in range(4)]
    _step(model, opt, xs[0])
    opt.param_groups[0]["capturable"] = True  # dynamo's trace
    for x in xs[1:]:
        forms.eager()
        assert opt.param_groups[0]["capturable"] is False and forms.changed
        _step(model, opt, x)  # would raise: capturable AdamW on CPU parameters
        forms.eager()  # entering the form it is in changes nothing
        forms.compiled()
        assert opt.param_groups[0]["capturable"] is True
    assert "AdamW as built" in forms.describe()
    for x in xs:
        _step(ref, ref_opt, x)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])
        assert opt.state[p]["step"].item() == 4


def test_an_optimizer_without_step_counts_or_flags_is_not_held():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert OptimizerForms.of(lambda x: _step(model, opt, x), (torch.randn(2, 4),)) is None


def test_an_optimizer_dynamo_left_alone_switches_as_a_no_op():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    forms = OptimizerForms.of(lambda x: _step(model, opt, x), (torch.randn(2, 4),))
    _step(model, opt, torch.randn(2, 4))
    steps = [opt.state[p]["step"] for p in model.parameters()]
    forms.eager()
    forms.compiled()
    assert not forms.changed and forms.describe() is None
    assert [opt.state[p]["step"] for p in model.parameters()] == steps


def test_switching_forms_keeps_the_compiled_codes_guards():
    """The compiled form is the very flags and objects dynamo saw: after any number of
    switches to the eager form and back, the compiled step is not traced again."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model, ref, opt, ref_opt = adamw_pair(torch.nn.Linear(8, 4))
    forms = OptimizerForms.of(lambda x: _step(model, opt, x), (torch.randn(2, 4),))
    opt.param_groups[0]["capturable"] = True  # as dynamo sets it before tracing on a GPU
    compiled = torch.compile(lambda x: _step(model, opt, x), backend="aot_eager")
    xs = [torch.randn(3, 8) for _ in range(8)]
    compiled(xs[0])
    compiled(xs[1])
    graphs = counters["stats"]["unique_graphs"]
    for i in range(2, 8, 2):
        forms.eager()
        _step(model, opt, xs[i])
        forms.compiled()
        compiled(xs[i + 1])
    assert counters["stats"]["unique_graphs"] == graphs
    for x in xs:
        _step(ref, ref_opt, x)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert opt.state[p]["step"].item() == 8
