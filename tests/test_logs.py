"""Quiet by default, precise on demand: dynamo's records, user errors, AUTOPAR_LOGS."""

from __future__ import annotations

import logging

import pytest
import torch

import autopar
from autopar.ir import logs


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_shape_error_in_user_code_is_eagers_error_without_log_lines(capfd, caplog):
    def eager():
        return torch.ones(2, 3) @ torch.ones(2, 3)

    with pytest.raises(RuntimeError) as want:
        eager()
    compiled = autopar.compile(lambda a, b: a @ b)
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError) as got:
        compiled(torch.ones(2, 3), torch.ones(2, 3))
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    assert "mat1 and mat2 shapes cannot be multiplied" in str(got.value)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert capfd.readouterr().err == ""
    # the same function still compiles right shapes afterwards
    torch.testing.assert_close(compiled(torch.ones(2, 3), torch.ones(3, 2)),
                               torch.full((2, 2), 3.0))


def test_a_shape_error_after_a_graph_break_is_raised_without_dynamos_wrapper():
    def f(x, w):
        x = x + 1
        print("", end="")  # a graph break: the first graph has run when the second fails
        return x @ w

    compiled = autopar.compile(f)
    compiled(torch.ones(2, 3), torch.ones(3, 2))
    with pytest.raises(RuntimeError) as got:
        compiled(torch.ones(2, 3), torch.ones(2, 2))
    assert not isinstance(got.value, torch._dynamo.exc.TorchDynamoException)


def test_a_graph_break_logs_nothing_at_warning_from_dynamo(capfd, caplog):
    """A scalar read that only a later call reaches breaks the graph with
    ``capture_scalar_outputs`` off; dynamo's warning about it goes to ``autopar.torch``."""
    from torch._dynamo.variables.tensor import TensorVariable

    warn = getattr(TensorVariable, "_warn_capture_scalar_outputs", None)
    if hasattr(warn, "cache_clear"):
        warn.cache_clear()  # dynamo says it once per process

    def f(x, read):
        y = x * 2
        if read:
            return y + y.sum().item()
        return y

    seen = _Records()
    dynamo = logging.getLogger("torch._dynamo")
    ours = logging.getLogger("autopar.torch")
    dynamo.addHandler(seen)
    ours.addHandler(seen)
    saved = ours.level
    ours.setLevel(logging.DEBUG)
    try:
        compiled = autopar.compile(f)
        x = torch.ones(3)
        with caplog.at_level(logging.WARNING):
            for read in (False, True, True):
                torch.testing.assert_close(compiled(x, read), f(x, read))
    finally:
        dynamo.removeHandler(seen)
        ours.removeHandler(seen)
        ours.setLevel(saved)
    loud = [r for r in (*caplog.records, *seen.records) if r.levelno >= logging.WARNING
            and r.name.startswith(("torch._dynamo", "torch._inductor"))]
    assert loud == []
    assert "Graph break" not in capfd.readouterr().err
    rerouted = [r.getMessage() for r in seen.records if r.name == "autopar.torch"]
    assert any("capture_scalar_outputs" in m for m in rerouted), rerouted


def test_a_fallback_is_one_line_naming_the_graph_the_reason_and_the_users_line(caplog):
    def f(x, n):
        return x[: n.item()] * 2

    compiled = autopar.compile(f)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        for k in (2, 4):
            x, n = torch.randn(6), torch.tensor(k)
            torch.testing.assert_close(compiled(x, n), f(x, n))
    lines = [r.getMessage() for r in caplog.records if "eagerly" in r.getMessage()]
    assert lines
    for line in lines:
        assert "\n" not in line and line.startswith("autopar: running f_")
        assert "test_logs.py:" in line


def test_autopar_logs_syntax():
    assert logs.parse("+placement,trials") == {"autopar.placement": logging.DEBUG,
                                               "autopar.trials": logging.INFO}
    assert logs.parse("debug") == {"autopar": logging.DEBUG}
    assert logs.parse("-all, +torch") == {"autopar": logging.ERROR,
                                          "autopar.torch": logging.DEBUG}
    with pytest.raises(ValueError, match="unknown topic 'placements'"):
        logs.parse("placements")


def test_autopar_logs_shows_placements_and_trials(capfd):
    def branches(x, y):
        return (x @ x).sum() + (y @ y).sum()

    logs.set_logs("placement,trials")
    try:
        compiled = autopar.compile(branches, devices="cpu:0,cpu:1")
        x = torch.randn(64, 64)
        for _ in range(3):
            compiled(x, x)
    finally:
        logs.set_logs("")
    err = capfd.readouterr().err
    assert "[autopar.placement] autopar: branches_inference_1:" in err and "placed" in err
    assert not logging.getLogger("autopar").handlers


def test_a_frame_whose_code_holds_a_slice_does_not_break_the_filter():
    """Code dynamo generates can hold a slice among its constants, and before Python 3.12 such
    a code object can't be hashed: the filter that keeps torch's records quiet must not raise
    inside the user's call when one is on the stack (torch 2.11, W1's bounds captured)."""
    logs.quiet_code(lambda: None)  # a quiet code registered: the filter walks the stack

    def emit() -> None:
        logging.getLogger("torch._dynamo").warning("a record from inside dynamo's code")

    code = emit.__code__.replace(co_consts=(*emit.__code__.co_consts, slice(1, 2)))
    logs.cover_torch_loggers()
    type(emit)(code, emit.__globals__, "emit", None, emit.__closure__)()  # raises nothing
