"""W4 and W5 side by side: eager, hand-tuned and autopar, in one process.

W4: two chains ``[x.mm(x) for _ in range(n)]`` written for one GPU (both inputs on cuda:0).
W5: one chain, then every result copied to the host.
W4+host: W4 plus a chain of CPU-sized matmuls on host tensors: one CPU and two GPUs, each with
work, all busy at once (the row reports the window in which every device had work).
Medians of ``--repeat`` runs after warm-up, every device synchronized; results checked against
eager first.

    python benchmarks/parallel.py [--size 4000] [--n 50] [--repeat 5] [--json PATH] [--trace-dir D]

With ``--trace-dir``, each workload is called once more by a traced copy of it, and its measured
timeline is written there as a Perfetto trace (``<name>.trace.json``) and a Gantt PNG with the
simulator's prediction of the same plan drawn beneath (``<name>.png``).
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import torch

import autopar
from autopar.api import Options, Runner
from autopar.bench.measure import in_process_compiles, measure
from autopar.capture.dynamo import make_backend
from autopar.report.trace import save_chrome_trace, save_gantt
from autopar.schedule.simulate import simulate
from autopar.schedule.timeline import Timeline


def median_s(fn, repeat: int) -> float:
    """Median seconds per call, every GPU synchronized around each sample."""
    return measure(fn, warmup=2, repeat=repeat, inner=1).median


def run(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    return [x.mm(x) for _ in range(n)]


def traced(fn, args: tuple, name: str, out: Path) -> Timeline:
    """Call a traced compile of ``fn`` twice; write the second call's trace and Gantt PNG."""
    runner = Runner(Options.parse({"trace": True}))
    runner.cost_model()
    compiled = torch.compile(fn, backend=make_backend(runner), dynamic=False)
    compiled(*args)
    compiled(*args)
    ex = runner.executors[-1]
    measured = ex.last_timeline
    predicted = simulate(ex.plan, runner.cost_model())
    out.mkdir(parents=True, exist_ok=True)
    save_chrome_trace(measured, out / f"{name}.trace.json", ex.plan.graph)
    save_gantt(measured, out / f"{name}.png", predicted=predicted,
               title=f"{name}: measured {measured.makespan * 1e3:.1f} ms, "
                     f"predicted {predicted.makespan * 1e3:.1f} ms")
    print(f"{name}: measured {measured.makespan:.4f} s, predicted {predicted.makespan:.4f} s, "
          f"lanes {measured.lanes()}")
    return measured


def all_busy(timeline: Timeline) -> dict[str, float]:
    """Per device, the span from its first op to its last; and the window in which all had work."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for s in timeline.spans:
        if s.kind != "op":
            continue
        dev = s.lane.split("/")[0]
        first[dev] = min(first.get(dev, s.start), s.start)
        last[dev] = max(last.get(dev, s.end), s.end)
    window = min(last.values()) - max(first.values()) if first else 0.0
    busy = {f"{d} busy s": sum(s.duration for s in timeline.spans
                               if s.kind == "op" and s.lane.split("/")[0] == d) for d in first}
    return {"devices": len(first), "all busy window s": max(window, 0.0), **busy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4000)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--trace-dir", type=Path, default=None)
    args = ap.parse_args()
    in_process_compiles()
    if not torch.cuda.is_available():
        raise SystemExit("parallel.py measures GPUs: no CUDA device here")
    torch.backends.cuda.matmul.allow_tf32 = False
    n, size = args.n, args.size
    x1 = torch.rand(size, size, device="cuda:0") / size
    x2 = torch.rand(size, size, device="cuda:0") / size
    rows: dict[str, dict[str, float]] = {}

    # -- W4 --------------------------------------------------------------------------------
    def w4(a, b):
        return run(a, n), run(b, n)

    compiled_w4 = autopar.compile(w4)
    ref = w4(x1, x2)
    got = compiled_w4(x1, x2)
    for r, g in zip(ref[0] + ref[1], got[0] + got[1]):
        assert g.device == r.device
        torch.testing.assert_close(g, r)
    del ref, got
    w4_row = {"eager": median_s(lambda: w4(x1, x2), args.repeat)}
    if torch.cuda.device_count() >= 2:
        x2_on_1 = x2.to("cuda:1")
        w4_row["hand"] = median_s(lambda: (run(x1, n), run(x2_on_1, n)), args.repeat)
    w4_row["autopar"] = median_s(lambda: compiled_w4(x1, x2), args.repeat)
    rows["W4 two chains"] = w4_row

    # -- W5 --------------------------------------------------------------------------------
    def w5(a):
        return [y.cpu() for y in run(a, n)]

    compiled_w5 = autopar.compile(w5)
    for r, g in zip(w5(x1), compiled_w5(x1)):
        assert g.device == r.device
        torch.testing.assert_close(g, r)
    side = torch.cuda.Stream()
    pinned = [torch.empty(size, size, pin_memory=True) for _ in range(n)]

    def w5_hand(a):
        done = []
        for i in range(n):
            y = a.mm(a)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                pinned[i].copy_(y, non_blocking=True)
            y.record_stream(side)
            done.append(pinned[i])
        side.synchronize()
        return done

    def w5_nonblocking(a):
        out = [y.to("cpu", non_blocking=True) for y in run(a, n)]
        torch.cuda.synchronize()
        return out

    rows["W5 compute then copy"] = {
        "eager": median_s(lambda: w5(x1), args.repeat),
        "eager non_blocking": median_s(lambda: w5_nonblocking(x1), args.repeat),
        "compute only": median_s(lambda: run(x1, n), args.repeat),
        "hand": median_s(lambda: w5_hand(x1), args.repeat),
        "autopar": median_s(lambda: compiled_w5(x1), args.repeat),
    }

    # -- W4 + host: one CPU and two GPUs ---------------------------------------------------
    h = torch.rand(256, 1024) / 1024
    w = torch.rand(1024, 1024) / 1024
    m = 60

    def host_chain(hh, ww):
        out = hh
        for _ in range(m):
            out = torch.tanh(out.mm(ww))
        return out

    def w4_host(a, b, hh, ww):
        return run(a, n), run(b, n), host_chain(hh, ww)

    compiled_w4h = autopar.compile(w4_host)
    ref, got = w4_host(x1, x2, h, w), compiled_w4h(x1, x2, h, w)
    torch.testing.assert_close(got[2], ref[2])
    assert got[2].device == ref[2].device
    for r, g in zip(ref[0] + ref[1], got[0] + got[1]):
        torch.testing.assert_close(g, r)
    del ref, got
    w4h_row = {"eager": median_s(lambda: w4_host(x1, x2, h, w), args.repeat),
               "host chain only": median_s(lambda: host_chain(h, w), args.repeat)}
    if torch.cuda.device_count() >= 2:
        w4h_row["hand"] = median_s(lambda: (run(x1, n), run(x2_on_1, n), host_chain(h, w)),
                                   args.repeat)
    w4h_row["autopar"] = median_s(lambda: compiled_w4h(x1, x2, h, w), args.repeat)
    rows["W4+host 1 CPU 2 GPUs"] = w4h_row

    extra: dict[str, dict[str, float]] = {}
    if args.trace_dir is not None:
        traced(w4, (x1, x2), "W4", args.trace_dir)
        traced(w5, (x1,), "W5", args.trace_dir)
        extra["W4+host"] = all_busy(traced(w4_host, (x1, x2, h, w), "W4-host", args.trace_dir))
        print("W4+host devices at once:", extra["W4+host"])

    print(f"{'workload':<22} {'variant':<20} {'median s':>10} {'vs eager':>9}")
    for name, row in rows.items():
        for variant, t in row.items():
            print(f"{name:<22} {variant:<20} {t:>10.4f} {row['eager'] / t:>8.2f}x")
    result = {"benchmark": "parallel", "date": date.today().isoformat(),
              "host": platform.node(), "torch": torch.__version__,
              "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
              "size": size, "n": n, "repeat": args.repeat, "rows": rows, "timelines": extra}
    out = args.json or Path(__file__).parent / "results" / f"parallel-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
