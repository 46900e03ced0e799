"""Test-wide settings: plan with conservative default numbers instead of calibrating here."""

import os

import pytest
import torch

os.environ.setdefault("AUTOPAR_NO_MEASURE", "1")
# Tests of capture, placement and the runtime compare autopar's own way with eager; Inductor's
# (torch.compile's default) is a candidate where a test asks for it (test_choose, test_models),
# so that each other test doesn't compile C++ kernels it doesn't check.
os.environ.setdefault("AUTOPAR_CANDIDATES", "eager,autopar")
os.environ.setdefault("AUTOPAR_CACHE_DIR", os.path.join(os.path.dirname(__file__), ".cache"))


@pytest.fixture
def fresh_dynamo():
    """Compile from scratch in each test: no graph or guard cached by an earlier one."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
