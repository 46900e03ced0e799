"""doctor: run a function eagerly while watching it, and report what wastes time around the GPU.

``doctor(fn, *args)`` calls ``fn`` as eager PyTorch would and reports, per source line, every
hazard below with its count per call, its cost per call (measured where it can be timed, else
estimated by :class:`autopar.cost.CostModel`), a concrete fix and the time the fix would save.
``doctor_file("user.py")`` does the same for the functions of a file (``autopar doctor``).

Hazards (``Finding.kind`` / ``Finding.subkind``)
- ``sync``: the host stops and waits for the GPU.
  ``item``: ``.item()``, ``int()``, ``float()``, ``.tolist()`` of a GPU tensor (also reads made
  inside torch, e.g. ``torch.allclose``); ``branch``: ``bool()`` of a GPU tensor (``if``,
  ``while``, ``assert``); ``index``: a GPU tensor used as a Python int; ``slice-bound``:
  ``x[r0:r1]`` with 0-dim GPU bounds (each bound is read back); ``nonzero``; ``bool-mask``:
  ``x[mask]``, ``masked_select``; ``unique``; ``print``: printing or formatting a GPU tensor;
  ``pageable-nonblocking``: a ``non_blocking=True`` device->host copy into pageable memory (it
  blocks anyway).
- ``pageable-copy``: a blocking device->host copy into pageable memory (staged, slow).
- ``ping-pong``: a value copied from one device to another and back with nothing computed on it
  in between (host->device->host or device->host->device).
- ``gpu-scalar``: a 0-dim GPU tensor that came from the host (an argument, a constant, a copy,
  a result of scalar-only ops on such) used as a number: as an operand beside larger tensors, or
  as the only kind of operand (``a ** 2``: a kernel launch a Python number would not need).
- ``tiny-gpu-op``: a GPU op the cost model says the host would finish sooner. Inputs that came
  from the host could have stayed there; inputs computed on the GPU during the call would have
  to be copied back (a sync plus the transfer), and that is counted.

How it watches
- Two layers. A ``TorchFunctionMode`` sees the Python-level call the user made (``Tensor.item``,
  ``Tensor.__getitem__``, ``Tensor.__repr__``): it names the sub-kind, and a call that is one
  sync by itself (``.item()``, ``bool()``, printing) is recorded once, the ATen ops inside it
  hidden. A ``TorchDispatchMode`` sees every ATen op with its arguments: the device->host read
  ``aten._local_scalar_dense`` behind tensor slice bounds, the data-dependent-shape ops, copies,
  and every op to cost.
- Attribution: the innermost frame outside torch, autopar and the standard library: the user's
  ``file:line``. Events are grouped by (kind, sub-kind, file, line); counts and costs are per
  call, averaged over the watched calls.
- Runs: ``fn`` is called ``1 + 2 * repeat`` times: a warm-up, ``repeat`` timed calls (median wall
  time, every device synchronized around each) and ``repeat`` watched calls. A function that
  mutates its inputs sees the mutation repeated, as it would in a loop.
- Per-call state, keyed by storage (views share their base's). Origin of each GPU value:
  computed on the GPU (``"gpu"``), made by tiny GPU ops from host-origin values (``"tiny"``: it
  could have been made on the host instead), or, when absent, it came from the host (an
  argument, a constant, a copy, scalar-only ops on such). And which values were made by a copy
  from another device (for ping-pong). Both are reset at the start of each watched call.

Costs and savings (per event; the model is :class:`autopar.cost.CostModel` of the machine)
- sync that reads a value: costs its measured wall time on a real GPU, else the model's host time
  of ``_local_scalar_dense`` (launch + kernel + host sync) plus the pageable transfer of the rest
  of what is read; saves all of it.
- sync of a data-dependent shape (nonzero, bool-mask, unique): costs the op's host time with its
  sync; saves the wait (kernel time + host sync).
- pageable-copy, pageable-nonblocking: cost measured, else the pageable link's time; saves the
  pageable minus the pinned link time.
- ping-pong: costs and saves both transfers.
- gpu-scalar: a scalar-only op costs and saves its GPU time (Python arithmetic is free); an
  operand use costs 0 (the kernel runs anyway) and is reported because it keeps the scalar on
  the GPU.
- tiny-gpu-op: costs its GPU time, saves that minus the host time (and transfers).
A measured cost is the wall time of the call or op itself during the watched calls: a read
includes the wait for the GPU work queued before it, which is what a sync costs the host.

Simulation (a GPU on a machine without one)
- ``doctor(fn, *args, machine="h200x2", inputs_on="cuda:0")``: the argument tensors that really
  live on the host are *believed* to live on ``inputs_on``; ``autopar doctor --machine h200x2``
  on a host without CUDA simulates too. The report says ``simulated``.
- Beliefs follow eager PyTorch's rules: an op's output lives where its GPU inputs live (else on
  the host); code that names a GPU (``device="cuda"``, ``.cuda()``, ``.to("cuda:1")``,
  ``pin_memory=True``, ``.pin_memory()``) runs on the host, its results believed on that GPU (or
  in pinned host memory); ``.cpu()`` / ``.to("cpu")`` of a believed-GPU tensor makes a real copy,
  believed on the host; ``Tensor.device``, ``.is_cuda`` and ``.is_pinned()`` answer with the
  belief. Tensors the doctor never saw made are on their real device.
- What a simulation on a host without CUDA cannot run: ``torch.cuda.*`` calls (streams,
  ``synchronize``) raise as they would anyway, and ``torch.cuda.is_available()`` stays False.
- Costs come from the machine's profile (``h200x2`` by default: MEASURED.md's machine); the
  measured time per call is this host's, running on its CPU.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import os
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from .cost import CostModel
from .findings import FIXES, DoctorError, DoctorReport, Finding, short_path
from .graph import Graph, Node, TensorMeta, op_kind, op_name
from .machine import Machine, load_machine
from .units import fmt_bytes, fmt_seconds
from .userfile import UserFileError, example_args, load_module, needs_args, targets

__all__ = ["FIXES", "DoctorError", "DoctorReport", "Finding", "doctor", "doctor_file"]

_aten = torch.ops.aten


# -- attribution -----------------------------------------------------------------------------
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_AUTOPAR_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep
                      for k in ("stdlib", "platstdlib")})


@functools.lru_cache(maxsize=4096)
def _is_internal(filename: str) -> bool:
    """Frames that are never the user's line: torch, autopar, the standard library."""
    if filename.startswith("<frozen"):
        return True
    path = os.path.abspath(filename)
    if path.startswith((_TORCH_DIR, _AUTOPAR_DIR)):
        return True
    if "site-packages" in path or "dist-packages" in path:
        return False
    return path.startswith(_STDLIB_DIRS)


def _user_frame() -> tuple[str, int, str]:
    """(file, line, function) of the innermost frame outside torch, autopar and the stdlib."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if not _is_internal(code.co_filename):
            return code.co_filename, frame.f_lineno, code.co_name
        frame = frame.f_back
    return "<unknown>", 0, "<unknown>"


# -- devices: real, or believed (simulation) -------------------------------------------------
def _storage(t: torch.Tensor) -> Any | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, ...: no storage
        return None


def _is_gpu(device: str) -> bool:
    return device.startswith("cuda")


def _device_name(d: Any) -> str:
    """"cpu" or "cuda:N" for a device argument (str, torch.device, int: a CUDA index)."""
    if isinstance(d, int):
        return f"cuda:{d}"
    if isinstance(d, torch.device):
        if d.type == "cuda":
            return f"cuda:{d.index or 0}"
        return d.type
    s = str(d)
    if s == "cuda":
        return "cuda:0"
    if s.startswith("cpu"):
        return "cpu"
    return s


class _Devices:
    """Where the doctor takes each tensor to live: its real device, or in a simulation the
    belief recorded for its storage (see Simulation in the module docstring)."""

    def __init__(self, simulated: bool) -> None:
        self.simulated = simulated
        self._where: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._pinned: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.gpus_seen = False

    def where(self, t: torch.Tensor) -> str:
        if self.simulated:
            s = _storage(t)
            if s is not None:
                dev = self._where.get(s)
                if dev is not None:
                    return dev
        return _device_name(t.device)

    def pinned(self, t: torch.Tensor) -> bool:
        if self.simulated:
            s = _storage(t)
            return s is not None and s in self._pinned
        if t.device.type != "cpu" or not torch.cuda.is_available():
            return False
        return t.is_pinned()

    def believe(self, t: torch.Tensor, device: str, pinned: bool = False) -> None:
        s = _storage(t)
        if s is None:
            return
        self._where[s] = device
        if pinned:
            self._pinned[s] = True
        else:
            self._pinned.pop(s, None)


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


# -- costs -----------------------------------------------------------------------------------
class _Estimator:
    """Costs from the cost model, built lazily: a host without GPU work never loads a profile."""

    def __init__(self, machine: Machine | str | None, cost_model: CostModel | None) -> None:
        self._spec = machine
        self._model = cost_model
        self.notes: list[str] = []

    @property
    def model(self) -> CostModel:
        if self._model is None:
            m = self._spec if isinstance(self._spec, Machine) else load_machine(
                self._spec, cpu_workers=1)  # eager uses the whole host
            self._model = CostModel(m)
        return self._model

    @property
    def machine_name(self) -> str:
        if self._model is not None:
            return self._model.machine.name
        if isinstance(self._spec, Machine):
            return self._spec.name
        return "this host" if self._spec in (None, "auto") else str(self._spec)

    def gpu(self, device: str) -> str | None:
        """The machine's GPU for a believed device (its first GPU if it lacks that one)."""
        names = [d.name for d in self.model.machine.gpus]
        if device in names:
            return device
        if not names:
            self._note(f"machine {self.model.machine.name} has no GPU: costs of {device} "
                       "not estimated")
            return None
        return names[0]

    @property
    def cpu(self) -> str:
        return self.model.machine.cpus[0].name

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def safely(self, what: str, f: Callable[[], Any], default: Any = 0.0) -> Any:
        try:
            return f()
        except Exception as e:  # a cost the model can't give must not stop the diagnosis
            self._note(f"could not estimate {what}: {type(e).__name__}: {e}")
            return default

    def read_s(self, device: str, t: torch.Tensor) -> float:
        """Host time of reading ``t`` back: one scalar read (launch, kernel, sync), plus the
        pageable transfer of the rest."""
        gpu = self.gpu(device)
        if gpu is None:
            return 0.0

        def cost() -> float:
            g = Graph("doctor")
            x = g.input(TensorMeta.make((), t.dtype, gpu))
            node = g.call(_aten._local_scalar_dense.default, (x,), meta=())
            s = self.model.op_cost(node, gpu).host_s
            if t.numel() > 1:
                s += self.model.transfer_time(_nbytes(t), gpu, self.cpu, pinned=False)
            return s
        return self.safely("a device->host read", cost)

    def link_s(self, nbytes: int, src: str, dst: str, pinned: bool) -> float:
        a = self.gpu(src) if _is_gpu(src) else self.cpu
        b = self.gpu(dst) if _is_gpu(dst) else self.cpu
        if a is None or b is None:
            return 0.0
        return self.safely("a copy", lambda: self.model.transfer_time(nbytes, a, b, pinned))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _meta(t: torch.Tensor, device: str) -> TensorMeta:
    return replace(TensorMeta.of(t), device=device)


def _node(func: Any, args: tuple, kwargs: dict, out: Any, devices: _Devices,
          gpu: str) -> Node:
    """A one-op graph node of this call, tensors described with their believed devices (GPU
    ones as ``gpu``, the machine's name for them)."""
    g = Graph("doctor")
    inputs: dict[int, Node] = {}

    def dev(t: torch.Tensor) -> str:
        return gpu if _is_gpu(devices.where(t)) else "cpu"

    for t in _tensors((args, kwargs)):
        if id(t) not in inputs:
            inputs[id(t)] = g.input(_meta(t, dev(t)))

    def as_node(x: Any) -> Any:
        return inputs[id(x)] if isinstance(x, torch.Tensor) else x

    if isinstance(out, torch.Tensor):
        meta: Any = _meta(out, dev(out))
    else:
        meta = tuple(_meta(t, dev(t)) if isinstance(t, torch.Tensor) else None
                     for t in (out if isinstance(out, (tuple, list)) else ()))
    return g.call(func, tree_map(as_node, args), tree_map(as_node, kwargs), meta=meta)


# -- events ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Event:
    kind: str
    subkind: str
    file: str
    line: int
    function: str
    device: str
    cost_s: float
    measured: bool
    saving_s: float
    detail: str
    op: str


class _Context(NamedTuple):
    api: str  # "Tensor.item", "Tensor.__getitem__", "torch.allclose"
    name: str  # "item", "__getitem__", "allclose"
    hides_ops: bool  # a call recorded as one sync: the ATen ops inside are not looked at


class _Copy(NamedTuple):
    src: str
    dst: str
    where: str  # "file:line"
    cost_s: float


# Python-level calls that are one device->host read each: name -> sync sub-kind
_SYNC_CALLS = {
    "item": "item", "tolist": "item", "__int__": "item", "__float__": "item",
    "__complex__": "item", "__index__": "index", "__bool__": "branch", "__contains__": "branch",
    "__repr__": "print", "__str__": "print", "__format__": "print",
}
# the sync sub-kind of a scalar read made inside a Python-level call
_READ_IN = {"__getitem__": "slice-bound", "__setitem__": "slice-bound"}
# ATen ops whose output shape depends on the data: the host waits for the GPU
_SHAPE_SYNCS = {
    "aten::nonzero": "nonzero", "aten::masked_select": "bool-mask", "aten::_unique2": "unique",
    "aten::unique_dim": "unique", "aten::unique_consecutive": "unique",
}
_FACTORY_LIKE = frozenset({"aten::lift_fresh", "aten::lift", "aten::lift_fresh_copy"})


class _Watch:
    """State of one doctor session: beliefs, the current Python-level call, per-call
    bookkeeping, and the events of the watched calls."""

    def __init__(self, devices: _Devices, estimator: _Estimator) -> None:
        self.devices = devices
        self.est = estimator
        self.recording = False
        self.events: list[_Event] = []
        self._contexts: list[_Context] = []
        self._targets: list[tuple[str, bool]] = []  # simulation: (device, pinned) of new values
        self.origin: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> "gpu" | "tiny"
        self.copied: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> _Copy

    # -- modes -------------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self, recording: bool = False) -> Iterator[None]:
        self.recording = recording
        try:
            with _FunctionLayer(self), _OpLayer(self):
                yield
        finally:
            self.recording = False

    def begin_call(self) -> None:
        self.origin = WeakIdKeyDictionary()
        self.copied = WeakIdKeyDictionary()

    @contextlib.contextmanager
    def context(self, ctx: _Context) -> Iterator[None]:
        self._contexts.append(ctx)
        try:
            yield
        finally:
            self._contexts.pop()

    @contextlib.contextmanager
    def target(self, device: str, pinned: bool = False) -> Iterator[None]:
        self._targets.append((device, pinned))
        try:
            yield
        finally:
            self._targets.pop()

    @property
    def ctx(self) -> _Context | None:
        return self._contexts[-1] if self._contexts else None

    @property
    def hiding(self) -> bool:
        return any(c.hides_ops for c in self._contexts)

    def origin_of(self, t: torch.Tensor) -> str | None:
        """"gpu", "tiny", or None: the value came from the host (module docstring)."""
        s = _storage(t)
        return None if s is None else self.origin.get(s)

    def set_origin(self, tensors: Sequence[torch.Tensor], origin: str | None) -> None:
        """A new value was made in these storages: record its origin; it is no copy."""
        for t in tensors:
            s = _storage(t)
            if s is None:
                continue
            if origin is None:
                self.origin.pop(s, None)
            else:
                self.origin[s] = origin
            self.copied.pop(s, None)

    def emit(self, kind: str, subkind: str, device: str, cost_s: float, measured: bool,
             saving_s: float, detail: str, op: str) -> None:
        file, line, function = _user_frame()
        self.events.append(_Event(kind, subkind, file, line, function, device, cost_s,
                                  measured, saving_s, detail, op))

    # -- beliefs (simulation) ------------------------------------------------------------
    def place_outputs(self, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Eager's device rule for the outputs of an op (only a simulation needs it)."""
        if not self.devices.simulated:
            return
        if self._targets:
            device, pinned = self._targets[-1]
            for t in outs:
                self.devices.believe(t, device, pinned)
            return
        gpus = [d for d in (self.devices.where(t) for t in ins) if _is_gpu(d)]
        device = gpus[0] if gpus else "cpu"
        in_storages = {id(s) for s in map(_storage, ins) if s is not None}
        for t in outs:
            s = _storage(t)
            if s is not None and id(s) not in in_storages:  # views and in-place keep theirs
                self.devices.believe(t, device)

    # -- Python-level calls --------------------------------------------------------------
    def on_sync_call(self, ctx: _Context, subkind: str, t: torch.Tensor, elapsed: float) -> None:
        device = self.devices.where(t)
        est = self.est.read_s(device, t)
        real = not self.devices.simulated
        detail = (f"{ctx.api} of a {TensorMeta.of(t)} tensor on {device} waits for the GPU and "
                  "copies the value to the host")
        self.emit("sync", subkind, device, elapsed if real else est, real, est, detail, ctx.api)

    # -- ATen ops ------------------------------------------------------------------------
    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any, elapsed: float) -> None:
        ins = _tensors((args, kwargs))
        outs = _tensors(out)
        self.place_outputs(ins, outs)
        if not self.recording:
            return
        if any(_is_gpu(self.devices.where(t)) for t in ins + outs):
            self.devices.gpus_seen = True
        if self.hiding:
            return
        name = func._schema.name
        if name == "aten::_local_scalar_dense":
            self._on_read(ins[0], elapsed)
        elif name in _SHAPE_SYNCS:
            self._on_shape_sync(func, args, kwargs, out, _SHAPE_SYNCS[name], elapsed)
        elif _masks(name, args):
            self._on_shape_sync(func, args, kwargs, out, "bool-mask", elapsed)
        elif name in ("aten::_to_copy", "aten::copy_"):
            self._on_copy(func, args, kwargs, out, elapsed)
        elif name in _FACTORY_LIKE or not ins:
            pass  # a value made from host data: it came from the host
        elif outs and op_kind(func) != "view":
            self._on_compute(func, args, kwargs, out, ins, outs)

    def _on_read(self, t: torch.Tensor, elapsed: float) -> None:
        device = self.devices.where(t)
        if not _is_gpu(device):
            return
        ctx = self.ctx
        subkind = _READ_IN.get(ctx.name, "item") if ctx else "item"
        api = ctx.api if ctx else "a read inside torch"
        est = self.est.read_s(device, t)
        real = not self.devices.simulated
        what = ("a slice bound that is a 0-dim tensor on " + device if subkind == "slice-bound"
                else f"{api} reads a {TensorMeta.of(t)} tensor on {device}")
        self.emit("sync", subkind, device, elapsed if real else est, real, est,
                  f"{what}: the host waits for the GPU (aten._local_scalar_dense)",
                  "aten._local_scalar_dense")

    def _on_shape_sync(self, func: Any, args: tuple, kwargs: dict, out: Any, subkind: str,
                       elapsed: float) -> None:
        x = args[0]
        device = self.devices.where(x)
        if not _is_gpu(device):
            return
        gpu = self.est.gpu(device)
        cost = wait = 0.0
        if gpu is not None:
            node = _node(func, args, kwargs, out, self.devices, gpu)
            oc = self.est.model.op_cost(node, gpu)
            launch = self.est.model.machine.profile.device(gpu).launch_s
            wait = oc.device_s + self.est.model.host_sync_s
            cost = max(oc.host_s, launch + wait)
        real = not self.devices.simulated
        self.set_origin(_tensors(out), "gpu")
        self.emit("sync", subkind, device, elapsed if real else cost, real, wait,
                  f"{op_name(func)} on {device} has a data-dependent output shape: the host "
                  "waits for the GPU to learn it", op_name(func))

    def _on_copy(self, func: Any, args: tuple, kwargs: dict, out: Any, elapsed: float) -> None:
        d = self.devices
        if func._schema.name == "aten::copy_":
            dst_t, src_t = args[0], args[1]
            dst = d.where(dst_t)
            dst_pinned = d.pinned(dst_t)
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        else:
            src_t, dst_t = args[0], out
            if self._targets:  # a simulated move: the function layer says where to
                dst, dst_pinned = self._targets[-1]
            else:
                dev = kwargs.get("device")
                dst = _device_name(dev) if dev is not None else d.where(src_t)
                dst_pinned = bool(kwargs.get("pin_memory") or False)
            non_blocking = bool(kwargs.get("non_blocking", False))
        src = d.where(src_t)
        origin = self.origin_of(src_t) if _is_gpu(src) and _is_gpu(dst) else None
        move = None
        if src != dst:
            pinned = dst_pinned if _is_gpu(src) else d.pinned(src_t)
            cost = self._on_transfer(func, src_t, src, dst, pinned, non_blocking, elapsed)
            file, line, _ = _user_frame()
            move = _Copy(src, dst, f"{file}:{line}", cost)
        self.set_origin([dst_t], origin)
        s = _storage(dst_t)
        if move is not None and s is not None:
            self.copied[s] = move

    def _on_transfer(self, func: Any, src_t: torch.Tensor, src: str, dst: str, pinned: bool,
                     non_blocking: bool, elapsed: float) -> float:
        """Events of one copy between devices; returns its estimated time."""
        nbytes = _nbytes(src_t)
        cost = self.est.link_s(nbytes, src, dst, pinned)
        if _is_gpu(src) and not _is_gpu(dst) and not pinned:
            real = not self.devices.simulated
            pinned_s = self.est.link_s(nbytes, src, dst, True)
            kind, sub = ("sync", "pageable-nonblocking") if non_blocking else ("pageable-copy", "")
            how = ("non_blocking=True into pageable memory: it blocks the host anyway"
                   if non_blocking else "blocking, staged through a bounce buffer")
            self.emit(kind, sub, src, elapsed if real else cost, real, max(0.0, cost - pinned_s),
                      f"{op_name(func)} copies {fmt_bytes(nbytes)} from {src} into pageable host "
                      f"memory ({how})", op_name(func))
        s = _storage(src_t)
        origin = self.copied.get(s) if s is not None else None
        if origin is not None and origin.src == dst:
            both = origin.cost_s + cost
            self.emit("ping-pong", "", src if _is_gpu(src) else dst, both, False, both,
                      f"copied {origin.src}->{origin.dst} at {short_path(origin.where)}, then "
                      f"back to {dst} here, nothing computed in between", op_name(func))
        return cost

    def _on_compute(self, func: Any, args: tuple, kwargs: dict, out: Any,
                    ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        device = self.devices.where(outs[0])
        if not _is_gpu(device):
            self.set_origin(outs, None)  # a host value, and no longer a copy of anything
            return
        gpu = self.est.gpu(device)
        on_gpu = [t for t in ins if _is_gpu(self.devices.where(t))]
        origins = [self.origin_of(t) for t in on_gpu]
        scalars = [t for t, o in zip(on_gpu, origins) if o is None and t.dim() == 0]
        origin = "gpu"
        if gpu is None:
            pass
        elif scalars and len(scalars) == len(on_gpu):
            node = _node(func, args, kwargs, out, self.devices, gpu)
            t_gpu = self.est.safely(op_name(func), lambda: self.est.model.node_time(node, gpu))
            self.emit("gpu-scalar", "", device, t_gpu, False, t_gpu,
                      f"{op_name(func)} computes on 0-dim {device} tensors only: a kernel launch "
                      "a Python number would not need", op_name(func))
            origin = None  # scalars from the host make a scalar from the host
        else:
            if scalars:
                big = max(on_gpu, key=lambda t: t.numel())
                self.emit("gpu-scalar", "", device, 0.0, False, 0.0,
                          f"{op_name(func)} takes a 0-dim {device} tensor that came from the "
                          f"host beside a {TensorMeta.of(big)} tensor", op_name(func))
            if self._check_tiny(func, args, kwargs, out, gpu, device, on_gpu, origins):
                origin = "tiny"
        self.set_origin(outs, origin)

    def _check_tiny(self, func: Any, args: tuple, kwargs: dict, out: Any, gpu: str, device: str,
                    on_gpu: list[torch.Tensor], origins: list[str | None]) -> bool:
        """Emit a tiny-gpu-op event if the host would be sooner; True if the output could then
        have lived on the host with no copy at all."""
        model = self.est.model
        node = _node(func, args, kwargs, out, self.devices, gpu)
        cpu = self.est.cpu
        if not model.can_run(node, cpu):
            return False
        back = [t for t, o in zip(on_gpu, origins) if o == "gpu"]

        def times() -> tuple[float, float]:
            t_cpu = model.node_time(node, cpu)
            for t in back:  # the user's fix would be a `.cpu()`: a pageable copy
                t_cpu += model.transfer_time(_nbytes(t), gpu, cpu, pinned=False)
            if back:
                t_cpu += model.host_sync_s
            return model.node_time(node, gpu), t_cpu

        t_gpu, t_cpu = self.est.safely(op_name(func), times, (0.0, 0.0))
        if t_cpu >= t_gpu:
            return False
        self.emit("tiny-gpu-op", "", device, t_gpu, False, t_gpu - t_cpu,
                  f"{op_name(func)} on {_shapes(node)}: {fmt_seconds(t_gpu)} on {device}, "
                  f"{fmt_seconds(t_cpu)} on the host"
                  + (" counting the copy of its inputs back" if back else ""), op_name(func))
        return not back


def _masks(name: str, args: tuple) -> bool:
    """Indexing with a boolean mask: the result's shape depends on the data. (Writing one value
    through a mask, ``x[mask] = 0``, is a masked_fill and does not sync.)"""
    if name not in ("aten::index", "aten::index_put_", "aten::index_put",
                    "aten::_index_put_impl_"):
        return False
    indices = args[1] if len(args) > 1 else ()
    if not any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ())):
        return False
    return name == "aten::index" or (len(args) > 2 and args[2].numel() > 1)


def _shapes(node: Node) -> str:
    return ", ".join(str(m) for i in node.inputs for m in i.tensor_metas)




# -- the two layers --------------------------------------------------------------------------
class _Api(NamedTuple):
    display: str  # "Tensor.item", "Tensor.device", "torch.zeros"
    name: str  # "item", "device", "zeros"
    getter: bool  # a property read (Tensor.device, Tensor.is_cuda)


def _api(func: Any) -> _Api:
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":
        return _Api(f"Tensor.{owner.__name__}", owner.__name__, True)
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    cls, _, name = qual.rpartition(".")
    if cls in ("TensorBase", "Tensor"):
        return _Api(f"Tensor.{name}", name, False)
    return _Api(f"torch.{name}", name, False)


def _parse_to(t: torch.Tensor, args: tuple, kwargs: dict,
              devices: _Devices) -> tuple[str | None, Any, bool, bool, Any]:
    """(device, dtype, non_blocking, copy, memory_format) of ``t.to(*args, **kwargs)``."""
    device = kwargs.get("device")
    dtype = kwargs.get("dtype")
    non_blocking = kwargs.get("non_blocking", False)
    copy = kwargs.get("copy", False)
    rest = list(args)
    if rest and isinstance(rest[0], torch.Tensor):
        other = rest.pop(0)
        device, dtype = devices.where(other), other.dtype
    elif rest and isinstance(rest[0], (str, int, torch.device)):
        device = rest.pop(0)
    if rest and isinstance(rest[0], torch.dtype):
        dtype = rest.pop(0)
    if rest:
        non_blocking = rest.pop(0)
    if rest:
        copy = rest.pop(0)
    return (None if device is None else _device_name(device), dtype, bool(non_blocking),
            bool(copy), kwargs.get("memory_format"))


class _FunctionLayer(TorchFunctionMode):
    """Names what the user called; runs GPU-naming code on the host in a simulation."""

    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        api = _api(func)
        if self.watch.devices.simulated:
            done, result = self._simulate(func, api, args, kwargs)
            if done:
                return result
        subkind = _SYNC_CALLS.get(api.name)
        t = args[0] if args else None
        if (subkind and not api.getter and isinstance(t, torch.Tensor)
                and _is_gpu(self.watch.devices.where(t))):
            with self.watch.context(_Context(api.display, api.name, True)):
                start = time.perf_counter()
                result = func(*args, **kwargs)
                elapsed = time.perf_counter() - start
            if self.watch.recording and not self.watch.hiding:
                self.watch.on_sync_call(_Context(api.display, api.name, True), subkind, t,
                                        elapsed)
            return result
        with self.watch.context(_Context(api.display, api.name, False)):
            return func(*args, **kwargs)

    # -- simulation ----------------------------------------------------------------------
    def _simulate(self, func: Any, api: _Api, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        d = self.watch.devices
        self_t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if api.getter and self_t is not None and api.name in ("device", "is_cuda", "is_cpu"):
            dev = d.where(self_t)
            value = {"device": torch.device(dev), "is_cuda": _is_gpu(dev),
                     "is_cpu": not _is_gpu(dev)}[api.name]
            return True, value
        if api.getter:
            return False, None
        if self_t is not None and api.display.startswith("Tensor."):
            if api.name == "is_pinned":
                return True, d.pinned(self_t)
            if api.name == "pin_memory":
                return True, self._move(self_t, "cpu", pinned=True, force=True)
            if api.name == "cpu":
                return True, self._move(self_t, "cpu")
            if api.name == "cuda":
                dev = args[1] if len(args) > 1 else kwargs.get("device")
                nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                return True, self._move(self_t, _device_name(0 if dev is None else dev),
                                        non_blocking=bool(nb))
            if api.name == "to":
                dev, dtype, nb, copy, fmt = _parse_to(self_t, args[1:], kwargs, d)
                if dev is None or (dev == d.where(self_t) and not _is_gpu(dev)):
                    return False, None  # nothing about devices (or host to host): run as is
                return True, self._move(self_t, dev, dtype=dtype, non_blocking=nb,
                                        force=copy, memory_format=fmt)
        dev_arg = kwargs.get("device")
        pin = bool(kwargs.get("pin_memory") or False)
        cuda = dev_arg is not None and _is_gpu(_device_name(dev_arg))
        if not (cuda or pin):
            return False, None
        new = dict(kwargs)
        if cuda:
            new["device"] = "cpu"
        if pin:
            new["pin_memory"] = False
        target = self._check(_device_name(dev_arg)) if cuda else "cpu"
        with self.watch.target(target, pinned=pin and not cuda), \
                self.watch.context(_Context(api.display, api.name, False)):
            return True, func(*args, **new)

    def _check(self, device: str) -> str:
        names = [g.name for g in self.watch.est.model.machine.gpus]
        if device not in names:
            raise DoctorError(f"the simulated machine {self.watch.est.machine_name} has no "
                             f"{device} (it has {names or 'no GPU'}): name one of its GPUs")
        return device

    def _move(self, t: torch.Tensor, device: str, *, pinned: bool = False, dtype: Any = None,
              non_blocking: bool = False, force: bool = False, memory_format: Any = None) -> Any:
        """``t.to(device)`` as a real copy into host memory, the result believed on ``device``
        (a real CUDA tensor, on a GPU host that simulates, is copied to the host too)."""
        if _is_gpu(device):
            device = self._check(device)
        same = device == self.watch.devices.where(t) and (dtype is None or dtype == t.dtype)
        if same and not force and not pinned:
            return t
        extra = {} if memory_format is None else {"memory_format": memory_format}
        with self.watch.target(device, pinned), \
                self.watch.context(_Context(f"Tensor.to({device})", "to", False)):
            return t.to("cpu", dtype=dtype or t.dtype, non_blocking=non_blocking, copy=True,
                        **extra)


class _OpLayer(TorchDispatchMode):
    """Sees every ATen op: keeps beliefs, times reads, records events."""

    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed = time.perf_counter() - start
        with torch._C.DisableTorchFunction():  # our own looks at tensors are not the user's
            self.watch.on_op(func, args, kwargs, out, elapsed)
        return out


# -- running ---------------------------------------------------------------------------------
def _sync_devices(devices: _Devices) -> None:
    if not devices.simulated and torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


class _Session:
    """One machine, one set of beliefs: a call to :func:`doctor`, or one file of the CLI."""

    def __init__(self, machine: Machine | str | None, inputs_on: str | None,
                 cost_model: CostModel | None) -> None:
        if cost_model is not None:
            machine = cost_model.machine
        resolved: Machine | None = None
        if isinstance(machine, Machine):
            resolved = machine
        elif machine not in (None, "auto"):
            resolved = _load(machine)
        has_cuda = torch.cuda.is_available()
        simulated = inputs_on is not None or (
            resolved is not None and bool(resolved.gpus) and not has_cuda)
        if simulated and resolved is None:
            if machine == "auto" and not has_cuda:
                raise DoctorError(f"inputs_on={inputs_on!r} needs a machine with that GPU, and "
                                 "this host has none: pass machine='h200x2' (or another preset) "
                                 "to simulate one")
            resolved = _load("h200x2" if machine is None else machine)
        if inputs_on is not None:
            inputs_on = _device_name(inputs_on)
            names = [g.name for g in resolved.gpus] if resolved is not None else []
            if not _is_gpu(inputs_on) or inputs_on not in names:
                raise DoctorError(f"inputs_on={inputs_on!r}: name the GPU the inputs are taken "
                                 f"to live on, one of machine {resolved.name}'s: "
                                 f"{names or 'it has no GPU'}")
        self.inputs_on = inputs_on
        self.devices = _Devices(simulated)
        self.est = _Estimator(resolved if resolved is not None else machine, cost_model)
        self.watch = _Watch(self.devices, self.est)

    @property
    def simulated(self) -> bool:
        return self.devices.simulated

    def setup(self) -> contextlib.AbstractContextManager:
        """Where code that makes values (imports, example inputs) runs: in a simulation, under
        the layers, so GPU-naming code runs and its values get beliefs."""
        return self.watch.active() if self.simulated else contextlib.nullcontext()

    def believe_inputs(self, args: tuple) -> None:
        if self.inputs_on is None:
            return
        for t in _tensors(args):
            if t.device.type == "cpu":
                self.devices.believe(t, self.inputs_on)

    def diagnose(self, fn: Callable[..., Any], args: tuple, repeat: int) -> DoctorReport:
        if repeat < 1:
            raise DoctorError(f"repeat={repeat}: watch at least one call")
        self.believe_inputs(args)
        self.devices.gpus_seen = False
        self.est.notes = []
        with self.setup():
            fn(*args)  # warm-up: lazy inits, allocator, caches
            times = []
            for _ in range(repeat):
                _sync_devices(self.devices)
                start = time.perf_counter()
                fn(*args)
                _sync_devices(self.devices)
                times.append(time.perf_counter() - start)
        watch = self.watch
        watch.events = []
        for _ in range(repeat):
            watch.begin_call()
            with watch.active(recording=True):
                fn(*args)
            _sync_devices(self.devices)
        return self._report(fn, statistics.median(times), repeat)

    def _report(self, fn: Callable[..., Any], per_call: float, calls: int) -> DoctorReport:
        notes: list[str] = []
        if self.simulated:
            inputs = (f"argument tensors on the host taken to live on {self.inputs_on}"
                      if self.inputs_on else "values live where the code made them")
            notes.append(f"simulated: values believed on a GPU ran on this host's CPU ({inputs})")
        if not self.devices.gpus_seen:
            hint = ("" if torch.cuda.is_available() or self.simulated else
                    ": this host has no GPU; simulate one with machine='h200x2', "
                    "inputs_on='cuda:0' (CLI: --machine h200x2)")
            notes.append(f"no value was on a GPU{hint}")
        notes += self.est.notes
        time_note = ("measured on this host's CPU, GPUs simulated: not the target's time"
                     if self.simulated else "measured, devices synchronized")
        return DoctorReport(
            target=getattr(fn, "__qualname__", None) or repr(fn), source=_source_of(fn),
            machine=self.est.machine_name, simulated=self.simulated, calls=calls,
            time_per_call_s=per_call, time_note=time_note,
            findings=_findings(self.watch.events, calls), notes=notes)


def _load(spec: str) -> Machine:
    try:
        return load_machine(spec, cpu_workers=1)  # eager uses the whole host
    except ValueError as e:
        raise DoctorError(str(e)) from None


def _source_of(fn: Callable[..., Any]) -> str:
    try:
        target = inspect.unwrap(fn)
        return f"{inspect.getsourcefile(target)}:{inspect.getsourcelines(target)[1]}"
    except (TypeError, OSError):
        return ""


def _findings(events: list[_Event], calls: int) -> list[Finding]:
    groups: dict[tuple[str, str, str, int], list[_Event]] = {}
    for e in events:
        groups.setdefault((e.kind, e.subkind, e.file, e.line), []).append(e)
    out = []
    for (kind, subkind, file, line), evs in groups.items():
        measured = {e.measured for e in evs}
        source = ("measured" if measured == {True} else "estimated" if measured == {False}
                  else "measured+estimated")
        details = list(dict.fromkeys(e.detail for e in evs))
        message = "; ".join(details[:3]) + (f"; and {len(details) - 3} more" if
                                            len(details) > 3 else "")
        out.append(Finding(
            kind=kind, subkind=subkind, file=file, line=line, function=evs[0].function,
            code=linecache.getline(file, line).strip(), count=len(evs) / calls,
            cost_s=sum(e.cost_s for e in evs) / calls, cost_source=source,
            saving_s=sum(e.saving_s for e in evs) / calls, fix=FIXES[(kind, subkind)],
            message=message, ops=tuple(dict.fromkeys(e.op for e in evs)),
            device=evs[0].device))
    out.sort(key=lambda f: (-f.saving_s, -f.cost_s, f.file, f.line, f.label))
    return out


def doctor(fn: Callable[..., Any], *args: Any, machine: Machine | str | None = None,
           inputs_on: str | None = None, repeat: int = 3,
           cost_model: CostModel | None = None) -> DoctorReport:
    """Run ``fn(*args)`` eagerly while watching, and report its hazards (module docstring).

    ``machine``: whose costs to estimate with: a :class:`~autopar.machine.Machine`, a preset
    name, or None / "auto" (this host; ``h200x2`` when simulating). ``inputs_on``: simulate:
    argument tensors on the host are taken to live on this GPU (e.g. "cuda:0"); a preset with
    GPUs on a host without CUDA simulates too. ``repeat``: timed calls and watched calls.
    ``cost_model``: use this one (its machine) instead of building one.
    """
    return _Session(machine, inputs_on, cost_model).diagnose(fn, args, repeat)


# -- files (the CLI) -------------------------------------------------------------------------
def doctor_file(path: str | Path, func: str | None = None,
                machine: Machine | str | None = "auto", repeat: int = 3) -> list[DoctorReport]:
    """``autopar doctor FILE.py``: import the file and diagnose its functions.

    Which functions: ``func`` (names, comma-separated), else those named in the file's
    ``__doctor__`` list, else ``main``. A function that takes arguments gets them from the file's
    ``example_inputs()``: a tuple, or a dict of tuples by function name. A preset ``machine``
    with GPUs on a host without CUDA simulates them; the file then runs with its GPU-naming code
    on the host (module docstring, Simulation).
    """
    path = Path(path)
    session = _Session(machine, None, None)
    try:
        with _hint_without_cuda(session), session.setup():
            module = load_module(path)
        with _hint_without_cuda(session):
            reports = []
            for name, fn in targets(module, path, func, listed="__doctor__"):
                with session.setup():
                    args = example_args(module, path, name) if needs_args(fn) else ()
                reports.append(session.diagnose(fn, args, repeat))
    except UserFileError as e:
        raise DoctorError(str(e)) from None
    return reports


@contextlib.contextmanager
def _hint_without_cuda(session: _Session) -> Iterator[None]:
    """Code written for a GPU, run for real on a host without CUDA: say how to simulate one."""
    try:
        yield
    except (AssertionError, RuntimeError) as e:
        if session.simulated or torch.cuda.is_available() or "CUDA" not in str(e):
            raise
        raise DoctorError(f"the code needs CUDA ({e}), and this host has none: simulate a GPU "
                          "machine with --machine h200x2 (or another preset)") from e
