"""Scalars: values read back to the host are graph nodes, and host scalars stay on the host.

Placement is checked exactly on small named graphs (times from a table: tests/_fakes.py; a host
scalar is pinned whatever the times), capture on what dynamo really records, and results
against eager for W1/W2 variants through both front doors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from _fakes import FakeCost, by_name, devices_of, machine, tensor
from _torch_versions import aot_traces_bounds
from autopar.capture.dynamo import make_backend
from autopar.capture.fx import from_fx
from autopar.ir.graph import Graph, ScalarMeta
from autopar.ir.routing import GraphIndex
from autopar.machine.model import Machine
from autopar.machine.presets import preset
from autopar.report.explain import explain_graph
from autopar.runtime import SequentialRunner
from autopar.schedule.place import place
from corpus import narrow_at_item, w2_scalar_made_inside

aten = torch.ops.aten
READ = aten._local_scalar_dense.default
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


# -- graphs --------------------------------------------------------------------------------
def w1_graph() -> Graph:
    """W1 with tensor bounds, as captured with scalar outputs::

        r0 (cuda:0)  r1 (cuda:0)        A (cuda:0)   B (cuda:0)
          |            |                 |            |
        l0 = item    l1 = item  ------> s = A[l0:l1]  |
                                          \\-------> copy(B, s)
    """
    g = Graph("w1")
    r0 = g.input(tensor((), "cuda:0", torch.int64), name="r0")
    r1 = g.input(tensor((), "cuda:0", torch.int64), name="r1")
    a = g.input(tensor((8, 8), "cuda:0"), name="A")
    b = g.input(tensor((2, 8), "cuda:0"), name="B")
    l0 = g.call(READ, (r0,), meta=ScalarMeta("int"), name="l0")
    l1 = g.call(READ, (r1,), meta=ScalarMeta("int"), name="l1")
    s = g.call(aten.slice.Tensor, (a, 0, l0, l1), meta=tensor((2, 8), "cuda:0"), name="s")
    out = g.call(aten.copy.default, (b, s), name="out")
    g.set_outputs([out])
    return g


def bound_arithmetic_graph() -> Graph:
    """``A[r0:r0 + 2]``: the bound's arithmetic is a 0-dim op on the GPU value::

        r0 (cuda:0) --> hi = r0 + 2 --> l1 = item(hi)
             \\-------------------------> l0 = item(r0)     A[l0:l1] -> out
    """
    g = Graph("bound_arithmetic")
    r0 = g.input(tensor((), "cuda:0", torch.int64), name="r0")
    a = g.input(tensor((8, 8), "cuda:0"), name="A")
    hi = g.call(aten.add.Tensor, (r0, 2), name="hi")
    l0 = g.call(READ, (r0,), meta=ScalarMeta("int"), name="l0")
    l1 = g.call(READ, (hi,), meta=ScalarMeta("int"), name="l1")
    s = g.call(aten.slice.Tensor, (a, 0, l0, l1), meta=tensor((2, 8), "cuda:0"), name="s")
    out = g.call(aten.mul.Tensor, (s, 2.0), name="out")
    g.set_outputs([out])
    return g


def w2_made_inside_graph() -> Graph:
    """W2 with ``a1 = torch.tensor(10.0, device="cuda")`` inside, as capture records it: the
    0-dim constant lives on the host and is moved where eager has it::

        c (cpu) -> to_dev -> a1 (lift_fresh_copy) -> sq = a1 ** 2 ----\\
                                        \\-> m = a1 * A (cuda:0) -> out = m + sq
    """
    g = Graph("w2_inside")
    a = g.input(tensor((600, 600), "cuda:0"), name="A")
    c = g.input(tensor((), "cpu"), name="c")
    to_dev = g.call(aten._to_copy.default, (c,), {"device": torch.device("cuda:0")},
                    meta=tensor((), "cuda:0"), name="to_dev")
    a1 = g.call(aten.lift_fresh_copy.default, (to_dev,), name="a1")
    m = g.call(aten.mul.Tensor, (a1, a), name="m")
    sq = g.call(aten.pow.Tensor_Scalar, (a1, 2), name="sq")
    out = g.call(aten.add.Tensor, (m, sq), name="out")
    g.set_outputs([out])
    return g


def w2_passed_in_graph() -> Graph:
    """W2 with a1 a 0-dim CUDA input: ``a1 * A + a1 ** 2``."""
    g = Graph("w2_passed")
    a1 = g.input(tensor((), "cuda:0"), name="a1")
    a = g.input(tensor((600, 600), "cuda:0"), name="A")
    m = g.call(aten.mul.Tensor, (a1, a), name="m")
    sq = g.call(aten.pow.Tensor_Scalar, (a1, 2), name="sq")
    g.set_outputs([g.call(aten.add.Tensor, (m, sq), name="out")])
    return g


def sync_cost() -> FakeCost:
    """1 us per op anywhere, but reading a value back on the GPU waits 50 us for it (a sync);
    copies take 5 us."""
    times = {(f"l{i}", "cuda"): 50e-6 for i in range(2)}
    return FakeCost(machine(cpus=1, gpus=1), times, default=1e-6, latency=5e-6)


def names(nodes) -> set[str]:
    return {n.name for n in nodes}


# -- which values are host scalars ----------------------------------------------------------
def test_host_scalars_are_numbers_and_zero_dim_values_made_from_host_values():
    assert names(GraphIndex.of(w1_graph()).host) == {"l0", "l1"}
    assert names(GraphIndex.of(bound_arithmetic_graph()).host) == {"hi", "l0", "l1"}
    assert names(GraphIndex.of(w2_made_inside_graph()).host) == {"to_dev", "a1", "sq"}
    # a1 lives on the GPU and feeds a GPU kernel: the host never needs its value
    assert names(GraphIndex.of(w2_passed_in_graph()).host) == set()


# -- placement ----------------------------------------------------------------------------
def test_w1_bounds_are_read_on_the_host_once_each_and_the_slice_stays_on_the_gpu():
    g = w1_graph()
    p = place(g, sync_cost())
    assert devices_of(p) == {"l0": "cpu:0", "l1": "cpu:0", "s": "cuda:0", "out": "cuda:0"}
    assert [(v.name, d) for v, d in p.copies()] == [("r0", "cpu:0"), ("r1", "cpu:0")]
    n = by_name(g)
    assert p.notes[n["l0"]] == ("pinned: host scalar: reads %r0 from cuda:0 to the host once "
                                "per call (one sync)")


def test_a_bound_used_twice_is_copied_to_the_host_once_and_its_arithmetic_runs_there():
    p = place(bound_arithmetic_graph(), sync_cost())
    assert devices_of(p) == {"hi": "cpu:0", "l0": "cpu:0", "l1": "cpu:0", "s": "cuda:0",
                             "out": "cuda:0"}
    assert [(v.name, d) for v, d in p.copies()] == [("r0", "cpu:0")]


def test_w2_scalar_made_inside_stays_on_the_host_and_reaches_the_gpu_kernel_uncopied():
    g = w2_made_inside_graph()
    p = place(g, sync_cost())
    assert devices_of(p) == {"to_dev": "cpu:0", "a1": "cpu:0", "sq": "cpu:0", "m": "cuda:0",
                             "out": "cuda:0"}
    assert p.copies() == []  # a1 and sq are scalar arguments of the GPU kernels
    assert by_name(g)["sq"] in GraphIndex.of(g).scalars


def test_host_scalars_follow_the_allowed_devices_and_eager_placement_ignores_them():
    g = w1_graph()
    cost = sync_cost()
    only_gpu = place(g, cost, devices=["cuda:0"])
    assert set(devices_of(only_gpu).values()) == {"cuda:0"}
    assert only_gpu.copies() == []
    eager = place(g, cost, policy="single")
    assert devices_of(eager)["l0"] == "cuda:0"  # a node without a tensor goes with its input


def test_w2_passed_in_is_placed_by_cost_not_pinned():
    g = w2_passed_in_graph()
    gpu_cheap = FakeCost(machine(cpus=1, gpus=1), default=1e-6, bandwidth=1e3, latency=1e-3)
    p = place(g, gpu_cheap)
    assert devices_of(p) == {"m": "cuda:0", "sq": "cuda:0", "out": "cuda:0"}
    assert not any(note.startswith("pinned: host scalar") for note in p.notes.values())


# -- explain ------------------------------------------------------------------------------
def h200x2_crossing(crossing_s: float) -> Machine:
    """The h200x2 preset with the executor's host<->GPU crossing cost set to ``crossing_s``."""
    m = preset("h200x2")
    return dataclasses.replace(m, profile=dataclasses.replace(m.profile, crossing_s=crossing_s))


def test_explain_lists_one_sync_per_gpu_value_the_host_reads():
    """With copies to the host at the link's cost alone, reading r0 once beats two syncs; at
    the executor's crossing cost (25 us on the preset) two syncs on the GPU are cheaper."""
    report = explain_graph(bound_arithmetic_graph(), h200x2_crossing(0.0))
    assert report.syncs == ["%r0 is read from cuda:0 once per call (one sync) by 2 host op(s): "
                            "aten.add.Tensor%hi, aten._local_scalar_dense%l0"]
    assert "host sync: %r0 is read from cuda:0 once per call" in report.to_text()
    assert explain_graph(bound_arithmetic_graph(), "h200x2").syncs == [
        "aten._local_scalar_dense%l0 reads a value back to the host on cuda:0 (one sync per call)",
        "aten._local_scalar_dense%l1 reads a value back to the host on cuda:0 (one sync per call)"]
    eager = explain_graph(w1_graph(), "h200x2", policy="single")
    assert eager.syncs == [
        "aten._local_scalar_dense%l0 reads a value back to the host on cuda:0 (one sync per call)",
        "aten._local_scalar_dense%l1 reads a value back to the host on cuda:0 (one sync per call)"]


# -- capture ------------------------------------------------------------------------------
def w1(A, B, r0, r1, c0, c1):
    B[:] = A[r0:r1, c0:c1]
    return B


def w1_made_inside(A, B):
    r0, r1 = torch.tensor(2, device=A.device), torch.tensor(6, device=A.device)
    c0, c1 = torch.tensor(1, device=A.device), torch.tensor(5, device=A.device)
    B[:] = A[r0:r1, c0:c1]
    return B


def bound_reused_and_item(A, B, r0):
    B[:] = A[r0:r0 + 4, r0:r0 + 4]
    return B * r0.item()


def w2(a1, A):
    return a1 * A + a1**2


def rand(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(0))


def w1_inputs():
    return rand(8, 8), rand(4, 4), torch.tensor(2), torch.tensor(6), torch.tensor(1), \
        torch.tensor(5)


CASES = {
    "w1": (w1, w1_inputs),
    "w1_made_inside": (w1_made_inside, lambda: w1_inputs()[:2]),
    "bound_reused_and_item": (bound_reused_and_item, lambda: (*w1_inputs()[:2], torch.tensor(3))),
    "w2": (w2, lambda: (torch.tensor(10.0), rand(6, 6))),
    "w2_made_inside": (w2_scalar_made_inside, lambda: (rand(6, 6),)),
    "narrow_at_item": (narrow_at_item, lambda: (rand(8, 3), torch.tensor(5))),
}


def record_graphs(fn, args):
    graphs = []

    def build(graph, phase):
        graphs.append(graph)
        return SequentialRunner(graph)

    compiled = torch.compile(fn, backend=make_backend(build), dynamic=False)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        out = compiled(*args)
    return graphs, out


@aot_traces_bounds
def test_tensor_slice_bounds_are_one_graph_with_one_read_per_bound():
    (g,), _ = record_graphs(w1, w1_inputs())
    reads = [n for n in g.ops if n.op is READ]
    assert [n.args[0].name for n in reads] == ["arg0_1", "arg1_1", "arg2_1", "arg3_1"]
    assert all(n.meta == ScalarMeta("int") for n in reads)


@aot_traces_bounds
def test_a_tensor_read_twice_becomes_one_read():
    from torch._dynamo.backends.common import aot_autograd

    kept = []

    def keep(gm, example_inputs):
        kept.append(gm)
        return gm

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch.compile(w1, backend=aot_autograd(fw_compiler=keep), dynamic=False)(*w1_inputs())
    (gm,) = kept
    first = next(n for n in gm.graph.nodes if n.target is READ)
    user = next(iter(first.users))
    with gm.graph.inserting_before(user):  # a second read of the same tensor for that use
        again = gm.graph.call_function(READ, first.args)
    again.meta = dict(first.meta)
    user.replace_input_with(first, again)
    graph, _ = from_fx(gm)
    reads = [n for n in graph.ops if n.op is READ]
    assert [n.args[0].name for n in reads] == ["arg0_1", "arg1_1", "arg2_1", "arg3_1"]


def test_a_bound_that_decides_an_output_shape_runs_that_graph_eagerly(caplog):
    def take(A, r0, r1):
        return A[r0:r1]

    A = torch.rand(8, 8)
    graphs, out = record_graphs(take, (A, torch.tensor(1), torch.tensor(3)))
    assert graphs == []
    assert "symbolic shape" in caplog.text
    torch.testing.assert_close(out, A[1:3])


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("front", ["torch.compile", "autopar.compile"])
def test_results_equal_eager(name, front):
    fn, make = CASES[name]
    expected_args, args = make(), make()
    expected = fn(*expected_args)
    if front == "autopar.compile":
        compiled = autopar.compile(fn, devices="cpu:0,cpu:1")
        got = compiled(*args)
    else:
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            got = torch.compile(fn, backend="autopar")(*args)
    torch.testing.assert_close(got, expected)
    for a, e in zip(args, expected_args):
        torch.testing.assert_close(a, e)  # B[:] = ... applied to the input


@aot_traces_bounds
def test_autopar_compile_keeps_scalar_reads_in_one_graph_placed_on_the_host():
    placements = []
    from autopar.api import Options, Runner

    class Recording(Runner):
        def __call__(self, graph, phase):
            run = super().__call__(graph, phase)
            placements.append(self.executors[-1].plan.placement)
            return run

    runner = Recording(Options.parse({"devices": "cpu:0,cpu:1"}))
    compiled = torch.compile(bound_reused_and_item, backend=make_backend(runner), dynamic=False)
    from autopar.capture.dynamo import capturing_scalars

    A, B, r0 = *w1_inputs()[:2], torch.tensor(3)
    out = capturing_scalars(compiled)(A, B.clone(), r0)
    torch.testing.assert_close(out, bound_reused_and_item(A, B.clone(), r0))
    (p,) = placements
    reads = [n for n in p.graph.ops if n.op is READ]
    assert len(reads) == 3  # r0, r0 + 4 for the rows, r0 + 4 for the columns
    assert {p.device[n] for n in reads} == {"cpu:0"}


def test_a_scalar_expanded_to_a_matrix_is_not_a_host_scalar():
    """``one = full([], 1.0)``; ``m = one.expand(600, 600)`` on cuda:0: on the host, the
    expanded view would be copied whole."""
    g = Graph("expanded")
    x = g.input(tensor((600, 600), "cuda:0"), name="x")
    one = g.call(aten.full.default, ([], 1.0), {"device": torch.device("cuda:0")}, name="one")
    m = g.call(aten.expand.default, (one, [600, 600]), name="m")
    g.set_outputs([g.call(aten.mul.Tensor, (x, m), name="out")])
    assert GraphIndex.of(g).host == frozenset()


@aot_traces_bounds
def test_explain_by_running_w1_places_the_reads_on_the_host_and_says_so():
    report = autopar.explain(w1, *w1_inputs(), machine=h200x2_crossing(0.0), inputs_on="cuda:0",
                             run=True)
    assert report.captured == "captured by running on this host: 1 graphs"
    reads = [r for r in report.rows if r.op == "aten._local_scalar_dense"]
    assert [r.device for r in reads] == ["cpu:0"] * 4
    assert [s.split(" is read")[0] for s in report.syncs] == [
        "%arg0_1", "%arg1_1", "%arg2_1", "%arg3_1"]
    assert report.transfers == 4


def test_capturing_scalars_stops_switching_once_not_needed():
    from autopar.capture.dynamo import capturing_scalars

    seen: list[bool] = []
    need = {"now": True}

    def compiled(x):
        seen.append(torch._dynamo.config.capture_scalar_outputs)
        return x + 1

    f = capturing_scalars(compiled, needed=lambda: need["now"])
    assert f(1) == 2
    need["now"] = False
    assert f(1) == 2
    assert seen == [True, False]
    assert torch._dynamo.config.capture_scalar_outputs is False


def test_a_dynamo_failure_with_scalars_captured_is_traced_again_without(caplog):
    from autopar.capture.dynamo import capturing_scalars

    calls: list[bool] = []

    def compiled(x):
        calls.append(torch._dynamo.config.capture_scalar_outputs)
        if torch._dynamo.config.capture_scalar_outputs:
            raise torch._dynamo.exc.InternalTorchDynamoError("PendingUnbackedSymbolNotFound")
        return x * 2

    f = capturing_scalars(compiled)
    with caplog.at_level("WARNING", logger="autopar"):
        assert f(3) == 6
    assert f(4) == 8
    assert calls == [True, False, False]
    assert "tracing it with graph breaks at .item() instead" in caplog.text


def test_a_backend_failing_on_a_data_dependent_value_is_traced_again_without_scalars(caplog):
    """torch 2.11's aot_autograd on tensor slice bounds passed in: the backend's failure
    (``GuardOnDataDependentSymNode``) reached the user; now the call is traced with graph breaks
    instead. Any other backend failure is raised as it is."""
    from autopar.capture.dynamo import capturing_scalars

    def failing(why):
        calls = []

        def compiled(x):
            calls.append(torch._dynamo.config.capture_scalar_outputs)
            if torch._dynamo.config.capture_scalar_outputs:
                raise torch._dynamo.exc.BackendCompilerFailed("ours", why, None)
            return x * 2
        return compiled, calls

    compiled, calls = failing(RuntimeError("GuardOnDataDependentSymNode: Eq(256, u4)"))
    with caplog.at_level("WARNING", logger="autopar"):
        assert capturing_scalars(compiled)(3) == 6
    assert calls == [True, False] and "tracing it with graph breaks" in caplog.text
    compiled, calls = failing(ValueError("an unrelated bug"))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="unrelated"):
        capturing_scalars(compiled)(3)


def test_the_registered_backend_runs_a_graph_aot_fails_on_as_captured(monkeypatch, caplog):
    """``torch.compile(fn, backend="autopar")`` can't ask dynamo to trace again with graph
    breaks: a graph whose captured values this torch's aot_autograd fails on (2.11 on W1's
    bounds) runs as dynamo captured it, logged, instead of raising where eager runs; any other
    failure is raised."""
    from autopar import backend

    def failing(why):
        def built(gm, example_inputs):
            raise why
        return built

    monkeypatch.setattr(backend, "make_backend", lambda runner: failing(
        RuntimeError("GuardOnDataDependentSymNode: Could not guard on Eq(4, u4)")))
    monkeypatch.setattr(backend, "_BACKENDS", {})
    A, B, *bounds = w1_inputs()
    with caplog.at_level("WARNING", logger="autopar"), \
            torch._dynamo.config.patch(capture_scalar_outputs=True):  # one graph, as 2.11's
        got = torch.compile(w1, backend="autopar")(A, B.clone(), *bounds)
    torch.testing.assert_close(got, w1(A, B.clone(), *bounds))
    assert "runs as captured, op by op" in caplog.text
    monkeypatch.setattr(backend, "make_backend", lambda runner: failing(ValueError("a bug")))
    monkeypatch.setattr(backend, "_BACKENDS", {})
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="a bug"), \
            torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch.compile(w1, backend="autopar")(A, B.clone(), *bounds)


def test_a_fused_kernels_host_lr_reaches_the_gpu_kernel_uncopied():
    """A fused optimizer's scheduled ``lr`` is a host tensor its GPU kernel reads as a number:
    placed on the GPU with the kernel, it is not copied there (CUDA's kernel refuses a
    float64 ``lr`` on the device, and no CUDA graph may bake a host value in); the tensors
    of the update are the kernel's. The step counts, 0-dim GPU values, stay GPU values."""
    g = Graph("fused_adamw")
    ps, gs, ms, vs = ([g.input(tensor((4, 4), "cuda:0"), name=f"{k}{i}") for i in range(2)]
                      for k in "pgmv")
    steps = [g.input(tensor((), "cuda:0"), name=f"step{i}") for i in range(2)]
    lr = g.input(tensor((), "cpu", torch.float64), name="lr")
    upd = g.call(aten._fused_adamw.tensor_lr, (ps, gs, ms, vs, [], steps), dict(
        lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
        maximize=False), meta=(*((tensor((4, 4), "cuda:0"),) * 2 for _ in range(4)), ()),
        name="update")
    g.set_outputs([upd])
    ix = GraphIndex.of(g)
    assert lr in ix.scalars and not set(steps) & ix.scalars
    p = place(g, sync_cost(), devices=["cuda:0"])
    assert devices_of(p)["update"] == "cuda:0"
    assert p.copies() == []
    eager = place(g, sync_cost(), policy="single")
    assert devices_of(eager)["update"] == "cuda:0" and eager.copies() == []


def test_where_no_host_device_is_allowed_a_host_scalar_ops_host_input_is_copied():
    """AdamW's host step counts get ``+ torch.tensor(1.0)`` (a host constant's
    ``lift_fresh_copy``, a host scalar op). Under ``devices=["cuda:0"]`` that op runs on the
    GPU, so its host input is copied there: handed over uncopied, it made a host tensor the
    plan held to be the GPU's, which ``_foreach_add`` on the GPU refused."""
    g = Graph("step_counts")
    steps = [g.input(tensor((), "cpu"), name=f"step{i}") for i in range(2)]
    one = g.input(tensor((), "cpu"), name="one")
    inc = g.call(aten.lift_fresh_copy.default, (one,), name="inc")
    add = g.call(aten._foreach_add.Tensor, (steps, inc), meta=(tensor((), "cpu"),) * 2,
                 name="add")
    g.set_outputs([add])
    assert inc in GraphIndex.of(g).host and one in GraphIndex.of(g).scalars
    only_gpu = place(g, sync_cost(), devices=["cuda:0"])
    assert devices_of(only_gpu)["inc"] == "cuda:0"
    assert not only_gpu.index.host and one not in only_gpu.index.scalars
    assert ("one", "cuda:0") in [(v.name, d) for v, d in only_gpu.copies()]
    with_host = place(g, sync_cost())
    assert devices_of(with_host)["inc"] == "cpu:0"
