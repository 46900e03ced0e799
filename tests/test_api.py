"""The front door: backend registration, option validation, capture and eager fallback."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

import autopar
from autopar.api import Options, parse_devices
from autopar.capture import from_fx, make_backend
from autopar.runtime import SequentialRunner

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_backend_is_registered_on_import():
    assert "autopar" in torch._dynamo.list_backends()

    def f(x):
        return (x @ x).relu() + 1

    x = torch.randn(8, 8)
    torch.testing.assert_close(torch.compile(f, backend="autopar")(x), f(x))


def test_backend_found_through_entry_point_without_import():
    """A fresh interpreter that never imports autopar still finds backend="autopar"."""
    from importlib.metadata import entry_points

    if not any(ep.name == "autopar" for ep in entry_points(group="torch_dynamo_backends")):
        pytest.skip("autopar is not installed as a distribution (pip install -e .)")
    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: x * 2 + 1, backend='autopar')\n"
        "assert torch.equal(f(torch.ones(3)), torch.full((3,), 3.0))\n"
        "assert 'autopar' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cpu:0,cpu:1", ("cpu:0", "cpu:1")),
        (["cpu:0", "cpu:3"], ("cpu:0", "cpu:3")),
        (" cpu ", ("cpu:0",)),
    ],
)
def test_parse_devices_accepts(spec, expected):
    assert parse_devices(spec) == expected


def test_parse_devices_auto_has_host_and_every_gpu():
    devices = parse_devices("auto")
    assert devices[0] == "cpu:0"
    assert [d for d in devices if d.startswith("cuda")] == [
        f"cuda:{i}" for i in range(torch.cuda.device_count())]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gpu:0", "malformed device 'gpu:0'"),
        ("cuda:7", "does not exist: this machine has"),
        ("cpu:0,cpu:0", "named twice"),
        ("", "devices is empty"),
        (["cpu:0", "tpu"], "malformed device 'tpu'"),
    ],
)
def test_parse_devices_rejects_with_a_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_devices(spec)


def test_compile_rejects_bad_arguments_clearly():
    with pytest.raises(TypeError, match=r"expects a function or nn\.Module, got int"):
        autopar.compile(3)
    with pytest.raises(TypeError, match=r"unknown autopar option\(s\) 'devcies'.*valid options"):
        autopar.compile(lambda x: x, devcies="cpu:0")
    with pytest.raises(ValueError, match="unknown policy 'fastest'; choose one of heft"):
        autopar.compile(lambda x: x, policy="fastest")
    with pytest.raises(TypeError, match="devices must be"):
        Options.parse({"devices": 3})


def test_compile_runs_module_forward_and_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    compiled = autopar.compile(model)
    compiled(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_unsupported_graph_runs_eagerly_with_one_logged_reason(caplog):
    """Symbolic shapes can't be represented: that graph falls back to eager, still correct."""
    built = []

    def build(graph, phase):
        built.append(graph)
        return SequentialRunner(graph)

    def f(x):
        return x.sin() * 2

    compiled = torch.compile(f, backend=make_backend(build), dynamic=True)
    with caplog.at_level(logging.INFO, logger="autopar"):
        for n in (3, 5):
            x = torch.randn(n)
            torch.testing.assert_close(compiled(x), f(x))
    assert built == []
    reasons = [r.getMessage() for r in caplog.records if r.name == "autopar"]
    assert reasons and all("eagerly" in r and "symbolic shape" in r for r in reasons)


def test_from_fx_records_source_lines_and_constants():
    seen = {}

    def keep(gm, example_inputs):
        seen["graph"], seen["consts"] = from_fx(gm, "t")
        return gm

    def f(x):
        return x * torch.tensor([1.0, 2.0, 3.0]) + 1

    from torch._dynamo.backends.common import aot_autograd

    torch.compile(f, backend=aot_autograd(fw_compiler=keep))(torch.ones(3))
    graph = seen["graph"]
    assert any(n.source and n.source.startswith("test_api.py:") for n in graph.ops)
    assert len(graph.inputs) == 1 + len(seen["consts"])
