"""Probe: what a small host op costs between GPU launches, against the same op in a loop of its
own (benchmarks/NOTES.md, 2026-12-05 (g): in GPT-2's plan on an H100 each host op or copy cost
~75 us, priced 7.5-45). Per host op (``arange`` of 128, ``le`` of 128x128, a bool ``where`` of
8x1x128x128 into float32): its median alone; then a loop of ``--n`` rounds of one tiny GPU
``add`` launch and that host op, less the loop of launches alone, per round; with torch's
thread count as it is and with one thread (an OpenMP team woken per op?).

    PYTHONPATH=src python benchmarks/probes/host_between_launches.py [--n 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _median(fn, reps: int = 15) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--json")
    a = ap.parse_args()
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    mask = torch.rand(8, 1, 128, 128) > 0.5
    row = torch.arange(128)
    zero, low = torch.tensor(0.0), torch.tensor(-3.4e38)
    host_ops = {
        "arange(128)": lambda: torch.arange(128),
        "le 128x128": lambda: row[None, :] <= row[:, None],
        "where 8x1x128x128": lambda: torch.where(mask, zero, low),
    }
    x = torch.ones(16, device=dev)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    out = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "rows": []}
    for threads in (torch.get_num_threads(), 1):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            def launches():
                for _ in range(a.n):
                    torch.add(x, 1)
                sync()
            base = _median(launches)
            for name, op in host_ops.items():
                def loop(op=op):
                    for _ in range(a.n):
                        op()
                alone = _median(loop) / a.n

                def mixed(op=op):
                    for _ in range(a.n):
                        torch.add(x, 1)
                        op()
                    sync()
                between = (_median(mixed) - base) / a.n
                r = {"op": name, "threads": threads, "alone_us": alone * 1e6,
                     "between_launches_us": between * 1e6, "launch_us": base / a.n * 1e6}
                out["rows"].append(r)
                print(f"{name:20} threads {threads:3}: alone {r['alone_us']:7.2f} us, between "
                      f"launches {r['between_launches_us']:7.2f} us "
                      f"(a launch {r['launch_us']:.2f})")
        finally:
            torch.set_num_threads(saved)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
