"""Human-readable durations and sizes, one spelling everywhere (reports, notes, tables)."""

from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_seconds"]


def fmt_seconds(seconds: float | None, missing: str = "-") -> str:
    """``1.23 s``, ``45.6 ms``, ``7.4 µs``, ``120 ns``; ``missing`` for None."""
    if seconds is None:
        return missing
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    if seconds >= 1e-6 or seconds == 0:
        return f"{seconds * 1e6:.3g} µs"
    return f"{seconds * 1e9:.3g} ns"


def fmt_bytes(n: float) -> str:
    """``64 MB``, ``4.1 kB``, ``12 B`` (powers of ten, as link bandwidths are quoted)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"
