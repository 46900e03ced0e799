"""One training (or inference) step, written for one device, run by every rank on its share.

``autopar.data_parallel(step)`` in a launched process (``torchrun``, ``autopar run``) returns a
:class:`DistributedStep`. Each rank is called with the whole global batch the script builds,
computes its rows, and the ranks' results combine into the one-process results.

Policy and invariants
- Batch arguments: ``batch_argnums`` (positions of tensor arguments, split along dim 0), else
  every tensor argument that doesn't require grad and whose dim 0 equals the first such one's.
  Rank r takes rows ``[start_r, stop_r)`` of each, as even as possible (the first ranks
  larger: :func:`autopar.passes.shard.even_sizes`).
- ``batch="per_rank"``: the script already hands each rank its own batch (a
  ``DistributedSampler``); nothing is split and gradients are averaged over ranks, as DDP does.
- The modules the step names (:func:`autopar.capture.state.find_state`) are sharded by FSDP2
  where a replica would not fit a GPU (:mod:`autopar.distributed.shard`, ``sharding=``), else
  replicated with torch's own reducer (``torch.distributed._composable.replicate``: DDP's
  buckets, each all-reduced as soon as its gradients exist, overlapping backward; unused
  parameters found each step, as a parameter may serve some steps or some ranks' rows
  only). Another step over the same module shares its replication or sharding; a module the
  script put under DDP or FSDP itself is left to it. DDP arms its reducer in the module's own
  forward: where a call ran only the module's children (``model.head(model.enc(x))``), their
  gradients are all-reduced after backward instead. At the first call every rank's model is
  checked against rank 0's (names, shapes, dtypes) and rank 0's parameters and buffers are
  broadcast, so ranks never drift apart silently. Batch norm uses the whole batch's
  statistics (:mod:`autopar.distributed.norm`).
- Parameters no module holds (step arguments that require grad, an optimizer's own tensors)
  have their gradients all-reduced after each backward, averaged as DDP's are.
- The global batch's semantics: each backward of a scalar loss is seeded so that DDP's average
  is the one-process gradient (:mod:`autopar.distributed.loss`); ``clip_grad_norm_`` then sees
  the global gradient, and GradScaler's inf check agrees on every rank, since every rank holds
  the same gradients.
- What the step returns: a scalar (a 0-dim floating tensor or a float: the loss) is combined
  over ranks as the loss was (its count-weighted mean, or its sum), so every rank returns the
  one-process value. Every other output is the rank's own share.
- Each rank's modules run compiled as on one device, the way measured and agreed by every
  rank (:mod:`autopar.distributed.compiled`; the ``candidates`` option).
- Every call is checked first: all ranks must pass the same signature
  (:mod:`autopar.distributed.agree`), else every rank raises naming the rank and argument.
- A step that raises raises on its rank with a note naming the rank; torch's agent then stops
  every rank and its summary shows that error (:func:`autopar.distributed.world.record_errors`).
- Random ops draw per rank (dropout's masks differ from one process's), as under DDP: results
  equal one process's where a step draws no random numbers.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed._composable.replicate import replicate
from torch.distributed._composable_state import _get_module_state
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..capture.state import find_state
from ..passes.shard import even_sizes
from . import loss as loss_weights
from .agree import check_same, describe
from .compiled import RankWays, rank_candidates
from .norm import sync_batch_norm
from .shard import SHARDING, Sharding, decide, shard
from .world import (
    World,
    adopt_local_device,
    broadcast_from_rank0,
    ensure_process_group,
    record_errors,
)

__all__ = ["BATCH_MODES", "DistributedStep"]

log = logging.getLogger("autopar.dataparallel")

SHARDED = "_autopar_sharded"
"""The attribute a model sharded by a step holds: (its :class:`Sharding`, its block count);
another step over the same model shares it."""

BATCH_MODES = ("global", "per_rank")
"""``global``: every rank is passed the whole batch and takes its rows (one process's
results); ``per_rank``: each rank is passed its own batch (DDP's semantics)."""


class _Weight(NamedTuple):
    """How one backward's scalar loss weighs this rank (:meth:`DistributedStep._weight`)."""

    kind: str  #: its reduction: "mean" or "sum"
    count: torch.Tensor  #: this rank's count (rows, tokens, class weights)
    total: torch.Tensor  #: the world's
    loss: torch.Tensor  #: the loss, held: its memory can't be another scalar's by _combined
    combined: torch.Tensor  #: its one-process value


class DistributedStep:
    """``step`` run by every rank on its share of the batch (see the module docstring)."""

    def __init__(self, fn: Callable, world: World, *, batch_argnums: Sequence[int] | None = None,
                 batch: str = "global", candidates: Sequence[str] = ("eager",),
                 sharding: str = "auto") -> None:
        if batch not in BATCH_MODES:
            raise ValueError(f"batch must be one of {BATCH_MODES}, not {batch!r}")
        if sharding not in SHARDING:
            raise ValueError(f"sharding must be one of {SHARDING}, not {sharding!r}")
        self.sharding = sharding
        #: the replicated models' choices (a sharded one keeps its own on the module)
        self.replicated: dict[str, Sharding] = {}
        self.fn, self.world, self.batch = fn, world, batch
        self.batch_argnums = None if batch_argnums is None else tuple(batch_argnums)
        #: the modules replicated, by the name the step reaches them with (set at first call)
        self.modules: list[tuple[str, torch.nn.Module]] | None = None
        #: parameters no module holds, whose gradients are all-reduced after each backward
        self.loose: list[torch.Tensor] = []
        #: a host-side group for the agreement checks (gloo; the default one where it is gloo)
        self.checks: dist.ProcessGroup | None = None
        self._warned: set[str] = set()
        #: batch-norm layers given the whole batch's statistics, by module name
        self.synced: dict[str, int] = {}
        #: the modules whose own forward ran in this call (DDP's reducer armed for them)
        self._forwarded: set[int] = set()
        self.candidates = tuple(candidates)
        #: the rank's compiled regions and the way kept (:mod:`autopar.distributed.compiled`)
        self.ways: RankWays | None = None

    # -- the call ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.modules is None:
            self._setup(args)
        leaves, spec = tree_flatten((args, kwargs))
        names = _leaf_names(spec, leaves)
        check_same([describe(n, x) for n, x in zip(names, leaves)], "the step's arguments",
                   self.checks)
        picked = self._batch_leaves(leaves, _children(spec)[0].num_leaves)
        rows = None
        if self.batch == "global" and picked:
            n = leaves[picked[0]].shape[0]
            rows = self._rows(n)
            leaves = [x[rows[0]:rows[1]] if i in picked else x for i, x in enumerate(leaves)]
        call_args, call_kwargs = tree_unflatten(leaves, spec)
        self._forwarded = set()
        weights: list[_Weight] = []
        with self._backward_seeded(weights, rows), self.ways.call():
            try:
                out = self.fn(*call_args, **call_kwargs)
            except Exception as e:
                _note(e, f"raised on rank {self.world.rank} of {self.world.size}")
                raise
        return self._combined(out, weights, rows)

    def _rows(self, n: int) -> tuple[int, int, int]:
        """This rank's rows ``[start, stop)`` of a global batch of ``n``, and ``n``."""
        if n < self.world.size:
            raise ValueError(f"a batch of {n} rows can't give each of {self.world.size} ranks "
                             "a share: pass a larger global batch, or batch='per_rank'")
        sizes = even_sizes(n, self.world.size)
        start = sum(sizes[:self.world.rank])
        return start, start + sizes[self.world.rank], n

    def _batch_leaves(self, leaves: list[Any], n_args: int) -> list[int]:
        tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if self.batch_argnums is not None:
            positions = [i for i in tensors if i < n_args]
            try:
                return [positions[k] for k in self.batch_argnums]
            except IndexError:
                raise ValueError(f"batch_argnums {self.batch_argnums} names a tensor argument "
                                 f"the step wasn't passed ({len(positions)} tensors)") from None
        rest = [i for i in tensors if not leaves[i].requires_grad and leaves[i].dim() >= 1]
        if not rest:
            return []
        n = leaves[rest[0]].shape[0]
        return [i for i in rest if leaves[i].shape[0] == n]

    # -- the first call ---------------------------------------------------------------------
    def _setup(self, args: Sequence[Any]) -> None:
        world = self.world
        adopt_local_device(world)
        ensure_process_group(world)
        record_errors()
        self.checks = dist.group.WORLD if dist.get_backend() == "gloo" else \
            dist.new_group(backend="gloo")
        state = find_state(self.fn, args, for_trace=False)
        held = {id(p) for _, m in state.modules for p in m.parameters()}
        optimizers = [opt for _, opt in state.optimizers]
        modules = []
        for name, module in state.modules:
            check_same([describe(f"{name}.{q}", t) for q, t in
                        [*module.named_parameters(), *module.named_buffers()]],
                       f"model {name!r}", self.checks)
            ours = getattr(module, SHARDED, None) or replicate.state(module) is not None
            if (not ours and _by_user(module)) or \
                    not any(p.requires_grad for p in module.parameters()):
                continue
            if not ours:  # not yet, by this step or another
                choice = decide(module, optimizers, self.sharding, world.device)
                if choice.shard and state.scalers:
                    raise ValueError(
                        f"rank {world.rank}: {name!r} is to be sharded ({choice.reason}), and "
                        f"the step holds a GradScaler ({state.scalers[0][0]!r}), whose inf "
                        "check would see this rank's shards only. Use bf16 autocast without "
                        "a scaler, or sharding='replicate'")
                if choice.shard:
                    setattr(module, SHARDED, (choice, shard(module, optimizers, world.device)))
                    if world.rank == 0:
                        log.warning("autopar: %s is sharded by FSDP2 (%s). Its state_dict() "
                                    "now holds each rank's shards: save it with "
                                    "autopar.distributed.full_state_dict(%s) on every rank, "
                                    "or torch.distributed.checkpoint", name, choice.reason,
                                    name)
                else:
                    broadcast_from_rank0(module.buffers())  # DDP broadcasts the parameters
                    _replicate(module, world)
                    self.replicated[name] = choice
            self.synced[name] = sync_batch_norm(module)
            module.register_forward_pre_hook(self._forwarded_hook(module))
            modules.append((name, module))
        held |= {id(p) for _, m in state.modules for p in m.parameters()}  # sharded: new ones
        loose = [x for x in tree_flatten(tuple(args))[0]
                 if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf]
        loose += [p for _, opt in state.optimizers for g in opt.param_groups
                  for p in g["params"] if id(p) not in held]
        self.loose = list({id(p): p for p in loose}.values())
        broadcast_from_rank0(self.loose)
        self.modules = modules
        self.ways = RankWays([(n, m) for n, m in modules if not getattr(m, SHARDED, None)],
                             rank_candidates(self.candidates, world.device), world.device,
                             self.checks)
        atexit.register(self._release)  # before the group's own end (atexit: last in, first)
        log.info("%s", self.describe())

    def _forwarded_hook(self, module: torch.nn.Module) -> Callable[..., None]:
        def seen(*_: Any) -> None:
            self._forwarded.add(id(module))
        return seen

    def _release(self) -> None:
        """Drop the DDP state the modules hold, at the script's end: its reducer keeps the
        process group alive past ``destroy_process_group``, and a gloo group left to the
        interpreter's teardown can abort a finished run (``terminate called without an
        active exception``; benchmarks/NOTES.md, "an abort at teardown")."""
        for _, module in self.modules or ():
            state = replicate.state(module)
            if state is not None and hasattr(state, "_ddp"):
                del state._ddp
        self.modules = []
        gc.collect()

    def describe(self) -> str:
        """What this rank does, in a few lines (logged once at the first call, on the
        ``dataparallel`` topic: ``AUTOPAR_LOGS=dataparallel``)."""
        w = self.world
        backend = dist.get_backend() if dist.is_initialized() else "not yet joined"
        lines = [f"rank {w.rank} of {w.size} on {w.device} ({backend}); batch: "
                 + ("each rank's own (gradients averaged, as DDP)" if self.batch == "per_rank"
                    else "the global batch, this rank's rows (one process's results)")]
        for name, module in self.modules or ():
            norms = self.synced.get(name, 0)
            sharded = getattr(module, SHARDED, None)
            how = f"sharded by FSDP2 ({sharded[1]} blocks and the rest)" if sharded else \
                "replicated under DDP's reducer (buckets of 25 MB, all-reduced as backward " \
                "makes them)"
            choice = sharded[0] if sharded else self.replicated.get(name)
            lines.append(f"  {name}: {how}" + (f": {choice.reason}" if choice else "")
                         + (f"; {norms} batch-norm layers over the whole batch" if norms else ""))
        if self.loose:
            lines.append(f"  {len(self.loose)} parameter(s) no module holds: gradients "
                         "all-reduced after each backward")
        if self.ways is not None:
            lines.append(self.ways.describe())
        return "\n".join(lines)

    # -- backward and outputs -----------------------------------------------------------------
    @contextlib.contextmanager
    def _backward_seeded(self, weights: list[_Weight], rows: tuple[int, int, int] | None
                         ) -> Iterator[None]:
        """While the step runs on this thread, ``torch.autograd.backward`` (so
        ``loss.backward()``) seeds a scalar loss with its weight (see the module docstring)
        and reduces the loose parameters' gradients after."""
        original = torch.autograd.backward
        me = threading.get_ident()

        def backward(tensors: Any, grad_tensors: Any = None, *rest: Any, **kw: Any) -> Any:
            if threading.get_ident() != me:
                return original(tensors, grad_tensors, *rest, **kw)
            if self.batch == "global" and grad_tensors is None:
                root = tensors[0] if isinstance(tensors, list | tuple) and len(tensors) == 1 \
                    else tensors
                if isinstance(root, torch.Tensor) and root.dim() == 0:
                    w = self._weight(root, rows)
                    weights.append(w)
                    size = self.world.size
                    seed = w.count * size / w.total if w.kind == "mean" else \
                        torch.full_like(w.count, float(size))
                    grad_tensors = seed.to(root.dtype).reshape(root.shape)
                    tensors = root
            result = original(tensors, grad_tensors, *rest, **kw)
            self._reduce_by_hand()
            return result

        torch.autograd.backward = backward
        try:
            yield
        finally:
            torch.autograd.backward = original

    def _weight(self, root: torch.Tensor, rows: tuple[int, int, int] | None) -> _Weight:
        """How ``root``'s reduction weighs this rank: one all-reduce of the count and the
        weighted value, so that the step's returned loss needs no collective of its own
        (:meth:`_combined`)."""
        found = loss_weights.reduction_of(root)
        if found is None:
            name = loss_weights.name_of(root)
            if name not in self._warned:
                self._warned.add(name)
                log.warning("autopar: can't tell how the loss averages over its batch (made by "
                            "%s), so each rank is weighed by its rows. That is exact for a "
                            "mean over rows, and wrong for a mean over tokens with ignored "
                            "labels, or a sum divided by a constant: use a plain mean, or "
                            "reduction='sum'", name)
            mine = float(rows[1] - rows[0]) if rows else 1.0
            found = loss_weights.Reduction("mean", mine, name)
        device = self._comm_device(root)
        count = torch.as_tensor(found.count, dtype=torch.float64).to(device).reshape(1)
        value = root.detach().to(device=device, dtype=torch.float64).reshape(1)
        if found.kind == "mean":  # a share with nothing to average has a NaN mean: weight 0
            value = torch.where(count == 0, torch.zeros_like(value), value * count)
        both = torch.cat([count, value])
        dist.all_reduce(both)
        total = both[:1]
        combined = both[1:] / total if found.kind == "mean" else both[1:]
        return _Weight(found.kind, count, total, root.detach(), combined)

    def _reduce_by_hand(self) -> None:
        """All-reduce, after a backward, the gradients DDP's reducer did not: those of
        parameters no module holds, and those of a module whose own forward did not run in
        this call (the step called its children, ``model.head(model.enc(x))``: DDP arms its
        reducer in the module's forward)."""
        grads = [p.grad for p in self.loose if p.grad is not None]
        if len(grads) != len(self.loose):
            missing = [i for i, p in enumerate(self.loose) if p.grad is None]
            raise RuntimeError(f"rank {self.world.rank}: parameter(s) {missing} got no gradient "
                               "in this backward; every rank must give each loose parameter "
                               "one")
        for _, module in self.modules or ():
            if id(module) not in self._forwarded and not getattr(module, SHARDED, None):
                grads += [p.grad for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world.size
        at = 0
        for g in grads:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()

    def _combined(self, out: Any, weights: list[_Weight], rows: tuple[int, int, int] | None) -> Any:
        leaves, spec = tree_flatten(out)
        scalars = [i for i, x in enumerate(leaves) if type(x) is float or (
            isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point())]
        if not scalars or self.batch != "global":
            return out
        device = self._comm_device(next((leaves[i] for i in scalars
                                         if isinstance(leaves[i], torch.Tensor)), None))
        if weights:
            w = weights[-1]
            loss_at = _storage(w.loss)
            factor = w.count / w.total if w.kind == "mean" else torch.ones_like(w.count)
            # the loss itself (``loss.detach()``) was combined with its weight already
            done = [i for i in scalars if isinstance(leaves[i], torch.Tensor)
                    and _storage(leaves[i]) == loss_at]
            for i in done:
                leaves[i] = w.combined.reshape(()).to(dtype=leaves[i].dtype,
                                                      device=leaves[i].device)
            scalars = [i for i in scalars if i not in done]
            if not scalars:
                return tree_unflatten(leaves, spec)
        else:
            mine, total = (rows[1] - rows[0], rows[2]) if rows else (1, self.world.size)
            factor = torch.tensor([mine / total], dtype=torch.float64, device=device)
        values = torch.stack([torch.as_tensor(leaves[i], dtype=torch.float64).to(device)
                              .reshape(()) for i in scalars])
        factor = factor.to(device)
        # a share with nothing to average (no token of a masked loss) has a NaN mean: weight 0
        values = torch.where(factor == 0, torch.zeros_like(values), values * factor)
        dist.all_reduce(values)
        for k, i in enumerate(scalars):
            x = leaves[i]
            leaves[i] = float(values[k]) if type(x) is float else \
                values[k].to(dtype=x.dtype, device=x.device)
        return tree_unflatten(leaves, spec)

    def _comm_device(self, like: torch.Tensor | None) -> torch.device:
        """Where a collective's tensors live: the default group's device (a GPU under NCCL)."""
        if dist.get_backend() == "nccl":
            return self.world.device
        return torch.device("cpu") if like is None else like.device


# -- helpers ---------------------------------------------------------------------------------------
def _leaf_names(spec: Any, leaves: list[Any]) -> list[str]:
    """A readable name for each leaf of ``(args, kwargs)``: ``argument 1`` or ``argument 1[0]``
    for nested ones, ``keyword 'mask'``."""
    args_spec, kwargs_spec = _children(spec)
    names: list[str] = []
    for i, child in enumerate(_children(args_spec)):
        k = child.num_leaves
        names += [f"argument {i}"] if k == 1 else [f"argument {i}[{j}]" for j in range(k)]
    for key, child in zip(kwargs_spec.context, _children(kwargs_spec)):
        k = child.num_leaves
        names += [f"keyword {key!r}"] if k == 1 else [f"keyword {key!r}[{j}]" for j in range(k)]
    return names[:len(leaves)] + [f"leaf {i}" for i in range(len(names), len(leaves))]


def _children(spec: Any) -> list[Any]:
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else list(spec.children_specs)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t``'s value lives: ``loss`` and ``loss.detach()`` share it."""
    return t.untyped_storage().data_ptr(), t.storage_offset()


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):
        error.add_note(f"autopar: {text}")


def _by_user(module: torch.nn.Module) -> bool:
    """Did the script itself put ``module`` under DDP or FSDP? (Not autopar's ``replicate``:
    another step over the same module shares it.)"""
    if isinstance(module, DistributedDataParallel):
        return True
    return _get_module_state(module) is not None and replicate.state(module) is None


def _replicate(module: torch.nn.Module, world: World) -> None:
    device = world.device
    # find_unused_parameters: a parameter may serve some steps, or some ranks' rows, only
    # (static_graph raises there)
    replicate(module, device_id=device if device.type == "cuda" else torch.device("cpu"),
              find_unused_parameters=True)

