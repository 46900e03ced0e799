"""Typer command functions, one module per command; autopar.cli registers them."""

from __future__ import annotations

from ...machine.presets import PRESETS
from ...schedule.place import POLICIES


def preset_names() -> str:
    """Every machine preset's name, for help texts (the registry is
    :data:`autopar.machine.presets.PRESETS`)."""
    return ", ".join(PRESETS)


def policy_names() -> str:
    """Every placement policy's name, for help texts."""
    return ", ".join(POLICIES)
