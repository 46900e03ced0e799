"""Views of a Timeline: Chrome/Perfetto trace JSON and a Gantt PNG.

Policy
- Views read Timelines (simulated or measured: the same type) and never change them.
- Chrome trace: one process per device, one thread per lane (stream or CPU worker); ops and
  copies are complete events (``ph: X``) with microsecond times; copies carry bytes and GB/s;
  flow arrows (``ph: s``/``f``) join the op that produced a value to the copy that moves it, and
  the copy to the first op on the destination that reads it (when the graph is given).
- Gantt PNG: a row per lane; with ``predicted`` given, its lanes are drawn beneath the measured
  ones in a lighter shade, labelled as predicted. matplotlib is imported only here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..ir.graph import Graph
from ..schedule.timeline import Span, Timeline

__all__ = ["save_chrome_trace", "save_gantt", "to_chrome_trace"]

_COLORS = {"op": "#4C72B0", "copy": "#DD8452", "wait": "#8C8C8C", "sync": "#C44E52"}


def _device_of(lane: str) -> str:
    return lane.split("/", 1)[0]


def to_chrome_trace(timeline: Timeline, graph: Graph | None = None,
                    extra: Iterable[Timeline] = ()) -> dict[str, Any]:
    """The Chrome trace-event JSON object of ``timeline`` (and of ``extra`` timelines)."""
    events: list[dict[str, Any]] = []
    pids: dict[str, int] = {}
    tids: dict[str, int] = {}
    for tl_index, tl in enumerate([timeline, *extra]):
        prefix = "" if tl_index == 0 else f"{tl.label or tl.source} "
        origin = min((s.start for s in tl.spans), default=0.0)
        for lane in tl.lanes():
            device = prefix + _device_of(lane)
            if device not in pids:
                pids[device] = len(pids) + 1
                events.append({"ph": "M", "name": "process_name", "pid": pids[device],
                               "args": {"name": device}})
            key = prefix + lane
            if key not in tids:
                tids[key] = len(tids) + 1
                events.append({"ph": "M", "name": "thread_name", "pid": pids[device],
                               "tid": tids[key], "args": {"name": lane}})
        for s in tl.spans:
            events.append(_event(s, pids[prefix + _device_of(s.lane)], tids[prefix + s.lane],
                                 origin))
        if tl_index == 0:
            events += _flows(tl, graph, pids, tids, origin)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": timeline.source, "label": timeline.label}}


def _event(s: Span, pid: int, tid: int, origin: float) -> dict[str, Any]:
    args: dict[str, Any] = {"kind": s.kind}
    if s.node is not None:
        args["node"] = s.node
    if s.kind == "copy":
        args.update(bytes=s.bytes, src=s.src, dst=s.dst)
        if s.duration > 0:
            args["GB/s"] = round(s.bytes / s.duration / 1e9, 2)
    return {"ph": "X", "name": s.name, "cat": s.kind, "pid": pid, "tid": tid,
            "ts": (s.start - origin) * 1e6, "dur": max(s.duration * 1e6, 0.001), "args": args}


def _flows(tl: Timeline, graph: Graph | None, pids: dict[str, int], tids: dict[str, int],
           origin: float) -> list[dict[str, Any]]:
    ops_by_node: dict[int, list[Span]] = {}
    for s in tl.spans:
        if s.kind == "op" and s.node is not None:
            ops_by_node.setdefault(s.node, []).append(s)
    readers: dict[int, list[int]] = {}
    if graph is not None:
        for n in graph.nodes:
            for i in n.inputs:
                readers.setdefault(i.id, []).append(n.id)
    flows: list[dict[str, Any]] = []

    def arrow(a: Span, b: Span, ident: int) -> None:
        for ph, s, ts in (("s", a, a.end), ("f", b, b.start)):
            ev = {"ph": ph, "id": ident, "name": "dep", "cat": "dep", "ts": (ts - origin) * 1e6,
                  "pid": pids[_device_of(s.lane)], "tid": tids[s.lane]}
            if ph == "f":
                ev["bp"] = "e"
            flows.append(ev)

    for k, copy in enumerate(s for s in tl.spans if s.kind == "copy" and s.node is not None):
        producer = [p for p in ops_by_node.get(copy.node, []) if p.end <= copy.start + 1e-9]
        if producer:
            arrow(producer[-1], copy, 2 * k + 1)
        consumers = sorted(
            (c for r in readers.get(copy.node, []) for c in ops_by_node.get(r, [])
             if _device_of(c.lane) == copy.dst and c.start >= copy.end - 1e-9),
            key=lambda c: c.start)
        if consumers:
            arrow(copy, consumers[0], 2 * k + 2)
    return flows


def save_chrome_trace(timeline: Timeline, path: str | Path, graph: Graph | None = None,
                      extra: Iterable[Timeline] = ()) -> Path:
    """Write the trace; open it in https://ui.perfetto.dev or chrome://tracing."""
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(timeline, graph, extra)))
    return path


def save_gantt(timeline: Timeline, path: str | Path, predicted: Timeline | None = None,
               title: str | None = None, labels: tuple[str, str] | None = None) -> Path:
    """A Gantt chart PNG: a row per lane, the predicted timeline beneath the measured one.

    ``labels`` name the two timelines in the row labels (default: the first one's source, and
    "predicted")."""
    import matplotlib  # optional dependency (autopar[plot])

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (autopar[plot])

    first, second = labels or (timeline.source, "predicted")
    rows: list[tuple[str, Timeline, str, float]] = []
    for lane in timeline.lanes():
        rows.append((f"{lane} ({first})", timeline, lane, 1.0))
    if predicted is not None:
        for lane in predicted.lanes():
            rows.append((f"{lane} ({second})", predicted, lane, 0.45))
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(rows) + 1.5))
    span_max = 0.0
    for y, (_, tl, lane, alpha) in enumerate(rows):
        origin = min((s.start for s in tl.spans), default=0.0)
        for s in tl.on(lane):
            start_ms, dur_ms = (s.start - origin) * 1e3, s.duration * 1e3
            span_max = max(span_max, start_ms + dur_ms)
            ax.broken_barh([(start_ms, max(dur_ms, 1e-4))], (y - 0.4, 0.8),
                           facecolors=_COLORS.get(s.kind, "#55A868"), alpha=alpha,
                           edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, span_max * 1.02 or 1)
    heading = title or timeline.label or "timeline"
    made = f"{first} {timeline.makespan * 1e3:.3g} ms"
    if predicted is not None:
        made += f", {second} {predicted.makespan * 1e3:.3g} ms"
    ax.set_title(f"{heading}: {made}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, list(_COLORS), loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
