"""Machine model: presets, profiles as JSON, unusable files, discovery without measuring."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

import autopar.machine.calibrate as calibrate_mod
from autopar.machine.detect import detect, load_machine
from autopar.machine.host import host_info, load_profile, profile_path, save_profile
from autopar.machine.model import (
    SCHEMA_VERSION,
    Device,
    DeviceProfile,
    LinkProfile,
    Machine,
    Profile,
    ProfileError,
    default_profile,
    fingerprint_of,
    link_key,
)
from autopar.machine.presets import PRESETS, preset

_REAL_CALIBRATE = calibrate_mod.calibrate


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets an empty cache directory, and measuring is refused unless a test allows
    it: no test may calibrate this host by accident."""
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AUTOPAR_NO_MEASURE", raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("a test tried to calibrate this host")

    monkeypatch.setattr(calibrate_mod, "calibrate", refuse)
    return tmp_path / "cache"


# -- presets ---------------------------------------------------------------------------------
def test_preset_names_and_devices():
    assert set(PRESETS) >= {"h200x2", "h200x4", "h200x8", "a100x4-pcie", "cpu-only"}
    m = preset("h200x2")
    assert [d.name for d in m.devices] == ["cpu:0", "cpu:1", "cuda:0", "cuda:1"]
    assert [d.name for d in m.cpus] == ["cpu:0", "cpu:1"]
    assert [d.name for d in m.gpus] == ["cuda:0", "cuda:1"]
    assert m.cores == 32 and m.cpu_threads == 16
    assert m.has_peer("cuda:0", "cuda:1") and m.has_peer("cuda:1", "cuda:0")
    assert m.fingerprint == "preset-h200x2"
    assert m.profile_path is None
    assert len(preset("h200x8").gpus) == 8
    four = preset("h200x4")
    assert [d.name for d in four.gpus] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert all(four.has_peer(a.name, b.name) for a in four.gpus for b in four.gpus if a != b)
    assert four.profile.device("cuda:3") == m.profile.device("cuda:0")  # the same H200s
    assert preset("cpu-only").gpus == ()


def test_preset_h200x2_carries_measured_figures():
    p = preset("h200x2").profile
    assert p.device("cuda:1").launch_s == pytest.approx(7.4e-6)
    assert p.link("cpu:0", "cuda:0", pinned=True).bandwidth == pytest.approx(55e9)
    assert p.link("cuda:0", "cpu:1", pinned=True).bandwidth == pytest.approx(54e9)
    assert p.link("cuda:0", "cuda:1").bandwidth == pytest.approx(367e9)
    # pageable GPU-to-host copies collapse to MEASURED.md's 1.5 GB/s past 32 MB
    d2h = p.link("cuda:0", "cpu:0", pinned=False)
    assert 2**26 / d2h.time(2**26) == pytest.approx(1.5e9, rel=0.1)
    assert 2**24 / d2h.time(2**24) > 10e9


def test_preset_cpu_workers_option():
    m = preset("cpu-only", cpu_workers=4)
    assert [d.name for d in m.devices] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    assert m.cpu_threads == 2  # 8 cores shared by 4 workers
    assert preset("h200x2", cpu_workers=1).cpu_threads == 32
    with pytest.raises(ValueError, match="at least one CPU worker"):
        preset("cpu-only", cpu_workers=0)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown machine preset 'h100'.*a100x4-pcie.*h200x2"):
        preset("h100")


def test_a100_pcie_peer_pairs_are_partial():
    m = preset("a100x4-pcie")
    assert m.has_peer("cuda:0", "cuda:1") and m.has_peer("cuda:3", "cuda:2")
    assert not m.has_peer("cuda:0", "cuda:2")
    p = m.profile
    # without peer access a copy is staged through the host: slower
    assert p.link("cuda:0", "cuda:2").time(2**26) > 2 * p.link("cuda:0", "cuda:1").time(2**26)


def test_every_preset_has_every_link():
    for name in PRESETS:
        m = preset(name)
        for a in m.gpus:
            for pinned in (True, False):
                assert m.profile.link("cpu:0", a.name, pinned).bandwidth > 0
                assert m.profile.link(a.name, "cpu:1", pinned).bandwidth > 0
            for b in m.gpus:
                if a != b:
                    assert m.profile.link(a.name, b.name).bandwidth > 0


def test_device_lookup_and_home():
    m = preset("h200x2")
    assert m.device("cuda:1") == Device("cuda:1", "cuda", 1)
    assert m.device(m.device("cpu:1")).name == "cpu:1"
    assert m.home("cpu").name == "cpu:0"
    assert m.home("cuda:1").name == "cuda:1"
    assert m.home("cuda").name == "cuda:0"
    with pytest.raises(KeyError, match=r"no device 'cuda:2'.*cuda:1"):
        m.device("cuda:2")
    with pytest.raises(KeyError):
        preset("cpu-only").home("cuda:0")


def test_stub_compatible_construction_gets_default_profile():
    m = Machine("tiny", (Device("cpu:0", "cpu", 0), Device("cuda:0", "cuda", 0)))
    assert m.profile.is_defaults
    assert m.profile.device("cuda:0").kind == "cuda"
    assert m.device("cpu:0").torch_device.type == "cpu"


def test_load_machine_resolves_specs(monkeypatch):
    m = preset("cpu-only")
    assert load_machine(m) is m
    assert load_machine("h200x8").name == "h200x8"
    assert load_machine("h200x2", cpu_workers=1).cpu_workers == 1
    with pytest.raises(ValueError, match=r"unknown machine 'tpu'.*cpu-only"):
        load_machine("tpu")
    auto = load_machine("auto", measure=False)
    assert auto.profile.is_defaults and auto.cpus


# -- curves and links ------------------------------------------------------------------------
def test_link_key_normalises_cpu_workers():
    assert link_key("cpu:1", "cuda:0", True) == "cpu->cuda:0/pinned"
    assert link_key("cuda:0", "cpu:0", False) == "cuda:0->cpu/pageable"
    assert link_key("cuda:0", "cuda:1") == "cuda:0->cuda:1"
    with pytest.raises(ValueError, match="share memory"):
        link_key("cpu:0", "cpu:1")


def test_link_without_samples_is_latency_plus_bytes_over_bandwidth():
    link = LinkProfile(10e-6, 1e9)
    assert link.time(0) == 0.0
    assert link.time(1e6) == pytest.approx(10e-6 + 1e-3)


def test_link_samples_are_interpolated_and_extended():
    link = LinkProfile(1e-6, 1e9, ((1e3, 2e-6), (1e6, 2e-3)))
    assert link.time(1e3) == pytest.approx(2e-6)
    assert link.time(1e6) == pytest.approx(2e-3)
    assert link.time(5e5) == pytest.approx(2e-6 + (2e-3 - 2e-6) * (5e5 - 1e3) / (1e6 - 1e3))
    assert link.time(2e6) == pytest.approx(2e-3 + 1e6 / 1e9)  # past the samples: bandwidth


@given(st.lists(st.tuples(st.floats(1, 1e9), st.floats(1e-7, 1.0)), min_size=1, max_size=6),
       st.floats(1, 1e10), st.floats(1, 1e10))
def test_link_time_never_decreases_with_size(samples, a, b):
    link = LinkProfile(5e-6, 2e9, tuple(samples))
    lo, hi = sorted((a, b))
    assert link.time(lo) <= link.time(hi) * (1 + 1e-9)


@given(st.lists(st.tuples(st.floats(1, 1e12), st.floats(1e3, 1e13)), min_size=1, max_size=6),
       st.floats(1, 1e13), st.floats(1, 1e13))
def test_compute_time_never_decreases_with_work(curve, a, b):
    d = DeviceProfile("cpu", "x", 1e-6, 1e-6, {"float32": 1e12}, 1e10, 2**30,
                      curves={"matmul": curve})
    lo, hi = sorted((a, b))
    assert d.compute_time("float32", lo) <= d.compute_time("float32", hi) * (1 + 1e-9)


def test_compute_time_scales_the_float32_curve_for_other_dtypes():
    d = DeviceProfile("cuda", "g", 1e-6, 1e-6, {"float32": 10e12, "bfloat16": 40e12}, 1e12,
                      2**30, curves={"matmul": ((1e6, 1e12), (1e9, 10e12))})
    assert d.compute_time("float32", 1e9) == pytest.approx(1e9 / 10e12)
    assert d.compute_time("bfloat16", 1e6) == pytest.approx(1e6 / 4e12)
    # below the smallest size measured, its time: an op's fixed cost stays
    assert d.compute_time("float32", 1e3) == pytest.approx(1e6 / 1e12)
    assert d.compute_time("int64", 1e12) == pytest.approx(1e12 / 10e12)  # slowest known rate
    flat = DeviceProfile("cuda", "g", 1e-6, 1e-6, {"float32": 10e12, "float16": 20e12}, 1e12, 1)
    assert flat.compute_time("float16", 1e9) == pytest.approx(1e9 / 20e12)


def test_convolutions_are_priced_on_their_own_curve_where_measured():
    curves = {"matmul": ((1e6, 1e12), (1e9, 10e12)), "conv": ((1e6, 1e11), (1e9, 20e12))}
    d = DeviceProfile("cpu", "x", 1e-6, 1e-6, {"float32": 10e12, "bfloat16": 20e12}, 1e12,
                      2**30, curves=curves)
    assert d.compute_time("float32", 1e6, curve="conv") == pytest.approx(1e6 / 1e11)
    assert d.compute_time("bfloat16", 1e9, curve="conv") == pytest.approx(1e9 / 40e12)
    no_conv = DeviceProfile("cpu", "x", 1e-6, 1e-6, {"float32": 10e12}, 1e12, 2**30,
                            curves={"matmul": curves["matmul"]})
    assert no_conv.compute_time("float32", 1e9, curve="conv") == pytest.approx(1e9 / 10e12)


def test_read_and_write_times():
    d = DeviceProfile("cpu", "x", 1e-6, 1e-6, {"float32": 1e12}, 1e10, 2**30,
                      curves={"read": ((1e3, 1e9), (1e6, 1e10)), "write": ((1e6, 2e9),)})
    assert d.read_time(1e6) == pytest.approx(1e-4)
    assert d.read_time(1e9) == pytest.approx(1e9 / 1e10)  # clamped above
    assert d.write_time(1e6) == pytest.approx(5e-4)
    plain = DeviceProfile("cpu", "x", 1e-6, 1e-6, {"float32": 1e12}, 1e10, 2**30)
    assert plain.read_time(1e6) == plain.write_time(1e6) == pytest.approx(1e-4)
    assert d.launch("matmul") == 1e-6
    assert replace(d, launch_by_kind={"matmul": 5e-6}).launch("matmul") == 5e-6


# -- JSON ------------------------------------------------------------------------------------
def test_profile_json_round_trip(tmp_path):
    for name in PRESETS:
        p = preset(name).profile
        path = save_profile(p, tmp_path / f"{name}.json")
        q = load_profile(path)
        assert q == p
        assert json.loads(path.read_text())["version"] == SCHEMA_VERSION


def _saved_profile() -> tuple[Profile, str]:
    host = host_info()
    fp = fingerprint_of(host)
    profile = default_profile(host, [])
    save_profile(profile, profile_path(fp))
    return profile, fp


@pytest.mark.parametrize("damage, message", [
    (lambda text: text[: len(text) // 2], "not valid JSON"),
    (lambda text: "\x00garbage{{{", "not valid JSON"),
    (lambda text: json.dumps({"some": "other tool's file"}), "not an autopar profile"),
    (lambda text: text.replace(f'"version": {SCHEMA_VERSION}', '"version": 999'),
     "schema version 999"),
    (lambda text: text.replace('"fingerprint": "', '"fingerprint": "x'), "another host"),
    (lambda text: text.replace('"mem_bw": ', '"mem_bw": -'), "must be a positive number"),
    (lambda text: text.replace('"devices"', '"gadgets"'), "malformed profile"),
])
def test_unusable_profile_files_are_refused_precisely(damage, message):
    _, fp = _saved_profile()
    path = profile_path(fp)
    path.write_text(damage(path.read_text()))
    with pytest.raises(ProfileError, match=message):
        load_profile(path, fp)


def test_binary_file_is_refused():
    _, fp = _saved_profile()
    profile_path(fp).write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(ProfileError):
        load_profile(profile_path(fp), fp)


@pytest.mark.parametrize("content", ["{\"format\": \"autopar-profile\", \"vers", "[]", "null"])
def test_detect_reports_and_replaces_an_unusable_profile(content):
    _, fp = _saved_profile()
    path = profile_path(fp)
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="unusable and will be replaced"):
        m = detect(measure=False)
    assert m.profile.is_defaults
    assert load_profile(path, fp).is_defaults  # the bad file was replaced by a good one


# -- detect ----------------------------------------------------------------------------------
def _profile_of(host):
    """A profile with an entry for every device of ``host`` (this machine may have GPUs)."""
    return default_profile(host, [f"cuda:{i}" for i in range(len(host["gpus"]))])


def test_detect_without_measuring_uses_defaults_and_saves_them(cache):
    m = detect(measure=False)
    assert m.profile.is_defaults
    assert [d.name for d in m.cpus] == (["cpu:0", "cpu:1"] if m.cores >= 4 else ["cpu:0"])
    assert m.profile_path == profile_path(m.fingerprint)
    assert m.profile_path.parent == cache
    assert load_profile(m.profile_path, m.fingerprint).is_defaults


def test_no_measure_environment_variable_is_honoured(monkeypatch):
    monkeypatch.setenv("AUTOPAR_NO_MEASURE", "1")
    assert detect().profile.is_defaults  # calibrate is patched to raise: not called


def test_missing_profile_triggers_one_quick_calibration(monkeypatch):
    calls = []

    def fake_calibrate(mode, host=None, progress=None):
        calls.append(mode)
        return replace(_profile_of(host), source=f"measured-{mode}")

    monkeypatch.setattr(calibrate_mod, "calibrate", fake_calibrate)
    first = detect(cpu_workers=3)
    assert calls == ["quick"] and first.profile.source == "measured-quick"
    assert first.cpu_workers == 3
    second = detect()  # cached now: no second measurement
    assert calls == ["quick"] and second.profile.source == "measured-quick"
    detect(calibrate="full")  # asked for: measures again
    assert calls == ["quick", "full"]
    with pytest.raises(ValueError, match="calibrate='slow'"):
        detect(calibrate="slow")


def _counting_calibrate(monkeypatch) -> list[str]:
    calls: list[str] = []

    def fake_calibrate(mode, host=None, progress=None):
        calls.append(mode)
        return replace(_profile_of(host), source=f"measured-{mode}")

    monkeypatch.setattr(calibrate_mod, "calibrate", fake_calibrate)
    return calls


def test_a_profile_of_an_older_schema_is_measured_again_and_said_so(monkeypatch, capsys,
                                                                    recwarn):
    calls = _counting_calibrate(monkeypatch)
    _, fp = _saved_profile()
    path = profile_path(fp)
    path.write_text(path.read_text().replace(f'"version": {SCHEMA_VERSION}', '"version": 1'))
    assert detect().profile.source == "measured-quick" and calls == ["quick"]
    said = capsys.readouterr().err
    assert "measured by an older autopar (profile schema 1" in said and "no profile" not in said
    assert not [w for w in recwarn if "unusable" in str(w.message)]  # an upgrade, not damage
    assert json.loads(path.read_text())["version"] == SCHEMA_VERSION
    detect()
    assert calls == ["quick"]


def test_a_cache_that_cannot_keep_the_profile_measures_once_a_process(monkeypatch):
    import autopar.machine.detect as detect_mod

    calls = _counting_calibrate(monkeypatch)

    def read_only(profile, path):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(detect_mod, "save_profile", read_only)
    monkeypatch.setattr(detect_mod, "_UNSAVED", {})
    with pytest.warns(RuntimeWarning, match="AUTOPAR_CACHE_DIR"):
        assert detect().profile.source == "measured-quick"
    assert detect().profile.source == "measured-quick" and calls == ["quick"]


def test_processes_started_at_once_measure_the_host_once(monkeypatch, capsys):
    """While another process measures the host (its lock beside the profile held: a thread
    stands in for it, flock locks open files), a process that finds no profile waits, says
    so, and loads the profile the other saved instead of measuring a busy host; one asking
    to calibrate by name measures after it."""
    import threading
    import time

    from autopar.ir.locks import file_lock

    calls = _counting_calibrate(monkeypatch)
    host = host_info()
    path = profile_path(fingerprint_of(host))
    path.parent.mkdir(parents=True, exist_ok=True)
    held, done = threading.Event(), threading.Event()

    def other_process():
        with file_lock(path):
            held.set()
            time.sleep(0.3)
            save_profile(replace(_profile_of(host), source="measured-by-the-other"), path)
        done.set()

    thread = threading.Thread(target=other_process)
    thread.start()
    held.wait()
    m = detect()
    assert done.is_set() and m.profile.source == "measured-by-the-other" and calls == []
    assert "another process is measuring this host: waiting" in capsys.readouterr().err
    thread.join()
    assert detect(calibrate="quick").profile.source == "measured-quick"
    assert calls == ["quick"]


def test_calibrating_by_name_measures_despite_no_measure(monkeypatch):
    calls = _counting_calibrate(monkeypatch)
    monkeypatch.setenv("AUTOPAR_NO_MEASURE", "1")
    assert detect().profile.is_defaults and calls == []
    assert detect(calibrate="quick").profile.source == "measured-quick" and calls == ["quick"]


def test_defaults_are_replaced_once_measuring_is_allowed(monkeypatch):
    detect(measure=False)
    calls = []

    def fake_calibrate(mode, host=None, progress=None):
        calls.append(mode)
        return replace(_profile_of(host), source="measured")

    monkeypatch.setattr(calibrate_mod, "calibrate", fake_calibrate)
    assert detect().profile.source == "measured"
    assert calls == ["quick"]


def test_fingerprint_depends_on_the_host():
    host = host_info()
    assert fingerprint_of(host) == fingerprint_of(dict(host))
    assert fingerprint_of(host) != fingerprint_of({**host, "torch": "0.0.1"})
    assert len(fingerprint_of(host)) == 16


def test_smoke_calibration_runs_every_cpu_code_path():
    steps = []  # the real calibration, in its seconds-long smoke mode
    p = _REAL_CALIBRATE("smoke", progress=lambda what, done, total: steps.append(what))
    cpu = p.device("cpu:0")
    assert p.source == "measured-smoke"
    assert cpu.launch_s > 0 and cpu.flops["float32"] > 0 and cpu.mem_bw > 0
    assert set(cpu.curves) >= {"matmul", "read", "write"}
    assert set(cpu.flops) >= {"float32", "float64", "bfloat16", "float16"}
    assert steps[0] == "cpu: dispatch overhead" and steps[-1] == "done"
    assert Profile.from_json(json.loads(json.dumps(p.to_json())), p.fingerprint) == p


# -- command line ----------------------------------------------------------------------------
def _invoke(args: list[str]):
    from autopar.cli import app

    # a typer app with a single command runs it without naming it
    prefix = ["calibrate"] if len(app.registered_commands) > 1 else []
    return CliRunner().invoke(app, prefix + args)


def test_cli_shows_a_preset_as_json():
    result = _invoke(["--machine", "h200x2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["source"] == "preset:h200x2" and "cuda:0->cuda:1" in data["links"]


def test_cli_show_prints_tables_without_measuring():
    detect(measure=False)  # a defaults profile saved (--show itself writes nothing)
    result = _invoke(["--show"])
    assert result.exit_code == 0, result.output
    assert "defaults" in result.output and "launch" in result.output


def test_cli_rejects_unknown_machine():
    result = _invoke(["--machine", "nope"])
    assert result.exit_code != 0


# -- CPU workers owning part of the host's threads -------------------------------------------
def test_worker_times_follow_amdahl_between_one_and_all_threads():
    # measured with 4 threads: 1 ms; with one thread: 3 ms
    curves = {"matmul": ((1e9, 1e12),), "matmul@1t": ((1e9, 1e9 / 3e-3),),
              "read": ((1e6, 1e10),), "read@1t": ((1e6, 1e9),)}
    d = DeviceProfile("cpu", "x", 1e-6, 1e-6, {"float32": 1e12, "float64": 5e11}, 1e10, 2**30,
                      threads=4, curves=curves)
    assert d.compute_time("float32", 1e9) == pytest.approx(1e-3)  # as measured
    assert d.compute_time("float32", 1e9, threads=4) == pytest.approx(1e-3)
    assert d.compute_time("float32", 1e9, threads=1) == pytest.approx(3e-3)
    # 2 of 4 threads: serial part s and parallel part p with s + p = 3 ms, s + p / 4 = 1 ms
    # give s = 1/3 ms, p = 8/3 ms, so s + p / 2 = 5/3 ms
    assert d.compute_time("float32", 1e9, threads=2) == pytest.approx(5e-3 / 3)
    assert d.compute_time("float64", 1e9, threads=2) == pytest.approx(10e-3 / 3)
    assert d.read_time(1e6, threads=2) == pytest.approx(1e-3 / 3 + 1e-4 * 2 / 3)


def test_worker_times_without_one_thread_curves_take_a_linear_share():
    d = DeviceProfile("cpu", "x", 1e-6, 1e-6, {"float32": 4e11}, 4e10, 2**30, threads=8)
    assert d.compute_time("float32", 4e11, threads=2) == pytest.approx(4.0)
    assert d.read_time(4e10, threads=4) == pytest.approx(2.0)


@given(st.lists(st.tuples(st.floats(1, 1e12), st.floats(1e3, 1e13)), min_size=1, max_size=5),
       st.lists(st.tuples(st.floats(1, 1e12), st.floats(1e3, 1e13)), min_size=1, max_size=5),
       st.integers(1, 16), st.floats(1, 1e13), st.floats(1, 1e13))
def test_worker_compute_time_never_decreases_with_work(full, one, threads, a, b):
    d = DeviceProfile("cpu", "x", 1e-6, 1e-6, {"float32": 1e12}, 1e10, 2**30, threads=16,
                      curves={"matmul": full, "matmul@1t": one})
    lo, hi = sorted((a, b))
    t = d.compute_time
    assert t("float32", lo, threads) <= t("float32", hi, threads) * (1 + 1e-9)


def test_profile_check_names_what_is_missing():
    p = preset("h200x2").profile
    p.check(["cuda:0", "cuda:1"])
    with pytest.raises(ProfileError, match=r"lacks cuda:2, cuda:0->cuda:2, cpu->cuda:2/pinned"):
        p.check(["cuda:0", "cuda:2"])
    links = {k: v for k, v in p.links.items() if k != "cuda:1->cuda:0"}
    with pytest.raises(ProfileError, match=r"lacks cuda:1->cuda:0$"):
        replace(p, links=links).check(["cuda:0", "cuda:1"])


def test_a_slow_outlier_in_a_curve_is_lowered_to_the_bigger_job():
    # 512^3 measured at 7.8 ms (a descheduled thread) between 256^3 at 40 us and 1024^3 at 1.1 ms
    d = DeviceProfile("cpu", "x", 1e-6, 1e-6, {"float32": 2e12}, 1e10, 2**30, curves={
        "matmul": ((2 * 256**3, 2 * 256**3 / 40e-6), (2 * 512**3, 2 * 512**3 / 7.8e-3),
                   (2 * 1024**3, 2 * 1024**3 / 1.1e-3))})
    assert d.compute_time("float32", 2 * 512**3) == pytest.approx(1.1e-3)
    assert d.compute_time("float32", 2 * 1024**3) == pytest.approx(1.1e-3)
    assert d.compute_time("float32", 2 * 256**3) == pytest.approx(40e-6)
    link = LinkProfile(1e-6, 1e9, ((1e3, 5e-3), (1e6, 1e-3)))
    assert link.samples == ((1e3, 1e-3), (1e6, 1e-3))


def test_an_all_thread_curve_is_never_slower_than_the_one_thread_curve():
    """A 2-core VM's profile calibrated beside another process: all-thread matmuls at 22
    MFLOP/s where one thread did 65 GFLOP/s at the same size (every small addmm priced 23.7
    ms). All threads are never slower than one: the point is raised to the one-thread rate."""
    n = 524288
    d = DeviceProfile("cpu", "x", 1e-6, 1e-6, {"float32": 3e9}, 1e10, 2**30, threads=2,
                      curves={"matmul": ((8192, 2.9e9), (n, 22e6)),
                              "matmul@1t": ((8192, 2.8e9), (n, 65e9))})
    assert d.compute_time("float32", n) == pytest.approx(n / 65e9)
    assert d.compute_time("float32", 8192) == pytest.approx(8192 / 2.9e9)  # kept where faster


def test_calibration_inside_tracing_still_measures_real_work():
    """A backend may ask for its machine while torch.compile traces with fake tensors: the
    calibration must set the fake mode aside, or every timed op would do no work."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        profile = _REAL_CALIBRATE("smoke")
    cpu = profile.device("cpu")
    assert cpu.launch_s < 1e-4  # a real tiny op: a few us; a fake one measured ~390 us
