"""This host as a :class:`~autopar.machine.model.Machine` (its profile from the cache, measured
when missing), and ``--machine`` resolved: this host or a preset."""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..ir.locks import file_lock
from . import calibrate as calibration
from .host import (
    _gpus,
    _peer_pairs,
    host_info,
    load_profile,
    profile_path,
    save_profile,
)
from .model import (
    SCHEMA_VERSION,
    Machine,
    Profile,
    ProfileError,
    _devices,
    default_cpu_workers,
    default_profile,
    fingerprint_of,
)
from .presets import PRESETS, preset

__all__ = ["check_machine", "detect", "load_machine", "with_profile"]


# -- this host -------------------------------------------------------------------------------
def _measuring_allowed(measure: bool) -> bool:
    return measure and os.environ.get("AUTOPAR_NO_MEASURE", "") in ("", "0")


def _say(msg: str) -> None:
    print(f"autopar: {msg}", file=sys.stderr)


def detect(cpu_workers: int | None = None, calibrate: bool | str = False,
           measure: bool = True, force: bool = False) -> Machine:
    """This host: its CPU workers and GPUs, with its profile from the cache.

    ``calibrate``: ``False`` uses the cached profile; ``True`` or ``"quick"`` measures again
    quickly (<= 20 s), ``"full"`` measures everything. A missing or unusable cached profile is
    replaced by a quick calibration, or by conservative defaults when ``measure`` is False (or
    ``AUTOPAR_NO_MEASURE=1``). ``cpu_workers``: logical CPU workers (default 2 on hosts with at
    least 2 cores). A profile measured on a busy host (:attr:`Profile.busy`) does not replace a
    good one: the earlier one is kept and a line says why, unless ``force``. Processes measure
    the host one at a time (a lock file beside the profile); one that found no profile and
    waited for another's measurement loads that one's profile.
    """
    host = host_info()
    gpus = _gpus()
    peers = _peer_pairs(len(gpus))
    fp = fingerprint_of(host)
    path = profile_path(fp)
    allowed = _measuring_allowed(measure)
    mode = {True: "quick", "quick": "quick", "full": "full"}.get(calibrate)  # type: ignore[call-overload]
    if calibrate and mode is None:
        raise ValueError(f"calibrate={calibrate!r}: use False, True, \"quick\" or \"full\"")

    if mode is not None and measure:
        allowed = True  # asked for by name (`autopar calibrate`): AUTOPAR_NO_MEASURE aside
    profile: Profile | None = None
    why = "no profile for this host yet"
    if mode is None or not allowed:
        unsaved = _UNSAVED.get(path)
        try:
            profile = load_profile(path, fp)
            profile.check([f"cuda:{i}" for i in range(len(gpus))])
        except FileNotFoundError:
            pass
        except (ProfileError, OSError) as e:
            older = _older_schema(path)
            if older is not None:  # an upgrade, not damage
                why = (f"the profile {path} was measured by an older autopar (profile schema "
                       f"{older}; this one reads {SCHEMA_VERSION})")
            elif unsaved is None:
                warnings.warn(f"autopar: the profile {path} is unusable and will be replaced: "
                              f"{e}", RuntimeWarning, stacklevel=3)
        if unsaved is not None and (profile is None or profile.is_defaults):
            profile = unsaved  # measured in this process; the cache could not keep it
    if profile is not None and profile.is_defaults and allowed:
        profile = None  # defaults were a stopgap: measure now that measuring is allowed
    if profile is None or (mode is not None and allowed):
        if not allowed:
            profile = default_profile(host, gpus, peers)
            _save(profile, path)
            return _machine_for(profile, host, len(gpus), peers, cpu_workers, path)
        # one process at a time measures the host (torchrun starts its ranks at once: each
        # would measure a host the others keep busy); one that waited loads the profile
        with file_lock(path, waiting=lambda: _say(
                f"another process is measuring this host: waiting until it is done ({path})")):
            mode = mode or "quick"
            if calibrate is False:
                earlier = _good_profile(path, fp, len(gpus))
                if earlier is not None:  # measured while this one waited
                    return _machine_for(earlier, host, len(gpus), peers, cpu_workers, path)
                _say(f"{why}: calibrating ({mode}, about 20 s; AUTOPAR_NO_MEASURE=1 skips "
                     "this and uses conservative defaults)")
            with calibration.console_progress() as progress:
                profile = calibration.calibrate(mode, host=host, progress=progress)
            earlier = _good_profile(path, fp, len(gpus))
            if profile.busy and not force and earlier is not None:
                _say(f"the host was busy while measuring ({profile.busy}): kept the profile "
                     f"measured {earlier.created or 'earlier'}; --force (force=True) saves "
                     "this one anyway")
                return _machine_for(earlier, host, len(gpus), peers, cpu_workers, path)
            if profile.busy:
                _say(f"the host was busy while measuring ({profile.busy}): the numbers may be "
                     "slow; calibrate again on a quiet host")
            _save(profile, path)
    return _machine_for(profile, host, len(gpus), peers, cpu_workers, path)


def _save(profile: Profile, path: Path) -> None:
    """Save ``profile``, or, where the cache can't keep it, keep a measured one for this
    process (see ``_UNSAVED``) and say so."""
    try:
        save_profile(profile, path)
        _UNSAVED.pop(path, None)
    except OSError as e:
        if not profile.is_defaults:
            _UNSAVED[path] = profile
        warnings.warn(f"autopar: could not save the profile to {path}: {e}; this process "
                      "keeps it, the next one measures again: set AUTOPAR_CACHE_DIR to a "
                      "folder it can write", RuntimeWarning, stacklevel=4)


_UNSAVED: dict[Path, Profile] = {}
"""Profiles measured in this process that the cache could not keep (a read-only folder): used
again instead of measuring at every compile."""


def _older_schema(path: Path) -> int | None:
    """The schema version of an autopar profile file of another (older) version, else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    version = data.get("version") if isinstance(data, dict) and \
        data.get("format") == "autopar-profile" else None
    return version if isinstance(version, int) and version < SCHEMA_VERSION else None


def _good_profile(path: Path, fingerprint: str, n_gpus: int) -> Profile | None:
    """The saved profile, if it is usable, measured, and was not measured on a busy host."""
    try:
        profile = load_profile(path, fingerprint)
        profile.check([f"cuda:{i}" for i in range(n_gpus)])
    except (FileNotFoundError, ProfileError, OSError):
        return None
    return None if profile.is_defaults or profile.busy else profile


def _machine_for(profile: Profile, host: Mapping[str, Any], n_gpus: int,
                 peers: frozenset[tuple[str, str]], cpu_workers: int | None,
                 path: Path | None) -> Machine:
    # the threads torch computes with when calibrating; the host's cores if nothing was measured
    cores = profile.device("cpu").threads or int(host.get("cores", 1))
    workers = default_cpu_workers(cores) if cpu_workers is None else cpu_workers
    name = socket.gethostname() or "this host"
    return Machine(name=name, devices=_devices(workers, n_gpus), profile=profile,
                   peer_pairs=peers, cores=cores, profile_path=path)


def with_profile(machine: Machine, profile: Profile) -> Machine:
    """The same machine with another profile (e.g. one just calibrated)."""
    return replace(machine, profile=profile)


def load_machine(spec: str | Machine | None = None, cpu_workers: int | None = None,
                 measure: bool = True) -> Machine:
    """Resolve what a user passed as ``--machine``: ``None`` or ``"auto"`` is this host
    (:func:`detect`), a preset name is that preset, a :class:`Machine` is itself."""
    check_machine(spec)
    if isinstance(spec, Machine):
        return spec
    if spec is None or spec == "auto":
        return detect(cpu_workers=cpu_workers, measure=measure)
    return preset(spec, cpu_workers=cpu_workers)


def check_machine(spec: Any) -> None:
    """Raise ``ValueError`` unless :func:`load_machine` can resolve ``spec`` (checked when
    compiling, before any host is measured)."""
    if not (spec is None or isinstance(spec, Machine)
            or (isinstance(spec, str) and (spec == "auto" or spec in PRESETS))):
        raise ValueError(f"unknown machine {spec!r}: use None or \"auto\" (this host), a "
                         f"preset ({', '.join(sorted(PRESETS))}) or a Machine")
