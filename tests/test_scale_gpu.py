"""benchmarks/scale.py's workloads on real GPUs at small size: autopar equals eager (and the
tiled Cholesky equals torch.linalg.cholesky) with inputs on cuda:0, on one GPU and on two."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("benchmarks_scale_gpu", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("name", ["chains", "ensemble4", "cholesky"])
def test_measured_row_on_gpus(scale, name, gpus, fresh_dynamo):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    case = scale.CASES[name](gpus, "small")
    row = scale.ScaleRow(name, case.scaling, gpus, scale.NOT_RUN, scale.PRESET_FOR[gpus])
    scale.measure_case(case, scale.gpu_names(gpus), 3, row)  # raises if a result differs
    assert row.status == "measured" and row.autopar_s > 0 and row.host_s > 0
    used = next(n for n in row.notes if n.startswith("devices used: "))
    assert set(used.removeprefix("devices used: ").split(",")) <= set(scale.gpu_names(gpus))
