"""The Python values a traced training step reads and writes besides its tensors.

A data-parallel step is traced once (:func:`autopar.capture.step.capture_step`) and its graph
replayed. What the step does in Python runs during the trace only, on fake tensors, and never
again: a counter it increments, a list it appends a loss to, an attribute a module sets in its
forward (an auxiliary loss, a call count). And a Python value it reads (a float in a config
dict, a flag it branches on) is baked into the graph. ``torch.compile`` guards the values its
code reads and replays the writes; a replayed graph does neither, so both are watched here.

Policy
- Watched (:func:`watch`): the step's free values as :func:`~autopar.capture.state.find_state`
  reaches them (the globals its code names and its closure cells, and those of the plain
  functions among them; a bound method's object's attributes), one level into each that is a
  list, tuple, dict or set or a plain object (its ``__dict__``; not torch's objects, loggers
  or Python modules); and each module's own attributes (its ``__dict__``: one added, one
  assigned anew; its parameters and buffers dicts, so a buffer assigned anew is seen; torch's
  other bookkeeping not) and the free values of its hooks (a feature-extraction hook's
  list).
- A value is recorded as itself where it is a number, string, bytes, bool, None, a
  ``torch.dtype`` or ``torch.device``; a list, dict or set as its identity, its length and its
  first items (each so recorded, one level: so an append is seen); anything else by
  identity.
- Reads (:func:`read_key`): the records of the free values and of their items are part of the
  step's signature, so a changed value is another capture (as dynamo guards them), never the
  old graph. Module attributes are left out of the key (thousands of them in a transformer:
  checked per call they would cost more than the step's dispatch); a plain number a module
  holds that the user changes between calls is the one read not seen.
- Writes (:func:`changed`, :func:`restore`): everything watched is recorded before the trace
  and compared after it; a difference means the step changes Python state as it runs, which a
  replayed graph would not do: the trace is refused, naming what changed, and what changed is
  put back (fake tensors must not stay in user objects).
"""

from __future__ import annotations

import itertools
import random
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .direct import free_values

__all__ = ["Watched", "changed", "held_tensors", "read_key", "records", "restore", "snapshot",
           "version_of", "watch", "world"]

_PLAIN = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)
_CONTAINERS = (list, dict, set)
_MAX_ITEMS = 64  # items of one container looked into
# objects of these packages are not looked into: torch's own (optimizers, schedulers, scalers:
# state of the trace), and loggers, whose level caches fill as a step logs
_LIBRARIES = frozenset({"torch", "logging"})
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# torch's own attributes of a module (watched on their own, or never written by a forward)
_MODULE_OWN = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks",
    "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "training"})


@dataclass
class Watched:
    """One place a value is read from: ``name`` (for messages), its holder and key there
    (a dict, including a ``__dict__``, and a key; or a closure cell and None; or a list and an
    index), and whether it is part of the signature (``read``)."""

    name: str
    holder: Any
    key: Any
    read: bool

    def get(self) -> Any:
        if isinstance(self.holder, dict):  # (dict's own methods: a subclass may change them)
            return dict.get(self.holder, self.key, _ABSENT)
        if isinstance(self.holder, list):
            return self.holder[self.key] if self.key < len(self.holder) else _ABSENT
        try:
            return self.holder.cell_contents
        except ValueError:  # an empty cell
            return _ABSENT

    def put(self, value: Any) -> None:
        if isinstance(self.holder, dict):
            if value is _ABSENT:
                dict.pop(self.holder, self.key, None)
            else:
                dict.__setitem__(self.holder, self.key, value)
        elif isinstance(self.holder, list):
            if self.key < len(self.holder):
                self.holder[self.key] = value
        elif value is not _ABSENT:
            self.holder.cell_contents = value


_ABSENT = object()


def _record(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if type(value) in _CONTAINERS:
        return (id(value), _shallow(value))
    return ("object", id(value))


def _shallow(c: Any) -> Any:
    """A container's length and its first items' identities (a dataset list of thousands is
    not walked each call; an append changes the length)."""
    if isinstance(c, dict):
        return len(c), tuple((k, _item(v)) for k, v in list(c.items())[:_MAX_ITEMS])
    if isinstance(c, set):
        return len(c), frozenset(_item(v) for v in list(c)[:_MAX_ITEMS])
    return len(c), tuple(_item(v) for v in c[:_MAX_ITEMS])


def _item(v: Any) -> Any:
    """A container's item: a plain value as itself (a float made anew each call is equal, not
    identical), anything else by identity."""
    return v if isinstance(v, _PLAIN) else ("object", id(v))


def watch(fn: Callable, modules: Sequence[tuple[str, torch.nn.Module]]) -> list[Watched]:
    """Every place the step ``fn`` may read a Python value from or write one to (see the
    module docstring)."""
    out: list[Watched] = []
    seen: set[int] = set()

    def one_level(name: str, value: Any) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, dict):
            for k in list(value)[:_MAX_ITEMS]:
                out.append(Watched(f"{name}[{k!r}]", value, k, True))
        elif isinstance(value, list):
            for i in range(min(len(value), _MAX_ITEMS)):
                out.append(Watched(f"{name}[{i}]", value, i, True))
        elif not isinstance(value, torch.Tensor | Callable) and \
                (attrs := _attributes(value)) is not None:
            for k in list(attrs)[:_MAX_ITEMS]:
                out.append(Watched(f"{name}.{k}", attrs, k, True))

    def free(f: Callable, prefix: str, read: bool) -> list[Any]:
        """Watch ``f``'s globals and closure cells (and one level into them); their values."""
        values = []
        for name, value, where in free_values(f):
            holder, key = (where[1], where[2]) if where[0] == "global" else (where[1], None)
            out.append(Watched(prefix + name, holder, key, read))
            one_level(prefix + name, value)
            values.append(value)
        return values

    functions: list[Callable] = [fn]
    owner = getattr(fn, "__self__", None)
    for f in functions:
        for value in free(f, "", True):
            if f is fn and hasattr(value, "__code__") and \
                    all(value is not g for g in functions):
                functions.append(value)
    if owner is not None and not isinstance(owner, torch.nn.Module):
        one_level("self", owner)
    for var, module in modules:
        for qual, m in module.named_modules(remove_duplicate=True):
            name = f"{var}.{qual}" if qual else var
            out.append(Watched(f"{name}.__dict__", {"": vars(m)}, "", False))  # one added
            for k in ("_parameters", "_buffers"):  # one assigned anew (a buffer of state)
                out.append(Watched(f"{name}.{k}", vars(m), k, False))
            for k in vars(m):
                if k not in _MODULE_OWN:
                    out.append(Watched(f"{name}.{k}", vars(m), k, False))
            for k in _HOOKS:  # what hooks write (a feature-extraction hook's list)
                for hook in getattr(m, k, {}).values():
                    free(hook, f"{name}'s hook's ", False)
    return out


def records(watched: Sequence[Watched]) -> tuple:
    """The records of every watched place (two are equal where nothing watched changed)."""
    return tuple(_record(w.get()) for w in watched)


def read_key(watched: Sequence[Watched]) -> tuple:
    """The records of the values a step reads (its part of the signature)."""
    return records([w for w in watched if w.read])


def snapshot(watched: Sequence[Watched]) -> list[tuple[Any, Any, Any]]:
    """Each watched place's value, its record and, for a container, a shallow copy of it: for
    :func:`changed` and :func:`restore`."""
    out = []
    for w in watched:
        v = w.get()
        out.append((v, _record(v), v.copy() if type(v) in _CONTAINERS else None))
    return out


def changed(watched: Sequence[Watched], before: list) -> list[str]:
    """The names of the watched places whose values are not what ``before`` recorded (a
    container: another object, or other items), the most precise: a dict whose item changed
    is named by the item."""
    names = [w.name for w, (_, record, _) in zip(watched, before) if _record(w.get()) != record]

    def within(n: str) -> tuple[str, ...]:  # names more precise than n
        return (n.removesuffix("__dict__"),) if n.endswith(".__dict__") else (n + "[", n + ".")
    return [n for n in names if not any(m != n and m.startswith(within(n)) for m in names)]


def restore(watched: Sequence[Watched], before: list) -> None:
    """Put back what :func:`snapshot` recorded where it changed (a container's items too)."""
    for w, (value, record, items) in zip(watched, before):
        if _record(w.get()) == record:
            continue
        if items is not None:  # the same object, its items as they were
            if isinstance(value, list):
                list.__setitem__(value, slice(None), items)
            else:
                type(items).clear(value)
                type(items).update(value, items)
        w.put(value)


def world(watched: Sequence[Watched], args: Any) -> tuple:
    """What a call may change besides the tensors it writes: the records of ``watched`` (the
    function's free values and its module's attributes), the state of every random number
    generator it may draw from (Python's, NumPy's where it is loaded, torch's default ones, and
    each ``torch.Generator`` among ``args``) and the Python objects among ``args``, a few
    levels in (:func:`_deep`: a KV cache the call appends to, as HF's ``DynamicCache`` is
    when a model is called with ``past_key_values``). Two equal results: the call changed
    none of it, so calling it again on the same arguments gives the same results (the
    measured choice checks a way against eager that way, :class:`autopar.dispatch.Dispatcher`)."""
    rngs: list[Any] = [random.getstate()]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, *rest = numpy.random.get_state()
        rngs.append((kind, keys.tobytes(), *rest))
    leaves = tree_flatten(args)[0]
    gens = [torch.default_generator, *(g for g in leaves if isinstance(g, torch.Generator))]
    if torch.cuda.is_initialized():
        gens += [torch.cuda.default_generators[i] for i in range(torch.cuda.device_count())]
    rngs += [_state_of(g) for g in gens]
    objects = tuple(_deep(x, _ARG_DEPTH, set()) for x in leaves
                    if not isinstance(x, (*_PLAIN, torch.Tensor, torch.Generator)))
    return records(watched), tuple(rngs), objects


_ARG_DEPTH = 4
"""Levels :func:`world` looks into a Python object among the arguments: a Hugging Face
``DynamicCache`` holds its tensors three down (``cache.layers[i].keys``)."""


def _state_of(generator: torch.Generator) -> tuple[int, ...]:
    """A generator's state as numbers, compared exactly (no NumPy: torch's base install has
    none), eight bytes a number where the state's size allows."""
    state = generator.get_state()
    return tuple((state.view(torch.int64) if state.numel() % 8 == 0 else state).tolist())


def version_of(t: torch.Tensor) -> Any:
    """``t._version``, or for an inference tensor (made under ``torch.inference_mode``: no
    version counter, and reading it raises) a new object each read: compared with any other
    read it differs, so a call given one is taken to have written it (never repeated)."""
    return object() if t.is_inference() else t._version


def _deep(value: Any, depth: int, seen: set[int]) -> Any:
    """A record of ``value`` that changes where anything within ``depth`` levels of it does: a
    plain value as itself, a tensor by identity and version, a list, tuple, dict or plain
    object by its items (:func:`_items`, the first ``_MAX_ITEMS``); anything else, or past
    ``depth``, by identity."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), version_of(value))
    if depth == 0 or id(value) in seen:
        return ("object", id(value))
    seen.add(id(value))
    looked = _items(value, _MAX_ITEMS)
    if looked is None:
        return ("object", id(value))
    size, items = looked
    return (id(value), size, tuple((k, _deep(v, depth - 1, seen)) for k, v in items))


def held_tensors(value: Any, depth: int = _ARG_DEPTH) -> list[torch.Tensor] | None:
    """The tensors within ``depth`` levels of ``value`` (:func:`_items`), in order, each once;
    None where anything within it is neither such a container nor a plain value nor a tensor
    (a module, an object of :data:`_LIBRARIES`) or lies deeper than ``depth``: where the list
    may be incomplete. Every item is looked at (a cache of 80 layers holds 160 tensors)."""
    found: dict[int, torch.Tensor] = {}

    def walk(v: Any, left: int) -> bool:
        if isinstance(v, _PLAIN):
            return True
        if isinstance(v, torch.Tensor):
            found.setdefault(id(v), v)
            return True
        looked = _items(v) if left else None
        return looked is not None and all(walk(item, left - 1) for _, item in looked[1])

    return list(found.values()) if walk(value, depth) else None


def _items(value: Any, limit: int | None = None) -> tuple[int, list[tuple[Any, Any]]] | None:
    """What is looked into within ``value``: how many items it has, and the first ``limit``
    (all: None) of them, a list's or tuple's by index, a dict's by key, a plain object's
    attributes (:func:`_attributes`) by name; None for anything else."""
    if type(value) in (list, tuple):
        return len(value), list(enumerate(value[:limit]))
    items = value if type(value) is dict else _attributes(value)
    if items is None:
        return None
    return len(items), list(itertools.islice(items.items(), limit))


def _attributes(value: Any) -> dict | None:
    """The attributes (``__dict__``) of a plain object that is looked into: not a module,
    class or Python module, nor an object of :data:`_LIBRARIES`; else None."""
    attrs = getattr(value, "__dict__", None)
    if type(attrs) is not dict or isinstance(value, torch.nn.Module | type | types.ModuleType) \
            or type(value).__module__.split(".")[0] in _LIBRARIES:
        return None
    return attrs
