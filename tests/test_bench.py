"""The timing harness, its reports, and the demo and bench commands."""

from __future__ import annotations

import json
import re

import pytest
import torch
import typer
from typer.testing import CliRunner

from autopar.bench import harness as bench
from autopar.bench.harness import Cell, Report, Row, Simulated, run_suite
from autopar.bench.measure import Stats, measure, measure_side_by_side
from autopar.bench.workloads import Workload
from autopar.cli.commands.bench import bench as bench_command
from autopar.cli.commands.demo import demo as demo_command


class FakeClock:
    """Returns the given instants in turn."""

    def __init__(self, *instants: float) -> None:
        self.instants = list(instants)

    def __call__(self) -> float:
        return self.instants.pop(0)


def test_measure_on_a_fake_clock():
    calls = []
    clock = FakeClock(0, 1, 1, 3, 3, 6, 6, 10, 10, 15)  # samples of 1, 2, 3, 4, 5 s
    stats = measure(lambda x: calls.append(x), 7, warmup=2, repeat=5, inner=1,
                    sync_devices=(), clock=clock)
    assert stats == Stats(median=3, p10=pytest.approx(1.4), p90=pytest.approx(4.6), n=5)
    assert calls == [7] * 7  # 2 warm-up calls, then 5 timed


def test_measure_divides_by_inner_calls():
    clock = FakeClock(0, 4, 4, 12)  # 2 samples of 2 calls: 4 s and 8 s
    stats = measure(lambda: None, warmup=0, repeat=2, inner=2, sync_devices=(), clock=clock)
    assert (stats.median, stats.n) == (3.0, 2)


def test_measure_chooses_inner_calls_for_short_functions():
    calls = []
    clock = FakeClock(0, 1e-4, *[t for i in range(3) for t in (i, i + 0.001)])
    stats = measure(lambda: calls.append(1), warmup=1, repeat=3, sync_devices=(),
                    min_sample_s=1e-3, clock=clock)
    assert len(calls) == 1 + 1 + 3 * 10  # warm-up, the probe, 3 samples of 10 calls
    assert stats.median == pytest.approx(1e-4)


def test_short_samples_are_taken_until_the_minimum_total_time():
    calls = []
    clock = FakeClock(0, 1e-4, *[t for i in range(8) for t in (i, i + 0.001)])
    stats = measure_side_by_side({"f": (lambda: calls.append(1), ())}, warmup=0, repeat=3,
                                 sync_devices=(), min_sample_s=1e-3, min_total_s=0.008,
                                 clock=clock)["f"]
    assert stats.n == 8 and len(calls) == 1 + 8 * 10  # the probe, 8 samples of 10 calls
    clock = FakeClock(0, 1e-4, *[t for i in range(4) for t in (i, i + 0.001)])
    capped = measure_side_by_side({"f": (lambda: None, ())}, warmup=0, repeat=3,
                                  sync_devices=(), min_sample_s=1e-3, min_total_s=0.008,
                                  budget_s=0.004, clock=clock)["f"]
    assert capped.n == 4  # the budget still caps it


def test_side_by_side_takes_one_sample_of_each_per_round():
    order = []

    def flaky():
        order.append("b")
        if order.count("b") == 3:
            raise RuntimeError("out of memory")

    ticks = iter(range(100))
    out = measure_side_by_side({"a": (order.append, ("a",)), "b": (flaky, ())}, warmup=1,
                               repeat=3, inner=1, sync_devices=(), clock=lambda: next(ticks))
    assert order == ["a", "b", "a", "b", "a", "b", "a"]  # warm-ups, then rounds; b fails
    assert out["a"] == Stats(1, 1, 1, 3)
    assert isinstance(out["b"], RuntimeError)


def test_stats_percentiles():
    s = Stats.of([5.0, 1.0, 3.0, 2.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0])
    assert (s.median, s.p10, s.p90, s.n) == (6.0, 2.0, 10.0, 11)
    assert Stats.of([2.5]) == Stats(2.5, 2.5, 2.5, 1)
    with pytest.raises(ValueError):
        Stats.of([])


def _inputs(devices, size):
    return (torch.arange(1.0, 5.0),)


def _double(x):
    return x * 2


def _fake(name="fake", **kw) -> Workload:
    return Workload(name, "x * 2", "test", _inputs, _double, **kw)


TIMING = {"warmup": 1, "repeat": 3, "budget_s": 0.05}


def test_failing_variants_become_cells_and_the_suite_goes_on(monkeypatch):
    def no_compiler(w, ctx, inputs):
        raise RuntimeError("torch.compile is unavailable here\nmore detail")

    monkeypatch.setitem(bench.VARIANTS, "compile", no_compiler)
    raising = _fake("raising", hand=lambda x: 1 / 0)
    wrong = _fake("wrong", hand=lambda x: x * 3)
    needs = _fake("needs", hand=_double, hand_gpus=torch.cuda.device_count() + 1)
    rows = run_suite([raising, wrong, needs], ("eager", "hand", "compile"), "cpu:0", "small",
                     **TIMING)
    assert [r.workload for r in rows] == ["raising", "wrong", "needs"]
    for row in rows:
        assert row.cells["eager"].ok and row.cells["eager"].median_s > 0
        assert row.cells["compile"].error == "RuntimeError: torch.compile is unavailable here"
    assert rows[0].cells["hand"].error == "ZeroDivisionError: division by zero"
    assert rows[1].cells["hand"].error.startswith("wrong result: ")
    assert rows[2].cells["hand"].skipped.startswith("needs ")
    assert rows[0].cells["eager"].devices == "cpu"


def _two_chains_inputs(devices, size):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.rand(384, 384, generator=g) / 384 for _ in range(2))


def _two_chains(a, b):
    for _ in range(3):
        a, b = a @ a, b @ b
    return a, b


def test_the_autopar_cell_says_where_autopar_ran(monkeypatch):
    """``plain`` where calls ran as the function itself; else the devices its plans used
    (where the plan measured faster than eager in its trial: a fake clock here)."""
    from autopar import choose

    (row,) = run_suite([_fake()], ("eager", "autopar"), "cpu:0", "small", **TIMING)
    assert row.cells["autopar"].devices == "plain"

    def clock() -> float:  # trial calls alternate eager, autopar: eager takes 2 s, autopar 1
        clock.reads += 1
        if clock.reads % 2 == 0:
            clock.now += 2.0 if (clock.reads // 2) % 2 else 1.0
        return clock.now
    clock.reads, clock.now = 0, 0.0
    monkeypatch.setattr(choose, "_clock", clock)
    chains = Workload("chains", "two chains", "test", _two_chains_inputs, _two_chains)
    (row,) = run_suite([chains], ("autopar",), "cpu:0,cpu:1", "small", **TIMING)
    assert row.cells["autopar"].devices == "cpu:0,cpu:1"


def _folds(x):
    a1 = torch.tensor(10.0)
    return (x @ x) * a1 + a1 ** 2


def _square_inputs(devices, size):
    return (torch.arange(64.0).reshape(8, 8) / 64,)


def test_autopar_is_timed_once_its_trials_are_over():
    """A folded function's calls are timed both ways for a while (autopar's trial); the
    harness calls it until that is decided, before its samples."""
    import autopar

    w = Workload("folds", "folded constant", "test", _square_inputs, _folds)
    (x,) = _square_inputs(("cpu:0",), "small")
    fresh = autopar.compile(_folds, devices="cpu:0")
    fresh(x)
    assert fresh.trials  # a trial starts at the first call
    fn, _ = bench.prepare_variant(w, "autopar", bench.Context(("cpu:0",), "small"),
                                  _folds(x))
    assert not fn.trials


def test_a_failing_eager_fails_the_whole_row():
    broken = Workload("broken", "?", "test", _inputs, lambda x: x.reshape(3))
    (row,) = run_suite([broken], ("eager", "hand"), "cpu:0", "small", **TIMING)
    assert all(c.error.startswith("eager failed: RuntimeError") for c in row.cells.values())


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match=r"unknown variant.*valid: eager, hand"):
        run_suite([_fake()], ("eager", "fast"), "cpu:0")


def _report() -> Report:
    rows = [
        Row("W1", "slicing", "scalars", {
            "eager": Cell(5e-5, 4e-5, 6e-5, 10, "cuda:0"),
            "hand": Cell(1.2e-5, 1e-5, 1.5e-5, 10, "cuda:0"),
            "compile": Cell(error="Unsupported: graph break"),
            "autopar": Cell(1.25e-5, 1.1e-5, 1.4e-5, 10, "cpu:0,cuda:0,cuda:1")},
            Simulated("h200x2", 1.3e-5, 5.6e-5), hand_goal=True),
        Row("two_tower", "towers", "users", {
            "eager": Cell(0.01, 0.009, 0.011, 5, "cuda:0"),
            "hand": Cell(skipped="needs 2 GPUs"),
            "compile": Cell(0.009, 0.009, 0.01, 5, "cuda:0"),
            "autopar": Cell(0.0106, 0.01, 0.011, 5, "cpu:0,cuda:0")},
            Simulated("h200x2", error="explain unavailable")),
    ]
    machine = bench.fingerprint(["autopar", "bench"])
    return Report(machine, "full", ["cpu:0", "cuda:0", "cuda:1"],
                  ["eager", "hand", "compile", "autopar"], rows)


def test_report_json_round_trip():
    report = _report()
    text = json.dumps(report.to_json())
    back = Report.from_json(json.loads(text))
    assert back == report
    assert json.loads(text)["schema"] == bench.SCHEMA
    assert {"host", "cpu_model", "gpus", "torch", "date", "command"} <= set(report.machine)
    with pytest.raises(ValueError, match="schema"):
        Report.from_json({"schema": "something else"})


def test_report_views_and_goals():
    report = _report()
    assert report.rows[0].speedup("autopar") == pytest.approx(4.0)
    assert report.rows[0].best() == "hand"
    assert report.misses() == [
        "two_tower: autopar 10.6 ms is more than 5% slower than eager 10 ms"]
    md = report.to_markdown()
    assert ("| W1 | 50 µs | 12 µs ×4.17 | error (1) | 12.5 µs ×4.00 | cpu:0 cuda:0,1 "
            "| 56 µs → 13 µs ×4.31 |") in md
    assert "| two_tower | 10 ms | needs 2 GPUs | 9 ms ×1.11 | 10.6 ms ×0.94 |" in md
    assert "(1) W1 compile: Unsupported: graph break" in md
    assert "(2) two_tower simulated: explain unavailable" in md
    assert "h200x2 (simulated): eager → autopar" in md
    assert "`autopar bench`" in md
    grid, notes = report.grid()
    assert len(grid) == 2 and len(notes) == 2


def test_hand_goal_applies_only_where_set():
    report = _report()
    report.rows[0].cells["autopar"].median_s = 13e-6
    assert report.misses()[0] == "W1: autopar 13 µs is not within 5% of hand-tuned 12 µs"
    report.rows[0].hand_goal = False
    assert [m for m in report.misses() if m.startswith("W1")] == []


def test_machine_label():
    assert bench.machine_label({"gpus": ["NVIDIA H200", "NVIDIA H200"]}) == "2xH200"
    assert bench.machine_label({"gpus": [], "cores": 2}) == "cpu2"


@pytest.fixture
def cli(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPAR_NO_MEASURE", "1")  # no calibration inside tests
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    app = typer.Typer()
    app.command("demo")(demo_command)
    app.command("bench")(bench_command)
    return app


def test_demo_prints_json(cli, tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(cli, ["demo", "--json", "-w", "W2", "--variants",
                                      "eager,hand,autopar", "--machine", "h200x2",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = Report.from_json(json.loads(result.stdout))
    (row,) = report.rows
    assert row.workload == "W2"
    assert row.cells["eager"].ok and row.cells["hand"].ok
    assert row.cells["autopar"].ok or row.cells["autopar"].error
    assert row.simulated is not None and row.simulated.machine == "h200x2"
    label = bench.machine_label(report.machine)
    assert (out / f"demo-{label}.json").exists() and (out / f"demo-{label}.md").exists()


def test_bench_command_writes_results(cli, tmp_path):
    result = CliRunner().invoke(cli, ["bench", "W1", "--size", "small", "--variants",
                                      "eager,hand", "--devices", "cpu:0", "--repeat", "3",
                                      "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [r["workload"] for r in data["rows"]] == ["W1"]
    assert len(list(tmp_path.glob("*.json"))) == 1 and len(list(tmp_path.glob("*.md"))) == 1


def test_a_busy_host_is_said_beside_the_table(cli, monkeypatch):
    """Other processes' share of the cores while the workloads were timed is in the report;
    over ``BUSY_OTHERS`` the table says the times are not an idle host's (on a shared 2-core
    host every W1 variant measured 8 ms, ×1.00, with nothing said)."""
    from rich.console import Console

    monkeypatch.setattr(bench, "other_cpu_share", lambda start: 0.5)
    result = CliRunner().invoke(cli, ["bench", "W1", "--size", "small", "--variants",
                                      "eager,hand", "--devices", "cpu:0", "--repeat", "3",
                                      "--json"])
    assert result.exit_code == 0, result.output
    report = Report.from_json(json.loads(result.stdout))
    assert report.machine["others_share"] == 0.5
    console = Console(record=True, width=200)
    console.print(report.to_rich())
    assert "this host was busy: other processes used 50% of its cores" in console.export_text()
    report.machine["others_share"] = 0.1
    assert report.busy() == ""


def test_bench_command_rejects_unknown_workloads(cli):
    result = CliRunner().invoke(cli, ["bench", "W9", "--json"])
    assert result.exit_code == 2
    assert "unknown workload" in result.stderr


def test_a_variant_cannot_change_the_thread_count_of_the_next(monkeypatch):
    def one_thread(w, ctx, inputs):
        torch.set_num_threads(1)
        return w.eager, inputs

    monkeypatch.setitem(bench.VARIANTS, "compile", one_thread)
    before = torch.get_num_threads()
    run_suite([_fake()], ("compile",), "cpu:0", **TIMING)
    assert torch.get_num_threads() == before


def test_notes_are_shared_by_identical_errors():
    report = _report()
    report.rows[1].cells["compile"] = Cell(error="Unsupported: graph break")
    grid, notes = report.grid()
    assert grid[1][3] == "error (1)"
    assert notes[0] == "(1) W1 compile, two_tower compile: Unsupported: graph break"


def _load_run_all(monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "run_all.py"
    spec = importlib.util.spec_from_file_location("benchmarks_run_all", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_run_all_refreshes_the_readme_block(tmp_path, monkeypatch):
    run_all = _load_run_all(monkeypatch)
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:cpu:start -->\nold\n<!-- results:cpu:end -->\nend\n")
    assert run_all.update_readme(readme, "cpu", "| new | table |")
    assert readme.read_text() == ("intro\n<!-- results:cpu:start -->\n| new | table |\n"
                                  "<!-- results:cpu:end -->\nend\n")
    assert not run_all.update_readme(readme, "2xH200", "x")
    assert run_all.readme_key({"gpus": ["NVIDIA H200"] * 2}) == "2xH200"
    assert run_all._parse_json('noise\n{"a": 1}\n') == {"a": 1}
    doc = {"label": "cpu2", "date": "2026-11-30", "families": {
        "workloads": {"result": _report().to_json()},
        "cost_model": {"error": "exit status 1"},
        "planning_time": {"result": {"markdown": "| planning |"}}}}
    md = run_all.to_markdown(doc)
    assert "| W1 |" in md and "not measured: exit status 1" in md and "| planning |" in md


def test_demo_refuses_an_unknown_machine(cli):
    result = CliRunner().invoke(cli, ["demo", "--json", "-w", "W2", "--machine", "h900x3"])
    assert result.exit_code == 2
    assert "unknown machine 'h900x3'" in result.stderr


def test_run_all_reads_both_json_conventions(tmp_path, monkeypatch):
    run_all = _load_run_all(monkeypatch)
    printing = tmp_path / "printing.py"
    printing.write_text("print('{\"ok\": 1}')\n")
    writing = tmp_path / "writing.py"
    writing.write_text("import sys, pathlib\n"
                       "pathlib.Path(sys.argv[sys.argv.index('--json') + 1]).write_text('[2]')\n")
    failing = tmp_path / "failing.py"
    failing.write_text("raise SystemExit(3)\n")
    assert run_all.run_family("p", run_all.Family(str(printing)), [], 60)["result"] == {"ok": 1}
    written = run_all.run_family("w", run_all.Family(str(writing), json_to_file=True), [], 60)
    assert written["result"] == [2]
    assert run_all.run_family("f", run_all.Family(str(failing)), [], 60)["error"].startswith(
        "exit status 3")


def test_every_family_of_run_all_takes_json_as_run_all_passes_it(monkeypatch):
    """run_all passes ``--json PATH`` to file-writing families and a bare ``--json`` to the
    others: each script must declare that option (as ``--json PATH`` where it writes a file)."""
    run_all = _load_run_all(monkeypatch)
    for name, family in run_all.FAMILIES.items():
        source = (run_all.HERE / family.script).read_text()
        assert '"--json"' in source, f"{family.script} has no --json option"
        takes_path = re.search(r'"--json",[^)]*type=Path', source) is not None
        assert takes_path == family.json_to_file, f"{name}: --json PATH or a flag, not both"


def _models_py(monkeypatch):
    """benchmarks/models.py as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "models.py"
    spec = importlib.util.spec_from_file_location("benchmarks_models", path)
    models = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, models)
    spec.loader.exec_module(models)
    return models


@pytest.mark.usefixtures("fresh_dynamo")
def test_varying_length_rows_run_every_variant_in_one_process(monkeypatch):
    """benchmarks/models.py's ``infer-varlen``: the variants' calls interleaved in one process,
    each checked against eager's; each compiled variant's model has a ``forward`` of its own
    code, so no entry of dynamo's lands on the model class's own ``forward``."""
    pytest.importorskip("transformers")
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from autopar.bench.models import MODELS

    models = _models_py(monkeypatch)
    monkeypatch.setattr(models, "VARLEN_CALLS", 6)
    row = models.run_varlen("gpt2", "infer-varlen", "tiny", ["eager", "compile", "autopar"],
                            2, 12)
    for name in ("eager", "compile", "autopar"):
        cell = row["variants"][name]
        assert cell.get("pass"), (name, cell)
        assert len(cell["calls_ms"]) == 6 and cell["median_s"] > 0
    forward = type(MODELS["gpt2"].make("tiny")).forward
    assert _debug_get_cache_entry_list(forward.__code__) == []


def test_the_generate_check_tells_a_near_tie_from_a_wrong_token(monkeypatch):
    """benchmarks/models.py's ``generate`` rows: tokens that part where eager's top two logits
    are within ``NEAR_TIE`` of each other, and the variant's logits within that of eager's,
    are a tie broken by summation order (a note); logits that drifted are a failure."""
    from types import SimpleNamespace

    models = _models_py(monkeypatch)

    def generated(tokens, scores):  # prompt of 2, then 2 steps over a vocabulary of 3
        return SimpleNamespace(sequences=torch.tensor([tokens]),
                               scores=[torch.tensor([s]) for s in scores])
    eager = generated([1, 2, 1, 0], [[0.0, 5.0001, 5.0], [4.0, 1.0, 3.0]])
    tie = generated([1, 2, 2, 0], [[0.0, 5.0, 5.0001], [4.0, 1.0, 3.0]])
    wrong = generated([1, 2, 2, 0], [[0.0, 5.0, 9.0], [4.0, 1.0, 3.0]])
    assert models._tokens_differ(eager, eager, prompt=2) is None
    said = models._tokens_differ(tie, eager, prompt=2)
    assert said.startswith("near tie: tokens differ from eager's, first at [0, 2]: eager's top "
                           "two logits there 0.0001 apart (largest 5)")
    said = models._tokens_differ(wrong, eager, prompt=2)
    assert not said.startswith("near tie") and said.endswith("within 4 of eager's")
