"""The front door: backend registration, option validation, capture and eager fallback."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import subprocess
import sys
import typing

import pytest
import torch

import autopar
from autopar import choose
from autopar.api import Options, parse_devices
from autopar.capture.dynamo import make_backend
from autopar.capture.fx import from_fx
from autopar.choose import WAYS
from autopar.ir.graph import Graph, TensorMeta
from autopar.machine.host import cpu_fusion_unavailable
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
        (["cpu:1", "cpu:0"], ("cpu:1", "cpu:0")),
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
        ("cpu:1", r"skips a CPU worker.*write 'cpu:0,cpu:1'"),
        (["cpu:0", "cpu:3"], r"skips a CPU worker.*write 'cpu:0,cpu:1,cpu:2,cpu:3'"),
    ],
)
def test_parse_devices_rejects_with_a_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_devices(spec)


def test_the_typed_options_are_the_options_checked():
    """``compile``'s and ``data_parallel``'s keywords are typed by ``CompileOptions``
    (``help()``, editors): the very options ``Options`` checks, each with a type that holds
    its default."""
    hints = typing.get_type_hints(autopar.CompileOptions)
    assert set(hints) == {f.name for f in dataclasses.fields(Options)}
    for sig in (inspect.signature(autopar.compile), inspect.signature(autopar.data_parallel)):
        assert "Unpack[CompileOptions]" in str(sig.parameters["options"].annotation)
    assert Options.policy in typing.get_args(hints["policy"])
    assert Options.guards in typing.get_args(hints["guards"])


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


def test_a_dynamic_graph_is_placed_once_per_shape(caplog):
    """Dynamo's dynamic graph (symbolic sizes) can't be placed as it is: each concrete signature
    gets a static graph at its first call, and later calls of it reuse that."""
    built = []

    def build(graph, phase):
        built.append(graph)
        return SequentialRunner(graph)

    def f(x):
        return x.sin() * 2 + x.shape[0]

    compiled = torch.compile(f, backend=make_backend(build), dynamic=True)
    with caplog.at_level(logging.INFO, logger="autopar"):
        for n in (3, 5, 3, 5, 5):
            x = torch.randn(n)
            torch.testing.assert_close(compiled(x), f(x))
    assert [tuple(g.inputs[0].meta.shape) for g in built] == [(3,), (5,)]
    placed = [r.getMessage() for r in caplog.records if "placed for shapes" in r.getMessage()]
    assert len(placed) == 2 and "[5]" in placed[1]


def test_a_dynamic_graph_keeps_at_most_max_signatures(caplog, monkeypatch):
    """Past ``MAX_SIGNATURES`` static graphs a dynamic graph's new sizes run eagerly, said
    once, and nothing more is kept for them (a key a new size, for ever, before 2026-12-05)."""
    import gc

    from autopar.capture import shapes

    monkeypatch.setattr(shapes, "MAX_SIGNATURES", 2)
    built = []

    def build(graph, phase):
        built.append(graph)
        return SequentialRunner(graph)

    def f(x):
        return x.sin() * 2

    compiled = torch.compile(f, backend=make_backend(build), dynamic=True)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        for n in range(3, 10):
            x = torch.randn(n)
            torch.testing.assert_close(compiled(x), f(x))
    assert len(built) == 2
    (per_shape,) = [o for o in gc.get_objects() if type(o) is shapes.PerShape]
    assert len(per_shape.runs) == 2
    said = [r for r in caplog.records if "signatures: new ones run eagerly" in r.getMessage()]
    assert len(said) == 1


def test_a_shape_decided_by_a_value_runs_eagerly_with_one_logged_reason(caplog):
    """``x[:n]`` with ``n`` read from a tensor: no static graph exists; that graph runs eagerly
    (never a wrong result) and says why."""
    def build(graph, phase):
        return SequentialRunner(graph)

    def f(x, n):
        return x[: n.item()] * 2

    with torch._dynamo.config.patch(capture_scalar_outputs=True), \
            caplog.at_level(logging.WARNING, logger="autopar"):
        compiled = torch.compile(f, backend=make_backend(build))
        for k in (2, 4):
            x, n = torch.randn(6), torch.tensor(k)
            torch.testing.assert_close(compiled(x, n), f(x, n))
    reasons = [r.getMessage() for r in caplog.records if r.name.startswith("autopar")]
    assert reasons and all("eagerly" in r for r in reasons)


@torch.library.custom_op("autopar_test::rows_and_count", mutates_args=())
def _rows_and_count(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    return x * 2, x.shape[0]


@_rows_and_count.register_fake
def _(x):
    return torch.empty_like(x), x.shape[0]


def test_an_op_returning_a_known_number_among_its_tensors_is_captured(caplog):
    """cuDNN's and flash attention return the sequence lengths beside their tensors
    (``max_q``, ``max_k``): a number known at capture time is that number in the graph, and
    the graph is autopar's, not run eagerly (HF text models under bf16 autocast on an H100
    were, until 2026-12-05)."""
    built = []

    def build(graph, phase):
        built.append(graph)
        return SequentialRunner(graph)

    def f(x):
        y, n = torch.ops.autopar_test.rows_and_count(x)
        return (y + 1).reshape(n, -1).sum(1) * n

    compiled = torch.compile(f, backend=make_backend(build))
    with caplog.at_level(logging.WARNING, logger="autopar"):
        x = torch.randn(6, 4)
        torch.testing.assert_close(compiled(x), f(x))
    assert not [r for r in caplog.records if r.name.startswith("autopar")]
    (graph,) = built
    assert next(n.op for n in graph.ops) is torch.ops.autopar_test.rows_and_count.default


def test_a_trial_times_the_gpus_holding_the_calls_tensors():
    """A trial times eager's and Inductor's calls on the GPUs the graphs touch and on those
    holding the call's tensors: where dynamo's graph ran eagerly (autopar could not represent
    it) no plan names a GPU, and the trial, timing the host alone, could never see a
    launch-bound call and try CUDA graphs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    compiled = autopar.compile(lambda x, y=None: x + 1)
    with FakeTensorMode():
        x = torch.empty(3, device="cuda:0")
    assert compiled.runner.graphs == 0
    assert compiled._trial_gpus((x,), {}) == (frozenset({0}), frozenset({0}))
    assert compiled._trial_gpus((torch.ones(3),), {"y": [x]})[0] == frozenset({0})
    assert compiled._trial_gpus((torch.ones(3),), {}) == (frozenset(), frozenset())


def test_autopar_compile_places_a_new_shape_too(caplog):
    """The second shape makes dynamo's graph dynamic: its static graph for that shape is
    placed at its first call. A third shape is of a family whose sizes vary
    (``autopar.choose.OWN_SIGNATURES``): it runs the family's way, not placed."""
    compiled = autopar.compile(lambda x: (x @ x).relu() + 1, devices="cpu:0")
    with caplog.at_level(logging.INFO, logger="autopar"):
        for n in (4, 6, 8, 6, 8):
            x = torch.randn(n, n)
            torch.testing.assert_close(compiled(x), (x @ x).relu() + 1)
    placed = [r.getMessage() for r in caplog.records if "placed for shapes" in r.getMessage()]
    assert [m.split("shapes ")[1] for m in placed] == ["[6, 6]"]


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


def _host_matmul_via_gpu(side: int) -> Graph:
    """x, y on the host -> to cuda:0 -> mm -> back to the host: W3's host case."""

    aten = torch.ops.aten
    g = Graph("w3_host")
    x = g.input(TensorMeta.make((side, side), device="cpu"), "x")
    y = g.input(TensorMeta.make((side, side), device="cpu"), "y")
    moved = [g.call(aten._to_copy.default, (v,), {"device": torch.device("cuda:0")},
                    meta=TensorMeta.make((side, side), device="cuda:0"), name=f"{v.name}_gpu")
             for v in (x, y)]
    m = g.call(aten.mm.default, tuple(moved), name="m")
    back = g.call(aten._to_copy.default, (m,), {"device": torch.device("cpu")},
                  meta=TensorMeta.make((side, side), device="cpu"), name="back")
    g.set_outputs([back])
    return g


def _two_chains(on: str) -> Graph:
    """Two matmul chains written for ``on``: HEFT gives the second to another GPU."""

    aten = torch.ops.aten
    g = Graph("two_chains")
    outs = []
    for v in [g.input(TensorMeta.make((4000, 4000), device=on), f"x{i}") for i in range(2)]:
        for _ in range(5):
            v = g.call(aten.mm.default, (v, v))
        outs.append(v)
    g.set_outputs(outs)
    return g


def test_a_plan_that_is_eagers_chain_runs_as_eager_does():
    from autopar.cost.model import CostModel
    from autopar.machine.presets import preset
    from autopar.schedule.place import place
    from autopar.schedule.plan import make_plan
    from autopar.schedule.simulate import runs_as_eager

    cost = CostModel(preset("h200x2"))
    devices = ("cpu:0", "cuda:0", "cuda:1")
    chain = _host_matmul_via_gpu(1024)  # the GPU wins: copy in, matmul, copy out
    assert runs_as_eager(make_plan(place(chain, cost, devices=devices), cost), cost, devices)
    host = place(_host_matmul_via_gpu(256), cost, devices=devices)  # the host wins
    assert set(host.device.values()) == {"cpu:0"}
    assert not runs_as_eager(make_plan(host, cost), cost, devices)
    split = _two_chains("cuda:0")  # HEFT's placement is not eager's
    assert not runs_as_eager(make_plan(place(split, cost, devices=devices), cost), cost, devices)
    # eager's own placement of two independent chains on one GPU overlaps nothing: eager's way
    one = _two_chains("cuda:0")
    plan = make_plan(place(one, cost, policy="single", devices=devices), cost)
    assert runs_as_eager(plan, cost, devices)


def test_compiled_graphs_that_gain_nothing_run_as_sequential_runners():
    from autopar.api import Options, Runner
    from autopar.capture.dynamo import make_backend

    runner = Runner(Options.parse({"devices": "cpu:0"}))
    compiled = torch.compile(lambda x: (x @ x).relu(), backend=make_backend(runner))
    x = torch.randn(8, 8)
    torch.testing.assert_close(compiled(x), (x @ x).relu())
    (ex,) = runner.executors
    assert ex.runs_as == "eager's sequence"
    traced = Runner(Options.parse({"devices": "cpu:0", "trace": True}))  # traced: the executor
    torch.compile(lambda x: (x @ x).relu() + 1, backend=make_backend(traced))(x)
    assert traced.executors[0].runs_as == "executor"


@pytest.mark.skipif(cpu_fusion_unavailable() is not None, reason="needs a C++ compiler")
def test_eager_like_plans_fuse_only_where_inductor_is_not_the_same_traces_form():
    """A chain on eager's placement: with Inductor's whole graph a form of the same trace
    (guards="all") autopar's plan fuses nothing of its own and runs as eager's sequence;
    under guards="arguments" (Inductor's way is torch.compile's own, through dynamo's frame)
    it is fused, for the entry that skips dynamo."""
    from autopar.api import Options, Runner
    from autopar.capture.dynamo import make_backend

    x = torch.randn(64)
    for guards, fused in (("all", False), ("arguments", True)):
        runner = Runner(Options.parse({"devices": "cpu:0", "fuse": True, "guards": guards,
                                       "candidates": "auto"}))
        compiled = torch.compile(lambda x: (x * 2 + 1).sin() * 3, backend=make_backend(runner))
        torch.testing.assert_close(compiled(x), (x * 2 + 1).sin() * 3)
        (ex,) = runner.executors
        assert bool(ex.fused) is fused, guards
        assert ex.runs_as == ("executor" if fused else "eager's sequence"), guards


def test_a_function_with_nothing_to_gain_runs_as_plain_python_from_its_second_call():
    """Every graph runs as eager does (one device, nothing to overlap): a signature seen once
    then calls the function itself, without dynamo; a new shape goes through dynamo again."""
    traced = []

    def f(x, scale):
        traced.append(1)  # a Python side effect: runs at each plain call, once per dynamo trace
        return (x @ x).relu() * scale

    compiled = autopar.compile(f, devices="cpu:0")
    x = torch.randn(8, 8)
    for _ in range(3):
        torch.testing.assert_close(compiled(x, 2.0), f(x, 2.0))
    assert compiled.runner.graphs == 1 and compiled.runner.planned == 0
    assert len(compiled.plain_signatures) == 1
    # one trace by dynamo, two plain calls of the compiled function, three eager references:
    # the capturing call changed Python state (traced), so it is not repeated to check it
    assert len(traced) == 1 + 2 + 3
    assert compiled.impure is not None
    y = torch.randn(4, 4)  # a new signature: through dynamo first
    compiled(y, 2.0)
    assert len(compiled.plain_signatures) == 2
    w = torch.randn(8, 8, requires_grad=True)  # can't be keyed: such calls share one entry
    compiled(w, 2.0).sum().backward()
    out = compiled(w, 2.0)
    assert len(compiled.plain_signatures) == 3 and None in compiled.plain_signatures
    assert out.grad_fn is not None  # plain calls are eager's: autograd records them


def trial_clock(**seconds: float):
    """A fake ``choose._clock`` for a trial over the ways named (in the order the trial runs
    them: round the ways, in ``choose.WAYS`` order): read twice a call (start, end); each
    call of a way lasts its seconds. ``.reads`` counts reads."""
    ways = [w for w in WAYS if w in seconds]

    def clock() -> float:
        i = clock.reads
        clock.reads += 1
        if i % 2:  # the end of trial call i // 2
            clock.now += seconds[ways[(i // 2) % len(ways)]]
        return clock.now

    clock.reads, clock.now = 0, 0.0
    return clock


def test_the_very_tensors_of_the_latest_plain_call_skip_the_key(monkeypatch):
    """A plain call with the same tensor objects as the one before it, or new tensors of the
    same shapes, dtypes and devices, doesn't build its key; another grad mode or a new shape
    does (and a new shape goes through dynamo)."""
    import gc

    from autopar import dispatch as api

    keyed = []
    signature = api._signature
    monkeypatch.setattr(api, "_signature", lambda *a: keyed.append(1) or signature(*a))
    compiled = autopar.compile(lambda x, y: x @ y, devices="cpu:0")
    x, y = torch.randn(5, 10), torch.randn(10, 5)
    for _ in range(4):
        torch.testing.assert_close(compiled(x, y), x @ y)
    assert len(keyed) == 2  # dynamo's call and the first plain one; then the same tensors
    with torch.no_grad():
        compiled(x, y)
    assert len(keyed) == 3
    del x, y
    gc.collect()
    for n in (5, 5, 6):
        a, b = torch.randn(n, 10), torch.randn(10, n)
        torch.testing.assert_close(compiled(a, b), a @ b)
        del a, b
        gc.collect()
    assert len(keyed) == 4  # new tensors like the remembered ones: no key; a new shape
    assert len(compiled.plain_signatures) == 3  # (5, grad), (5, no grad), and (6, grad)
    w = torch.randn(6, 10, requires_grad=True)  # can't be keyed: one entry for all such calls
    compiled(w, torch.randn(10, 6)).sum().backward()
    assert len(keyed) == 5 and len(compiled.plain_signatures) == 4


def test_a_kept_eager_layout_is_served_by_its_plain_entry(monkeypatch):
    """A signature kept as eager gets a generated plain entry as the Dispatcher's route: calls
    of that layout (new tensors too) run the function with no Dispatcher frame and no key;
    another grad mode or shape goes the Dispatcher's way (and is remembered in turn)."""
    from autopar import api

    entered = []
    call = api.Dispatcher._call
    monkeypatch.setattr(api.Dispatcher, "_call",
                        lambda self, *a, **k: entered.append(1) or call(self, *a, **k))

    def mm(x, y):
        return x @ y

    compiled = autopar.compile(mm, devices="cpu:0")
    x, y = torch.randn(5, 10), torch.randn(10, 5)
    for _ in range(3):
        torch.testing.assert_close(compiled(x, y), mm(x, y))
    assert compiled.kept_way((x, y)) == "eager" and compiled._route.head.__name__ == "plain"
    before = len(entered)
    for _ in range(3):
        a, b = torch.randn(5, 10), torch.randn(10, 5)
        torch.testing.assert_close(compiled(a, b), mm(a, b))
    assert len(entered) == before  # the plain entry served them
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, y), mm(x, y))
    a = torch.randn(3, 10)
    torch.testing.assert_close(compiled(a, y), mm(a, y))
    assert len(entered) == before + 2  # another grad mode, another shape: the Dispatcher's
    torch.testing.assert_close(compiled(x, y.t().contiguous().t()), mm(x, y))  # other strides
    assert len(entered) == before + 3


def test_a_compiled_block_under_non_reentrant_checkpointing_matches_eager():
    """``torch.utils.checkpoint(compiled, x, use_reentrant=False)``: the recomputation in
    backward must save what the forward saved; a trial's calls took different ways for the
    two (CheckpointError at the third step, 2026-12-05). Calls under saved-tensor hooks run
    eagerly while their signature is not settled."""
    import copy

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    ref = copy.deepcopy(block)
    compiled = autopar.compile(block, candidates=("eager", "autopar", "inductor"))
    for _ in range(6):
        x = torch.randn(3, 4, requires_grad=True)
        checkpoint(compiled, x, use_reentrant=False).sum().backward()
        y = x.detach().clone().requires_grad_(True)
        checkpoint(ref, y, use_reentrant=False).sum().backward()
        torch.testing.assert_close(x.grad, y.grad)
    for p, q in zip(block.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert not compiled.forward.kept  # nothing settled under checkpointing
    offloaded = autopar.compile(copy.deepcopy(ref), candidates=("eager", "autopar"))
    with torch.autograd.graph.save_on_cpu():  # other saved-tensor hooks: captured as ever
        for _ in range(3):
            offloaded(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert offloaded.forward.kept


def test_torch_func_grad_of_a_compiled_function_is_eagers():
    """``torch.func.grad(autopar.compile(f))``: the capture's snapshot of the random
    generators failed under the transform ("Cannot access data pointer of Tensor that
    doesn't have storage"); such calls run eagerly until a way is kept."""
    def f(x, w):
        return (x.sin() * w).sum()

    compiled = autopar.compile(f)
    x, w = torch.randn(3), torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(torch.func.grad(compiled)(x, w), torch.func.grad(f)(x, w))
    torch.testing.assert_close(torch.func.vmap(compiled)(x[:, None], w[:, None]),
                               torch.func.vmap(f)(x[:, None], w[:, None]))


def test_signatures_that_alternate_stop_routing_plain_entries():
    """Two layouts kept as eager, called in turn: each call would miss the other's entry and
    route its own anew; after ``PLAIN_SWITCHES`` switches the route is the Dispatcher's and
    stays so. One layout called again and again keeps its entry."""
    from autopar.dispatch import PLAIN_SWITCHES

    def mm(x, y):
        return x @ y

    compiled = autopar.compile(mm, devices="cpu:0")
    shapes = [(torch.randn(5, 10), torch.randn(10, 5)), (torch.randn(6, 10), torch.randn(10, 6))]
    for _ in range(6):
        torch.testing.assert_close(compiled(*shapes[0]), mm(*shapes[0]))
    assert compiled._route.head.__name__ == "plain"
    for i in range(2 * PLAIN_SWITCHES + 4):
        x, y = shapes[i % 2]
        torch.testing.assert_close(compiled(x, y), mm(x, y))
    assert compiled._switches == PLAIN_SWITCHES
    assert compiled._route.head == compiled._call
    for _ in range(4):
        torch.testing.assert_close(compiled(*shapes[0]), mm(*shapes[0]))
    assert compiled._route.head == compiled._call


def test_the_same_tensors_in_lists_and_tuples_skip_the_key_too(monkeypatch):
    """Weights passed as a list or tuple: the same tensors in the same order skip the key, and
    so does a list changed in place to another tensor of the same shape; one more weight is
    keyed (a new signature, through dynamo)."""
    from autopar import dispatch as api

    keyed = []
    signature = api._signature
    monkeypatch.setattr(api, "_signature", lambda *a: keyed.append(1) or signature(*a))

    def mlp(x, weights):
        for w in weights:
            x = (x @ w).relu()
        return x

    compiled = autopar.compile(mlp, devices="cpu:0")
    x = torch.randn(4, 8)
    weights = [torch.randn(8, 8), torch.randn(8, 8)]
    for _ in range(4):
        torch.testing.assert_close(compiled(x, weights), mlp(x, weights))
    assert len(keyed) == 2  # dynamo's call and the first plain one
    compiled(x, tuple(weights))  # another container, the same tensors in the same order
    assert len(keyed) == 2
    weights[1] = torch.randn(8, 8)  # changed in place, same metadata: plain, no key
    torch.testing.assert_close(compiled(x, weights), mlp(x, weights))
    assert len(keyed) == 2
    weights.append(torch.randn(8, 8))  # one more weight: a new signature, through dynamo
    torch.testing.assert_close(compiled(x, weights), mlp(x, weights))
    assert len(keyed) == 3 and len(compiled.plain_signatures) == 2
    weights[0] = torch.randn(8, 4)  # another shape: keyed again
    compiled(x, weights[:1])
    assert len(keyed) == 4


def test_graph_breaks_alone_keep_calls_plain_and_folding_times_both_ways(monkeypatch):
    """Graph breaks alone don't keep a call from going plain: dynamo runs the function's own
    Python between graphs. Folding computes some ops at capture (``a1 * A + a1 ** 2`` becomes
    ``A * 10.0 + 100.0``), so the next calls of that signature alternate, timed, between
    dynamo and the plain call, and the faster way keeps it (the clock is faked here: each
    compiled call takes 10 s, each plain one 1 s, or the other way round)."""

    def broken(x):
        y = (x @ x).relu()
        torch._dynamo.graph_break()
        return y * 2

    def folds(x):
        a1 = torch.tensor(10.0)
        return (x @ x) * a1 + a1 ** 2

    x = torch.randn(8, 8)
    compiled = autopar.compile(broken, devices="cpu:0")
    for _ in range(3):
        torch.testing.assert_close(compiled(x), broken(x))
    runner = compiled.runner
    assert (runner.graphs, runner.planned, runner.folded) == (2, 0, 0)
    assert len(compiled.plain_signatures) == 1 and not compiled.trials

    for plain_faster in (True, False):
        clock = trial_clock(eager=1.0, autopar=10.0) if plain_faster else \
            trial_clock(eager=10.0, autopar=1.0)
        monkeypatch.setattr(choose, "_clock", clock)
        compiled = autopar.compile(folds, devices="cpu:0")
        torch.testing.assert_close(compiled(x), folds(x))
        assert compiled.runner.folded == 1 and len(compiled.trials) == 1
        for _ in range(4 * choose.TRIAL_CALLS):  # per way: an untimed call, a timed one
            torch.testing.assert_close(compiled(x), folds(x))
        assert not compiled.trials
        assert len(compiled.plain_signatures) == (1 if plain_faster else 0)
        used = clock.reads
        torch.testing.assert_close(compiled(x), folds(x))  # settled: no more timing
        assert clock.reads == used


@pytest.mark.parametrize("side", [64, 1024])
def test_a_placed_plan_is_timed_against_the_plain_call_whatever_its_prediction(
        monkeypatch, caplog, side):
    """Two branches on two CPU workers (the cpu-only preset splits them): predicted ~70 us at
    64, ~9 ms at 1024; either way the next calls are a trial (predictions prune, measurement
    decides), and here (fake clock) the plain call is faster and keeps the signature."""
    from autopar.machine.presets import preset

    def branches(x, y):
        return (x @ x).relu(), (y @ y).tanh()

    monkeypatch.setattr(choose, "_clock", trial_clock(eager=1.0, autopar=2.0))
    x, y = torch.randn(side, side), torch.randn(side, side)
    compiled = autopar.compile(branches, devices="cpu:0,cpu:1",
                               machine=preset("cpu-only", cpu_workers=2))
    want = branches(x, y)
    with caplog.at_level(logging.INFO, logger="autopar"):
        for _ in range(1 + 4 * choose.TRIAL_CALLS):
            torch.testing.assert_close(compiled(x, y), want)
    verdicts = [r.getMessage() for r in caplog.records if " kept for " in r.getMessage()]
    assert verdicts == [f"autopar: branches: eager kept for shapes ({side}, {side}), "
                        f"({side}, {side}) (medians: eager 1 s, autopar 2 s)"]
    assert compiled.runner.planned == 1
    assert not compiled.trials
    assert len(compiled.plain_signatures) == 1


def test_another_torch_compile_of_a_function_decides_nothing_of_autopars():
    """``torch.compile`` traced ``f`` first and found nothing to capture before its graph
    break (W1's slice with tensor bounds), so dynamo skips ``f``'s frame for any backend: once,
    autopar then never got a graph and ran ``f`` plainly. autopar compiles a copy of ``f``'s
    code (dynamo's entries are kept per code object) and captures its own graphs."""
    def f(A, B, r0, r1):
        B[:] = A[r0:r1]
        return B

    A, r0, r1 = torch.randn(8, 3), torch.tensor(2), torch.tensor(6)
    graphs = []
    for other_first in (False, True):  # as many graphs either way (how many: torch's dynamo)
        if other_first:
            torch.compile(f)(A, torch.empty(4, 3), r0, r1)
        compiled = autopar.compile(f, devices="cpu:0")
        for _ in range(3):
            torch.testing.assert_close(compiled(A, torch.empty(4, 3), r0, r1), A[2:6])
        graphs.append(compiled.runner.graphs)
    assert graphs[0] == graphs[1]


def test_a_function_compiled_again_and_again_is_captured_each_time():
    """dynamo stops compiling one code object after its recompile limit (8): the ninth
    ``autopar.compile`` of one function (a notebook cell run again) ran it plainly, while its
    ``explain()`` said autopar's way ran it."""
    def f(a, b):
        return (a @ a).relu(), (b @ b).tanh()

    a, b = torch.randn(16, 16), torch.randn(16, 16)
    for _ in range(10):
        compiled = autopar.compile(f, devices="cpu:0,cpu:1", policy="round_robin",
                                   candidates=("autopar",))
        torch.testing.assert_close(compiled(a, b), f(a, b))
        assert compiled.runner.graphs == 1


def test_defaults_reassigned_after_compiling_are_followed():
    def f(x, s=2.0, *, t=1.0):
        return x * s + t

    compiled = autopar.compile(f, devices="cpu:0,cpu:1", candidates=("autopar",))
    x = torch.ones(2)
    torch.testing.assert_close(compiled(x), f(x))
    f.__defaults__ = (5.0,)
    torch.testing.assert_close(compiled(x), f(x))
    f.__kwdefaults__ = {"t": 10.0}
    torch.testing.assert_close(compiled(x), torch.full((2,), 15.0))


def test_partials_and_callable_objects_compiled_again_and_again_are_captured_each_time():
    """dynamo calls partials and callable objects from one function of its own: every such
    callable compiled shared that function's recompile limit, and the ninth ran plainly."""
    def g(x, k):
        return torch.cos(x) * k + 1

    class Scaled:
        def __init__(self, i):
            self.i = i

        def __call__(self, x):
            return torch.sin(x) * 2 + self.i

    x = torch.randn(4, 4)
    for i in range(10):
        fn = functools.partial(g, k=float(i)) if i % 2 else Scaled(i)
        compiled = autopar.compile(fn, devices="cpu:0,cpu:1", candidates=("autopar",))
        torch.testing.assert_close(compiled(x), fn(x))
        assert compiled.runner.graphs == 1


def test_a_function_autopar_places_keeps_going_through_autopar_where_it_measured_faster(
        monkeypatch):
    monkeypatch.setattr(choose, "_clock", trial_clock(eager=2.0, autopar=1.0))
    compiled = autopar.compile(lambda a, b: (a @ a, b @ b), devices="cpu:0,cpu:1",
                               policy="round_robin")
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    for _ in range(2 + 4 * choose.TRIAL_CALLS):
        got = compiled(a, b)
        torch.testing.assert_close(got[0], a @ a)
    assert compiled.runner.planned == 1
    assert not compiled.plain_signatures and compiled.kept_way((a, b)) == "autopar"
    assert compiled.only is compiled.compiled  # settled: no key is built any more


def test_a_dynamic_training_graph_is_placed_per_shape_forward_and_backward():
    """aot_autograd calls a backward through wrappers that copy the function's ``__dict__``:
    the per-shape runner must carry its boxed-call mark there too."""
    built = []

    def build(graph, phase):
        built.append(phase)
        return SequentialRunner(graph)

    def f(x, s):
        return (x @ x).relu() * s

    compiled = torch.compile(f, backend=make_backend(build), dynamic=True)
    for n in (8, 6):
        w = torch.randn(n, n, requires_grad=True)
        compiled(w, 2.0).sum().backward()
        v = w.detach().clone().requires_grad_()
        f(v, 2.0).sum().backward()
        torch.testing.assert_close(w.grad, v.grad)
    assert built == ["forward", "backward", "forward", "backward"]


def test_arguments_in_tuples_are_keyed_too():
    compiled = autopar.compile(lambda x, ps: (x @ ps[0]).relu() @ ps[1], devices="cpu:0")
    x, ps = torch.randn(8, 8), (torch.randn(8, 8), torch.randn(8, 4))
    for _ in range(2):
        torch.testing.assert_close(compiled(x, ps), (x @ ps[0]).relu() @ ps[1])
    assert len(compiled.plain_signatures) == 1
    compiled(x, (ps[0], torch.randn(8, 6)))  # another shape inside the tuple: another key
    assert len(compiled.plain_signatures) == 2


def test_the_argument_key_tells_apart_what_decides_a_plan():
    from autopar.dispatch import _signature

    x, y = torch.randn(2, 3), torch.randn(3)
    keys = [_signature(a, k) for a, k in [
        ((x, y), {}), ((x, [y]), {}), ((x, (y,)), {}), ((x,), {"y": y}), ((y, x), {}),
        ((x, y.double()), {}), ((x, 1), {}), ((x, True), {}), ((x, 1.0), {}), ((x, 2), {}),
        ((x, torch.randn(4)), {})]]
    assert len(set(keys)) == len(keys)
    assert _signature((x, y), {}) == _signature((torch.randn(2, 3), torch.randn(3)), {})
    assert _signature((x, object()), {}) is None  # can't be keyed
    w = torch.randn(3, requires_grad=True)
    assert _signature((x, [w]), {}) is None  # autograd would record it
    with torch.no_grad():
        assert _signature((x, [w]), {}) is not None


def test_the_runner_knows_which_gpus_each_way_touches():
    """W3 with host data planned for 2xH200: eager's code uses cuda:0; autopar's plan runs
    5x10x5 on the host (no GPU) and 2048^3 on cuda:0."""
    from autopar.api import Runner
    from autopar.bench.workloads import w3_via_gpu
    from autopar.capture.fake import trace_fake
    from autopar.cost.model import CostModel
    from autopar.machine.presets import preset
    from autopar.schedule.place import place
    from autopar.schedule.plan import make_plan

    runner = Runner(Options.parse({"devices": "cpu:0"}))  # devices play no part here
    cost = CostModel(preset("h200x2"))

    class Ran:
        runs_as = "executor"

        def __init__(self, n: int) -> None:
            graph = trace_fake(w3_via_gpu, (torch.rand(n, n), torch.rand(n, n)),
                               inputs_on="cpu")
            self.plan = make_plan(place(graph, cost), cost)

    runner.graphs, runner.executors = 1, [Ran(5)]
    assert runner.gpus_touched() == (frozenset({0}), frozenset())
    runner.executors = [Ran(2048)]
    assert runner.gpus_touched() == (frozenset({0}), frozenset({0}))
    runner.executors[0].runs_as = "eager's sequence"
    assert runner.gpus_touched() == (frozenset({0}), frozenset({0}))
    runner.graphs = 2  # a graph that fell back to eager's devices: unknown
    assert runner.gpus_touched() is None


def test_torch_compile_options_convention_reaches_autopar():
    """``torch.compile(fn, backend="autopar", options={...})``, as every backend is given its
    options: validated as autopar.compile's, and one runner serves a set of options."""
    import autopar.backend as capture

    def two_branches(x, y):
        return (x @ x).relu() + (y @ y).tanh()

    x, y = torch.randn(16, 16), torch.randn(16, 16)
    torch._dynamo.reset()
    f = torch.compile(two_branches, backend="autopar",
                      options={"devices": "cpu:0,cpu:1", "policy": "round_robin"})
    torch.testing.assert_close(f(x, y), two_branches(x, y))
    key = (("devices", repr("cpu:0,cpu:1")), ("policy", repr("round_robin")))
    assert key in capture._BACKENDS
    with pytest.raises(Exception, match=r"unknown autopar option\(s\) 'devics'"):
        torch.compile(lambda a: a + 1, backend="autopar", options={"devics": "cpu:0"})(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"mode='reduce-overhead' is Inductor's.*cuda_graphs"):
        torch.compile(lambda a: a + 2, backend="autopar", mode="reduce-overhead")(x)
    torch._dynamo.reset()
    g = torch.compile(lambda a: a + 3, backend="autopar", mode="default")
    torch.testing.assert_close(g(x), x + 3)
    torch._dynamo.reset()


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_compiled_module_is_copied_and_pickled_as_compiled_again(how):
    """``copy.deepcopy`` (an EMA copy) and ``torch.save`` of ``autopar.compile(model)`` give
    the module's copy compiled again with the same options: a measured choice of its own (not
    the original's runner and trials), eager's outputs; the original runs on as before."""
    import copy
    import io

    from autopar.api import CompiledModule, dispatcher_of

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    compiled = autopar.compile(model, devices="cpu:0,cpu:1", policy="round_robin")
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x))
    if how == "deepcopy":
        again = copy.deepcopy(compiled)
    else:
        buffer = io.BytesIO()
        torch.save(compiled, buffer)
        buffer.seek(0)
        again = torch.load(buffer, weights_only=False)
    assert type(again) is CompiledModule
    assert again.autopar_options == {"devices": "cpu:0,cpu:1", "policy": "round_robin"}
    mine, theirs = dispatcher_of(again), dispatcher_of(compiled)
    assert mine is not None and mine is not theirs and mine.runner is not theirs.runner
    assert not mine.kept and not mine.trials  # nothing chosen yet
    assert again._orig_mod is not model
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(again(x), model(x))
            torch.testing.assert_close(compiled(x), model(x))
    assert mine.kept or mine.trials


def test_an_unknown_machine_or_a_trace_into_no_folder_is_refused_when_compiling(tmp_path):
    """Checked with the other options, when compiling (an unknown machine had planned with a
    logged warning only; a trace path into no folder failed at the first call's plan)."""
    f = lambda x: x * 2  # noqa: E731
    with pytest.raises(ValueError, match="unknown machine 'h100x3'"):
        autopar.compile(f, machine="h100x3")
    with pytest.raises(ValueError, match="unknown machine 5"):
        autopar.compile(f, machine=5)
    with pytest.raises(ValueError, match="its folder does not exist"):
        autopar.compile(f, trace=str(tmp_path / "no" / "t.json"))
    autopar.compile(f, machine="h200x2", trace=str(tmp_path / "t.json"))  # both fine


def test_meta_tensors_run_as_eager_does():
    """No values to compare: the capturing call's check compares shapes and dtypes only."""
    f = lambda x: (x @ x.t()).relu()  # noqa: E731
    x = torch.empty(3, 4, device="meta")
    with torch.no_grad():
        out = autopar.compile(f)(x)
    assert out.shape == (3, 3) and out.is_meta


def _checked_reshape(x):
    torch._assert(x.sum() > -1e9, "a data-dependent check")  # a graph break
    return x.reshape(3, -1)  # the mistake, after the break


def test_a_users_error_after_a_graph_break_names_the_users_line():
    """Part of the call ran (before the break), so the error dynamo caught is raised as it
    is, not by running the call again; it carries the user's line, which its traceback (the
    trace's) lacks."""
    compiled = autopar.compile(_checked_reshape)
    for _ in range(2):
        compiled(torch.randn(6))
    with pytest.raises(RuntimeError, match=r"shape '\[3, -1\]' is invalid") as got:
        compiled(torch.randn(7))
    notes = "\n".join(getattr(got.value, "__notes__", []))
    assert "test_api.py" in notes and "return x.reshape(3, -1)" in notes


def test_a_traced_compile_runs_autopars_way_and_gives_its_timelines(tmp_path):
    """``trace=True``: every call runs autopar's plan (the timelines are of it), the compiled
    object explains itself like any other, and ``timelines()`` gives the latest call's
    measured timeline of each graph, whose spans are the plan's ops; a path also writes the
    latest call's Chrome trace there. Untraced, there are none."""
    import json

    def f(x, y):
        return (x @ y).relu(), (y @ x).sigmoid()

    x, y = torch.randn(16, 16), torch.randn(16, 16)
    path = tmp_path / "t.json"
    g = autopar.compile(f, devices="cpu:0,cpu:1", policy="round_robin", trace=str(path))
    for _ in range(3):
        for got, want in zip(g(x, y), f(x, y)):
            torch.testing.assert_close(got, want)
    assert g.kept_way((x, y)) == "autopar"
    assert "runs autopar" in g.explain()
    (timeline,) = g.timelines()
    ops = {span.name for span in timeline.spans}
    assert any("mm" in op for op in ops) and {span.lane.split("/")[0] for span in
                                              timeline.spans} >= {"cpu:0", "cpu:1"}
    assert json.loads(path.read_text())["traceEvents"]
    plain = autopar.compile(f, devices="cpu:0,cpu:1", policy="round_robin")
    plain(x, y)
    assert plain.timelines() == []
