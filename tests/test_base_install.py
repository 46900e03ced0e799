"""The base install works: a fresh virtual environment, ``pip install .`` with no extras (no
matplotlib, no NumPy), then ``autopar demo``, ``autopar doctor`` on a plain script and
``autopar explain`` exit 0, and a picture that needs matplotlib is skipped with one line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TORCH = torch.__version__.split("+")[0]


def _ok(done: subprocess.CompletedProcess, what: str) -> str:
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{what} exited {done.returncode}:\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    if sys.prefix != sys.base_prefix and not (ROOT / ".venv").exists():
        pytest.skip("needs scripts/env.sh's layout")
    where = tmp_path_factory.mktemp("base") / "venv"
    _ok(subprocess.run([sys.executable, "-m", "venv", str(where)], capture_output=True,
                       text=True), "venv")
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    _ok(subprocess.run([*pip, f"torch=={TORCH}"], capture_output=True, text=True,
                       timeout=600), "pip install torch")
    _ok(subprocess.run([*pip, str(ROOT)], capture_output=True, text=True, timeout=600),
        "pip install .")
    return where


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"AUTOPAR_NO_MEASURE": "1", "AUTOPAR_CACHE_DIR": str(cwd / "cache")}
    return subprocess.run([str(venv / "bin" / "autopar"), *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd, env=env)


def test_the_base_install_has_neither_matplotlib_nor_numpy(venv):
    python = str(venv / "bin" / "python")
    for name in ("matplotlib", "numpy"):
        done = subprocess.run([python, "-c", f"import {name}"], capture_output=True)
        assert done.returncode != 0, f"{name} is installed: this test proves nothing"


def test_demo_runs_and_skips_the_pictures_with_one_line(venv, tmp_path):
    out = _ok(_run(venv, "demo", "-w", "W4", "--variants", "eager,autopar", "--out",
                   str(tmp_path / "demo"), cwd=tmp_path), "autopar demo")
    assert out.count("matplotlib is not installed (pip install 'autopar[plot]')") == 1
    assert "Traceback" not in out and "error (" not in out


def test_doctor_runs_a_plain_script(venv, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent("""\
        import torch
        x = torch.randn(32, 32, device="cuda")
        total = 0.0
        for _ in range(5):
            total += (x @ x).sum().item()
        if __name__ == "__main__":
            print("ran its main block")
        """))
    out = _ok(_run(venv, "doctor", str(script), "--machine", "h200x2", cwd=tmp_path),
              "autopar doctor")
    assert "ran its main block" in out
    assert "plain.py:5 in <module>" in out


def test_explain_runs(venv, tmp_path):
    code = tmp_path / "chains.py"
    code.write_text(textwrap.dedent("""\
        import torch
        def chains(a, b):
            return (a @ a).relu(), (b @ b).relu()
        def example_inputs():
            return torch.randn(512, 512), torch.randn(512, 512)
        """))
    out = _ok(_run(venv, "explain", f"{code}:chains", "--machine", "h200x2",
                   "--inputs-on", "cuda:0", cwd=tmp_path), "autopar explain")
    assert "predicted" in out
