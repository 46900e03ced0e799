"""How this torch's dynamo captures W1 (``B[:] = A[r0:r1, c0:c1]``, the bounds made inside the
function as 0-dim tensors on the device), and what ``autopar.compile(fn, guards="arguments")``
then runs: a probe for the slice-bound fold of issue #22.

    python benchmarks/w1_capture.py [--device cuda] [--json PATH]

For each of dynamo's ``capture_scalar_outputs`` off and on: the graphs dynamo hands a backend
(their count and ops) or the error; ``make_fx`` of the function with real tensors (what a trace
that runs the function sees); then autopar's mode: the way kept, its entries, and the median
per-call time against the same copy with Python-int bounds run eagerly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

try:
    import autopar
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import autopar
from autopar.bench.workloads import w1_bounds_inside, w1_slice


def w1_ints(A, B):
    return w1_slice(A, B, 100, 356, 100, 356)


def _graphs(capture_scalars: bool, A: torch.Tensor, B: torch.Tensor) -> dict:
    torch._dynamo.reset()
    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.append(" ".join(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return gm.forward

    old = torch._dynamo.config.capture_scalar_outputs
    torch._dynamo.config.capture_scalar_outputs = capture_scalars
    try:
        torch.compile(w1_bounds_inside, backend=backend, fullgraph=False)(A, B.clone())
        return {"graphs": len(seen), "ops": seen}
    except Exception as e:  # the probe reports dynamo's own failure
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                "where": traceback.format_exc().splitlines()[-12:]}
    finally:
        torch._dynamo.config.capture_scalar_outputs = old


def _median_us(fn, args, n: int = 2000) -> float:
    for _ in range(50):
        fn(*args)
    sync = torch.cuda.synchronize if args[0].is_cuda else (lambda: None)
    times = []
    for _ in range(5):
        sync()
        t = time.perf_counter()
        for _ in range(n // 5):
            fn(*args)
        sync()
        times.append((time.perf_counter() - t) / (n // 5))
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    A = torch.randn(1024, 1024, device=a.device)
    B = torch.empty(256, 256, device=a.device)
    out: dict = {"torch": torch.__version__, "device": a.device}
    for flag in (False, True):
        out[f"dynamo capture_scalar_outputs={flag}"] = _graphs(flag, A, B)
    try:
        from torch.fx.experimental.proxy_tensor import make_fx

        gm = make_fx(w1_bounds_inside, tracing_mode="real")(A, B.clone())
        out["make_fx real"] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    except Exception as e:  # the probe reports the tracer's failure
        out["make_fx real"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    torch._dynamo.reset()
    fn = autopar.compile(w1_bounds_inside, guards="arguments")
    got = fn(A, B.clone())
    want = w1_ints(A, B.clone())
    out["autopar equal"] = bool(torch.equal(got, want))
    Bs = B.clone()
    out["autopar arguments us"] = _median_us(fn, (A, Bs))
    out["eager python ints us"] = _median_us(w1_ints, (A, Bs))
    out["eager tensor bounds us"] = _median_us(w1_bounds_inside, (A, Bs))
    d = autopar.api.dispatcher_of(fn)
    out["explain"] = d.explain() if d is not None else None
    direct = d.compiled if d is not None else None
    out["direct entries"] = len(getattr(direct, "entries", []))
    print(json.dumps(out, indent=1))
    if a.json is not None:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
