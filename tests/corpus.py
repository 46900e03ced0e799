"""The eager-equality corpus: one conformance suite that every executor and policy must pass.

Each :class:`Case` is a small PyTorch program; :func:`run_case` runs it once eagerly and once
through a compile function (``fn -> fn'``: a ``torch.compile`` backend, ``autopar.compile`` with a
policy, or anything later), on two independent copies of its inputs and state, and asserts that
the compiled program is indistinguishable from eager PyTorch.

What "indistinguishable" means (checked after every call, in this order)
- outputs: the same structure (nested tuples, lists, dicts, structseqs, Python constants), and for
  every tensor the same device, dtype, shape, ``requires_grad`` and values (exact for integer and
  bool tensors, the case's tolerance for floating point);
- aliasing: an output shares storage with an input, or with an earlier output, exactly when it does
  in eager (a view of an input is still a view of it; a tensor returned twice is still one tensor);
- inputs after the call: every tensor argument has the same shape, dtype, device and values, so
  in-place updates of inputs are applied and nothing else is written;
- gradients, for ``requires_grad`` cases: after backpropagating the same seeded cotangents through
  every differentiable output, ``.grad`` of every input and module parameter;
- state, for ``factory`` and ``program`` cases: every parameter, buffer and parameter ``.grad`` of
  the module the callable owns (training steps, batch-norm running statistics).

How a case is run
- ``kind="function"``: ``fn`` is the function itself; it is compiled once and called ``calls``
  times.
- ``kind="factory"``: ``fn(device)`` builds a fresh stateful callable (an ``nn.Module`` or a closure
  with a ``module`` attribute); it is built twice under the same seed, once per side, and the
  compiled side compiles the whole callable.
- ``kind="program"``: ``fn(device, compile_fn)`` builds a fresh callable that compiles only the part
  it chooses (the usual ``model = torch.compile(model)`` training loop); eager passes the identity.
- Call ``k`` (from 0) gets fresh inputs from :meth:`Case.inputs` with seed ``k``, identical on both
  sides, so the second call hits the compiled cache with new values; both sides call
  ``torch.manual_seed(RUN_SEED + k)`` right before calling, so random ops draw the same numbers.

Glossary: *side* is eager or compiled; *leaf* is one element of a pytree-flattened value.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = [
    "CASES",
    "CATEGORIES",
    "RUN_SEED",
    "Case",
    "CompileFn",
    "Compiler",
    "alias_pattern",
    "assert_same",
    "case",
    "clone_args",
    "module_of",
    "run_case",
]

CompileFn = Callable[[Callable[..., Any]], Callable[..., Any]]
RUN_SEED = 1234
"""Call ``k`` of a case runs under ``torch.manual_seed(RUN_SEED + k)``, on both sides."""

KINDS = ("function", "factory", "program")


@dataclass(frozen=True)
class Case:
    """One program of the corpus. See the module docstring for ``kind`` and what is compared."""

    name: str
    fn: Callable[..., Any]
    make_inputs: Callable[[str], tuple[Any, ...]]
    kind: str = "function"
    requires_grad: bool = False  # floating-point tensor inputs become leaves requiring grad
    training_step: bool = False  # each call updates the parameters of the module it owns
    mutates_inputs: bool = False  # eager writes into at least one tensor argument
    random: bool = False  # outputs depend on the global RNG
    calls: int = 2
    atol: float | None = None
    rtol: float | None = None
    tags: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"case {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if (self.atol is None) != (self.rtol is None):
            raise ValueError(f"case {self.name!r}: give both atol and rtol, or neither")
        if self.calls < 2:
            raise ValueError(f"case {self.name!r}: calls={self.calls}; the cache needs >= 2")

    def inputs(self, device: str = "cpu", seed: int = 0) -> tuple[Any, ...]:
        """Fresh arguments for one call: ``make_inputs(device)`` under ``torch.manual_seed(seed)``.

        The global RNG state outside is left as it was. Floating-point tensors require grad when
        the case says so.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            args = tuple(self.make_inputs(device))
        if self.requires_grad:
            for a in args:
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    a.requires_grad_(True)
        return args

    def build(self, device: str, compile_fn: CompileFn | None) -> tuple[Callable, Any]:
        """(callable to call, the object whose module state is compared), for one side.

        ``compile_fn=None`` builds the eager side.
        """
        if self.kind == "function":
            return (self.fn if compile_fn is None else compile_fn(self.fn)), None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            if self.kind == "factory":
                made = self.fn(device)
                run = made if compile_fn is None else compile_fn(made)
            else:
                made = self.fn(device, compile_fn or _identity)
                run = made
        return run, made


def _identity(fn: Callable) -> Callable:
    return fn


def module_of(made: Any) -> nn.Module | None:
    """The module whose parameters and buffers a factory or program callable owns."""
    if made is None or isinstance(made, nn.Module):
        return made
    return getattr(made, "module", None)


# ---------------------------------------------------------------------------------------------
# run_case: the harness


def run_case(case: Case, compile_fn: CompileFn, device: str = "cpu") -> None:
    """Run ``case`` eagerly and through ``compile_fn`` on ``device``; raise AssertionError on any
    difference (see the module docstring for what is compared)."""
    eager_fn, eager_made = case.build(device, None)
    comp_fn, comp_made = case.build(device, compile_fn)
    tol = {} if case.atol is None else {"atol": case.atol, "rtol": case.rtol}
    for k in range(case.calls):
        where = f"[{case.name}] call {k + 1} of {case.calls}"
        e_args, c_args = case.inputs(device, seed=k), case.inputs(device, seed=k)
        e_out = _call(eager_fn, e_args, k, f"{where}: eager")
        c_out = _call(comp_fn, c_args, k, f"{where}: compiled")
        assert_same(e_out, c_out, f"{where}: output", tol)
        _assert_same_aliasing(e_out, e_args, c_out, c_args, where)
        assert_same(e_args, c_args, f"{where}: input after the call", tol)
        if case.requires_grad:
            _backward(e_out, f"{where}: eager")
            _backward(c_out, f"{where}: compiled")
            grads = [a.grad if isinstance(a, torch.Tensor) else None for a in e_args]
            c_grads = [a.grad if isinstance(a, torch.Tensor) else None for a in c_args]
            assert_same(grads, c_grads, f"{where}: input .grad", tol)
        _assert_same_state(module_of(eager_made), module_of(comp_made), where, tol)


def _call(fn: Callable, args: tuple, k: int, where: str) -> Any:
    torch.manual_seed(RUN_SEED + k)
    try:
        return fn(*args)
    except Exception as e:
        raise AssertionError(f"{where} raised {type(e).__name__}: {e}") from e


def assert_same(expected: Any, actual: Any, where: str, tol: dict | None = None) -> None:
    """Assert two (nested) values are equal as eager PyTorch would see them."""
    e_leaves, e_spec = tree_flatten(expected)
    a_leaves, a_spec = tree_flatten(actual)
    if e_spec != a_spec:
        raise AssertionError(
            f"{where}: structure differs\n eager:    {e_spec}\n compiled: {a_spec}")
    for i, (e, a) in enumerate(zip(e_leaves, a_leaves)):
        at = f"{where} leaf {i}" if len(e_leaves) > 1 else where
        if isinstance(e, torch.Tensor) or isinstance(a, torch.Tensor):
            _assert_same_tensor(e, a, at, tol or {})
        elif isinstance(e, float) and isinstance(a, float):
            torch.testing.assert_close(a, e, msg=lambda m, at=at: f"{at}: {m}", **(tol or {}))
        elif type(e) is not type(a) or e != a:
            raise AssertionError(f"{at}: eager gave {e!r}, compiled gave {a!r}")


def _assert_same_tensor(e: Any, a: Any, where: str, tol: dict) -> None:
    if not (isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor)):
        raise AssertionError(f"{where}: eager gave {type(e).__name__}, compiled {type(a).__name__}")
    for what in ("device", "dtype", "shape", "requires_grad"):
        ev, av = getattr(e, what), getattr(a, what)
        if ev != av:
            raise AssertionError(f"{where}: {what} differs: eager {ev}, compiled {av}")
    ok_tol = tol if e.is_floating_point() or e.is_complex() else {}
    torch.testing.assert_close(
        a.detach(), e.detach(), equal_nan=True, **ok_tol,
        msg=lambda m: f"{where}: values differ (compiled vs eager)\n{m}",
    )


def _storage_key(t: torch.Tensor) -> tuple | None:
    if t.numel() == 0 or t.device.type == "meta":
        return None
    return (str(t.device), t.untyped_storage().data_ptr())


def alias_pattern(out: Any, args: tuple) -> list[tuple]:
    """For each output leaf: (arguments it shares storage with, earlier outputs it shares with)."""
    arg_keys = [_storage_key(a) if isinstance(a, torch.Tensor) else None
                for a in tree_flatten(args)[0]]
    out_keys = [_storage_key(o) if isinstance(o, torch.Tensor) else None
                for o in tree_flatten(out)[0]]
    pattern = []
    for i, key in enumerate(out_keys):
        if key is None:
            pattern.append(((), ()))
            continue
        pattern.append((
            tuple(j for j, k in enumerate(arg_keys) if k == key),
            tuple(j for j in range(i) if out_keys[j] == key),
        ))
    return pattern


def _assert_same_aliasing(e_out: Any, e_args: tuple, c_out: Any, c_args: tuple, where: str) -> None:
    expected, actual = alias_pattern(e_out, e_args), alias_pattern(c_out, c_args)
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e != a:
            raise AssertionError(
                f"{where}: output leaf {i} aliasing differs: eager shares storage with "
                f"inputs {list(e[0])} and outputs {list(e[1])}, compiled with inputs {list(a[0])} "
                f"and outputs {list(a[1])}"
            )


def _cotangent(t: torch.Tensor, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.device, t.dtype)


def _backward(out: Any, where: str) -> None:
    """Backpropagate fixed seeded cotangents (not ones: sum(softmax) has zero gradient)."""
    leaves = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    if not leaves:
        raise AssertionError(f"{where}: requires_grad case has no output that requires grad")
    try:
        torch.autograd.backward(leaves, [_cotangent(o, i) for i, o in enumerate(leaves)])
    except Exception as e:
        raise AssertionError(f"{where}: backward raised {type(e).__name__}: {e}") from e


def _module_state(m: nn.Module | None) -> dict[str, Any]:
    if m is None:
        return {}
    state: dict[str, Any] = {}
    for name, p in m.named_parameters():
        state[f"parameter {name}"] = p
        state[f"parameter {name}.grad"] = p.grad
    for name, b in m.named_buffers():
        state[f"buffer {name}"] = b
    return state


def _assert_same_state(e_mod: nn.Module | None, c_mod: nn.Module | None, where: str,
                       tol: dict) -> None:
    e_state, c_state = _module_state(e_mod), _module_state(c_mod)
    if e_state.keys() != c_state.keys():
        raise AssertionError(f"{where}: module state names differ: {sorted(e_state)} "
                             f"vs {sorted(c_state)}")
    for name, e in e_state.items():
        assert_same(e, c_state[name], f"{where}: module {name}", tol)


# ---------------------------------------------------------------------------------------------
# input helpers: draw on the CPU from the global RNG (seeded by Case.inputs), then move, so the
# values are the same on every device.


def randn(*shape: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(device=device, dtype=dtype)


def rand(*shape: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.rand(*shape).to(device=device, dtype=dtype)


def randint(high: int, *shape: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, high, shape).to(device)


def scalar(value: float, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(value, device=device)


def normals(device: str, *shapes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """One float32 tensor of standard normal values per shape."""
    return tuple(randn(*shape, device=device) for shape in shapes)


def distinct_per_row(rows: int, high: int, k: int, device: str = "cpu") -> torch.Tensor:
    """``rows`` x ``k`` indices below ``high``, no repeats within a row."""
    return torch.rand(rows, high).argsort(dim=1)[:, :k].to(device)


def ints(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, device=device)


# ---------------------------------------------------------------------------------------------
# elementwise


def elementwise_chain(x, y):
    return ((x.sin() * y + 1).relu().exp() - y.tanh()) / (1 + x.abs())


def elementwise_long_chain(x):
    for _ in range(12):
        x = torch.sin(x) * 1.1 + 0.1
    return x


def broadcasting(x, y, z):
    return x + y * z, (x * z).sum(-1)


def elementwise_misc(x):
    return (x.clamp(-0.5, 0.5), x.abs().sqrt(), torch.sign(x), (x.abs() + 1).reciprocal(),
            x.pow(3), torch.sigmoid(x), F.gelu(x), F.silu(x), torch.lerp(x, x.flip(0), 0.3))


def integer_ops(a, b):
    return a // b, a % b, a & b, a | 3, a << 2, -a, a.abs(), torch.maximum(a, b)


def comparisons(x, y):
    m = (x > y) & (y < 0.5) | ~(x == y)
    return m, x >= 0, m.sum(), torch.isclose(x, y), torch.logical_xor(x > 0, y > 0)


def dtype_promotion(f32, i64, f16, b):
    return f32 + i64, f16 * f32, i64 * 2.5, b + i64, i64 // 2, f16 + 1, f32.sum(dtype=torch.float64)


def casts(x):
    return (x.to(torch.float16) * 2, x.to(torch.bfloat16).exp(), x.double() * 3, x.long(),
            x.int(), (x > 0).float(), x.to(torch.float16).float())


def half_precision(a, b):
    return a @ b, F.layer_norm(a, (8,)), (a.to(torch.bfloat16) @ b.to(torch.bfloat16)).float()


def where_mask(x, y):
    return torch.where(x > 0, x, y * 2), x.masked_fill(y < 0, 0.0), torch.where(y > x, 1.0, x)


def python_scalars(x, a, n, flag):
    y = x * a + n
    if flag:
        y = y.relu()
    return y ** n, a * 2, n + 1


def python_scalar_varies(x, a):
    return x * a + a ** 2


def tensor_scalar_w2(a1, A):
    return a1 * A + a1 ** 2


# ---------------------------------------------------------------------------------------------
# matmul


def w4_run(x):
    return [x.mm(x) for _ in range(50)]


def w4_two_chains(x1, x2):
    return w4_run(x1), w4_run(x2)


def matmul_chain(x, *ws):
    for w in ws:
        x = torch.tanh(x @ w)
    return x


def mm_chain_normalized(x, w):
    n = x.shape[-1]
    for _ in range(10):
        x = x.mm(w) / math.sqrt(n)
    return x


def matmul_variety(a, b, c, w, bias):
    return (torch.bmm(c, c.transpose(1, 2)), torch.einsum("ik,kj->ij", a, b),
            F.linear(a, w, bias), torch.addmm(bias, a, w.t()), c @ b)


def matmul_sizes_w3(a, b, c, d):
    return a @ b, c @ d


# ---------------------------------------------------------------------------------------------
# views, slicing, indexing


def views(x):
    y = x.view(2, 3, 4).transpose(0, 1).reshape(6, 4)
    z = x.permute(1, 0).contiguous().unsqueeze(0).squeeze(0)
    return y * 2, z + 1, x.expand(3, 6, 4).sum(0), x.flatten()[3:9]


def slicing_python_ints(x, r0, r1, c0, c1):
    return x[r0:r1, c0:c1] * 2, x[::2, -3:] + 1, x[..., 1], x[None, :, 0], x.narrow(0, 1, 2) - 1


def w1_slice_assign(A, B, r0, r1, c0, c1):
    B[:] = A[r0:r1, c0:c1]


def index_select_gather_scatter(x, idx, gidx, sidx, src):
    # scatter's index has no repeats within a row: with repeats its result is undefined (CUDA
    # and CPU keep different writes), so eager itself gives no reference
    return (x.index_select(1, idx), torch.gather(x, 1, gidx), x.scatter(1, sidx, src),
            torch.zeros(4, 6, device=x.device).scatter_add(0, gidx[:4, :].remainder(4), src[:4]))


def advanced_int_indexing(x, idx, idx2):
    return x[idx], x[:, idx], x[idx, idx2]


def index_put_out_of_place(x, idx, v):
    return x.index_put((idx,), v, accumulate=True), x.index_put((idx[:2],), v[:2])


# ---------------------------------------------------------------------------------------------
# in-place updates


def inplace_input_returned(x, y):
    x.add_(y)
    x.mul_(2)
    return x


def inplace_slice_of_input(x, y):
    x[1:3] += 1
    y.zero_()
    return (x * 2).sum()


def copy_into_input(out, x):
    out.copy_(x.sin())
    out.mul_(2)


def index_add_into_input(buf, idx, src):
    buf.index_add_(0, idx, src)
    return buf.sum(0)


def mutate_view_of_input(x):
    v = x[:, 0]
    v.mul_(3)
    return x.sum()


def mutate_then_use(x, y):
    x.add_(1)
    return x * y, y - x


def inplace_metadata_of_input(x):
    x.unsqueeze_(0)
    return x.shape[0] + 1, x * 2


def inplace_on_intermediate(x):
    t = x * 2
    t.add_(1)
    t[0] = 0
    t.relu_()
    return t


def batch_norm_functional_train(x, running_mean, running_var, weight, bias):
    return F.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum=0.1)


# ---------------------------------------------------------------------------------------------
# outputs: several, nested, constants, aliases


def nested_outputs(x, y):
    return {"sum": x.sum(), "parts": [x * 2, (y + 1, y.mean())], "n": 3}


def cat_stack_split(x, y):
    z = torch.cat([x, y], 0)
    return (z, torch.stack([x, y]), torch.split(z * 2, 3), torch.chunk(x, 2, 1), torch.unbind(y),
            torch.cat([x, y], 1).split([2, 6], dim=1))


def topk_sort(x):
    v, i = x.topk(3, dim=-1)
    s, si = x.sort(dim=0, descending=True)
    return v, i, s, si, x.argsort(-1), torch.max(x, dim=1)


def returns_constants(x):
    return x + 1, 3, "label", None, (2.5, True)


def returns_input_unchanged(x, y):
    return x, y * 2


def returns_same_tensor_twice(x):
    y = x * 2
    return y, y


def returns_views_of_input(x):
    return x[1:], x.t(), x.view(-1), x.unsqueeze(0)


def returns_views_of_intermediate(x):
    y = x + 1
    return y, y[0], y.t(), y.view(-1)[2:5]


# ---------------------------------------------------------------------------------------------
# reductions, scans, nn functional


def reductions(x):
    return (x.sum(), x.sum(1, keepdim=True), x.mean(0), x.var(1), x.std(), x.amax(1), x.amin(0),
            x.prod(1), x.norm(), torch.logsumexp(x, 1))


def index_reductions(x, i):
    return (x.argmax(1), x.argmin(0), (x > 0).any(1), (x > -5).all(),
            torch.count_nonzero(x > 0.5, 0), i.sum(), i.max())


def cumulative(x):
    return x.cumsum(1), x.cumprod(0), torch.cummax(x, 1)


def softmax_norms(x, w, b):
    return (x.softmax(-1), F.log_softmax(x, 1), F.layer_norm(x, (8,), w, b),
            F.group_norm(x.view(2, 4, 8), 2))


def conv_pool(x, w, b):
    y = F.conv2d(x, w, b, padding=1)
    return F.max_pool2d(y.relu(), 2), F.avg_pool2d(y, 2)


def embedding(idx, weight):
    return F.embedding(idx, weight), F.embedding(idx, weight, padding_idx=0).sum(1)


def losses(x, target, y):
    log_p = F.log_softmax(x, 1)
    return F.cross_entropy(x, target), F.mse_loss(x, y), F.nll_loss(log_p, target, reduction="sum")


# ---------------------------------------------------------------------------------------------
# factory ops, random ops


def factory_ops(x):
    d = x.device
    n = x.shape[0]
    return (torch.arange(n, device=d) * x[:, 0], torch.zeros(3, 4, device=d),
            torch.full((2, 3), 2.5, device=d), torch.ones_like(x) + x, torch.eye(4, device=d),
            torch.linspace(0, 1, 5, device=d), torch.arange(0, 10, 3, device=d))


def factory_default_device(x):
    return (x.sum() + 1, torch.arange(5), torch.tensor([1.0, 2.0]) * 3,
            torch.zeros(2, dtype=torch.int64))


def random_inside(x):
    return (x + torch.rand(x.shape, device=x.device) + torch.randn_like(x),
            torch.randint(0, 10, (5,), device=x.device), torch.bernoulli(torch.sigmoid(x)))


def dropout(x):
    return F.dropout(x, 0.5, training=True) * 2


# ---------------------------------------------------------------------------------------------
# graph breaks, results to the host, shapes that change


def graph_break_item(x):
    y = x.sin()
    z = y * 2 if y.sum().item() > 0 else y - 1
    return z.cos()


def graph_break_print(x):
    y = x * 2
    print("autopar corpus: a graph break")
    return y + 1


def w1_tensor_bounds(A, B, r0, r1, c0, c1):
    B[:] = A[r0:r1, c0:c1]


def w1_bounds_made_inside(A, B):
    r0, r1 = torch.tensor(2, device=A.device), torch.tensor(6, device=A.device)
    B[:] = A[r0:r1, r0 + 1:r1 + 1]


def w2_scalar_made_inside(A):
    a1 = torch.tensor(10.0, device=A.device)
    return a1 * A + a1 ** 2


def narrow_at_item(x, n):
    k = n.item()
    return x.narrow(0, k, 2) * k


def results_to_cpu_w5(x):
    ys = [x.mm(x) for _ in range(10)]
    return [t.cpu() for t in ys]


def varying_shapes(x):
    return x.softmax(-1) * x.shape[0], x.sum(0)


def _varying_shape_inputs(d):
    n = 3 + int(torch.randint(0, 5, ()))
    return (randn(n, 4, device=d),)


# ---------------------------------------------------------------------------------------------
# modules and training steps (factories take the device; programs also the compile function)


def mlp(device: str) -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)).to(device)


def mlp_dropout(device: str) -> nn.Module:
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
    return net.to(device)


def small_cnn(device: str, train: bool = True) -> nn.Module:
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    ).to(device)
    return net.train(train)


def small_cnn_eval(device: str) -> nn.Module:
    return small_cnn(device, train=False)


def batch_norm_module(device: str, train: bool = True) -> nn.Module:
    return nn.BatchNorm1d(8).to(device).train(train)


def batch_norm_module_eval(device: str) -> nn.Module:
    bn = batch_norm_module(device, train=False)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    return bn


class ScaleShift(nn.Module):
    """A parameter, a float buffer and a call counter buffer updated in place by forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8))
        self.register_buffer("offset", torch.randn(8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.weight + self.offset * self.calls


def scale_shift(device: str) -> nn.Module:
    return ScaleShift().to(device)


def train_step_sgd(device: str) -> Callable:
    """W6 style, the whole step is the compiled function (backward inside it breaks the graph)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, target):
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step.module = model
    return step


def train_loop_adam(device: str, compile_fn: CompileFn) -> Callable:
    """W6 style, only the model is compiled; loss, backward and Adam run eagerly around it."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)).to(device)
    compiled = compile_fn(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(x, target):
        opt.zero_grad()
        out = compiled(x)
        loss = F.cross_entropy(out, target)
        loss.backward()
        opt.step()
        return loss.detach(), out.detach()

    step.module = model
    return step


# ---------------------------------------------------------------------------------------------
# the corpus


def _bounds_inputs(d: str, as_tensors: bool) -> tuple:
    bounds = (100, 356, 100, 356)
    if as_tensors:
        bounds = tuple(torch.tensor(b, device=d) for b in bounds)
    return (rand(600, 600, device=d), rand(256, 256, device=d), *bounds)


def _train_inputs(d: str) -> tuple:
    return randn(32, 16, device=d), randint(10, 32, device=d)


def _c(*tags: str) -> frozenset[str]:
    return frozenset(tags)


CASES: list[Case] = [
    # elementwise, broadcasting, dtypes, masks, scalars
    Case("elementwise_chain", elementwise_chain, lambda d: normals(d, (8, 8), (8, 8)),
         requires_grad=True, tags=_c("elementwise")),
    Case("elementwise_long_chain", elementwise_long_chain, lambda d: normals(d, (16, 16)),
         requires_grad=True, tags=_c("elementwise")),
    Case("broadcasting", broadcasting, lambda d: normals(d, (4, 1, 3), (5, 3), (3,)),
         requires_grad=True, tags=_c("elementwise", "broadcast")),
    Case("elementwise_misc", elementwise_misc, lambda d: normals(d, (6, 5)),
         requires_grad=True, tags=_c("elementwise")),
    Case("integer_ops", integer_ops,
         lambda d: (randint(100, 5, 4, device=d) - 50, randint(9, 5, 4, device=d) + 1),
         tags=_c("elementwise", "dtype")),
    Case("comparisons", comparisons, lambda d: normals(d, (5, 4), (5, 4)),
         tags=_c("elementwise", "dtype")),
    Case("dtype_promotion", dtype_promotion,
         lambda d: (randn(4, 3, device=d), randint(10, 4, 3, device=d),
                    randn(4, 3, device=d, dtype=torch.float16), randint(2, 4, 3, device=d).bool()),
         tags=_c("elementwise", "dtype")),
    Case("casts", casts, lambda d: normals(d, (4, 5)), requires_grad=True, tags=_c("dtype")),
    Case("half_precision", half_precision,
         lambda d: tuple(t.half() for t in normals(d, (4, 8), (8, 3))),
         requires_grad=True, tags=_c("dtype", "matmul")),
    Case("where_mask", where_mask, lambda d: normals(d, (6, 4), (6, 4)),
         requires_grad=True, tags=_c("elementwise", "mask")),
    Case("python_scalars", python_scalars, lambda d: (*normals(d, (4, 4)), 2.5, 3, True),
         requires_grad=True, tags=_c("scalar")),
    Case("python_scalar_varies", python_scalar_varies,
         lambda d: (*normals(d, (4, 4)), round(float(torch.rand(())), 3)), tags=_c("scalar")),
    Case("tensor_scalar_w2", tensor_scalar_w2,
         lambda d: (scalar(10.0, d), rand(600, 600, device=d)),
         requires_grad=True, tags=_c("scalar", "workload")),
    # matmul
    Case("w4_two_chains", w4_two_chains,
         lambda d: (rand(64, 64, device=d) / 8, rand(64, 64, device=d) / 8),
         tags=_c("matmul", "workload")),
    Case("w4_two_chains_large", w4_two_chains,
         lambda d: (rand(512, 512, device=d) / 23, rand(512, 512, device=d) / 23),
         rtol=1e-4, atol=1e-4, tags=_c("matmul", "workload", "slow")),
    Case("matmul_chain", matmul_chain,
         lambda d: (randn(8, 16, device=d), *(randn(16, 16, device=d) / 4 for _ in range(4))),
         requires_grad=True, tags=_c("matmul")),
    Case("mm_chain_normalized", mm_chain_normalized, lambda d: normals(d, (32, 32), (32, 32)),
         tags=_c("matmul")),
    Case("matmul_variety", matmul_variety,
         lambda d: normals(d, (4, 6), (6, 5), (3, 4, 6), (5, 6), (5,)),
         requires_grad=True, tags=_c("matmul")),
    Case("matmul_sizes_w3", matmul_sizes_w3,
         lambda d: normals(d, (5, 10), (10, 5), (100, 200), (200, 100)),
         requires_grad=True, tags=_c("matmul", "workload")),
    # views, slicing, indexing
    Case("views", views, lambda d: normals(d, (6, 4)), requires_grad=True, tags=_c("view")),
    Case("slicing_python_ints", slicing_python_ints, lambda d: (*normals(d, (8, 7)), 1, 5, 2, 6),
         requires_grad=True, tags=_c("view", "slice")),
    Case("w1_slice_assign", w1_slice_assign, lambda d: _bounds_inputs(d, as_tensors=False),
         mutates_inputs=True, tags=_c("slice", "mutation", "workload")),
    Case("index_select_gather_scatter", index_select_gather_scatter,
         lambda d: (randn(6, 5, device=d), randint(5, 3, device=d), randint(5, 6, 3, device=d),
                    distinct_per_row(6, 5, 3, device=d), randn(6, 3, device=d)),
         requires_grad=True, tags=_c("index")),
    Case("advanced_int_indexing", advanced_int_indexing,
         lambda d: (randn(6, 5, device=d), randint(5, 4, device=d), randint(5, 4, device=d)),
         requires_grad=True, tags=_c("index")),
    Case("index_put_out_of_place", index_put_out_of_place,
         lambda d: (randn(6, 3, device=d), ints([0, 2, 2, 5], d), randn(4, 3, device=d)),
         requires_grad=True, tags=_c("index")),
    # in-place updates
    Case("inplace_input_returned", inplace_input_returned, lambda d: normals(d, (4, 4), (4, 4)),
         mutates_inputs=True, tags=_c("mutation")),
    Case("inplace_slice_of_input", inplace_slice_of_input, lambda d: normals(d, (5, 3), (2, 2)),
         mutates_inputs=True, tags=_c("mutation", "slice")),
    Case("copy_into_input", copy_into_input, lambda d: normals(d, (4, 3), (4, 3)),
         mutates_inputs=True, tags=_c("mutation")),
    Case("index_add_into_input", index_add_into_input,
         lambda d: (randn(5, 3, device=d), ints([0, 4, 4, 1], d), randn(4, 3, device=d)),
         mutates_inputs=True, tags=_c("mutation", "index")),
    Case("mutate_view_of_input", mutate_view_of_input, lambda d: normals(d, (4, 3)),
         mutates_inputs=True, tags=_c("mutation", "view")),
    Case("mutate_then_use", mutate_then_use, lambda d: normals(d, (4, 3), (4, 3)),
         mutates_inputs=True, tags=_c("mutation")),
    Case("inplace_metadata_of_input", inplace_metadata_of_input, lambda d: normals(d, (4, 3)),
         mutates_inputs=True, tags=_c("mutation", "view")),
    Case("inplace_on_intermediate", inplace_on_intermediate, lambda d: normals(d, (4, 3)),
         requires_grad=True, tags=_c("mutation")),
    Case("batch_norm_functional_train", batch_norm_functional_train,
         lambda d: (randn(6, 4, device=d), torch.zeros(4, device=d), torch.ones(4, device=d),
                    *normals(d, (4,), (4,))),
         mutates_inputs=True, tags=_c("mutation", "nn")),
    # outputs
    Case("nested_outputs", nested_outputs, lambda d: normals(d, (3, 4), (2,)),
         requires_grad=True, tags=_c("outputs")),
    Case("cat_stack_split", cat_stack_split, lambda d: normals(d, (3, 4), (3, 4)),
         requires_grad=True, tags=_c("outputs", "view")),
    Case("topk_sort", topk_sort, lambda d: normals(d, (5, 6)), requires_grad=True,
         tags=_c("outputs", "reduction")),
    Case("returns_constants", returns_constants, lambda d: normals(d, (3,)),
         requires_grad=True, tags=_c("outputs")),
    Case("returns_input_unchanged", returns_input_unchanged, lambda d: normals(d, (3, 2), (3, 2)),
         requires_grad=True, tags=_c("outputs", "alias")),
    Case("returns_same_tensor_twice", returns_same_tensor_twice, lambda d: normals(d, (3, 2)),
         requires_grad=True, tags=_c("outputs", "alias")),
    Case("returns_views_of_input", returns_views_of_input, lambda d: normals(d, (3, 4)),
         requires_grad=True, tags=_c("outputs", "alias", "view")),
    Case("returns_views_of_intermediate", returns_views_of_intermediate,
         lambda d: normals(d, (3, 4)), requires_grad=True, tags=_c("outputs", "alias", "view")),
    # reductions, scans, nn functional
    Case("reductions", reductions, lambda d: normals(d, (5, 6)), requires_grad=True,
         tags=_c("reduction")),
    Case("index_reductions", index_reductions,
         lambda d: (randn(5, 6, device=d), randint(50, 7, device=d)),
         tags=_c("reduction", "dtype")),
    Case("cumulative", cumulative, lambda d: normals(d, (4, 5)), requires_grad=True,
         tags=_c("reduction")),
    Case("softmax_norms", softmax_norms, lambda d: normals(d, (8, 8), (8,), (8,)),
         requires_grad=True, tags=_c("nn")),
    Case("conv_pool", conv_pool, lambda d: normals(d, (2, 3, 8, 8), (4, 3, 3, 3), (4,)),
         requires_grad=True, tags=_c("nn", "conv")),
    Case("embedding", embedding, lambda d: (randint(10, 4, 3, device=d), randn(10, 5, device=d)),
         requires_grad=True, tags=_c("nn", "index")),
    Case("losses", losses,
         lambda d: (randn(6, 4, device=d), randint(4, 6, device=d), randn(6, 4, device=d)),
         requires_grad=True, tags=_c("nn", "reduction")),
    # factory ops, random ops
    Case("factory_ops", factory_ops, lambda d: normals(d, (4, 3)), tags=_c("factory")),
    Case("factory_default_device", factory_default_device, lambda d: normals(d, (4, 3)),
         tags=_c("factory", "device")),
    Case("random_inside", random_inside, lambda d: normals(d, (4, 5)), random=True,
         tags=_c("random", "factory")),
    Case("dropout", dropout, lambda d: normals(d, (8, 8)), requires_grad=True, random=True,
         tags=_c("random", "nn")),
    # graph breaks, results to the host, dynamic shapes
    Case("graph_break_item", graph_break_item, lambda d: normals(d, (4, 4)),
         requires_grad=True, calls=3, tags=_c("graph_break")),
    Case("graph_break_print", graph_break_print, lambda d: normals(d, (4, 4)),
         requires_grad=True, tags=_c("graph_break")),
    Case("w1_tensor_bounds", w1_tensor_bounds, lambda d: _bounds_inputs(d, as_tensors=True),
         mutates_inputs=True, tags=_c("slice", "mutation", "graph_break", "workload")),
    Case("w1_bounds_made_inside", w1_bounds_made_inside,
         lambda d: (rand(8, 8, device=d), rand(4, 4, device=d)),
         mutates_inputs=True, tags=_c("slice", "mutation", "scalar", "workload")),
    Case("w2_scalar_made_inside", w2_scalar_made_inside, lambda d: (rand(6, 6, device=d),),
         tags=_c("scalar", "workload")),
    Case("narrow_at_item", narrow_at_item,
         lambda d: (rand(8, 3, device=d), torch.tensor(5, device=d)),
         tags=_c("slice", "graph_break")),
    Case("results_to_cpu_w5", results_to_cpu_w5, lambda d: (rand(32, 32, device=d) / 6,),
         tags=_c("device", "workload")),
    Case("varying_shapes", varying_shapes, _varying_shape_inputs, calls=3, tags=_c("dynamic")),
    # modules and training
    Case("mlp_module", mlp, lambda d: normals(d, (8, 16)), kind="factory",
         requires_grad=True, tags=_c("module")),
    Case("mlp_dropout_module", mlp_dropout, lambda d: normals(d, (8, 16)), kind="factory",
         requires_grad=True, random=True, tags=_c("module", "random")),
    Case("small_cnn_train", small_cnn, lambda d: normals(d, (4, 3, 12, 12)), kind="factory",
         requires_grad=True, tags=_c("module", "conv")),
    Case("small_cnn_eval", small_cnn_eval, lambda d: normals(d, (4, 3, 12, 12)),
         kind="factory", tags=_c("module", "conv")),
    Case("batch_norm_module_train", batch_norm_module, lambda d: normals(d, (6, 8)),
         kind="factory", requires_grad=True, tags=_c("module", "nn")),
    Case("batch_norm_module_eval", batch_norm_module_eval, lambda d: normals(d, (6, 8)),
         kind="factory", requires_grad=True, tags=_c("module", "nn")),
    Case("module_params_buffers", scale_shift, lambda d: normals(d, (3, 8)), kind="factory",
         requires_grad=True, tags=_c("module")),
    Case("train_step_sgd", train_step_sgd, _train_inputs, kind="factory", training_step=True,
         calls=3, tags=_c("train", "module", "graph_break", "workload")),
    Case("train_loop_adam", train_loop_adam, _train_inputs, kind="program", training_step=True,
         calls=3, tags=_c("train", "module", "workload")),
]

CATEGORIES: dict[str, tuple[str, ...]] = {
    "elementwise chains": ("elementwise",),
    "matmul chains and W4": ("matmul",),
    "views, slicing and indexing": ("view", "slice", "index"),
    "in-place updates of inputs": ("mutation",),
    "multiple outputs": ("outputs",),
    "Python scalars": ("scalar",),
    "reductions": ("reduction",),
    "random ops": ("random",),
    "modules": ("module",),
    "training step": ("train",),
    "graph break": ("graph_break",),
    "results to CPU": ("device",),
}
"""Every category the corpus promises, and the tags that count for it."""


def case(name: str) -> Case:
    """The case called ``name``."""
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no case named {name!r}; names: {[c.name for c in CASES]}")


# ---------------------------------------------------------------------------------------------
# compile functions under test: the tables live in the test modules, the pieces here


@dataclass(frozen=True)
class Compiler:
    """A named compile function, and why it can't run here (None when it can)."""

    name: str
    compile: CompileFn
    unavailable: Callable[[], str | None] = lambda: None


def autopar_unavailable() -> str | None:
    """Why ``autopar.compile`` and the ``"autopar"`` backend can't be used, or None."""
    try:
        import autopar
    except Exception as e:
        return f"autopar does not import: {type(e).__name__}: {e}"
    if not callable(getattr(autopar, "compile", None)):
        return "autopar.compile does not exist yet"
    return None


def policies_unavailable() -> str | None:
    """Why the placement policies can't be tested yet, or None."""
    import importlib.util

    why = autopar_unavailable()
    if why:
        return why
    if importlib.util.find_spec("autopar.schedule.place") is None:
        return "autopar.schedule.place (the placement policies) does not exist yet"
    return None


def torch_compile_autopar(fn: Callable) -> Callable:
    import autopar  # noqa: F401  (registers the "autopar" backend)

    return torch.compile(fn, backend="autopar")


def autopar_compile(**options: Any) -> CompileFn:
    """``fn -> autopar.compile(fn, **options)``."""

    def compile_fn(fn: Callable) -> Callable:
        import autopar

        return autopar.compile(fn, **options)

    return compile_fn


def clone_args(args: Sequence[Any]) -> tuple[Any, ...]:
    """Independent copies of call arguments (tensors cloned, everything else deep-copied)."""
    return tuple(a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
                 else copy.deepcopy(a) for a in args)
