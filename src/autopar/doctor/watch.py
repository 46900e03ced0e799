"""The doctor's watch: the two layers (a ``TorchFunctionMode`` for the user's Python-level calls,
a ``TorchDispatchMode`` for every ATen op) and the per-call state that turns what they see into
hazard events (syncs, pageable copies, ping-pong, GPU scalars, tiny GPU ops). See
:mod:`autopar.doctor` for the policy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ..ir.graph import Node, TensorMeta, op_kind, op_name
from ..ir.units import fmt_bytes, fmt_seconds
from .beliefs import (
    _device_name,
    _Devices,
    _Estimator,
    _is_gpu,
    _nbytes,
    _node,
    _storage,
    _tensors,
    _user_frame,
)
from .findings import DoctorError, short_path

_aten = torch.ops.aten


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
        elif name in _FACTORY_LIKE:  # a value made from Python data (torch.tensor(...))
            if outs and _is_gpu(self.devices.where(outs[0])):
                self._on_host_data(func, outs[0], elapsed)
        elif not ins:
            pass  # a value made on the spot (a factory): nothing came from elsewhere
        elif outs and op_kind(func) != "view":
            self._on_compute(func, args, kwargs, out, ins, outs)

    def _on_host_data(self, func: Any, t: torch.Tensor, elapsed: float) -> None:
        """``torch.tensor(data, device=gpu)``: the data copied from pageable host memory to the
        GPU, at every call, the host waiting for it."""
        device, nbytes = self.devices.where(t), _nbytes(t)
        real = not self.devices.simulated
        cost = elapsed if real else self.est.link_s(nbytes, "cpu", device, False)
        self.emit("host-data", "", device, cost, real, cost,
                  f"a tensor made from Python data ({fmt_bytes(nbytes)}) is copied to {device} "
                  "from pageable host memory at each call, the host waiting for it",
                  op_name(func))

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


