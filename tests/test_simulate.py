"""The simulator replays plans exactly: spans on small named graphs, deadlocks, memory."""

from __future__ import annotations

import pytest

from _fakes import FakeCost, by_name, chains_cost, machine, op, tensor, two_chains, w5
from autopar.ir.graph import Graph
from autopar.schedule.place import place
from autopar.schedule.plan import make_plan
from autopar.schedule.simulate import issue_s, peak_memory, simulate
from autopar.schedule.steps import Plan, Record, Run, Send, Wait
from autopar.schedule.timeline import Span

ms = 1e-3
MB = 1_000_000


def test_two_chains_timeline():
    """Spans of the two-chains plan (see test_place), by start then end: op spans carry the
    node id, copies the bytes and endpoints."""
    g = two_chains()
    n = by_name(g)
    tl = simulate(make_plan(place(g, chains_cost())), chains_cost())
    got = [(s.lane, s.name, round(s.start / ms, 9), round(s.end / ms, 9), s.kind, s.node)
           for s in tl.spans]
    assert got == [
        ("cuda:0/peer", "copy %y", 0, 1, "copy", n["y"].id),
        ("cuda:0/compute", "aten.mm", 0, 10, "op", n["a1"].id),
        ("cuda:1/compute", "aten.mm", 1, 11, "op", n["b1"].id),
        ("cuda:0/compute", "aten.mm", 10, 20, "op", n["a2"].id),
        ("cuda:1/compute", "aten.mm", 11, 21, "op", n["b2"].id),
        ("cuda:1/peer", "copy %b2", 21, 22, "copy", n["b2"].id),
    ]
    copy = tl.on("cuda:0/peer")[0]
    assert (copy.bytes, copy.src, copy.dst) == (4 * MB, "cuda:0", "cuda:1")
    assert tl.lanes() == ["cuda:0/compute", "cuda:0/peer", "cuda:1/compute", "cuda:1/peer"]
    assert tl.source == "simulated" and tl.label == "two_chains (heft)"
    assert tl.makespan == pytest.approx(22 * ms)


@pytest.mark.parametrize("policy", ["heft", "single", "round_robin"])
def test_simulated_makespan_is_the_planned_one(policy):
    cost = chains_cost()
    p = place(two_chains(), cost, policy)
    assert simulate(make_plan(p), cost).makespan == pytest.approx(p.predicted_s, rel=1e-12)


def test_copies_on_one_lane_run_back_to_back_in_event_order():
    """W5, 3 matmuls of 1 ms, copies of 5 ms: the d2h lane is busy from 1 to 16 ms."""
    g = w5(3, side=1000)
    cost = FakeCost(machine(cpus=1, gpus=1), {(f"y{i}", "cuda"): 1 * ms for i in range(3)},
                    default=1.0, bandwidth=4e6 / 5e-3)
    tl = simulate(make_plan(place(g, cost)), cost)
    d2h = [(round(s.start / ms, 9), round(s.end / ms, 9)) for s in tl.on("cuda:0/d2h")]
    assert d2h == [(1, 6), (6, 11), (11, 16)]
    moves = [s for s in tl.on("cpu:0")]
    assert [(s.name, s.duration) for s in moves] == [("aten._to_copy", 0.0)] * 3


def test_a_plan_whose_programs_wait_on_each_other_deadlocks():
    """Hand-made: cuda:0 waits for cuda:1's copy before sending its own, and vice versa."""
    g = Graph("cycle")
    x = g.input(tensor((10,), "cuda:0"), name="x")
    y = g.input(tensor((10,), "cuda:1"), name="y")
    a = op(g, "a", [x, y], 40, device="cuda:0")
    b = op(g, "b", [y, x], 40, device="cuda:1")
    g.set_outputs([a, b])
    placement = place(g, FakeCost(machine(cpus=1, gpus=2)), "single")
    programs = {
        "cuda:0": [Wait(1, y, "cuda:1"), Send(x, "cuda:0", "cuda:1", "peer", 0), Run(a)],
        "cuda:1": [Wait(0, x, "cuda:0"), Send(y, "cuda:1", "cuda:0", "peer", 1), Run(b)],
    }
    plan = Plan(g, placement, programs, ((a, "cuda:0"), (b, "cuda:1")), 2)
    with pytest.raises(RuntimeError, match=r"plan cycle deadlocks: cuda:0 at step 0 \(wait"):
        simulate(plan, FakeCost(machine(cpus=1, gpus=2)))


def test_a_send_before_its_value_exists_is_an_error():
    g = Graph("early")
    x = g.input(tensor((10,), "cpu"), name="x")
    a = op(g, "a", [x], 40)
    g.set_outputs([a])
    placement = place(g, FakeCost(machine(cpus=1, gpus=1)), "single")
    plan = Plan(g, placement, {"cpu:0": [Send(a, "cpu:0", "cuda:0", "h2d", 0), Run(a)]},
                ((a, "cpu:0"),), 1)
    with pytest.raises(RuntimeError, match="%a was not produced there before"):
        simulate(plan, FakeCost(machine(cpus=1, gpus=1)))


def test_cpu_workers_wait_for_records():
    """b on cpu:1 takes 3 ms; c on cpu:0 starts when b's Record fires, not when a ends."""
    g = Graph("workers")
    x = g.input(tensor((1000,), "cpu"), name="x")
    a, b = op(g, "a", [x], 4000), op(g, "b", [x], 4000)
    c = op(g, "c", [a, b], 4000)
    g.set_outputs([c])
    cost = FakeCost(machine(cpus=2, gpus=0), {("a", "cpu"): 1 * ms, ("b", "cpu"): 3 * ms},
                    only={"b": ["cpu:1"]}, default=1 * ms)
    plan = make_plan(place(g, cost))
    assert Record(b, 0) in plan.programs["cpu:1"]
    tl = simulate(plan, cost)
    assert [(s.lane, s.start / ms, s.end / ms) for s in tl.spans] == [
        ("cpu:0", 0, 1), ("cpu:1", 0, 3), ("cpu:0", 3, 4)]


def test_peak_memory_follows_allocations_and_last_uses():
    """cuda:0: x, y (8 MB) + a1 + a2 = 16 MB; later a1 is freed and b2 comes home: still 16.
    cuda:1: y's copy until b1 ends at 11 ms, b1 until b2 ends, b2 until delivered: 8 MB."""
    cost = chains_cost()
    plan = make_plan(place(two_chains(), cost))
    assert peak_memory(plan, simulate(plan, cost)) == {"cuda:0": 16 * MB, "cuda:1": 8 * MB}


def test_timeline_span_type_is_shared_with_the_runtime():
    cost = chains_cost()
    tl = simulate(make_plan(place(two_chains(), cost)), cost)
    assert all(isinstance(s, Span) for s in tl.spans)
    assert tl.busy("cuda:0/compute") == pytest.approx(20 * ms)


def test_one_thread_issues_every_gpus_work():
    """The two chains on two GPUs overlap on the lanes (makespan 22 ms, b2 copied back), but
    one thread launches both GPUs' ops: with 6 ms of host time a launch the call takes at
    least 24 ms (issue_s), and a cost model without a host split counts each op whole (40).
    Each of the plan's two copies costs the thread a launch and an event record and wait
    (10 + 10 us on this machine), and cuda:1's wait for y half of that: 45 us more."""
    g = two_chains()
    cost = chains_cost()
    plan = make_plan(place(g, cost), cost)
    assert round(simulate(plan, cost).makespan / ms, 6) == 22
    copies = 2 * (10e-6 + 10e-6) + 5e-6
    assert sum(isinstance(s, Send) for p in plan.programs.values() for s in p) == 2
    assert issue_s(plan, cost) == pytest.approx(40 * ms + copies)  # FakeCost: ops whole

    class Launches(FakeCost):
        def host_s(self, node, device):
            return 6e-3

    launching = Launches(cost.machine, cost.times, default=cost.default,
                         bandwidth=cost.bandwidth)
    assert issue_s(plan, launching) == pytest.approx(24 * ms + copies)
    # another CPU worker's program runs on a thread of its own: not counted
    host = Plan(g, plan.placement, {**plan.programs, "cpu:1": [Run(n) for n in g.ops]},
                plan.outputs, plan.n_events)
    assert issue_s(host, launching) == issue_s(plan, launching)
