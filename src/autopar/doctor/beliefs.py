"""The doctor's beliefs about tensors and costs: where each tensor lives (really, or believed on a
simulated GPU), which user source line an event belongs to, and what an op or copy costs on the
machine (measured where it can be timed, else the cost model's estimate). See
:mod:`autopar.doctor` for the policy.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from ..cost.model import CostModel
from ..ir.graph import Graph, Node, TensorMeta
from ..machine.detect import load_machine
from ..machine.model import Machine

_aten = torch.ops.aten



# -- attribution -----------------------------------------------------------------------------
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_AUTOPAR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # autopar/
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


