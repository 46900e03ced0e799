"""CUDA-graph segments: which are formed, which can be captured, what pays, and the runtime
state machine, checked on the CPU with a stand-in for CUDA graphs that has their memory
semantics (static inputs and outputs, overwritten by each replay).

The same machinery on a real GPU: tests/test_cudagraphs_gpu.py.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from _fakes import by_hand
from autopar.cost.model import CostModel
from autopar.ir.graph import Graph, TensorMeta
from autopar.machine.presets import preset
from autopar.passes.cudagraphs import capture_rule, pays
from autopar.runtime import Executor, SequentialRunner
from autopar.runtime import executor as executor_module
from autopar.schedule.plan import make_plan
from autopar.schedule.segments import segments, why_not_capturable
from autopar.schedule.steps import Free, Run, Wait
from corpus import CASES, autopar_compile, case, run_case

aten = torch.ops.aten
RUN_SLOW = os.environ.get("AUTOPAR_SLOW") == "1"


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel(preset("cpu-only", cpu_workers=2))


class StandInGraphs:
    """Captures by running the segment; a replay runs it again on the static inputs and writes
    the results into the static outputs, as a CUDA graph's replay overwrites its memory."""

    def __init__(self, fail: str | None = None, skew: float = 0.0) -> None:
        self.fail = fail
        self.skew = skew  # added to every replayed value: a graph that baked something in
        self.captures = 0
        self.current = "stream 0"  # the calling thread's current stream
        self.orders: list[tuple[str, str]] = []  # (later, earlier) stream waits made

    def enable_peer_access(self, gpus) -> None:
        pass

    def stream(self, device):
        return self.current

    def order(self, later, earlier) -> None:
        self.orders.append((later, earlier))

    def capture(self, run, static_in, device):
        self.captures += 1
        if self.fail:
            raise RuntimeError(self.fail)
        run(static_in)  # warm-up
        outs = run(static_in)

        def replay() -> None:
            for out, fresh in zip(outs, run(static_in)):
                out.copy_(fresh + self.skew)
        return replay, outs


def split_chain() -> Graph:
    """cpu:0 runs two segments around ``d``, which cpu:1 computes.

        x -> a=mul -> b=add -> c=mul -> d=exp (cpu:1)
                      b ...................... e=mul(d, b) -> f=add -> g=relu -> out
    """
    g = Graph("split_chain")
    x = g.input(TensorMeta.make((4, 8)), "x")
    a = g.call(aten.mul.Tensor, (x, 0.5), name="a")
    b = g.call(aten.add.Tensor, (a, 1.0), name="b")
    c = g.call(aten.mul.Tensor, (b, b), name="c")
    d = g.call(aten.exp.default, (c,), name="d")
    e = g.call(aten.mul.Tensor, (d, b), name="e")
    f = g.call(aten.add.Tensor, (e, -1.0), name="f")
    g.set_outputs([g.call(aten.relu.default, (f,), name="g")])
    return g


def shown(steps) -> list[str]:
    return [f"{type(s).__name__.lower()} {(s.node if isinstance(s, Run) else s.value).name}"
            for s in steps]


def test_segments_end_at_cross_device_points(cost):
    plan = make_plan(by_hand(split_chain(), {"d": "cpu:1"}), cost)
    steps = plan.programs["cpu:0"]
    assert shown(steps) == ["run a", "run b", "free a", "run c", "record c", "wait d", "run e",
                            "free b", "run f", "free e", "run g", "free f"]
    assert [shown(steps[i:j]) for i, j in segments(steps)] == [
        ["run a", "run b", "free a", "run c"],
        ["run e", "free b", "run f", "free e", "run g", "free f"]]
    assert segments([Wait(0, steps[0].node, "cpu:1"), Free(steps[0].node, "cpu:0")]) == []


def test_what_cannot_be_captured_is_known_before_trying():
    g = Graph("uncapturable")
    x = g.input(TensorMeta.make((4,)), "x")
    host = g.input(TensorMeta.make(()), "host")
    r = g.call(aten.rand_like.default, (x,), name="r")
    w = g.call(aten.copy_.default, (x, r), name="w")
    nz = g.call(aten.nonzero.default, (x,), meta=TensorMeta.make((2, 1), torch.int64), name="nz")
    m = g.call(aten.mul.Tensor, (x, host), name="m")
    ok = g.call(aten.sin.default, (x,), name="ok")
    local = lambda v: v is not host  # noqa: E731
    why = {n.name: why_not_capturable([Run(n)], local) for n in (r, w, nz, m, ok)}
    assert why == {
        "r": "aten.rand_like draws random numbers (a failed capture would spoil the CUDA RNG)",
        "w": "aten.copy_ writes into its input (a graph would write into a static copy)",
        "nz": "aten.nonzero syncs with the host",
        "m": "aten.mul.Tensor reads %host from another memory pool",
        "ok": None,
    }


@pytest.mark.parametrize(("mode", "launches", "copies", "clones", "want"), [
    (False, 50, 0, 0, False),
    (True, 1, 3, 3, True),
    ("auto", 0, 0, 0, False),
    ("auto", 4, 1, 0, True),   # 4 launches against a replay, a copy: 2 * 2
    ("auto", 3, 1, 0, False),
    ("auto", 100, 2, 1, True),
    ("auto", 7, 2, 2, False),  # 7 < 2 * 5
])
def test_capture_pays_when_launches_outweigh_copies_and_clones(mode, launches, copies, clones,
                                                                want):
    assert pays(mode, launches, copies, clones) is want


@pytest.fixture
def stand_in(monkeypatch):
    """CPU workers get graph segments, captured by a :class:`StandInGraphs`."""
    def install(backend: StandInGraphs) -> StandInGraphs:
        monkeypatch.setattr(executor_module, "graph_devices",
                            lambda devices, rule: [] if rule is None else list(devices))
        monkeypatch.setattr(executor_module, "_GRAPH_BACKEND", backend)
        return backend
    return install


def test_segments_replay_with_static_buffers_and_equal_sequential(cost, stand_in):
    backend = stand_in(StandInGraphs())
    g = split_chain()
    ex = Executor(make_plan(by_hand(g, {"d": "cpu:1"}), cost), cuda_graphs=capture_rule(True))
    first, second, lone = ex.segments  # cpu:0's two, then cpu:1's exp
    assert "segment" in ex.source()
    assert lone.label == "segment split_chain/cpu:1#0 (1 steps)"
    outs = []
    for k in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        got = ex([x])
        torch.testing.assert_close(got, SequentialRunner(g)([x]), rtol=0, atol=0)
        outs.append((x, got[0]))
        want = "pending" if k == 0 else "captured"
        assert [s.status for s in ex.segments] == [want] * 3
    assert backend.captures == 3
    for x, out in outs:  # an output is cloned from the static buffer: later replays keep it
        torch.testing.assert_close(out, SequentialRunner(g)([x])[0], rtol=0, atol=0)
    # b stays in the first graph's static buffer and is the second's input as it is
    assert any(t is s for t in second._static_in for s in first._static_out)
    assert [escapes for _, escapes in first.output_slots] == [False, True]  # b, c (recorded)


def view_after_a_wait() -> Graph:
    """cpu:0: ``a = x * 0.5``, ``v = a.t()`` (a view), then, after waiting for cpu:1's
    ``h = exp(x)``, ``e = v @ h``; ``v`` is an output too."""
    g = Graph("view_after_a_wait")
    x = g.input(TensorMeta.make((4, 8)), "x")
    a = g.call(aten.mul.Tensor, (x, 0.5), name="a")
    v = g.call(aten.t.default, (a,), name="v")
    h = g.call(aten.exp.default, (x,), name="h")
    e = g.call(aten.mm.default, (v, h), name="e")
    g.set_outputs([e, v])
    return g


def test_a_view_read_after_its_segment_is_made_again_after_each_replay(cost, stand_in):
    """``v`` stays in the first segment (it used to end it): the segment hands out its root
    ``a`` (cloned after each replay, since ``v`` leaves the call) and ``v`` is made again
    from it after the replay; every call's outputs stay eager's after later replays."""
    from autopar.ir.routing import GraphIndex
    from autopar.schedule.segments import chosen_segments

    g = view_after_a_wait()
    plan = make_plan(by_hand(g, {"h": "cpu:1"}), cost)
    steps = plan.programs["cpu:0"]
    nodes = {n.name: n for n in g.nodes}
    (first, _) = chosen_segments(steps, GraphIndex.of(g), set(g.output_nodes),
                                 lambda v: True, lambda *_: True, lambda seg: 1)
    assert shown(steps[first.start:first.end])[:2] == ["run a", "run v"]
    assert first.again == (nodes["v"],) and first.outputs == (nodes["a"],)
    assert first.escapes == {nodes["a"]}
    backend = stand_in(StandInGraphs())
    ex = Executor(plan, cuda_graphs=capture_rule(True))
    outs = []
    for k in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        got = ex([x])
        torch.testing.assert_close(got, SequentialRunner(g)([x]), rtol=0, atol=0)
        outs.append((x, got))
    assert backend.captures == 3 and all(s.status == "captured" for s in ex.segments)
    for x, got in outs:
        torch.testing.assert_close(got, SequentialRunner(g)([x]), rtol=0, atol=0)


def test_a_view_of_a_static_buffer_is_made_once_and_equals_eager_every_call(cost, stand_in):
    """As above with ``v`` read only inside the call: its root ``a`` stays in its static
    buffer (no clone), so ``v`` is the same view every call (made at the first, an identity
    check after), and every call's output is eager's."""
    from autopar.ir.routing import GraphIndex
    from autopar.passes.cudagraphs import MADE_ONCE_S, GraphedCost, graphed_segments_each
    from autopar.schedule.segments import chosen_segments, views_made_once

    g = view_after_a_wait()
    g.set_outputs(g.outputs[:1])
    plan = make_plan(by_hand(g, {"h": "cpu:1"}), cost)
    steps = plan.programs["cpu:0"]
    nodes = {n.name: n for n in g.nodes}
    chosen = chosen_segments(steps, GraphIndex.of(g), set(g.output_nodes), lambda v: True,
                             lambda *_: True, lambda seg: 1)
    assert chosen[0].again == (nodes["v"],) and not chosen[0].escapes
    assert views_made_once(steps, chosen) == {nodes["v"]}
    graphed = graphed_segments_each(plan, ["cpu:0"], [capture_rule(True)])[0]
    assert graphed.once["cpu:0"] == {nodes["v"]}  # the prediction: one identity check
    assert GraphedCost(cost, *graphed).host_s(nodes["v"], "cpu:0") == MADE_ONCE_S
    stand_in(StandInGraphs())
    ex = Executor(plan, cuda_graphs=capture_rule(True))
    assert any("(made once)" in p.source for p in ex.programs.values())
    for k in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        torch.testing.assert_close(ex([x]), SequentialRunner(g)([x]), rtol=0, atol=0)
    assert all(s.status == "captured" for s in ex.segments)


def test_a_view_made_once_is_made_again_when_its_base_is_another_tensor():
    """The generated line keeps the view with the tensor it was made of: the same base gives
    the same view object, another base (a segment back on streams hands out new tensors) a
    new view of it; a base that keeps changing ends the keeping."""
    from autopar.runtime.codegen import SlotTable, build_program

    g = Graph("once")
    a = g.input(TensorMeta.make((2, 3)), "a")
    v = g.call(aten.t.default, (a,), name="v")
    g.set_outputs([v])
    slots = SlotTable()
    program = build_program("cpu:0", [Run(v)], slots, lambda n, d: d, set(),
                             once=frozenset({(v, "cpu:0")}))
    env = [None] * len(slots)
    base = torch.arange(6.0).view(2, 3)
    env[slots(a, "cpu:0")] = base
    program.fn(env, None)
    first = env[slots(v, "cpu:0")]
    program.fn(env, None)
    assert env[slots(v, "cpu:0")] is first and torch.equal(first, base.t())
    other = torch.ones(2, 3)
    env[slots(a, "cpu:0")] = other
    program.fn(env, None)
    got = env[slots(v, "cpu:0")]
    assert got is not first and got._base is other and torch.equal(got, other.t())
    # a base new at every call: after two more misses the cell keeps nothing (no call's
    # tensor outlives its call), and every view is still its base's
    cell = next(c for c in program.fn.__globals__.values()
                if isinstance(c, list) and len(c) == 2 and isinstance(c[0], tuple))
    for k in range(3):
        fresh = torch.full((2, 3), float(k))
        env[slots(a, "cpu:0")] = fresh
        program.fn(env, None)
        assert env[slots(v, "cpu:0")]._base is fresh
    assert not any(isinstance(x, torch.Tensor) for x in cell[0])


def test_a_failed_capture_stays_on_streams(cost, stand_in, caplog):
    backend = stand_in(StandInGraphs(fail="operation not permitted when stream is capturing"))
    g = split_chain()
    ex = Executor(make_plan(by_hand(g, {"d": "cpu:1"}), cost), cuda_graphs=capture_rule(True))
    with caplog.at_level(logging.WARNING, logger="autopar"):
        for k in range(3):
            x = torch.randn(4, 8) + k
            torch.testing.assert_close(ex([x]), SequentialRunner(g)([x]), rtol=0, atol=0)
    assert [s.status for s in ex.segments] == ["streams"] * 3
    assert ex.segments[0].reason == ("capture failed: RuntimeError: operation not permitted "
                                     "when stream is capturing")
    assert backend.captures == 3  # one try each, never again
    assert sum("stays on streams" in r.getMessage() for r in caplog.records) == 3


def test_uncapturable_and_unpaying_segments_are_never_tried(cost, stand_in):
    """A random op runs on streams between segments and is never captured; "auto" leaves a
    two-op segment with an input copy and an output clone alone, and takes a six-op one."""
    backend = stand_in(StandInGraphs())
    g = Graph("random_then_chain")
    x = g.input(TensorMeta.make((4, 4)), "x")
    r = g.call(aten.rand_like.default, (x,), name="r")
    y = g.call(aten.mul.Tensor, (x, r))
    g.set_outputs([g.call(aten.neg.default, (y,))])
    ex = Executor(make_plan(by_hand(g, {}), cost), cuda_graphs=capture_rule(True))
    assert [s.label for s in ex.segments] == ["segment random_then_chain/cpu:0#0 (4 steps)"]
    assert "rand_like" not in ex.segments[0].program.source
    g2 = Graph("short")
    x2 = g2.input(TensorMeta.make((4, 4)), "x")
    g2.set_outputs([g2.call(aten.relu.default, (g2.call(aten.neg.default, (x2,)),))])
    short = Executor(make_plan(by_hand(g2, {}), cost), cuda_graphs=capture_rule("auto"))
    assert short.segments == []  # 2 launches < 2 * (1 + 1 copy + 1 clone)
    for _ in range(3):
        ex([torch.randn(4, 4)])
        short([torch.randn(4, 4)])
    assert backend.captures == 1  # the mul and neg after rand_like
    g3 = split_chain()
    six = Executor(make_plan(by_hand(g3, {}), cost), cuda_graphs=capture_rule("auto"))
    assert len(six.segments) == 1  # 6 launches >= 2 * 3


def test_cuda_graphs_false_and_tracing_leave_programs_alone(cost, stand_in):
    stand_in(StandInGraphs())
    plan = make_plan(by_hand(split_chain(), {"d": "cpu:1"}), cost)
    plain = Executor(plan).source()
    assert Executor(plan, cuda_graphs=capture_rule(False)).source() == plain
    assert Executor(plan, cuda_graphs=capture_rule(True), trace=True).segments == []


ALIASING = ["returns_views_of_input", "returns_views_of_intermediate", "returns_same_tensor_twice",
            "mutate_then_use", "cat_stack_split", "topk_sort"]


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("name", [c.name for c in CASES if RUN_SLOW or c.name in ALIASING])
def test_corpus_with_every_segment_replayed(name, stand_in):
    """Every segment with an op becomes a graph (stand-in on the host): results, aliasing and
    mutations stay eager's (the whole corpus under AUTOPAR_SLOW=1)."""
    c = case(name)
    if "slow" in c.tags and not RUN_SLOW:
        pytest.skip("slow case")
    stand_in(StandInGraphs())
    run_case(c, autopar_compile(devices="cpu:0", cuda_graphs=True, fuse=False))


def _static(t: torch.Tensor) -> torch.Tensor:
    t._dynamo_static_input_type = "unguarded"  # as dynamo marks a module's parameters
    return t


def test_a_graphed_call_reads_parameters_in_place_and_copies_the_rest():
    """The cudagraphs way's form of a whole compiled function: warm-up, capture, replays;
    a parameter (marked static by dynamo) is read where it lives, so an in-place update shows
    in the next replay; the batch is copied into a static buffer (the caller's tensor is never
    written); each result is cloned out, so one the caller holds survives later replays."""
    from autopar.runtime.cudagraphs import GraphedCall

    def fn(w, x):
        return [w * x + 1.0, x.sum()]

    backend = StandInGraphs()
    g = GraphedCall(fn, "cpu", "fn", backend=backend)
    w = _static(torch.randn(4))
    x1, x2 = torch.randn(4), torch.randn(4)
    keep1 = x1.clone()
    for x in (x1, x2):  # warm-up, then capture and the first replay
        torch.testing.assert_close(g(w, x), fn(w, x))
    assert g.status == "captured" and backend.captures == 1
    held = g(w, x1)
    torch.testing.assert_close(g(w, x2), fn(w, x2))
    torch.testing.assert_close(held, fn(w, x1))  # not overwritten by the later replay
    assert torch.equal(x1, keep1)  # the caller's input is read, never written
    with torch.no_grad():
        w.mul_(2.0)
    torch.testing.assert_close(g(w, x1), fn(w, x1))  # the parameter read in place
    assert g.status == "captured" and g._copied == [1]


@pytest.mark.parametrize("change", ["parameter replaced", "other layout", "capture fails",
                                    "replay differs", "other number"])
def test_a_graphed_call_that_can_not_replay_runs_plain_for_good(change, caplog):
    """"other number": a graph of dynamic shapes takes sizes as ints (dynamo's SymInts), and
    one may change while every tensor keeps its layout (``x[:, :n]`` of a buffer): a replay
    would compute with the number it was captured with."""
    from autopar.runtime.cudagraphs import GraphedCall

    def fn(w, x, n=4):
        return [w[:, :n] * x[:, :n]]

    backend = StandInGraphs(fail="no capture here" if change == "capture fails" else None,
                            skew=1.0 if change == "replay differs" else 0.0)
    g = GraphedCall(fn, "cpu", "fn", backend=backend)
    w, x, n = _static(torch.randn(4, 4)), torch.randn(4, 4), 4
    with caplog.at_level(logging.WARNING, logger="autopar"):
        g(w, x, n)
        g(w, x, n)
        if change == "parameter replaced":
            w = _static(torch.randn(4, 4))
        elif change == "other layout":
            x = torch.randn(4, 4).t()
        elif change == "other number":
            n = 3
        torch.testing.assert_close(g(w, x, n), fn(w, x, n))
        torch.testing.assert_close(g(w, x, n), fn(w, x, n))
    assert g.status == "plain" and g.reason
    assert len([r for r in caplog.records if "without its CUDA graph" in r.getMessage()]) == 1


def test_a_graphed_call_takes_turns_across_threads_and_orders_streams():
    """One set of static buffers: two threads replaying at once each get their own input's
    result (a slow replay widens the window a race would need), and a call on another stream
    than the last one's first waits for that stream."""
    import threading
    import time

    from autopar.runtime.cudagraphs import GraphedCall

    def fn(w, x):
        time.sleep(0.0005)  # the replay reads the static input late
        return [w * x]

    backend = StandInGraphs()
    g = GraphedCall(fn, "cpu", "fn", backend=backend)
    w = _static(torch.ones(4))
    g(w, torch.zeros(4))
    g(w, torch.zeros(4))  # captured
    bad: list[float] = []

    def worker(k: float) -> None:
        for _ in range(40):
            x = torch.full((4,), k)
            got = g(w, x)[0]
            if not torch.equal(got, x):
                bad.append(k)

    threads = [threading.Thread(target=worker, args=(float(k),)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and backend.orders == []
    backend.current = "stream 1"
    g(w, torch.ones(4))
    assert backend.orders == [("stream 1", "stream 0")]


def test_a_replayed_segment_is_predicted_at_its_device_time_and_one_replay():
    """GraphedCost (data parallelism's predictions): a launch-bound chain of eight small ops
    on an H200 becomes one segment; its first op carries the replay and a launch per input
    copied and output cloned, the others only their device time, so the issuing thread's time
    and the makespan both fall. An input read in place costs no copy."""
    from autopar.passes.cudagraphs import REPLAY_S, GraphedCost, graphed_segments
    from autopar.schedule.simulate import issue_s, simulate

    h200 = CostModel(preset("h200x2"))
    g = Graph("small_ops")
    x = g.input(TensorMeta.make((64, 64)), "x")
    v = x
    for k, op in enumerate([aten.neg.default, aten.relu.default, aten.sin.default,
                            aten.cos.default] * 2):
        v = g.call(op, (v,), name=f"op{k}")
    g.set_outputs([v])
    plan = make_plan(by_hand(g, {n.name: "cuda:0" for n in g.nodes}), h200)
    launch = h200.machine.profile.device("cuda:0").launch("copy")
    segs = graphed_segments(plan, ["cuda:0"], capture_rule("auto"))
    (ops, copies, clones), = segs["cuda:0"]
    assert [n.name for n in ops] == [f"op{k}" for k in range(8)] and (copies, clones) == (1, 1)
    graphed = GraphedCost(h200, segs)
    assert graphed.host_s(ops[0], "cuda:0") == pytest.approx(REPLAY_S + 2 * launch)
    assert all(graphed.host_s(n, "cuda:0") == 0.0 for n in ops[1:])
    assert graphed.node_time(ops[3], "cuda:0") == h200.op_cost(ops[3], "cuda:0").device_s
    # x comes from the host and op7 goes back: two copies (a launch and an event record
    # and wait each, 7.4 + 10 us) and cuda:0's wait for x (5 us), graphs or not
    copies = 2 * (7.4e-6 + 10e-6) + 5e-6
    assert issue_s(plan, graphed) == pytest.approx(REPLAY_S + 2 * launch + copies)
    assert issue_s(plan, h200) == pytest.approx(8 * h200.host_s(ops[0], "cuda:0") + copies)
    def busy(cost) -> float:  # the GPU's lane: 8 x 7.4 us of launches, or the replay and
        return sum(s.end - s.start for s in simulate(plan, cost).spans  # device times
                   if s.lane == "cuda:0/compute")
    device = [h200.op_cost(n, "cuda:0").device_s for n in ops]
    assert busy(h200) == pytest.approx(8 * h200.host_s(ops[0], "cuda:0"))  # launch-bound
    assert busy(graphed) == pytest.approx(max(REPLAY_S + 2 * launch, device[0]) + sum(device[1:]))
    assert busy(graphed) < busy(h200)
    read = graphed_segments(plan, ["cuda:0"], capture_rule("auto"), in_place=frozenset({x}))
    assert [c for _, c, _ in read["cuda:0"]] == [0]


def test_an_expanded_input_is_copied_into_a_dense_buffer_and_replays(cost, stand_in):
    """An input that is an expanded view (stride 0, as HF's token-type ids) is cloned dense
    for the capture; later calls with the same expanded layout copy into that buffer and
    replay (compared with the layout the input had when captured, not with the buffer's)."""
    stand_in(StandInGraphs())
    g = split_chain()
    ex = Executor(make_plan(by_hand(g, {}), cost), cuda_graphs=capture_rule(True))
    for k in range(4):
        x = torch.randn(1, 8, generator=torch.Generator().manual_seed(k)).expand(4, 8)
        torch.testing.assert_close(ex([x]), SequentialRunner(g)([x]), rtol=0, atol=0)
    assert [s.status for s in ex.segments] == ["captured"]
