"""What a call through dynamo costs, and what PyTorch's own ways of skipping guards take off it.

Per-call seconds (medians of interleaved rounds of ``timeit``) of a one-op function
(``x @ y``, 5x10x5) and W2-like code (``a1 * A + a1 ** 2`` with ``a1`` made inside, 8x8):
the op itself, the function, ``torch.compile`` with ``backend="eager"`` and ``"aot_eager"``,
each also inside ``torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)``, with
dynamo's C flag for it set directly, with ``guard_filter_fn`` dropping every guard, with
``skip_guard_on_all_nn_modules_unsafe``; and a backend that returns the op itself (dynamo's
frame alone), and autopar's ``guards="arguments"`` calling autopar's graph directly.

    python benchmarks/call_floor.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import timeit
from collections.abc import Callable
from typing import Any

os.environ.setdefault("AUTOPAR_NO_MEASURE", "1")

import torch

import autopar


def mm(x, y):
    return x @ y


def w2(A):
    a1 = torch.tensor(10.0, device=A.device)
    return a1 * A + a1 ** 2


def copy_of(f: Callable) -> Callable:
    """A function of its own code object: dynamo caches per code object."""
    return type(f)(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__,
                   f.__closure__)


def drop_all(entries: Any) -> list[bool]:
    return [False] * len(entries)


def in_stance(f: Callable) -> Callable:
    def call(*args: Any) -> Any:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return f(*args)
    return call


def c_flag(f: Callable) -> Callable:
    """``f`` with dynamo's skip-guard flag set around the call, without the stance's context
    manager (a private setter; absent on some versions: then ``f`` itself)."""
    setter = getattr(torch._dynamo.eval_frame, "set_skip_guard_eval_unsafe", None)
    if setter is None:
        return f

    def call(*args: Any) -> Any:
        prior = setter(True)
        try:
            return f(*args)
        finally:
            setter(prior)
    return call


def the_op_itself(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
    """A backend whose graph is ``torch.matmul`` itself: what is left is dynamo's frame."""
    matmul = torch.matmul
    return lambda a, b: (matmul(a, b),)


def variants(fn: Callable, args: tuple) -> dict[str, tuple[Callable, tuple]]:
    rows: dict[str, tuple[Callable, tuple]] = {}
    if fn is mm:
        rows["op itself"] = (torch.matmul, args)
    rows["function"] = (fn, args)
    for backend in ("eager", "aot_eager"):
        c = torch.compile(copy_of(fn), backend=backend)
        rows[f"dynamo {backend}"] = (c, args)
        rows[f"dynamo {backend}, set_stance skip_guard_eval_unsafe"] = (in_stance(c), args)
        rows[f"dynamo {backend}, skip flag set directly"] = (c_flag(c), args)
        rows[f"dynamo {backend}, guard_filter_fn drops all"] = (torch.compile(
            copy_of(fn), backend=backend, options={"guard_filter_fn": drop_all}), args)
        rows[f"dynamo {backend}, skip_guard_on_all_nn_modules_unsafe"] = (torch.compile(
            copy_of(fn), backend=backend,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}),
            args)
    if fn is mm:
        rows["dynamo, backend returns the op"] = (torch.compile(copy_of(fn),
                                                                backend=the_op_itself), args)
        rows["dynamo, backend returns the op, no guards"] = (torch.compile(
            copy_of(fn), backend=the_op_itself, options={"guard_filter_fn": drop_all}), args)
    rows["autopar way (guards='all')"] = (autopar.compile(
        copy_of(fn), devices="cpu:0", candidates="autopar"), args)
    rows["autopar way, guards='arguments'"] = (autopar.compile(
        copy_of(fn), devices="cpu:0", candidates="autopar", guards="arguments"), args)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--number", type=int, default=2000)
    args = ap.parse_args()
    x, y, A = torch.randn(5, 10), torch.randn(10, 5), torch.randn(8, 8)
    for name, fn, fn_args in (("x @ y 5x10x5", mm, (x, y)), ("W2-like 8x8", w2, (A,))):
        rows = variants(fn, fn_args)
        for f, a in rows.values():  # compile, and warm up before any stance is set
            for _ in range(3):
                f(*a)
        samples: dict[str, list[float]] = {k: [] for k in rows}
        for _ in range(args.rounds):
            for k, (f, a) in rows.items():
                samples[k].append(timeit.timeit(lambda f=f, a=a: f(*a), number=args.number)
                                  / args.number)
        for k, v in samples.items():
            print(f"{name:13} {k:60} {statistics.median(v) * 1e6:7.2f} us")


if __name__ == "__main__":
    main()
