"""The executor on logical CPU workers: results, concurrency, failures, bounded waits."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.cost.model import CostModel
from autopar.ir.graph import Graph, Node, TensorMeta
from autopar.machine.presets import preset
from autopar.runtime import Executor, SequentialRunner, WorkerError
from autopar.runtime import executor as executor_module
from autopar.schedule.place import Placement, place
from autopar.schedule.plan import make_plan
from autopar.schedule.steps import Plan, Run, Wait

aten = torch.ops.aten
CPUS = ("cpu:0", "cpu:1")


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel(preset("cpu-only", cpu_workers=2))


def branches(n: int = 4, size: int = 64) -> Graph:
    """Two independent chains joined at the end.

        a -> mm -> mm -> ... -\\
                               add -> out
        b -> mm -> mm -> ... -/
    """
    g = Graph("branches")
    a = g.input(TensorMeta.make((size, size)), "a")
    b = g.input(TensorMeta.make((size, size)), "b")
    ya, yb = a, b
    for _ in range(n):
        ya = g.call(aten.mm.default, (ya, a))
        ya = g.call(aten.mul.Tensor, (ya, 1.0 / size))
        yb = g.call(aten.mm.default, (yb, b))
        yb = g.call(aten.mul.Tensor, (yb, 1.0 / size))
    g.set_outputs([g.call(aten.add.Tensor, (ya, yb)), ya])
    return g


def by_hand(graph: Graph, devices: dict[int, str]) -> Placement:
    """A placement that puts op ``id`` on ``devices[id]`` (cpu:0 otherwise), in graph order."""
    device = {n: devices.get(n.id, "cpu:0") for n in graph.nodes}
    for x in graph.inputs:
        device[x] = "cpu:0"
    order: dict[str, list[Node]] = {}
    for n in graph.ops:
        order.setdefault(device[n], []).append(n)
    return Placement(graph=graph, device=device, order=order, policy="by_hand", notes={},
                     predicted_s=0.0)


def inputs(graph: Graph, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(x.meta.shape, generator=gen) for x in graph.inputs]


def test_round_robin_on_two_workers_equals_sequential(cost):
    g = branches()
    plan = make_plan(place(g, cost, policy="round_robin", devices=CPUS), cost)
    assert {"cpu:0", "cpu:1"} <= set(plan.programs)
    args = inputs(g)
    got = Executor(plan)(args)
    want = SequentialRunner(g)(args)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_two_branches_overlap_in_the_measured_timeline(cost):
    """Each chain on its own worker: the workers' measured spans overlap in time."""
    g = branches(n=6, size=384)
    left = {n.id for n in g.ops if n.id % 4 in (2, 3)}  # mm/mul of chain a (ids 2,3,6,7,...)
    devices = {n.id: ("cpu:0" if n.id in left else "cpu:1") for n in g.ops}
    plan = make_plan(by_hand(g, devices), cost)
    ex = Executor(plan, trace=True)
    args = inputs(g)
    ex(args)
    ex(args)
    tl = ex.last_timeline
    assert tl is not None and tl.source == "measured"
    assert set(tl.lanes()) == {"cpu:0", "cpu:1"}
    a, b = tl.on("cpu:0"), tl.on("cpu:1")
    overlap = sum(max(0.0, min(x.end, y.end) - max(x.start, y.start)) for x in a for y in b)
    assert overlap > 0.2 * min(tl.busy("cpu:0"), tl.busy("cpu:1"))
    assert len(tl.spans) == len(g.ops)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_placements_give_sequential_results(cost, data):
    """Random DAGs of real ops, each op on a random worker: same values as graph order."""
    n_ops = data.draw(st.integers(3, 24))
    g = Graph("random")
    values = [g.input(TensorMeta.make((8, 8)), f"x{i}") for i in range(2)]
    ops = [aten.add.Tensor, aten.mul.Tensor, aten.mm.default, aten.sub.Tensor]
    for _ in range(n_ops):
        op = data.draw(st.sampled_from(ops))
        a = data.draw(st.sampled_from(values))
        b = data.draw(st.sampled_from(values))
        out = g.call(op, (a, b))
        values.append(g.call(aten.tanh.default, (out,)))  # keep values bounded
    g.set_outputs(values[-3:])
    devices = {n.id: data.draw(st.sampled_from(CPUS)) for n in g.ops}
    plan = make_plan(by_hand(g, devices), cost)
    args = inputs(g, seed=n_ops)
    for x, y in zip(Executor(plan)(args), SequentialRunner(g)(args)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def failing_graph() -> Graph:
    """x -> neg -> mm(bad shapes) on one worker while the other waits for it."""
    g = Graph("failing")
    x = g.input(TensorMeta.make((4, 3)), "x")
    a = g.call(aten.neg.default, (x,))
    bad = g.call(aten.mm.default, (a, a), meta=TensorMeta.make((4, 4)), source="user.py:7")
    c = g.call(aten.relu.default, (bad,))
    g.set_outputs([c])
    return g


def test_a_failing_op_stops_every_worker_and_names_the_op(cost):
    g = failing_graph()
    plan = make_plan(by_hand(g, {2: "cpu:1", 3: "cpu:1", 4: "cpu:0"}), cost)
    ex = Executor(plan)
    for _ in range(2):  # the workers survive a failure and serve the next call
        with pytest.raises(RuntimeError) as info:
            ex([torch.randn(4, 3)])
        assert "mat1 and mat2 shapes cannot be multiplied" in str(info.value)
        notes = getattr(info.value, "__notes__", [])
        assert any("aten.mm" in n and "cpu:1" in n and "user.py:7" in n for n in notes)
    assert all(t.is_alive() for t in threading.enumerate() if t.name.startswith("autopar-"))


def test_a_wait_that_never_ends_is_bounded(cost, monkeypatch):
    """A program waiting for an event nobody records times out with a clear message."""
    g = branches(n=1, size=4)
    plan = make_plan(by_hand(g, {}), cost)
    x = g.ops[0]
    stuck = dict(plan.programs)
    stuck["cpu:0"] = [Wait(plan.n_events, x, "cpu:1"), *stuck["cpu:0"]]
    broken = Plan(plan.graph, plan.placement, stuck, plan.outputs, plan.n_events + 1)
    monkeypatch.setattr(executor_module, "_TIMEOUT", 0.2)
    with pytest.raises(WorkerError, match=r"waited 0 s for event .* never came"):
        Executor(broken)(inputs(g))


def test_generated_programs_are_straight_line_code(cost):
    g = branches(n=2, size=8)
    plan = make_plan(place(g, cost, policy="round_robin", devices=CPUS), cost)
    src = Executor(plan).source()
    runs = sum(isinstance(s, Run) for steps in plan.programs.values() for s in steps)
    assert src.count(" = c") == runs  # one call line per op, nothing interpreted
    assert "for " not in src and "while " not in src


def test_input_count_is_checked(cost):
    g = branches(n=1, size=4)
    ex = Executor(make_plan(by_hand(g, {}), cost))
    with pytest.raises(TypeError, match="takes 2 inputs, got 1"):
        ex([torch.randn(4, 4)])


def test_one_program_runs_as_one_function_and_still_names_a_failing_op(cost):
    g = failing_graph()
    ex = Executor(make_plan(by_hand(g, {}), cost))
    assert ex.solo == "cpu:0" and ex.source().startswith("# cpu:0\ndef program(args, rt=None):")
    with pytest.raises(RuntimeError) as info:
        ex([torch.randn(4, 3)])
    assert any("aten.mm" in n and "user.py:7" in n for n in getattr(info.value, "__notes__", []))
    g2 = branches(n=2, size=8)
    args = inputs(g2)
    for x, y in zip(Executor(make_plan(by_hand(g2, {}), cost))(args), SequentialRunner(g2)(args)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_a_solo_host_programs_own_call_reports_falls_back_and_shows_in_the_profiler(cost, caplog):
    """``Executor.unchecked`` (the host's one program, which ``guards="arguments"`` entries
    call past the executor): a failing op is named as by the executor's call; under the
    runner that falls back (``_FallsBack``) the failure becomes eager's result, logged once,
    on that path and the other; under torch.profiler the call still has its ranges."""
    import logging

    from torch.profiler import ProfilerActivity, profile

    from autopar.pipeline import _FallsBack

    g = failing_graph()
    ex = Executor(make_plan(by_hand(g, {}), cost))
    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError) as info:
        ex.unchecked([x])
    assert any("aten.mm" in n and "user.py:7" in n for n in getattr(info.value, "__notes__", []))

    g2 = branches(n=1, size=4)
    args = inputs(g2)
    ex2 = Executor(make_plan(by_hand(g2, {}), cost))
    want = SequentialRunner(g2)(args)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = ex2.unchecked(args)
    names = {e.name for e in prof.events()}
    assert {f"autopar:{g2.name}", f"autopar:{g2.name}:cpu:0"} <= names
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    falls = _FallsBack(ex2, g2)
    assert falls.unchecked is ex2.unchecked  # the fast call, with the fallback inside it
    namespace = ex2.unchecked.__globals__
    mm = next(k for k, v in namespace.items() if k.startswith("c") and callable(v))

    def broken(*a, **k):
        raise RuntimeError("the plan's kernel failed")
    namespace[mm] = broken
    with caplog.at_level(logging.WARNING, logger="autopar"):
        for call in (falls.unchecked, falls, falls.unchecked):
            for a, b in zip(call(args), want):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    said = [r.getMessage() for r in caplog.records if "from now on" in r.getMessage()]
    assert len(said) == 1 and "the plan's kernel failed" in said[0]


def _worker_state(device: str, ex: Executor, args: list) -> dict:
    """What a worker thread sees while it runs its part of ``ex(args)``, called here."""
    seen: dict = {}
    real = ex._run

    def spy(dev, call):
        if dev == device:
            seen.update(grad=torch.is_grad_enabled(), inference=torch.is_inference_mode_enabled(),
                        autocast=torch.is_autocast_enabled("cpu"),
                        dtype=torch.get_autocast_dtype("cpu"),
                        thread=threading.current_thread().name)
        real(dev, call)
    ex._run = spy
    ex(args)
    return seen


def test_worker_threads_run_in_the_callers_thread_local_state(cost):
    """cpu:1's program runs on a worker thread under the caller's grad mode, inference mode
    and autocast, and the worker's own state is back afterwards (its thread is reused)."""
    g = branches()
    ex = Executor(make_plan(place(g, cost, policy="round_robin", devices=CPUS), cost))
    assert ex.threaded == ["cpu:1"]
    args = inputs(g)
    with torch.no_grad():
        assert _worker_state("cpu:1", ex, args) == dict(
            grad=False, inference=False, autocast=False, dtype=torch.bfloat16,
            thread="autopar-cpu:1")
    with torch.inference_mode():
        seen = _worker_state("cpu:1", ex, args)
        assert seen["inference"] and not seen["grad"]
    with torch.autocast("cpu", dtype=torch.float16):
        seen = _worker_state("cpu:1", ex, args)
        assert seen["autocast"] and seen["dtype"] == torch.float16 and seen["grad"]
    after: list = []
    done = threading.Event()
    executor_module._Worker.of("cpu:1").jobs.put(lambda: (after.append(
        (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
         torch.get_autocast_dtype("cpu"))), done.set()))
    assert done.wait(10)
    assert after == [(True, False, torch.bfloat16)]


def test_a_call_on_worker_threads_changes_no_thread_count(cost):
    """Thread counts are process-wide in PyTorch (a thread started later inherits them): a call
    with a worker thread leaves the caller's and a new thread's count as they were."""
    g = branches()
    ex = Executor(make_plan(place(g, cost, policy="round_robin", devices=CPUS), cost))

    def new_thread_count() -> int:
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        return seen[0]

    caller, fresh = torch.get_num_threads(), new_thread_count()
    ex(inputs(g))
    assert (torch.get_num_threads(), new_thread_count()) == (caller, fresh)


def test_moves_left_on_the_host_hand_their_inputs_on_and_results_stay_eagers():
    """``(x.to("cuda") @ y.to("cuda")).cpu()`` placed on the host (h200x2 preset, 5x5): runs
    without CUDA, the moves are the values themselves (no copy lines), the result is eager's and
    a storage of its own, and the inputs are untouched."""
    aten = torch.ops.aten
    g = Graph("via_gpu")
    ins = [g.input(TensorMeta.make((5, 5), device="cpu"), name) for name in "xy"]
    moved = [g.call(aten._to_copy.default, (v,), {"device": torch.device("cuda:0")},
                    meta=TensorMeta.make((5, 5), device="cuda:0")) for v in ins]
    mm = g.call(aten.mm.default, tuple(moved))
    g.set_outputs([g.call(aten._to_copy.default, (mm,), {"device": torch.device("cpu")},
                          meta=TensorMeta.make((5, 5), device="cpu"))])
    cost = CostModel(preset("h200x2"))
    placement = place(g, cost, devices=["cpu:0", "cuda:0"])
    assert set(placement.device.values()) == {"cpu:0"}
    ex = Executor(make_plan(placement, cost))
    (program,) = ex.programs.values()
    moves = [line for line in program.source.splitlines() if "aten._to_copy" in line]
    # each is its input's slot handed on (a local of the whole call's program: no list)
    assert len(moves) == 3 and all(re.fullmatch(r"v\d+", line.split("=")[1].split("#")[0].strip())
                                   and "a free move" in line for line in moves)
    x, y = torch.randn(5, 5), torch.randn(5, 5)
    keep = (x.clone(), y.clone())
    (got,) = ex([x, y])
    torch.testing.assert_close(got, x @ y, rtol=0, atol=0)
    assert got.data_ptr() not in (x.data_ptr(), y.data_ptr())
    torch.testing.assert_close((x, y), keep, rtol=0, atol=0)


def test_an_expanded_value_crosses_devices_once_and_arrives_expanded():
    """A copy moves a broadcast value's one row per broadcast dimension and expands it back:
    the consumer sees eager's strides (0 there), which SDPA's efficient kernel checks."""
    padded = torch.randn(4, 1, 11, 16)
    bias = padded[..., :11].expand(4, 4, 11, 11)
    compact, shape = executor_module._unexpanded(bias)
    assert compact.shape == (4, 1, 11, 11) and shape == bias.shape
    out = executor_module._copy_to(compact, "cpu").expand(shape)
    assert out.stride() == bias.stride() == (176, 0, 16, 1) and torch.equal(out, bias)
    plain = torch.randn(3, 4)
    assert executor_module._unexpanded(plain) == (plain, None)
    assert executor_module._unexpanded(torch.randn(3, 1).expand(3, 1))[1] is None


def test_a_copy_keeps_the_strides_of_a_non_dense_view():
    """A slice of a padded buffer (SDPA's padded attention bias) crosses devices with its
    strides, which ``.to()`` would drop; dense layouts (a transpose) are ``.to()``'s own, and
    an expand (stride 0) can't be written into, so it is copied dense."""
    padded = torch.randn(2, 17, 24)
    view = padded[..., :17]
    assert executor_module._kept_strides(view) == view.stride()
    out = executor_module._empty_like_on(view, "cpu").copy_(view)
    assert out.stride() == view.stride() and torch.equal(out, view)
    assert executor_module._kept_strides(torch.randn(5, 3).t()) is None
    assert executor_module._kept_strides(torch.randn(3, 1).expand(3, 4)) is None
    assert executor_module._kept_strides(torch.randn(4, 4)) is None
    assert executor_module._copy_to(view, "cpu").stride() == view.stride()


def _sliced(chain, also_out: bool = False) -> Graph:
    """A graph of slice views of its input ``A`` (6 x 5): ``chain`` = [(dim, start, end)]."""
    g = Graph("slices")
    x = a = g.input(TensorMeta.make((6, 5)), "A")
    views = []
    for dim, start, end in chain:
        x = g.call(torch.ops.aten.slice.Tensor, (x, dim, start, end))
        views.append(x)
    g.set_outputs([x, views[0]] if also_out else [x])
    assert a.is_input
    return g


@pytest.mark.parametrize("chain", [
    [(0, 1, 4), (1, 2, 5)],  # W1's A[r0:r1, c0:c1]
    [(0, -4, None), (-1, None, 3), (0, 1, 2)],  # negative and open bounds, three deep
    [(1, 1, 99), (0, 2, 6)],  # an end past the size
])
def test_a_chain_of_slices_from_an_input_is_one_view_at_the_inputs_offset(chain):
    runner = SequentialRunner(_sliced(chain))
    source = runner.program.source
    assert "slices as one view" in source and "slice" not in source.replace(
        "slices as one view", "")
    big = torch.randn(8, 5)
    A = big[2:]  # the input's strides, at a storage offset of its own
    want = A
    for dim, start, end in chain:
        want = want[(slice(None),) * (dim % 2) + (slice(start, end),)]
    got = runner([A])[0]
    assert torch.equal(got, want) and got.stride() == want.stride()
    assert got.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()  # a view


def test_a_slice_something_else_reads_is_kept_and_a_single_slice_stays_a_slice():
    runner = SequentialRunner(_sliced([(0, 1, 4), (1, 2, 5)], also_out=True))
    source = runner.program.source
    assert source.count("slices as one view") == 1 and "aten.slice.Tensor" in source
    A = torch.randn(6, 5)
    end, first = runner([A])
    assert torch.equal(end, A[1:4, 2:5]) and torch.equal(first, A[1:4])
    one = SequentialRunner(_sliced([(0, 1, 4)])).program.source
    assert "slices as one view" not in one and "aten.slice.Tensor" in one


def test_ops_run_through_the_python_binding_that_provably_dispatches_them():
    """fast_call: torch's binding where calling it on meta tensors dispatched the very op with
    the very arguments (add, permute, a Tensor method for view), else the op's C++ entry
    (linear decomposes below autograd; gelu has no binding); the results are eager's."""
    from autopar.runtime.codegen import fast_call

    aten = torch.ops.aten
    g = Graph("bindings")
    x = g.input(TensorMeta.make((4, 8)), "x")
    w = g.input(TensorMeta.make((3, 8)), "w")
    add = g.call(aten.add.Tensor, (x, x))
    perm = g.call(aten.permute.default, (add, [1, 0]))
    view = g.call(aten.view.default, (add, [32]))
    lin = g.call(aten.linear.default, (x, w))
    gelu = g.call(aten.gelu.default, (lin,))
    g.set_outputs([perm, view, gelu])
    assert fast_call(add) is torch._C._VariableFunctions.add
    assert fast_call(perm) is torch._C._VariableFunctions.permute
    assert fast_call(view) is torch.Tensor.view
    assert fast_call(lin) is aten.linear.default._op
    assert fast_call(gelu) is aten.gelu.default._op
    X, W = torch.randn(4, 8), torch.randn(3, 8)
    got = SequentialRunner(g)([X, W])
    torch.testing.assert_close(got[0], (X + X).permute(1, 0))
    torch.testing.assert_close(got[1], (X + X).view(32))
    torch.testing.assert_close(got[2], torch.nn.functional.gelu(X @ W.T))



def test_no_value_of_a_call_outlives_it_on_a_worker_thread():
    """A CPU worker's thread kept its last job, whose closure held the call's values (inputs,
    activations, outputs, parameters' aliases), until its next job: on two workers an input,
    or a split's output with the input's storage, outlived its call (2026-12-05)."""
    import gc
    import weakref

    import autopar

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    c = autopar.compile(m, devices="cpu:0,cpu:1", policy="round_robin", candidates=("autopar",))
    for _ in range(3):
        x = torch.randn(8, 64)
        out = c(x)
        out.sum().backward()
        torch.testing.assert_close(out, m(x))
        left = weakref.ref(x), weakref.ref(out)
        del x, out
        gc.collect()
        assert [r() is None for r in left] == [True, True]
