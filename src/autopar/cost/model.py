"""The cost model: how long a graph node takes on a device, and bytes over a link.

Policy, in order of preference for a node ``n`` on device ``d``
1. ``input`` and ``getitem`` (a tuple index in the generated code): free (0). ``view``:
   host-only, ``profile.view_s``, no kernel. A collective (:mod:`autopar.ir.collective`) on
   its lane: see :meth:`CostModel.collective_cost`; ``take`` of its items is free.
2. History: once the history holds ``min_samples`` trusted measurements of the same op with the
   same input shapes, dtypes and arguments on the same device (CPU workers share one entry), their
   outlier-robust median replaces the estimate below.
3. Roofline: ``work = max(compute, read + write)``, each read off the profile's calibrated curves
   (achieved rates grow with size): ``compute`` for the op's FLOPs in its dtype (convolutions on
   the ``conv`` curve where the profile has one, else the ``matmul`` one), ``read`` for the
   bytes of its inputs, ``write`` for the bytes of its outputs (in place: of the inputs it
   mutates; on the host writing fresh memory costs page faults). Ops without a FLOP formula are
   costed by bytes alone, except transcendental pointwise ops (exp, tanh, softmax...), whose
   compute is their elements at the measured speed of ``exp``. ``launch`` is the profile's launch
   time for the op's kind.
   - CPU worker: the host runs the op, ``host_s = max(min_kernel_s, launch + work)``,
     ``device_s = 0``, with rates for the worker's ``Machine.cpu_threads`` threads (see
     :mod:`autopar.machine.model`).
   - GPU: the host only launches, ``host_s = launch``, and the device computes,
     ``device_s = max(min_kernel_s, work)``: the two overlap across consecutive ops, so a
     stream of ops costs ``max(host_s, device_s)`` each (:meth:`CostModel.node_time`).
   - A GPU op whose result the host must read (``.item()``, ``nonzero``...) adds the device time
     and a host sync to its host time: the host waits.
4. float32 matmuls and convolutions on a GPU use the tf32 rate when torch allows tf32 for them
   (``torch.get_float32_matmul_precision() != "highest"``; ``torch.backends.cudnn.allow_tf32``),
   read when the CostModel is built, unless ``allow_tf32`` says otherwise.

Where an op may run (:meth:`CostModel.can_run`): random ops only where eager runs them (any CPU
worker for CPU values, which share the host generator; the same GPU for GPU values, each GPU
having its own generator) so random streams stay identical; an op with a kernel for eager's
kind of device only (cuDNN's, flash and memory-efficient attention on GPUs; CPU-only kernels
such as int4 weight packing on the host) on that kind (GPUs are asked about only where torch
is built with CUDA); other ops anywhere their inputs and output fit in the device's memory.

History: per key ``"<device>|<op>(<input metas and arguments>)"`` the last ``max_samples``
measured seconds. Outliers (modified z-score over 3.5, from the median absolute deviation,
floored at 5 % of the median so that ordinary jitter is never an outlier) are ignored; the median
of the rest is the estimate, trusted once ``min_samples`` samples remain. JSON beside the profile
(``history-<fingerprint>.json``); a corrupt or foreign file is reported and ignored, never fatal.

Nothing here imports CUDA-only code: costs are pure functions of a node, a Machine and History.
"""

from __future__ import annotations

import json
import math
import operator
import statistics
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autopar.ir.collective import COMM, inline, is_collective, take
from autopar.ir.graph import Node, TensorMeta, op_name
from autopar.ir.locks import file_lock
from autopar.ir.ops import SCALAR_FUNCTIONS, has_kernel, is_fused_update
from autopar.ir.routing import home_device, pool
from autopar.machine.model import (
    Device,
    DeviceProfile,
    Machine,
    _write_json_atomic,
    check_envelope,
)

_CUDA_BUILT = torch.backends.cuda.is_built()  # else no CUDA kernel is registered to ask about

__all__ = ["COLLECTIVE_LATENCY_S", "PYTHON_NUMBER_OP_S", "CostModel", "History", "HistoryStats",
           "OpCost", "reads_to_host"]


@dataclass(frozen=True, slots=True)
class OpCost:
    """Time of one node on one device: host time and (GPU only) device-queue time, seconds.

    ``source`` says where the numbers came from: "input", "view", "history", "roofline"
    (FLOPs and bytes), "bytes" (no FLOP formula: bytes alone), "collective" or "python" (an
    operation on Python numbers).
    """

    host_s: float
    device_s: float
    source: str = "roofline"

    @property
    def time(self) -> float:
        return max(self.host_s, self.device_s)


# -- history ---------------------------------------------------------------------------------
_HISTORY_FORMAT = "autopar-history"
_HISTORY_VERSION = 1


@dataclass(frozen=True, slots=True)
class HistoryStats:
    n: int  # samples held
    kept: int  # samples left after outlier rejection
    median: float  # of the kept samples: the estimate
    spread: float  # robust relative spread: 1.4826 * MAD / median of the kept samples
    trusted: bool


class History:
    """Measured op times, keyed by op, input metas, arguments and device (see module doc)."""

    def __init__(self, min_samples: int = 3, max_samples: int = 64, fingerprint: str = "",
                 path: Path | None = None) -> None:
        if min_samples < 1 or max_samples < min_samples:
            raise ValueError(f"History(min_samples={min_samples}, max_samples={max_samples}): "
                             "need 1 <= min_samples <= max_samples")
        self.min_samples = min_samples
        self.max_samples = max_samples
        self.fingerprint = fingerprint
        self.path = path
        self._samples: dict[str, list[float]] = {}
        self._ops: set[str] = set()  # op names with samples: skips building keys for the rest
        # samples added since the file was read or written: what a save appends to it
        self._unsaved: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def add(self, key: str, seconds: float) -> None:
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"measured time {seconds!r} for {key!r} must be a finite number of "
                             "seconds >= 0")
        with self._lock:
            self._add(key, float(seconds))
            self._unsaved.setdefault(key, []).append(float(seconds))

    def _add(self, key: str, seconds: float) -> None:
        samples = self._samples.setdefault(key, [])
        samples.append(seconds)
        del samples[:-self.max_samples]  # keep the latest: the estimate follows drifts
        self._ops.add(_op_of_key(key))

    def has_op(self, name: str) -> bool:
        return name in self._ops

    def samples(self, key: str) -> list[float]:
        return list(self._samples.get(key, ()))

    def stats(self, key: str) -> HistoryStats | None:
        xs = self._samples.get(key)
        if not xs:
            return None
        kept = _reject_outliers(xs)
        med = statistics.median(kept)
        mad = statistics.median(abs(x - med) for x in kept)
        spread = 1.4826 * mad / med if med > 0 else 0.0
        return HistoryStats(len(xs), len(kept), med, spread, len(kept) >= self.min_samples)

    def estimate(self, key: str) -> float | None:
        """The trusted median for ``key``, or None while there are too few samples."""
        st = self.stats(key)
        return st.median if st is not None and st.trusted else None

    def __len__(self) -> int:
        return len(self._samples)

    def keys(self) -> list[str]:
        return sorted(self._samples)

    # -- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format": _HISTORY_FORMAT, "version": _HISTORY_VERSION,
                "fingerprint": self.fingerprint, "min_samples": self.min_samples,
                "max_samples": self.max_samples,
                "entries": {k: v for k, v in sorted(self._samples.items())}}

    @staticmethod
    def from_json(data: Any, fingerprint: str | None = None) -> History:
        """Parse; raise ValueError saying what is wrong (corrupt, foreign, other version)."""
        check_envelope(data, "history", _HISTORY_FORMAT, _HISTORY_VERSION, fingerprint)
        h = History(int(data.get("min_samples", 3)), int(data.get("max_samples", 64)),
                    str(data.get("fingerprint", "")))
        entries = data.get("entries")
        if not isinstance(entries, dict):
            raise ValueError("malformed history: \"entries\" is not an object")
        for key, xs in entries.items():
            if not isinstance(xs, list):
                raise ValueError(f"malformed history: samples of {key!r} are not a list")
            for x in xs:
                h.add(str(key), x)
        h._unsaved = {}  # read, not added
        return h

    def save(self, path: Path | str | None = None) -> Path:
        """Write the history to ``path`` (default: its own file). Its own file is merged, not
        overwritten: under a lock beside it, the samples added here since it was read or last
        written are appended to what the file holds now, so that histories saved by other
        compiled functions and processes since are kept; this history then holds the union."""
        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError("History.save(): this history has no file (a preset machine's); "
                             "pass a path")
        if target != self.path:
            _write_json_atomic(target, self.to_json())
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(target), self._lock:
            try:
                disk = History.from_json(json.loads(target.read_text()), self.fingerprint)
            except (OSError, ValueError, TypeError, UnicodeDecodeError):
                disk = None  # missing or unusable: this history replaces it
            if disk is not None:
                for key, xs in self._unsaved.items():
                    for x in xs:
                        disk._add(key, x)
                self._samples, self._ops = disk._samples, disk._ops
            self._unsaved = {}
            _write_json_atomic(target, self.to_json())
        return target

    @staticmethod
    def load(path: Path | str, fingerprint: str | None = None) -> History:
        """Read a history file. Missing: an empty history. Unusable: reported, and empty."""
        path = Path(path)
        try:
            h = History.from_json(json.loads(path.read_text()), fingerprint)
        except FileNotFoundError:
            h = History(fingerprint=fingerprint or "")
        except (OSError, ValueError, TypeError, UnicodeDecodeError) as e:
            warnings.warn(f"autopar: ignoring the unusable history {path} (it will be replaced "
                          f"on the next save): {e}", RuntimeWarning, stacklevel=2)
            h = History(fingerprint=fingerprint or "")
        h.path = path
        return h

    @staticmethod
    def for_machine(machine: Machine) -> History:
        """The persisted history beside the machine's profile; in memory only for presets."""
        if machine.profile_path is None:
            return History(fingerprint=machine.fingerprint)
        path = machine.profile_path.with_name(f"history-{machine.fingerprint}.json")
        return History.load(path, machine.fingerprint)


def _reject_outliers(xs: list[float]) -> list[float]:
    med = statistics.median(xs)
    mad = max(statistics.median(abs(x - med) for x in xs), 0.05 * med)
    if mad == 0:
        return list(xs)
    kept = [x for x in xs if 0.6745 * abs(x - med) / mad <= 3.5]
    return kept or list(xs)


def _op_of_key(key: str) -> str:
    return key.split("|", 1)[-1].split("(", 1)[0]


# -- node facts ------------------------------------------------------------------------------
def _contiguous(m: TensorMeta) -> bool:
    return m.stride == TensorMeta.make(m.shape, m.dtype, m.device).stride


def _fmt_arg(a: Any) -> str:
    if isinstance(a, Node):
        metas = a.tensor_metas
        if not metas:
            return "?"
        return ",".join(str(m) + ("" if _contiguous(m) else "~") for m in metas)
    if isinstance(a, (list, tuple)):
        return "[" + ",".join(_fmt_arg(x) for x in a) + "]"
    text = repr(a)
    return text if len(text) <= 40 else text[:37] + "..."


def signature(node: Node) -> str:
    """``op(args)`` with tensors as their metas (``~`` marks non-contiguous): a history key."""
    parts = [_fmt_arg(a) for a in node.args]
    parts += [f"{k}={_fmt_arg(v)}" for k, v in sorted(node.kwargs.items())]
    return f"{op_name(node.op)}({', '.join(parts)})"


def _dtype_name(node: Node) -> str:
    """The dtype that sets the compute rate: the first floating input's, else the output's."""
    metas = [m for i in node.inputs for m in i.tensor_metas] + list(node.tensor_metas)
    for m in metas:
        if m.dtype.is_floating_point:
            return str(m.dtype).removeprefix("torch.")
    return str(metas[0].dtype).removeprefix("torch.") if metas else "float32"


def _bytes_written(node: Node) -> int:
    """Bytes an op writes: its outputs, or, in place, the inputs it mutates."""
    return node.out_bytes or sum(m.nbytes for w in node.writes for m in w.tensor_metas)


def _elements(node: Node) -> int:
    return sum(m.numel for m in node.tensor_metas)


def _schema_name(node: Node) -> str:
    return node.op._schema.name if isinstance(node.op, torch._ops.OpOverload) else ""


# ops whose result the host must see at once: on a GPU they end in a device->host sync
_HOST_READS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
                         "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
                         "aten::item", "aten::is_nonzero"})
# pointwise ops whose arithmetic (exp, log, trig...) can outlast their memory traffic, costed
# per element at the measured speed of exp
_TRANSCENDENTAL = frozenset(f"aten::{name}" for name in (
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sigmoid", "tanh", "sin", "cos",
    "tan", "asin", "acos", "atan", "sinh", "cosh", "erf", "erfc", "erfinv", "gelu", "silu",
    "mish", "softplus", "elu", "selu", "logit", "_softmax", "_log_softmax", "pow"))
_CONVOLUTIONS = frozenset({"aten::convolution", "aten::convolution_backward",
                           "aten::cudnn_convolution", "aten::_convolution"})


def reads_to_host(node: Node) -> bool:
    """Does this op hand a tensor's value to the host (``.item()``, ``nonzero``...)? On a GPU
    that is a device->host sync."""
    return _schema_name(node) in _HOST_READS


def _tf32_flags() -> tuple[bool, bool]:
    """(matmul, convolution) tf32 permission as torch has it now."""
    matmul = torch.get_float32_matmul_precision() != "highest"
    conv = bool(getattr(torch.backends.cudnn, "allow_tf32", True))
    return matmul, conv


PYTHON_NUMBER_OP_S = 0.05e-6
"""Seconds of one operation on Python numbers (:data:`~autopar.ir.ops.SCALAR_FUNCTIONS`: the
arithmetic dynamo or a trace records on ``.item()`` values, AdamW's bias corrections) as the
executor runs it, one generated line: 0.03 us on the 2-core VM (a program of 1,000 such lines).
They had been priced as CPU kernels (1.5 us): GPT-2 small's AdamW step has 1,200 of them."""


COLLECTIVE_LATENCY_S = 20e-6
"""An all-reduce's fixed time over one machine's GPUs, whatever its size: NCCL's small-message
all-reduce over 8 NVLink GPUs takes tens of microseconds (its LL protocols). An assumption, not
calibrated: no machine with two GPUs was lent to measure it (``autopar calibrate`` measures
links, not collectives)."""


# -- the model -------------------------------------------------------------------------------
class CostModel:
    """Predicted seconds of nodes on devices and of bytes over links, for one machine.

    Building one never measures: it reads the machine's profile and, for a detected machine, the
    history file beside it.
    """

    def __init__(self, machine: Machine, history: History | None = None, *,
                 allow_tf32: bool | Mapping[str, bool] | None = None) -> None:
        self.machine = machine
        self.history = history if history is not None else History.for_machine(machine)
        self._times: dict[tuple[Node, str], float] = {}
        # the roofline of a node is the same on devices of equal profiles (a preset's 8 GPUs):
        # computed once per (node, first such device)
        self._works: dict[tuple[Node, str], float] = {}
        self._twin: dict[str, str] = {}
        if allow_tf32 is None:
            self.tf32_matmul, self.tf32_conv = _tf32_flags()
        elif isinstance(allow_tf32, Mapping):
            self.tf32_matmul = bool(allow_tf32.get("matmul", False))
            self.tf32_conv = bool(allow_tf32.get("conv", False))
        else:
            self.tf32_matmul = self.tf32_conv = bool(allow_tf32)

    # -- ops -----------------------------------------------------------------------------
    def op_cost(self, node: Node, device: Device | str) -> OpCost:
        if node.is_input:
            return OpCost(0.0, 0.0, "input")
        if node.op is operator.getitem or node.op is take:  # a tuple index: no dispatch
            return OpCost(0.0, 0.0, "getitem")
        if is_collective(node.op):
            return self.collective_cost(node)
        if node.op in SCALAR_FUNCTIONS:  # arithmetic on Python numbers, on the calling thread
            return OpCost(PYTHON_NUMBER_OP_S, 0.0, "python")
        dev = self.machine.device(device)
        prof = self.machine.profile
        if node.kind == "view":
            return OpCost(prof.view_s, 0.0, "view")
        dp = prof.device(dev.name)
        measured = self._measured(node, dev)
        if measured is not None:
            if dev.is_cpu:
                return OpCost(measured, 0.0, "history")
            return OpCost(dp.launch(node.kind), measured, "history")

        twin = self._twin.get(dev.name) or self._twin_of(dev)
        work = self._works.get((node, twin))
        if work is None:
            work = self._works[(node, twin)] = self._work(node, dev, dp)
        source = "roofline" if node.flops else "bytes"
        launch = dp.launch(node.kind)
        if dev.is_cpu:
            return OpCost(max(dp.min_kernel_s, launch + work), 0.0, source)
        device_s = max(dp.min_kernel_s, work)
        host_s = launch
        if _schema_name(node) in _HOST_READS:
            host_s += device_s + prof.host_sync_s  # the host waits for the value
        return OpCost(host_s, device_s, source)

    def collective_cost(self, node: Node) -> OpCost:
        """An all-reduce of k parts of ``n`` bytes each. Over GPUs of their own memory: a ring
        (NCCL's algorithm for big messages), ``2 (k-1)`` steps that each move ``n / k`` bytes
        over every neighbouring link at once, pipelined in one kernel, so ``2 (k-1) / k * n``
        bytes at the slowest link's bandwidth, plus :data:`COLLECTIVE_LATENCY_S` (not a copy's
        latency per step: a step is no launch); the launching thread pays, per GPU, the
        collective's launch and, on comm streams, its stream's wait for the part (an event:
        ``event_wait_s``) and half an event for the item its consumers wait on (none on the
        compute streams: :func:`~autopar.ir.collective.inline`). Parts sharing one memory (CPU
        workers): the parts added in order once, on the host (the lane's thread computes
        it)."""
        metas = [p.meta for p in node.args]
        k, n = len(metas), metas[0].nbytes
        devices = [home_device(m.device) for m in metas]
        prof = self.machine.profile
        if len({pool(d) for d in devices}) < k:
            dp = prof.device(devices[0])
            threads = self.machine.cpu_threads
            adds = (k - 1) * (dp.read_time(2 * n, threads) + dp.write_time(n, threads))
            return OpCost(adds, 0.0, "collective")
        bandwidth = min(prof.link(a, b).bandwidth
                        for a, b in zip(devices, devices[1:] + devices[:1]))
        per_gpu = prof.device(devices[0]).launch("copy") + \
            (0.0 if inline(n) else 1.5 * prof.event_wait_s)
        return OpCost(k * per_gpu, COLLECTIVE_LATENCY_S + 2 * (k - 1) / k * n / bandwidth,
                      "collective")

    def _twin_of(self, dev: Device) -> str:
        """The first device seen whose roofline is ``dev``'s: of its kind, with an equal
        profile (and so equal rates, bandwidths and thread counts)."""
        prof = self.machine.profile
        mine = prof.device(dev.name)
        for name, twin in self._twin.items():
            if name == twin and self.machine.device(name).is_cpu == dev.is_cpu and \
                    prof.device(name) == mine:
                self._twin[dev.name] = name
                return name
        self._twin[dev.name] = dev.name
        return dev.name

    def _work(self, node: Node, dev: Device, dp: DeviceProfile) -> float:
        """The roofline: seconds of compute or of memory traffic, whichever is longer."""
        threads = self.machine.cpu_threads if dev.is_cpu else 0
        compute_s = 0.0
        if node.flops:
            curve = "conv" if _schema_name(node) in _CONVOLUTIONS else "matmul"
            compute_s = dp.compute_time(self._rate_dtype(node, dev), node.flops, threads, curve)
        elif _schema_name(node) in _TRANSCENDENTAL:
            compute_s = dp.transcendental_time(_elements(node), threads)
        read, written = node.in_bytes, _bytes_written(node)
        memory_s = ((dp.read_time(read, threads) if read else 0.0)
                    + (dp.write_time(written, threads) if written else 0.0))
        if is_fused_update(node.op):
            memory_s *= 2  # the functional form: its lists cloned, then updated
        return max(compute_s, memory_s)

    def node_time(self, node: Node, device: Device | str) -> float:
        """Seconds the node occupies ``device`` in a stream of ops: max(host, device).

        Memoized per (node, device): placement asks for every op on every device, and simulation
        asks again; :meth:`observe` clears the memo, since history changes the answer."""
        key = (node, device if isinstance(device, str) else device.name)
        t = self._times.get(key)
        if t is None:
            t = self._times[key] = self.op_cost(node, device).time
        return t

    def host_s(self, node: Node, device: Device | str) -> float:
        """Seconds of the launching thread's time the node takes on ``device`` (its whole
        time on the host; a GPU op's launch)."""
        return self.op_cost(node, device).host_s

    def can_run(self, node: Node, device: Device | str) -> bool:
        if is_collective(node.op) or device == COMM:  # collectives run on their lane alone
            return device == COMM and is_collective(node.op)
        dev = self.machine.device(device)
        if node.kind == "random":
            home = node.device
            if home is None:
                return True
            return dev.is_cpu if home.startswith("cpu") else dev.name == _cuda_name(home)
        if node.is_input or node.kind in ("view", "getitem"):
            return True
        home = node.device or "cpu"
        if dev.is_cpu != home.startswith("cpu") and not has_kernel(
                node.op, "CPU" if dev.is_cpu else "CUDA") and (dev.is_cpu or _CUDA_BUILT):
            return False  # a kernel of eager's kind of device only (cuDNN's attention)
        need = node.in_bytes + _bytes_written(node)
        return need <= self.machine.profile.device(dev.name).memory_bytes

    # -- links ---------------------------------------------------------------------------
    def transfer_time(self, nbytes: int, src: Device | str, dst: Device | str,
                      pinned: bool = True) -> float:
        """Seconds to move ``nbytes`` from ``src`` to ``dst`` (0 on the same memory)."""
        a = self.machine.device(src)
        b = self.machine.device(dst)
        if a == b or (a.is_cpu and b.is_cpu) or nbytes <= 0:
            return 0.0
        return self.machine.profile.link(a.name, b.name, pinned).time(nbytes)

    @property
    def host_sync_s(self) -> float:
        return self.machine.profile.host_sync_s

    @property
    def event_wait_s(self) -> float:
        return self.machine.profile.event_wait_s

    @property
    def crossing_s(self) -> float:
        return self.machine.profile.crossing_s

    # -- learning ------------------------------------------------------------------------
    def observe(self, node: Node, device: Device | str, seconds: float) -> None:
        """Record a measured time of ``node`` on ``device``: for a CPU worker its wall time, for
        a GPU its device time (CUDA events) or its per-op time in a back-to-back stream."""
        dev = self.machine.device(device)
        self.history.add(self.history_key(node, dev), seconds)
        self._times.clear()

    def history_key(self, node: Node, device: Device | str) -> str:
        dev = self.machine.device(device)
        return f"{'cpu' if dev.is_cpu else dev.name}|{signature(node)}"

    def save_history(self, path: Path | str | None = None) -> Path:
        return self.history.save(path)

    def _measured(self, node: Node, dev: Device) -> float | None:
        if not self.history.has_op(op_name(node.op)):
            return None
        return self.history.estimate(self.history_key(node, dev))

    def _rate_dtype(self, node: Node, dev: Device) -> str:
        dtype = _dtype_name(node)
        if dtype == "float32" and dev.is_gpu and node.kind == "matmul":
            allowed = self.tf32_conv if _schema_name(node) in _CONVOLUTIONS else self.tf32_matmul
            if allowed and "tf32" in self.machine.profile.device(dev.name).flops:
                return "tf32"
        return dtype


def _cuda_name(torch_device: str) -> str:
    return "cuda:0" if torch_device == "cuda" else torch_device
