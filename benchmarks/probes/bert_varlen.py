"""Where BERT's varying-length inference loses to torch.compile on a GPU (NOTES 2026-12-04):
each variant in a process of its own, 60 calls of lengths drawn from [64, 128] to settle, then
per call the host's time to return (no sync), the whole call (synced), the CUDA kernels it
launched (torch.profiler) and, for autopar, where its host time goes (cProfile).

    python benchmarks/probes/bert_varlen.py --json out/bert-varlen.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one(variant: str, dev: str) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    import autopar
    from autopar.bench.models import MODELS, inputs_for

    torch.backends.cuda.matmul.allow_tf32 = False
    m = MODELS["bert"]
    model = m.make("small").to(dev).eval()
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    f = {"eager": model, "compile": torch.compile(model),
         "autopar": autopar.compile(model)}[variant]
    draw = random.Random(0)
    batches = [inputs_for(m, "small", batch=8, length=draw.randint(64, 128), device=dev,
                          seed=i)[1] for i in range(100)]
    for b in batches:
        b.pop("labels", None)

    def call(kw):
        with torch.no_grad():
            return f(**kw)
    for kw in batches[:60]:
        call(kw)
    sync()
    host, whole = [], []
    for kw in batches[60:]:
        t = time.perf_counter()
        call(kw)
        host.append(time.perf_counter() - t)
        sync()
        whole.append(time.perf_counter() - t)
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        for kw in batches[60:70]:
            call(kw)
        sync()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                       "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    kernels = sorted(((e.key, e.count) for e in events if e.device_type.name == "CUDA"),
                     key=lambda x: -x[1])[:25]
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    out = {"variant": variant, "host_ms": statistics.median(host) * 1e3,
           "call_ms": statistics.median(whole) * 1e3, "launches_per_call": launches / 10,
           "aten_calls_per_call": ops / 10,
           "kernels": kernels}
    import torch._dynamo.utils as dynamo_utils

    before = {k: dict(v) for k, v in dynamo_utils.counters.items()}
    for kw in batches[70:100]:
        call(kw)
    sync()
    out["dynamo_counters_during_30_calls"] = {
        k: {n: c - before.get(k, {}).get(n, 0) for n, c in v.items()
            if c != before.get(k, {}).get(n, 0)} for k, v in dynamo_utils.counters.items()}
    if variant != "eager":
        pr = cProfile.Profile()
        pr.enable()
        for kw in batches[70:100]:
            call(kw)
        pr.disable()
        sync()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        out["cprofile"] = s.getvalue()[-14000:]
        d = getattr(f, "forward", None)
        out["explain"] = d.explain() if hasattr(d, "explain") else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.device)))
        return 0
    rows = []
    for v in ("eager", "compile", "autopar"):
        p = subprocess.run([sys.executable, __file__, "--one", v, "--device", a.device],
                           capture_output=True, text=True, timeout=400)
        try:
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
        except Exception:
            rows.append({"variant": v, "error": p.stderr[-3000:]})
        r = rows[-1]
        print(v, {k: r.get(k) for k in ("host_ms", "call_ms", "launches_per_call",
                                        "aten_calls_per_call", "error")},
              flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
