"""The front door: ``autopar.compile(fn, **options)`` and ``autopar.data_parallel(step)``.

Policy
- Options are validated before anything is traced (:mod:`autopar.options`).
- What ``compile`` returns is a :class:`~autopar.dispatch.Dispatcher` (for a module: put in
  its ``forward``), which runs each argument signature the way the measured choice kept
  (:mod:`autopar.dispatch`); autopar's own way sends every captured graph through the
  compile pipeline (:mod:`autopar.pipeline`).
- ``data_parallel`` in a process launched by ``torchrun`` runs each rank's share
  (:mod:`autopar.distributed`); alone, it splits the batch over this process's devices
  (:mod:`autopar.dataparallel`).

Map: options.py (what a user may ask) -> pipeline.py (a graph placed, planned, run) ->
dispatch.py (the way kept per signature) -> api.py (the two entry points).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import torch

from .capture.direct import Direct
from .capture.dynamo import (
    WaySwitch,
    capturing_scalars,
    make_backend,
    with_own_code,
)
from .dataparallel import DataParallelStep
from .dispatch import (
    SPLIT_MIN_S,
    Dispatcher,
    _inductor_alone,
    _name,
    _of_kind,
    _switched_on,
    dispatcher_of,
)
from .distributed.step import DistributedStep
from .distributed.world import World
from .machine.model import parse_devices
from .options import GUARDS, CompileOptions, Options
from .pipeline import Runner, make_runner
from .runtime.cudagraphs import GraphedCall

__all__ = ["GUARDS", "SPLIT_MIN_S", "CompileOptions", "CompiledModule", "Dispatcher", "Options",
           "Runner", "compile", "data_parallel", "dispatcher_of", "make_runner", "parse_devices"]

log = logging.getLogger("autopar.placement")


def compile(fn: Callable, **options: Unpack[CompileOptions]) -> Callable:
    """Compile ``fn`` (a function or ``nn.Module``) to run with autopar.

    Options: ``devices`` ("auto", "cpu:0,cpu:1", ["cuda:0", "cuda:1"]), ``policy`` ("heft",
    "single", "round_robin"), ``machine`` (None: this machine's calibrated profile; a Machine
    to plan with other numbers), ``trace`` (True records timelines; a path also writes the
    latest call's Chrome trace there; default ``$AUTOPAR_TRACE``), ``fuse`` ("auto": Inductor
    compiles the fusible regions of GPU programs; True: of every program, CPU workers too;
    False: every op runs as its own ATen call), ``cuda_graphs`` ("auto": GPU segments with
    static shapes are replayed as CUDA graphs where that pays; True: every capturable one;
    False: never), ``candidates`` (the ways the measured choice may keep: "auto" for
    eager, inductor, autopar, cudagraphs and split (an inference batch split over the named
    devices of its kind), or a list of them, e.g. ``["eager", "autopar"]``; default
    ``$AUTOPAR_CANDIDATES``; see :mod:`autopar.choose`), ``guards``
    ("all": every call of autopar's way goes through dynamo and all its guards; "arguments":
    see below).

    ``guards="arguments"`` is a contract: ``fn``'s result depends only on its arguments, and
    the modules and globals it reads do not change between calls. Under it, a call of
    autopar's way whose arguments (positional: tensors and plain values) match a signature
    seen before runs that signature's graph straight away, without entering dynamo (no frame,
    no guards; constants made inside are folded as ever). Checked still, cheaply: each
    tensor's shape, strides, dtype and device, each plain value, grad mode, autocast, a
    module's ``training``, the ``_version`` of every parameter and buffer the graph reads and
    the identity of every global tensor: a change there sends the call through dynamo again
    (re-guarded, recaptured as need be). Not detected (the contract's to keep): Python side
    effects of ``fn``, a module's attributes, hooks or parameter objects replaced, non-tensor
    globals, torch's other global state. Calls of graph breaks, mutating graphs or training
    graphs keep going through dynamo. See :mod:`autopar.capture.direct`.
    """
    if not callable(fn):
        raise TypeError(
            f"autopar.compile expects a function or nn.Module, got {type(fn).__name__}")

    opts = Options.parse(options)
    runner = make_runner(opts)
    runner.cost_model()  # resolve (and if need be calibrate) the machine now, not mid-trace
    name = getattr(fn, "__name__", None) or type(fn).__name__
    module = fn if isinstance(fn, torch.nn.Module) else None
    direct = switch = None
    # a function's own code object: dynamo keeps its entries per code object, and the ninth
    # autopar.compile of one function (a notebook cell run again) ran it plainly, unsaid
    traced = with_own_code(fn)
    if opts.guards == "arguments":  # a static graph per signature: each is learned alone
        direct = Direct(fn if module is None else fn.forward, module=module)
        dynamo = torch.compile(traced, backend=make_backend(runner, name=name,
                                                            learn=direct.record), dynamic=False)
    else:  # one trace for autopar's way and Inductor's (capture.dynamo's WaySwitch)
        switch = WaySwitch(replay=GraphedCall) if runner.inductor_candidate and \
            not opts.trace else None
        dynamo = torch.compile(traced, backend=make_backend(runner, name=name, switch=switch))
    compiled = capturing_scalars(dynamo, needed=lambda: not runner.graphs or runner.reads_scalars,
                                 failed=direct.scalars_failed if direct is not None else None)
    ours = compiled.forward if module is not None else compiled
    if direct is not None:
        direct.compiled, ours = ours, direct
    alone = functools.partial(_inductor_alone, module if module is not None else fn)
    make_way = functools.partial(_switched_on, switch, ours) if switch is not None else alone
    eager = module.__call__ if module is not None else fn
    split = DataParallelStep(eager, opts, None, unsplit=eager, cost_model=runner.cost_model,
                             measured=False, name=_name(eager)) \
        if "split" in opts.candidates and any(
            _of_kind(opts.devices, kind) > 1 for kind in ("cpu", "cuda")) else None
    if module is not None:
        compiled.forward = Dispatcher(  # type: ignore[method-assign]
            eager, ours, runner, make_way=make_way, switch=switch,
            key_extra=lambda: module.training, split=split, make_alone=alone)
        compiled.__class__ = CompiledModule
        compiled.autopar_options = dict(options)
        return compiled
    return Dispatcher(fn, ours, runner, make_way=make_way, switch=switch, split=split,
                      make_alone=alone)


class CompiledModule(torch._dynamo.eval_frame.OptimizedModule):
    """What :func:`compile` returns for a module: ``torch.compile``'s wrapper (the module is
    ``_orig_mod``, its ``state_dict`` keys are prefixed as ``torch.compile``'s), its
    ``forward`` autopar's :class:`Dispatcher`. Pickled (``torch.save``) and deep-copied (an EMA
    copy) as :func:`compile` of the module with the same options: the trials, plans and
    compiled code are this process's, and the copy chooses anew (as the wrapper alone, it
    would keep autopar's backend, shared with the original, and skip the measured choice)."""

    # class attributes, so that the wrapper's __setattr__ sets them on the instance (not the
    # module)
    autopar_options: dict[str, Any] | None = None
    said_generate = False  # the warning of __getattr__ said

    def __reduce__(self) -> tuple[Callable, tuple[torch.nn.Module, dict[str, Any]]]:
        return _compiled_again, (self._orig_mod, self.autopar_options or {})

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        if name == "generate" and callable(value) and not self.said_generate:
            self.said_generate = True
            log.warning(
                "autopar: %s.generate runs the module's own forward, not the compiled one (as "
                "torch.compile's wrapper does): to compile generation's forward passes, "
                "compile the forward: model.forward = autopar.compile(model.forward)",
                type(self._orig_mod).__name__)
        return value


def _compiled_again(module: torch.nn.Module, options: dict[str, Any]) -> CompiledModule:
    """A :class:`CompiledModule` unpickled or copied: ``module`` compiled with ``options``."""
    return compile(module, **options)  # type: ignore[return-value]


def data_parallel(fn: Callable, *, batch_argnums: Sequence[int] | None = None,
                  shards: int | None = None, batch: str = "global", sharding: str | None = None,
                  **options: Unpack[CompileOptions]) -> DataParallelStep | DistributedStep:
    """Run ``fn`` (a whole training or inference step) with its batch split over devices.

    In a process launched as one rank of several (``torchrun``, ``autopar run``), every rank
    runs its share of the batch and the results are one process's
    (:mod:`autopar.distributed.step`); ``batch="per_rank"`` says each rank is already passed
    its own batch (a ``DistributedSampler``: gradients averaged over ranks, as DDP does).
    Alone, the batch is split over this process's devices (:mod:`autopar.dataparallel`).
    Launched, each rank's modules run compiled as on one device, the way (of ``candidates``:
    eager, inductor, cudagraphs) measured and agreed by every rank
    (:mod:`autopar.distributed.compiled`). ``sharding`` (default ``$AUTOPAR_SHARDING``, else
    ``"auto"``): ``"auto"`` shards a model with FSDP2 where a replica would not fit a GPU,
    ``"shard"`` or ``"replicate"`` force one (:mod:`autopar.distributed.shard`).

    ``batch_argnums``: positions of the arguments to split along dim 0 (default: every tensor
    argument that doesn't require grad whose dim 0 equals the first one's). ``shards``: how many
    devices take a shard (default: the cost model decides; 1 never splits). Options are
    :func:`compile`'s (``devices``, ``policy``, ``machine``, ``trace``); a call that is not
    split runs through :func:`compile` of ``fn`` with them (its own measured choice).
    """
    if not callable(fn):
        raise TypeError(f"data_parallel expects a function, got {type(fn).__name__}")
    world = World.from_env()
    if world is not None:
        if shards is not None or set(options) - {"candidates"}:
            raise ValueError("shards= and compile options but candidates= apply to one "
                             f"process; launched as rank {world.rank} of {world.size}, each "
                             "rank runs its share")
        return DistributedStep(fn, world, batch_argnums=batch_argnums, batch=batch,
                               candidates=Options.parse(options).candidates,
                               sharding=sharding or os.environ.get("AUTOPAR_SHARDING", "auto"))
    if batch != "global" or sharding not in (None, "auto"):
        what = f"batch={batch!r}" if batch != "global" else f"sharding={sharding!r}"
        raise ValueError(f"{what} needs a launched world (torchrun); this process runs alone")
    if shards is not None and (not isinstance(shards, int) or shards < 1):
        raise ValueError(f"shards must be a positive int or None, not {shards!r}")
    opts = Options.parse(options)
    return DataParallelStep(fn, opts, batch_argnums, shards, unsplit=_CompiledLater(fn, options),
                            cost_model=make_runner(opts).cost_model)


class _CompiledLater:
    """``compile(fn, **options)``, made at the first call (``compiled``: None until then)."""

    def __init__(self, fn: Callable, options: dict[str, Any]) -> None:
        self.fn, self.options = fn, options
        self.compiled: Callable | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            self.compiled = compile(self.fn, **self.options)
        return self.compiled(*args, **kwargs)
