"""autopar doctor on the CPU: every hazard kind found at its exact line, with counts per call and
costs from the cost model, on a simulated h200x2 (argument tensors taken to live on cuda:0)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from autopar.cli.commands.doctor import doctor as doctor_command
from autopar.cost.model import CostModel
from autopar.doctor import DoctorError, DoctorReport, Finding, doctor, doctor_file
from autopar.ir.graph import Graph, TensorMeta
from autopar.machine.presets import preset

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "w1_w2_user_code.py"
H200 = CostModel(preset("h200x2", cpu_workers=1))
aten = torch.ops.aten


def line_of(fn, marker: str) -> int:
    """The line of ``fn``'s source that holds ``marker`` (exactly one)."""
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, text in enumerate(lines) if marker in text]
    assert len(hits) == 1, f"{marker!r} found {len(hits)} times in {fn.__name__}"
    return hits[0]


def line_in(path: Path, text: str) -> int:
    hits = [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line]
    assert len(hits) == 1
    return hits[0]


def sim(fn, *args, repeat: int = 2) -> DoctorReport:
    return doctor(fn, *args, machine="h200x2", inputs_on="cuda:0", repeat=repeat)


def only(report: DoctorReport, kind: str, subkind: str | None = None) -> Finding:
    found = report.select(kind, subkind)
    assert len(found) == 1, report.to_text()
    return found[0]


def kinds(report: DoctorReport) -> set[str]:
    return {f.label for f in report.findings}


def gpu_node(op, *metas, meta=()):
    g = Graph("t")
    ins = [g.input(m) for m in metas]
    return g.call(op, tuple(ins), meta=meta)


def read_s() -> float:
    """The model's host time of one scalar read on the h200x2's GPU."""
    node = gpu_node(aten._local_scalar_dense.default, TensorMeta.make((), device="cuda:0"))
    return H200.op_cost(node, "cuda:0").host_s


# -- syncs -----------------------------------------------------------------------------------
def test_item_in_a_loop_is_one_finding_counted_per_call():
    def items(x):
        total = 0.0
        for i in range(3):
            total += x[i].item()  # item
        return total

    report = sim(items, torch.rand(4), repeat=2)
    f = only(report, "sync", "item")
    assert (f.file, f.line, f.function) == (__file__, line_of(items, "# item"), "items")
    assert f.count == 3 and report.calls == 2
    assert f.code == "total += x[i].item()  # item"
    assert f.cost_source == "estimated" and f.device == "cuda:0"
    assert f.cost_s == pytest.approx(3 * read_s()) and f.saving_s == pytest.approx(f.cost_s)
    assert report.simulated and report.machine == "h200x2"


def test_the_same_code_on_the_host_has_no_hazards():
    def items(x):
        return sum(x[i].item() for i in range(3)) + (x > 0).sum().item()

    report = doctor(items, torch.rand(4), machine="cpu-only")
    assert report.findings == [] and not report.simulated
    assert any("no value was on a GPU" in n for n in report.notes)


def test_slice_bounds_on_the_gpu_are_four_syncs_per_call():
    def window(A, B, r0, r1, c0, c1):
        B[:] = A[r0:r1, c0:c1]  # slice
        return B

    A, B = torch.rand(60, 60), torch.zeros(20, 20)
    bounds = [torch.tensor(v) for v in (10, 30, 5, 25)]
    report = sim(window, A, B, *bounds)
    f = only(report, "sync", "slice-bound")
    assert f.line == line_of(window, "# slice") and f.count == 4
    assert f.saving_s == pytest.approx(4 * read_s())
    assert "Python ints" in f.fix
    assert torch.equal(B, A[10:30, 5:25])  # it ran, for real
    assert kinds(report) == {"sync/slice-bound"}


def test_python_int_bounds_are_no_sync():
    def window(A, B, r0, r1):
        B[:] = A[r0:r1]
        return B

    report = sim(window, torch.rand(30, 4), torch.zeros(10, 4), 10, 20)
    assert report.select("sync") == []


def test_branching_on_a_gpu_value_and_indexing_with_one():
    def control(x, i):
        if x.sum() > 0:  # branch
            x = x * 2
        return [10, 20, 30][i]  # index

    report = sim(control, torch.rand(1000), torch.tensor(1))
    assert only(report, "sync", "branch").line == line_of(control, "# branch")
    assert only(report, "sync", "index").line == line_of(control, "# index")


def test_nonzero_and_boolean_masks():
    def masks(x):
        idx = torch.nonzero(x > 0.5)  # nonzero
        big = x[x > 0.5]  # mask
        sel = torch.masked_select(x, x < 0.1)  # select
        x[x > 0.9] = 0.0  # one value through a mask: a masked_fill, no sync
        return idx, big, sel

    report = sim(masks, torch.rand(1000))
    assert only(report, "sync", "nonzero").line == line_of(masks, "# nonzero")
    lines = {f.line for f in report.select("sync", "bool-mask")}
    assert lines == {line_of(masks, "# mask"), line_of(masks, "# select")}
    f = report.select("sync", "bool-mask", line=line_of(masks, "# mask"))[0]
    assert f.ops == ("aten.index.Tensor",) and 0 < f.saving_s < f.cost_s


def test_printing_a_gpu_tensor(capsys):
    def show(x, a):
        print(x)  # print
        return f"{a:.2f}"  # format

    report = sim(show, torch.arange(4.0), torch.tensor(0.5))
    assert "tensor([0., 1., 2., 3.])" in capsys.readouterr().out
    lines = [f.line for f in report.select("sync", "print")]
    assert sorted(lines) == [line_of(show, "# print"), line_of(show, "# format")]
    assert [f.count for f in report.findings] == [1, 1]


def test_non_blocking_copy_into_pageable_memory_syncs_and_pinned_does_not():
    def to_host(x):
        a = x.to("cpu", non_blocking=True)  # pageable
        buf = torch.empty(x.shape, pin_memory=True)
        buf.copy_(x, non_blocking=True)  # pinned
        return a, buf

    x = torch.rand(1000, 1000)
    report = sim(to_host, x)
    f = only(report, "sync", "pageable-nonblocking")
    assert f.line == line_of(to_host, "# pageable")
    assert report.select(line=line_of(to_host, "# pinned")) == []
    pageable = H200.transfer_time(x.numel() * 4, "cuda:0", "cpu:0", pinned=False)
    pinned = H200.transfer_time(x.numel() * 4, "cuda:0", "cpu:0", pinned=True)
    assert f.cost_s == pytest.approx(pageable)
    assert f.saving_s == pytest.approx(pageable - pinned)


def test_blocking_copy_into_pageable_memory():
    def to_host(x):
        return x.cpu(), x.to("cpu")  # copies

    report = sim(to_host, torch.rand(256, 256))
    f = only(report, "pageable-copy")
    assert f.line == line_of(to_host, "# copies") and f.count == 2
    assert "pin_memory=True" in f.fix and f.saving_s > 0


# -- ping-pong -------------------------------------------------------------------------------
def test_ping_pong_both_ways_and_not_when_computed_in_between():
    def trips(x):
        y = x.cpu()
        z = y.cuda()  # device-host-device
        h = torch.ones(8)
        back = h.cuda().cpu()  # host-device-host
        w = (x.cpu() * 2).cuda()  # computed between
        return z, back, w

    report = sim(trips, torch.rand(64))
    lines = {f.line for f in report.select("ping-pong")}
    assert lines == {line_of(trips, "# device-host-device"), line_of(trips, "# host-device-host")}
    f = report.select("ping-pong", line=line_of(trips, "# device-host-device"))[0]
    assert f"test_doctor.py:{line_of(trips, 'y = x.cpu()')}" in f.message
    assert f.saving_s == pytest.approx(f.cost_s) and f.cost_s > 0


# -- GPU scalars -----------------------------------------------------------------------------
def test_w2_gpu_scalar_and_its_fix():
    def w2(A, a1):
        return a1 * A + a1 ** 2  # w2

    report = sim(w2, torch.rand(600, 600), torch.tensor(10.0))
    f = only(report, "gpu-scalar")
    assert f.line == line_of(w2, "# w2") and f.count == 3
    assert f.ops == ("aten.mul.Tensor", "aten.pow.Tensor_Scalar", "aten.add.Tensor")
    pow_node = gpu_node(aten.pow.Tensor_Scalar, TensorMeta.make((), device="cuda:0"),
                        meta=TensorMeta.make((), device="cuda:0"))
    assert f.saving_s == pytest.approx(H200.node_time(pow_node, "cuda:0"))
    assert kinds(report) == {"gpu-scalar"}

    fixed = sim(lambda A, a: a * A + a ** 2, torch.rand(600, 600), 10.0)
    assert fixed.findings == []


def test_scalars_made_inside_the_function():
    def inside(A, B):
        r0, r1 = torch.tensor(10, device="cuda"), torch.tensor(30, device="cuda")
        B[:] = A[r0:r1, r0:r1]  # bounds
        a1 = torch.tensor(10.0, device="cuda")
        return a1 * A + a1 ** 2  # scalar

    report = sim(inside, torch.rand(60, 60), torch.zeros(20, 20))
    f = only(report, "sync", "slice-bound")
    assert f.line == line_of(inside, "# bounds") and f.count == 4
    assert only(report, "gpu-scalar").line == line_of(inside, "# scalar")


def test_a_tensor_made_from_python_data_on_the_gpu_each_call_is_a_copy_the_host_waits_for():
    """``torch.tensor(0.01, device=x.device)`` in the function: the number is copied from
    pageable host memory at every call (it had been seen only as a GPU scalar operand, costing
    nothing); made once outside, nothing is said."""
    def per_call(x):
        lr = torch.tensor(0.01, device=x.device)  # made here
        return x - lr * x.sign()

    report = sim(per_call, torch.rand(600, 600))
    f = only(report, "host-data")
    assert f.line == line_of(per_call, "# made here") and f.count == 1
    assert f.cost_s > 0 and f.saving_s == pytest.approx(f.cost_s)
    assert "copied to cuda:0 from pageable host memory" in report.to_text()
    assert "make it once, outside the function" in report.to_text()
    lr = 0.01
    assert sim(lambda x: x - lr * x.sign(), torch.rand(600, 600)).select("host-data") == []


def test_a_scalar_computed_on_the_gpu_is_no_gpu_scalar():
    def normalise(x):
        return x / x.sum()

    assert sim(normalise, torch.rand(600, 600)).select("gpu-scalar") == []


# -- tiny GPU ops ----------------------------------------------------------------------------
def test_tiny_matmul_is_faster_on_the_host_big_one_is_not():
    def mms(x, y, a):
        small = x @ y  # small
        big = a @ a  # big
        return small, big

    report = sim(mms, torch.rand(5, 10), torch.rand(10, 5), torch.rand(512, 512))
    f = only(report, "tiny-gpu-op")
    assert f.line == line_of(mms, "# small") and f.ops == ("aten.mm",)
    g = Graph("t")
    x = g.input(TensorMeta.make((5, 10), device="cuda:0"))
    y = g.input(TensorMeta.make((10, 5), device="cuda:0"))
    mm = g.call(aten.mm.default, (x, y), meta=TensorMeta.make((5, 5), device="cuda:0"))
    assert f.saving_s == pytest.approx(H200.node_time(mm, "cuda:0") - H200.node_time(mm, "cpu:0"))


def test_a_tiny_op_on_a_value_computed_on_the_gpu_stays_there():
    """Its input would have to come back first: a sync and a transfer cost more than launch."""
    def mms(a, y):
        z = a @ a
        return z[:5, :10] @ y  # tiny after big

    report = sim(mms, torch.rand(512, 512), torch.rand(10, 5))
    assert report.select("tiny-gpu-op") == []


def test_a_chain_of_tiny_ops_is_counted_per_call():
    def chain(x):
        for _ in range(10):
            x = x * 1.01 + 0.5  # chain
        return x

    report = sim(chain, torch.rand(64))
    f = only(report, "tiny-gpu-op")
    assert f.line == line_of(chain, "# chain") and f.count == 20


# -- simulation ------------------------------------------------------------------------------
def test_code_naming_cuda_runs_on_the_host_with_believed_devices():
    seen = {}

    def gpu_code(x):
        y = torch.ones(3, device="cuda") + x.cuda()
        seen.update(device=y.device, is_cuda=y.is_cuda, host=y.cpu().device,
                    pinned=torch.empty(3, pin_memory=True).is_pinned(), moved=y.to("cuda:1").device,
                    host_pinned=torch.empty(3).is_pinned(), value=y.cpu())
        return y

    report = doctor(gpu_code, torch.arange(3.0), machine="h200x2", inputs_on="cuda:0")
    assert report.simulated
    assert seen["device"] == torch.device("cuda:0") and seen["is_cuda"]
    assert seen["host"] == torch.device("cpu")
    assert seen["pinned"] and not seen["host_pinned"]
    assert seen["moved"] == torch.device("cuda:1")
    assert torch.equal(seen["value"], torch.arange(3.0) + 1)


def test_simulation_refuses_gpus_the_machine_lacks():
    with pytest.raises(DoctorError, match="cuda:5"):
        doctor(lambda x: x, torch.ones(1), machine="h200x2", inputs_on="cuda:5")
    with pytest.raises(DoctorError, match="inputs_on='cpu'"):
        doctor(lambda x: x, torch.ones(1), machine="h200x2", inputs_on="cpu")
    with pytest.raises(DoctorError, match="has no cuda:7"):
        doctor(lambda: torch.ones(1, device="cuda:7"), machine="h200x2", inputs_on="cuda:0")
    with pytest.raises(DoctorError, match="unknown machine"):
        doctor(lambda x: x, torch.ones(1), machine="h300x9", inputs_on="cuda:0")


# -- the report ------------------------------------------------------------------------------
def test_json_round_trip_and_text():
    def w(A, a1, r0):
        y = A[r0:] * a1  # both
        return y.sum().item()  # read

    report = sim(w, torch.rand(50, 50), torch.tensor(2.0), torch.tensor(3))
    again = DoctorReport.from_json(report.to_json())
    assert again == report and again.findings and isinstance(again.findings[0].ops, tuple)
    assert json.loads(report.to_json())["format"] == "autopar-doctor"
    text = report.to_text()
    assert f"test_doctor.py:{line_of(w, '# both')}" in text
    assert f"test_doctor.py:{line_of(w, '# read')}" in text
    assert "per call" in text and "fix:" in text and "[simulated]" in text
    with pytest.raises(ValueError, match="not an autopar doctor report"):
        DoctorReport.from_json("{}")


# -- files and the CLI -----------------------------------------------------------------------
def cli(*args: str):
    app = typer.Typer()
    app.command("doctor")(doctor_command)

    @app.callback()
    def _root() -> None:  # keeps "doctor" a subcommand, as in autopar's app
        pass

    return CliRunner().invoke(app, ["doctor", *args])


def test_cli_finds_w1_syncs_and_w2_scalar_in_the_example():
    result = cli(str(EXAMPLE), "--machine", "h200x2", "--json")
    assert result.exit_code == 0, result.output
    w1, w2 = (DoctorReport.from_dict(d) for d in json.loads(result.stdout))
    assert (w1.target, w2.target) == ("w1", "w2")
    assert w1.simulated == (not torch.cuda.is_available())  # --machine h200x2 without CUDA
    f = only(w1, "sync", "slice-bound")
    assert (f.file, f.line) == (str(EXAMPLE), line_in(EXAMPLE, "B[:] = A[r0:r1, c0:c1]"))
    assert f.count == 4 and f.saving_s == pytest.approx(4 * read_s())
    g = only(w2, "gpu-scalar")
    assert g.line == line_in(EXAMPLE, "return a1 * A + a1 ** 2") and g.saving_s > 0


def test_cli_text_names_the_lines():
    result = cli(str(EXAMPLE), "--machine", "h200x2", "--func", "w2")
    assert result.exit_code == 0, result.output
    line = line_in(EXAMPLE, "return a1 * A + a1 ** 2")
    assert f"w1_w2_user_code.py:{line}" in result.stdout
    assert "autopar doctor: w2" in result.stdout and "autopar doctor: w1" not in result.stdout


def test_cli_without_a_gpu_says_how_to_simulate(monkeypatch):
    monkeypatch.setenv("AUTOPAR_NO_MEASURE", "1")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    result = cli(str(EXAMPLE))
    assert result.exit_code == 2 and "--machine h200x2" in result.stderr


def test_file_with_main_and_prints(tmp_path):
    user = tmp_path / "user.py"
    user.write_text(
        "import torch\n"
        "x = torch.rand(100, device='cuda')\n"
        "def main():\n"
        "    print('hello from main')\n"
        "    return x.max().item()\n")
    result = cli(str(user), "--machine", "h200x2", "--json")
    assert result.exit_code == 0, result.output
    assert "hello from main" not in result.stdout and "hello from main" in result.stderr
    (report,) = (DoctorReport.from_dict(d) for d in json.loads(result.stdout))
    assert only(report, "sync", "item").line == 5


def test_a_users_function_that_raises_is_a_failed_run_not_a_misuse(tmp_path):
    user = tmp_path / "user.py"
    user.write_text("import torch\n\ndef f(x):\n    raise RuntimeError('boom')\n\n"
                    "def example_inputs():\n    return (torch.rand(4, 4),)\n")
    result = cli(str(user), "--func", "f")
    assert result.exit_code == 1 and "boom" in result.stderr, result.output


def test_a_plain_script_runs_whole_as_a_profiler_runs_it(tmp_path):
    """No ``main`` and no ``__doctor__``: the file runs once as ``__main__``, watched."""
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\n"
                     "x = torch.randn(8, 8, device='cuda')\n"
                     "if __name__ == '__main__':\n"
                     "    print('main block', x.sum().item())\n")
    result = cli(str(plain), "--machine", "h200x2")
    assert result.exit_code == 0, result.output
    assert "1 watched call;" in result.stdout and "plain.py:4 in <module>" in result.stdout
    assert "main block" in result.stderr  # the script's prints stay off the report


def test_file_errors_say_what_to_pass(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("def helper(x):\n    return x\n")
    result = cli(str(empty), "--machine", "h200x2", "--func", "nope")
    assert result.exit_code == 2 and "'helper'" in result.stderr
    result = cli(str(empty), "--machine", "h200x2", "--func", "helper")
    assert result.exit_code == 2 and "example_inputs()" in result.stderr
    result = cli(str(tmp_path / "missing.py"))
    assert result.exit_code == 2 and "no such file" in result.stderr


def test_cli_takes_host_inputs_to_a_simulated_gpu_as_its_hint_says(tmp_path, monkeypatch):
    """Host tensors from example_inputs() run on a simulated GPU with --inputs-on (the hint
    for a host without a GPU named only --machine, which left every value on the host)."""
    monkeypatch.setenv("AUTOPAR_NO_MEASURE", "1")
    user = tmp_path / "host.py"
    user.write_text("import torch\n"
                    "def example_inputs():\n"
                    "    return (torch.randn(64, 64),)\n"
                    "def main(x):\n"
                    "    return x.sin()\n")
    plain = cli(str(user), "--machine", "h200x2", "--json")
    moved = cli(str(user), "--machine", "h200x2", "--inputs-on", "cuda:0", "--json")
    assert plain.exit_code == 0 and moved.exit_code == 0, (plain.output, moved.output)
    (before,), (after,) = (map(DoctorReport.from_dict, json.loads(r.stdout))
                           for r in (plain, moved))
    assert any("no value was on a GPU" in n for n in before.notes)
    assert not any("no value was on a GPU" in n for n in after.notes)
    assert any(f.kind == "tiny-gpu-op" and f.line == 5 for f in after.findings)


def test_example_inputs_as_a_tuple(tmp_path):
    user = tmp_path / "tup.py"
    user.write_text(
        "import torch\n"
        "__doctor__ = ['f']\n"
        "def f(x, n):\n"
        "    return x[:n].sum()\n"
        "def example_inputs():\n"
        "    return torch.rand(10, device='cuda'), torch.tensor(3, device='cuda')\n")
    (report,) = doctor_file(user, machine="h200x2", repeat=1)
    assert only(report, "sync", "slice-bound").line == 4
