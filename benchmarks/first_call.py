"""Where a first call's time goes: ``torch.compile`` and ``autopar.compile`` on a real model.

    python benchmarks/first_call.py [MODEL ...] [--modes infer,train] [--size small]
                                    [--json out.json]

Per model, mode and variant, in a process of its own with an Inductor cache directory of its
own (``--warm``: the same call made once before in that directory, as on a user's second run),
the wrapper's construction and calls until autopar's trial is settled: ``autopar.compile``
runs first, and ``torch.compile`` then makes as many calls (the user makes them either way;
``first_call_s`` is the first alone), with the inclusive seconds spent in each phase:
dynamo's tracing (``convert_frame``), aot_autograd, autopar's conversion (``from_fx``),
placement and planning, building executors, Inductor (``compile_fx``, for autopar's own
fused regions and its ``inductor`` way alike) and the trial's calls. Phases nest (Inductor
runs inside dynamo's tracing), so they do not add up to the total.

The host is calibrated before any process is timed (``calibrate_s``, once per host: the
profile is saved and every later ``autopar.compile`` loads it). Before 2026-12-03 it fell in
the first autopar process: GPT-2's AdamW row on a fresh GPU machine spent 14.5 s between
``autopar.compile`` and its first call (``torch.compile``: 1.3 s; 1.5 and 1.5 on the VM, whose
profile was saved).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

PHASES = {  # name -> (module, attribute path)
    "dynamo trace": ("torch._dynamo.convert_frame", "_compile"),
    "aot_autograd": ("torch._dynamo.backends.common", "aot_module_simplified"),
    "inductor compile_fx": ("torch._inductor.compile_fx", "compile_fx"),
    "autopar from_fx": ("autopar.capture.dynamo", "from_fx"),
    "autopar place": ("autopar.api", "place"),
    "autopar make_plan": ("autopar.api", "make_plan"),
    "autopar prefer_fused": ("autopar.api", "prefer_fused"),
    "autopar executor": ("autopar.api", "Executor"),
}


class _Timed:
    """Inclusive seconds and calls of the wrapped functions; a recursive call is counted once."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._depth: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth[name] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth[name] -= 1
                if not self._depth[name]:
                    self.seconds[name] += time.perf_counter() - start
                    self.calls[name] += 1
        return timed

    def trial_ways(self, orig: Any) -> Any:
        """``Trial._call`` (``orig``) wrapped: the host seconds of each way's calls in the
        trial, its first (untimed: it builds the way, Inductor and CUDA-graph capture
        included) apart. No device sync here: the trial times these very calls."""
        seen: set[tuple[int, str]] = set()

        def timed(trial: Any, fn: Any, way: str, args: Any, kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return orig(trial, fn, way, args, kwargs)
            finally:
                first = (id(trial), way) not in seen
                seen.add((id(trial), way))
                name = f"trial {way} {'first call' if first else 'other calls'}"
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
        return timed

    @contextlib.contextmanager
    def installed(self):
        from autopar.choose import Trial

        undo = [(Trial, "_call", Trial._call)]
        Trial._call = self.trial_ways(Trial._call)
        for name, (mod, attr) in PHASES.items():
            try:
                m = importlib.import_module(mod)
                orig = getattr(m, attr)
            except (ImportError, AttributeError):
                continue
            setattr(m, attr, self.wrap(name, orig))
            undo.append((m, attr, orig))
        try:
            yield self
        finally:
            for m, attr, orig in undo:
                setattr(m, attr, orig)

    def take(self) -> dict[str, Any]:
        out = {k: {"s": round(v, 3), "calls": self.calls[k]} for k, v in self.seconds.items()}
        self.seconds.clear()
        self.calls.clear()
        return out


def run_one(model_name: str, mode: str, variant: str, size: str, batch: int,
            length: int, calls: int = 0) -> dict[str, Any]:
    """One variant in this process: its construction and first call, then (``autopar``) calls
    until its trial is settled, or (``compile``) ``calls`` more calls."""
    import autopar
    from autopar.api import dispatcher_of
    from autopar.bench.harness import SETTLE_CALLS, in_process_compiles
    from autopar.bench.models import MODELS, fixed_step, inputs_for

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    in_process_compiles()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = MODELS[model_name]
    args, kwargs = inputs_for(m, size, batch=batch, length=length, device=dev)
    model = m.make(size).to(dev)
    compile_ = torch.compile if variant == "compile" else autopar.compile
    made = time.perf_counter()  # autopar.compile resolves the machine (and probes a C++ compiler)
    if mode == "train":
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fn = compile_(fixed_step(model, opt, args, kwargs))
        call = fn
    else:
        fn = compile_(model)

        def call():
            with torch.no_grad():
                return fn(*args, **kwargs)
    timer = _Timed()
    with timer.installed():
        start = time.perf_counter()
        call()
        if dev == "cuda":
            torch.cuda.synchronize()
        cell: dict[str, Any] = {"first_call_s": round(time.perf_counter() - start, 3),
                                "compile_call_s": round(start - made, 3)}
        cell["total_s"] = round(time.perf_counter() - made, 3)
        if variant == "autopar":
            d = dispatcher_of(fn)
            start = time.perf_counter()
            n = 0
            while d is not None and d.trials and n < SETTLE_CALLS:
                call()
                n += 1
            if dev == "cuda":
                torch.cuda.synchronize()
            cell["trial_s"] = round(time.perf_counter() - start, 3)
            cell["trial_calls"] = n
            cell["kept"] = sorted(set(d.kept.values())) if d is not None else []
            cell["total_s"] = round(time.perf_counter() - made, 3)
        elif calls:
            for _ in range(calls):
                call()
            if dev == "cuda":
                torch.cuda.synchronize()
            cell["calls"] = calls
            cell["total_s"] = round(time.perf_counter() - made, 3)
    cell["phases"] = timer.take()
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=["gpt2", "llama", "bert", "vit"])
    ap.add_argument("--modes", default="infer,train")
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    ap.add_argument("--warm", action="store_true",
                    help="time each variant's second run in its cache directory")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        model, mode, variant = a.one.split(":")
        print(json.dumps(run_one(model, mode, variant, a.size, a.batch, a.length, a.calls)))
        return
    rows: list[dict[str, Any]] = []
    calibrate_s = _calibrate()
    print(f"host profile resolved in {calibrate_s:.2f} s (calibrated where none was saved)")
    for model in a.models:
        for mode in a.modes.split(","):
            row: dict[str, Any] = {"model": model, "mode": mode, "warm": a.warm}
            for variant in ("autopar", "compile"):  # each with a cache directory of its own
                with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
                    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                    cmd = [sys.executable, __file__, "--one", f"{model}:{mode}:{variant}",
                           "--size", a.size, "--batch", str(a.batch), "--length", str(a.length),
                           "--calls", str(row.get("autopar", {}).get("trial_calls", 0))]
                    for _ in range(2 if a.warm else 1):  # the first of two warms the cache
                        row[variant] = _child(cmd, env, a.timeout)
            rows.append(row)
            _print(row)
            if a.json:  # after every row: a timeout later loses nothing
                a.json.write_text(json.dumps({
                    "benchmark": "first_call", "date": time.strftime("%Y-%m-%d"),
                    "torch": torch.__version__, "calibrate_s": calibrate_s, "size": a.size,
                    "batch": a.batch, "length": a.length, "rows": rows}, indent=1))


def _calibrate() -> float:
    """Seconds to resolve this host's profile, calibrating (and saving) it where none is saved:
    a once-per-host cost, not a first call's."""
    from autopar.machine.detect import load_machine

    start = time.perf_counter()
    load_machine()
    return round(time.perf_counter() - start, 3)


def _child(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout} s"}
    if p.returncode != 0:
        return {"error": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _print(row: dict[str, Any]) -> None:
    c, a = row["compile"], row["autopar"]
    head = f"{row['model']} {row['mode']}{' (warm)' if row['warm'] else ''}"
    if "error" in c or "error" in a:
        print(f"{head}: error: {(c.get('error') or a.get('error'))[-300:]}")
        return
    print(f"{head}, {1 + a['trial_calls']} calls each: compile {c['total_s']:.2f} s (first "
          f"{c['first_call_s']:.2f}), autopar {a['total_s']:.2f} s (first "
          f"{a['first_call_s']:.2f}, trial {a['trial_s']:.2f}, kept {','.join(a['kept'])}) = "
          f"{a['total_s'] / c['total_s']:.2f}x")
    for name, cell in (("compile", c), ("autopar", a)):
        parts = ", ".join(f"{k} {v['s']:.2f} s ({v['calls']})" for k, v in cell["phases"].items())
        print(f"    {name}: {parts}")


if __name__ == "__main__":
    main()
