"""The placed graph as a picture: DOT text always; SVG/PNG through Graphviz's ``dot`` when it
is installed, else drawn with matplotlib (the ``plot`` extra), else an error saying which is
missing (:class:`MissingRenderer`; the ``.dot`` text is written next to the asked-for path).

Policy
- Nodes are coloured by device; edges that cross devices are drawn bold and labelled with the
  bytes the transfer moves; the critical path is drawn thick and red.
- Graphs of more than ``max_nodes`` ops are collapsed: consecutive ops of one op family on one
  device (e.g. a chain of 50 matmuls on cuda:1) become one box labelled with the count, so the
  picture stays readable. Collapsing never merges ops of different devices.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from ..ir.graph import Node, op_name
from ..ir.units import fmt_bytes
from ..schedule.place import Placement

__all__ = ["MissingRenderer", "render", "to_dot"]


class MissingRenderer(RuntimeError):
    """Neither Graphviz's ``dot`` nor matplotlib is installed: no image could be drawn."""

_PALETTE = ["#8ecae6", "#ffb703", "#90be6d", "#f28482", "#cdb4db", "#f9c74f", "#43aa8b",
            "#577590", "#f8961e"]


def _colour(device: str, devices: list[str]) -> str:
    return _PALETTE[devices.index(device) % len(_PALETTE)]


def _groups(placement: Placement, max_nodes: int) -> dict[Node, int]:
    """Node -> group id: one group per node, or runs of one family on one device if too many."""
    ops = placement.graph.ops
    if len(ops) <= max_nodes:
        return {n: n.id for n in placement.graph.nodes}
    group: dict[Node, int] = {x: x.id for x in placement.graph.inputs}
    last: dict[tuple[str, str], int] = {}
    for n in ops:
        key = (placement.device[n], n.kind)
        # join the open run of this (device, family) if every input is outside it or in it
        gid = last.get(key)
        if gid is None or any(group.get(i) not in (gid, None) and placement.device[i] == key[0]
                              and i.kind == key[1] and group[i] != gid for i in n.inputs):
            gid = n.id
        group[n] = gid
        last[key] = gid
    return group


def _boxes(placement: Placement, critical: list[Node], max_nodes: int) -> tuple:
    """What both pictures draw: the devices, each box's nodes (by group id, in node order),
    the boxes on the critical path, and each edge between boxes with the bytes it moves
    across devices (-1 where it stays on one)."""
    graph = placement.graph
    devices = sorted({placement.device[n] for n in graph.nodes})
    group = _groups(placement, max_nodes)
    members: dict[int, list[Node]] = {}
    for n in graph.nodes:
        members.setdefault(group[n], []).append(n)
    edges: dict[tuple[int, int], int] = {}
    for n in graph.nodes:
        for i in n.inputs:
            a, b = group[i], group[n]
            if a != b:
                moved = (sum(m.nbytes for m in i.tensor_metas)
                         if placement.device[i] != placement.device[n] else -1)
                edges[(a, b)] = max(edges.get((a, b), -1), moved)
    return devices, members, {group[n] for n in critical}, edges


def to_dot(placement: Placement, critical: list[Node] = (), max_nodes: int = 80) -> str:
    """DOT source of the placed graph (see the module docstring)."""
    graph = placement.graph
    devices, members, on_path, edges = _boxes(placement, critical, max_nodes)
    lines = [f'digraph "{graph.name}" {{', "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];']
    for gid, nodes in members.items():
        first = nodes[0]
        dev = placement.device[first]
        name = "input" if first.is_input else op_name(first.op)
        label = f"{name} x{len(nodes)}" if len(nodes) > 1 else f"{name} {first!r}"
        meta = first.tensor_metas
        shape = f"\\n{meta[0]}" if meta else ""
        border = ', color="#d62828", penwidth=3' if gid in on_path else ""
        lines.append(f'  g{gid} [label="{label}{shape}\\n{dev}", '
                     f'fillcolor="{_colour(dev, devices)}"{border}];')
    for (a, b), moved in edges.items():
        style = []
        if moved >= 0:
            style += [f'label="{fmt_bytes(moved)}"', "style=bold", 'color="#6c757d"']
        if a in on_path and b in on_path:
            style += ['color="#d62828"', "penwidth=2.5"]
        lines.append(f"  g{a} -> g{b}" + (f" [{', '.join(style)}]" if style else "") + ";")
    legend = " | ".join(f"{d}" for d in devices)
    lines.append(f'  labelloc="t"; label="{graph.name}: {legend}";')
    lines.append("}")
    return "\n".join(lines)


def _draw(placement: Placement, path: Path, critical: list[Node], max_nodes: int) -> None:
    """The picture of :func:`to_dot` drawn with matplotlib: ops in rows by depth (inputs at the
    top), coloured by device; cross-device edges bold with their bytes; the critical path red."""
    from matplotlib.figure import Figure  # no pyplot: the user's backend is left alone
    from matplotlib.patches import Patch  # the plot extra: optional

    graph = placement.graph
    devices, members, on_path, edges = _boxes(placement, critical, max_nodes)
    depth: dict[int, int] = {}
    for gid in members:  # members is in node order, which is topological
        depth[gid] = max((depth[a] + 1 for (a, b) in edges if b == gid and a in depth),
                         default=0)
    rows: dict[int, list[int]] = {}
    for gid in members:
        rows.setdefault(depth[gid], []).append(gid)
    width = max(len(r) for r in rows.values())
    where = {gid: ((k + 0.5) * width / len(row), -d)
             for d, row in rows.items() for k, gid in enumerate(row)}
    fig = Figure(figsize=(min(2.0 + 1.8 * width, 60), min(1.5 + 0.9 * len(rows), 60)))
    ax = fig.subplots()
    for (a, b), moved in edges.items():
        (x0, y0), (x1, y1) = where[a], where[b]
        hot = a in on_path and b in on_path
        ax.annotate("", xy=(x1, y1 + 0.18), xytext=(x0, y0 - 0.18), arrowprops={
            "arrowstyle": "->", "color": "#d62828" if hot else "#6c757d",
            "lw": 2.5 if hot else (1.6 if moved >= 0 else 0.8)})
        if moved >= 0:
            ax.text((x0 + x1) / 2, (y0 + y1) / 2, fmt_bytes(moved), fontsize=7,
                    ha="center", va="center", color="#495057")
    for gid, nodes in members.items():
        first = nodes[0]
        dev = placement.device[first]
        name = "input" if first.is_input else op_name(first.op)
        label = f"{name} x{len(nodes)}" if len(nodes) > 1 else name
        x, y = where[gid]
        ax.text(x, y, label, ha="center", va="center", fontsize=8, bbox={
            "boxstyle": "round", "facecolor": _colour(dev, devices),
            "edgecolor": "#d62828" if gid in on_path else "#495057",
            "linewidth": 2.5 if gid in on_path else 0.8})
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(-len(rows) + 0.4, 0.6)
    ax.axis("off")
    ax.set_title(f"{graph.name}: {' | '.join(devices)}")
    ax.legend(handles=[Patch(facecolor=_colour(d, devices), label=d) for d in devices],
              loc="upper right", fontsize=8)
    fig.savefig(path, bbox_inches="tight")


def render(placement: Placement, path: str | Path, critical: list[Node] = (),
           max_nodes: int = 80) -> Path:
    """Write the picture: ``.dot`` (or ``.gv``) text, or ``.svg``/``.png`` through Graphviz,
    else drawn with matplotlib (another suffix: ValueError); returns the path written. Raises
    :class:`MissingRenderer` (after writing the ``.dot`` text next to ``path``) when neither is
    installed."""
    path = Path(path)
    if path.suffix not in (".dot", ".gv", ".svg", ".png"):
        raise ValueError(f"can't write the placed graph as {path.name}: name a .dot, .svg or "
                         ".png file")
    dot = to_dot(placement, critical, max_nodes)
    if path.suffix in (".dot", ".gv"):
        path.write_text(dot)
        return path
    exe = shutil.which("dot")
    if exe is None:
        try:
            import matplotlib  # noqa: F401  (the plot extra: optional)
        except ImportError:
            fallback = path.with_suffix(".dot")
            fallback.write_text(dot)
            raise MissingRenderer(
                f"can't draw {path}: Graphviz's 'dot' is not on PATH and matplotlib is not "
                f"installed (pip install 'autopar[plot]', or install Graphviz); wrote the DOT "
                f"text to {fallback}") from None
        _draw(placement, path, critical, max_nodes)
        return path
    subprocess.run([exe, f"-T{path.suffix[1:]}", "-o", str(path)], input=dot.encode(),
                   check=True, timeout=120)
    return path
