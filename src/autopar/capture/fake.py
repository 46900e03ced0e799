"""Capture without ``torch.compile``'s runner: fake tracing, for explain on machines that aren't at
hand, and capture by running once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental import symbolic_shapes
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..ir.graph import Graph, Node, TensorMeta
from ..ir.locks import tracing
from ..ir.logs import line_in, quiet
from .dynamo import capturing_scalars, make_backend, with_own_code
from .fx import Unsupported, from_fx
from .state import find_state

__all__ = ["capture_by_running", "relabel_devices", "trace_fake"]

log = logging.getLogger("autopar.capture")


class _IndexedCuda(torch.overrides.TorchFunctionMode):
    """Names ``"cuda"`` without an index as ``"cuda:0"`` (eager's current device by default)
    in every call's arguments, and ``Tensor.cuda()`` as ``.to("cuda:0")``: a build of torch
    without CUDA can't look up a current device, though fake tensors may live on ``cuda:0``."""

    @staticmethod
    def _indexed(value: Any) -> Any:
        if isinstance(value, str) and value == "cuda":
            return "cuda:0"
        if isinstance(value, torch.device) and value.type == "cuda" and value.index is None:
            return torch.device("cuda", 0)
        return value

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.device and (len(args) > 1 or "index" in kwargs):
            return func(*args, **kwargs)  # torch.device("cuda", 1): the index is given
        kwargs = {k: self._indexed(v) for k, v in kwargs.items()}
        args = tuple(self._indexed(a) for a in args)
        if func is torch.Tensor.cuda:  # its device, if any, is already indexed above
            device = args[1] if len(args) > 1 else kwargs.get("device")
            index = device if isinstance(device, int) else torch.device(device or "cuda:0").index
            return args[0].to(torch.device("cuda", index),
                              non_blocking=kwargs.get("non_blocking", False))
        return func(*args, **kwargs)


class _FakedReads(torch.overrides.TorchFunctionMode):
    """Hands each torch function a fake tensor in place of a real one it was given (a global
    weight the traced code reads), made once per real tensor by ``fake`` (on ``inputs_on``
    where it lives on the CPU, as the arguments are): the trace computes nothing on it and
    writes nothing into it."""

    def __init__(self, fake: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.fake, self.made = fake, {}

    def _swap(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, fake_tensor.FakeTensor) \
                or torch._is_functional_tensor(value) or value.device.type == "meta":
            return value
        got = self.made.get(id(value))
        if got is None:
            with disable_proxy_modes_tracing():  # a constant of the trace, not an op of it
                got = self.made[id(value)] = (value, self.fake(value))  # (the real one kept)
        return got[1]

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = tree_map(self._swap, (tuple(args), kwargs or {}))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _swapped(modules: list[tuple[torch.nn.Module, dict[str, Any]]]) -> Any:
    """Each module with its tensors replaced by the given ones while the block runs."""
    with contextlib.ExitStack() as stack:
        for module, tensors in modules:
            stack.enter_context(_reparametrize_module(module, tensors))
        yield


def _needs_a_run(error: BaseException) -> bool:
    """Is ``error`` fake tensors' own limit rather than the code's: a value read from a tensor
    (a slice bound, ``.item()``), an output shape decided by data, a kernel fake tensors lack,
    a ``backward()`` (the trace is of the forward pass), or code for a GPU this torch can't
    fake (see :func:`autopar.machine.host.no_cuda_error`)?"""
    limits = (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
              fake_tensor.UnsupportedOperatorException, symbolic_shapes.GuardOnDataDependentSymNode)
    text = str(error).lower()
    return isinstance(error, limits) or any(k in text for k in (
        "data-dependent", "data dependent", "cuda", "nvidia",
        "backward() called inside", "does not require grad and does not have a grad_fn"))


def _users_line(error: BaseException, fn: Callable) -> str | None:
    """``file:line`` of the last frame of ``error``'s traceback in the file that defines
    ``fn`` (an ``nn.Module``: its ``forward``), or None."""
    code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "forward", None),
                                                     "__code__", None)
    line = None if code is None else line_in(error, code.co_filename)
    return None if line is None else f"{Path(code.co_filename).name}:{line}"


def trace_fake(fn: Callable, args: Sequence[Any], inputs_on: str | None = None,
               name: str | None = None) -> Graph:
    """Capture ``fn(*args)`` as a functional Graph without computing anything.

    Tensors among ``args``, and the parameters and buffers of every ``nn.Module`` the call
    reaches (``fn`` itself, the arguments, its globals and closure variables: what
    :func:`~autopar.capture.state.find_state` finds), are replaced by fake tensors of the
    same shape, dtype and strides; those built on the CPU are taken to live on ``inputs_on``
    (e.g. ``"cuda:0"``), so code written for a GPU can be explained on a CPU-only machine
    (where ``"cuda"`` without an index means ``cuda:0``). Another real tensor it reads (a
    global weight) is faked where it lives. In-place updates of inputs appear as
    ``aten.copy_`` nodes at the end. Forward only: it traces under ``no_grad``.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        device = inputs_on if (inputs_on and x.device.type == "cpu") else x.device
        with mode:
            return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype,
                                       device=device)

    made: dict[int, Any] = {}

    def faked(module: torch.nn.Module) -> dict[str, Any]:
        """The module's tensors by name, each faked once (tied weights share their fake)."""
        named = {**dict(module.named_parameters(remove_duplicate=False)),
                 **dict(module.named_buffers(remove_duplicate=False))}
        return {k: made.setdefault(id(v), fake(v)) for k, v in named.items()}

    call = fn
    if isinstance(fn, torch.nn.Module):
        state = faked(fn)

        def call(*a: Any) -> Any:
            return torch.func.functional_call(fn, state, a)
    try:
        reached = [(m, faked(m)) for _, m in find_state(fn, args).modules if m is not fn]
    except Exception:  # (an optimizer's state not made yet, ...): the modules it names only
        reached = []

    # the tensors are the graph's inputs; the rest of the arguments (a Python number, a
    # flag) are constants of the trace, as eager's call sees them
    leaves, spec = tree_flatten(tuple(args))
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def flat(*tensors: Any) -> list[Any]:
        full = list(leaves)
        for i, t in zip(at, tensors):
            full[i] = t
        return tree_flatten(call(*tree_unflatten(full, spec)))[0]

    fake_args = [fake(leaves[i]) for i in at]
    try:
        traced = make_fx(torch.func.functionalize(flat), tracing_mode="fake",
                         record_stack_traces=True)
    except TypeError:  # torch without record_stack_traces
        traced = make_fx(torch.func.functionalize(flat), tracing_mode="fake")
    try:
        indexed = contextlib.nullcontext() if torch.cuda.is_available() else _IndexedCuda()
        # forward only: no autograd on fake GPU tensors; FX patches the process while it traces
        with mode, torch.no_grad(), indexed, tracing(), _swapped(reached), _FakedReads(fake):
            gm = quiet(traced)(*fake_args)  # fake tensors' log of a user's shape mistake: off
    except Exception as e:  # data-dependent ops, backward(), device code fake tensors can't take
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        label = getattr(fn, "__name__", type(fn).__name__)
        at = _users_line(e, fn)
        if at is not None and not _needs_a_run(e):  # the user's code refused these shapes
            raise Unsupported(
                f"{label} fails on the example inputs at {at}: {type(e).__name__}: {first} "
                "(traced with fake inputs of the same shapes, dtypes and devices: a real call "
                "would most likely fail the same way)") from e
        raise Unsupported(
            f"can't trace {label} without running it: "
            f"{type(e).__name__}: {first} (explain traces the forward pass with fake inputs; "
            "data-dependent values such as tensor slice bounds or .item(), and backward(), "
            "need a real run)") from e
    graph, constants = from_fx(gm, name or getattr(fn, "__name__", type(fn).__name__))
    if constants:
        log.info("autopar: %d tensor constants in %s are graph inputs", len(constants), graph.name)
    return graph


def capture_by_running(fn: Callable, args: Sequence[Any],
                       runner: Callable[[Graph], Callable[[list], Any]]) -> list[Graph]:
    """Capture every graph ``fn(*args)`` makes by running it once through the backend, each graph
    run by ``runner(graph)`` (eagerly: :class:`autopar.runtime.SequentialRunner`).

    For code :func:`trace_fake` can't follow: values read back from tensors (``.item()``, tensor
    slice bounds) split it into several graphs, and ``backward()`` and an optimizer step are
    captured as graphs of their own. The arguments are used as given: it really computes.
    Each capture compiles a copy of a function's code (:func:`~autopar.capture.dynamo.
    with_own_code`), so that captures of one function don't add up to dynamo's recompile limit
    (a module's forward is shared by its captures).
    """
    graphs: list[Graph] = []

    def record(graph: Graph, phase: str) -> Callable:
        graphs.append(graph)
        return runner(graph)

    name = getattr(fn, "__name__", type(fn).__name__)
    # a code object of its own: dynamo keeps entries per code object, and each capture's
    # backend is new, so the ninth capture of one function hit its recompile limit and ran
    # eagerly (no graph)
    compiled = torch.compile(with_own_code(fn), backend=make_backend(record, name=name),
                             dynamic=False)
    capturing_scalars(compiled)(*args)
    return graphs


def relabel_devices(graph: Graph, src: str, dst: str,
                    keep: Collection[Node] = ()) -> Graph:
    """Take every value eager put on ``src`` (e.g. "cpu") to live on ``dst`` ("cuda:0"), in place,
    but the inputs in ``keep`` and what is computed from them alone: eager code written for
    ``dst`` keeps those on ``src`` (``torch.optim``'s step counts stay on the host beside
    CUDA parameters, and so do the bias corrections computed from them).

    Used to explain CPU-captured code as if it had been written for ``dst``.
    """
    target = torch.device(dst)
    stays = set(keep)

    def moved(meta: Any) -> Any:
        if isinstance(meta, TensorMeta) and meta.device == src:
            return replace(meta, device=dst)
        if isinstance(meta, tuple):
            return tuple(moved(m) for m in meta)
        return meta

    for node in graph.nodes:
        if node in stays:
            continue
        ins = node.inputs
        if ins and all(v in stays for v in ins):
            stays.add(node)
            continue
        node.meta = moved(node.meta)
        if isinstance(node.kwargs.get("device"), torch.device) and str(
                node.kwargs["device"]) == src:
            node.kwargs = {**node.kwargs, "device": target}
    return graph
