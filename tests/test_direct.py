"""guards="arguments" (autopar.capture.direct): learned calls skip dynamo; what it checks."""

from __future__ import annotations

import pytest
import torch

import autopar
from _torch_versions import dynamo_guards_requires_grad_of_parameters
from autopar.api import Options

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

W = torch.randn(10, 5)  # a global tensor the functions below read


def through_dynamo(compiled) -> list[int]:
    """Count the calls of ``compiled``'s autopar way that go through dynamo."""
    direct = compiled.compiled
    calls = []
    dynamo = direct.compiled

    def counted(*args, **kwargs):
        calls.append(1)
        return dynamo(*args, **kwargs)

    direct.compiled = counted
    return calls


def test_the_option_is_checked():
    assert Options.parse({}).guards == "all"
    assert Options.parse({"guards": "arguments"}).guards == "arguments"
    with pytest.raises(ValueError, match="guards must be 'all' or 'arguments', not 'none'"):
        autopar.compile(lambda x: x, guards="none")
    with pytest.raises(Exception, match=r"guards='arguments' is autopar\.compile's"):
        torch.compile(lambda a: a + 1, backend="autopar",
                      options={"guards": "arguments"})(torch.ones(2))


def test_a_settled_signature_runs_its_graph_without_dynamo(monkeypatch):
    """Dynamo's frame (``compile_wrapper``) sets its eval-frame callback at each call: counted,
    none is set by a learned signature's calls, nor is the compiled way called."""
    from torch._dynamo import eval_frame

    def mm(x, y):
        return x @ y

    compiled = autopar.compile(mm, devices="cpu:0", guards="arguments", candidates="autopar")
    x, y = torch.randn(5, 10), torch.randn(10, 5)
    torch.testing.assert_close(compiled(x, y), x @ y)
    direct = compiled.compiled
    assert len(direct.entries) == 1 and compiled.only is direct
    calls = through_dynamo(compiled)
    frames = []
    set_eval_frame = eval_frame.set_eval_frame
    monkeypatch.setattr(eval_frame, "set_eval_frame",
                        lambda *a: frames.append(1) or set_eval_frame(*a))
    for _ in range(5):
        a, b = torch.randn(5, 10), torch.randn(10, 5)  # new tensors, the same signature
        torch.testing.assert_close(compiled(a, b), a @ b)
    assert not calls and not frames
    a = torch.randn(3, 10)  # a new signature: through dynamo's frame (the count works)
    torch.testing.assert_close(compiled(a, y), a @ y)
    assert len(calls) == 1 and frames


def test_the_entry_runs_the_graphs_ops_in_its_own_lines_and_the_program_where_they_fail():
    """A learned entry takes the runner's whole call in (``codegen.Inline``): the ops run in
    the entry's lines, no program call. Where a line raises, the runner's program runs the
    call (it reports the failure, or falls back to eager: test_runtime's solo-program test);
    under the profiler the program runs it too (an executor's program opens its ranges)."""
    from torch.profiler import ProfilerActivity, profile

    def f(x, y):
        return (x @ y).relu()

    compiled = autopar.compile(f, devices="cpu:0", guards="arguments", candidates="autopar")
    x, y = torch.randn(5, 10), torch.randn(10, 5)
    torch.testing.assert_close(compiled(x, y), f(x, y))
    (entry,) = compiled.compiled.entries
    assert "outs = _run([a0, a1])" in entry.source and "c0(v" in entry.source
    program = entry.__globals__["_run"]
    ran = []
    entry.__globals__["_run"] = lambda args: ran.append(1) or program(args)
    for _ in range(3):
        a, b = torch.randn(5, 10), torch.randn(10, 5)
        torch.testing.assert_close(compiled(a, b), f(a, b))
    assert not ran  # the entry's own lines ran every call

    with profile(activities=[ProfilerActivity.CPU]):
        torch.testing.assert_close(compiled(x, y), f(x, y))
    assert ran == [1]

    ops = [k for k, v in entry.__globals__.items() if k.startswith("c") and callable(v)]
    for k in ops:  # every op of the entry's lines fails; the program's own do not
        entry.__globals__[k] = lambda *a, **kw: 1 / 0
    torch.testing.assert_close(compiled(x, y), f(x, y))
    assert ran == [1, 1]


def test_an_entry_over_a_plan_of_two_workers_calls_the_executor():
    """A plan of several programs has no whole-call lines: the entry calls the executor
    (a regression: its attribute for the caller's program was taken for those lines)."""
    def branches(x, y):
        return (x @ y).relu() + (y @ x).sum()

    compiled = autopar.compile(branches, devices="cpu:0,cpu:1", policy="round_robin",
                               guards="arguments", candidates="autopar")
    for _ in range(4):
        x, y = torch.randn(6, 6), torch.randn(6, 6)
        torch.testing.assert_close(compiled(x, y), branches(x, y))
    (entry,) = compiled.compiled.entries
    assert len(compiled.runner.executors[-1].programs) == 2
    assert "outs = _run([a0, a1])" in entry.source and "c0(" not in entry.source


def test_a_new_shape_dtype_or_grad_mode_is_a_new_signature():
    compiled = autopar.compile(lambda x, y: (x @ y).relu(), devices="cpu:0",
                               guards="arguments", candidates="autopar")
    calls = through_dynamo(compiled)
    x, y = torch.randn(5, 10), torch.randn(10, 5)
    cases = [(x, y), (x, y), (torch.randn(3, 10), y), (x.double(), y.double()), (x, y),
             (x.t().contiguous().t(), y)]  # another stride too
    for a, b in cases:
        torch.testing.assert_close(compiled(a, b), (a @ b).relu())
    assert len(calls) == 4  # each new signature through dynamo once
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, y), (x @ y).relu())
    assert len(calls) == 5
    with torch.autocast("cpu"):  # autocast: through dynamo, as eager computes it
        compiled(x, y)
    assert len(calls) == 6
    assert len(compiled.compiled.entries) == 5
    # the head is the entry that served the latest call: a grad-mode call after the
    # no_grad one puts its entry first again, so later calls pay no other entry's checks
    direct = compiled.compiled
    assert direct.head.signature[0] is False  # the no_grad call's entry
    torch.testing.assert_close(compiled(x, y), (x @ y).relu())
    assert direct.head.signature[0] is True and direct.head is direct.entries[0]
    assert len(calls) == 6 and len(direct.entries) == 5


def test_torchs_global_state_is_part_of_the_signature():
    """A learned entry serves calls under the global state it was learned in (dynamo's
    ``GlobalStateGuard``): dynamo reads ``torch.get_default_dtype()`` while tracing, so the
    graph learned under float32 casts to float32; under float64 the call goes through dynamo
    and casts as eager does. Each state keeps its own entry."""
    def as_default(x):
        return x.to(torch.get_default_dtype()) * 2

    compiled = autopar.compile(as_default, devices="cpu:0", guards="arguments",
                               candidates="autopar")
    x = torch.randn(4, dtype=torch.float16)
    for _ in range(2):
        assert compiled(x).dtype == torch.float32
    calls = through_dynamo(compiled)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for _ in range(2):
            got, want = compiled(x), as_default(x)
            assert got.dtype == want.dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    assert len(calls) == 1  # through dynamo once, which guards the default dtype too
    torch.testing.assert_close(compiled(x), as_default(x))
    assert len(calls) == 1 and len(compiled.compiled.entries) == 2  # each state's entry


@pytest.mark.skipif(not torch.cuda.is_available(), reason="another device needs CUDA")
def test_a_new_device_is_a_new_signature():
    compiled = autopar.compile(lambda x, y: x @ y, guards="arguments", candidates="autopar")
    calls = through_dynamo(compiled)
    x, y = torch.randn(5, 10), torch.randn(10, 5)
    for a, b in [(x, y), (x.cuda(), y.cuda()), (x, y)]:
        torch.testing.assert_close(compiled(a, b), a @ b)
    assert len(calls) == 2


def test_a_parameter_updated_in_place_goes_through_dynamo_once():
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 5)
    compiled = autopar.compile(model, devices="cpu:0", guards="arguments",
                               candidates="autopar")
    x = torch.randn(4, 10)
    with torch.no_grad():  # an inference graph (with grad, a training graph: dynamo's way)
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x))
        calls = through_dynamo(compiled.forward)
        compiled(x)
        assert not calls
        model.weight.mul_(2)  # an optimizer's step: the parameter's _version changes
        torch.testing.assert_close(compiled(x), model(x))
        assert len(calls) == 1  # re-guarded by dynamo, then learned again
        torch.testing.assert_close(compiled(x), model(x))
        assert len(calls) == 1
        model.eval()  # the module's training flag is checked too
        compiled(x)
        assert len(calls) == 2


def _frozen_entry():
    """A module whose parameters are frozen, a learned entry for it (grad mode on, nothing
    requiring grad: an inference graph), and the count of calls through dynamo from then."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 5), torch.nn.Tanh())
    compiled = autopar.compile(model, devices="cpu:0", guards="arguments",
                               candidates="autopar")
    model.requires_grad_(False)
    x = torch.randn(4, 10)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), model(x))
    calls = through_dynamo(compiled.forward)
    compiled(x)
    assert not calls
    return model, compiled, x, calls


def test_a_module_converted_goes_through_dynamo():
    """``module.double()`` keeps the parameter objects (``.data`` assigned): their layout is
    checked with the arguments'. A learned entry had run the float32 graph on float64 weights
    ("mat1 and mat2 must have the same dtype")."""
    model, compiled, x, calls = _frozen_entry()
    model.double()
    xd = x.double()
    torch.testing.assert_close(compiled(xd), model(xd))
    assert len(calls) == 1


@dynamo_guards_requires_grad_of_parameters
def test_a_module_unfrozen_goes_through_dynamo_and_records_for_backward():
    """``requires_grad_(True)`` on a frozen module's parameters: the entry had run the
    inference graph, outputs with no grad."""
    model, compiled, x, calls = _frozen_entry()
    model.requires_grad_(True)
    out = compiled(x)
    assert out.requires_grad and len(calls) == 1
    out.sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad)


def mm_global(x):
    return x @ W


def test_a_global_tensor_replaced_goes_through_dynamo():
    global W
    compiled = autopar.compile(mm_global, devices="cpu:0", guards="arguments",
                               candidates="autopar")
    x = torch.randn(4, 10)
    torch.testing.assert_close(compiled(x), x @ W)
    calls = through_dynamo(compiled)
    compiled(x)
    assert not calls
    old = W
    try:
        W = torch.randn(10, 5)
        torch.testing.assert_close(compiled(x), x @ W)
        assert len(calls) == 1
        torch.testing.assert_close(compiled(x), x @ W)
        assert len(calls) == 1
    finally:
        W = old


def test_constants_made_inside_are_still_folded():
    def w2(A):
        a1 = torch.tensor(10.0, device=A.device)
        return a1 * A + a1 ** 2

    compiled = autopar.compile(w2, devices="cpu:0", guards="arguments", candidates="autopar")
    A = torch.randn(8, 8)
    torch.testing.assert_close(compiled(A), w2(A))
    assert compiled.runner.folded == 1 and len(compiled.compiled.entries) == 1
    calls = through_dynamo(compiled)
    B = torch.randn(8, 8)
    assert torch.equal(compiled(B), w2(B))
    assert not calls


def test_plain_arguments_are_part_of_the_signature():
    compiled = autopar.compile(lambda x, k, tag: x * k, devices="cpu:0", guards="arguments",
                               candidates="autopar")
    calls = through_dynamo(compiled)
    x = torch.randn(4)
    for k, tag in [(2, "a"), (2, "a"), (3, "a"), (2, "b"), (True, "a"), (2, "a")]:
        torch.testing.assert_close(compiled(x, k, tag), x * k)
    assert len(calls) == 4


def test_a_graph_that_writes_an_argument_is_learned_and_writes_it_each_call():
    """W1's form, ``B[:] = A[2:4]; return B``: the light wrapper copies the graph's new ``B``
    into the caller's (the slice itself: no fresh copy made first), and the result is that
    very tensor."""
    def writes(A, B):
        B[:] = A[2:4]
        return B

    A, B = torch.randn(6, 3), torch.zeros(2, 3)
    compiled = autopar.compile(writes, devices="cpu:0", guards="arguments",
                               candidates="autopar")
    assert compiled(A, B) is B and torch.equal(B, A[2:4])
    assert len(compiled.compiled.entries) == 1
    source = compiled.compiled.entries[0].source  # the light wrapper inline: copy back, B out
    assert "_run([a0, a1])" in source and "a1.copy_(outs[0])" in source
    graph = compiled.runner.executors[-1].plan.graph  # the slice is copied into B once, by
    assert not any(n.op is torch.ops.aten.copy.default for n in graph.ops)  # the epilogue
    calls = through_dynamo(compiled)
    for _ in range(3):
        B.zero_()
        A = torch.randn(6, 3)
        assert compiled(A, B) is B and torch.equal(B, A[2:4])
    assert not calls


def test_what_is_not_learned_keeps_going_through_dynamo():
    """A graph break (Python between graphs), a result that is not the graph's outputs alone
    (dynamo returns the argument itself), keyword arguments: every call through dynamo."""
    def broken(x):
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    def passes_through(x):
        return x, x.sin()

    x = torch.randn(6, 3)
    for fn, args, kwargs in [(broken, (x,), {}), (passes_through, (x,), {}),
                             (lambda x: x.sin(), (), {"x": x})]:
        compiled = autopar.compile(fn, devices="cpu:0", guards="arguments",
                                   candidates="autopar")
        calls = through_dynamo(compiled)
        for _ in range(3):
            got, want = compiled(*args, **kwargs), fn(*args, **kwargs)
            torch.testing.assert_close(got, want)
        assert len(calls) == 3 and not compiled.compiled.entries


def _as_on_torch_2_11(monkeypatch) -> None:
    """dynamo failing inside when scalars are captured, as torch 2.11's does on CUDA slice
    bounds made inside (``PendingUnbackedSymbolNotFound``)."""
    import autopar.api
    from autopar.capture import dynamo

    real = dynamo.capturing_scalars

    def failing(compiled, **kwargs):
        def call(*args, **kw):
            if torch._dynamo.config.capture_scalar_outputs:
                raise torch._dynamo.exc.InternalTorchDynamoError("PendingUnbackedSymbolNotFound")
            return compiled(*args, **kw)
        return real(call, **kwargs)
    monkeypatch.setattr(autopar.api, "capturing_scalars", failing)


def w1_bounds_inside(A, B):
    d = A.device
    r0, r1 = torch.tensor(2, device=d), torch.tensor(5, device=d)
    c0, c1 = torch.tensor(1, device=d), torch.tensor(3, device=d)
    B[:] = A[r0:r1, c0:c1]
    return B


def test_where_dynamo_cannot_capture_the_scalars_the_function_is_traced_by_running(
        monkeypatch, caplog):
    """W1 on torch 2.11's CUDA path: dynamo's trace fails with the bounds captured and breaks
    the graph at each bound instead; the mode then traces the function by running it on
    copies of its arguments, and the bounds fold: the entry is two slices and a copy into B,
    no tensor made, no value read, and calls skip dynamo."""
    _as_on_torch_2_11(monkeypatch)
    compiled = autopar.compile(w1_bounds_inside, devices="cpu:0", guards="arguments",
                               candidates="autopar")
    A, B = torch.randn(8, 6), torch.zeros(3, 2)
    with caplog.at_level("INFO", logger="autopar"):
        assert compiled(A, B) is B and torch.equal(B, A[2:5, 1:3])  # dynamo, graph breaks
        direct = compiled.compiled
        assert direct.by_running and not direct.entries
        B.zero_()
        assert compiled(A, B) is B and torch.equal(B, A[2:5, 1:3])  # traced by running
    assert "traced by running it" in caplog.text
    assert len(direct.entries) == 1
    source = direct.entries[0].source
    assert "_program(a0, a1)" in source
    calls = through_dynamo(compiled)
    for _ in range(3):
        A, B = torch.randn(8, 6), torch.zeros(3, 2)  # new data, the same signature
        assert compiled(A, B) is B and torch.equal(B, A[2:5, 1:3])
    assert not calls
    assert compiled(torch.randn(9, 6), B) is B  # a new shape: a new entry, traced again
    assert len(direct.entries) == 2


def test_a_bound_read_from_an_argument_stops_tracing_by_running(monkeypatch):
    """A bound that depends on an argument's data can't be baked in: make_fx stops at the
    read, the call goes through dynamo (right for every value), and tracing by running
    is not tried again."""
    _as_on_torch_2_11(monkeypatch)

    def data_bounds(A, n):
        return A[: n[0]] * 2

    compiled = autopar.compile(data_bounds, devices="cpu:0", guards="arguments",
                               candidates="autopar")
    A = torch.randn(6, 2)
    for k in (2, 2, 4, 3):
        n = torch.tensor([k])
        torch.testing.assert_close(compiled(A, n), A[:k] * 2)
    direct = compiled.compiled
    assert not direct.by_running and "the trace stopped" in direct.refused
    assert not direct.entries


def test_a_function_reading_a_global_tensor_is_not_traced_by_running(monkeypatch):
    _as_on_torch_2_11(monkeypatch)

    def reads_w(x):
        k = torch.tensor(3)
        return x[:, :k] @ W[:k]

    compiled = autopar.compile(reads_w, devices="cpu:0", guards="arguments",
                               candidates="autopar")
    x = torch.randn(4, 10)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), x[:, :3] @ W[:3])
    direct = compiled.compiled
    assert direct.refused == "it reads 1 tensor(s) besides its arguments"


def test_a_tensor_passed_twice_is_not_traced_by_running(monkeypatch):
    """The traced graph assumes distinct arguments (it ran on a copy of each, and a graph that
    writes one would not see the other change): one tensor passed twice keeps going through
    dynamo, as for a learned entry."""
    _as_on_torch_2_11(monkeypatch)

    def two(x, y):
        n = torch.tensor(2, device=x.device)
        return x[:n] + y[:n]

    compiled = autopar.compile(two, devices="cpu:0", guards="arguments", candidates="autopar")
    x = torch.randn(4, 3)
    torch.testing.assert_close(compiled(x, x.clone()), 2 * x[:2])  # dynamo, graph breaks
    direct = compiled.compiled
    assert direct.by_running
    torch.testing.assert_close(compiled(x, x), 2 * x[:2])
    assert not direct.by_running and "distinct" in direct.refused and not direct.entries
