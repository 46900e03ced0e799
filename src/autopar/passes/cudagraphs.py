"""Whether replaying a GPU segment as a CUDA graph pays (the mechanism is
:mod:`autopar.runtime.cudagraphs`).

Policy: a replay costs about one launch, plus one copy per input that is not already a static
buffer and one clone per escaping output; with ``"auto"`` a segment is captured when its launches
are at least twice that. ``True`` captures every capturable segment; ``False`` none.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

__all__ = ["capture_rule", "pays"]


def pays(mode: bool | str, n_launches: int, n_copies: int, n_clones: int) -> bool:
    """Is capturing worth it? (see the module docstring)."""
    if mode is False or n_launches == 0:
        return False
    if mode is True:
        return True
    return n_launches >= 2 * (1 + n_copies + n_clones)


def capture_rule(mode: bool | str) -> Callable[[int, int, int], bool] | None:
    """The executor's ``cuda_graphs``: ``pays`` under ``mode`` (``autopar.compile``'s
    ``cuda_graphs`` option), or None for ``False``."""
    return None if mode is False else partial(pays, mode)
