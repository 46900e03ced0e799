"""Every compile function in COMPILERS must pass every case of the corpus (tests/corpus.py).

To test a new executor or policy, add one line to COMPILERS. ``aot_eager`` is the reference: a
case that fails there is a defect of the case (or of PyTorch), not of autopar. It and the cases
tagged "slow" run only with AUTOPAR_SLOW=1, to keep the default run short.

The rest of this file tests the harness itself: it passes with the identity, the case flags say
what eager really does, and each kind of wrong result (values, devices, aliasing, gradients,
mutations, module state, cached results, RNG) makes ``run_case`` raise.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

from corpus import (
    CASES,
    CATEGORIES,
    RUN_SEED,
    Case,
    Compiler,
    alias_pattern,
    assert_same,
    autopar_compile,
    autopar_unavailable,
    clone_args,
    module_of,
    policies_unavailable,
    run_case,
    torch_compile_autopar,
)

RUN_SLOW = os.environ.get("AUTOPAR_SLOW") == "1"


def _reference_skipped() -> str | None:
    return None if RUN_SLOW else "the aot_eager reference runs with AUTOPAR_SLOW=1"


def _fused_skipped() -> str | None:
    if not RUN_SLOW:
        return "fusion on the CPU runs with AUTOPAR_SLOW=1 (Inductor compiles every case)"
    return autopar_unavailable()


COMPILERS: list[Compiler] = [
    Compiler("aot_eager", lambda fn: torch.compile(fn, backend="aot_eager"), _reference_skipped),
    Compiler("torch.compile-autopar", torch_compile_autopar, autopar_unavailable),
    Compiler("autopar.compile", autopar_compile(), autopar_unavailable),
    Compiler("autopar-fused-cpu0", autopar_compile(devices="cpu:0", fuse=True),
             _fused_skipped),
    *(Compiler(f"autopar-cpu0-cpu1-{p}", autopar_compile(devices=["cpu:0", "cpu:1"], policy=p),
               policies_unavailable) for p in ("single", "round_robin", "heft")),
]


def case_params(cases: list[Case]) -> list[Any]:
    """pytest params for cases: ids are names; "slow" cases skip unless AUTOPAR_SLOW=1."""
    slow = pytest.mark.skipif(not RUN_SLOW, reason="slow case: set AUTOPAR_SLOW=1 to run it")
    return [pytest.param(c, id=c.name, marks=[slow] if "slow" in c.tags else []) for c in cases]


def compiler_params(compilers: list[Compiler]) -> list[Any]:
    return [pytest.param(c, id=c.name) for c in compilers]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("case", case_params(CASES))
@pytest.mark.parametrize("compiler", compiler_params(COMPILERS))
def test_matches_eager(compiler: Compiler, case: Case) -> None:
    why = compiler.unavailable()
    if why:
        pytest.skip(why)
    run_case(case, compiler.compile)


# ---------------------------------------------------------------------------------------------
# the corpus itself


def test_corpus_covers_every_category() -> None:
    names = [c.name for c in CASES]
    assert len(names) == len(set(names)), "case names must be unique"
    assert len(CASES) >= 45
    for category, tags in CATEGORIES.items():
        assert any(set(tags) & c.tags for c in CASES), f"no case for {category!r}"
    assert {"w4_two_chains", "tensor_scalar_w2", "w1_slice_assign", "results_to_cpu_w5",
            "train_step_sgd", "graph_break_item"} <= set(names)


@pytest.mark.parametrize("case", case_params(CASES))
def test_harness_passes_with_identity(case: Case) -> None:
    run_case(case, lambda fn: fn)


@dataclass(frozen=True)
class EagerProfile:
    """What eager really does with a case (calls 0 and 1, as run_case makes them)."""

    outputs: tuple[Any, Any]
    has_tensor_output: bool
    grad_output: bool
    aliases: bool
    mutated_inputs: bool
    state_changed: bool
    seed_sensitive: bool
    varies_between_calls: bool


def _same(a: Any, b: Any) -> bool:
    try:
        assert_same(a, b, "", {"atol": 0.0, "rtol": 0.0})
    except AssertionError:
        return False
    return True


def _state(made: Any) -> dict[str, torch.Tensor]:
    mod = module_of(made)
    return {} if mod is None else {k: v.detach().clone() for k, v in mod.state_dict().items()}


def _run_eager(case: Case, run_seed: int, calls: int = 2) -> tuple[list[Any], Any, list[tuple]]:
    fn, made = case.build("cpu", None)
    outs, argss = [], []
    for k in range(calls):
        args = case.inputs("cpu", seed=k)
        torch.manual_seed(run_seed + k)
        outs.append(fn(*args))
        argss.append(args)
    return outs, made, argss


@cache
def eager_profile(case: Case) -> EagerProfile:
    fn, made = case.build("cpu", None)
    state0 = _state(made)
    outs, mutated, aliases = [], False, False
    for k in range(2):
        args = case.inputs("cpu", seed=k)
        before = clone_args(args)
        torch.manual_seed(RUN_SEED + k)
        out = fn(*args)
        outs.append(out)
        mutated |= not _same(before, args)
        aliases |= any(p != ((), ()) for p in alias_pattern(out, args))
    leaves = [t for t in tree_flatten(outs[0])[0] if isinstance(t, torch.Tensor) and t.numel()]
    other_seed = _run_eager(case, RUN_SEED + 100, calls=1)[0][0]
    return EagerProfile(
        outputs=(outs[0], outs[1]),
        has_tensor_output=bool(leaves),
        grad_output=any(t.requires_grad for t in leaves),
        aliases=aliases,
        mutated_inputs=mutated,
        state_changed=not _same(state0, _state(made)),
        seed_sensitive=not _same(outs[0], other_seed),
        varies_between_calls=not _same(outs[0], outs[1]),
    )


@pytest.mark.parametrize("case", case_params(CASES))
def test_case_flags_match_eager(case: Case) -> None:
    p = eager_profile(case)
    assert p.mutated_inputs == case.mutates_inputs, f"{case.name}: mutates_inputs is wrong"
    assert p.seed_sensitive == case.random, f"{case.name}: random is wrong"
    if case.requires_grad:
        assert p.grad_output, f"{case.name}: requires_grad but no output requires grad"
    if case.training_step:
        assert p.state_changed, f"{case.name}: a training step that leaves the parameters alone"
    assert p.has_tensor_output or p.mutated_inputs or p.state_changed, (
        f"{case.name}: nothing a wrong compiled function could get wrong")
    if case.random:
        again = _run_eager(case, RUN_SEED, calls=1)[0][0]
        assert _same(p.outputs[0], again), f"{case.name}: not reproducible under a fixed seed"


# ---------------------------------------------------------------------------------------------
# wrong compile functions that the harness must catch


def _wrap(post: Callable[[Any], Any]) -> Callable[[Callable], Callable]:
    def compile_fn(fn: Callable) -> Callable:
        def run(*args: Any) -> Any:
            return post(fn(*args))
        return run
    return compile_fn


def _perturb(t: Any) -> Any:
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return t
    if t.dtype == torch.bool:
        return ~t
    if t.is_floating_point():
        return t + (1e-3 if t.element_size() >= 4 else 0.1)
    return t + 1


def _leaves(fn: Callable[[torch.Tensor], Any]) -> Callable[[Any], Any]:
    return lambda out: tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, out)


def _drop_input_mutations(fn: Callable) -> Callable:
    return lambda *args: fn(*clone_args(args))


def _stale_cache(fn: Callable) -> Callable:
    first: list[Any] = []

    def run(*args: Any) -> Any:
        if not first:
            first.append(fn(*args))
        return first[0]
    return run


def _reseed(fn: Callable) -> Callable:
    def run(*args: Any) -> Any:
        torch.manual_seed(987)
        return fn(*args)
    return run


def _restore_module_state(fn: Callable) -> Callable:
    mod = module_of(fn)

    def run(*args: Any) -> Any:
        saved = {k: v.detach().clone() for k, v in mod.state_dict().items()}
        out = fn(*args)
        mod.load_state_dict(saved)
        return out
    return run


MUTANTS: dict[str, tuple[Callable[[Callable], Callable], Callable[[Case, EagerProfile], bool]]] = {
    "perturbed values": (_wrap(_leaves(_perturb)), lambda c, p: p.has_tensor_output),
    "outputs on another device": (_wrap(_leaves(lambda t: t.to("meta"))),
                                  lambda c, p: p.has_tensor_output),
    "outputs in float64": (_wrap(_leaves(lambda t: t.double() if t.is_floating_point() else t)),
                           lambda c, p: p.has_tensor_output and any(
                               t.dtype != torch.float64 and t.is_floating_point()
                               for t in tree_flatten(p.outputs[0])[0]
                               if isinstance(t, torch.Tensor))),
    "detached outputs": (_wrap(_leaves(torch.Tensor.detach)), lambda c, p: p.grad_output),
    "outputs copied (aliasing lost)": (_wrap(_leaves(torch.clone)), lambda c, p: p.aliases),
    "input mutations dropped": (_drop_input_mutations,
                                lambda c, p: c.kind == "function" and p.mutated_inputs),
    "module state updates dropped": (_restore_module_state,
                                     lambda c, p: c.kind == "factory" and p.state_changed),
    "first result cached": (_stale_cache, lambda c, p: c.kind != "program"
                            and p.varies_between_calls),
    "random ops reseeded": (_reseed, lambda c, p: c.kind != "program" and p.seed_sensitive),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_harness_detects_wrong_results(mutant: str) -> None:
    compile_fn, applies = MUTANTS[mutant]
    runnable = [c for c in CASES if RUN_SLOW or "slow" not in c.tags]
    cases = [c for c in runnable if applies(c, eager_profile(c))]
    assert cases, f"no case to try {mutant!r} on"
    missed = []
    for c in cases:
        try:
            run_case(c, compile_fn)
        except AssertionError as e:
            assert str(e).startswith(f"[{c.name}]"), f"{c.name}: unclear message: {e}"
        else:
            missed.append(c.name)
    assert not missed, f"{mutant}: run_case passed a wrong compile function on {missed}"


def test_harness_detects_small_error_in_w4() -> None:
    """The brief's example: 1e-3 added to every output of W4 must not pass."""
    w4 = next(c for c in CASES if c.name == "w4_two_chains")
    with pytest.raises(AssertionError, match=r"^\[w4_two_chains\] call 1 of 2: output leaf 0"):
        run_case(w4, _wrap(_leaves(lambda t: t + 1e-3)))
