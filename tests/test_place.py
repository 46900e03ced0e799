"""Exact placements on small named graphs (times from a table: see tests/_fakes.py)."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from _fakes import (
    MM,
    RELU,
    FakeCost,
    by_name,
    chains_cost,
    devices_of,
    machine,
    op,
    order_of,
    scalar_times_matrix,
    tensor,
    two_chains,
    w4,
    w5,
)
from autopar.cost.model import CostModel, History
from autopar.ir.graph import Graph
from autopar.ir.routing import GraphIndex, copy_time, gc_paused
from autopar.machine.presets import preset
from autopar.schedule.place import (
    POLICIES,
    Placement,
    Slot,
    lower_bound,
    merged_order,
    place,
    retime,
)
from autopar.schedule.plan import make_plan
from autopar.schedule.simulate import simulate

ms, us = 1e-3, 1e-6
MB = 1_000_000


def test_two_independent_chains_go_one_per_gpu():
    """Two chains written for one GPU; the second moves to cuda:1 and comes back at the end.

        x@cuda:0   y@cuda:0            cuda:0: a1 [0,10] a2 [10,20]
          |          |                 cuda:0/peer: y -> cuda:1 [0,1]
          a1         b1                cuda:1: b1 [1,11] b2 [11,21]
          |          |                 cuda:1/peer: b2 -> cuda:0 [21,22]
          a2         b2
           \\        /
           outputs (eager: cuda:0)     single: 40 ms, heft: 22 ms
    """
    g = two_chains()
    p = place(g, chains_cost())
    assert devices_of(p) == {"a1": "cuda:0", "a2": "cuda:0", "b1": "cuda:1", "b2": "cuda:1"}
    assert order_of(p) == {"cuda:0": ["a1", "a2"], "cuda:1": ["b1", "b2"]}
    assert p.predicted_s == pytest.approx(22 * ms)
    n = by_name(g)
    assert [(v.name, d) for v, d in p.copies()] == [("y", "cuda:1"), ("b2", "cuda:0")]
    assert p.slots[(n["b2"], "cuda:0")].start == pytest.approx(21 * ms)
    assert p.notes[n["b1"]] == "fastest finish: cuda:1 11 ms vs cuda:0 20 ms"
    assert p.notes[n["x"]] == "input stays on cuda:0"
    assert place(g, chains_cost(), "single").predicted_s == pytest.approx(40 * ms)


def matmul_on_host(side: int) -> Graph:
    g = Graph(f"mm{side}")
    x = g.input(tensor((side, side), "cpu"), name="x")
    y = g.input(tensor((side, side), "cpu"), name="y")
    g.set_outputs([g.call(MM, (x, y), name="mm")])
    return g


def measured_mm_cost(m) -> FakeCost:
    """MEASURED.md: 5x10x5 takes 1.9 us on the host and 16 us on a GPU; 2048^3 takes 8.2 ms and
    0.35 ms. Copies: 10 us + bytes at 10 GB/s."""
    def mm_time(node, device):
        big = node.tensor_metas[0].numel > 1000
        if device.startswith("cpu"):
            return 8.2 * ms if big else 1.9 * us
        return 0.35 * ms if big else 16 * us

    return FakeCost(m, default=mm_time, bandwidth=10e9, latency=10 * us)


def test_tiny_matmul_with_host_inputs_stays_on_host():
    """x, y on the host, result wanted on the host; the GPU would pay two copies in, one out.

        x@cpu  y@cpu
           \\   /
            mm        cpu:0 1.9 us  vs  cuda:0 10+16+10 us and more
    """
    g = matmul_on_host(5)
    p = place(g, measured_mm_cost(machine(cpus=1, gpus=1)))
    assert devices_of(p) == {"mm": "cpu:0"}
    assert p.predicted_s == pytest.approx(1.9 * us)
    assert p.copies() == []


def test_big_matmul_with_host_inputs_goes_to_gpu():
    """2048^3: the GPU wins even after copying 2 x 16.8 MB in and 16.8 MB back.

        x@cpu  y@cpu        cpu/h2d:    x [0, 1.69] y [1.69, 3.37] (ms)
           \\   /            cuda:0: mm [3.37, 3.72]
            mm              cuda:0/d2h: mm -> cpu:0 [3.72, 5.41]   vs 8.2 ms on the host
    """
    g = matmul_on_host(2048)
    p = place(g, measured_mm_cost(machine(cpus=1, gpus=1)))
    assert devices_of(p) == {"mm": "cuda:0"}
    copy = 10 * us + 2048 * 2048 * 4 / 10e9
    assert p.predicted_s == pytest.approx(3 * copy + 0.35 * ms)
    assert [(v.name, d) for v, d in p.copies()] == [("x", "cuda:0"), ("y", "cuda:0"),
                                                    ("mm", "cpu:0")]


TO_COPY = torch.ops.aten._to_copy.default


def matmul_via_gpu(side: int) -> Graph:
    """``(x.to("cuda") @ y.to("cuda")).cpu()``: W3's host case, written for the GPU."""
    g = Graph(f"via_gpu{side}")
    ins = [g.input(tensor((side, side), "cpu"), name=name) for name in "xy"]
    moved = [g.call(TO_COPY, (v,), {"device": torch.device("cuda:0")},
                    meta=tensor((side, side), "cuda:0"), name=f"{v.name}g") for v in ins]
    mm = g.call(MM, tuple(moved), name="mm")
    g.set_outputs([g.call(TO_COPY, (mm,), {"device": torch.device("cpu")},
                          meta=tensor((side, side), "cpu"), name="back")])
    return g


def test_tiny_matmul_written_for_the_gpu_runs_on_the_host():
    """The moves to the GPU are ops like others: left on the host, they hand x and y on, so
    the host runs the whole call in the mm's 1.9 us, with no copy (eager: 36 us and more).

        x@cpu -> xg = x.to("cuda") --\
                                      mm -> back = .cpu()   all on cpu:0, xg, yg, back free
        y@cpu -> yg = y.to("cuda") --/
    """
    g = matmul_via_gpu(5)
    n = by_name(g)
    assert GraphIndex.of(g).passthrough == {n["xg"], n["yg"], n["back"]}
    cost = measured_mm_cost(machine(cpus=1, gpus=1))
    p = place(g, cost)
    assert devices_of(p) == {"xg": "cpu:0", "yg": "cpu:0", "mm": "cpu:0", "back": "cpu:0"}
    assert p.copies() == []
    assert p.predicted_s == pytest.approx(1.9 * us)
    assert p.notes[n["xg"]].startswith("hands %x on, no copy; fastest finish: cpu:0")
    assert simulate(make_plan(p), cost).makespan == pytest.approx(p.predicted_s)
    eager = place(g, cost, "single")
    assert devices_of(eager) == {"xg": "cuda:0", "yg": "cuda:0", "mm": "cuda:0",
                                 "back": "cpu:0"}
    assert eager.predicted_s > 36 * us  # two copies in, the GPU's mm, one copy out


def test_big_matmul_written_for_the_gpu_stays_eagers_plan():
    """2048^3: the GPU wins; HEFT leaves the moves with their inputs and copies x and y in,
    which is eager's plan (``runs_as_eager``), so the call runs as eager's sequence."""
    from autopar.schedule.simulate import runs_as_eager

    g = matmul_via_gpu(2048)
    cost = measured_mm_cost(machine(cpus=1, gpus=1))
    p = place(g, cost)
    assert devices_of(p)["mm"] == "cuda:0" and devices_of(p)["back"] == "cpu:0"
    copy = 10 * us + 2048 * 2048 * 4 / 10e9
    assert p.predicted_s == pytest.approx(3 * copy + 0.35 * ms)
    assert len(p.copies()) == 3
    assert runs_as_eager(make_plan(p), cost, ["cpu:0", "cuda:0"])


def test_device_moves_hand_on_their_input_only_where_nothing_can_tell():
    """A move that hands on its input makes two values share a storage that eager kept apart:
    allowed only where no op writes in place and no output would newly share a storage."""
    def graph(tail: str) -> Graph:
        g = Graph(tail)
        x = g.input(tensor((4, 4), "cpu"), name="x")
        h = g.call(RELU, (x,), name="h")
        for name, src in (("xg", x), ("hg", h)):
            g.call(TO_COPY, (src,), {"device": torch.device("cuda:0")},
                   meta=tensor((4, 4), "cuda:0"), name=name)
        n = by_name(g)
        xg, hg = n["xg"], n["hg"]
        outs = [g.call(MM, (xg, hg), name="mm")]
        if tail == "view of a moved input":  # would alias the caller's x
            outs.append(g.call(torch.ops.aten.t.default, (xg,), name="xt"))
        elif tail == "two outputs":  # hg's output and h would become one storage
            outs += [g.call(torch.ops.aten.t.default, (hg,), name="ht"), h]
        elif tail == "in-place write":
            g.call(torch.ops.aten.relu_.default, (h,), name="w")
        g.set_outputs(outs)
        return g

    def handed(tail: str) -> set[str]:
        return {v.name for v in GraphIndex.of(graph(tail)).passthrough}

    assert handed("plain") == {"xg", "hg"}
    assert handed("view of a moved input") == {"hg"}
    assert handed("two outputs") == {"xg"}
    assert handed("in-place write") == set()


def test_small_op_between_big_ones_stays_on_their_gpu():
    """relu is 10x faster on the host, but moving its input there and back costs more.

        x@cuda:0 -> big1 (mm) -> small (relu) -> big2 (mm) -> out
                     10 ms       20 us | 2 us     10 ms
        1 MB each way: 0.11 ms, so the host would finish small at 10.1 ms, cuda:0 at 10.02 ms
        (1 MB, not more: a larger value eager keeps on the GPU never goes to the host, see
        test_the_host_never_pulls_a_big_gpu_value)
    """
    g = Graph("sandwich")
    x = g.input(tensor((500, 500), "cuda:0"), name="x")
    big1 = g.call(MM, (x, x), name="big1")
    small = g.call(RELU, (big1,), name="small")
    big2 = g.call(MM, (small, small), name="big2")
    g.set_outputs([big2])
    cost = FakeCost(machine(cpus=1, gpus=1), {
        ("big1", "cuda"): 10 * ms, ("big2", "cuda"): 10 * ms, ("big1", "cpu"): 1.0,
        ("big2", "cpu"): 1.0, ("small", "cuda"): 20 * us, ("small", "cpu"): 2 * us,
    }, bandwidth=10e9, latency=10 * us)
    p = place(g, cost)
    assert devices_of(p) == {"big1": "cuda:0", "small": "cuda:0", "big2": "cuda:0"}
    assert p.notes[by_name(g)["small"]] == "fastest finish: cuda:0 10 ms vs cpu:0 10.1 ms"
    assert p.predicted_s == pytest.approx(20.02 * ms)


@pytest.mark.parametrize("side", [1000, 500])
def test_the_host_never_pulls_a_big_gpu_value(side):
    """Two GPUs busy with long matmuls; ``t = tanh(a)`` of ``a`` on cuda:0 finishes soonest on
    the idle host by the timing model. At 4 MB it stays on a GPU anyway (the host's compute
    would hold the thread that launches GPU work); at 1 MB the host takes it. With one GPU
    left to choose, the note says why."""
    g = Graph("gravity")
    x = g.input(tensor((side, side), "cuda:0"), name="x")
    a = g.call(MM, (x, x), name="a")
    busy = [g.call(MM, (x, x), name=f"busy{i}") for i in range(4)]
    t = g.call(torch.ops.aten.tanh.default, (a,), name="t")
    g.set_outputs([t, *busy])
    cost = FakeCost(machine(cpus=1, gpus=2), {
        ("a", "cuda"): 1 * ms, ("t", "cuda"): 10 * ms, ("t", "cpu"): 50 * us,
        **{(f"busy{i}", "cuda"): 20 * ms for i in range(4)},
        **{(f"busy{i}", "cpu"): 10.0 for i in range(4)}, ("a", "cpu"): 10.0,
    }, bandwidth=1e12, latency=1 * us)
    p = place(g, cost)
    if side == 1000:
        assert devices_of(p)["t"].startswith("cuda")
        one = place(g, cost, devices=["cpu:0", "cuda:0"])
        assert one.device[t] == "cuda:0"
        assert one.notes[t] == "off the host: reads %a (4 MB) from cuda:0"
    else:
        assert devices_of(p)["t"] == "cpu:0"


def test_tiny_values_prefer_the_host_on_a_tie():
    """A 0-dim value made from nothing costs the same everywhere: it goes to the host, and the
    GPU kernel that reads it takes it as a scalar argument (no copy).

        s = scalar_tensor(2.0, device=cuda:0)     5 us on cpu:0 or cuda:0
        out = A * s                               A@cuda:0, 1 ms
    """
    g, cost = scalar_times_matrix()
    p = place(g, cost)
    assert devices_of(p) == {"s": "cpu:0", "out": "cuda:0"}
    assert p.copies() == []
    assert p.predicted_s == pytest.approx(1.005 * ms)


def test_views_follow_their_base_and_random_ops_stay_pinned():
    """b can only run on cuda:1; its view follows it; the random op stays where can_run says.

        x@cuda:0 -> b (only cuda:1) -> v = b.t() -> c = mm(v, v)
                 -> r = rand_like(x) (only cuda:0)
    """
    g = Graph("views")
    x = g.input(tensor((100, 100), "cuda:0"), name="x")
    b = g.call(MM, (x, x), name="b")
    v = g.call(torch.ops.aten.t.default, (b,), name="v")
    c = g.call(MM, (v, v), name="c")
    r = g.call(torch.ops.aten.rand_like.default, (x,), name="r")
    g.set_outputs([c, r])
    cost = FakeCost(machine(cpus=1, gpus=2), only={"b": ["cuda:1"], "r": ["cuda:0"]},
                    default=1 * ms, bandwidth=1e9)
    p = place(g, cost)
    n = by_name(g)
    assert p.device[n["v"]] == "cuda:1"
    assert p.notes[n["v"]] == "pinned: view of %b: stays with its base"
    assert p.notes[n["b"]] == "pinned: only cuda:1 can run it"
    assert p.device[n["r"]] == "cuda:0"
    assert p.notes[n["r"]] == "pinned: random op"


def delivery_graph(q_bytes: int) -> Graph:
    g = Graph("delivery")
    x = g.input(tensor((1000,), "cuda:0"), name="x")
    p = op(g, "p", [x], 100 * MB)
    q = op(g, "q", [x], q_bytes)
    g.set_outputs([op(g, "p2", [p], 4), q])
    return g


def test_output_delivery_cost_decides_the_device():
    """q's result (40 MB) must end on cuda:0: computing it on idle cuda:1 finishes at 5 ms but
    delivers at 45 ms, so it waits for p on cuda:0 instead.

        x@cuda:0 -> p (5 ms, only cuda:0) -> p2 (1 us, only cuda:0) -> output
                 -> q (5 ms) -> output (eager: cuda:0)
        q on cuda:0: [5, 10];  on cuda:1: copy x 4 us + 5 ms + deliver 40 ms
    """
    cost = FakeCost(machine(cpus=1, gpus=2), {("p", "cuda"): 5 * ms, ("q", "cuda"): 5 * ms,
                                              ("p2", "cuda"): 1 * us},
                    only={"p": ["cuda:0"], "p2": ["cuda:0"]}, bandwidth=1e9)
    p = place(delivery_graph(40 * MB), cost, devices=["cuda:0", "cuda:1"])
    assert order_of(p) == {"cuda:0": ["p", "q", "p2"]}
    assert p.predicted_s == pytest.approx(10 * ms + 1 * us)
    # a small result is worth computing on cuda:1 and bringing back
    p = place(delivery_graph(4000), cost, devices=["cuda:0", "cuda:1"])
    assert order_of(p) == {"cuda:0": ["p", "p2"], "cuda:1": ["q"]}
    assert p.predicted_s == pytest.approx(4 * us + 5 * ms + 4 * us)


def test_full_gpu_is_skipped():
    """cuda:0 holds x (4 MB) and has 10 MB: a's 8 MB result goes to cuda:1 instead.

        x@cuda:0 -> a (8 MB) -> b (4 B) -> output
    """
    g = Graph("full")
    x = g.input(tensor((1000, 1000), "cuda:0"), name="x")
    a = op(g, "a", [x], 8 * MB)
    g.set_outputs([op(g, "b", [a], 4)])
    cost = FakeCost(machine(cpus=1, gpus=2), {("a", "cuda"): 1 * ms, ("b", "cuda"): 1 * ms},
                    default=1.0, bandwidth=1e9)
    p = place(g, cost, memory={"cuda:0": 10 * MB})
    assert devices_of(p) == {"a": "cuda:1", "b": "cuda:1"}
    assert p.notes[a] == ("fastest finish: cuda:1 5 ms vs cuda:0 1 ms; "
                          "no room: cuda:0 would need 12 MB")
    assert place(g, cost).device[a] == "cuda:0"


def test_no_room_anywhere_falls_back_to_eager(caplog):
    """Nothing fits on any GPU: a warning, and the eager placement."""
    g = two_chains()
    with caplog.at_level(logging.WARNING, logger="autopar"):
        p = place(g, chains_cost(), memory={"cuda:0": 8 * MB, "cuda:1": 1, "cpu": 1})
    assert p.policy == "single"
    assert set(devices_of(p).values()) == {"cuda:0"}
    assert "no device has room for %a1" in caplog.text
    assert "falling back to the 'single' policy" in caplog.text


def test_eager_placement_is_kept_when_heft_predicts_worse():
    """Greedy HEFT moves b to idle cuda:1, then pays 15 ms to bring a or b together for c.

        x@cuda:0 -> a (10 ms, 15 MB) \\
                 -> b (10 ms, 15 MB)  -> c (1 us) -> output       single: 20 ms
    """
    g = Graph("fork_join")
    x = g.input(tensor((1000,), "cuda:0"), name="x")
    a = op(g, "a", [x], 15 * MB)
    b = op(g, "b", [x], 15 * MB)
    g.set_outputs([op(g, "c", [a, b], 4)])
    cost = FakeCost(machine(cpus=1, gpus=2), {("a", "cuda"): 10 * ms, ("b", "cuda"): 10 * ms,
                                              ("c", "cuda"): 1 * us}, default=1.0,
                    bandwidth=1e9)
    p = place(g, cost)
    assert p.policy == "heft"
    assert set(devices_of(p).values()) == {"cuda:0"}
    assert p.predicted_s == pytest.approx(20 * ms + 1 * us)
    assert p.notes[by_name(g)["c"]].startswith("eager placement kept: predicted 20 ms vs HEFT")


def test_single_and_round_robin_baselines():
    g = two_chains()
    cost = chains_cost()
    single = place(g, cost, "single")
    assert order_of(single) == {"cuda:0": ["a1", "a2", "b1", "b2"]}
    rr = place(g, cost, "round_robin")
    assert devices_of(rr) == {"a1": "cpu:0", "a2": "cuda:0", "b1": "cuda:1", "b2": "cpu:0"}
    rr2 = place(g, cost, "round_robin", devices=["cuda:0", "cuda:1"])
    assert devices_of(rr2) == {"a1": "cuda:0", "a2": "cuda:1", "b1": "cuda:0", "b2": "cuda:1"}
    assert POLICIES == ("heft", "single", "round_robin")


def test_devices_restrict_where_ops_go_but_inputs_stay():
    g = two_chains()
    p = place(g, chains_cost(), devices=["cpu:0"])
    assert set(devices_of(p).values()) == {"cpu:0"}
    assert p.device[by_name(g)["x"]] == "cuda:0"
    with pytest.raises(ValueError, match=r"device 'cuda:7' does not exist: machine \S+ has "
                                         r"cuda:0, cuda:1$"):
        place(g, chains_cost(), devices=["cuda:7"])


def test_unknown_policy_names_the_valid_ones():
    with pytest.raises(ValueError, match="valid policies: heft, single, round_robin"):
        place(two_chains(), chains_cost(), "fastest")


def test_an_op_no_device_can_run_is_an_error():
    g = two_chains()
    cost = FakeCost(machine(), only={"a1": []})
    with pytest.raises(ValueError, match=r"no device among .* can run %a1 \(aten.mm\)"):
        place(g, cost)


def test_placement_is_deterministic():
    g = two_chains()
    a, b = place(g, chains_cost()), place(g, chains_cost())
    assert a.device == b.device and a.order == b.order and a.slots == b.slots
    assert a.notes == b.notes


def test_placement_prints_device_and_reason_per_op():
    text = str(place(two_chains(), chains_cost()))
    assert text.splitlines()[0] == "placement two_chains (heft, predicted 22 ms)"
    assert "%b1 = aten.mm(%y, %y)" in text
    assert "@ cuda:1  (fastest finish: cuda:1 11 ms vs cuda:0 20 ms)" in text


def test_hand_made_placement_is_merged_and_retimed():
    """No slots: merged_order interleaves the devices' orders; retime plans the times."""
    g = two_chains()
    n = by_name(g)
    device = {v: "cuda:0" for v in g.nodes} | {n["b1"]: "cuda:1", n["b2"]: "cuda:1"}
    order = {"cuda:0": [n["a1"], n["a2"]], "cuda:1": [n["b1"], n["b2"]]}
    hand = Placement(g, device, order, "hand", {}, 0.0)
    assert [v.name for v in merged_order(hand)] == ["a1", "a2", "b1", "b2"]
    timed = retime(hand, chains_cost())
    assert timed.device == device
    assert timed.predicted_s == pytest.approx(22 * ms)
    assert timed.slots[n["b1"]] == Slot(1 * ms, 11 * ms, 4)  # after a1, a2, copy of y
    bad = Placement(g, device, {"cuda:0": [n["a2"], n["a1"]], "cuda:1": order["cuda:1"]},
                    "hand", {}, 0.0)
    with pytest.raises(ValueError, match=r"cannot run: %a1 on cuda:0 waits for \[%a2\]"):
        merged_order(bad)


def test_lower_bound_is_critical_path_or_work_over_devices():
    g = two_chains()
    cost = chains_cost()
    assert lower_bound(g, cost) == pytest.approx(20 * ms)  # chain: 2 x 10 ms > 40 ms / 3
    assert place(g, cost).predicted_s >= lower_bound(g, cost)


def test_graph_index_inputs_users_and_scalars():
    """s feeds only a pointwise op (a scalar argument on a GPU); t also feeds a matmul.

        x -> s = sum(x) -> mul(x, s)
          -> t = sum(x) -> mul(x, t), t + t, t.view(1, 1)
    """
    g = two_chains()
    cat = g.call(torch.ops.aten.cat.default, ([g.nodes[2], g.nodes[3], g.nodes[2]],), name="c")
    x = g.nodes[0]
    s = g.call(torch.ops.aten.sum.default, (x,), name="s")
    g.call(torch.ops.aten.mul.Tensor, (x, s), name="xs")
    t = g.call(torch.ops.aten.sum.default, (x,), name="t")
    g.call(torch.ops.aten.mul.Tensor, (x, t), name="xt")
    g.call(torch.ops.aten.add.Tensor, (t, t), name="tt")
    g.call(torch.ops.aten.view.default, (t, [1, 1]), name="tv")
    ix = GraphIndex.of(g)
    assert ix.ins == {v: v.inputs for v in g.nodes}
    assert ix.ins[cat] == (g.nodes[2], g.nodes[3])
    assert ix.users == g.users()
    assert ix.scalars == {s}


def test_only_binary_arithmetic_takes_a_host_scalar():
    """masked_fill's mask must sit on self's device, and add of two 0-dim tensors would run
    on the host: neither 0-dim input is a scalar argument; mul with a matrix is.

        x@cuda:0 -> s = sum(x) -> masked_fill(x, s_bool, 0)
                 -> t = sum(x) -> add(t, u)       (u = sum(x), 0-dim as well)
                 -> w = sum(x) -> mul(x, w)
    """
    g = Graph("scalars")
    x = g.input(tensor((4, 4), "cuda:0"), name="x")
    s = g.call(torch.ops.aten.gt.Scalar, (g.call(torch.ops.aten.sum.default, (x,)), 0), name="s")
    g.call(torch.ops.aten.masked_fill.Scalar, (x, s, 0.0), name="mf")
    t = g.call(torch.ops.aten.sum.default, (x,), name="t")
    u = g.call(torch.ops.aten.sum.default, (x,), name="u")
    g.call(torch.ops.aten.add.Tensor, (t, u), name="tu")
    w = g.call(torch.ops.aten.sum.default, (x,), name="w")
    g.call(torch.ops.aten.mul.Tensor, (x, w), name="xw")
    assert GraphIndex.of(g).scalars == {w}


def test_outputs_sharing_a_storage_are_made_where_eager_makes_them():
    """Two outputs are views of one cat: copied one by one they would no longer share it, so
    the cat runs on the outputs' device even though the host is much faster here.

        x@cuda:0, y@cuda:0 -> c = cat(x, y) -> a = c[:2], b = c[2:]   (outputs a, b)
    """
    g = Graph("shared")
    x = g.input(tensor((2, 4), "cuda:0"), name="x")
    y = g.input(tensor((2, 4), "cuda:0"), name="y")
    c = g.call(torch.ops.aten.cat.default, ([x, y],), name="c")
    a = g.call(torch.ops.aten.slice.Tensor, (c, 0, 0, 2), name="a")
    b = g.call(torch.ops.aten.slice.Tensor, (c, 0, 2, 4), name="b")
    g.set_outputs([a, b])
    cost = FakeCost(machine(cpus=1, gpus=1), times={("c", "cpu:0"): 1 * us}, default=1 * ms,
                    bandwidth=1e12)
    p = place(g, cost)
    assert devices_of(p) == {"c": "cuda:0", "a": "cuda:0", "b": "cuda:0"}
    assert p.notes[c] == "pinned: outputs share its storage: produced on their device cuda:0"
    assert p.copies() == []


# -- the machine of MEASURED.md ----------------------------------------------------------------
@pytest.fixture(scope="module")
def h200x2() -> CostModel:
    return CostModel(preset("h200x2"), History(), allow_tf32=False)


def test_w4_on_two_h200_is_predicted_nearly_twice_as_fast(h200x2):
    g = w4()
    heft, eager = place(g, h200x2), place(g, h200x2, "single")
    per_gpu = {d: len(ops) for d, ops in heft.order.items()}
    assert per_gpu["cuda:0"] >= 45 and per_gpu["cuda:1"] >= 45  # idle CPU workers may take one
    assert eager.predicted_s / heft.predicted_s >= 1.9
    assert simulate(make_plan(heft), h200x2).makespan == pytest.approx(heft.predicted_s)


def test_w5_hides_the_copies_behind_compute(h200x2):
    """On one GPU: max(compute, copy) within 5 %, not their sum."""
    g = w5()
    p = place(g, h200x2, devices=["cpu:0", "cuda:0"])
    n = by_name(g)
    mm = h200x2.node_time(n["y0"], "cuda:0")
    copy = h200x2.transfer_time(4000 * 4000 * 4, "cuda:0", "cpu:0")
    compute, copies = 50 * mm, 50 * copy
    assert p.predicted_s <= 1.05 * max(compute, copies)
    assert p.predicted_s < 0.8 * (compute + copies)
    assert all(p.device[n[f"z{i}"]] == "cpu:0" for i in range(50))
    on_gpu = [n[f"y{i}"] for i in range(50) if p.device[n[f"y{i}"]] == "cuda:0"]
    assert len(on_gpu) >= 48  # the idle host may take a matmul or two
    assert {(v, d) for v, d in p.copies() if v in on_gpu} == {(y, "cpu:0") for y in on_gpu}
    # with both GPUs, half the matmuls move to cuda:1 and copy out from there
    both = place(g, h200x2)
    assert both.predicted_s < 0.6 * p.predicted_s


def test_gc_paused_restores_the_collector():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("inside")
    assert gc.isenabled()


def test_copies_between_host_and_gpu_pay_the_executor_crossing(h200x2):
    """The link's time, plus the profile's crossing cost only where one end is the host."""
    link = h200x2.transfer_time(4, "cuda:0", "cpu:0")
    assert h200x2.crossing_s == pytest.approx(25 * us)
    assert copy_time(h200x2, 4, "cuda:0", "cpu:0") == pytest.approx(link + 25 * us)
    assert copy_time(h200x2, 4, "cuda:0", "cuda:1") == h200x2.transfer_time(4, "cuda:0", "cuda:1")
    assert copy_time(h200x2, 4, "cpu:0", "cpu:1") == 0.0
    assert copy_time(FakeCost(machine()), 4_000, "cpu:0", "cuda:0") == pytest.approx(4e-6)


def preprocess_then_gpu() -> tuple[Graph, FakeCost]:
    """cpu_preprocess's trap: a 12 MB input on the host, converted to a 4x larger value, which
    three more ops read one after the other before a move to the GPU and a matmul there.

        raw@cpu (12 MB) -> f = float(raw) (48 MB) -> a -> b -> xg = b.to("cuda") -> out
        f: 1.00 ms on the host, 0.05 ms on the GPU after raw's 1.2 ms copy (10 GB/s)
        a, b: 2 ms each on the host, 0.03 ms on the GPU; out: 0.1 ms on the GPU only
    """
    g = Graph("preprocess")
    raw = g.input(tensor((12_000_000,), "cpu", torch.uint8), name="raw")
    f = g.call(TO_COPY, (raw,), {"dtype": torch.float32}, meta=tensor((12_000_000,), "cpu"),
               name="f")
    a = g.call(RELU, (f,), meta=tensor((12_000_000,), "cpu"), name="a")
    b = g.call(RELU, (a,), meta=tensor((12_000_000,), "cpu"), name="b")
    xg = g.call(TO_COPY, (b,), {"device": torch.device("cuda:0")},
                meta=tensor((12_000_000,), "cuda:0"), name="xg")
    out = g.call(RELU, (xg,), meta=tensor((12_000_000,), "cuda:0"), name="out")
    g.set_outputs([out])
    times = {("f", "cpu"): 1.0 * ms, ("f", "cuda"): 0.05 * ms, ("out", "cuda"): 0.1 * ms}
    for name in "ab":
        times[(name, "cpu")], times[(name, "cuda")] = 2 * ms, 0.03 * ms
    return g, FakeCost(machine(cpus=1, gpus=1), times, bandwidth=10e9,
                       only={"out": ["cuda:0"]})


def test_the_lookahead_sees_what_a_greedy_choice_commits_the_rest_to():
    """Greedy HEFT keeps ``f`` on the host (1.0 ms against 1.25 ms), then a and b follow it (a
    48 MB copy costs more than their 2 ms) and xg copies 48 MB: 9.9 ms. Choosing by finish
    plus what the consumers still take moves raw (12 MB) to the GPU first: 1.41 ms."""
    from autopar.schedule import place as place_module

    g, cost = preprocess_then_gpu()
    index = GraphIndex.of(g)
    limits = {"cpu": None, "cuda:0": None}
    greedy = place_module._run(g, cost, "heft", ["cpu:0", "cuda:0"], limits, index)
    assert {n.name: d for n, d in greedy.device.items() if not n.is_input}["f"] == "cpu:0"
    assert greedy.makespan() == pytest.approx(1.0 * ms + 4 * ms + 4.8 * ms + 0.1 * ms)
    p = place(g, cost)
    assert devices_of(p) == {"f": "cuda:0", "a": "cuda:0", "b": "cuda:0", "xg": "cuda:0",
                             "out": "cuda:0"}
    assert p.predicted_s == pytest.approx(1.2 * ms + 0.05 * ms + 0.06 * ms + 0.1 * ms)
    n = by_name(g)
    assert p.notes[n["f"]].startswith("fastest finish with what follows: cuda:0")
    assert simulate(make_plan(p), cost).makespan == pytest.approx(p.predicted_s)


def test_copies_from_the_host_to_two_gpus_take_turns():
    """The thread that issues a copy of pageable host memory stages it itself: a copy of x to
    cuda:0 and one of y to cuda:1 (1 ms each) run one after the other, not at once.

        x@cpu -> a (cuda:0 only)      cpu/h2d: x -> cuda:0 [0, 1], y -> cuda:1 [1, 2]
        y@cpu -> b (cuda:1 only)      a [1, 2] on cuda:0, b [2, 3] on cuda:1
    """
    g = Graph("two_gpus_from_the_host")
    x = g.input(tensor((500, 500), "cpu"), name="x")  # 1 MB each: 1 ms at 1 GB/s
    y = g.input(tensor((500, 500), "cpu"), name="y")
    g.set_outputs([g.call(MM, (x, x), name="a"), g.call(MM, (y, y), name="b")])
    cost = FakeCost(machine(cpus=1, gpus=2), default=1 * ms, bandwidth=1e9,
                    only={"a": ["cuda:0"], "b": ["cuda:1"]})
    p = place(g, cost, devices=["cuda:0", "cuda:1"])
    n = by_name(g)
    copies = sorted((p.slots[k].start, p.slots[k].end) for k in p.copies()
                    if k[0].name in "xy")
    assert copies == [pytest.approx((0.0, 1 * ms)), pytest.approx((1 * ms, 2 * ms))]
    assert sorted([p.slots[n["a"]].end, p.slots[n["b"]].end]) == [pytest.approx(2 * ms),
                                                                  pytest.approx(3 * ms)]
    assert simulate(make_plan(p), cost).makespan == pytest.approx(p.predicted_s)


def test_a_view_of_an_input_is_taken_first_so_its_copy_leaves_at_once():
    """A weight's transpose is ready at time 0; taken in rank order after the 10 ms matmul on
    its lane, it (and its copy to cuda:1) would start only when that matmul ends.

        x, w1, w2 @cuda:0    a = x @ w1 (10 ms) -> a2 (10 ms) -+
                             wt = w2.t() (a view, 0 s)           +-> out = a2 + b
                             b = x @ wt (10 ms) ---------------+
        1 MB copies take 1 ms: x and wt to cuda:1 [0, 2], b there [2, 12], back [12, 13];
        a and a2 on cuda:0 [0, 20]; out [20, 21].
    """
    g = Graph("transposed_weight")
    x = g.input(tensor((500, 500), "cuda:0"), name="x")
    w1 = g.input(tensor((500, 500), "cuda:0"), name="w1")
    w2 = g.input(tensor((500, 500), "cuda:0"), name="w2")
    a = g.call(MM, (x, w1), name="a")
    a2 = g.call(RELU, (a,), name="a2")
    wt = g.call(torch.ops.aten.t.default, (w2,), name="wt")
    b = g.call(MM, (x, wt), name="b")
    g.set_outputs([g.call(torch.ops.aten.add.Tensor, (a2, b), name="out")])
    cost = FakeCost(machine(cpus=1, gpus=2), {
        ("a", "cuda"): 10 * ms, ("a2", "cuda"): 10 * ms, ("b", "cuda"): 10 * ms,
        ("wt", "cuda"): 0.0, ("out", "cuda"): 1 * ms,
    }, default=1.0, bandwidth=1e9)
    p = place(g, cost)
    n = by_name(g)
    assert devices_of(p) == {"a": "cuda:0", "a2": "cuda:0", "wt": "cuda:0", "b": "cuda:1",
                             "out": "cuda:0"}
    assert p.slots[n["wt"]].start == 0.0
    assert p.slots[(n["wt"], "cuda:1")].start < 2 * ms
    assert p.predicted_s == pytest.approx(21 * ms)
    assert simulate(make_plan(p, cost), cost).makespan == pytest.approx(p.predicted_s)
