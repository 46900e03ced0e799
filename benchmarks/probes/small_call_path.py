"""Where a small call's time goes in ``guards="arguments"`` (issue #22, NOTES 2026-12-04 (c)).

W3 with host data (``(x.to("cuda") @ y.to("cuda")).cpu()`` at 5x10x5, ``x``, ``y`` on the host;
on a machine without a GPU, ``x @ y`` stands in) compiled with ``guards="arguments"``, its
calls settled, then per call (medians of ``timeit`` rounds): the op on the host, the user's
handle, the Direct entry it reaches, and the program the entry runs; the floor of any checked
call on that host (a Python frame calling ``torch.mm``, then with the entry's two C checks); and
the sources of the entry and the program, so the path can be read as it runs.

    python benchmarks/probes/small_call_path.py [--json out/small-call-path.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any


def per_call_us(fn: Any, *args: Any, rounds: int = 7, number: int = 20000) -> float:
    return statistics.median(timeit.repeat(lambda: fn(*args), number=number, repeat=rounds)) \
        / number * 1e6


def floors(x: Any, y: Any) -> dict[str, float]:
    """The least a checked call can cost on this host: a Python function calling ``torch.mm``
    (a frame), then with dynamo's C tensor check of the two arguments, then with its global
    state check too (what an entry must check, #22's contract); each done on the host's
    data, as W3's plan runs it."""
    import torch
    from torch._C._dynamo.guards import GlobalStateGuard

    from autopar.capture.direct import layout_check

    mm, match, state = torch.mm, layout_check([x, y]), GlobalStateGuard().check

    def frame(a, b):
        return mm(a, b)

    def frame_tensors(a, b):
        if not match(a, b):
            return None
        return mm(a, b)

    def frame_tensors_state(a, b):
        if not (state() and match(a, b)):
            return None
        return mm(a, b)

    return {"floor: frame": per_call_us(frame, x, y),
            "floor: + tensor check": per_call_us(frame_tensors, x, y),
            "floor: + global state": per_call_us(frame_tensors_state, x, y)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--candidates", default="auto", help="e.g. autopar: force autopar's way")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    import torch

    import autopar

    gpu = torch.cuda.is_available()
    x, y = torch.rand(5, 10), torch.rand(10, 5)
    if gpu:
        def w3(x, y):
            return (x.to("cuda") @ y.to("cuda")).cpu()
    else:
        def w3(x, y):
            return x @ y
    kw = {} if a.candidates == "auto" else {"candidates": a.candidates.split(",")}
    f = autopar.compile(w3, guards="arguments", **kw)
    for _ in range(400):
        f(x, y)
    if gpu:
        torch.cuda.synchronize()
    assert torch.allclose(f(x, y), x @ y)
    row: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__,
                           "python": sys.version.split()[0], "kept": f.kept_way((x, y))}
    times = {"x @ y": per_call_us(lambda p, q: p @ q, x, y),
             "torch.mm": per_call_us(torch.mm, x, y), "handle": per_call_us(f, x, y)}
    times.update(floors(x, y))
    from autopar.capture.direct import Direct

    direct = getattr(f, "_route", None)  # where one way serves every call: what a call runs
    if isinstance(direct, Direct):
        entry = direct.head
        row["entry_source"] = getattr(entry, "source", None)
        times["entry"] = per_call_us(entry, x, y)
        run = entry.__globals__.get("_run") or entry.__globals__.get("_program")
        try:
            row["program_source"] = inspect.getsource(run)
        except (OSError, TypeError) as e:
            row["program_source"] = f"({type(e).__name__}: {e}; {run!r})"
        try:
            times["program"] = per_call_us(run, [x, y])
        except TypeError:
            times["program"] = per_call_us(run, x, y)
    row["us"] = times
    for k, v in times.items():
        print(f"{k:10s} {v:7.2f} us")
    print("kept:", row["kept"])
    print(row.get("entry_source", "(no Direct entry)"))
    print(row.get("program_source", ""))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
