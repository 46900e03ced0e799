"""autopar doctor on a real GPU: every hazard kind, found at its line, with measured syncs.

Skipped without CUDA. Costs are estimated with the h200x2 preset (no calibration needed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from autopar.cli.commands.doctor import doctor as doctor_command
from autopar.doctor import DoctorReport, Finding, doctor
from test_doctor import line_in, line_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "w1_w2_user_code.py"


def real(fn, *args, repeat: int = 2) -> DoctorReport:
    report = doctor(fn, *args, machine="h200x2", repeat=repeat)
    assert not report.simulated
    return report


def only(report: DoctorReport, kind: str, subkind: str | None = None) -> Finding:
    found = report.select(kind, subkind)
    assert len(found) == 1, report.to_text()
    return found[0]


def cuda(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, device="cuda")


def test_item_is_measured_per_call():
    def items(x):
        return sum(x[i].item() for i in range(3))  # item

    f = only(real(items, cuda(4)), "sync", "item")
    assert (f.file, f.line) == (__file__, line_of(items, "# item")) and f.count == 3
    assert f.cost_source == "measured" and f.cost_s > 0 and f.saving_s > 0


def test_w1_slice_bounds():
    def w1(A, B, r0, r1, c0, c1):
        B[:] = A[r0:r1, c0:c1]  # w1
        return B

    A, B = cuda(600, 600), cuda(256, 256)
    bounds = [torch.tensor(v, device="cuda") for v in (100, 356, 100, 356)]
    report = real(w1, A, B, *bounds)
    f = only(report, "sync", "slice-bound")
    assert f.line == line_of(w1, "# w1") and f.count == 4 and f.cost_source == "measured"
    assert torch.equal(B, A[100:356, 100:356])
    assert real(w1, A, B, 100, 356, 100, 356).findings == []


def test_branch_and_index():
    def control(x, i):
        if x.sum() > 0:  # branch
            x = x * 2
        return [10, 20, 30][i]  # index

    report = real(control, cuda(100_000), torch.tensor(1, device="cuda"))
    assert only(report, "sync", "branch").line == line_of(control, "# branch")
    assert only(report, "sync", "index").line == line_of(control, "# index")


def test_nonzero_and_masks():
    def masks(x):
        idx = torch.nonzero(x > 0.5)  # nonzero
        big = x[x > 0.5]  # boolmask
        x[x > 0.9] = 0.0  # one value through a mask is a masked_fill: no sync
        return idx, big

    report = real(masks, cuda(100_000))
    assert only(report, "sync", "nonzero").line == line_of(masks, "# nonzero")
    assert only(report, "sync", "bool-mask").line == line_of(masks, "# boolmask")


def test_print(capsys):
    def show(x):
        print(x)  # print

    report = real(show, torch.arange(4.0, device="cuda"))
    assert "tensor([0., 1., 2., 3.], device='cuda:0')" in capsys.readouterr().out
    assert only(report, "sync", "print").line == line_of(show, "# print")


def test_pageable_copies_and_pinned_buffers():
    def to_host(x):
        a = x.to("cpu", non_blocking=True)  # nonblocking
        b = x.cpu()  # blocking
        buf = torch.empty(x.shape, pin_memory=True)
        buf.copy_(x, non_blocking=True)  # pinned
        torch.cuda.current_stream().synchronize()
        return a, b, buf

    report = real(to_host, cuda(1000, 1000))
    assert only(report, "sync", "pageable-nonblocking").line == line_of(to_host, "# nonblocking")
    assert only(report, "pageable-copy").line == line_of(to_host, "# blocking")
    assert report.select(line=line_of(to_host, "# pinned")) == []


def test_ping_pong():
    def trips(x):
        z = x.cpu().cuda()  # trip
        w = (x.cpu() * 2).cuda()  # computed between
        return z, w

    report = real(trips, cuda(64))
    assert only(report, "ping-pong").line == line_of(trips, "# trip")


def test_w2_gpu_scalar():
    def w2(A, a1):
        return a1 * A + a1 ** 2  # w2

    A = cuda(600, 600)
    f = only(real(w2, A, torch.tensor(10.0, device="cuda")), "gpu-scalar")
    assert f.line == line_of(w2, "# w2") and f.count == 3 and f.saving_s > 0
    assert real(w2, A, 10.0).findings == []


def test_scalars_made_inside_the_function():
    def inside(A, B):
        r0, r1 = torch.tensor(100, device="cuda"), torch.tensor(356, device="cuda")
        B[:] = A[r0:r1, r0:r1]  # bounds
        a1 = torch.tensor(10.0, device="cuda")
        return a1 * A + a1 ** 2  # scalar

    report = real(inside, cuda(600, 600), cuda(256, 256))
    assert only(report, "sync", "slice-bound").line == line_of(inside, "# bounds")
    assert only(report, "gpu-scalar").line == line_of(inside, "# scalar")


def test_tiny_matmul_and_big_work_without_hazards():
    def mms(x, y, a):
        small = x @ y  # small
        return small, (a @ a).relu_()

    report = real(mms, cuda(5, 10), cuda(10, 5), cuda(1024, 1024))
    assert only(report, "tiny-gpu-op").line == line_of(mms, "# small")
    assert real(lambda a: (a @ a).relu_(), cuda(1024, 1024)).findings == []


def test_simulation_on_a_gpu_host():
    def w1(A, B, r0, r1):
        B[:] = A[r0:r1]

    report = doctor(w1, torch.rand(30, 4), torch.zeros(10, 4), torch.tensor(10),
                    torch.tensor(20), machine="h200x2", inputs_on="cuda:0")
    assert report.simulated and only(report, "sync", "slice-bound").count == 2


def test_cli_on_the_example():
    app = typer.Typer()
    app.command("doctor")(doctor_command)

    @app.callback()
    def _root() -> None:
        pass

    result = CliRunner().invoke(app, ["doctor", str(EXAMPLE), "--machine", "h200x2", "--json"])
    assert result.exit_code == 0, result.output
    w1, w2 = (DoctorReport.from_dict(d) for d in json.loads(result.stdout))
    assert not w1.simulated
    f = only(w1, "sync", "slice-bound")
    assert f.line == line_in(EXAMPLE, "B[:] = A[r0:r1, c0:c1]") and f.count == 4
    assert only(w2, "gpu-scalar").line == line_in(EXAMPLE, "return a1 * A + a1 ** 2")
