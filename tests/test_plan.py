"""Exact per-device programs for small named graphs."""

from __future__ import annotations

import pytest
import torch

from _fakes import (
    MM,
    FakeCost,
    by_name,
    chains_cost,
    check_plan,
    machine,
    op,
    scalar_times_matrix,
    tensor,
    two_chains,
    w5,
)
from autopar.ir.graph import Graph
from autopar.schedule.place import Placement, place
from autopar.schedule.plan import make_plan
from autopar.schedule.steps import Free, Record, Run, Send, Wait

ms, us = 1e-3, 1e-6


def test_two_chains_plan():
    """cuda:0 copies y to cuda:1 up front; cuda:1 sends b2 home when done.

        x@cuda:0   y@cuda:0
          a1         b1 @cuda:1
          a2         b2 @cuda:1 -> back to cuda:0
    """
    g = two_chains()
    n = by_name(g)
    plan = make_plan(place(g, chains_cost()))
    assert plan.programs == {
        "cuda:0": [Send(n["y"], "cuda:0", "cuda:1", "peer", 0), Run(n["a1"]), Run(n["a2"]),
                   Free(n["a1"], "cuda:0")],
        "cuda:1": [Wait(0, n["y"], "cuda:0"), Run(n["b1"]), Free(n["y"], "cuda:1"), Run(n["b2"]),
                   Free(n["b1"], "cuda:1"), Send(n["b2"], "cuda:1", "cuda:0", "peer", 1),
                   Free(n["b2"], "cuda:1")],
    }
    assert plan.outputs == ((n["a2"], "cuda:0"), (n["b2"], "cuda:0"))
    assert plan.n_events == 2
    assert [s.lane for s in plan.copies()] == ["cuda:0/peer", "cuda:1/peer"]
    check_plan(plan)


def test_plan_prints_one_section_per_device():
    plan = make_plan(place(two_chains(), chains_cost()))
    assert str(plan) == "\n".join([
        "plan two_chains: heft, 2 programs, 2 copies, 2 events, predicted 0.022 s",
        "cuda:0:",
        "    0  send   %y -> cuda:1 on cuda:0/peer  (e0)",
        "    1  run    %a1 = aten.mm(%x, %x)",
        "    2  run    %a2 = aten.mm(%a1, %a1)",
        "    3  free   %a1",
        "cuda:1:",
        "    0  wait   e0: %y from cuda:0",
        "    1  run    %b1 = aten.mm(%y, %y)",
        "    2  free   %y",
        "    3  run    %b2 = aten.mm(%b1, %b1)",
        "    4  free   %b1",
        "    5  send   %b2 -> cuda:0 on cuda:1/peer  (e1)",
        "    6  free   %b2",
        "outputs: %a2 @ cuda:0, %b2 @ cuda:0",
    ])


def test_compute_then_copy_to_host_issues_each_send_right_after_its_matmul():
    """W5 with 3 matmuls of 1 ms whose copies take 5 ms: the d2h lane is the bottleneck, yet
    each Send is issued right after its producer (not after the next matmul).

        x@cuda:0 -> y0 -> z0 = y0.cpu()      cuda:0:     y0 [0,1] y1 [1,2] y2 [2,3]
                 -> y1 -> z1 = y1.cpu()      cuda:0/d2h: y0 [1,6] y1 [6,11] y2 [11,16]
                 -> y2 -> z2 = y2.cpu()      cpu:0: each z is its copy (0 s)
    """
    g = w5(3, side=1000)
    n = by_name(g)
    cost = FakeCost(machine(cpus=1, gpus=1), {(f"y{i}", "cuda"): 1 * ms for i in range(3)},
                    default=1.0, bandwidth=4e9 / 5e-3 / 1e3)
    p = place(g, cost)
    assert p.predicted_s == pytest.approx(16 * ms)
    plan = make_plan(p)
    y, z = [n[f"y{i}"] for i in range(3)], [n[f"z{i}"] for i in range(3)]
    assert plan.programs["cuda:0"] == [
        Run(y[0]), Send(y[0], "cuda:0", "cpu:0", "d2h", 0), Free(y[0], "cuda:0"),
        Run(y[1]), Send(y[1], "cuda:0", "cpu:0", "d2h", 1), Free(y[1], "cuda:0"),
        Run(y[2]), Send(y[2], "cuda:0", "cpu:0", "d2h", 2), Free(y[2], "cuda:0"),
    ]
    assert plan.programs["cpu:0"] == [
        Wait(0, y[0], "cuda:0"), Run(z[0]), Free(y[0], "cpu:0"),
        Wait(1, y[1], "cuda:0"), Run(z[1]), Free(y[1], "cpu:0"),
        Wait(2, y[2], "cuda:0"), Run(z[2]), Free(y[2], "cpu:0"),
    ]
    check_plan(plan)


def test_cpu_workers_share_memory_and_order_by_events():
    """b runs on the second CPU worker; a's consumer c waits for b's Record, no copy.

        x@cpu -> a (cpu:0) \\
              -> b (cpu:1)  -> c (cpu:0) -> output
    """
    g = Graph("workers")
    x = g.input(tensor((1000,), "cpu"), name="x")
    a, b = op(g, "a", [x], 4000), op(g, "b", [x], 4000)
    c = op(g, "c", [a, b], 4000)
    g.set_outputs([c])
    cost = FakeCost(machine(cpus=2, gpus=0), only={"b": ["cpu:1"]}, default=1 * ms)
    plan = make_plan(place(g, cost))
    assert plan.programs == {
        "cpu:0": [Run(a), Wait(0, b, "cpu:1"), Run(c), Free(a, "cpu:0")],
        "cpu:1": [Run(b), Record(b, 0)],
    }
    assert plan.copies() == []
    check_plan(plan)


def test_host_scalar_feeds_a_gpu_kernel_without_a_copy():
    """s is 0-dim on the host; the GPU's mul takes it as a scalar: Record/Wait, no Send, and s
    is kept (the kernel reads it at launch).

        s = scalar_tensor(2.0) @cpu:0  ->  out = A * s @cuda:0
    """
    g, cost = scalar_times_matrix()
    s, out = by_name(g)["s"], by_name(g)["out"]
    plan = make_plan(place(g, cost))
    assert plan.programs == {"cpu:0": [Run(s), Record(s, 0)],
                             "cuda:0": [Wait(0, s, "cpu:0"), Run(out)]}
    check_plan(plan)


def test_one_copy_per_value_and_pool():
    """Two consumers of x on cuda:1 share one copy and one Wait; r follows its 400 kB inputs.

        x@cuda:0 -> p, q (only cuda:1) -> r -> output (4 kB, back to cuda:0)
    """
    g = Graph("dedup")
    x = g.input(tensor((1000,), "cuda:0"), name="x")
    p_, q = op(g, "p", [x], 400_000), op(g, "q", [x], 400_000)
    r = op(g, "r", [p_, q], 4000)
    g.set_outputs([r])
    cost = FakeCost(machine(cpus=1, gpus=2), only={"p": ["cuda:1"], "q": ["cuda:1"]},
                    default=1 * ms)
    plan = make_plan(place(g, cost, devices=["cuda:0", "cuda:1"]))
    assert [(s.value, s.dst) for s in plan.copies()] == [(x, "cuda:1"), (r, "cuda:0")]
    assert [s for s in plan.programs["cuda:1"] if isinstance(s, Wait)] == [Wait(0, x, "cuda:0")]
    check_plan(plan)


def hand_placement() -> tuple[Placement, dict]:
    g = two_chains()
    n = by_name(g)
    device = {v: "cuda:0" for v in g.nodes} | {n["b1"]: "cuda:1", n["b2"]: "cuda:1"}
    order = {"cuda:0": [n["a1"], n["a2"]], "cuda:1": [n["b1"], n["b2"]]}
    return Placement(g, device, order, "hand", {}, 0.0), n


def test_hand_made_placement_without_times_sends_after_producers():
    p, n = hand_placement()
    plan = make_plan(p)
    assert plan.programs["cuda:0"] == [Send(n["y"], "cuda:0", "cuda:1", "peer", 0),
                                       Run(n["a1"]), Run(n["a2"]), Free(n["a1"], "cuda:0")]
    assert plan.programs["cuda:1"][-2:] == [Send(n["b2"], "cuda:1", "cuda:0", "peer", 1),
                                            Free(n["b2"], "cuda:1")]
    check_plan(plan)
    timed = make_plan(p, chains_cost())
    assert timed.placement.predicted_s == pytest.approx(22 * ms)
    assert timed.programs == plan.programs


def test_slots_that_contradict_the_order_are_refused():
    placed = place(two_chains(), chains_cost())
    n = by_name(placed.graph)
    swapped = dict(placed.order) | {"cuda:0": [n["a2"], n["a1"]]}
    bad = Placement(placed.graph, placed.device, swapped, "heft", placed.notes,
                    placed.predicted_s, placed.slots)
    with pytest.raises(ValueError, match="the order of cuda:0 disagrees with its planned times"):
        make_plan(bad)
    no_copy = {k: v for k, v in placed.slots.items() if k != (n["y"], "cuda:1")}
    bad = Placement(placed.graph, placed.device, placed.order, "heft", placed.notes,
                    placed.predicted_s, no_copy)
    with pytest.raises(ValueError, match="plans no copy of %y into cuda:1, which cuda:1 needs"):
        make_plan(bad)


def test_graph_inputs_and_outputs_are_never_freed():
    """An input returned as is, and an output that is also read later."""
    g = Graph("keep")
    x = g.input(tensor((10,), "cuda:0"), name="x")
    a = g.call(MM, (g.call(torch.ops.aten.view.default, (x, [2, 5]), name="v"),
                    g.call(torch.ops.aten.view.default, (x, [5, 2]), name="w")), name="a")
    b = op(g, "b", [a], 16)
    g.set_outputs([x, a, b, 3])
    plan = make_plan(place(g, FakeCost(machine(cpus=1, gpus=1), default=1 * us)))
    frees = [s.value.name for _, s in plan.steps() if isinstance(s, Free)]
    assert "x" not in frees and "a" not in frees and "b" not in frees
    assert plan.outputs[3] == (3, None)
    check_plan(plan)


def test_random_ops_draw_in_eager_order_even_on_two_workers():
    """Both CPU workers share the host's generator: r2 waits for r1 though it does not read it.

        x@cpu -> r1 = rand_like(x) (cpu:1) -> a (cpu:1)
              -> r2 = rand_like(x) (cpu:0)
    """
    g = Graph("draws")
    x = g.input(tensor((1000,), "cpu"), name="x")
    r1 = g.call(torch.ops.aten.rand_like.default, (x,), name="r1")
    r2 = g.call(torch.ops.aten.rand_like.default, (x,), name="r2")
    a = op(g, "a", [r1], 4000)
    g.set_outputs([a, r2])
    cost = FakeCost(machine(cpus=2, gpus=0), only={"r1": ["cpu:1"], "r2": ["cpu:0"]},
                    default=1 * ms)
    plan = make_plan(place(g, cost))
    assert plan.programs["cpu:1"][:2] == [Run(r1), Record(r1, 0)]
    assert plan.programs["cpu:0"][:2] == [Wait(0, r1, "cpu:1"), Run(r2)]
    check_plan(plan)
