"""The IR: metadata, FLOPs, schema effects, verification, printing, totals."""

from __future__ import annotations

import operator

import pytest
import torch

from autopar.ir.graph import INPUT, Graph, GraphError, Node, TensorMeta, op_kind, op_name

aten = torch.ops.aten


def two_chains(n: int = 3, size: int = 64) -> Graph:
    """Two independent matmul chains on cuda:0 (W4 in miniature).

        x0 -> mm -> mm -> mm          x1 -> mm -> mm -> mm
    """
    g = Graph("two_chains")
    xs = [g.input(TensorMeta.make((size, size), device="cuda:0"), f"x{i}") for i in range(2)]
    outs = []
    for x in xs:
        y = x
        for _ in range(n):
            y = g.call(aten.mm.default, (y, x))
        outs.append(y)
    g.set_outputs(outs)
    return g


def test_meta_inference_keeps_eager_device_and_flops():
    g = two_chains(size=64)
    g.verify()
    mm = g.ops[0]
    assert mm.meta == TensorMeta((64, 64), torch.float32, (64, 1), "cuda:0", 64 * 64 * 4)
    assert mm.flops == 2 * 64 * 64 * 64  # torch.utils.flop_counter's mm formula
    assert mm.inputs == (g.inputs[0],)
    assert mm.kind == "matmul"


def test_cholesky_and_triangular_solve_have_flops():
    g = Graph("potrf_trsm")
    a = g.input(TensorMeta.make((3, 64, 64), device="cuda:0"), "a")
    b = g.input(TensorMeta.make((3, 32, 64), device="cuda:0"), "b")
    chol = g.call(aten.linalg_cholesky_ex.default, (a,))
    low = g.call(operator.getitem, (chol, 0))
    solve = g.call(aten.linalg_solve_triangular.default, (low, b), {"upper": False,
                                                                   "left": False})
    g.set_outputs([solve])
    assert chol.flops == 3 * 64**3 // 3  # n^3 / 3 per matrix
    assert solve.flops == 64 * 3 * 32 * 64  # n^2 per right-hand side of length n
    assert chol.kind == solve.kind == "matmul"


def test_totals_and_users():
    g = two_chains(n=3, size=10)
    t = g.totals()
    assert t.nodes == 6
    assert t.flops == 6 * 2 * 10**3
    assert t.bytes == 6 * 10 * 10 * 4
    assert t.ops_by_kind == {"matmul": 6}
    users = g.users()
    x0 = g.inputs[0]
    assert [u.id for u in users[x0]] == [2, 3, 4]  # every mm of its chain reads x0


def test_schema_effects_reads_writes_aliases():
    g = Graph()
    x = g.input(TensorMeta.make((4, 4)))
    y = g.input(TensorMeta.make((2, 4)))
    v = g.call(aten.slice.Tensor, (x, 0, 1, 3))
    w = g.call(aten.add_.Tensor, (y, v))
    s = g.call(aten.split.Tensor, (x, 2))
    first = g.call(operator.getitem, (s, 0))
    assert v.aliases == (x,) and v.writes == () and v.reads == (x,)
    assert v.kind == "view" and v.out_bytes == 0
    assert w.writes == (y,) and w.aliases == (y,) and set(w.reads) == {y, v}
    assert isinstance(s.meta, tuple) and len(s.meta) == 2
    assert first.meta == s.meta[0] and first.kind == "getitem"


def test_cudnn_batch_norm_writes_its_running_statistics_in_training_though_its_schema_doesnt():
    """cuDNN's batch norm updates the running statistics it is given (its schema annotates no
    write): in training the node writes them, so no pass replays or moves it unawares."""
    g = Graph()
    x = g.input(TensorMeta.make((6, 3, 2)))
    w, b, rm, rv = (g.input(TensorMeta.make((3,))) for _ in range(4))
    train = g.call(aten.cudnn_batch_norm.default, (x, w, b, rm, rv, True, 0.1, 1e-5))
    infer = g.call(aten.cudnn_batch_norm.default, (x, w, b, rm, rv, False, 0.1, 1e-5))
    assert train.writes == (rm, rv) and infer.writes == ()
    assert set(train.reads) == {x, w, b, rm, rv}


def test_last_uses_keep_a_base_alive_while_its_view_is_read():
    """x -> t (view) -> relu ; x is last read by relu through its view."""
    g = Graph()
    x = g.input(TensorMeta.make((4, 4)))
    a = g.call(aten.neg.default, (x,))
    t = g.call(aten.t.default, (a,))
    r = g.call(aten.relu.default, (t,))
    g.set_outputs([r])
    last = g.last_uses()
    assert last[t] is r
    assert last[a] is r  # the base lives as long as its view
    assert last[r] is None  # an output is never freed


def test_verify_rejects_use_before_definition_and_missing_meta():
    g = Graph()
    x = g.input(TensorMeta.make((2,)))
    a = g.call(aten.neg.default, (x,))
    ghost = Node(id=99, op=aten.neg.default, meta=a.meta)
    b = Node(id=2, op=aten.neg.default, args=(ghost,), meta=a.meta)
    g.nodes.append(b)
    with pytest.raises(GraphError, match="before it is defined"):
        g.verify()
    g2 = Graph()
    x2 = g2.input(TensorMeta.make((2,)))
    g2.nodes.append(Node(id=1, op=aten.neg.default, args=(x2,), meta=None))
    with pytest.raises(GraphError, match="no output metadata"):
        g2.verify()
    g3 = Graph()
    g3.input(TensorMeta.make((2,)))
    g3.call(aten.neg.default, (g3.nodes[0],))
    with pytest.raises(GraphError, match="after op nodes"):
        g3.input(TensorMeta.make((2,)))


def test_printout_names_ops_shapes_devices():
    text = str(two_chains(n=1, size=8))
    assert "graph two_chains(%x0: f32[8,8]@cuda:0, %x1: f32[8,8]@cuda:0):" in text
    assert "aten.mm(%x0, %x0)  f32[8,8]@cuda:0" in text
    assert "return (%2, %3)" in text
    assert "2 ops" in text


def test_op_names_and_kinds():
    assert op_name(aten.add.Tensor) == "aten.add.Tensor"
    assert op_name(aten.mm.default) == "aten.mm"
    assert op_name(INPUT) == "input"
    assert op_kind(aten.add.Tensor) == "pointwise"
    assert op_kind(aten.sum.default) == "reduction"
    assert op_kind(aten.rand.default) == "random"
    assert op_kind(aten.view.default) == "view"
    assert op_kind(aten.convolution.default) == "matmul"
    assert op_kind(aten._to_copy.default) == "copy"


def test_tensor_meta_of_real_tensor():
    t = torch.zeros(3, 5, dtype=torch.float16).t()
    m = TensorMeta.of(t)
    assert m.shape == (5, 3) and m.stride == (1, 5) and m.nbytes == 30 and m.device == "cpu"
    assert str(m) == "f16[5,3]"
