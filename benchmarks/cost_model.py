"""Predicted against measured: how good autopar's cost model is on this machine.

    PYTHONPATH=src python benchmarks/cost_model.py                 # CPU, and GPUs if any
    PYTHONPATH=src python benchmarks/cost_model.py --devices cpu:0,cuda:0,cuda:1 --calibrate full

For every op of a sweep (matmul at 8 sizes from 5x10x5 to 4096^3, elementwise, reductions,
convolutions, softmax) on every device asked for, and for copies over every link between them:
the cost model's prediction (after calibration: the roofline on the calibrated curves) against
the measured time; then the prediction after ``--observe`` measured runs fed to
``CostModel.observe``, against the same measurement. With a GPU it also checks the CPU-or-GPU
choice of matmul at every size, with the data on the host and with the data on the GPU; the two
ways of each are timed side by side, their batches interleaved.

Measuring: an op runs through its ATen overload as the runtime calls it; ``inner`` back-to-back
calls between two synchronizations of every device form one sample (at least ~2 ms, so the
clock and the sync do not matter); the measured time is the median of ``--reps`` samples. Op
samples are per-op times in a stream, which is what ``CostModel.node_time`` predicts (max of
host and device time). The ``--observe`` runs are separate samples, taken after the reference
ones. CPU ops run with ``Machine.cpu_threads`` threads, as a CPU worker does.

Goals (printed with the table): median |error| <= 25 % over ops taking over 50 us; the CPU-or-GPU
choice right at every matmul size (where the two paths measure within 5 % of each other, either
pick counts as right; strict counts are reported too); <= 10 % once 5 runs were observed.
Results: JSON in benchmarks/results/cost_model-<cpu|gpu>-<date>.json (``--out`` to choose), a
table printed (``--json`` prints the JSON instead).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from autopar.cost.model import CostModel, History
from autopar.ir.graph import Graph, Node, TensorMeta
from autopar.machine.detect import detect
from autopar.machine.host import host_info
from autopar.machine.model import Machine

aten = torch.ops.aten
RESULTS = Path(__file__).resolve().parent / "results"
BIG_S = 50e-6  # the accuracy goal counts ops over 50 us
TIE = 0.05  # two paths within 5 % of each other are a tie: picking either is right


# -- the sweep -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    family: str
    name: str
    inputs: tuple[tuple[int, ...], ...]  # shapes of the tensor inputs, float32
    op: Any
    extra: tuple = ()  # further positional arguments after the tensors
    big: bool = False  # skipped by --quick


MATMULS = [(5, 10, 5), (32, 64, 32), (100, 200, 100), (256, 256, 256), (512, 512, 512),
           (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096)]


def sweep() -> list[Case]:
    cases = [Case("matmul", f"mm {m}x{k}x{n}", ((m, k), (k, n)), aten.mm.default,
                  big=m >= 4096) for m, k, n in MATMULS]
    for n in (2**10, 2**16, 2**20, 2**22, 2**24):
        cases.append(Case("elementwise", f"add {n}", ((n,), (n,)), aten.add.Tensor,
                          big=n >= 2**24))
    for n in (2**16, 2**20, 2**24):
        cases.append(Case("elementwise", f"mul {n}", ((n,), (n,)), aten.mul.Tensor,
                          big=n >= 2**24))
        cases.append(Case("elementwise", f"relu {n}", ((n,),), aten.relu.default,
                          big=n >= 2**24))
        cases.append(Case("elementwise", f"exp {n}", ((n,),), aten.exp.default, big=n >= 2**24))
    for n in (2**16, 2**20, 2**24):
        cases.append(Case("reduction", f"sum {n}", ((n,),), aten.sum.default, big=n >= 2**24))
    cases += [
        Case("reduction", "amax 4096x4096 dim -1", ((4096, 4096),), aten.amax.default, ([-1],)),
        Case("reduction", "mean 1024x1024 dim 0", ((1024, 1024),), aten.mean.dim, ([0],)),
        Case("conv", "conv 1x16x32x32 k3", ((1, 16, 32, 32), (16, 16, 3, 3)),
             aten.convolution.default, (None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
        Case("conv", "conv 8x64x56x56 k3", ((8, 64, 56, 56), (64, 64, 3, 3)),
             aten.convolution.default, (None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
        Case("conv", "conv 32x3x224x224 k7 s2", ((32, 3, 224, 224), (64, 3, 7, 7)),
             aten.convolution.default, (None, [2, 2], [3, 3], [1, 1], False, [0, 0], 1),
             big=True),
    ]
    for shape in ((64, 1000), (1024, 1024), (4096, 4096)):
        cases.append(Case("softmax", f"softmax {shape[0]}x{shape[1]}", (shape,),
                          aten._softmax.default, (-1, False), big=shape[0] >= 4096))
    return cases


COPY_BYTES = (2**12, 2**20, 2**24, 2**26)


# -- measuring -------------------------------------------------------------------------------
def sync_all() -> None:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def _inner(fn: Callable[[], Any], batch_s: float) -> int:
    fn()
    sync_all()
    t0 = time.perf_counter()
    fn()
    sync_all()
    return max(1, min(2000, int(batch_s / max(time.perf_counter() - t0, 1e-7))))


def _batch(fn: Callable[[], Any], inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    sync_all()
    return (time.perf_counter() - t0) / inner


def samples(fn: Callable[[], Any], reps: int, batch_s: float = 2e-3) -> list[float]:
    """``reps`` per-call times, each from a batch of back-to-back calls ending in a sync."""
    inner = _inner(fn, batch_s)
    return [_batch(fn, inner) for _ in range(reps)]


def side_by_side(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median per-call time of each function, their batches interleaved so that a passing
    disturbance of the machine hits all of them alike."""
    inner = {k: _inner(fn, 2e-3) for k, fn in fns.items()}
    got: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            got[k].append(_batch(fn, inner[k]))
    return {k: statistics.median(v) for k, v in got.items()}


@dataclass
class Row:
    family: str
    name: str
    device: str
    predicted_s: float
    measured_s: float
    spread: float  # (q90 - q10) / median of the reference samples
    predicted_after_s: float = 0.0
    source: str = ""

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1

    @property
    def error_after(self) -> float:
        return self.predicted_after_s / self.measured_s - 1


def _spread(xs: list[float]) -> float:
    if len(xs) < 3:
        return 0.0
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return (q[-1] - q[0]) / statistics.median(xs)


def build(case: Case, device: str) -> tuple[Node, Callable[[], Any]]:
    """The case as a graph node on ``device``, and a call of its op on real tensors there."""
    g = Graph(case.name)
    ins = [g.input(TensorMeta.make(s, torch.float32, device)) for s in case.inputs]
    node = g.call(case.op, (*ins, *case.extra))
    torch.manual_seed(0)
    real = {n: torch.rand(n.meta.shape, device=device) for n in ins}
    args = tree_map(lambda a: real.get(a, a) if isinstance(a, Node) else a, node.args)
    return node, lambda: case.op(*args)


def bench_ops(cm: CostModel, devices: list[str], cases: list[Case], reps: int,
              observe: int, say: Callable[[str], None]) -> list[Row]:
    rows = []
    for dev in devices:
        home = "cpu" if dev.startswith("cpu") else dev
        for case in cases:
            say(f"{case.name} on {dev}")
            node, fn = build(case, home)
            with torch.no_grad():
                ref = samples(fn, reps)
                seen = samples(fn, observe) if observe else []
            cost = cm.op_cost(node, dev)
            row = Row(case.family, case.name, dev, cost.time, statistics.median(ref),
                      _spread(ref), source=cost.source)
            for s in seen:
                cm.observe(node, dev, s)
            row.predicted_after_s = cm.node_time(node, dev)
            rows.append(row)
    return rows


def bench_copies(cm: CostModel, gpus: list[str], reps: int, observe: int,
                 say: Callable[[str], None]) -> list[Row]:
    """Copies over every link: host<->GPU pinned and pageable (as eager's ``.to``/``.cpu``),
    GPU<->GPU. Links have no history: the prediction after observing is the same."""
    rows = []
    for nbytes in COPY_BYTES:
        n = nbytes // 4
        for g in gpus:
            say(f"copies of {nbytes} B with {g}")
            pinned = torch.rand(n).pin_memory()
            pageable = torch.rand(n)
            on_gpu = torch.rand(n, device=g)
            cases = {
                ("cpu:0", g, True): lambda g=g, p=pinned: p.to(g, non_blocking=True),
                ("cpu:0", g, False): lambda g=g, p=pageable: p.to(g),
                (g, "cpu:0", True): lambda d=on_gpu, p=pinned: p.copy_(d, non_blocking=True),
                (g, "cpu:0", False): lambda d=on_gpu: d.cpu(),
            }
            for h in gpus:
                if h != g:
                    cases[(g, h, True)] = lambda d=on_gpu, h=h: d.to(h, non_blocking=True)
            for (src, dst, pin), fn in cases.items():
                ref = samples(fn, reps)
                kind = "pinned" if pin else "pageable"
                if src.startswith("cuda") and dst.startswith("cuda"):
                    kind = "peer"
                pred = cm.transfer_time(nbytes, src, dst, pinned=pin)
                rows.append(Row("copy", f"{src}->{dst} {kind} {nbytes} B", f"{src}->{dst}",
                                pred, statistics.median(ref), _spread(ref), pred, "link"))
    return rows


# -- CPU or GPU? -----------------------------------------------------------------------------
def _paths(a: torch.Tensor, b: torch.Tensor, ga: torch.Tensor, gb: torch.Tensor,
           gpu: str) -> dict[str, dict[str, Callable[[], Any]]]:
    """The two ways to get ``a @ b``, with the data on the host (``a``, ``b``) and on the GPU
    (``ga``, ``gb``), the result wanted where the data is."""
    def on_gpu(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> None:
            fn()
            torch.cuda.synchronize(gpu)  # one call at a time: its latency, as on the host

        return call

    return {
        "host": {"cpu": lambda: aten.mm.default(a, b),
                 "gpu": lambda: aten.mm.default(a.to(gpu), b.to(gpu)).cpu()},
        "gpu": {"cpu": on_gpu(lambda: aten.mm.default(ga.cpu(), gb.cpu()).to(gpu)),
                "gpu": on_gpu(lambda: aten.mm.default(ga, gb))},
    }


def bench_choices(cm: CostModel, gpu: str, reps: int, say: Callable[[str], None],
                  quick: bool) -> list[dict[str, Any]]:
    """For each matmul size: is the device the model picks the faster one, with the data (and
    the result wanted) on the host, and on the GPU? Each path is timed as one synchronous call."""
    out = []
    for m, k, n in MATMULS:
        if quick and m >= 4096:
            continue
        say(f"choice mm {m}x{k}x{n}")
        torch.manual_seed(0)
        a, b = torch.rand(m, k), torch.rand(k, n)
        ga, gb = a.to(gpu), b.to(gpu)
        g = Graph("mm")
        x = g.input(TensorMeta.make((m, k), device="cpu"))
        y = g.input(TensorMeta.make((k, n), device="cpu"))
        node_cpu = g.call(aten.mm.default, (x, y))
        g2 = Graph("mm")
        x2 = g2.input(TensorMeta.make((m, k), device=gpu))
        y2 = g2.input(TensorMeta.make((k, n), device=gpu))
        node_gpu = g2.call(aten.mm.default, (x2, y2))
        gpu_cost = cm.op_cost(node_gpu, gpu)
        gpu_op = gpu_cost.host_s + gpu_cost.device_s  # one op, waited for: launch then kernel
        cpu_op = cm.node_time(node_cpu, "cpu:0")

        def pageable(nbytes: int, src: str, dst: str) -> float:
            return cm.transfer_time(nbytes, src, dst, pinned=False)

        ab, out_b = (4 * m * k, 4 * k * n), 4 * m * n
        predicted = {
            "host": {"cpu": cpu_op,
                     "gpu": sum(pageable(s, "cpu:0", gpu) for s in ab) + gpu_op
                     + pageable(out_b, gpu, "cpu:0")},
            "gpu": {"cpu": sum(pageable(s, gpu, "cpu:0") for s in ab) + cpu_op
                    + pageable(out_b, "cpu:0", gpu) + cm.host_sync_s,
                    "gpu": gpu_op + cm.host_sync_s},
        }
        with torch.no_grad():
            paths = _paths(a, b, ga, gb, gpu)
            measured = {where: side_by_side(p, reps) for where, p in paths.items()}
        for where in ("host", "gpu"):
            pick = min(predicted[where], key=predicted[where].get)
            best = min(measured[where], key=measured[where].get)
            loss = measured[where][pick] / measured[where][best] - 1
            out.append({"size": f"{m}x{k}x{n}", "data_on": where, "predicted": predicted[where],
                        "measured": measured[where], "picked": pick, "best": best,
                        "right": pick == best, "right_within_tie": loss <= TIE, "loss": loss})
    return out


# -- report ----------------------------------------------------------------------------------
def _median_abs(xs: list[float]) -> float | None:
    return statistics.median(abs(x) for x in xs) if xs else None


def summarize(rows: list[Row], choices: list[dict[str, Any]]) -> dict[str, Any]:
    big = [r for r in rows if r.measured_s > BIG_S and r.family != "copy"]
    ops = [r for r in rows if r.family != "copy"]
    copies = [r for r in rows if r.family == "copy"]
    s = {
        "ops_over_50us": len(big),
        "median_abs_error_over_50us": _median_abs([r.error for r in big]),
        "median_abs_error_all_ops": _median_abs([r.error for r in ops]),
        "median_abs_error_copies": _median_abs([r.error for r in copies]),
        "median_abs_error_after_observing": _median_abs([r.error_after for r in ops]),
        "median_abs_error_after_observing_over_50us": _median_abs(
            [r.error_after for r in big]),
        "choices_right": sum(c["right"] for c in choices),
        "choices_right_within_tie": sum(c["right_within_tie"] for c in choices),
        "choices": len(choices),
    }
    s["goals"] = {
        "error_over_50us <= 25%": s["median_abs_error_over_50us"] is not None
        and s["median_abs_error_over_50us"] <= 0.25,
        "after observing <= 10%": s["median_abs_error_after_observing"] is not None
        and s["median_abs_error_after_observing"] <= 0.10,
        "matmul choice right at every size (ties within 5 % count)":
        s["choices_right_within_tie"] == s["choices"] if choices else None,
    }
    return s


def _t(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} µs"


def print_report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"cost model on {result['machine']} ({result['profile_source']})")
    for col in ("op", "device", "measured", "spread", "predicted", "error", "source",
                f"after {result['observe']} runs", "error"):
        table.add_column(col, justify="left" if col in ("op", "device", "source") else "right")
    for r in result["rows"]:
        err = r["predicted_s"] / r["measured_s"] - 1
        after = r["predicted_after_s"] / r["measured_s"] - 1
        table.add_row(r["name"], r["device"], _t(r["measured_s"]), f"{r['spread']:.0%}",
                      _t(r["predicted_s"]), f"{err:+.0%}", r["source"],
                      _t(r["predicted_after_s"]), f"{after:+.0%}")
    console.print(table)
    if result["choices"]:
        ct = Table(title="matmul: CPU or GPU?")
        for col in ("size", "data on", "predicted cpu / gpu", "measured cpu / gpu", "picked",
                    "best", "loss"):
            ct.add_column(col)
        for c in result["choices"]:
            p, m = c["predicted"], c["measured"]
            ct.add_row(c["size"], c["data_on"], f"{_t(p['cpu'])} / {_t(p['gpu'])}",
                       f"{_t(m['cpu'])} / {_t(m['gpu'])}", c["picked"], c["best"],
                       f"{c['loss']:.0%}")
        console.print(ct)
    s = result["summary"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    console.print(
        f"median |error|: ops over 50 µs {pct(s['median_abs_error_over_50us'])} "
        f"({s['ops_over_50us']} ops), all ops {pct(s['median_abs_error_all_ops'])}, copies "
        f"{pct(s['median_abs_error_copies'])}; after observing "
        f"{pct(s['median_abs_error_after_observing'])}; matmul choices right "
        f"{s['choices_right']}/{s['choices']} ({s['choices_right_within_tie']} counting ties)")
    for goal, ok in s["goals"].items():
        console.print(f"  goal {goal}: {'-' if ok is None else 'met' if ok else 'MISSED'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="",
                    help="comma-separated, e.g. cpu:0,cuda:0 (default: cpu:0 and up to 2 GPUs)")
    ap.add_argument("--calibrate", choices=("cached", "quick", "full"), default="quick",
                    help="profile to predict with: the cached one, or measure now (default)")
    ap.add_argument("--cpu-workers", type=int, default=None,
                    help="logical CPU workers (default: autopar's, 2 on hosts of 2+ cores); "
                         "1 gives a worker the whole host")
    ap.add_argument("--reps", type=int, default=7, help="reference samples per op")
    ap.add_argument("--observe", type=int, default=5, help="runs fed to CostModel.observe")
    ap.add_argument("--quick", action="store_true", help="skip the biggest cases")
    ap.add_argument("--only", default="", help="comma-separated families to run")
    ap.add_argument("--out", default="", help="JSON path (default benchmarks/results/...)")
    ap.add_argument("--json", action="store_true", help="print the JSON instead of tables")
    args = ap.parse_args(argv)

    def say(what: str) -> None:
        print(f"  {what}", file=sys.stderr, flush=True)

    calibrate = False if args.calibrate == "cached" else args.calibrate
    machine: Machine = detect(cpu_workers=args.cpu_workers, calibrate=calibrate)
    # observations go to a fresh in-memory history: the user's history is not touched
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls as MEASURED.md ran them
    cm = CostModel(machine, History(fingerprint=machine.fingerprint))  # reads torch's tf32 flags
    devices = [d for d in args.devices.split(",") if d] or (
        ["cpu:0"] + [d.name for d in machine.gpus[:2]])
    for d in devices:
        machine.device(d)  # a precise KeyError for a device this machine lacks
    gpus = [d for d in devices if d.startswith("cuda")]
    families = set(args.only.split(",")) if args.only else None
    cases = [c for c in sweep() if not (args.quick and c.big)
             and (families is None or c.family in families)]

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(machine.cpu_threads)  # as a CPU worker runs
    try:
        rows = bench_ops(cm, devices, cases, args.reps, args.observe, say)
        if gpus and (families is None or "copy" in families):
            rows += bench_copies(cm, gpus, args.reps, args.observe, say)
        choices = (bench_choices(cm, gpus[0], args.reps, say, args.quick)
                   if gpus and (families is None or "matmul" in families) else [])
    finally:
        torch.set_num_threads(saved_threads)

    result = {
        "benchmark": "cost_model", "date": date.today().isoformat(), "host": host_info(),
        "machine": str(machine), "fingerprint": machine.fingerprint,
        "profile_source": machine.profile.source, "cpu_threads": machine.cpu_threads,
        "loadavg": os.getloadavg(), "devices": devices, "reps": args.reps,
        "observe": args.observe, "rows": [asdict(r) for r in rows], "choices": choices,
        "summary": summarize(rows, choices),
    }
    out = Path(args.out) if args.out else RESULTS / (
        f"cost_model-{'gpu' if gpus else 'cpu'}-{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_report(result)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
