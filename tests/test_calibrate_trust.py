"""Calibration that can be trusted: spreads, a busy host said, a good profile kept."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import autopar.machine.calibrate as calibrate_mod
from autopar.cli import app
from autopar.machine.detect import detect
from autopar.machine.host import host_info, load_profile, profile_path
from autopar.machine.model import fingerprint_of


@pytest.fixture
def host(monkeypatch, tmp_path):
    """A cache of its own, quick mode as short as smoke, and a quiet host unless told."""
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AUTOPAR_NO_MEASURE", "0")  # the suite plans with defaults elsewhere
    monkeypatch.setitem(calibrate_mod.MODES, "quick", calibrate_mod.MODES["smoke"])
    monkeypatch.setattr(calibrate_mod, "BUSY_SPREAD", 100.0)  # smoke numbers are rough
    state = {"load": 0.0, "others": 0.0}
    monkeypatch.setattr(calibrate_mod, "_load_per_core", lambda: state["load"])
    monkeypatch.setattr(calibrate_mod, "other_cpu_share", lambda start: state["others"])
    monkeypatch.setattr(calibrate_mod, "_reference_s", lambda: 1e-3)
    return state


def test_a_stable_measurement_saves_with_its_spreads(host):
    profile = detect(calibrate=True).profile
    saved = load_profile(profile_path(fingerprint_of(host_info())))
    assert saved.created == profile.created and saved.busy == ""
    spread = saved.quality["spread"]
    assert "cpu: dispatch overhead" in spread and all(v >= 0 for v in spread.values())


def test_a_busy_host_keeps_the_earlier_profile_and_says_so(host, capsys):
    good = detect(calibrate=True).profile
    path = profile_path(fingerprint_of(host_info()))
    before = path.read_text()
    host["load"] = 3.0
    kept = detect(calibrate=True).profile
    err = capsys.readouterr().err
    assert "busy" in err and "load average 3.00 per core" in err and "kept" in err
    assert "--force" in err
    assert path.read_text() == before and kept.created == good.created
    forced = detect(calibrate=True, force=True).profile
    assert "load average" in forced.busy
    assert "load average" in load_profile(path).busy


def test_a_busy_first_profile_is_saved_with_a_warning(host, capsys):
    host["load"] = 3.0
    profile = detect(calibrate=True).profile
    assert "may be slow" in capsys.readouterr().err
    assert load_profile(profile_path(fingerprint_of(host_info()))).busy == profile.busy


def test_a_competitor_running_all_along_is_a_busy_host(host, capsys):
    """Neither the load before nor the reference loop's drift sees a process that competes
    from start to end: the cores' busy time less this process's own does."""
    good = detect(calibrate=True).profile
    host["others"] = 0.9
    kept = detect(calibrate=True).profile
    err = capsys.readouterr().err
    assert "other processes used 90% of the cores while measuring" in err and "kept" in err
    assert kept.created == good.created


def test_other_processes_share_is_read_from_the_host():
    """A process spinning beside this one (which sleeps) shows as others' share of the cores;
    this process's own work does not."""
    import os
    import subprocess
    import sys
    import time

    start = calibrate_mod.cpu_busy()
    if start is None:
        pytest.skip("no /proc/stat")
    time.sleep(0.3)
    if (idle := calibrate_mod.other_cpu_share(start)) > 0.25:  # (a test run beside this one)
        pytest.skip(f"other processes use {idle:.0%} of the cores while this one sleeps")
    start = calibrate_mod.cpu_busy()
    sum(range(3_000_000))  # own work
    assert calibrate_mod.other_cpu_share(start) < 0.5
    spinner = subprocess.Popen([sys.executable, "-c",
                                "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass"])
    time.sleep(0.2)  # the interpreter has started
    start = calibrate_mod.cpu_busy()
    time.sleep(0.6)
    share = calibrate_mod.other_cpu_share(start)
    spinner.wait()
    assert share > 0.5 / (os.cpu_count() or 1), share  # one of the cores was someone else's


def test_a_drifting_reference_loop_is_a_busy_host(host, monkeypatch):
    times = iter([1.0, 1.6])
    monkeypatch.setattr(calibrate_mod, "_reference_s", lambda: next(times))
    profile = calibrate_mod.calibrate("smoke")
    assert "60% slower at the end" in profile.busy


def test_show_prints_each_steps_spread_and_when(host):
    detect(calibrate=True)
    result = CliRunner().invoke(app, ["calibrate", "--show"])
    assert result.exit_code == 0, result.output
    assert "spread" in result.stdout and "measured 20" in result.stdout
    assert "cpu: dispatch overhead" in result.stdout and "host quiet" in result.stdout


# -- the host's memory curves, as a program meets memory (benchmarks/NOTES.md, 2026-12-05 (g))
def _timed_by_name(seconds: dict[str, float], on_one: dict[str, float] | None = None):
    """A Timer that runs ``fn`` twice and says ``seconds[its name]``, or ``on_one[its name]``
    for operands of one float: which op each curve point was read from."""
    def timer(fn):
        fn()
        fn()
        name = getattr(fn, "__name__", "")
        ops = getattr(fn, "__self__", None)
        if on_one is not None and getattr(ops, "_n", None) == 1:
            return on_one[name]
        return seconds.get(name, 1e-6)
    return timer


def test_streamed_host_curves_take_write_from_fresh_memory_alone_less_each_ops_own_cost():
    """Streamed, ``write`` is ``full``'s time alone (not add less sum), and each curve is its
    op's time less that op's on one float (its dispatch and bookkeeping: ``full``'s 1.45 us
    priced a 5x10x5 matmul at 3.5 us against 1.9 on an H100's host), never under a tenth."""
    n = 1 << 12
    timer = _timed_by_name({"sum": 4e-6, "add": 5e-6, "fresh": 3e-6, "exp": 8e-6},
                           on_one={"sum": 0.5e-6, "fresh": 1.5e-6, "exp": 7.5e-6})
    streamed = calibrate_mod._curves(timer, "cpu", (), (n,), 1e12, 1.0, streamed=True)
    assert streamed["read"] == ((8.0 * n, pytest.approx(8.0 * n / 3.5e-6)),)
    assert streamed["write"] == ((4.0 * n, pytest.approx(4.0 * n / 1.5e-6)),)
    assert streamed["exp"] == ((float(n), pytest.approx(n / 0.8e-6)),)  # a tenth of 8 us
    plain = calibrate_mod._curves(timer, "cpu", (), (n,), 1e12, 1.0)  # as a GPU's are
    assert plain["write"] == ((4.0 * n, pytest.approx(4.0 * n / 1e-6)),)  # add less sum


def test_streamed_operands_turn_over_distinct_arrays_and_hold_fresh_outputs(monkeypatch):
    import weakref

    n = 1 << 10
    monkeypatch.setattr(calibrate_mod, "HELD_BYTES", 3 * 4 * n)  # three outputs held
    ops = calibrate_mod._Operands(n, "cpu", streamed=True)
    sums = [float(ops.sum()) for _ in range(4)]
    assert len(set(sums)) == 4  # four different arrays, not one in cache
    one = calibrate_mod._Operands(n, "cpu", streamed=False)
    assert len({float(one.sum()) for _ in range(3)}) == 1
    ops.fresh()
    first = weakref.ref(ops._held[0])
    ops.fresh()
    assert first() is not None  # alive while the "call" goes on
    ops.fresh()  # the third: the call's values let go together
    assert first() is None and not ops._held
