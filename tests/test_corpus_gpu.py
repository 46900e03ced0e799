"""The eager-equality corpus (tests/corpus.py) on CUDA: inputs on cuda:0, eager on one copy,
each compile function on the other. Skips cleanly on machines without CUDA (or with one GPU, for
the two-GPU tests).

To test a new executor or policy on GPUs, add one line to GPU_COMPILERS or TWO_GPU_COMPILERS.
"""

from __future__ import annotations

import pytest
import torch

from corpus import (
    CASES,
    Case,
    Compiler,
    autopar_compile,
    autopar_unavailable,
    case,
    policies_unavailable,
    run_case,
    torch_compile_autopar,
)

POLICIES = ("single", "round_robin", "heft")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("fresh_dynamo"),
]
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

GPU_COMPILERS: list[Compiler] = [
    Compiler("aot_eager", lambda fn: torch.compile(fn, backend="aot_eager")),
    Compiler("torch.compile-autopar", torch_compile_autopar, autopar_unavailable),
    Compiler("autopar.compile", autopar_compile(), autopar_unavailable),
    *(Compiler(f"autopar-cpu0-cuda0-{p}", autopar_compile(devices=["cpu:0", "cuda:0"], policy=p),
               policies_unavailable) for p in POLICIES),
]

TWO_GPU_COMPILERS: list[Compiler] = [
    Compiler(f"autopar-cuda0-cuda1-{p}", autopar_compile(devices=["cuda:0", "cuda:1"], policy=p),
             policies_unavailable) for p in POLICIES
]

TWO_GPU_CASES = ["w4_two_chains", "w4_two_chains_large", "results_to_cpu_w5", "train_step_sgd",
                 "train_loop_adam", "matmul_sizes_w3", "tensor_scalar_w2", "w1_tensor_bounds"]


def _cases(cases: list[Case]) -> list:
    return [pytest.param(c, id=c.name) for c in cases]


def _compilers(compilers: list[Compiler]) -> list:
    return [pytest.param(c, id=c.name) for c in compilers]


@pytest.mark.parametrize("case", _cases(CASES))
def test_harness_passes_with_identity_on_cuda(case: Case) -> None:
    run_case(case, lambda fn: fn, device="cuda:0")


@pytest.mark.parametrize("case", _cases(CASES))
@pytest.mark.parametrize("compiler", _compilers(GPU_COMPILERS))
def test_matches_eager_on_cuda(compiler: Compiler, case: Case) -> None:
    why = compiler.unavailable()
    if why:
        pytest.skip(why)
    run_case(case, compiler.compile, device="cuda:0")


@needs_two_gpus
@pytest.mark.parametrize("case", _cases([case(n) for n in TWO_GPU_CASES]))
@pytest.mark.parametrize("compiler", _compilers(TWO_GPU_COMPILERS))
def test_matches_eager_on_two_gpus(compiler: Compiler, case: Case) -> None:
    """Inputs on cuda:0 as the user wrote them; autopar may use both GPUs, results stay put."""
    why = compiler.unavailable()
    if why:
        pytest.skip(why)
    run_case(case, compiler.compile, device="cuda:0")
