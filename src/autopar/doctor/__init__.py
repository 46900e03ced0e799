"""doctor: run a function eagerly while watching it, and report what wastes time around the GPU.

``doctor(fn, *args)`` calls ``fn`` as eager PyTorch would and reports, per source line, every
hazard below with its count per call, its cost per call (measured where it can be timed, else
estimated by :class:`autopar.cost.model.CostModel`), a concrete fix and the time the fix would save.
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
- ``host-data``: a tensor made from Python data on a GPU (``torch.tensor(0.01,
  device="cuda")``) at every call: a copy from pageable host memory the host waits for.
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

Costs and savings (per event; the model is :class:`autopar.cost.model.CostModel` of the machine)
- sync that reads a value: costs its measured wall time on a real GPU, else the model's host time
  of ``_local_scalar_dense`` (launch + kernel + host sync) plus the pageable transfer of the rest
  of what is read; saves all of it.
- sync of a data-dependent shape (nonzero, bool-mask, unique): costs the op's host time with its
  sync; saves the wait (kernel time + host sync).
- pageable-copy, pageable-nonblocking: cost measured, else the pageable link's time; saves the
  pageable minus the pinned link time.
- ping-pong: costs and saves both transfers.
- host-data: costs and saves its measured time, else the pageable host->GPU link's time.
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

Modules: :mod:`~autopar.doctor.beliefs` (where tensors live, source attribution, costs),
:mod:`~autopar.doctor.watch` (the two layers and the per-call state that make events), and this
one (running the calls, grouping events into findings, files for the CLI).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import linecache
import runpy
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..cost.model import CostModel
from ..machine.detect import load_machine
from ..machine.host import no_cuda_error
from ..machine.model import Machine
from ..report.userfile import (
    UserFileError,
    example_args,
    load_module,
    needs_args,
    targets,
    users_error,
)
from .beliefs import (
    _device_name,
    _Devices,
    _Estimator,
    _is_gpu,
    _tensors,
)
from .findings import FIXES, DoctorError, DoctorReport, Finding, UserCodeError
from .watch import (
    _Event,
    _Watch,
)

__all__ = ["FIXES", "DoctorError", "DoctorReport", "Finding", "UserCodeError", "doctor",
           "doctor_file"]


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

    def diagnose(self, fn: Callable[..., Any], args: tuple, repeat: int,
                 warm: bool = True) -> DoctorReport:
        """Time ``fn(*args)`` (after a warm-up call), then watch ``repeat`` calls; ``warm``
        False: one call only, watched and timed at once (a whole script)."""
        if repeat < 1:
            raise DoctorError(f"repeat={repeat}: watch at least one call")
        self.believe_inputs(args)
        self.devices.gpus_seen = False
        self.est.notes = []
        times = []
        if warm:
            with self.setup():
                fn(*args)  # warm-up: lazy inits, allocator, caches
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
            start = time.perf_counter()
            with watch.active(recording=True):
                fn(*args)
            _sync_devices(self.devices)
            if not warm:
                times.append(time.perf_counter() - start)
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
                    "inputs_on='cuda:0' (CLI: --machine h200x2 --inputs-on cuda:0)")
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
    if getattr(fn, "_autopar_source", None):  # a whole script: the file itself
        return fn._autopar_source
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

    ``machine``: whose costs to estimate with: a :class:`~autopar.machine.model.Machine`, a preset
    name, or None / "auto" (this host; ``h200x2`` when simulating). ``inputs_on``: simulate:
    argument tensors on the host are taken to live on this GPU (e.g. "cuda:0"); a preset with
    GPUs on a host without CUDA simulates too. ``repeat``: timed calls and watched calls.
    ``cost_model``: use this one (its machine) instead of building one.
    """
    return _Session(machine, inputs_on, cost_model).diagnose(fn, args, repeat)


# -- files (the CLI) -------------------------------------------------------------------------
def doctor_file(path: str | Path, func: str | None = None,
                machine: Machine | str | None = "auto", repeat: int = 3,
                inputs_on: str | None = None) -> list[DoctorReport]:
    """``autopar doctor FILE.py``: import the file and diagnose its functions.

    Which functions: ``func`` (names, comma-separated), else those named in the file's
    ``__doctor__`` list, else ``main``. A function that takes arguments gets them from the file's
    ``example_inputs()``: a tuple, or a dict of tuples by function name. A preset ``machine``
    with GPUs on a host without CUDA simulates them; the file then runs with its GPU-naming code
    on the host (module docstring, Simulation), and ``inputs_on`` takes the argument tensors
    built on the host to live there (as :func:`doctor`'s).
    """
    path = Path(path)
    session = _Session(machine, inputs_on, None)
    if func is None and is_plain_script(path):
        return [_doctor_script(session, path)]
    try:
        with _hint_without_cuda(session), session.setup():
            module = load_module(path)
        with _hint_without_cuda(session):
            reports = []
            for name, fn in targets(module, path, func, listed="__doctor__"):
                with session.setup():
                    args = example_args(module, path, name) if needs_args(fn) else ()
                try:
                    reports.append(session.diagnose(fn, args, repeat))
                except Exception as e:  # the user's function raised: one line, if it did
                    said = users_error(e, path, f"{name}(...)")
                    if said is None:
                        raise
                    raise UserCodeError(said) from None
    except UserFileError as e:
        raise DoctorError(str(e)) from None
    return reports


def is_plain_script(path: Path) -> bool:
    """Does the file at ``path`` define neither ``main`` nor ``__doctor__`` (read, not run)?"""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return False  # load_module says what is wrong with it
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return not names & {"main", "__doctor__"}


def _doctor_script(session: _Session, path: Path) -> DoctorReport:
    """Run a plain script once as ``__main__`` (its ``if __name__ == "__main__":`` block too),
    watched, as a profiler runs a script."""
    def script() -> None:
        argv, sys.argv = sys.argv, [str(path)]
        folder = str(path.resolve().parent)
        sys.path.insert(0, folder)
        try:
            runpy.run_path(str(path), run_name="__main__")
        finally:
            sys.argv = argv
            with contextlib.suppress(ValueError):
                sys.path.remove(folder)
    script.__name__ = script.__qualname__ = path.name
    script._autopar_source = str(path)  # type: ignore[attr-defined]
    try:
        with _hint_without_cuda(session):
            return session.diagnose(script, (), repeat=1, warm=False)
    except SystemExit as e:  # the script's own exit: a failure only if it says so
        if e.code not in (None, 0):
            raise UserCodeError(f"{path} exited with {e.code!r}") from None
        raise DoctorError(f"{path} called sys.exit before the watch ended") from None
    except Exception as e:  # the script raised: one line, where it did
        said = users_error(e, path, path.name)
        if said is None:
            raise
        raise UserCodeError(said) from None


@contextlib.contextmanager
def _hint_without_cuda(session: _Session) -> Iterator[None]:
    """Code written for a GPU, run for real on a host without CUDA: say how to simulate one."""
    try:
        yield
    except (AssertionError, RuntimeError, UserFileError) as e:
        cause = e.__cause__ if isinstance(e, UserFileError) else e  # (example_inputs' error)
        if session.simulated or torch.cuda.is_available() or cause is None or \
                not no_cuda_error(cause):
            raise
        raise DoctorError(f"the code needs CUDA ({e}), and this host has none: simulate a GPU "
                          "machine with --machine h200x2 (or another preset)") from e
