"""What the doctor reports: findings per source line, the report, and the fix for each hazard.

A :class:`Finding` is one hazard at one source line; a :class:`DoctorReport` is the findings of
one watched function with its measured time per call, as text or JSON (round-trips). ``FIXES``
holds the advice for each (kind, subkind). :mod:`autopar.doctor` does the watching.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ..ir.units import fmt_seconds

__all__ = ["FIXES", "DoctorError", "DoctorReport", "Finding", "fmt_count", "short_path"]

class DoctorError(ValueError):
    """The doctor was asked something it can't do: a missing function, a GPU the (simulated)
    machine lacks, a file without example inputs. The message says what to pass instead."""


class UserCodeError(DoctorError):
    """The user's function raised while watched; the message is its error, at its line (the
    CLI's exit code 1: the run failed, it was not misused)."""


# -- findings and the report -----------------------------------------------------------------
@dataclass(frozen=True)
class Finding:
    """One hazard at one source line: how often per call, what it costs, how to fix it."""

    kind: str  # sync | pageable-copy | ping-pong | host-data | gpu-scalar | tiny-gpu-op
    subkind: str  # for sync: item, branch, index, slice-bound, ...; else ""
    file: str
    line: int
    function: str
    code: str  # the source line, stripped
    count: float  # occurrences per call
    cost_s: float  # per call
    cost_source: str  # "measured" | "estimated" | "measured+estimated"
    saving_s: float  # estimated, per call
    fix: str
    message: str
    ops: tuple[str, ...] = ()
    device: str = ""

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.subkind}" if self.subkind else self.kind


@dataclass
class DoctorReport:
    """What ``doctor`` found in one function; ``to_text()`` and ``to_json()`` render it."""

    target: str  # the function's qualified name
    source: str  # "file:line" of its definition ("" when unknown)
    machine: str
    simulated: bool
    calls: int  # watched calls
    time_per_call_s: float  # median of the timed calls
    time_note: str  # what the measured time is
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def saving_s(self) -> float:
        """Estimated time saved per call if every finding were fixed."""
        return sum(f.saving_s for f in self.findings)

    def select(self, kind: str | None = None, subkind: str | None = None,
               line: int | None = None) -> list[Finding]:
        """The findings of a kind (and sub-kind, and line), in report order."""
        return [f for f in self.findings
                if (kind is None or f.kind == kind) and (subkind is None or f.subkind == subkind)
                and (line is None or f.line == line)]

    # -- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["format"] = "autopar-doctor"
        d["findings"] = [{**asdict(f), "ops": list(f.ops)} for f in self.findings]
        return d

    @staticmethod
    def from_dict(data: dict[str, Any]) -> DoctorReport:
        if not isinstance(data, dict) or data.get("format") != "autopar-doctor":
            raise ValueError("not an autopar doctor report (no \"format\": \"autopar-doctor\")")
        fields = {k: v for k, v in data.items() if k not in ("format", "findings")}
        findings = [Finding(**{**f, "ops": tuple(f.get("ops", ()))}) for f in data["findings"]]
        return DoctorReport(**fields, findings=findings)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @staticmethod
    def from_json(text: str) -> DoctorReport:
        return DoctorReport.from_dict(json.loads(text))

    # -- text ----------------------------------------------------------------------------
    def to_text(self) -> str:
        where = f"  ({short_path(self.source)})" if self.source else ""
        lines = [f"autopar doctor: {self.target}{where}",
                 f"machine {self.machine}" + ("  [simulated]" if self.simulated else ""),
                 f"{self.calls} watched call{'s' if self.calls != 1 else ''}; "
                 f"{fmt_seconds(self.time_per_call_s)} per call ({self.time_note})"]
        if self.findings:
            n = len(self.findings)
            lines.append(f"{n} finding{'s' if n > 1 else ''}; fixing "
                         f"{'them all' if n > 1 else 'it'} saves about "
                         f"{fmt_seconds(self.saving_s)} per call (estimated)")
        else:
            lines.append("no hazards found")
        for note in self.notes:
            lines.append(f"note: {note}")
        for i, f in enumerate(self.findings, 1):
            lines += [
                "",
                f"[{i}] {f.label} at {short_path(f.file)}:{f.line} in {f.function}, "
                f"{fmt_count(f.count)} per call",
            ]
            if f.code:
                lines.append(f"      {f.code}")
            lines += [
                f"    {f.message}",
                f"    cost {fmt_seconds(f.cost_s)} per call ({f.cost_source}); "
                f"saves about {fmt_seconds(f.saving_s)} per call",
                f"    fix: {f.fix}",
            ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()




def fmt_count(n: float) -> str:
    return f"{int(n)}x" if float(n).is_integer() else f"{n:.2g}x"


def short_path(path: str) -> str:
    """``path`` relative to the working directory when it lies under it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


# -- fixes -----------------------------------------------------------------------------------
FIXES: dict[tuple[str, str], str] = {
    ("sync", "item"): (
        "keep the value on the GPU and use it as a tensor in later ops, or read it once "
        "outside the hot path: every read waits for all queued GPU work"),
    ("sync", "branch"): (
        "don't branch on a GPU value: compute both sides and pick with torch.where, or decide "
        "from host-side values"),
    ("sync", "index"): (
        "use a Python int as the index, or let the GPU do the lookup (index_select, gather)"),
    ("sync", "slice-bound"): (
        "slice with Python ints: make the bounds ints where they are created (int(r0) once, "
        "outside the hot path); a 0-dim GPU bound is read back on every slice"),
    ("sync", "nonzero"): (
        "nonzero has a data-dependent shape, so the host waits for the count: use "
        "torch.nonzero_static(x, size=k) when a bound is known, or keep a mask with torch.where"),
    ("sync", "bool-mask"): (
        "x[mask] has a data-dependent shape: keep the shape with torch.where(mask, x, 0) (or "
        "x * mask) and reduce afterwards"),
    ("sync", "unique"): (
        "unique has a data-dependent shape: move it out of the hot path or give it a fixed-size "
        "result"),
    ("sync", "print"): (
        "printing a GPU tensor copies it to the host and waits: print outside the hot path or "
        "less often"),
    ("sync", "pageable-nonblocking"): (
        "non_blocking=True into pageable memory still blocks: copy into a pinned buffer "
        "(torch.empty(..., pin_memory=True), buf.copy_(x, non_blocking=True)) on a side stream, "
        "or let autopar.compile place the copies"),
    ("pageable-copy", ""): (
        "copy into pinned host buffers with non_blocking=True (torch.empty(..., "
        "pin_memory=True)), on a side stream so copies overlap compute, or let "
        "autopar.compile place them"),
    ("ping-pong", ""): (
        "keep using the value where it already was: nothing is computed between the two copies"),
    ("host-data", ""): (
        "make it once, outside the function (a module buffer, or an argument already on the "
        "GPU), or keep it a Python number: torch.tensor(...) on a GPU copies from the host and "
        "waits, at every call"),
    ("gpu-scalar", ""): (
        "keep the scalar a Python number (or a 0-dim CPU tensor): it then rides in the kernel's "
        "arguments, and scalar-only math like a ** 2 runs on the host without a kernel launch"),
    ("tiny-gpu-op", ""): (
        "too small for the GPU: keep tensors this small on the host (the op runs there sooner, "
        "launch overhead dominates on the GPU), or let autopar.compile place it"),
}
