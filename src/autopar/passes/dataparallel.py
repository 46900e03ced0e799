"""Data parallelism's choice: a step placed unsplit and split over k devices for each k, the
one predicted fastest kept (see :mod:`autopar.dataparallel` for the policy).

Each candidate is predicted as the executor will run it, and for at least the time the one
thread that issues the host's and every GPU's work spends on it
(:func:`~autopar.schedule.simulate.issue_s`); where the programs of some devices get their
regions fused (``fusing``, :func:`autopar.passes.fusion.fusion_devices` of the
``fuse`` option: the GPUs by default), its plan is simulated under
:class:`~autopar.passes.fusion.FusedCost`. Unfused, every small kernel of a GPU's share is a
launch whatever its size: GPT-2 small's AdamW step split over 8 H200s (``h200x8``) kept
~8 ms of small kernels on every GPU beside 19 ms of GEMMs, the same count as on one GPU, so
the split's prediction was bound by launches that the executor fuses away."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..capture.step import StepGraph
from ..ir.graph import Node
from ..ir.routing import index_of
from ..ir.units import fmt_seconds
from ..machine.model import GiB
from ..schedule.place import memory_limits, place
from ..schedule.plan import make_plan
from ..schedule.simulate import issue_s, peak_memory, simulate
from .cudagraphs import GraphedCost, capture_rule, graphed_segments_each
from .fusion import FusedCost, fused_regions
from .shard import NotShardable, Sharded, shard

__all__ = ["AT_ONCE_SLACK", "FOREACH_TENSORS", "GRAPHS_ISSUE_SHARE", "Choice", "choose",
           "devices_for", "predicted_run", "resident", "shard_devices", "with_graphs", "write_back"]

log = logging.getLogger("autopar.dataparallel")

AT_ONCE_SLACK = 0.1
"""The split over two devices with its big sums reduced at once is placed too where the same
split reduced in chunks is predicted within this share of the fastest candidate."""


@dataclass
class Choice:
    """What :func:`choose` picked: the placement that runs, the sharded graph (None: unsplit)
    and the predicted seconds of every candidate (key ``"unsplit"`` or the devices joined by
    commas)."""

    placement: Any
    sharded: Sharded | None
    predicted: dict[str, float]
    refused: dict[str, str] = field(default_factory=dict)  # candidate -> why it can't run
    plan: Any = None  # the kept candidate's Plan, the one its prediction simulated
    timeline: Any = None  # the kept candidate's simulated Timeline, as predicted
    label: str = "unsplit"  # the kept candidate's key in ``predicted``
    pruned: dict[str, str] = field(default_factory=dict)  # candidate -> why it wasn't placed
    graphs: bool | str = False  # the cuda_graphs mode its GPUs' segments replay under
    issue_s: float = 0.0  # the kept candidate's seconds on the one issuing thread

    def bound(self) -> str:
        """What the kept candidate's prediction is bound by: the issuing thread's seconds and
        the busiest device lane's (the larger binds; neither, the chain of dependencies)."""
        if self.timeline is None:
            return ""
        busy = {lane: self.timeline.busy(lane) for lane in self.timeline.lanes()
                if lane.endswith("/compute") or lane.startswith("cpu:")}
        lane = max(busy, key=busy.__getitem__, default=None)
        total = self.predicted[self.label]
        parts = [f"the issuing thread {fmt_seconds(self.issue_s)}"]
        if lane is not None:
            parts.append(f"the busiest lane ({lane}) {fmt_seconds(busy[lane])}")
        return f"of its {fmt_seconds(total)}: " + ", ".join(parts)


def resident(step: StepGraph, sharded: Sharded | None,
             graphs: bool | str) -> tuple[frozenset[int], frozenset[int]]:
    """By index, for a step's graph (``sharded``'s where split): the inputs that stay where they
    live between calls (the state's tensors: modules' parameters and buffers, optimizer
    state; parameters among the arguments; the trace's constants; the replicas), read in
    place by CUDA graphs; the outputs the caller writes back into the tensors that hold them
    (new values of mutated inputs always; under ``graphs`` each ``.grad`` and the replicas'
    next values too, since a graph's outputs are its static buffers: the executor's
    ``transient``, no graph need clone them)."""
    n_in = len(step.graph.inputs)
    n_out = len(step.graph.outputs)
    n_rep = len(sharded.replicas) if sharded is not None else 0
    n_next = len(sharded.replica_outputs) if sharded is not None else 0
    in_place = frozenset(range(step.n_args, n_in + n_rep)) | frozenset(step.arg_params)
    mutated = range(step.n_outputs + len(step.grads), n_out)
    back = frozenset(range(step.n_outputs, n_out + n_next)) if graphs else frozenset(mutated)
    return in_place, back


GRAPHS_ISSUE_SHARE = 0.8
"""A candidate whose issuing thread is busy for less than this share of its makespan is not
bound by launches, and its segments are not looked at for CUDA graphs (planning GPT-2 small's
step on ``h200x8`` took 11 s without that analysis and 14-15 s with it, for no gain)."""

FOREACH_TENSORS = 110
"""Tensors one ``torch._foreach_copy_`` launch takes (multi-tensor apply's list depth 2)."""


def write_back(plan: Any, cost: Any, back: frozenset[int]) -> tuple[float, float]:
    """(the longest GPU time, the issuing thread's time) of writing the graph outputs ``back``
    into the tensors that hold them after a call: one ``torch._foreach_copy_`` per device, a
    launch per ``FOREACH_TENSORS`` tensors, each byte read and written."""
    ix = index_of(plan.placement, plan.graph)
    by_device: dict[str, list[int]] = {}
    for i in back:
        value, device = plan.outputs[i]
        if isinstance(value, Node) and not device.startswith("cpu"):
            by_device.setdefault(device, []).append(ix.nbytes[value])
    prof = cost.machine.profile
    longest = issue = 0.0
    for device, sizes in by_device.items():
        dp = prof.device(device)
        launches = -(-len(sizes) // FOREACH_TENSORS)
        issue += launches * dp.launch("copy")
        longest = max(longest, dp.read_time(sum(sizes)) + dp.write_time(sum(sizes)))
    return longest, issue


def predicted_run(placed: Any, cost: Any, fusing: Sequence[str],
                  step: StepGraph | None = None,
                  sharded: Sharded | None = None) -> tuple[Any, Any, float, float]:
    """The plan of ``placed``, its simulated Timeline as the executor runs it (the regions of
    the programs of ``fusing`` fused; none: priced op by op), its predicted seconds (the
    longer of its makespan and the calling thread's issue time, :func:`issue_s`: one thread
    launches every GPU's work; for a ``step``, each with its outputs' write-back after it,
    :func:`write_back`) and that issue time; :func:`with_graphs` also predicts the segments
    replayed as CUDA graphs."""
    return with_graphs(placed, cost, fusing, step, sharded)[:4]


def with_graphs(placed: Any, cost: Any, fusing: Sequence[str], step: StepGraph | None,
                sharded: Sharded | None, cuda_graphs: bool | str = False,
                graphed_devices: Sequence[str] = ()
                ) -> tuple[Any, Any, float, float, bool | str]:
    """:func:`predicted_run`'s answer and the ``cuda_graphs`` mode its executor replays
    segments under (the programs of ``graphed_devices``; False: none): a mode is kept only
    where its rule (:func:`~autopar.passes.cudagraphs.capture_rule`) chooses segments and the
    prediction with them (their replays, the outputs written back out of static buffers) is
    shorter than without. ``cuda_graphs=True``: wherever segments are chosen; ``"auto"`` only
    where the issuing thread is the bound (``GRAPHS_ISSUE_SHARE``), and then the faster of
    the ``"auto"`` rule's segments and every capturable one: the rule judges each segment
    alone, and one it drops makes its outputs copies into the next, so on GPT-2 small's step
    over 8 GPUs it dropped them all (57.7 ms predicted) where replaying all predicts 32.6."""
    plan = make_plan(placed, cost)
    fused = fused_regions(plan, fusing) if fusing else {}
    priced: Any = FusedCost(cost, fused) if fusing else cost

    def run(priced: Any, back: frozenset[int]) -> tuple[Any, float, float]:
        timeline = simulate(plan, priced)
        issue = issue_s(plan, priced)
        back_s, back_issue = write_back(plan, cost, back)
        return timeline, max(timeline.makespan + back_s, issue + back_issue), issue

    timeline, predicted, issue = run(priced, resident(step, sharded, False)[1]
                                     if step is not None else frozenset())
    forced = cuda_graphs is True
    on = [d for d in plan.programs if d in graphed_devices]
    if capture_rule(cuda_graphs) is None or step is None or not on or \
            (not forced and issue < GRAPHS_ISSUE_SHARE * timeline.makespan):
        return plan, timeline, predicted, issue, False
    in_place, back = resident(step, sharded, True)
    inputs = plan.graph.inputs
    best: tuple[Any, float, float, bool | str] = (timeline, predicted, issue, False)
    modes = (cuda_graphs, True) if cuda_graphs == "auto" else (cuda_graphs,)
    each = graphed_segments_each(plan, on, [capture_rule(m) for m in modes], fused,
                                 frozenset(inputs[i] for i in in_place),
                                 frozenset(plan.outputs[i][0] for i in back))
    for mode, graphed in zip(modes, each, strict=True):
        if not any(graphed.segments.values()):
            continue
        g_timeline, g_predicted, g_issue = run(GraphedCost(priced, *graphed), back)
        if forced or g_predicted < best[1]:
            best = (g_timeline, g_predicted, g_issue, mode)
    return plan, *best


def choose(step: StepGraph, batch: dict[Node, int], cost: Any, devices: Sequence[str], *,
           policy: str = "heft", shards: int | None = None,
           fusing: Sequence[str] = (), cuda_graphs: bool | str = False,
           graphed_devices: Sequence[str] = ()) -> Choice:
    """Place ``step`` unsplit and split over the first k same-kind devices (home first) for
    k = 1, 2, 4, ... and all of them, and keep the one predicted fastest (with the programs
    of ``fusing`` fused, as the executor will run them); ``shards`` forces k (1: don't split).
    A split over two devices whose big partial sums are reduced in chunks
    (:mod:`autopar.passes.shard`) is also placed with every sum reduced at once (key
    ``"<devices> at once"``), the model picking, where the chunked form is predicted within
    ``AT_ONCE_SLACK`` of the fastest candidate (the two forms differ by a few percent: W6 on
    ``h200x2`` 11.81 against 11.96 ms; GPT-2 small's step on ``h200x8``, 73.0 and 72.4 ms,
    where 4 GPUs predict 44.3). A split over more devices than the last one placed is not
    placed (``Choice.pruned`` says why, and no larger k is tried) where its ops at the last
    split's issue seconds per op already exceed the fastest prediction, or where the last
    split predicted slower than the one before it (ResNet-50's step on ``h200x8``: 31.3 ms
    over 2 GPUs, 58.8 over 4; its batch norm's statistics cross between GPUs at every
    layer): more devices, more
    launches on the one issuing thread (GPT-2 small's step on ``h200x8``: over 4 GPUs 24.1 ms
    of issue for 10,138 ops; over 8, 18,638 ops, an estimate of 44.3 ms and a prediction of
    50.4, not placed; planning 16.3 s -> 12.0 on the 2-core VM); not where segments may
    replay as CUDA graphs, which take launches off that thread. Once the first split (two
    devices) predicts faster than unsplit, the largest is placed next, then fewer devices,
    each only while 1/k of the unsplit prediction is below the fastest so far (no split of
    the presets' steps beats its share: 1.27-3.2x it): GPT-2 small's step on ``h200x8``
    places 8 GPUs after 2 and not 4 (26.5 ms against 116.4 / 4), a second off its planning.
    ``cuda_graphs`` (the option) and ``graphed_devices`` (the executor's devices for
    graphs): each candidate predicted with those programs' segments replayed too, the faster
    form kept (``Choice.graphs``; see :func:`with_graphs`)."""
    devices, same_kind = shard_devices(batch, cost, devices, shards)
    # launches are no floor where segments may replay as CUDA graphs
    replayable = capture_rule(cuda_graphs) is not None and bool(graphed_devices)
    n = len(same_kind)
    ks = sorted({k for k in (1 << i for i in range(n.bit_length())) if k <= n} | {n}) \
        if shards is None else [shards]  # powers of two and all: planning time stays bounded
    predicted: dict[str, float] = {}
    issues: dict[str, float] = {}  # label -> its issuing thread's seconds
    runs: dict[str, tuple[Any, Any]] = {}  # label -> (plan, timeline)
    graphed: dict[str, bool] = {}  # label -> predicted with its segments replayed
    placed_all: list[tuple[str, Any, Sharded | None]] = []
    at_once: tuple[str, list[str]] | None = None  # the chunked pair's label and devices
    pruned: dict[str, str] = {}
    per_op = 0.0  # the issuing thread's seconds per op of the last split placed
    splits: list[float] = []  # the predictions of the splits placed, by k
    down = False  # the splits after the first that paid: the largest first, then fewer
    order = list(ks)
    for at, k in enumerate(order):
        if shards is None and not down and len(splits) >= 2 and splits[-1] > splits[-2]:
            label = ",".join(same_kind[:k])
            pruned[label] = ("not placed: the last split predicted slower than the one before "
                             f"it ({fmt_seconds(splits[-1])} against {fmt_seconds(splits[-2])})")
            log.info("autopar: %s %s: %s", step.graph.name, label, pruned[label])
            break  # more devices, more cross-device points: it only gets slower
        if down and predicted["unsplit"] / k >= min(predicted.values()):
            label = ",".join(same_kind[:k])
            pruned[label] = (f"not placed: its share of the unsplit prediction (1/{k} of "
                             f"{fmt_seconds(predicted['unsplit'])}) is no faster than the "
                             f"fastest candidate's {fmt_seconds(min(predicted.values()))}")
            log.info("autopar: %s %s: %s", step.graph.name, label, pruned[label])
            break  # fewer devices, a larger share
        if k == 1:
            placed, sharded = place(step.graph, cost, policy=policy, devices=devices), None
            label = "unsplit"
            candidates = [(label, placed, sharded)]
        else:
            try:
                # over more than two GPUs big sums are reduced scattered, not in mm chunks
                chunked = shard(step.graph, batch, same_kind[:k], updates=step.updates,
                                reduce_chunks=None if k == 2 else 1)
                forms = [("", chunked)]
                if chunked.reduced_in_chunks and k == 2:  # over more GPUs: scattered sums
                    at_once = ",".join(same_kind[:k]), same_kind[:k]
            except NotShardable as e:
                if shards is not None:
                    raise
                log.info("autopar: %s not split over %d devices: %s", step.graph.name, k, e)
                continue
            label = ",".join(same_kind[:k])
            floor = per_op * len(chunked.graph.ops)
            if shards is None and not replayable and floor > min(predicted.values()):
                pruned[label] = (f"not placed: its launches alone, about {fmt_seconds(floor)} "
                                 "on the issuing thread, exceed the fastest candidate's "
                                 f"{fmt_seconds(min(predicted.values()))}")
                log.info("autopar: %s %s: %s", step.graph.name, label, pruned[label])
                if down:
                    continue  # fewer devices next: fewer launches
                break  # more devices, more launches
            candidates = [(label + suffix, place(s.graph, cost, policy=policy, devices=devices,
                                                 pins=s.pins), s) for suffix, s in forms]
        for label, placed, sharded in candidates:
            plan, timeline, predicted[label], issue, graphed[label] = with_graphs(
                placed, cost, fusing, step, sharded, cuda_graphs, graphed_devices)
            runs[label], issues[label] = (plan, timeline), issue
            placed_all.append((label, placed, sharded))
            if sharded is not None:  # the issuing thread's seconds per op of a split graph
                per_op = issue / len(sharded.graph.ops)
                splits.append(predicted[label])
        if shards is None and not down and k > 1 and at + 2 < len(order) and \
                min(splits) < predicted["unsplit"]:
            # the first split paid: the largest next, then fewer devices while their share
            # of the unsplit prediction could still beat the fastest (see the docstring)
            order[at + 1:] = sorted(order[at + 1:], reverse=True)
            down = True
    if at_once is not None and \
            predicted[at_once[0]] <= (1 + AT_ONCE_SLACK) * min(predicted.values()):
        label, pair = f"{at_once[0]} at once", at_once[1]
        sharded = shard(step.graph, batch, pair, updates=step.updates, reduce_chunks=1)
        placed = place(sharded.graph, cost, policy=policy, devices=devices, pins=sharded.pins)
        plan, timeline, predicted[label], issues[label], graphed[label] = with_graphs(
            placed, cost, fusing, step, sharded, cuda_graphs, graphed_devices)
        runs[label] = plan, timeline
        placed_all.append((label, placed, sharded))
    ranked = sorted(placed_all, key=lambda c: predicted[c[0]])
    refused: dict[str, str] = {}
    for label, placed, sharded in ranked:  # the fastest that fits every device's memory
        why = _does_not_fit(*runs[label], cost)
        if why is None:
            return Choice(placed, sharded, predicted, refused, *runs[label], label, pruned,
                          graphed[label], issues[label])
        refused[label] = why
        log.info("autopar: %s %s: %s", step.graph.name, label, why)
    label, placed, sharded = ranked[0]  # nothing fits (eager's own form neither): the fastest
    return Choice(placed, sharded, predicted, refused, *runs[label], label, pruned,
                  graphed[label], issues[label])


def _does_not_fit(plan: Any, timeline: Any, cost: Any) -> str | None:
    """Why a plan's peak memory over its simulated timeline exceeds a device's, or None."""
    limits = memory_limits(cost)
    for pool, peak in peak_memory(plan, timeline).items():
        has = limits.get(pool)
        if has is not None and peak > has:
            return f"needs {peak / GiB:.2f} GiB on {pool}, which has {has / GiB:.2f} GiB"
    return None


def shard_devices(batch: dict[Node, int], cost: Any, devices: Sequence[str],
                   shards: int | None) -> tuple[list[str], list[str]]:
    """The devices to place on (home added) and those that may take a shard (home first, then
    the others of its kind), checking ``shards`` against them (:func:`devices_for`)."""
    return devices_for(cost.machine.home(next(iter(batch)).device).name, devices, shards)


def devices_for(home: str, devices: Sequence[str],
                shards: int | None) -> tuple[list[str], list[str]]:
    """:func:`shard_devices` for a batch on ``home``: raises ValueError where ``shards`` is
    more than the devices of home's kind (or less than 1)."""
    devices = list(devices)
    if home not in devices:
        devices.insert(0, home)
    kind = home.split(":")[0]
    same_kind = [home] + [d for d in devices if d != home and d.split(":")[0] == kind]
    if shards is not None and not 1 <= shards <= len(same_kind):
        raise ValueError(f"shards={shards}: between 1 and {len(same_kind)} devices of the "
                         f"home's kind ({', '.join(same_kind)}) can take a shard")
    return devices, same_kind


