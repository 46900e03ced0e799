"""This host: what it is (discovery and fingerprint), where its profiles are kept (see
:mod:`autopar.machine.model` for the policy)."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import torch

from .model import (
    Profile,
    ProfileError,
    _write_json_atomic,
)

__all__ = ["cache_dir", "cpu_fusion_unavailable", "host_info", "load_profile", "no_cuda_error",
           "profile_path", "save_profile"]


# -- host discovery and fingerprint ----------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def _host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # cores this process may use (containers, taskset)
    except AttributeError:
        return os.cpu_count() or 1


def _driver_version() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "none"
    m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([\d.]+)", text)
    return m.group(1) if m else text.splitlines()[0].strip()


def _gpus() -> list[dict[str, Any]]:
    """Name, memory and SM count of each visible GPU (none without CUDA)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"name": p.name, "memory_bytes": int(p.total_memory),
                    "sm_count": int(p.multi_processor_count)})
    return out


def _peer_pairs(n_gpus: int) -> frozenset[tuple[str, str]]:
    if n_gpus < 2:
        return frozenset()
    return frozenset((f"cuda:{i}", f"cuda:{j}") for i in range(n_gpus) for j in range(n_gpus)
                     if i != j and torch.cuda.can_device_access_peer(i, j))


def host_info() -> dict[str, Any]:
    """What makes this host's numbers what they are: the fingerprint's inputs."""
    return {
        "cpu_model": _cpu_model(),
        "cores": _host_cores(),
        "gpus": [g["name"] for g in _gpus()],
        "driver": _driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
    }


# -- files -----------------------------------------------------------------------------------
def cache_dir() -> Path:
    env = os.environ.get("AUTOPAR_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "autopar"


def profile_path(fingerprint: str) -> Path:
    return cache_dir() / f"profile-{fingerprint}.json"


def save_profile(profile: Profile, path: Path | None = None) -> Path:
    """Write ``profile`` as JSON, atomically (a crash leaves the old file or the new one)."""
    path = Path(path) if path is not None else profile_path(profile.fingerprint)
    _write_json_atomic(path, profile.to_json())
    return path


def load_profile(path: Path, fingerprint: str | None = None) -> Profile:
    """Read a profile; :class:`ProfileError` says what is wrong, FileNotFoundError if absent."""
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path} is not text: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path} is not valid JSON (corrupt or truncated): {e}") from None
    return Profile.from_json(data, fingerprint)


# -- what this host can compile ---------------------------------------------------------
@cache
def cpu_fusion_unavailable() -> str | None:
    """Why Inductor can't compile CPU code here (it needs a C++ compiler), or None."""
    try:
        from torch._inductor import config  # lazy: slow to import

        names = [c for c in config.cpp.cxx if c]
    except Exception as e:  # pragma: no cover - Inductor's config moved
        return f"Inductor's C++ compiler setting is unreadable: {type(e).__name__}: {e}"
    if not any(shutil.which(c) for c in names):
        return f"no C++ compiler for Inductor's CPU code (looked for {', '.join(names)})"
    return None


# -- what this host can run -------------------------------------------------------------
_NO_CUDA = ("not compiled with cuda", "not linked with support for cuda", "no nvidia driver",
            "no cuda gpus are available", "cuda driver version is insufficient",
            "with arguments from the 'cuda' backend")  # an op run for real on a fake GPU tensor


def no_cuda_error(error: BaseException) -> bool:
    """Whether ``error`` says this host can't run CUDA at all: a CPU-only build of torch ("Torch
    not compiled with CUDA enabled"; a fake GPU tensor: "not linked with support for cuda"), or
    a CUDA build on a host without a GPU or its driver ("Found no NVIDIA driver on your
    system", the default ``pip install torch`` on a laptop)."""
    text = str(error).lower()
    return any(marker in text for marker in _NO_CUDA)
