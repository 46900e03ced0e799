"""The machine model: which devices there are, and how fast each one and each link is.

Everything autopar decides rests on predicted time; this module holds the numbers the cost model
reads. Nothing here measures (that is :mod:`autopar.machine.calibrate`), looks at this host
(:mod:`autopar.machine.host`, :mod:`autopar.machine.detect`) or costs an op (that is
:mod:`autopar.cost.model`).

Glossary
- :class:`Device`: one place ops run. ``"cpu:N"`` is a *logical CPU worker*: the host's cores are
  split between ``cpu_workers`` workers so independent branches can run side by side, also on a
  machine without GPUs. ``"cuda:N"`` is one GPU.
- :class:`Profile`: the calibrated numbers of one machine. One :class:`DeviceProfile` for the host
  (key ``"cpu"``, shared by every CPU worker) and one per GPU (key ``"cuda:N"``); one
  :class:`LinkProfile` per directed link (keys from :func:`link_key`); the host-sync, event-wait and
  view costs. Versioned JSON (``SCHEMA_VERSION``), never pickle, keyed by the host fingerprint.
- fingerprint: a hash of what makes numbers differ between hosts (CPU model, cores, GPU models,
  driver, torch and CUDA versions). A profile whose fingerprint differs is foreign.
- :class:`Machine`: devices + profile + which GPU pairs have peer access. From :func:`detect` (this
  host), :func:`preset` (machines not at hand, for simulation and tests) or :func:`load_machine`.

Policy and invariants
- Rates are curves, not single numbers: achieved FLOP/s grows with the size of a matmul, achieved
  bandwidth with the size of an array, and pageable copies slow down when they get large. A curve
  is a few measured ``(size, rate)`` points, interpolated log-log and clamped at its ends. Curves
  are normalised on construction so that predicted *time* never decreases with size: a point
  slower than a bigger job is lowered to it (interference only ever slows a measurement down);
  and an all-thread point more than ``DISTURBED`` times slower than the one-thread curve at
  its size is raised to it (threads cost a small job up to ~2x; a 2-core VM's profile
  calibrated beside another process had float32 matmuls at 22 MFLOP/s with all threads and
  65 GFLOP/s with one, at the same size: every small addmm priced 23.7 ms).
- CPU worker threads: the host is measured with all of torch's threads (``threads``) and with
  one. A worker is assumed to own ``Machine.cpu_threads = max(1, threads // cpu_workers)`` of
  them; its times follow Amdahl's law through the two measurements (a profile without one-thread
  curves, like the smaller presets and the defaults, scales by the worker's share of threads).
  The runtime sets no thread count (process-wide in PyTorch): workers running at once share the
  cores, which this share models. With ``cpu_workers=1`` a worker gets the whole host, the
  configuration MEASURED.md's CPU figures were taken in.
- Loading never crashes a run: a missing, corrupt, truncated or foreign profile file is reported
  (``warnings.warn``) and replaced, by a quick calibration or, when measuring is off (argument
  ``measure=False`` or ``AUTOPAR_NO_MEASURE=1``), by conservative defaults. A defaults profile is
  recalibrated the next time measuring is allowed.
- Cache directory: ``$AUTOPAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopar``, else
  ``~/.cache/autopar``. Files: ``profile-<fingerprint>.json``, ``history-<fingerprint>.json``.
- Importing this module, building a preset or reading a profile never measures anything.
- ``torch.cuda`` is touched only in discovery (:func:`detect`), always behind
  ``torch.cuda.is_available()``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CURVES",
    "SCHEMA_VERSION",
    "Device",
    "DeviceProfile",
    "LinkProfile",
    "Machine",
    "Profile",
    "ProfileError",
    "check_envelope",
    "default_cpu_workers",
    "default_profile",
    "fingerprint_of",
    "link_key",
    "parse_devices",
]

SCHEMA_VERSION = 3
"""Version of the profile JSON: a file with another version is foreign and replaced (the host is
measured again). 2: the host's ``read``, ``write`` and ``exp`` curves are measured as a
program meets memory (:data:`autopar.machine.calibrate.STREAM_BYTES`); a profile of 1 prices
the host's memory-bound ops 1.3-4x too cheap. 3: the host's ``write`` less ``full``'s own cost
(a profile of 2 adds that cost, ~1.5 us, to every op's output)."""
CROSSING_S = 25e-6
"""Executor cost of one host<->GPU copy beyond the link's time: staging in pinned memory, the
CUDA event and the host's wait. The host and its GPU partner share one thread
(:mod:`autopar.runtime.interleave`), for which this is the predicted figure; between two threads
a crossing cost several times more (measured: see benchmarks/NOTES.md). Profiles without the
key take this value."""

_FORMAT = "autopar-profile"

Curve = tuple[tuple[float, float], ...]
"""Measured ``(size, rate)`` points, sorted by size: FLOPs -> FLOP/s, or bytes -> bytes/s."""


def check_envelope(data: Any, what: str, fmt: str, version: int, fingerprint: str | None,
                   error: type[ValueError] = ValueError) -> None:
    """Refuse a JSON file that is not ours (``format``), of another schema ``version``, or, when
    ``fingerprint`` is given, of another host; the message says which."""
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise error(f"not an autopar {what} (no \"format\": \"{fmt}\")")
    if data.get("version") != version:
        raise error(f"{what} schema version {data.get('version')!r}, this autopar reads "
                    f"version {version}")
    if fingerprint is not None and data.get("fingerprint") != fingerprint:
        raise error(f"{what} of another host (fingerprint {data.get('fingerprint')!r}, this "
                    f"host is {fingerprint!r})")


class ProfileError(ValueError):
    """A profile file or dict is unusable: corrupt, truncated, foreign, or of another version."""


# -- devices ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Device:
    """One place ops can run. ``name`` is ``"cpu:N"`` (a logical host worker) or ``"cuda:N"``."""

    name: str
    kind: str  # "cpu" | "cuda"
    index: int

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.name)

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return self.name


# -- curves ----------------------------------------------------------------------------------
DISTURBED = 10.0
"""An all-thread rate this many times below the one-thread rate at the same size was measured
while something else held the cores (see the module docstring)."""


def _normalise_curve(points: Iterable[Sequence[float]]) -> Curve:
    """Sort, drop unusable points, and make time (size / rate) non-decreasing in size.

    A point whose time exceeds that of a bigger job is lowered to it, not the bigger job raised:
    interference (another process, a descheduled thread) only ever makes a measurement slower,
    so of two contradicting points the slower one is the wrong one.
    """
    clean = sorted((float(x), float(r)) for x, r in points
                   if x > 0 and r > 0 and math.isfinite(x) and math.isfinite(r))
    out: list[tuple[float, float]] = []
    for x, r in reversed(clean):
        if out and x == out[-1][0]:
            continue
        if out:
            nx, nr = out[-1]
            r = max(r, nr * x / nx)  # no slower than the next bigger job
        out.append((x, r))
    return tuple(reversed(out))


def _curve_at(curve: Curve, x: float) -> float:
    """The curve's rate at size ``x``: log-log interpolation, clamped at both ends."""
    if x <= curve[0][0]:
        return curve[0][1]
    if x >= curve[-1][0]:
        return curve[-1][1]
    i = bisect.bisect_right([p[0] for p in curve], x)
    (x0, r0), (x1, r1) = curve[i - 1], curve[i]
    w = math.log(x / x0) / math.log(x1 / x0)
    return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))


def _floored(curve: Curve, x: float) -> float:
    """Seconds of an op of size ``x`` on ``curve``; below its smallest measured size, that
    size's time: an op's fixed cost stays (a 3x3 convolution of 0.02 MFLOP took 46-128 us on
    the 2-core VM, where the rate of the smallest one measured gave 5 us)."""
    return max(x, curve[0][0]) / _curve_at(curve, x)


# -- profiles --------------------------------------------------------------------------------
CURVES = ("matmul", "read", "write", "exp", "conv")
"""Curve names of a DeviceProfile: float32 matmul FLOPs -> FLOP/s; bytes read -> bytes/s (an op
reading that much, like ``sum``); bytes written -> bytes/s (the output of ``add``, its reads
apart; on the host this includes the first-touch page faults of fresh output memory); elements
-> elements/s of ``exp``, the compute of transcendental pointwise ops; float32 convolution FLOPs
-> FLOP/s (a profile without it prices convolutions by ``matmul``). Each may also be given
measured with one thread, as ``"<name>@1t"``."""


@dataclass(frozen=True)
class DeviceProfile:
    """Calibrated speed of one device (the host, or one GPU).

    ``launch_s``: host time to issue one op (GPU: one kernel launch; CPU: eager dispatch overhead);
    ``launch_by_kind`` overrides it per op kind (cuBLAS and cuDNN calls cost more host time than
    an elementwise kernel). ``min_kernel_s``: the least time an op occupies the device.
    ``flops``: achievable FLOP/s per dtype name (``float32``, ``tf32``, ``float16``, ``bfloat16``,
    ``float64``); the float32 entry tops the ``"matmul"`` curve, which other dtypes scale.
    ``mem_bw``: achievable read bandwidth of a large array, bytes/s (the curves' fallback).
    ``memory_bytes``: usable memory. ``curves``: see :data:`CURVES`. ``threads``: host threads the
    curves were measured with (CPU only).
    """

    kind: str
    model: str
    launch_s: float
    min_kernel_s: float
    flops: Mapping[str, float]
    mem_bw: float
    memory_bytes: int
    curves: Mapping[str, Curve] = field(default_factory=dict)
    launch_by_kind: Mapping[str, float] = field(default_factory=dict)
    threads: int = 0
    sm_count: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "flops", dict(self.flops))
        object.__setattr__(self, "launch_by_kind", dict(self.launch_by_kind))
        curves = {k: _normalise_curve(v) for k, v in sorted(self.curves.items()) if v}
        for name, points in curves.items():  # all threads: never far slower than one
            one = curves.get(f"{name}@1t")
            if one and not name.endswith("@1t"):
                alone = [_curve_at(one, x) for x, _ in points]
                curves[name] = _normalise_curve((x, r1 if r * DISTURBED < r1 else r)
                                                for (x, r), r1 in zip(points, alone))
        object.__setattr__(self, "curves", curves)

    def launch(self, kind: str) -> float:
        """Host time to issue one op of ``kind`` (an :func:`autopar.ir.graph.op_kind` family)."""
        return self.launch_by_kind.get(kind, self.launch_s)

    def compute_time(self, dtype: str, flops: float, threads: int = 0,
                     curve: str = "matmul") -> float:
        """Seconds of ``flops`` FLOPs in ``dtype`` (a dtype name) with ``threads`` threads (0:
        as measured), on ``curve`` (``"conv"`` for convolutions, where measured) scaled by
        the dtype's matmul rate. A dtype never measured (integers, complex) gets the slowest
        known rate."""
        peak = self.flops.get(dtype, min(self.flops.values()))
        fp32 = self.flops.get("float32", peak)
        if curve not in self.curves:
            curve = "matmul"
        return self._time(curve, flops, fp32, threads) * fp32 / peak

    def read_time(self, nbytes: float, threads: int = 0) -> float:
        return self._time("read", nbytes, self.mem_bw, threads)

    def write_time(self, nbytes: float, threads: int = 0) -> float:
        if "write" not in self.curves:  # nothing measured: a byte written costs a byte read
            return self.read_time(nbytes, threads)
        return self._time("write", nbytes, self.mem_bw, threads)

    def transcendental_time(self, elements: float, threads: int = 0) -> float:
        """Compute time of ``exp``-like work on ``elements`` elements (0 if never measured)."""
        if "exp" not in self.curves:
            return 0.0
        return self._time("exp", elements, 1.0, threads)

    def _time(self, curve: str, size: float, flat_rate: float, threads: int) -> float:
        """``size`` over the curve's rate; for a worker with fewer threads than measured, by
        Amdahl's law through the all-thread and one-thread times (``t = (1 - c) t1 + c tT``,
        ``c = T (t - 1) / (t (T - 1))``), or, without a one-thread curve, the linear share.
        Both keep time non-decreasing in size."""
        points = self.curves.get(curve)
        full = _floored(points, size) if points else size / flat_rate
        if not threads or not self.threads or threads >= self.threads:
            return full
        one_points = self.curves.get(f"{curve}@1t")
        if not one_points:
            return full * self.threads / threads
        one = _floored(one_points, size)
        total = self.threads
        c = total * (threads - 1) / (threads * (total - 1))
        return (1 - c) * one + c * full


@dataclass(frozen=True)
class LinkProfile:
    """One directed link: ``time(n) = latency_s + n / bandwidth``, or, where ``samples`` (measured
    ``(nbytes, seconds)``) cover ``n``, their linear interpolation (a copy is a fixed cost plus a
    per-byte cost, whose rate may change between samples); past the largest sample the time
    grows at ``bandwidth``."""

    latency_s: float
    bandwidth: float
    samples: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        pts = sorted((float(n), float(t)) for n, t in self.samples if n > 0 and t > 0)
        mono: list[tuple[float, float]] = []
        for n, t in reversed(pts):  # as for curves: a slow outlier is lowered to its successor
            if mono and n == mono[-1][0]:
                continue
            mono.append((n, min(t, mono[-1][1]) if mono else t))
        object.__setattr__(self, "samples", tuple(reversed(mono)))

    def time(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        linear = self.latency_s + nbytes / self.bandwidth
        s = self.samples
        if not s:
            return linear
        if nbytes <= s[0][0]:
            return min(linear, s[0][1])
        if nbytes >= s[-1][0]:
            return s[-1][1] + (nbytes - s[-1][0]) / self.bandwidth
        i = bisect.bisect_right([p[0] for p in s], nbytes)
        (n0, t0), (n1, t1) = s[i - 1], s[i]
        return t0 + (t1 - t0) * (nbytes - n0) / (n1 - n0)


def link_key(src: str, dst: str, pinned: bool = True) -> str:
    """Profile key of the link from device ``src`` to ``dst`` (CPU workers all share "cpu").

    ``"cpu->cuda:0/pinned"``, ``"cuda:0->cpu/pageable"``, ``"cuda:0->cuda:1"``.
    """
    a = "cpu" if src.startswith("cpu") else src
    b = "cpu" if dst.startswith("cpu") else dst
    if a == "cpu" and b == "cpu":
        raise ValueError(f"no link between host workers {src!r} and {dst!r}: they share memory")
    if "cpu" in (a, b):
        return f"{a}->{b}/{'pinned' if pinned else 'pageable'}"
    return f"{a}->{b}"


@dataclass(frozen=True)
class Profile:
    """Calibrated numbers of one machine (see the module docstring for keys and policy).

    ``host_sync_s``: host time of waiting for an idle device (a ``.item()`` costs one launch plus
    this). ``event_wait_s``: cost of ordering one queue after another (CUDA event record + wait;
    between CPU workers, a thread hand-off). ``view_s``: host time of a metadata-only op.
    ``crossing_s``: what one copy between the host and a GPU costs the executor beyond the
    link's own time (staging through pinned memory, the CUDA event, the host waiting for it and
    the worker thread waking): :data:`CROSSING_S` until calibration measures it per host.
    """

    fingerprint: str
    host: Mapping[str, Any]
    devices: Mapping[str, DeviceProfile]
    links: Mapping[str, LinkProfile]
    host_sync_s: float
    event_wait_s: float
    view_s: float = 1e-6
    crossing_s: float = CROSSING_S
    source: str = "defaults"  # "measured-quick" | "measured-full" | "preset:NAME" | "defaults"
    created: str = ""
    version: int = SCHEMA_VERSION
    # how trustworthy a measured profile is (autopar.machine.calibrate): "spread" (step ->
    # relative spread of its samples), "load" (load average per core before), "busy" (why the
    # host was judged busy, "" if not); empty for presets, defaults and older files
    quality: Mapping[str, Any] = field(default_factory=dict)

    @property
    def busy(self) -> str:
        """Why this profile was measured on a busy host ("" if it was not, or is not measured)."""
        return str(self.quality.get("busy", "") or "")

    def device(self, name: str) -> DeviceProfile:
        key = "cpu" if name.startswith("cpu") else name
        try:
            return self.devices[key]
        except KeyError:
            raise KeyError(f"profile {self.source!r} has no device {key!r} (has "
                           f"{sorted(self.devices)}); recalibrate with `autopar calibrate`"
                           ) from None

    def link(self, src: str, dst: str, pinned: bool = True) -> LinkProfile:
        key = link_key(src, dst, pinned)
        try:
            return self.links[key]
        except KeyError:
            raise KeyError(f"profile {self.source!r} has no link {key!r}; recalibrate with "
                           "`autopar calibrate`") from None

    @property
    def is_defaults(self) -> bool:
        return self.source == "defaults"

    def check(self, gpus: Sequence[str]) -> None:
        """Raise :class:`ProfileError` unless every device and link of a host with ``gpus``
        (names ``"cuda:N"``) has its numbers."""
        missing = [g for g in ["cpu", *gpus] if g not in self.devices]
        missing += [key for a in gpus for key in (
            *(link_key(x, y, p) for p in (True, False) for x, y in (("cpu", a), (a, "cpu"))),
            *(link_key(a, b) for b in gpus if b != a)) if key not in self.links]
        if missing:
            raise ProfileError(f"profile {self.source!r} lacks {', '.join(missing)}")

    # -- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        def dev(d: DeviceProfile) -> dict[str, Any]:
            return {
                "kind": d.kind, "model": d.model, "launch_s": d.launch_s,
                "min_kernel_s": d.min_kernel_s, "launch_by_kind": dict(d.launch_by_kind),
                "flops": dict(d.flops), "mem_bw": d.mem_bw, "memory_bytes": d.memory_bytes,
                "threads": d.threads, "sm_count": d.sm_count,
                "curves": {k: [list(p) for p in c] for k, c in d.curves.items()},
            }

        def link(k: LinkProfile) -> dict[str, Any]:
            return {"latency_s": k.latency_s, "bandwidth": k.bandwidth,
                    "samples": [list(p) for p in k.samples]}

        return {
            "format": _FORMAT, "version": self.version, "fingerprint": self.fingerprint,
            "source": self.source, "created": self.created, "host": dict(self.host),
            "host_sync_s": self.host_sync_s, "event_wait_s": self.event_wait_s,
            "view_s": self.view_s, "crossing_s": self.crossing_s,
            "devices": {k: dev(v) for k, v in sorted(self.devices.items())},
            "links": {k: link(v) for k, v in sorted(self.links.items())},
            **({"quality": dict(self.quality)} if self.quality else {}),
        }

    @staticmethod
    def from_json(data: Any, fingerprint: str | None = None) -> Profile:
        """Parse and validate; raise :class:`ProfileError` saying what is wrong.

        ``fingerprint``: when given, a profile of another host is refused as foreign.
        """
        check_envelope(data, "profile", _FORMAT, SCHEMA_VERSION, fingerprint, ProfileError)
        try:
            devices = {k: _device_from_json(v) for k, v in data["devices"].items()}
            links = {k: LinkProfile(_pos(v["latency_s"], "latency_s", zero_ok=True),
                                    _pos(v["bandwidth"], "bandwidth"),
                                    tuple(tuple(p) for p in v.get("samples", ())))
                     for k, v in data["links"].items()}
            profile = Profile(
                fingerprint=str(data["fingerprint"]), host=dict(data["host"]), devices=devices,
                links=links, host_sync_s=_pos(data["host_sync_s"], "host_sync_s", zero_ok=True),
                event_wait_s=_pos(data["event_wait_s"], "event_wait_s", zero_ok=True),
                view_s=_pos(data.get("view_s", 1e-6), "view_s", zero_ok=True),
                crossing_s=_pos(data.get("crossing_s", CROSSING_S), "crossing_s", zero_ok=True),
                source=str(data["source"]), created=str(data.get("created", "")),
                quality=dict(data.get("quality") or {}),
            )
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProfileError(f"malformed profile: {type(e).__name__}: {e}") from None
        if "cpu" not in profile.devices:
            raise ProfileError("malformed profile: no \"cpu\" device entry")
        return profile


def _pos(v: Any, what: str, zero_ok: bool = False) -> float:
    x = float(v)
    if not math.isfinite(x) or x < 0 or (x == 0 and not zero_ok):
        raise ProfileError(f"malformed profile: {what} = {v!r} must be a positive number")
    return x


def _device_from_json(v: dict[str, Any]) -> DeviceProfile:
    if v["kind"] not in ("cpu", "cuda"):
        raise ProfileError(f"malformed profile: device kind {v['kind']!r} is not cpu or cuda")
    flops = {str(k): _pos(r, f"flops[{k}]") for k, r in v["flops"].items()}
    if not flops:
        raise ProfileError("malformed profile: a device has no FLOP rates")
    return DeviceProfile(
        kind=v["kind"], model=str(v["model"]), launch_s=_pos(v["launch_s"], "launch_s", True),
        min_kernel_s=_pos(v["min_kernel_s"], "min_kernel_s", True), flops=flops,
        mem_bw=_pos(v["mem_bw"], "mem_bw"), memory_bytes=int(_pos(v["memory_bytes"], "memory")),
        curves={str(k): tuple((float(x), float(r)) for x, r in c)
                for k, c in v.get("curves", {}).items()},
        launch_by_kind={str(k): _pos(t, f"launch_by_kind[{k}]", True)
                        for k, t in v.get("launch_by_kind", {}).items()},
        threads=int(v.get("threads", 0)), sm_count=int(v.get("sm_count", 0)),
    )


# -- the machine -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    """Devices, their profile, and which GPU pairs have peer access.

    ``cores``: the threads the host computes with, shared by the CPU workers (0: the CPU
    profile's ``threads``). ``profile_path``: where this machine's profile lives (``None`` for
    presets: nothing of theirs is written to disk).
    Equal machines have the same name, devices, peer pairs and cores.
    """

    name: str
    devices: tuple[Device, ...]
    profile: Profile = field(default=None, compare=False)  # type: ignore[assignment]
    peer_pairs: frozenset[tuple[str, str]] = frozenset()
    cores: int = 0
    profile_path: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.profile is None:
            object.__setattr__(self, "profile", default_profile(
                {"cores": self.cores or 1}, [d.name for d in self.devices if d.is_gpu]))
        # peer access is symmetric: keep both orders so lookups need not sort
        object.__setattr__(self, "peer_pairs", frozenset(
            p for a, b in self.peer_pairs for p in ((a, b), (b, a))))
        if not self.cores:
            object.__setattr__(self, "cores", max(1, self.profile.device("cpu").threads))
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError(f"machine {self.name!r} lists a device twice: {names}")
        for d in self.devices:
            self.profile.device(d.name)  # raises a KeyError naming what is missing

    def device(self, name: str | Device) -> Device:
        if isinstance(name, Device):
            name = name.name
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(f"machine {self.name!r} has no device {name!r}; it has "
                       f"{[d.name for d in self.devices]}")

    def home(self, torch_device: str | torch.device) -> Device:
        """The machine device eager places a value on: "cpu" -> cpu:0, "cuda:1" -> cuda:1."""
        s = str(torch_device)
        if s.startswith("cpu"):
            return self.device("cpu:0")
        if s == "cuda":
            s = "cuda:0"
        return self.device(s)

    @property
    def cpus(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.is_cpu)

    @property
    def gpus(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.is_gpu)

    @property
    def cpu_workers(self) -> int:
        return len(self.cpus)

    @property
    def cpu_threads(self) -> int:
        """Threads each CPU worker is assumed to own (see the module docstring)."""
        return max(1, self.cores // max(1, self.cpu_workers))

    @property
    def fingerprint(self) -> str:
        return self.profile.fingerprint

    def has_peer(self, a: str, b: str) -> bool:
        return (a, b) in self.peer_pairs

    def __str__(self) -> str:
        gpus = ", ".join(f"{d.name} {self.profile.device(d.name).model}" for d in self.gpus)
        return (f"{self.name}: {self.cpu_workers} CPU workers x {self.cpu_threads} threads"
                + (f", {gpus}" if gpus else "") + f" [{self.profile.source}]")


MAX_CPU_WORKERS = 64
"""Logical CPU workers a device spec may name at most."""
_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def parse_devices(devices: str | Sequence[str] | None, gpus: int | None = None,
                  machine: str = "this machine") -> tuple[str, ...]:
    """Normalize a device spec to a tuple of autopar device names, checking they exist.

    Accepts "auto", a comma-separated string ("cuda:0,cuda:1", "cpu:0, cpu:1") or a list.
    "cpu" means cpu:0 and "cuda" means cuda:0. ``gpus``: the GPUs a ``cuda:N`` must be among
    (None: this host's; a preset's number where one is planned for), ``machine`` its name in
    errors. "auto" is cpu:0 and every GPU.
    """
    n_gpus = torch.cuda.device_count() if gpus is None else gpus
    if devices is None or devices == "auto":
        return ("cpu:0", *(f"cuda:{i}" for i in range(n_gpus)))
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
    for item in items:
        m = _DEVICE.match(item)
        if m is None:
            raise ValueError(
                f"malformed device {item!r}: write 'cpu:N' (a logical CPU worker) or 'cuda:N', "
                "e.g. devices=['cpu:0', 'cuda:0']")
        kind, index = m.group(1), int(m.group(2) or 0)
        if kind == "cuda" and index >= n_gpus:
            have = ", ".join(f"cuda:{i}" for i in range(n_gpus)) or "no CUDA devices"
            raise ValueError(f"device {item!r} does not exist: {machine} has {have}")
        if kind == "cpu" and index >= MAX_CPU_WORKERS:
            raise ValueError(f"device {item!r}: at most {MAX_CPU_WORKERS} logical CPU workers")
        name = f"{kind}:{index}"
        if name in out:
            raise ValueError(f"device {name!r} is named twice in devices={devices!r}")
        out.append(name)
    cpus = sorted(int(d[4:]) for d in out if d.startswith("cpu"))
    if cpus != list(range(len(cpus))):
        want = ",".join(f"cpu:{i}" for i in range(max(cpus) + 1))
        raise ValueError(
            f"devices={devices!r} skips a CPU worker: logical CPU workers are numbered from "
            f"cpu:0 up without gaps (write {want!r})")
    return tuple(out)


def _devices(cpu_workers: int, n_gpus: int) -> tuple[Device, ...]:
    if cpu_workers < 1:
        raise ValueError(f"cpu_workers={cpu_workers}: a machine needs at least one CPU worker")
    return tuple([Device(f"cpu:{i}", "cpu", i) for i in range(cpu_workers)]
                 + [Device(f"cuda:{i}", "cuda", i) for i in range(n_gpus)])


def default_cpu_workers(cores: int) -> int:
    """Logical CPU workers a machine model (a preset, a loaded profile) assumes when none is
    named: two from 4 cores up, else one. (``autopar.compile``'s ``devices="auto"`` names one.)

    On 2 cores, torch's intra-op threads already use both for any sizeable op, and two Python
    threads dispatching ATen ops measured 0.75x of eager on two independent branches
    (``benchmarks/cpu_branches.py``): a second worker does not pay there."""
    return 2 if cores >= 4 else 1


GiB = 1024**3


def _write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def fingerprint_of(host: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit hash of :func:`host_info`'s dict."""
    blob = json.dumps(dict(host), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# -- conservative defaults -------------------------------------------------------------------
def default_profile(host: Mapping[str, Any], gpus: Sequence[str] | Sequence[dict[str, Any]],
                    peer_pairs: Iterable[tuple[str, str]] = ()) -> Profile:
    """Numbers to plan with when nothing was measured: slow rather than fast, so that autopar
    moves work to a GPU only when that wins by a wide margin. ``gpus``: names ``"cuda:N"`` or
    the dicts of discovery (their memory is used)."""
    cores = int(host.get("cores", 1)) or 1
    devices = {"cpu": DeviceProfile(
        kind="cpu", model=str(host.get("cpu_model", "cpu")), launch_s=5e-6, min_kernel_s=5e-6,
        flops={"float32": 10e9 * cores, "float64": 5e9 * cores, "bfloat16": 2e9 * cores,
               "float16": 1e9 * cores},
        mem_bw=5e9 * min(cores, 8), memory_bytes=16 * GiB, threads=cores)}
    links: dict[str, LinkProfile] = {}
    names = [g if isinstance(g, str) else f"cuda:{i}" for i, g in enumerate(gpus)]
    peers = set(peer_pairs)
    for i, name in enumerate(names):
        g = gpus[i]
        mem = int(g["memory_bytes"] * 0.9) if isinstance(g, dict) else 16 * GiB
        model = g["name"] if isinstance(g, dict) else "gpu"
        devices[name] = DeviceProfile(
            kind="cuda", model=model, launch_s=10e-6, min_kernel_s=5e-6,
            launch_by_kind={"matmul": 20e-6},
            flops={"float32": 10e12, "tf32": 20e12, "float16": 50e12, "bfloat16": 50e12,
                   "float64": 1e12}, mem_bw=500e9, memory_bytes=mem)
        for pinned, bw in ((True, 10e9), (False, 2e9)):
            links[link_key("cpu", name, pinned)] = LinkProfile(20e-6, bw)
            links[link_key(name, "cpu", pinned)] = LinkProfile(20e-6, bw)
        for other in names:
            if other != name:
                bw = 50e9 if (name, other) in peers else 5e9
                links[link_key(name, other)] = LinkProfile(20e-6, bw)
    return Profile(fingerprint=fingerprint_of(host), host=dict(host), devices=devices,
                   links=links, host_sync_s=20e-6, event_wait_s=10e-6, view_s=2e-6,
                   source="defaults", created=_now())
