"""benchmarks/scale.py on the CPU: its workloads equal eager on CPU workers, and every GPU count
this host lacks appears as a row predicted on its preset, labelled as not run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import autopar

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("benchmarks_scale", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_tiled_cholesky_is_the_factor_of_the_whole_matrix(scale):
    case = scale.cholesky_case(1, "small")
    (a,) = case.inputs("cpu", True)
    n, tile = scale.CHOLESKY["small"]
    tiles = case.fn(a)
    assert len(tiles) == (n // tile) * (n // tile + 1) // 2
    assert all(t.shape == (tile, tile) for t in tiles)
    torch.testing.assert_close(tiles, scale.lower_tiles(torch.linalg.cholesky(a), tile),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tiles[0] @ tiles[0].T, a[:tile, :tile], rtol=1e-4, atol=1e-4)


def test_the_chains_are_one_per_gpu_with_their_own_data(scale):
    case = scale.chains_case(3, "small")
    xs, ws = case.inputs("cpu", True)
    n, depth = scale.CHAINS["small"]
    assert len(xs) == len(ws) == 3 and xs[0].shape == (n, n)
    assert not torch.equal(xs[0], xs[1]) and not torch.equal(ws[0], ws[2])
    out = case.fn(xs, ws)
    expected = xs[2] @ torch.linalg.matrix_power(ws[2], depth)
    torch.testing.assert_close(out[2], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["chains", "ensemble4", "cholesky"])
def test_workloads_equal_eager_on_two_cpu_workers(scale, name, fresh_dynamo):
    case = scale.CASES[name](2, "small")
    args = case.inputs("cpu", True)
    compiled = autopar.compile(case.fn, devices="cpu:0,cpu:1")
    scale.check_close(compiled(*args), case.fn(*args), case.rtol, case.atol, name)


def test_measure_case_fills_a_measured_row_with_the_plans_prediction(scale, fresh_dynamo):
    case = scale.cholesky_case(2, "small")
    row = scale.ScaleRow("cholesky", case.scaling, 2, scale.NOT_RUN, "h200x2")
    scale.measure_case(case, ["cpu:0", "cpu:1"], 3, row, home="cpu")
    assert row.status == "measured"
    assert row.eager_s > 0 and row.autopar_s > 0 and row.host_s > 0
    assert row.autopar_p10_s <= row.autopar_s <= row.autopar_p90_s
    assert row.host_error == pytest.approx((row.host_s - row.autopar_s) / row.autopar_s)
    assert row.preset_error is None  # nothing predicted on the preset for this row


def test_a_wrong_result_is_an_error_not_a_time(scale, fresh_dynamo):
    case = scale.cholesky_case(1, "small")
    wrong = scale.Case(case.name, case.scaling, case.fn, case.inputs,
                       reference=lambda args: [2 * t for t in case.reference(args)])
    row = scale.ScaleRow("cholesky", "strong", 1, scale.NOT_RUN, "h200x2")
    with pytest.raises(AssertionError, match="cholesky eager"):
        scale.measure_case(wrong, ["cpu:0"], 3, row, home="cpu")
    assert row.autopar_s is None and row.status == scale.NOT_RUN


def test_rows_this_host_lacks_are_simulated_on_the_matching_preset(scale):
    rows = scale.collect(size="small", run_here=False)
    assert [(r.workload, r.gpus) for r in rows] == [
        (w, g) for w in ("chains", "ensemble4", "cholesky") for g in (1, 2, 4, 8)]
    assert {r.status for r in rows} == {"simulated, not run"}
    assert [r.preset for r in rows[:4]] == ["h200x2", "h200x2", "h200x4", "h200x8"]
    assert all(r.preset_s > 0 and r.autopar_s is None and r.efficiency is None for r in rows)
    assert all(r.notes == [] for r in rows)
    ones = [r for r in rows if r.gpus == 1]
    assert all(r.preset_efficiency == pytest.approx(1.0) for r in ones)
    chains = {r.gpus: r for r in rows if r.workload == "chains"}
    assert chains[8].preset_efficiency == pytest.approx(chains[1].preset_s / chains[8].preset_s)
    assert chains[1].scaling == "weak" and rows[-1].scaling == "strong"


def test_main_writes_the_simulated_rows_as_json(scale, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU host main() measures: see tests/test_scale_gpu.py")
    out = tmp_path / "scale.json"
    assert scale.main(["--size", "small", "--only", "chains", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "autopar-scale/1" and doc["size"] == "small"
    assert [(r["gpus"], r["status"], r["preset"]) for r in doc["rows"]] == [
        (1, "simulated, not run", "h200x2"), (2, "simulated, not run", "h200x2"),
        (4, "simulated, not run", "h200x4"), (8, "simulated, not run", "h200x8")]
    assert "| chains (weak) | 8 | simulated, not run | — | — | — | — |" in doc["markdown"]
    assert "simulator accuracy: nothing measured on this host" in doc["goal_lines"]
    assert "chains at 4 GPUs" in capsys.readouterr().out


def test_efficiency_weak_and_strong(scale):
    assert scale.efficiency("weak", 4, 10.0, 10.5) == pytest.approx(10 / 10.5)
    assert scale.efficiency("strong", 4, 10.0, 2.5) == pytest.approx(1.0)
    assert scale.efficiency("strong", 4, None, 2.5) is None


def test_goals_say_what_was_measured_and_what_only_predicted(scale):
    row = scale.ScaleRow
    rows = [row("chains", "weak", 1, "measured", "h200x2", preset_s=1.0, autopar_s=1.0,
                host_s=1.05),
            row("chains", "weak", 2, "measured", "h200x2", preset_s=1.0, autopar_s=1.25,
                host_s=1.0),
            row("chains", "weak", 4, "simulated, not run", "h200x4", preset_s=1.2),
            row("chains", "weak", 8, "simulated, not run", "h200x8", preset_s=1.1)]
    one = rows[0]
    for r in rows:
        r.efficiency = scale.efficiency("weak", r.gpus, one.autopar_s, r.autopar_s)
        r.preset_efficiency = scale.efficiency("weak", r.gpus, one.preset_s, r.preset_s)
    lines = scale.goals(rows)
    assert lines == [
        "chains at 4 GPUs: efficiency 83.3% predicted on h200x4, not measured (goal >= 90%): "
        "would be missed",
        "chains at 8 GPUs: efficiency 90.9% predicted on h200x8, not measured (goal >= 85%): "
        "would be met",
        "chains on 2 GPUs: simulator (this host's model) off by -20.0% (goal within 15%): MISSED",
        "chains on 2 GPUs: simulator (h200x2) off by -20.0% (goal within 15%): MISSED",
    ]
