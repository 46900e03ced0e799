"""The command line's conventions: -h, --version, help texts, exit codes, completion."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopar.api import POLICIES
from autopar.cli import app
from autopar.machine.presets import PRESETS

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
