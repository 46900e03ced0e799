"""Timeline: what ran where and when. The simulator and the real executor both produce it.

A :class:`Timeline` is a flat list of :class:`Span`, each on one *lane*. Lanes are named
``"<device>"`` for a CPU worker (``"cpu:0"``) and ``"<device>/<stream>"`` for a GPU stream
(``"cuda:0/compute"``, ``"cuda:0/d2h"``, ``"cuda:0/h2d"``, ``"cuda:1/peer"``); a simulated
timeline puts every copy from the host on ``"cpu/h2d"`` (see :mod:`autopar.ir.routing`). Times
are seconds from the start of the run. Views (Chrome trace, Gantt PNG) read Timelines and
never change them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Span:
    lane: str
    name: str
    start: float
    end: float
    kind: str = "op"  # "op" | "copy" | "wait" | "sync"
    node: int | None = None  # Node.id of the op, or of the value a copy moves
    bytes: int = 0
    src: str | None = None  # copies: source and destination devices
    dst: str | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    spans: list[Span] = field(default_factory=list)
    source: str = "simulated"  # "simulated" | "measured"
    label: str = ""

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.spans), default=0.0) - min(
            (s.start for s in self.spans), default=0.0)

    def lanes(self) -> list[str]:
        return sorted({s.lane for s in self.spans})

    def busy(self, lane: str) -> float:
        return sum(s.duration for s in self.spans if s.lane == lane)

    def on(self, lane: str) -> list[Span]:
        return sorted((s for s in self.spans if s.lane == lane), key=lambda s: s.start)
