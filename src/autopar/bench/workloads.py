"""The workloads autopar is measured on: W1-W6 (benchmarks/README.md) and four that real users have.

A :class:`Workload` is data and functions, kept in one registry (:data:`WORKLOADS`, in table
order); :func:`select` picks by name. Every workload has an *eager* form, the code a user writes
for one device, and most have a *hand-tuned* form, what an expert writes instead.

Policy
- Inputs come from ``make_inputs(devices, size)`` with a fixed seed, drawn on the host and moved
  to the *home* device (the first GPU named in ``devices``, else the host), so every variant of a
  workload sees the same values on any machine. Never zeros.
- ``size="full"``: the sizes of benchmarks/README.md (GPUs); ``"small"`` keeps each to a few
  milliseconds on a 2-core CPU, for CPU machines and CI.
- The hand-tuned form runs on inputs made by ``prepare_hand(inputs, gpus)`` outside the timed
  region: bounds read back to Python once, the second input copied to the second GPU up front,
  pinned buffers and side streams allocated, parameters replicated, a CUDA graph captured. A
  real run gives it ``hand_gpus`` GPUs; tests may give it ``["cpu", ...]`` stand-ins to check its
  arithmetic without CUDA, except where ``hand_cuda_only`` (streams, CUDA graphs).
- ``hand_goal``: autopar should be the fastest or within 5% of the hand-tuned form (W1-W6;
  not W3's resident cases, whose hand-tuned form moves the data, which autopar is not given).
- ``check(out, ref)`` compares an output with eager's (on the output's device, with the
  workload's tolerance: results may come from another device kind) and raises AssertionError
  saying what differs. Stateful workloads set ``calls=2``: the second call sees the first update.
- ``whole_step``: the eager form is a whole training step (forward, ``backward()``, update);
  autopar runs it through :func:`autopar.data_parallel` (one graph, batch split across devices)
  instead of ``autopar.compile`` (separate forward, backward and update graphs).

Glossary: *home* the device eager code uses; *case* one W3 (size, data placement) pair, a
workload of its own named ``W3/<m>x<k>x<n>/<mode>``; *group* the part of a name before ``/``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F

from .measure import measure

__all__ = ["SIZES", "WORKLOADS", "Workload", "home_of", "select"]

SEED = 20261130
SIZES = ("full", "small")
LR = 0.01


# -- the workload type -------------------------------------------------------------------------
def _identity_prepare(inputs: tuple, gpus: Sequence[str]) -> tuple:
    return inputs


@dataclass(frozen=True)
class Workload:
    """One benchmark program. ``hand`` is ``None`` where no hand-tuned form exists."""

    name: str
    title: str
    family: str
    make_inputs: Callable[[Sequence[str], str], tuple]
    eager: Callable[..., Any]
    hand: Callable[..., Any] | None = None
    prepare_hand: Callable[[tuple, Sequence[str]], tuple] = _identity_prepare
    hand_gpus: int = 0  # GPUs the hand-tuned form needs on a real run
    hand_cuda_only: bool = False  # its logic itself needs CUDA: no CPU stand-in devices
    min_gpus: int = 0  # GPUs the workload needs to be run at all
    sizes: tuple[str, ...] = SIZES  # the sizes this workload (or W3 case) belongs to
    calls: int = 1  # calls before outputs are compared
    rtol: float = 1e-3
    atol: float = 1e-3
    explain_inputs_on: str | None = "cuda:0"  # where explain takes CPU-built inputs to live
    explain_note: str = ""  # why it isn't explained, when explain_inputs_on is None
    hand_goal: bool = False  # autopar should match the hand-tuned form (W1-W6)
    whole_step: bool = False  # a training step: autopar runs it with autopar.data_parallel

    @property
    def group(self) -> str:
        return self.name.split("/", 1)[0]

    def check(self, out: Any, ref: Any) -> None:
        """Raise AssertionError if ``out`` differs from eager's ``ref``."""
        _assert_close(out, ref, self.rtol, self.atol, self.name)


def home_of(devices: Sequence[str]) -> str:
    """The device code written for one device uses: the first GPU named, else the host."""
    for d in devices:
        if d.startswith("cuda"):
            return d if ":" in d else "cuda:0"
    return "cpu"


def _assert_close(out: Any, ref: Any, rtol: float, atol: float, where: str) -> None:
    if isinstance(ref, torch.Tensor):
        if not isinstance(out, torch.Tensor):
            raise AssertionError(f"{where}: expected a tensor, got {type(out).__name__}")
        if out.shape != ref.shape:
            raise AssertionError(f"{where}: shape {tuple(out.shape)} != {tuple(ref.shape)}")
        torch.testing.assert_close(
            out.detach(), ref.detach().to(out.device), rtol=rtol, atol=atol,
            check_device=False, check_stride=False, msg=lambda m: f"{where}: {m}")
        return
    if isinstance(ref, (list, tuple)):
        if not isinstance(out, (list, tuple)) or len(out) != len(ref):
            raise AssertionError(f"{where}: expected a sequence of {len(ref)}, got {out!r:.80}")
        for i, (o, r) in enumerate(zip(out, ref)):
            _assert_close(o, r, rtol, atol, f"{where}[{i}]")
        return
    if out != ref:
        raise AssertionError(f"{where}: {out!r} != {ref!r}")


# -- inputs ------------------------------------------------------------------------------------
class _Draw:
    """Seeded draws on the host, moved to a device: the same values on every machine."""

    def __init__(self, device: str, seed: int = SEED) -> None:
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def rand(self, *shape: int) -> torch.Tensor:
        return self._to(torch.rand(*shape, generator=self.gen) + 0.01)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return self._to(torch.randn(*shape, generator=self.gen) * scale)

    def weight(self, out_f: int, in_f: int, grad: bool = False) -> torch.Tensor:
        w = self.randn(out_f, in_f, scale=1.0 / math.sqrt(in_f))
        return w.requires_grad_(grad)

    def bias(self, n: int, grad: bool = False) -> torch.Tensor:
        return self.randn(n, scale=0.1).requires_grad_(grad)

    def labels(self, n: int, classes: int) -> torch.Tensor:
        return self._to(torch.randint(0, classes, (n,), generator=self.gen))

    def scalar(self, value: float | int) -> torch.Tensor:
        return self._to(torch.tensor(value))


def _same_tensors_on(device: str, values: Iterable[Any]) -> tuple:
    return tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in values)


# -- W1: slicing with GPU scalars --------------------------------------------------------------
def _w1_inputs(devices: Sequence[str], size: str) -> tuple:
    d = _Draw(home_of(devices))
    A, B = d.rand(600, 600), d.rand(256, 256)
    return (A, B, d.scalar(100), d.scalar(356), d.scalar(100), d.scalar(356))


def w1_slice(A, B, r0, r1, c0, c1):
    B[:] = A[r0:r1, c0:c1]
    return B


def w1_bounds_inside(A, B):
    """W1 with its bounds made inside the function, as 0-dim tensors on ``A``'s device (the
    forum case: ``benchmarks/launch.py``, ``benchmarks/w1_capture.py``)."""
    d = A.device
    r0, r1 = torch.tensor(100, device=d), torch.tensor(356, device=d)
    c0, c1 = torch.tensor(100, device=d), torch.tensor(356, device=d)
    B[:] = A[r0:r1, c0:c1]
    return B


def _w1_prepare(inputs: tuple, gpus: Sequence[str]) -> tuple:
    A, B, *bounds = inputs
    return (A, B, *(int(b) for b in bounds))  # read the bounds back once, not on every call


# -- W2: arithmetic on a GPU scalar ------------------------------------------------------------
def _w2_inputs(devices: Sequence[str], size: str) -> tuple:
    d = _Draw(home_of(devices))
    return (d.scalar(10.0), d.rand(600, 600))


def w2_scalar(a1, A):
    return a1 * A + a1**2


def _w2_prepare(inputs: tuple, gpus: Sequence[str]) -> tuple:
    a1, A = inputs
    return (float(a1), A)


# -- W3: where the GPU starts to win -----------------------------------------------------------
W3_SHAPES = ((5, 10, 5), (100, 200, 100), (256, 256, 256), (512, 512, 512),
             (1024, 1024, 1024), (2048, 2048, 2048))
W3_SMALL = ((5, 10, 5), (100, 200, 100), (512, 512, 512))


def w3_matmul(x, y):
    return x @ y


def w3_via_gpu(x, y):
    return (x.to("cuda") @ y.to("cuda")).cpu()


def w3_faster(x, y, where):
    """The hand-tuned choice: compute where it is faster, data and result on the host."""
    if where.startswith("cpu"):
        return x @ y
    return (x.to(where) @ y.to(where)).cpu()


def _time_once(fn: Callable[[], Any], reps: int = 5) -> float:
    return measure(fn, warmup=2, repeat=reps).median


def _w3_resident_time(x: torch.Tensor, y: torch.Tensor, device: str) -> float:
    a, b = x.to(device), y.to(device)
    return _time_once(lambda: a @ b)


def _w3_prepare_resident(inputs: tuple, gpus: Sequence[str]) -> tuple:
    """Keep the data resident on whichever of the host and the first GPU is faster."""
    x, y = inputs
    best = min(("cpu", gpus[0]), key=lambda dev: _w3_resident_time(x, y, dev))
    return (x.to(best), y.to(best))


def _w3_prepare_host(inputs: tuple, gpus: Sequence[str]) -> tuple:
    x, y = inputs
    best = min(("cpu", gpus[0]), key=lambda dev: _time_once(lambda: w3_faster(x, y, dev)))
    return (x, y, best)


def _w3_case(shape: tuple[int, int, int], mode: str) -> Workload:
    m, k, n = shape
    label = f"{m}x{k}x{n}"
    sizes = ("full", "small") if shape in W3_SMALL else ("full",)

    def make(devices: Sequence[str], size: str) -> tuple:
        d = _Draw("cpu" if mode == "host" else home_of(devices))
        return (d.rand(m, k), d.rand(k, n))

    if mode == "resident":
        return Workload(
            f"W3/{label}/resident", f"x @ y, {label}, data resident", "matmul-size", make,
            w3_matmul, hand=w3_matmul, prepare_hand=_w3_prepare_resident, hand_gpus=1,
            sizes=sizes)
    return Workload(
        f"W3/{label}/host", f"x @ y, {label}, data and result on the host", "matmul-size",
        make, w3_via_gpu, hand=w3_faster, prepare_hand=_w3_prepare_host, hand_gpus=1,
        min_gpus=1, sizes=sizes, explain_inputs_on="cpu:0", hand_goal=True)


# -- W4: two chains written for one device -----------------------------------------------------
CHAIN = 50  # matmuls per chain, as in benchmarks/README.md
_SIDE = {"full": 4000, "small": 96}


def run(x: torch.Tensor) -> list[torch.Tensor]:
    return [x.mm(x) for _ in range(CHAIN)]


def w4_two_chains(x1, x2):
    return run(x1), run(x2)


def _w4_inputs(devices: Sequence[str], size: str) -> tuple:
    d = _Draw(home_of(devices))
    return (d.rand(_SIDE[size], _SIDE[size]), d.rand(_SIDE[size], _SIDE[size]))


def _w4_prepare(inputs: tuple, gpus: Sequence[str]) -> tuple:
    x1, x2 = inputs
    return (x1.to(gpus[0]), x2.to(gpus[1]))  # the second input moves up front, off the clock


# -- W5: compute, then copy to the host --------------------------------------------------------
def w5_compute_then_copy(x):
    return [y.cpu() for y in run(x)]


def _w5_inputs(devices: Sequence[str], size: str) -> tuple:
    d = _Draw(home_of(devices))
    return (d.rand(_SIDE[size], _SIDE[size]),)


def w5_copy_stream(x, host_bufs, copy_stream):
    """Copy y[i-1] to pinned memory on a side stream while y[i] computes."""
    compute = torch.cuda.current_stream(x.device)
    for buf in host_bufs:
        y = x.mm(x)
        copy_stream.wait_stream(compute)
        with torch.cuda.stream(copy_stream):
            buf.copy_(y, non_blocking=True)
        y.record_stream(copy_stream)  # y's memory is not reused before the copy is done
    copy_stream.synchronize()
    return list(host_bufs)


def _w5_prepare(inputs: tuple, gpus: Sequence[str]) -> tuple:
    x = inputs[0].to(gpus[0])
    bufs = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for _ in range(CHAIN)]
    return (x, bufs, torch.cuda.Stream(device=x.device))


# -- W6: a 2-layer MLP trained with SGD --------------------------------------------------------
_MLP = {"full": (8192, 4096, 8192, 10), "small": (256, 256, 512, 10)}


def _mlp_loss(params: Sequence[torch.Tensor], x, t):
    w1, b1, w2, b2 = params
    return F.cross_entropy(F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2), t)


def w6_train_step(w1, b1, w2, b2, x, t):
    loss = _mlp_loss((w1, b1, w2, b2), x, t)
    loss.backward()
    with torch.no_grad():
        for p in (w1, b1, w2, b2):
            p -= LR * p.grad
            p.grad = None
    return loss.detach()


def _w6_inputs(devices: Sequence[str], size: str) -> tuple:
    batch, d_in, hidden, classes = _MLP[size]
    d = _Draw(home_of(devices))
    params = (d.weight(hidden, d_in, True), d.bias(hidden, True),
              d.weight(classes, hidden, True), d.bias(classes, True))
    return (*params, d.randn(batch, d_in), d.labels(batch, classes))


def w6_data_parallel(params, replicas, x0, t0, x1, t1):
    """Replicated parameters, half the batch on each GPU, gradients summed on the first."""
    l0 = _mlp_loss(params, x0, t0)
    l1 = _mlp_loss(replicas, x1, t1)
    torch.autograd.backward([l0 * 0.5, l1 * 0.5])  # both GPUs' backward passes at once
    with torch.no_grad():
        for p, r in zip(params, replicas):
            p -= LR * (p.grad + r.grad.to(p.device, non_blocking=True))
            p.grad = None
            r.grad = None
            r.copy_(p, non_blocking=True)  # re-broadcast the updated parameters
    return (l0.detach() + l1.detach().to(l0.device)) * 0.5


def _w6_prepare(inputs: tuple, gpus: Sequence[str]) -> tuple:
    *params, x, t = inputs
    params = tuple(p.detach().to(gpus[0]).requires_grad_() for p in params)
    replicas = tuple(p.detach().to(gpus[1]).requires_grad_() for p in params)
    half = x.shape[0] // 2
    return (params, replicas, x[:half].to(gpus[0]), t[:half].to(gpus[0]),
            x[half:].to(gpus[1]), t[half:].to(gpus[1]))


# -- ensemble4: four different models on one batch ---------------------------------------------
_ENSEMBLE = {"full": (4096, 4096, 4096, 1000), "small": (64, 128, 128, 16)}


def _model_relu(x, p):
    return F.linear(torch.relu(F.linear(x, p[0], p[1])), p[2], p[3])


def _model_gelu3(x, p):
    h = F.gelu(F.linear(x, p[0], p[1]))
    return F.linear(F.gelu(F.linear(h, p[2], p[3])), p[4], p[5])


def _model_residual(x, p):
    h = F.linear(x, p[0], p[1])
    h = h + torch.relu(F.linear(F.layer_norm(h, h.shape[-1:]), p[2], p[3]))
    return F.linear(h, p[4], p[5])


def _model_bottleneck(x, p):
    h = torch.tanh(F.linear(x, p[0], p[1]))
    return F.linear(F.silu(F.linear(h, p[2], p[3])), p[4], p[5])


_MODELS = (_model_relu, _model_gelu3, _model_residual, _model_bottleneck)


def ensemble4(x, p1, p2, p3, p4):
    return (_model_relu(x, p1) + _model_gelu3(x, p2) + _model_residual(x, p3)
            + _model_bottleneck(x, p4)) * 0.25


def _ensemble_inputs(devices: Sequence[str], size: str) -> tuple:
    batch, d_in, hidden, classes = _ENSEMBLE[size]
    d = _Draw(home_of(devices))

    def layers(*dims: int) -> tuple:
        return tuple(t for a, b in pairwise(dims) for t in (d.weight(b, a), d.bias(b)))

    x = d.randn(batch, d_in)
    return (x, layers(d_in, hidden, classes), layers(d_in, hidden, hidden, classes),
            layers(d_in, hidden, hidden, classes), layers(d_in, hidden // 2, hidden, classes))


def ensemble4_two_gpus(x0, x1, p1, p2, p3, p4):
    """Two models on each GPU; the second GPU's sum comes back to the first."""
    a = _model_relu(x0, p1) + _model_gelu3(x0, p2)
    b = _model_residual(x1, p3) + _model_bottleneck(x1, p4)
    return (a + b.to(a.device, non_blocking=True)) * 0.25


def _ensemble_prepare(inputs: tuple, gpus: Sequence[str]) -> tuple:
    x, p1, p2, p3, p4 = inputs
    g0, g1 = gpus[0], gpus[1]
    return (x.to(g0), x.to(g1), _same_tensors_on(g0, p1), _same_tensors_on(g0, p2),
            _same_tensors_on(g1, p3), _same_tensors_on(g1, p4))


# -- two_tower: user and item towers, then all-pairs scores ------------------------------------
_TOWERS = {"full": (8192, 8192, 2048, 4096, 256), "small": (64, 64, 64, 128, 32)}


def _tower(x, p):
    h = torch.relu(F.linear(x, p[0], p[1]))
    return F.normalize(F.linear(h, p[2], p[3]), dim=-1)


def two_tower(users, items, pu, pi):
    return _tower(users, pu) @ _tower(items, pi).t()


def two_tower_two_gpus(users, items, pu, pi):
    """The item tower runs on the second GPU; its embeddings come back for the scores."""
    u = _tower(users, pu)
    i = _tower(items, pi)
    return u @ i.to(u.device, non_blocking=True).t()


def _two_tower_inputs(devices: Sequence[str], size: str) -> tuple:
    n_users, n_items, d_in, hidden, emb = _TOWERS[size]
    d = _Draw(home_of(devices))

    def tower() -> tuple:
        return (d.weight(hidden, d_in), d.bias(hidden), d.weight(emb, hidden), d.bias(emb))

    return (d.randn(n_users, d_in), d.randn(n_items, d_in), tower(), tower())


def _two_tower_prepare(inputs: tuple, gpus: Sequence[str]) -> tuple:
    users, items, pu, pi = inputs
    return (users.to(gpus[0]), items.to(gpus[1]), _same_tensors_on(gpus[0], pu),
            _same_tensors_on(gpus[1], pi))


# -- cpu_preprocess: host preprocessing feeding a GPU model ------------------------------------
_IMAGES = {"full": (256, 128, 2048, 100), "small": (32, 32, 128, 10)}


def _preprocess(raw, mean, std):
    x = (raw.float() / 255.0 - mean) / std
    x = F.avg_pool2d(x.flip(-1), 2)  # deterministic flip, then halve the resolution
    return x.flatten(1)


def cpu_preprocess(raw, mean, std, w1, b1, w2, b2):
    x = _preprocess(raw, mean, std).to(w1.device)
    return F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2)


def cpu_preprocess_pipelined(raw, mean, std, w1, b1, w2, b2, staging, copied):
    """Preprocess chunk i+1 on the host while the GPU runs chunk i; pinned staging buffers."""
    outs = []
    for i, part in enumerate(raw.chunk(len(staging))):
        if copied[i] is not None:
            copied[i].synchronize()  # the previous call's copy out of this buffer is done
        staging[i].copy_(_preprocess(part, mean, std))
        x = staging[i].to(w1.device, non_blocking=True)
        if copied[i] is not None:
            copied[i].record(torch.cuda.current_stream(w1.device))
        outs.append(F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2))
    return torch.cat(outs)


def _preprocess_inputs(devices: Sequence[str], size: str) -> tuple:
    batch, side, hidden, classes = _IMAGES[size]
    gen = torch.Generator().manual_seed(SEED)
    raw = torch.randint(1, 256, (batch, 3, side, side), generator=gen, dtype=torch.uint8)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    d = _Draw(home_of(devices), SEED + 1)
    features = 3 * (side // 2) ** 2
    return (raw, mean, std, d.weight(hidden, features), d.bias(hidden),
            d.weight(classes, hidden), d.bias(classes))


def _preprocess_prepare(inputs: tuple, gpus: Sequence[str], chunks: int = 4) -> tuple:
    raw, mean, std, *params = inputs
    params = _same_tensors_on(gpus[0], params)
    cuda = gpus[0].startswith("cuda")
    features = 3 * (raw.shape[-1] // 2) ** 2
    staging = [torch.empty(part.shape[0], features, pin_memory=cuda)
               for part in raw.chunk(chunks)]
    copied = [torch.cuda.Event() if cuda else None for _ in staging]
    return (raw, mean, std, *params, staging, copied)


# -- rnn_cell: a small-op-heavy loop -----------------------------------------------------------
_RNN = {"full": (64, 32, 256, 256), "small": (8, 8, 32, 32)}


def lstm_unrolled(xs, h, c, w_ih, w_hh, b):
    outs = []
    for t in range(xs.shape[0]):
        gates = xs[t] @ w_ih.t() + h @ w_hh.t() + b
        i, f, g, o = gates.chunk(4, 1)
        c = f.sigmoid() * c + i.sigmoid() * g.tanh()
        h = o.sigmoid() * c.tanh()
        outs.append(h)
    return torch.stack(outs)


def _rnn_inputs(devices: Sequence[str], size: str) -> tuple:
    steps, batch, d_in, hidden = _RNN[size]
    d = _Draw(home_of(devices))
    return (d.randn(steps, batch, d_in), d.randn(batch, hidden, scale=0.1),
            d.randn(batch, hidden, scale=0.1), d.weight(4 * hidden, d_in),
            d.weight(4 * hidden, hidden), d.bias(4 * hidden))


def replay(graph, out):
    graph.replay()
    return out


def _rnn_prepare(inputs: tuple, gpus: Sequence[str]) -> tuple:
    """Capture the whole loop as one CUDA graph (inputs are static: the same tensors)."""
    device = torch.device(gpus[0])
    static = _same_tensors_on(gpus[0], inputs)
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                lstm_unrolled(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = lstm_unrolled(*static)
    return (graph, out)


# -- the registry ------------------------------------------------------------------------------
def _registry() -> list[Workload]:
    ws = [
        Workload("W1", "B[:] = A[r0:r1, c0:c1], bounds 0-dim tensors", "scalars", _w1_inputs,
                 w1_slice, hand=w1_slice, prepare_hand=_w1_prepare, hand_goal=True),
        Workload("W2", "a1 * A + a1 ** 2, a1 a 0-dim tensor", "scalars", _w2_inputs, w2_scalar,
                 hand=w2_scalar, prepare_hand=_w2_prepare, hand_goal=True),
    ]
    for shape in W3_SHAPES:
        ws += [_w3_case(shape, "resident"), _w3_case(shape, "host")]
    ws += [
        Workload("W4", "two chains of x.mm(x), written for one device", "multi-gpu",
                 _w4_inputs, w4_two_chains, hand=w4_two_chains, prepare_hand=_w4_prepare,
                 hand_gpus=2, hand_goal=True),
        Workload("W5", "compute, then copy every result to the host", "copy-overlap",
                 _w5_inputs, w5_compute_then_copy, hand=w5_copy_stream,
                 prepare_hand=_w5_prepare, hand_gpus=1, hand_cuda_only=True, hand_goal=True),
        Workload("W6", "2-layer MLP train step (forward, backward, SGD)", "training",
                 _w6_inputs, w6_train_step, hand=w6_data_parallel, prepare_hand=_w6_prepare,
                 hand_gpus=2, calls=2, hand_goal=True, whole_step=True),
        Workload("ensemble4", "four different models on one batch, averaged", "users",
                 _ensemble_inputs, ensemble4, hand=ensemble4_two_gpus,
                 prepare_hand=_ensemble_prepare, hand_gpus=2),
        Workload("two_tower", "user and item towers, all-pairs scores", "users",
                 _two_tower_inputs, two_tower, hand=two_tower_two_gpus,
                 prepare_hand=_two_tower_prepare, hand_gpus=2),
        Workload("cpu_preprocess", "uint8 images normalized on the host, MLP on the GPU",
                 "users", _preprocess_inputs, cpu_preprocess, hand=cpu_preprocess_pipelined,
                 prepare_hand=_preprocess_prepare, hand_gpus=1, explain_inputs_on=None,
                 explain_note="not simulated: its inputs start on two devices, and explain "
                              "takes one device for them all"),
        Workload("rnn_cell", "LSTM cell unrolled over time (small ops)", "users", _rnn_inputs,
                 lstm_unrolled, hand=replay, prepare_hand=_rnn_prepare, hand_gpus=1,
                 hand_cuda_only=True, rtol=1e-3, atol=1e-4),
    ]
    return ws


WORKLOADS: dict[str, Workload] = {w.name: w for w in _registry()}


def select(names: Iterable[str] | None = None, size: str = "small",
           n_gpus: int | None = None) -> list[Workload]:
    """Workloads by name, in table order: a name, or a group (``"W3"`` is every W3 case).

    Keeps those of ``size`` that ``n_gpus`` GPUs can run (``None``: no GPU filter).
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    wanted = None
    if names is not None:
        wanted = {n.strip() for item in names for n in str(item).split(",") if n.strip()}
        known = set(WORKLOADS) | {w.group for w in WORKLOADS.values()}
        unknown = sorted(wanted - known)
        if unknown:
            groups = sorted({w.group for w in WORKLOADS.values()}, key=_table_order)
            raise ValueError(f"unknown workload(s) {', '.join(unknown)}; valid names: "
                             f"{', '.join(groups)} (or a W3 case such as W3/512x512x512/host)")
    return [w for w in WORKLOADS.values()
            if (wanted is None or w.name in wanted or w.group in wanted)
            and size in w.sizes and (n_gpus is None or w.min_gpus <= n_gpus)]


def _table_order(group: str) -> int:
    order = [w.group for w in WORKLOADS.values()]
    return order.index(group)
