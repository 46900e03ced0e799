"""The command line's conventions: -h, --version, help texts, exit codes, completion; and
pictures of the placed graph without Graphviz."""

from __future__ import annotations

import builtins
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopar.cli import app
from autopar.machine.presets import PRESETS
from autopar.schedule.place import POLICIES

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
COMMANDS = ("demo", "bench", "calibrate", "explain", "doctor")


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_version():
    result = _run("--version")
    assert result.exit_code == 0 and result.stdout.startswith("autopar 0.")
    assert "torch" in result.stdout


@pytest.mark.parametrize("command", ("", *COMMANDS))
def test_h_and_help_everywhere(command):
    args = [command] if command else []
    short, long = _run(*args, "-h"), _run(*args, "--help")
    assert short.exit_code == 0 and long.exit_code == 0, short.output
    assert short.stdout == long.stdout and "Usage" in short.stdout


def test_help_lists_what_the_code_accepts():
    def flat(text: str) -> str:
        return " ".join(text.replace("│", " ").split())

    explain = flat(_run("explain", "-h").stdout)
    for name in (*PRESETS, *POLICIES):
        assert name in explain, name
    for command in ("doctor", "calibrate", "demo", "bench"):
        text = flat(_run(command, "-h").stdout)
        assert all(name in text for name in PRESETS), command
    top = flat(_run("-h").stdout)
    assert "AUTOPAR_LOGS" in top and "+topic" in top and "Exit codes" in top


def test_completion_is_offered():
    assert "--install-completion" in _run("-h").stdout


def test_exit_codes():
    assert _run("no-such-command").exit_code == 2
    assert _run("explain", "--no-such-option").exit_code == 2
    assert _run("calibrate", "--show", "--machine", "no-such-preset").exit_code == 2
    assert _run("explain", "no_colon.py").exit_code == 2
    ok = _run("calibrate", "--show", "--machine", "h200x2")
    assert ok.exit_code == 0, ok.output


def test_calibrate_show_reads_the_profile_and_writes_nothing(tmp_path, monkeypatch):
    from autopar.machine.host import host_info, profile_path, save_profile
    from autopar.machine.model import SCHEMA_VERSION, default_profile, fingerprint_of

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    missing = _run("calibrate", "--show")
    assert missing.exit_code == 1 and "none saved" in missing.output
    assert "autopar calibrate" in missing.output and not list(tmp_path.iterdir())
    path = profile_path(fingerprint_of(host_info()))
    save_profile(default_profile(host_info(), []), path)
    text = path.read_text()
    assert _run("calibrate", "--show", "--json").exit_code == 0
    path.write_text(text.replace(f'"version": {SCHEMA_VERSION}', '"version": 1'))
    older = _run("calibrate", "--show")
    assert older.exit_code == 1 and "schema version 1" in older.output
    assert '"version": 1' in path.read_text()  # left as it was


def _explain_graph(path: Path):
    return _run("explain", f"{EXAMPLES / 'two_chains.py'}:two_chains", "--machine", "h200x2",
                "--inputs-on", "cuda:0", "--graph", str(path))


def test_a_picture_without_graphviz_is_drawn_with_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    result = _explain_graph(tmp_path / "g.png")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {tmp_path / 'g.png'}" in result.stdout
    svg = _explain_graph(tmp_path / "g.svg")
    assert svg.exit_code == 0 and "<svg" in (tmp_path / "g.svg").read_text()


def test_without_graphviz_or_matplotlib_it_says_so_and_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = _explain_graph(tmp_path / "g.svg")
    assert result.exit_code == 1
    assert not (tmp_path / "g.svg").exists() and (tmp_path / "g.dot").exists()
    assert "Graphviz" in result.stderr and "matplotlib" in result.stderr
    assert f"wrote {tmp_path / 'g.svg'}" not in result.stdout
