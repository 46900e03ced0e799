"""Options of ``autopar.compile`` and ``autopar.data_parallel``, validated before anything
is traced.

Policy
- An unknown option, a malformed device string or a device this machine doesn't have raises
  at once, with a message that says what was wrong and what to write instead.
- ``devices="auto"`` means every GPU of this machine plus the host as one CPU worker
  (``cpu:0``). Logical CPU workers (``cpu:0,cpu:1``) are asked for by name: they share the
  host's intra-op threads (autopar sets no thread count: in PyTorch that is process-wide
  state, inherited by every thread started later), so a second one pays only where ops leave
  cores idle.
- ``candidates`` (else ``$AUTOPAR_CANDIDATES``) names the ways the measured choice may keep;
  ``trace`` set makes every call autopar's (the timelines are of its plans).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, TypedDict

from .choose import WAYS
from .machine.detect import check_machine
from .machine.model import Machine, parse_devices
from .schedule.place import POLICIES

__all__ = ["GUARDS", "CompileOptions", "Options"]


GUARDS = ("all", "arguments")


class CompileOptions(TypedDict, total=False):
    """The keyword options of :func:`compile` and :func:`data_parallel` (and the ``options=``
    of ``torch.compile(fn, backend="autopar")``), each optional; :class:`Options` checks them
    and holds their defaults."""

    devices: str | Sequence[str]  #: "auto", "cpu:0,cpu:1", ["cuda:0", "cuda:1"]
    policy: Literal["heft", "single", "round_robin"]
    machine: Machine | str | None  #: None or "auto": this host; a preset's name; a Machine
    trace: bool | str | os.PathLike  #: True: timelines; a path: a Chrome trace too
    fuse: bool | Literal["auto"]
    cuda_graphs: bool | Literal["auto"]
    candidates: str | Sequence[str]  #: "auto" or ways: eager, inductor, autopar, ...
    guards: Literal["all", "arguments"]


@dataclass(frozen=True)
class Options:
    """Validated options of :func:`compile` (and of ``torch.compile(..., options=...)``)."""

    devices: tuple[str, ...] = ()
    policy: str = "heft"
    machine: Any = None  # None: this machine (calibrated or defaults); or a Machine
    trace: bool | str = False  # True: record timelines; a path: also write a Chrome trace there
    fuse: bool | str = "auto"  # Inductor fuses each device's regions: "auto" on GPUs, True: all
    cuda_graphs: bool | str = "auto"  # replay GPU segments as CUDA graphs (static shapes)
    candidates: tuple[str, ...] = WAYS  # the ways the measured choice may keep
    guards: str = "all"  # "arguments": learned calls skip dynamo (autopar.capture.direct)

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
        trace = options.get("trace", os.environ.get("AUTOPAR_TRACE") or False)
        if not isinstance(trace, bool | str | os.PathLike):
            raise TypeError(f"trace must be True, False or a file path, not {type(trace).__name__}")
        if isinstance(trace, str | os.PathLike) and \
                not os.path.isdir(os.path.dirname(os.path.abspath(trace))):
            raise ValueError(f"trace={os.fspath(trace)!r}: its folder does not exist")
        machine = options.get("machine")
        check_machine(machine)
        fuse = _tristate(options, "fuse")
        cuda_graphs = _tristate(options, "cuda_graphs")
        guards = options.get("guards", "all")
        if guards not in GUARDS:
            raise ValueError(f"guards must be {' or '.join(map(repr, GUARDS))}, not {guards!r}")
        candidates = _candidates("candidates", options["candidates"]) \
            if "candidates" in options else \
            _candidates("AUTOPAR_CANDIDATES", os.environ.get("AUTOPAR_CANDIDATES", "auto"))
        if trace:  # timelines are of autopar's plans: every call is autopar's
            candidates = ("autopar",)
        return Options(devices=devices, policy=policy, machine=machine,
                       trace=os.fspath(trace) if isinstance(trace, os.PathLike) else trace,
                       fuse=fuse, cuda_graphs=cuda_graphs, candidates=candidates,
                       guards=guards)


def _candidates(name: str, value: Any) -> tuple[str, ...]:
    """``value`` of the option (or environment variable) ``name``, as the ways it names."""
    if value == "auto":
        return WAYS
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    unknown = [v for v in items if v not in WAYS]
    if unknown or not items:
        raise ValueError(f"{name} must be 'auto' or some of {', '.join(WAYS)}, "
                         f"not {value!r}")
    return tuple(w for w in WAYS if w in items)


def _tristate(options: dict[str, Any], name: str) -> bool | str:
    value = options.get(name, "auto")
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"{name} must be 'auto', True or False, not {value!r}")
