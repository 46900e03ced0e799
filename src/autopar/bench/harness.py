"""The harness: run workloads' variants side by side, check and time them, report them.

Policy
- Timing is :mod:`autopar.bench.measure`'s (:func:`~autopar.bench.measure.measure`).
- :func:`run_suite` runs each workload's variants in one process, one after the other. Eager's
  output on fresh inputs is the reference; each variant gets its own fresh inputs (same seed),
  is prepared (compiled, or the hand-tuned setup done), called ``workload.calls`` times and
  checked against the reference; only a variant that matches is timed. A variant that fails
  becomes a cell holding its error (one that does not apply here, the reason it was skipped):
  the suite goes on.
- Timing is interleaved (:func:`~autopar.bench.measure.measure_side_by_side`).
- Variants are a table, :data:`VARIANTS`: name -> prepare(workload, context, inputs) ->
  (callable, inputs). Dynamo is reset before each workload, so that one workload's cache never
  serves (or exhausts the recompile limit of) another; within a workload, torch.compile's and
  autopar's entries for the same code are kept apart by dynamo's backend guard.
- Simulated cells (:func:`simulate`) come from ``autopar.explain`` on a preset machine (or on
  this host's model), with the full-size inputs built on the host; nothing runs. Where explain
  is missing or fails, the cell says why.
- A :class:`Report` is the machine's fingerprint plus rows; it renders to JSON (``SCHEMA``),
  markdown and a rich table, and says which speed goals were missed (:meth:`Report.misses`).

Glossary: *variant* one way of running a workload (eager, hand, compile, autopar); *cell* one
variant's result in a row; *context* the devices and size of a run.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import platform
import socket
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import autopar

from ..api import dispatcher_of, parse_devices
from ..capture.fx import Unsupported
from ..dataparallel import predict_step
from ..ir.logs import quiet
from ..ir.units import fmt_seconds
from ..machine.calibrate import BUSY_OTHERS, cpu_busy, other_cpu_share
from ..machine.host import host_info
from ..machine.presets import PRESETS
from ..report.explain import explain
from ..report.trace import save_gantt
from .measure import (
    SUITE_MIN_TOTAL_S,
    Prepared,
    Stats,
    in_process_compiles,
    measure_side_by_side,
    sync_all,
)
from .workloads import SIZES, WORKLOADS, Workload, home_of, select

__all__ = ["SCHEMA", "VARIANTS", "Cell", "Context", "Report", "Row", "Simulated",
           "collect", "fingerprint", "gpus_of", "machine_label", "run_suite", "settle",
           "simulate", "write_report"]

SCHEMA = "autopar-bench/1"
TOLERANCE = 1.05  # "within 5%"


# -- results -----------------------------------------------------------------------------------
@dataclass
class Cell:
    """One variant of one workload: timed, failed (``error``) or not run (``skipped``)."""

    median_s: float | None = None
    p10_s: float | None = None
    p90_s: float | None = None
    n: int = 0
    devices: str = ""
    error: str | None = None
    skipped: str | None = None

    @property
    def ok(self) -> bool:
        return self.median_s is not None

    @staticmethod
    def timed(stats: Stats, devices: str) -> Cell:
        return Cell(stats.median, stats.p10, stats.p90, stats.n, devices)


@dataclass
class Simulated:
    """Predicted seconds of eager's placement and of autopar's on a machine not at hand."""

    machine: str
    predicted_s: float | None = None
    eager_predicted_s: float | None = None
    error: str | None = None

    @property
    def speedup(self) -> float | None:
        if self.predicted_s and self.eager_predicted_s:
            return self.eager_predicted_s / self.predicted_s
        return None


@dataclass
class Row:
    workload: str
    title: str
    family: str
    cells: dict[str, Cell] = field(default_factory=dict)
    simulated: Simulated | None = None
    hand_goal: bool = False  # autopar should be fastest or within 5% of hand-tuned here

    def speedup(self, variant: str) -> float | None:
        """Eager's median over ``variant``'s (above 1: faster than eager)."""
        eager, other = self.cells.get("eager"), self.cells.get(variant)
        if eager and other and eager.ok and other.ok and other.median_s > 0:
            return eager.median_s / other.median_s
        return None

    def best(self) -> str | None:
        timed = {v: c.median_s for v, c in self.cells.items() if c.ok}
        return min(timed, key=timed.__getitem__) if timed else None


@dataclass
class Report:
    machine: dict[str, Any]
    size: str
    devices: list[str]
    variants: list[str]
    rows: list[Row]
    schema: str = SCHEMA

    def to_json(self) -> dict[str, Any]:
        """A dict for ``json.dumps``; unset (None or empty) fields of cells are left out."""
        data = asdict(self)
        for row in data["rows"]:
            row["cells"] = {v: _set_fields(c) for v, c in row["cells"].items()}
            if row["simulated"]:
                row["simulated"] = _set_fields(row["simulated"])
        return data

    @staticmethod
    def from_json(data: dict[str, Any]) -> Report:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not an autopar benchmark report: schema {data.get('schema')!r}, "
                             f"expected {SCHEMA!r}")
        rows = [Row(r["workload"], r["title"], r["family"],
                    {v: Cell(**c) for v, c in r["cells"].items()},
                    Simulated(**r["simulated"]) if r.get("simulated") else None,
                    bool(r.get("hand_goal", False)))
                for r in data["rows"]]
        return Report(dict(data["machine"]), data["size"], list(data["devices"]),
                      list(data["variants"]), rows)

    def misses(self) -> list[str]:
        """Speed goals missed: on W1-W6 autopar fastest or within 5% of hand-tuned; on every
        workload autopar no more than 5% slower than eager."""
        out = []
        for row in self.rows:
            auto = row.cells.get("autopar")
            if auto is None or not auto.ok:
                if auto is not None and auto.error:
                    out.append(f"{row.workload}: autopar failed: {auto.error}")
                continue
            eager = row.cells.get("eager")
            if eager and eager.ok and auto.median_s > TOLERANCE * eager.median_s:
                out.append(f"{row.workload}: autopar {fmt_seconds(auto.median_s)} is more than 5% "
                           f"slower than eager {fmt_seconds(eager.median_s)}")
            if not row.hand_goal or row.best() == "autopar":
                continue
            hand = row.cells.get("hand")
            if hand and hand.ok and auto.median_s > TOLERANCE * hand.median_s:
                out.append(f"{row.workload}: autopar {fmt_seconds(auto.median_s)} is not within 5% "
                           f"of hand-tuned {fmt_seconds(hand.median_s)}")
        return out

    # -- views ---------------------------------------------------------------------------------
    def _sim_machine(self) -> str | None:
        return next((r.simulated.machine for r in self.rows if r.simulated), None)

    def headers(self) -> list[str]:
        cols = ["workload", *self.variants, "autopar ran on"]
        sim = self._sim_machine()
        if sim:
            cols.append(f"{sim} (simulated): eager → autopar")
        return cols

    def grid(self, sep: str = " ") -> tuple[list[list[str]], list[str]]:
        """Cell texts row by row, and the notes that their ``(n)`` marks point to (errors,
        one note per distinct message). ``sep`` goes between a time and its speedup."""
        notes: dict[str, list[str]] = {}

        def mark(where: str, message: str) -> str:
            notes.setdefault(message, []).append(where)
            return f"({list(notes).index(message) + 1})"

        sim = self._sim_machine()
        grid = []
        for row in self.rows:
            texts = [row.workload]
            for v in self.variants:
                cell = row.cells.get(v)
                if cell is None or (cell.skipped and cell.skipped.startswith("no ")):
                    texts.append("—")
                elif cell.error:
                    texts.append("error " + mark(f"{row.workload} {v}", cell.error))
                elif cell.skipped:
                    texts.append(cell.skipped)
                else:
                    speedup = row.speedup(v)
                    texts.append(fmt_seconds(cell.median_s) + (
                        f"{sep}×{speedup:.2f}" if v != "eager" and speedup else ""))
            auto = row.cells.get("autopar")
            texts.append(_compact_devices(auto.devices) if auto and auto.ok else "")
            if sim:
                s = row.simulated
                if s is None:
                    texts.append("")
                elif s.error:
                    texts.append("n/a " + mark(f"{row.workload} simulated", s.error))
                else:
                    texts.append(f"{fmt_seconds(s.eager_predicted_s)} → "
                                 f"{fmt_seconds(s.predicted_s)}{sep}×{s.speedup:.2f}")
            grid.append(texts)
        lines = [f"({i}) {', '.join(where)}: {msg}" for i, (msg, where)
                 in enumerate(notes.items(), 1)]
        return grid, lines

    def title(self) -> str:
        return (f"autopar on {machine_label(self.machine)}, size {self.size}: median time per "
                "call, × speedup against eager")

    def to_markdown(self) -> str:
        m = self.machine
        gpus = ", ".join(m.get("gpus") or []) or "no GPU"
        head = (f"{machine_label(m)}: {m.get('cpu_model', '?')}, {m.get('cores', '?')} cores, "
                f"{gpus}; torch {m.get('torch', '?')}; size {self.size}; {m.get('date', '')}; "
                f"`{m.get('command', '')}`\n\n")
        headers = self.headers()
        grid, notes = self.grid()
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in grid]
        body = "\n".join(lines) + "\n"
        if notes:
            body += "\n" + "".join(f"{n}\n\n" for n in notes)
        return head + body + _goals(self)

    def to_rich(self) -> Any:
        from rich.console import Group  # lazy: start-up cost
        from rich.markup import escape  # lazy: start-up cost
        from rich.table import Table  # lazy: start-up cost
        from rich.text import Text  # lazy: start-up cost

        table = Table(title=self.title())
        headers = self.headers()
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0,
                             style="dim" if "simulated" in h else None)
        grid, notes = self.grid(sep="\n")
        for row, texts in zip(self.rows, grid):
            best = row.best()
            styled = [escape(t) for t in texts]
            for i, h in enumerate(headers):
                if h == best:
                    styled[i] = f"[bold green]{styled[i]}[/]"
                elif texts[i].startswith("error"):
                    styled[i] = f"[red]{styled[i]}[/]"
            table.add_row(*styled)
        busy = self.busy()
        return Group(table, *(Text(n, style="dim") for n in notes),
                     *([Text(busy, style="yellow")] if busy else []))

    def busy(self) -> str:
        """A warning where other processes used over ``BUSY_OTHERS`` of the host's cores while
        the workloads were timed (the times are then theirs too), else ""."""
        share = self.machine.get("others_share", 0.0)
        if share <= BUSY_OTHERS:
            return ""
        return (f"this host was busy: other processes used {share:.0%} of its cores while "
                "timing; times include their contention, and ratios may not hold on an idle "
                "host")


def _set_fields(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None and v != ""}


def _compact_devices(devices: str) -> str:
    """``cpu:0,cpu:1,cuda:0,cuda:1`` -> ``cpu:0,1 cuda:0,1``."""
    groups: dict[str, list[str]] = {}
    for d in filter(None, devices.split(",")):
        kind, _, index = d.partition(":")
        groups.setdefault(kind, []).append(index)
    return " ".join(f"{k}:{','.join(i)}" if any(i) else k for k, i in groups.items())




def _short(e: BaseException) -> str:
    """An error in one line, whole: its type and its message's first line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


NEEDS_A_RUN = ("not simulated: it reads a tensor's value on the host (a slice bound or "
               ".item()), which a trace on fake tensors can't know without running it")
"""What a table says of a workload explain can't trace without running it."""


def _goals(report: Report) -> str:
    misses = report.misses()
    if not misses:
        return "Speed goals: met on every row that ran.\n"
    return "Speed goals missed:\n\n" + "".join(f"- {m}\n" for m in misses)


# -- the machine -------------------------------------------------------------------------------
def fingerprint(command: Sequence[str] | None = None) -> dict[str, Any]:
    """What a result was measured on, and how: host, CPU, GPUs, versions, date, command."""
    try:
        info = dict(host_info())
    except Exception:  # machine discovery must never stop a benchmark
        info = {"cpu_model": platform.processor() or platform.machine(),
                "cores": os.cpu_count() or 1,
                "gpus": [torch.cuda.get_device_name(i)
                         for i in range(torch.cuda.device_count())],
                "torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    info.update(host=socket.gethostname(), python=platform.python_version(),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                command=" ".join(command if command is not None else _argv()))
    return info


def _argv() -> list[str]:
    if not sys.argv:
        return []
    return [Path(sys.argv[0]).name, *sys.argv[1:]]


def machine_label(fp: dict[str, Any]) -> str:
    """``2xH200`` for two NVIDIA H200, ``cpu2`` for a 2-core host without GPUs."""
    gpus = list(fp.get("gpus") or [])
    if not gpus:
        return f"cpu{fp.get('cores', '')}"
    name = gpus[0].replace("NVIDIA ", "").strip().replace(" ", "-")
    return f"{len(gpus)}x{name}"


# -- running variants --------------------------------------------------------------------------
class Skip(Exception):
    """This variant does not apply here; the message says why."""


@dataclass(frozen=True)
class Context:
    devices: tuple[str, ...]  # what autopar may use
    size: str

    @property
    def gpus(self) -> list[str]:
        return [d for d in self.devices if d.startswith("cuda")]

    @property
    def home(self) -> str:
        return home_of(self.devices)


def _eager(w: Workload, ctx: Context, inputs: tuple) -> Prepared:
    return w.eager, inputs


def _hand(w: Workload, ctx: Context, inputs: tuple) -> Prepared:
    if w.hand is None:
        raise Skip("no hand-tuned form")
    if len(ctx.gpus) < w.hand_gpus:
        raise Skip(f"needs {w.hand_gpus} GPU" + ("s" if w.hand_gpus > 1 else ""))
    return w.hand, w.prepare_hand(inputs, ctx.gpus)


def _torch_compile(w: Workload, ctx: Context, inputs: tuple) -> Prepared:
    # dynamo's warnings about the workload (a graph break at .item()) are not the user's: kept
    # off the console (a wrapper's call, ~0.1 us)
    return quiet(torch.compile(w.eager)), inputs


def _autopar(w: Workload, ctx: Context, inputs: tuple) -> Prepared:
    if w.whole_step:
        return autopar.data_parallel(w.eager, devices=list(ctx.devices)), inputs
    return autopar.compile(w.eager, devices=list(ctx.devices)), inputs


VARIANTS: dict[str, Callable[[Workload, Context, tuple], Prepared]] = {
    "eager": _eager, "hand": _hand, "compile": _torch_compile, "autopar": _autopar,
}


def _call(fn: Callable[..., Any], args: tuple, calls: int) -> Any:
    out = None
    for _ in range(calls):
        out = fn(*args)
    sync_all()
    return out


def _devices_of(values: Any) -> str:
    found: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            found.add(str(v.device))
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(values)
    return ",".join(sorted(found))


def _used_by_autopar(fn: Callable[..., Any], args: tuple, ctx: Context) -> str:
    """Where autopar's calls ran: ``plain`` where calls with these arguments ran as the
    function itself, else the devices its placed plans put ops on (eager's devices where every
    graph ran as eager's sequence); for what keeps no such record (``data_parallel``), the
    devices it was given."""
    d = dispatcher_of(fn)
    if d is None:
        return ",".join(ctx.devices)
    way = d.kept_way(args)
    if way == "eager":
        return "plain"
    if way == "inductor":
        return "inductor"
    used = {e for ex in d.runner.executors if ex.runs_as == "executor"
            for e, ops in ex.plan.placement.order.items() if ops}
    return ",".join(sorted(used)) if used else "eager's"


def prepare_variant(w: Workload, variant: str, ctx: Context, ref: Any) -> Prepared | Cell:
    """The variant's callable and inputs, checked against ``ref``; or a Cell saying why not.
    Never raises."""
    try:
        fn, args = VARIANTS[variant](w, ctx, w.make_inputs(ctx.devices, ctx.size))
    except Skip as s:
        return Cell(skipped=str(s))
    except Exception as e:
        return Cell(error=_short(e))
    try:
        w.check(_call(fn, args, w.calls), ref)
        settle(fn, args, w.calls)
    except AssertionError as e:
        return Cell(error="wrong result: " + _short(e).split(": ", 1)[-1])
    except Exception as e:
        return Cell(error=_short(e))
    return fn, args


SETTLE_CALLS = 1024  # at most: two trials (3 ways, then 2), 2 x TRIAL_MAX_CALLS a way, waits


def settle(fn: Callable[..., Any], args: tuple, calls: int) -> None:
    """Call an ``autopar.compile`` function until it has decided each signature's way (its
    timed trials are over; at most ``SETTLE_CALLS`` calls), as compiling is done before timing
    for ``torch.compile``: samples then time the way it keeps, and the calls per sample are
    chosen from a call of that way, not from a trial's slower one."""
    d = dispatcher_of(fn)
    for _ in range(SETTLE_CALLS):
        if d is None or not d.trials:
            return
        _call(fn, args, calls)


def run_workload(w: Workload, ctx: Context, variants: Sequence[str],
                 timing: dict[str, Any], progress: Callable[[str], None] | None = None) -> Row:
    """Prepare and check every variant, then time those that passed side by side."""
    row = Row(w.name, w.title, w.family, hand_goal=w.hand_goal)
    torch._dynamo.reset()  # this workload's compiled variants start from an empty cache
    try:
        ref = _call(w.eager, w.make_inputs(ctx.devices, ctx.size), w.calls)
    except Exception as e:
        reason = f"eager failed: {_short(e)}"
        row.cells = {v: Cell(error=reason) for v in variants}
        return row
    done: dict[str, Cell] = {}
    prepared: dict[str, Prepared] = {}
    for v in variants:
        if progress:
            progress(f"{w.name}: {v}")
        result = _same_threads(prepare_variant, w, v, ctx, ref)
        if isinstance(result, Cell):
            done[v] = result
        else:
            prepared[v] = result
    del ref
    if progress:
        progress(f"{w.name}: timing {', '.join(prepared)}")
    for v, stats in measure_side_by_side(prepared, **timing).items():
        if isinstance(stats, Exception):
            done[v] = Cell(error=_short(stats))
        else:
            used = _used_by_autopar(*prepared[v], ctx) if v == "autopar" else \
                _devices_of(prepared[v][1])
            done[v] = Cell.timed(stats, used)
    row.cells = {v: done[v] for v in variants}
    prepared.clear()
    _release()
    return row


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_suite(workloads: Sequence[Workload], variants: Sequence[str] = tuple(VARIANTS),
              devices: str | Sequence[str] = "auto", size: str = "small", *, warmup: int = 2,
              repeat: int = 10, budget_s: float | None = 2.0,
              progress: Callable[[str], None] | None = None) -> list[Row]:
    """Run every variant of every workload in this process, side by side; a row each."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
    if torch.cuda.is_available():  # fp32 means fp32, as in MEASURED.md
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    in_process_compiles()
    ctx = Context(parse_devices(devices), size)
    timing = {"warmup": warmup, "repeat": repeat, "budget_s": budget_s,
              "min_total_s": SUITE_MIN_TOTAL_S}
    return [run_workload(w, ctx, variants, timing, progress) for w in workloads]


def _same_threads(run: Callable[..., Cell], *args: Any) -> Cell:
    """Restore torch's intra-op thread count after ``run``, whatever the variant changed."""
    threads = torch.get_num_threads()
    try:
        return run(*args)
    finally:
        torch.set_num_threads(threads)


# -- simulation --------------------------------------------------------------------------------
def simulate(w: Workload, machine: str) -> tuple[Simulated, Any]:
    """Predicted eager and autopar times of ``w`` (full size) on ``machine``, and autopar's
    simulated Timeline (None when it could not be explained). Never raises."""
    label = "this host" if machine == "auto" else machine
    if w.whole_step:
        return _simulate_step(w, machine, label)
    if w.explain_inputs_on is None:
        return Simulated(label, error=w.explain_note or "not explainable"), None
    try:
        inputs = w.make_inputs(("cpu",), "full")
        report = explain(w.eager, *inputs, machine=machine, inputs_on=w.explain_inputs_on)
    except Unsupported as e:
        return Simulated(label, error=NEEDS_A_RUN if str(e).startswith("can't trace") else
                         str(e).splitlines()[0]), None
    except Exception as e:
        return Simulated(label, error=_short(e)), None
    return (Simulated(label, report.predicted_s, report.eager_predicted_s),
            getattr(report, "timeline", None))


def _simulate_step(w: Workload, machine: str, label: str) -> tuple[Simulated, Any]:
    """A whole training step, as :func:`autopar.data_parallel` would run it."""
    try:
        got = predict_step(w.eager, w.make_inputs(("cpu",), "full"),
                           None if machine == "auto" else machine,
                           inputs_on=w.explain_inputs_on)
    except Exception as e:
        return Simulated(label, error=_short(e)), None
    return Simulated(label, got.predicted_s, got.eager_s), got.timeline


def save_timeline_png(timeline: Any, path: Path, title: str) -> Path | None:
    """A Gantt PNG of ``timeline`` through ``autopar.report.trace`` (None without a timeline,
    or without matplotlib: then said once, with how to get it)."""
    if timeline is None:
        return None
    try:
        import matplotlib  # noqa: F401  (the plot extra: optional)
    except ImportError:
        _say_no_matplotlib()
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_gantt(timeline, path, title=title)


@functools.cache  # said once a process
def _say_no_matplotlib() -> None:
    print("autopar: timeline pictures skipped: matplotlib is not installed "
          "(pip install 'autopar[plot]')", file=sys.stderr)


# -- one call for the commands and scripts -----------------------------------------------------
def resolve_size(size: str, n_gpus: int) -> str:
    """``"auto"``: the full sizes (benchmarks/README.md) with a GPU, the small ones without."""
    if size == "auto":
        return "full" if n_gpus else "small"
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose auto, {', '.join(SIZES)}")
    return size


def gpus_of(machine: str) -> int:
    """GPUs of a preset, or of this host for "auto"."""
    if machine == "auto":
        return torch.cuda.device_count()
    spec = PRESETS.get(machine)
    if spec is None:
        raise ValueError(f"unknown machine {machine!r} to simulate on: use auto (this host), "
                         f"none, or a preset: {', '.join(sorted(PRESETS))}")
    return spec.n_gpus


def collect(names: Iterable[str] | None = None, *, size: str = "auto",
            variants: Sequence[str] = tuple(VARIANTS), devices: str | Sequence[str] = "auto",
            simulate_on: str | None = None, warmup: int = 2, repeat: int = 10,
            budget_s: float | None = 2.0, progress: Callable[[str], None] | None = None,
            command: Sequence[str] | None = None) -> tuple[Report, dict[str, Any]]:
    """Run the named workloads here (all of them by default) and, with ``simulate_on`` (a
    preset name, or "auto" for this host's model), predict them there too.

    Returns the report and the simulated Timelines by workload name. Workloads this host can't
    run (too few GPUs) appear with their simulated cells only.
    """
    devs = parse_devices(devices)
    n_gpus = sum(d.startswith("cuda") for d in devs)
    size = resolve_size(size, n_gpus)
    sim_gpus = gpus_of(simulate_on) if simulate_on else 0  # checks the name before running
    busy_at = cpu_busy()
    rows = run_suite(select(names, size, n_gpus), variants, devs, size, warmup=warmup,
                     repeat=repeat, budget_s=budget_s, progress=progress)
    others = other_cpu_share(busy_at)  # other processes' share of the cores while timing
    timelines: dict[str, Any] = {}
    if simulate_on:
        by_name = {r.workload: r for r in rows}
        for w in select(names, size, sim_gpus):
            if progress:
                progress(f"{w.name}: simulating on {simulate_on}")
            row = by_name.get(w.name)
            if row is None:
                why = f"needs {w.min_gpus} GPU" + ("s" if w.min_gpus > 1 else "")
                row = by_name[w.name] = Row(w.name, w.title, w.family,
                                            {v: Cell(skipped=why) for v in variants},
                                            hand_goal=w.hand_goal)
            row.simulated, timelines[w.name] = simulate(w, simulate_on)
        order = list(WORKLOADS)
        rows = sorted(by_name.values(), key=lambda r: order.index(r.workload))
    machine = {**fingerprint(command), "others_share": round(others, 3)}
    report = Report(machine, size, list(devs), list(variants), rows)
    return report, timelines


def timeline_machine(report: Report, name: str) -> str:
    row = next((r for r in report.rows if r.workload == name), None)
    return row.simulated.machine if row and row.simulated else "?"


def write_report(report: Report, out: Path, stem: str | None = None,
                 timelines: dict[str, Any] | None = None) -> list[Path]:
    """Write ``<stem>.json`` and ``<stem>.md`` (default stem ``<machine>-<date>``) under
    ``out``, and a timeline PNG per simulated workload where ``autopar.report.trace`` can draw
    one."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = stem or f"{machine_label(report.machine)}-{report.machine['date'][:10]}"
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(report.to_json(), indent=1) + "\n")
    paths[1].write_text(report.to_markdown())
    for name, timeline in (timelines or {}).items():
        png = save_timeline_png(timeline, out / f"timeline-{name.replace('/', '_')}.png",
                                title=f"{name} on {timeline_machine(report, name)}")
        if png is not None:
            paths.append(png)
    return paths
