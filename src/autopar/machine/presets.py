"""Presets: machines not at hand, for simulation, explain and tests.

Built from measured figures: ``h200x2`` from ``shared/MEASURED.md`` (2 H200 with NVLink, torch
2.11), the others scaled from published rates of their parts (``h200x4`` and ``h200x8``: the same
H200s and NVLink, every pair linked, on a larger host). ``preset(name)`` builds one;
``--machine NAME`` takes any name of :data:`PRESETS` wherever a machine is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .fabric import Fabric, fabric_of
from .model import (
    Curve,
    DeviceProfile,
    GiB,
    LinkProfile,
    Machine,
    Profile,
    _devices,
    default_cpu_workers,
    link_key,
)

__all__ = ["PRESETS", "preset", "preset_fabric"]

# Built from MEASURED.md (2x H200 with NVLink, 32-core host, torch 2.11, tf32 off) and, where it
# has no figure, from a full `autopar calibrate` of the same kind of machine (where each figure
# comes from: docs/measurements.md, "Where the presets' figures come from"). Curves are written
# as measured (size, seconds) pairs.
def _rates(times: Iterable[tuple[float, float]]) -> Curve:
    return tuple((size, size / seconds) for size, seconds in times)


def _mm(n: float) -> float:
    return 2 * n**3


# host matmul, all 32 threads (MEASURED.md: 5x10x5 1.9 us, 100x200x100 17.5 us, 256^3 .. 2048^3
# 46 / 211 / 1167 / 8248 us; less the 1.5 us dispatch) and one thread (calibrated)
_HOST_MM = _rates([(500, 0.4e-6), (4e6, 16e-6), (_mm(256), 44.5e-6), (_mm(512), 209.5e-6),
                   (_mm(1024), 1165.5e-6), (_mm(2048), 8246.5e-6), (_mm(4096), 62.7e-3)])
_HOST_MM_1T = _rates([(1024, 0.2e-6), (6.55e4, 0.46e-6), (5.24e5, 4.35e-6), (4.19e6, 22.8e-6),
                      (3.36e7, 207e-6), (2.68e8, 1.68e-3), (2.15e9, 13.1e-3)])
# bytes read and written, streamed (operands taken in turn from 256 MB, outputs held: as a
# program meets memory; `autopar calibrate --full` of a 16-core host of an H100 machine, whose
# profile docs/measurements.md names, less each op's own cost on a few bytes, `full` 1.45 us and
# `sum` 0.5, as calibration takes them). Timed on one hot array, its output freed at once, the
# host's memory-bound ops priced 1.3-4x too cheap (calibrate.STREAM_BYTES says why)
_HOST_READ = _rates([(512, 5.3e-08), (8.19e3, 3.4e-07), (3.28e4, 1.5e-06), (1.31e5, 1.22e-05),
                     (5.24e5, 1.95e-05), (2.1e6, 2.21e-05), (8.39e6, 5.57e-05),
                     (3.36e7, 0.000238), (1.34e8, 0.000946), (5.37e8, 0.00524)])
_HOST_READ_1T = _rates([(512, 6.1e-08), (8.19e3, 3.1e-07), (3.28e4, 2e-06), (1.31e5, 9.95e-06),
                        (5.24e5, 3.66e-05), (2.1e6, 0.00015), (8.39e6, 0.000614),
                        (3.36e7, 0.00244), (1.34e8, 0.0106), (5.37e8, 0.0402)])
_HOST_WRITE = _rates([(256, 1.46e-07), (4.1e3, 2e-07), (1.64e4, 5.7e-07), (6.55e4, 1.73e-06),
                      (2.62e5, 9.35e-06), (1.05e6, 1.09e-05), (4.19e6, 0.000327),
                      (1.68e7, 0.000987), (6.71e7, 0.00587), (2.68e8, 0.0192)])
_HOST_WRITE_1T = _rates([(256, 1.5e-07), (4.1e3, 1.56e-07), (1.64e4, 4.8e-07), (6.55e4, 1.73e-06),
                         (2.62e5, 1.26e-05), (1.05e6, 4.98e-05), (4.19e6, 0.00164),
                         (1.68e7, 0.0069), (6.71e7, 0.03), (2.68e8, 0.113)])

# H200 kernel times: fp32 matmul (2048^3 in 343 us; MEASURED.md's 348 us includes launch and
# sync), bytes read and written
_H200_MM = _rates([(1.02e3, 2.7e-6), (6.55e4, 5.87e-6), (3.36e7, 8.0e-6), (1.13e8, 10.8e-6),
                   (2.68e8, 14e-6), (9.06e8, 34.1e-6), (2.15e9, 56.5e-6), (7.25e9, 188e-6),
                   (1.72e10, 343e-6), (5.8e10, 1.28e-3), (1.37e11, 2.69e-3), (1.1e12, 21.5e-3)])
_H200_READ = _rates([(8.19e3, 2.83e-6), (1.31e5, 5.53e-6), (2.1e6, 7.15e-6), (3.36e7, 12.1e-6),
                     (1.34e8, 38e-6), (5.37e8, 129e-6), (2.15e9, 491e-6)])
_H200_WRITE = _rates([(6.55e4, 0.19e-6), (4.19e6, 0.32e-6), (1.68e7, 1.32e-6), (6.71e7, 11.5e-6),
                      (2.68e8, 57.4e-6), (1.07e9, 247e-6)])

# pageable copies (eager .to / .cpu): host-to-GPU about 8 GB/s; GPU-to-host 1.5 GB/s past 32 MB
# (MEASURED.md: pageable D2H 1.5 GB/s), where each copy lands in freshly mapped memory
_H200_PAGEABLE_H2D = LinkProfile(12e-6, 8.45e9, (
    (4.1e3, 17.1e-6), (6.55e4, 27e-6), (2.62e5, 40.7e-6), (1.05e6, 140e-6), (4.19e6, 402e-6),
    (1.68e7, 1.26e-3), (3.36e7, 4.18e-3), (6.71e7, 6.82e-3), (2.68e8, 31.8e-3)))
_H200_PAGEABLE_D2H = LinkProfile(16e-6, 1.66e9, (
    (4.1e3, 17.3e-6), (6.55e4, 24.2e-6), (2.62e5, 47e-6), (1.05e6, 131e-6), (4.19e6, 337e-6),
    (1.68e7, 1.18e-3), (3.36e7, 21.5e-3), (6.71e7, 47e-3), (2.68e8, 162e-3)))


def _scaled(curve: Curve, factor: float) -> Curve:
    return tuple((x, r * factor) for x, r in curve)


def _host_profile(model: str, cores: int, scale: float, memory: int) -> DeviceProfile:
    """A host like MEASURED.md's 32-core one, its all-thread rates scaled by ``scale``. The
    one-thread curves are kept only for hosts at least as big (a smaller host's all-thread rates
    could fall below them), so smaller hosts share by threads linearly."""
    curves = {"matmul": _scaled(_HOST_MM, scale), "read": _scaled(_HOST_READ, scale),
              "write": _scaled(_HOST_WRITE, scale)}
    if scale >= 1:
        curves |= {"matmul@1t": _HOST_MM_1T, "read@1t": _HOST_READ_1T,
                   "write@1t": _HOST_WRITE_1T}
    return DeviceProfile(
        kind="cpu", model=model, launch_s=1.5e-6, min_kernel_s=1.5e-6,
        flops={"float32": 2.19e12 * scale, "float64": 1.4e12 * scale,
               "bfloat16": 2.3e12 * scale, "float16": 1.58e12 * scale},
        mem_bw=280e9 * scale, memory_bytes=memory, threads=cores, curves=curves)


def _h200() -> DeviceProfile:
    # MEASURED.md: a tiny kernel costs 7.4 us of host time; a tiny matmul 16 us end to end
    return DeviceProfile(
        kind="cuda", model="NVIDIA H200", launch_s=7.4e-6, min_kernel_s=1.7e-6,
        launch_by_kind={"matmul": 10.4e-6},
        flops={"float32": 51.2e12, "tf32": 394e12, "float16": 735e12, "bfloat16": 790e12,
               "float64": 57.7e12},
        mem_bw=4.37e12, memory_bytes=int(143771 * 2**20 * 0.92), sm_count=132,
        curves={"matmul": _H200_MM, "read": _H200_READ, "write": _H200_WRITE})


def _a100_pcie() -> DeviceProfile:
    fp32 = 18e12 / 51.2e12  # A100 fp32 against the H200's, achieved; HBM2e about 0.4 of HBM3e
    return DeviceProfile(
        kind="cuda", model="NVIDIA A100 80GB PCIe", launch_s=6e-6, min_kernel_s=2e-6,
        launch_by_kind={"matmul": 9e-6},
        flops={"float32": 18e12, "tf32": 110e12, "float16": 230e12, "bfloat16": 230e12,
               "float64": 17e12},
        mem_bw=1.7e12, memory_bytes=int(80 * GiB * 0.92), sm_count=108,
        curves={"matmul": _scaled(_H200_MM, fp32), "read": _scaled(_H200_READ, 0.4),
                "write": _scaled(_H200_WRITE, 0.4)})


def _gpu_links(n: int, *, pinned_h2d: float, pinned_d2h: float, pageable_h2d: LinkProfile,
               pageable_d2h: LinkProfile, peer: LinkProfile, staged: LinkProfile,
               peers: frozenset[tuple[str, str]]) -> dict[str, LinkProfile]:
    links: dict[str, LinkProfile] = {}
    for i in range(n):
        g = f"cuda:{i}"
        links[link_key("cpu", g, True)] = LinkProfile(4e-6, pinned_h2d)
        links[link_key(g, "cpu", True)] = LinkProfile(4e-6, pinned_d2h)
        links[link_key("cpu", g, False)] = pageable_h2d
        links[link_key(g, "cpu", False)] = pageable_d2h
        for j in range(n):
            if i != j:
                h = f"cuda:{j}"
                links[link_key(g, h)] = peer if (g, h) in peers or (h, g) in peers else staged
    return links


def _all_pairs(n: int) -> frozenset[tuple[str, str]]:
    return frozenset((f"cuda:{i}", f"cuda:{j}") for i in range(n) for j in range(i + 1, n))


_NVLINK = LinkProfile(13e-6, 367e9)
_NDR400 = LinkProfile(10e-6, 50e9)  # one 400 Gb/s NIC a GPU (InfiniBand NDR, RDMA)
_STAGED = LinkProfile(25e-6, 10e9)


@dataclass(frozen=True)
class _PresetSpec:
    description: str
    cpu_model: str
    cores: int
    host_memory: int
    host_scale: float
    gpu: Callable[[], DeviceProfile] | None
    n_gpus: int
    peers: frozenset[tuple[str, str]]
    pinned_h2d: float = 55e9  # MEASURED.md
    pinned_d2h: float = 54e9
    pageable_h2d: LinkProfile = _H200_PAGEABLE_H2D
    pageable_d2h: LinkProfile = _H200_PAGEABLE_D2H
    peer: LinkProfile = _NVLINK  # MEASURED.md: GPU0 -> GPU1 367 GB/s
    staged: LinkProfile = _STAGED  # no peer access: through host memory
    host_sync_s: float = 2e-6  # MEASURED.md: .item() 9.1 us = launch + kernel + this
    event_wait_s: float = 10e-6  # calibrated: Python-level event record + stream wait
    view_s: float = 2.4e-6
    nodes: int = 1  # a world of several such nodes (each Machine is one of them)
    nic: LinkProfile | None = None  # each GPU's link to the other nodes


_PCIE = {"pinned_h2d": 24e9, "pinned_d2h": 22e9,
         "pageable_h2d": LinkProfile(12e-6, 6e9, tuple((n, t * 1.3) for n, t in
                                                       _H200_PAGEABLE_H2D.samples)),
         "peer": LinkProfile(10e-6, 20e9), "staged": LinkProfile(25e-6, 9e9)}

PRESETS: dict[str, _PresetSpec] = {
    "h200x2": _PresetSpec(
        "2x NVIDIA H200 with NVLink, 32-core host (the machine of MEASURED.md)",
        "x86-64, 32 cores", 32, 256 * GiB, 1.0, _h200, 2, _all_pairs(2)),
    "h200x4": _PresetSpec(
        "4x NVIDIA H200, all pairs NVLink, 64-core host",
        "x86-64, 64 cores", 64, 512 * GiB, 1.5, _h200, 4, _all_pairs(4)),
    "h200x8": _PresetSpec(
        "8x NVIDIA H200, all pairs NVLink (NVSwitch), 128-core host",
        "x86-64, 128 cores", 128, 560 * GiB, 2.5, _h200, 8, _all_pairs(8)),
    "2xh200x8": _PresetSpec(
        "2 nodes of 8x NVIDIA H200 (NVSwitch), 8x 400 Gb/s between the nodes (one NIC a GPU); "
        "a Machine of it is one node", "x86-64, 128 cores", 128, 560 * GiB, 2.5, _h200, 8,
        _all_pairs(8), nodes=2, nic=_NDR400),
    "a100x4-pcie": _PresetSpec(
        "4x NVIDIA A100 80GB PCIe, peer access only within PCIe-switch pairs 0-1 and 2-3, "
        "64-core host", "x86-64, 64 cores", 64, 512 * GiB, 1.5, _a100_pcie, 4,
        frozenset({("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")}), **_PCIE),
    "cpu-only": _PresetSpec(
        "8-core host without GPUs", "x86-64, 8 cores", 8, 32 * GiB, 0.25, None, 0,
        frozenset(), host_sync_s=0.0, event_wait_s=8e-6),
}


def preset(name: str, cpu_workers: int | None = None) -> Machine:
    """A machine not at hand, for simulation and tests. Never measures.

    ``cpu_workers``: logical CPU workers (default 2). Names: see :data:`PRESETS`.
    """
    spec = PRESETS.get(name)
    if spec is None:
        raise ValueError(f"unknown machine preset {name!r}; valid names: {sorted(PRESETS)} "
                         "(or \"auto\" for this host)")
    workers = default_cpu_workers(spec.cores) if cpu_workers is None else cpu_workers
    devices = _devices(workers, spec.n_gpus)
    profiles = {"cpu": _host_profile(spec.cpu_model, spec.cores, spec.host_scale,
                                     spec.host_memory)}
    for d in devices:
        if d.is_gpu and spec.gpu is not None:
            profiles[d.name] = spec.gpu()
    host = {"preset": name, "cpu_model": spec.cpu_model, "cores": spec.cores,
            "gpus": [profiles[d.name].model for d in devices if d.is_gpu]}
    profile = Profile(
        fingerprint=f"preset-{name}", host=host, devices=profiles,
        links=_gpu_links(spec.n_gpus, pinned_h2d=spec.pinned_h2d, pinned_d2h=spec.pinned_d2h,
                         pageable_h2d=spec.pageable_h2d, pageable_d2h=spec.pageable_d2h,
                         peer=spec.peer, staged=spec.staged, peers=spec.peers),
        host_sync_s=spec.host_sync_s, event_wait_s=spec.event_wait_s, view_s=spec.view_s,
        source=f"preset:{name}", created="",
    )
    return Machine(name=name, devices=devices, profile=profile, peer_pairs=spec.peers,
                   cores=spec.cores)


def preset_fabric(name: str, gpus: int | None = None) -> Fabric:
    """The fabric of preset ``name``'s world: its nodes, each using ``gpus`` GPUs (all by
    default)."""
    spec = PRESETS.get(name)
    if spec is None:
        raise ValueError(f"unknown machine preset {name!r}; valid names: {sorted(PRESETS)}")
    return fabric_of(preset(name), nodes=spec.nodes, nic=spec.nic, gpus=gpus)
