"""PyTorch's OpInfo database through ``autopar.compile`` on two CPU workers: nothing may raise
where eager succeeds (and ``aot_eager`` does: an op torch's own tracing can't take is exempt).

Each op with float32 samples on the CPU, its first two samples, each called once through
``autopar.compile(fn, devices="cpu:0,cpu:1", policy="round_robin")`` with eager and autopar's
way as the candidates: the capture, the plan and the check of the capturing call's results
against eager's all run. A capture that can't begin where eager runs must run eagerly (the
Dispatcher's fallback), sparse and complex-half outputs included. Values are not compared here:
random and uninitialized (``empty``) outputs differ by design; the Dispatcher compares the
capturing call's results itself and keeps eager where they differ. The sweep runs in a process
of its own (``_opinfo_run.py``: torch's test utilities change process-wide flags).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("expecttest")  # torch's OpInfo module imports it

TESTS = Path(__file__).resolve().parent


def test_nothing_raises_under_autopar_where_eager_runs():
    done = subprocess.run([sys.executable, str(TESTS / "_opinfo_run.py")], capture_output=True,
                          text=True, timeout=900, cwd=TESTS,
                          env=dict(os.environ, AUTOPAR_NO_MEASURE="1"))
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["ran"] > 1000, got  # the database is there, and its samples run
    assert got["failed"] == [], "\n".join(got["failed"])
