"""Test-wide settings: plan with conservative default numbers instead of calibrating here."""

import os

os.environ.setdefault("AUTOPAR_NO_MEASURE", "1")
os.environ.setdefault("AUTOPAR_CACHE_DIR", os.path.join(os.path.dirname(__file__), ".cache"))
