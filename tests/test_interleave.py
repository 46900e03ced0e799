"""The host's program and the GPUs' interleaved onto one thread (autopar.runtime.interleave):
exact order on small plans, and on random plans (hypothesis) an order that keeps each
program's order, puts every Wait after its event and lets the other threads finish."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings

from _fakes import FakeCost, machine, tensor
from autopar.ir.graph import Graph
from autopar.runtime.executor import _planned_times
from autopar.runtime.interleave import interleave
from autopar.schedule.place import place
from autopar.schedule.plan import make_plan
from autopar.schedule.steps import Record, Run, Send, Wait
from test_place_properties import problems

aten = torch.ops.aten
us = 1e-6


def check_order(programs, host, gpus, merged) -> None:
    """Each program's order kept; every Wait after its event, by a simulation in which the
    programs left on their own threads advance as far as they can."""
    lanes = ([gpus] if isinstance(gpus, str) else list(gpus)) + ([host] if host else [])
    for lane in lanes:
        assert [s for d, s in merged if d == lane] == list(programs[lane])
    assert {d for d, _ in merged} <= set(lanes)
    issued: set[int] = set()
    pos = {d: 0 for d in programs if d not in lanes}

    def run_others() -> None:
        moved = True
        while moved:
            moved = False
            for d in pos:
                steps = programs[d]
                while pos[d] < len(steps) and (not isinstance(steps[pos[d]], Wait)
                                               or steps[pos[d]].event in issued):
                    if isinstance(steps[pos[d]], Send | Record):
                        issued.add(steps[pos[d]].event)
                    pos[d] += 1
                    moved = True

    for _, step in merged:
        run_others()
        if isinstance(step, Wait):
            assert step.event in issued, f"{step} before its event"
        if isinstance(step, Send | Record):
            issued.add(step.event)
    run_others()
    assert all(pos[d] == len(programs[d]) for d in pos), "another thread never finishes"


def w2_like() -> Graph:
    """x@cuda:0 -> a = relu(x) -> s = sum(a), t = s + 1 (only the host) -> b = mul(a, t); and
    c = relu(x), which HEFT gives the idle host."""
    g = Graph("w2_like")
    x = g.input(tensor((1000,), "cuda:0"), name="x")
    a = g.call(aten.relu.default, (x,), name="a")
    s = g.call(aten.sum.default, (a,), name="s")
    t = g.call(aten.add.Tensor, (s, 1.0), name="t")
    b = g.call(aten.mul.Tensor, (a, t), name="b")
    c = g.call(aten.relu.default, (x,), name="c")
    g.set_outputs([b, c])
    return g


def test_gpu_steps_go_first_and_the_host_fills_in():
    g = w2_like()
    cost = FakeCost(machine(cpus=1, gpus=1), times={("s", "cpu:0"): 1 * us, ("t", "cpu:0"): 1 * us},
                    default=100 * us, bandwidth=1e12, only={"s": ["cpu:0"], "t": ["cpu:0"]})
    plan = make_plan(place(g, cost))
    programs = {d: list(steps) for d, steps in plan.programs.items() if steps}
    merged = interleave(programs, "cpu:0", "cuda:0")
    assert merged is not None
    check_order(programs, "cpu:0", "cuda:0", merged)
    # the GPU issues all it can (x and a to the host, a) before the host's first wait; the
    # host then runs its whole program (c, s, t) and the GPU ends with b, which waits for t
    cuda, cpu = programs["cuda:0"], programs["cpu:0"]
    assert merged == ([("cuda:0", s) for s in cuda[:3]] + [("cpu:0", s) for s in cpu]
                      + [("cuda:0", s) for s in cuda[3:]])
    assert isinstance(cuda[3], Wait) and cuda[3].src == "cpu:0"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_random_plans_interleave_into_a_valid_order(problem):
    g, cost, limits = problem
    plan = make_plan(place(g, cost, "heft", memory=limits))
    programs = {d: list(steps) for d, steps in plan.programs.items() if steps}
    host = min((d for d in programs if d.startswith("cpu")), default=None)
    gpus = sorted(d for d in programs if not d.startswith("cpu"))
    if not gpus:
        return
    for lanes in ([gpus[0]], gpus):  # the host with one GPU, with every GPU
        for times in (None, _planned_times(plan.placement.slots)):
            merged = interleave(programs, host, lanes, times)
            assert merged is not None
            check_order(programs, host, lanes, merged)


def feeds_another_gpu(host_op_s: float) -> tuple:
    """h@cpu -> s = h * 2 (host only) -> u = relu(s) (cuda:1 only); x@cuda:0 -> a = relu(x)
    (cuda:0) -> c = neg(a) (host only); d = neg(x) (cuda:0). cuda:1 waits for the host's s."""
    g = Graph("feeds")
    x = g.input(tensor((1000,), "cuda:0"), name="x")
    h = g.input(tensor((1000,), "cpu"), name="h")
    s = g.call(aten.mul.Tensor, (h, 2.0), name="s")
    u = g.call(aten.relu.default, (s,), name="u")
    a = g.call(aten.relu.default, (x,), name="a")
    c = g.call(aten.neg.default, (a,), name="c")
    d = g.call(aten.neg.default, (x,), name="d")
    g.set_outputs([u, c, d])
    cost = FakeCost(machine(cpus=1, gpus=2), times={("s", "cpu:0"): host_op_s,
                                                    ("c", "cpu:0"): 1 * us},
                    default=100 * us, bandwidth=1e12,
                    only={"s": ["cpu:0"], "c": ["cpu:0"], "u": ["cuda:1"], "a": ["cuda:0"],
                          "d": ["cuda:0"]})
    plan = make_plan(place(g, cost))
    programs = {d: list(steps) for d, steps in plan.programs.items() if steps}
    return plan, programs


def first_index(merged, device, name) -> int:
    return next(i for i, (d, s) in enumerate(merged)
                if d == device and isinstance(s, Run) and s.node.name == name)


def test_a_short_host_op_another_gpu_waits_for_goes_before_the_gpu_launches():
    plan, programs = feeds_another_gpu(1 * us)
    times = _planned_times(plan.placement.slots)
    merged = interleave(programs, "cpu:0", "cuda:0", times)
    check_order(programs, "cpu:0", "cuda:0", merged)
    assert first_index(merged, "cpu:0", "s") < first_index(merged, "cuda:0", "a")
    # without the plan's times, GPU steps first
    plain = interleave(programs, "cpu:0", "cuda:0")
    assert first_index(plain, "cuda:0", "a") < first_index(plain, "cpu:0", "s")


def test_a_long_host_op_waits_for_the_gpu_launches():
    plan, programs = feeds_another_gpu(1e-3)
    merged = interleave(programs, "cpu:0", "cuda:0", _planned_times(plan.placement.slots))
    check_order(programs, "cpu:0", "cuda:0", merged)
    assert first_index(merged, "cuda:0", "a") < first_index(merged, "cpu:0", "s")


def host_reads_a_gpu_value_for_another_gpu() -> tuple:
    """x@cuda:0 -> s = neg(x) on the host (a copy to the host first) -> u = relu(s) on cuda:1;
    on cuda:0, a = relu(x) then b = relu(a), long: the host's copy of x lands before b starts."""
    g = Graph("labels_like")
    x = g.input(tensor((1000,), "cuda:0"), name="x")
    s = g.call(aten.neg.default, (x,), name="s")
    u = g.call(aten.relu.default, (s,), name="u")
    a = g.call(aten.relu.default, (x,), name="a")
    b = g.call(aten.relu.default, (a,), name="b")
    g.set_outputs([u, b])
    cost = FakeCost(machine(cpus=1, gpus=2), times={("s", "cpu:0"): 1 * us, ("a", "cuda:0"): 1e-3,
                                                    ("b", "cuda:0"): 1e-3},
                    default=10 * us, bandwidth=1e12,
                    only={"s": ["cpu:0"], "u": ["cuda:1"], "a": ["cuda:0"], "b": ["cuda:0"]})
    plan = make_plan(place(g, cost))
    programs = {d: list(steps) for d, steps in plan.programs.items() if steps}
    return plan, programs


def test_a_host_wait_for_a_copy_that_lands_early_goes_before_later_gpu_launches():
    plan, programs = host_reads_a_gpu_value_for_another_gpu()
    merged = interleave(programs, "cpu:0", "cuda:0", _planned_times(plan.placement.slots))
    check_order(programs, "cpu:0", "cuda:0", merged)
    # the host waits for x, computes s and sends it to cuda:1 before cuda:0 launches b
    assert first_index(merged, "cpu:0", "s") < first_index(merged, "cuda:0", "b")
    plain = interleave(programs, "cpu:0", "cuda:0")  # without times: every launch first
    assert first_index(plain, "cuda:0", "b") < first_index(plain, "cpu:0", "s")


def test_every_gpu_gets_its_steps_in_the_order_the_plan_starts_them():
    """Two GPUs on one thread: cuda:1's first op waits for a copy of x; cuda:0's long op a1
    starts at once. The copy and a1 go first, then cuda:1's op (planned to start when the copy
    lands, long before a1 ends), then cuda:0's a2; every launch in planned-start order."""
    g = Graph("two_gpus")
    x = g.input(tensor((1000,), "cuda:0"), name="x")
    a1 = g.call(aten.relu.default, (x,), name="a1")
    a2 = g.call(aten.neg.default, (a1,), name="a2")
    b1 = g.call(aten.relu.default, (x,), name="b1")
    g.set_outputs([a2, b1])
    cost = FakeCost(machine(cpus=1, gpus=2), times={("a1", "cuda:0"): 1e-3, ("b1", "cuda:1"): 1e-3},
                    default=10 * us, bandwidth=1e12,
                    only={"a1": ["cuda:0"], "a2": ["cuda:0"], "b1": ["cuda:1"]})
    plan = make_plan(place(g, cost))
    programs = {d: list(steps) for d, steps in plan.programs.items() if steps}
    merged = interleave(programs, None, ["cuda:0", "cuda:1"],
                        _planned_times(plan.placement.slots))
    check_order(programs, None, ["cuda:0", "cuda:1"], merged)
    runs = [s.node.name for _, s in merged if isinstance(s, Run)]
    assert runs == ["a1", "b1", "a2"]
    send = next(i for i, (_, s) in enumerate(merged) if isinstance(s, Send))
    assert send < first_index(merged, "cuda:1", "b1")


def test_a_merged_program_without_events_keeps_every_lanes_steps():
    """The host's and cuda:0's programs exchange nothing (no events): the call runs as one
    straight function, which must hold both programs' steps (the corpus's
    ``factory_default_device`` once lost its host outputs this way)."""
    from autopar.runtime.executor import Executor

    g = Graph("no_crossing")
    x = g.input(tensor((1000,), "cuda:0"), name="x")
    s = g.call(aten.relu.default, (x,), name="s")
    h = g.call(aten.arange.default, (5,), {"device": torch.device("cpu")}, name="h")
    g.set_outputs([s, h])
    cost = FakeCost(machine(cpus=1, gpus=1), default=10 * us, bandwidth=1e12,
                    only={"s": ["cuda:0"], "h": ["cpu:0"]})
    plan = make_plan(place(g, cost))
    assert plan.n_events == 0 and set(plan.programs) == {"cpu:0", "cuda:0"}
    ex = Executor(plan)
    assert ex.solo is not None and ex.merged == ("cuda:0", "cpu:0")
    source = ex.programs[ex.solo].source
    assert "aten.relu" in source and "aten.arange" in source
    xs = torch.randn(1000)  # the generated code is device-agnostic: a host tensor stands in
    got = ex.programs[ex.solo].fn([xs])
    assert torch.equal(got[0], xs.relu()) and torch.equal(got[1], torch.arange(5))
