"""The placed graph as a picture: DOT text always, SVG/PNG when Graphviz's ``dot`` is installed.

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

__all__ = ["render", "to_dot"]

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


def to_dot(placement: Placement, critical: list[Node] = (), max_nodes: int = 80) -> str:
    """DOT source of the placed graph (see the module docstring)."""
    graph = placement.graph
    devices = sorted({placement.device[n] for n in graph.nodes})
    group = _groups(placement, max_nodes)
    members: dict[int, list[Node]] = {}
    for n in graph.nodes:
        members.setdefault(group[n], []).append(n)
    on_path = {group[n] for n in critical}
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
    edges: dict[tuple[int, int], int] = {}
    for n in graph.nodes:
        for i in n.inputs:
            a, b = group[i], group[n]
            if a == b:
                continue
            moved = (sum(m.nbytes for m in i.tensor_metas)
                     if placement.device[i] != placement.device[n] else -1)
            edges[(a, b)] = max(edges.get((a, b), -1), moved)
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




def render(placement: Placement, path: str | Path, critical: list[Node] = (),
           max_nodes: int = 80) -> Path:
    """Write the picture: ``.dot`` always; ``.svg``/``.png`` through Graphviz when installed.

    Returns the path written (the ``.dot`` file when Graphviz is missing for an image suffix).
    """
    path = Path(path)
    dot = to_dot(placement, critical, max_nodes)
    if path.suffix not in (".svg", ".png"):
        path.write_text(dot)
        return path
    exe = shutil.which("dot")
    if exe is None:
        fallback = path.with_suffix(".dot")
        fallback.write_text(dot)
        return fallback
    subprocess.run([exe, f"-T{path.suffix[1:]}", "-o", str(path)], input=dot.encode(),
                   check=True, timeout=120)
    return path
