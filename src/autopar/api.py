"""The front door: ``autopar.compile(fn, **options)`` and option validation.

Policy
- Options are validated eagerly, before anything is traced: an unknown option, a malformed device
  string or a device this machine doesn't have raises at ``autopar.compile`` time with a message
  that says what was wrong and what to write instead.
- ``devices="auto"`` means every GPU of this machine plus the host; a CPU-only machine gets two
  logical CPU workers (``cpu:0``, ``cpu:1``) when it has at least two cores.
- The compiled callable is ``torch.compile(fn, backend=<autopar>, dynamic=False)``: every graph
  dynamo captures goes through :func:`make_runner` (place, plan, run); anything autopar can't
  represent runs eagerly for that graph (see :mod:`autopar.capture`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from .graph import Graph

__all__ = ["Options", "compile", "parse_devices"]

POLICIES = ("heft", "single", "round_robin")
_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
MAX_CPU_WORKERS = 64


def _cpu_workers_default() -> int:
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def parse_devices(devices: str | Sequence[str] | None) -> tuple[str, ...]:
    """Normalize a device spec to a tuple of autopar device names, checking they exist.

    Accepts "auto", a comma-separated string ("cuda:0,cuda:1", "cpu:0, cpu:1") or a list.
    "cpu" means cpu:0 and "cuda" means cuda:0.
    """
    if devices is None or devices == "auto":
        gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        cpus = [f"cpu:{i}" for i in range(1 if gpus else _cpu_workers_default())]
        return tuple(cpus + gpus)
    if isinstance(devices, str):
        items = [d.strip() for d in devices.split(",") if d.strip()]
    elif isinstance(devices, Sequence):
        items = [str(d).strip() for d in devices]
    else:
        raise TypeError(
            f"devices must be 'auto', a comma-separated string or a list of device names, "
            f"not {type(devices).__name__}")
    if not items:
        raise ValueError("devices is empty: name at least one device, e.g. devices='cpu:0'")
    out: list[str] = []
    n_gpus = torch.cuda.device_count()
    for item in items:
        m = _DEVICE.match(item)
        if m is None:
            raise ValueError(
                f"malformed device {item!r}: write 'cpu:N' (a logical CPU worker) or 'cuda:N', "
                "e.g. devices=['cpu:0', 'cuda:0']")
        kind, index = m.group(1), int(m.group(2) or 0)
        if kind == "cuda" and index >= n_gpus:
            have = ", ".join(f"cuda:{i}" for i in range(n_gpus)) or "no CUDA devices"
            raise ValueError(f"device {item!r} does not exist: this machine has {have}")
        if kind == "cpu" and index >= MAX_CPU_WORKERS:
            raise ValueError(f"device {item!r}: at most {MAX_CPU_WORKERS} logical CPU workers")
        name = f"{kind}:{index}"
        if name in out:
            raise ValueError(f"device {name!r} is named twice in devices={devices!r}")
        out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class Options:
    """Validated options of :func:`compile` (and of ``torch.compile(..., options=...)``)."""

    devices: tuple[str, ...] = ()
    policy: str = "heft"
    machine: Any = None  # None: this machine (calibrated or defaults); or a preset name

    @staticmethod
    def parse(options: dict[str, Any]) -> Options:
        known = {f.name for f in fields(Options)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown autopar option(s) {', '.join(map(repr, unknown))}; "
                f"valid options are: {', '.join(sorted(known))}")
        policy = options.get("policy", "heft")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        devices = parse_devices(options.get("devices", "auto"))
        return Options(devices=devices, policy=policy, machine=options.get("machine"))


def make_runner(options: Options) -> Callable[[Graph, str], Callable]:
    """The GraphRunner for these options: (graph, phase) -> run(args) -> outputs."""
    from .runtime import SequentialRunner

    def build(graph: Graph, phase: str) -> Callable:
        return SequentialRunner(graph)

    return build


def compile(fn: Callable, **options: Any) -> Callable:
    """Compile ``fn`` (a function or ``nn.Module``) to run with autopar.

    Options: ``devices`` ("auto", "cpu:0,cpu:1", ["cuda:0", "cuda:1"]), ``policy`` ("heft",
    "single", "round_robin"), ``machine`` (None for this machine, or a preset name).
    """
    if not callable(fn):
        raise TypeError(
            f"autopar.compile expects a function or nn.Module, got {type(fn).__name__}")
    from .capture import make_backend

    opts = Options.parse(options)
    return torch.compile(fn, backend=make_backend(make_runner(opts)), dynamic=False)
