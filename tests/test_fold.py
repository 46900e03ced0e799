"""Constant folding at capture (autopar.capture.fold): constants made inside the function become
Python numbers where that is exact, and results stay eager's bit for bit.

Graphs are checked on what dynamo (or make_fx) really records; the GPU pattern, where dynamo
keeps ``.item()`` of a constant as a ``_local_scalar_dense`` node, is made on this CPU machine
by turning the slice-bound inputs of a captured graph into constants.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import autopar
from _torch_versions import aot_traces_bounds
from autopar.capture import fold
from autopar.capture.fake import capture_by_running
from autopar.capture.fx import from_fx
from autopar.ir.graph import LOCAL_SCALAR_DENSE, Graph
from autopar.runtime import SequentialRunner
from corpus import w2_scalar_made_inside

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def rand(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(0))


def ops_of(graph: Graph) -> list:
    return [n.op for n in graph.ops]


def zero_dim_ops(graph: Graph) -> list[str]:
    return [n.name for n in graph.ops if n.tensor_metas and n.tensor_metas[0].shape == ()]


def only_graph(fn, *args) -> Graph:
    (graph,) = capture_by_running(fn, args, SequentialRunner)
    return graph


# -- W2: a scalar made inside ----------------------------------------------------------------
def test_w2_made_inside_becomes_numbers_and_equals_eager():
    A = rand(6, 6)
    got = autopar.compile(w2_scalar_made_inside, devices="cpu:0")(A)
    assert torch.equal(got, w2_scalar_made_inside(A))

    g = only_graph(w2_scalar_made_inside, A)
    assert ops_of(g) == [aten.mul.Tensor, aten.add.Tensor]
    mul, add = g.ops
    assert mul.args == (g.inputs[0], 10.0) and type(mul.args[1]) is float
    assert add.args == (mul, 100.0)
    assert len(g.inputs) == 1  # the constant is no longer an input of the graph
    assert zero_dim_ops(g) == []


def test_a_chain_of_constant_arithmetic_folds_to_one_number():
    def chain(x):
        a = torch.tensor(3, dtype=torch.int32)
        b = (a.to(torch.float64) * 2 - 1).float()  # 5.0, float32
        return x * b + torch.full((), 0.5).neg() - a

    x = rand(4, 5)
    expected = chain(x)
    got = autopar.compile(chain, devices="cpu:0")(x)
    assert torch.equal(got, expected) and got.dtype == expected.dtype
    g = only_graph(chain, x)
    assert ops_of(g) == [aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor]
    assert [n.args[1] for n in g.ops] == [5.0, -0.5, 3]
    assert zero_dim_ops(g) == []


# -- W1: slice bounds read from constants ----------------------------------------------------
def bounds_from_a_small_constant(A, B):
    r = torch.tensor([2, 6], device=A.device)
    B[:] = A[r[0]:r[1], :4]
    return B


def test_bounds_read_from_a_constant_become_ints_and_the_graph_is_placed():
    """Dynamo keeps ``r[0]`` and ``r[1]`` as reads (the constant has two elements); without
    folding, the slice's storage offset is a symbol and the graph ran eagerly."""
    A, B = rand(8, 8), torch.zeros(4, 4)
    expected = bounds_from_a_small_constant(A, B.clone())
    got = autopar.compile(bounds_from_a_small_constant, devices="cpu:0")(A, B.clone())
    assert torch.equal(got, expected)

    g = only_graph(bounds_from_a_small_constant, A, B.clone())
    assert LOCAL_SCALAR_DENSE not in ops_of(g)
    slices = [n for n in g.ops if n.op is aten.slice.Tensor]
    assert [n.args[1:] for n in slices] == [(0, 2, 6), (1, 0, 4)]
    assert all(type(b) is int for n in slices for b in n.args[1:])
    # the constant folded away: the inputs are A and B (torch 2.11's dynamo writes B outside
    # the graph: A alone), never the constant's two elements
    assert {tuple(n.meta.shape) for n in g.inputs} <= {(8, 8), (4, 4)}
    assert zero_dim_ops(g) == []


def w1(A, B, r0, r1, c0, c1):
    B[:] = A[r0:r1, c0:c1]
    return B


def bound_arithmetic_and_item(A, B, r0):
    B[:] = A[r0:r0 + 4, r0:r0 + 4]
    return B * r0.item()


def captured(fn, args) -> torch.fx.GraphModule:
    """The aot_autograd graph dynamo makes of ``fn(*args)``, tensor slice bounds kept."""
    from torch._dynamo.backends.common import aot_autograd

    kept = []

    def keep(gm, example_inputs):
        kept.append(gm)
        return gm

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch.compile(fn, backend=aot_autograd(fw_compiler=keep), dynamic=False)(*args)
    (gm,) = kept
    return gm


def made_inside(gm: torch.fx.GraphModule, values: list[torch.Tensor]) -> torch.fx.GraphModule:
    """``gm`` with its 0-dim inputs replaced, in order, by constants made inside the function
    (``get_attr`` + ``lift_fresh_copy``), as dynamo records ``torch.tensor(100, device="cuda")``
    when its fake tensors can't see the value."""
    g = gm.graph
    scalars = [n for n in g.nodes if n.op == "placeholder" and n.meta["val"].dim() == 0]
    assert len(scalars) == len(values)
    first = next(n for n in g.nodes if n.op != "placeholder")
    for i, (ph, value) in enumerate(zip(scalars, values)):
        gm.register_buffer(f"_tensor_constant{i}", value)
        with g.inserting_before(first):
            lift = g.call_function(aten.lift_fresh_copy.default,
                                   (g.get_attr(f"_tensor_constant{i}"),))
        lift.meta["val"] = ph.meta["val"]
        ph.replace_all_uses_with(lift)
        g.erase_node(ph)
    gm.recompile()
    return gm


@aot_traces_bounds  # captured() runs aot_autograd on slice bounds read in the graph
def test_reads_of_constants_become_ints_as_on_a_gpu():
    A, B = rand(8, 8), torch.zeros(4, 4)
    bounds = [torch.tensor(2), torch.tensor(6), torch.tensor(1), torch.tensor(5)]
    gm = made_inside(captured(w1, (A, B.clone(), *bounds)), bounds)
    assert sum(n.target is LOCAL_SCALAR_DENSE for n in gm.graph.nodes) == 4  # what from_fx sees

    graph, constants = from_fx(gm)
    assert constants == [] and LOCAL_SCALAR_DENSE not in ops_of(graph)
    slices = [n for n in graph.ops if n.op is aten.slice.Tensor]
    assert [n.args[1:] for n in slices] == [(0, 2, 6), (1, 1, 5)]
    assert sum(n.target is LOCAL_SCALAR_DENSE for n in gm.graph.nodes) == 4  # gm unchanged
    got = SequentialRunner(graph)([A, B.clone()])[0]
    assert torch.equal(got, w1(A, B.clone(), *bounds))


@aot_traces_bounds
def test_bound_arithmetic_asserts_and_item_of_a_constant_fold():
    A, B, r0 = rand(8, 8), torch.zeros(4, 4), torch.tensor(3)
    gm = made_inside(captured(bound_arithmetic_and_item, (A, B.clone(), r0)), [r0])
    targets = {n.target for n in gm.graph.nodes}
    assert LOCAL_SCALAR_DENSE in targets and aten.add.Tensor in targets  # r0 + 4, then read

    graph, constants = from_fx(gm)
    assert constants == []
    assert ops_of(graph) == [aten.slice.Tensor, aten.slice.Tensor, aten.copy.default,
                             aten.mul.Tensor]
    assert [n.args[1:] for n in graph.ops[:2]] == [(0, 3, 7), (1, 3, 7)]
    assert graph.ops[3].args[1] == 3 and type(graph.ops[3].args[1]) is int
    got = SequentialRunner(graph)([A, B.clone()])
    expected = bound_arithmetic_and_item(A, B.clone(), r0)
    assert torch.equal(got[-1], expected)


# -- where folding must not happen -----------------------------------------------------------
def float64_times_ints(x):
    c = torch.tensor(2.5, dtype=torch.float64)
    return x * c, c * x + 1


def test_a_float_constant_times_ints_keeps_the_tensor_and_its_dtype():
    """int32 * 0-dim float64 is float64; int32 * 2.5 would be float32: not folded."""
    x = torch.arange(-3, 9, dtype=torch.int32).reshape(3, 4)
    expected = float64_times_ints(x)
    got = autopar.compile(float64_times_ints, devices="cpu:0")(x)
    for e, a in zip(expected, got):
        assert a.dtype == e.dtype == torch.float64 and torch.equal(a, e)
    g = only_graph(float64_times_ints, x)
    muls = [n for n in g.ops if n.op is aten.mul.Tensor]
    assert len(muls) == 2 and all(isinstance(a, type(g.inputs[0])) for n in muls for a in n.args)
    assert len(g.inputs) == 2  # x and the constant


def test_a_returned_constant_keeps_its_device_and_dtype():
    def returns_constant(x):
        c = torch.tensor(2.5, dtype=torch.float64)
        return x * c.float(), c

    x = rand(3, 3)
    expected = returns_constant(x)
    got = autopar.compile(returns_constant, devices="cpu:0")(x)
    assert torch.equal(got[0], expected[0])
    assert got[1].dtype == torch.float64 and got[1].device == expected[1].device
    assert got[1].shape == () and torch.equal(got[1], expected[1])
    g = only_graph(returns_constant, x)
    mul = next(n for n in g.ops if n.op is aten.mul.Tensor)
    assert mul.args[1] == 2.5  # the product still folds
    assert g.outputs[1].tensor_metas[0].dtype == torch.float64


def test_random_ops_are_never_folded():
    def noisy(x):
        return x * torch.rand(()) + torch.tensor(1.0)

    g = only_graph(noisy, rand(3))
    assert [str(op) for op in ops_of(g)] == ["aten.rand.default", "aten.mul.Tensor",
                                             "aten.add.Tensor"]
    add = next(n for n in g.ops if n.op is aten.add.Tensor)
    assert add.args[1] == 1.0  # the constant beside it still folds


def test_a_tensor_closed_over_by_make_fx_is_not_folded():
    """make_fx records a tensor the function closes over as a bare get_attr, by reference: the
    user may change it between calls."""
    scale = torch.tensor(3.0)

    def closes_over(x):
        return x * scale

    gm = make_fx(closes_over)(rand(4))
    graph, constants = from_fx(gm)
    assert constants == [scale] and constants[0] is scale
    assert aten.mul.Tensor in ops_of(graph)


def gpu_w2_graph() -> torch.fx.GraphModule:
    """``a1 = torch.tensor(10.0, device="cuda"); a1 * A + a1 ** 2 + torch.exp(a1 / 4)`` as
    make_fx records it where fake tensors don't make GPU tensors (the constant is made on the
    host, then moved), built by hand: this machine may have no CUDA build to trace with."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    root = torch.nn.Module()
    root.register_buffer("_tensor_constant0", torch.tensor(10.0))
    g = torch.fx.Graph()
    cuda = torch.device("cuda:0")

    def node(make, val):
        n = make()
        n.meta["val"] = val
        return n

    def call(op, *args, **kwargs):
        with mode:
            val = op(*torch.fx.node.map_arg(args, lambda n: n.meta["val"]), **kwargs)
        return node(lambda: g.call_function(op, args, kwargs), val)

    with mode:
        A = node(lambda: g.placeholder("A"), torch.empty(6, 6, device=cuda))
    c = node(lambda: g.get_attr("_tensor_constant0"), mode.from_tensor(root._tensor_constant0))
    a1 = call(aten._to_copy.default, call(aten.lift_fresh_copy.default, c), device=cuda)
    out = call(aten.add.Tensor, call(aten.mul.Tensor, a1, A), call(aten.pow.Tensor_Scalar, a1, 2))
    out = call(aten.add.Tensor, out, call(aten.exp.default, call(aten.div.Tensor, a1, 4)))
    g.output((out,))
    return torch.fx.GraphModule(root, g)


def test_a_gpu_constant_folds_only_exact_ops():
    """``a1 ** 2`` and ``* A`` fold; ``exp`` (host and GPU may round it differently) stays,
    with the constant moved to the GPU for it as before."""
    graph, constants = from_fx(gpu_w2_graph())
    assert [str(op) for op in ops_of(graph)] == [
        "aten.lift_fresh_copy.default", "aten._to_copy.default", "aten.mul.Tensor",
        "aten.add.Tensor", "aten.div.Tensor", "aten.exp.default", "aten.add.Tensor"]
    mul, add = graph.ops[2:4]
    assert mul.args[1] == 10.0 and add.args == (mul, 100.0)
    exp = graph.ops[5]
    assert exp.args[0].op is aten.div.Tensor and exp.tensor_metas[0].device == "cuda:0"
    assert constants == [torch.tensor(10.0)]


def test_a_write_into_a_constant_stops_folding():
    gm = make_fx(lambda x: x * torch.tensor(2.0))(rand(3))
    g = gm.graph
    lift = next(n for n in g.nodes if n.target is aten.lift_fresh_copy.default)
    with g.inserting_after(lift):
        g.call_function(aten.add_.Tensor, (lift, 1.0))
    gm.recompile()
    assert fold.fold_constants(gm) is gm


def test_a_constant_written_into_an_input_still_lets_the_rest_fold():
    def fill_and_scale(x, buf):
        buf.copy_(torch.tensor(3.0))
        return x * torch.tensor(2.0)

    x, buf = rand(3), torch.zeros(3)
    graph, constants = from_fx(make_fx(fill_and_scale)(x, buf.clone()))
    assert [str(op) for op in ops_of(graph)] == ["aten.lift_fresh_copy.default",
                                                 "aten.copy_.default", "aten.mul.Tensor"]
    assert graph.ops[2].args[1] == 2.0
    (got,) = SequentialRunner(graph)([x, buf, *constants])
    assert torch.equal(got, x * 2) and torch.equal(buf, torch.full((3,), 3.0))


def test_a_failure_inside_the_pass_leaves_the_graph_as_it_was(monkeypatch):
    def broken(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(fold._Fold, "_rewrite", broken)
    A = rand(6, 6)
    g = only_graph(w2_scalar_made_inside, A)
    assert aten.lift_fresh_copy.default in ops_of(g) and len(g.inputs) == 2
    got = autopar.compile(w2_scalar_made_inside, devices="cpu:0")(A)
    assert torch.equal(got, w2_scalar_made_inside(A))


# -- property: any dtype pair, any op, either side -------------------------------------------
DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64]
OPS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}
VALUES = [0, 1, 3, -2, 0.5, -1.25, 2049, 70000, 2**31 + 1, 1e-3, 1e-8, 3.3e38, -0.0,
          float("inf"), float("nan")]


def tensor_of(dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(3, 4, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(3, 4, generator=g) * 10).to(dtype)
    return torch.randint(0, 100, (3, 4), generator=g).to(dtype)


def run_captured(fn, x):
    """Trace ``fn`` with make_fx, capture (folding) and run the graph; the graph too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    gm = make_fx(fn, tracing_mode="fake")(mode.from_tensor(x))
    graph, constants = from_fx(gm)
    return SequentialRunner(graph)([x, *constants])[0], graph


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c_dtype=st.sampled_from(DTYPES), x_dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(sorted(OPS)), first=st.booleans(), value=st.sampled_from(VALUES),
       seed=st.integers(0, 3))
def test_folding_gives_eagers_values_and_dtype(c_dtype, x_dtype, op, first, value, seed):
    x = tensor_of(x_dtype, seed)

    def fn(t):
        c = torch.tensor(value, dtype=c_dtype)
        return OPS[op](c, t) if first else OPS[op](t, c)

    try:
        expected = fn(x)
    except RuntimeError:  # e.g. sub on bools: eager refuses too
        return
    got, graph = run_captured(fn, x)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected) or (
        got.is_floating_point() and torch.equal(got.isnan(), expected.isnan())
        and torch.equal(got.nan_to_num(), expected.nan_to_num()))
    folded = not graph.inputs[1:]
    if folded:  # then the op took a Python number of the constant's kind
        (node,) = graph.ops
        number = node.args[1]
        assert type(number) is (bool if c_dtype == torch.bool else
                                float if c_dtype.is_floating_point else int)


def test_the_property_is_not_vacuous():
    """Same-dtype float and int cases fold; int tensors times a float constant don't."""
    def times(c_dtype, value):
        return lambda t: t * torch.tensor(value, dtype=c_dtype)

    _, g = run_captured(times(torch.float32, 0.5), tensor_of(torch.float32, 0))
    assert g.ops[0].args[1] == 0.5 and len(g.inputs) == 1
    _, g = run_captured(times(torch.int64, 3), tensor_of(torch.int32, 0))
    assert g.ops[0].args[1] == 3 and len(g.inputs) == 1
    _, g = run_captured(times(torch.float32, 0.5), tensor_of(torch.int32, 0))
    assert g.ops[0].args[1] == 0.5 and len(g.inputs) == 1  # float32 either way
    _, g = run_captured(times(torch.float64, 0.5), tensor_of(torch.int32, 0))
    assert len(g.inputs) == 2  # float64 with the 0-dim tensor, float32 with a number
    _, g = run_captured(times(torch.int64, 2049), tensor_of(torch.float16, 0))
    assert len(g.inputs) == 2  # 2049 is no float16: an integer the result can't hold is kept
