"""Scale-out on one host: three workloads on 1, 2, 4 and 8 GPUs, measured next to the simulator.

    python benchmarks/scale.py          # every GPU count; those this host lacks are simulated
    python benchmarks/scale.py --size small --json out.json

Workloads (inputs on cuda:0, as code written for one GPU has them):
- ``chains``: g independent chains ``x = x @ w`` (``depth`` products each) on g GPUs. Weak
  scaling: the work per GPU is fixed, so the efficiency at g GPUs is ``T(1) / T(g)``.
- ``ensemble4``: the four-model ensemble of :mod:`autopar.bench.workloads`, one batch. Strong
  scaling (fixed work): efficiency ``T(1) / (g T(g))``; four models cannot use more than four GPUs.
- ``cholesky``: right-looking tiled Cholesky of a T x T tiled SPD matrix written as plain torch
  code on tiles: ``cholesky_ex`` on diagonal tiles (potrf), ``solve_triangular`` below them
  (trsm), ``L_ik @ L_jk^T`` updates (syrk, gemm). Strong scaling. It returns the lower tiles of
  the factor, checked against ``torch.linalg.cholesky`` of the whole matrix. ``cholesky_ex``
  rather than ``cholesky``: the latter checks its result on the host (``_linalg_check_errors``,
  a sync that leaves no tensor to capture).

Policy
- For each GPU count g this host has, each workload runs as ``autopar.compile(fn,
  devices=["cuda:0", ..., f"cuda:{g-1}"])`` after its result has been checked against eager;
  eager and autopar are timed with :func:`autopar.bench.harness.measure` (median of ``--repeat``
  samples, every device synchronized). The compile goes through autopar's own runner, recording
  the plan it ran, so the "this host" prediction is :func:`autopar.schedule.simulate.simulate` of
  that very plan under this host's cost model (calibrated, or calibrated now).
- Every row, run or not, also has the prediction on the matching preset (``h200x2`` restricted
  to cuda:0 for 1 GPU, ``h200x2``, ``h200x4``, ``h200x8``): :func:`autopar.explain` of the same
  function with the same devices. GPU counts this host lacks appear with that prediction only,
  labelled "simulated, not run". Nothing is timed on a host without GPUs.
- Errors are ``(predicted - measured) / measured``: negative means the simulator is optimistic.

Goals (ISSUE 9): chains' efficiency >= 90% at 4 GPUs and >= 85% at 8; the simulator within 15%
of the measured time on every run.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

try:
    import autopar  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from autopar.api import Options, Runner
from autopar.bench.harness import fingerprint, machine_label
from autopar.bench.measure import in_process_compiles, measure
from autopar.bench.workloads import WORKLOADS
from autopar.ir.units import fmt_seconds

SCHEMA = "autopar-scale/1"
GPU_COUNTS = (1, 2, 4, 8)
PRESET_FOR = {1: "h200x2", 2: "h200x2", 4: "h200x4", 8: "h200x8"}
NOT_RUN = "simulated, not run"
GOALS = {"efficiency": {4: 0.90, 8: 0.85}, "sim_error": 0.15}
SEED = 20261130

# (matrix size, chain depth); (matrix size, tile size)
CHAINS = {"full": (4096, 10), "small": (64, 4)}
CHOLESKY = {"full": (16384, 2048), "small": (128, 32)}


# -- the workloads -----------------------------------------------------------------------------
def chain(x: torch.Tensor, w: torch.Tensor, depth: int) -> torch.Tensor:
    for _ in range(depth):
        x = x @ w
    return x


def make_chains(depth: int) -> Callable[[list[torch.Tensor], list[torch.Tensor]], list]:
    def chains(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> list[torch.Tensor]:
        return [chain(x, w, depth) for x, w in zip(xs, ws)]
    return chains


def make_tiled_cholesky(tile: int) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """Lower Cholesky factor of ``a`` (n x n, n a multiple of ``tile``) by tiles, returned as
    its lower tiles row by row: L00, L10, L11, L20, ..."""

    def tiled_cholesky(a: torch.Tensor) -> list[torch.Tensor]:
        t = a.shape[0] // tile
        blocks = [[a[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile] for j in range(i + 1)]
                  for i in range(t)]
        low: list[list[Any]] = [[None] * (i + 1) for i in range(t)]
        for k in range(t):
            low[k][k] = torch.linalg.cholesky_ex(blocks[k][k])[0]  # potrf
            for i in range(k + 1, t):  # trsm: L_ik L_kk^T = A_ik
                low[i][k] = torch.linalg.solve_triangular(low[k][k].mT, blocks[i][k],
                                                          upper=True, left=False)
            for i in range(k + 1, t):  # syrk (j == i) and gemm: the trailing update
                for j in range(k + 1, i + 1):
                    blocks[i][j] = blocks[i][j] - low[i][k] @ low[j][k].mT
        return [tile_ for row in low for tile_ in row]

    return tiled_cholesky


def lower_tiles(factor: torch.Tensor, tile: int) -> list[torch.Tensor]:
    """The lower tiles of a whole factor, in :func:`make_tiled_cholesky`'s order."""
    t = factor.shape[0] // tile
    return [factor[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile]
            for i in range(t) for j in range(i + 1)]


@dataclass(frozen=True)
class Case:
    """One workload at one GPU count: the function and how to build its inputs."""

    name: str
    scaling: str  # "weak" or "strong"
    fn: Callable[..., Any]
    inputs: Callable[[str, bool], tuple]  # (device, values?) -> args; values False: shapes only
    reference: Callable[[tuple], Any] | None = None  # an independent result eager must match
    rtol: float = 1e-3
    atol: float = 1e-3


def _draw(shape: tuple[int, ...], gen: torch.Generator | None, device: str,
          scale: float = 1.0) -> torch.Tensor:
    """Seeded normal values drawn on ``device`` (on the GPU: drawing a GiB on the host would
    take seconds); with no generator, an untouched tensor of that shape on the host, which is
    only ever traced with fake tensors."""
    if gen is None:
        return torch.empty(shape)
    return torch.randn(shape, generator=gen, device=device) * scale


def _generator(device: str, values: bool) -> torch.Generator | None:
    return torch.Generator(device).manual_seed(SEED) if values else None


def chains_case(gpus: int, size: str) -> Case:
    n, depth = CHAINS[size]

    def inputs(device: str, values: bool) -> tuple:
        gen = _generator(device, values)
        xs = [_draw((n, n), gen, device) for _ in range(gpus)]
        ws = [_draw((n, n), gen, device, 1 / math.sqrt(n)) for _ in range(gpus)]
        return xs, ws

    return Case("chains", "weak", make_chains(depth), inputs)


@functools.cache
def _ensemble_shapes(size: str) -> tuple:
    """The ensemble's inputs as untouched tensors of the same shapes (built once: drawing the
    full-size values takes seconds on a small host)."""
    drawn = WORKLOADS["ensemble4"].make_inputs(("cpu",), size)
    return tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype), drawn)


def ensemble_case(gpus: int, size: str) -> Case:
    w = WORKLOADS["ensemble4"]

    def inputs(device: str, values: bool) -> tuple:
        if not values:
            return _ensemble_shapes(size)
        return w.make_inputs((device,) if device.startswith("cuda") else ("cpu",), size)

    return Case("ensemble4", "strong", w.eager, inputs, rtol=w.rtol, atol=w.atol)


def cholesky_case(gpus: int, size: str) -> Case:
    n, tile = CHOLESKY[size]

    def inputs(device: str, values: bool) -> tuple:
        if not values:
            return (torch.empty(n, n),)
        m = _draw((n, n), _generator(device, values), device)
        a = m @ m.T / n + torch.eye(n, device=device)  # eigenvalues in [1, 5]: well conditioned
        return (a,)

    def reference(args: tuple) -> list[torch.Tensor]:
        return lower_tiles(torch.linalg.cholesky(args[0]), tile)

    return Case("cholesky", "strong", make_tiled_cholesky(tile), inputs, reference)


CASES: dict[str, Callable[[int, str], Case]] = {
    "chains": chains_case, "ensemble4": ensemble_case, "cholesky": cholesky_case}


def check_close(out: Any, ref: Any, rtol: float, atol: float, where: str) -> None:
    """Raise AssertionError unless ``out`` matches ``ref`` (tensors, nested lists and tuples)."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
            raise AssertionError(f"{where}: expected a tensor of shape {tuple(ref.shape)}")
        torch.testing.assert_close(out, ref.to(out.device), rtol=rtol, atol=atol,
                                   check_stride=False, msg=lambda m: f"{where}: {m}")
        return
    if not isinstance(out, (list, tuple)) or len(out) != len(ref):
        raise AssertionError(f"{where}: expected a sequence of {len(ref)} values")
    for i, (o, r) in enumerate(zip(out, ref)):
        check_close(o, r, rtol, atol, f"{where}[{i}]")


# -- compiling with the plan at hand -----------------------------------------------------------
class RecordingRunner(Runner):
    """autopar's runner, keeping the plan of each graph it ran (None: it fell back to eager)."""

    def __init__(self, options: Options) -> None:
        super().__init__(options)
        self.plans: dict[str, Any] = {}

    def __call__(self, graph: Any, phase: str) -> Callable:
        run = super().__call__(graph, phase)
        self.plans[graph.name] = getattr(run, "plan", None)
        return run


def compile_recording(fn: Callable, devices: Sequence[str]) -> tuple[Callable, RecordingRunner]:
    """``autopar.compile(fn, devices=devices)``, with the runner at hand."""
    from autopar.capture.dynamo import make_backend

    runner = RecordingRunner(Options.parse({"devices": list(devices)}))
    runner.cost_model()  # as autopar.compile: the machine is resolved before tracing
    return torch.compile(fn, backend=make_backend(runner), dynamic=False), runner


def host_prediction(runner: RecordingRunner) -> tuple[float | None, str]:
    """Simulated seconds of the plans the runner ran, under its own cost model."""
    from autopar.schedule.simulate import simulate

    if not runner.plans:
        return None, "no graph captured"
    if any(p is None for p in runner.plans.values()):
        return None, "a graph fell back to eager"
    cost = runner.cost_model()
    return sum(simulate(p, cost).makespan for p in runner.plans.values()), ""


def preset_prediction(case: Case, gpus: int) -> tuple[str, float | None, str]:
    """(preset, predicted seconds or None, why not) of ``case`` on ``gpus`` GPUs of its preset."""
    from autopar.report.explain import explain

    name = PRESET_FOR[gpus]
    try:
        report = explain(case.fn, *case.inputs("cpu", False), machine=name, inputs_on="cuda:0",
                         devices=gpu_names(gpus))
    except Exception as e:  # one row's failure must not stop the table
        return name, None, f"{type(e).__name__}: {e}"[:160]
    return name, report.predicted_s, ""


def gpu_names(gpus: int) -> list[str]:
    return [f"cuda:{i}" for i in range(gpus)]


# -- rows --------------------------------------------------------------------------------------
@dataclass
class ScaleRow:
    workload: str
    scaling: str
    gpus: int
    status: str  # "measured", NOT_RUN, or "error"
    preset: str
    preset_s: float | None = None  # predicted on the preset
    eager_s: float | None = None  # measured: the code as written, on cuda:0
    autopar_s: float | None = None  # measured
    autopar_p10_s: float | None = None
    autopar_p90_s: float | None = None
    host_s: float | None = None  # predicted with this host's cost model, of the plan that ran
    efficiency: float | None = None  # measured, against the measured 1-GPU row
    preset_efficiency: float | None = None  # predicted on presets, against the 1-GPU preset row
    notes: list[str] = field(default_factory=list)

    @property
    def host_error(self) -> float | None:
        return _rel(self.host_s, self.autopar_s)

    @property
    def preset_error(self) -> float | None:
        return _rel(self.preset_s, self.autopar_s)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"host_error": self.host_error, "preset_error": self.preset_error}


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def efficiency(scaling: str, gpus: int, t1: float | None, tg: float | None) -> float | None:
    """Weak scaling: ``T(1) / T(g)`` (g times the work); strong: ``T(1) / (g T(g))``."""
    if not t1 or not tg:
        return None
    return t1 / tg if scaling == "weak" else t1 / (gpus * tg)


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_case(case: Case, devices: Sequence[str], repeat: int, row: ScaleRow,
                 home: str = "cuda:0") -> None:
    """Check autopar on ``devices`` against eager (inputs on ``home``), then time both; fills
    ``row``. Raises AssertionError when a result differs."""
    args = case.inputs(home, True)
    ref = case.fn(*args)
    if case.reference is not None:
        check_close(ref, case.reference(args), case.rtol, case.atol, f"{case.name} eager")
    torch._dynamo.reset()
    compiled, runner = compile_recording(case.fn, devices)
    check_close(compiled(*args), ref, case.rtol, case.atol, f"{case.name} autopar")
    del ref
    row.eager_s = measure(case.fn, *args, warmup=1, repeat=repeat).median
    stats = measure(compiled, *args, warmup=2, repeat=repeat)
    row.autopar_s, row.autopar_p10_s, row.autopar_p90_s = stats.median, stats.p10, stats.p90
    row.host_s, why = host_prediction(runner)
    if why:
        row.notes.append(f"no host prediction: {why}")
    used = sorted({d for p in runner.plans.values() if p is not None
                   for d in p.placement.device.values()})
    row.notes.append(f"devices used: {','.join(used)}")
    row.status = "measured"


def collect(workloads: Sequence[str] = tuple(CASES), counts: Sequence[int] = GPU_COUNTS,
            size: str = "full", repeat: int = 5, run_here: bool = True,
            progress: Callable[[str], None] | None = None) -> list[ScaleRow]:
    """Every workload at every GPU count: measured where this host has the GPUs (and
    ``run_here``), predicted on the matching preset everywhere."""
    have = torch.cuda.device_count() if run_here else 0
    rows: list[ScaleRow] = []
    for name in workloads:
        by_count: dict[int, ScaleRow] = {}
        for g in counts:
            case = CASES[name](g, size)
            preset, predicted, why = preset_prediction(case, g)
            row = ScaleRow(name, case.scaling, g, NOT_RUN, preset, predicted)
            if why:
                row.notes.append(f"no preset prediction: {why}")
            if g <= have:
                if progress:
                    progress(f"{name} on {g} GPU{'s' if g > 1 else ''}")
                try:
                    measure_case(case, gpu_names(g), repeat, row)
                except Exception as e:  # the table goes on; the row says what failed
                    row.status = "error"
                    row.notes.append(f"{type(e).__name__}: {e}"[:300])
                torch._dynamo.reset()
                _release()
            by_count[g] = row
            rows.append(row)
        one = by_count.get(1)
        for g, row in by_count.items():
            if one is not None:
                row.efficiency = efficiency(row.scaling, g, one.autopar_s, row.autopar_s)
                row.preset_efficiency = efficiency(row.scaling, g, one.preset_s, row.preset_s)
    return rows


# -- reporting ---------------------------------------------------------------------------------
def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "—"
    return f"{x:+.1%}" if signed else f"{x:.0%}"


def _t(x: float | None) -> str:
    return "—" if x is None else fmt_seconds(x)


HEADERS = ("workload", "GPUs", "status", "eager", "autopar", "predicted (this host)", "error",
           "predicted (preset)", "error", "efficiency", "efficiency (preset)")


def grid(rows: Sequence[ScaleRow]) -> list[list[str]]:
    return [[r.workload + (" (weak)" if r.scaling == "weak" else ""), str(r.gpus), r.status,
             _t(r.eager_s), _t(r.autopar_s), _t(r.host_s), _pct(r.host_error, True),
             f"{_t(r.preset_s)} on {r.preset}", _pct(r.preset_error, True), _pct(r.efficiency),
             _pct(r.preset_efficiency)] for r in rows]


def goals(rows: Sequence[ScaleRow]) -> list[str]:
    """One line per goal: met, missed, or only predicted (never measured here)."""
    lines = []
    for g, floor in GOALS["efficiency"].items():
        row = next((r for r in rows if r.workload == "chains" and r.gpus == g), None)
        if row is None:
            continue
        if row.efficiency is not None:
            verdict = "met" if row.efficiency >= floor else "MISSED"
            lines.append(f"chains at {g} GPUs: efficiency {row.efficiency:.1%} measured "
                         f"(goal >= {floor:.0%}): {verdict}")
        elif row.preset_efficiency is not None:
            verdict = "would be met" if row.preset_efficiency >= floor else "would be missed"
            lines.append(f"chains at {g} GPUs: efficiency {row.preset_efficiency:.1%} predicted "
                         f"on {row.preset}, not measured (goal >= {floor:.0%}): {verdict}")
    limit = GOALS["sim_error"]
    measured = [r for r in rows if r.status == "measured"]
    for r in measured:
        for what, err in (("this host's model", r.host_error), (r.preset, r.preset_error)):
            if err is not None and abs(err) > limit:
                lines.append(f"{r.workload} on {r.gpus} GPUs: simulator ({what}) off by "
                             f"{err:+.1%} (goal within {limit:.0%}): MISSED")
    if measured and not any("simulator" in line for line in lines):
        lines.append(f"simulator within {limit:.0%} of the measured time on every run: met")
    if not measured:
        lines.append("simulator accuracy: nothing measured on this host")
    return lines


def to_markdown(rows: Sequence[ScaleRow], machine: dict[str, Any], size: str) -> str:
    head = (f"{machine_label(machine)}: {machine.get('cpu_model', '?')}, torch "
            f"{machine.get('torch', torch.__version__)}; size {size}; "
            f"{machine.get('date', '')}; `{machine.get('command', '')}`\n\n")
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in grid(rows)]
    notes = [f"- {r.workload} on {r.gpus} GPUs: {n}" for r in rows for n in r.notes
             if not n.startswith("devices used")]
    text = head + "\n".join(lines) + "\n\nGoals:\n\n" + "".join(f"- {g}\n" for g in goals(rows))
    return text + ("\nNotes:\n\n" + "\n".join(notes) + "\n" if notes else "")


def print_table(rows: Sequence[ScaleRow], size: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(" | ".join(HEADERS))
        for cells in grid(rows):
            print(" | ".join(cells))
    else:
        table = Table(title=f"autopar scale-out, size {size}")
        for h in HEADERS:
            table.add_column(h, overflow="fold")
        for cells in grid(rows):
            table.add_row(*cells)
        Console(width=200).print(table)
    for line in goals(rows):
        print(line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="full", choices=("full", "small"),
                   help="full: sizes for H200s; small: a CPU-sized smoke run")
    p.add_argument("--only", default=",".join(CASES),
                   help=f"comma-separated workloads among {', '.join(CASES)}")
    p.add_argument("--gpus", default=",".join(map(str, GPU_COUNTS)),
                   help="comma-separated GPU counts among 1,2,4,8")
    p.add_argument("--repeat", type=int, default=5, help="timed samples per variant")
    p.add_argument("--json", type=Path, default=None,
                   help="where to write the JSON (default benchmarks/results/"
                        "scale-<machine>-<date>.json)")
    args = p.parse_args(argv)
    in_process_compiles()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    counts = sorted({int(c) for c in args.gpus.split(",") if c.strip()})
    if unknown:
        p.error(f"unknown workloads {unknown}; choose among {', '.join(CASES)}")
    if not counts or any(c not in PRESET_FOR for c in counts):
        p.error(f"--gpus {args.gpus}: choose among {', '.join(map(str, GPU_COUNTS))}")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    machine = fingerprint(["python", "benchmarks/scale.py", *(argv if argv is not None
                                                              else sys.argv[1:])])
    rows = collect(names, counts, args.size, args.repeat,
                   progress=lambda m: print(f"scale: {m}", file=sys.stderr, flush=True))
    print_table(rows, args.size)
    doc = {"schema": SCHEMA, "benchmark": "scale", "machine": machine, "size": args.size,
           "goals": {"efficiency": {str(k): v for k, v in GOALS["efficiency"].items()},
                     "sim_error": GOALS["sim_error"]},
           "rows": [r.to_json() for r in rows], "goal_lines": goals(rows),
           "markdown": to_markdown(rows, machine, args.size)}
    out = args.json or (Path(__file__).resolve().parent / "results"
                        / f"scale-{machine_label(machine)}-{machine['date'][:10]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0 if all(r.status != "error" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
