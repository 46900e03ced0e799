"""Real models, side by side: eager, ``torch.compile`` (default and reduce-overhead) and
``autopar.compile``, per model and mode, accuracy first.

    python benchmarks/models.py [MODEL ...] [--modes infer,bf16,train] [--size small]
                                [--json out.json] [--variants eager,compile,autopar]

Modes: ``infer`` (fp32 under ``no_grad``), ``bf16`` (``no_grad`` under
``torch.autocast(<device>, torch.bfloat16)``), ``train`` (a step with ``torch.optim.AdamW``:
zero_grad, loss, backward, step, compiled whole), ``train-fused`` (the same with
``AdamW(fused=True)``) and ``train-sgd`` (SGD with momentum 0.9 and
``clip_grad_norm_(1.0)`` before the step), ``train-module`` (the AdamW step with the model
compiled and the step around it eager: ``model = torch.compile(model)``, the commonest
form); ``generate`` (causal LMs: ``model.generate`` of ``GENERATE_TOKENS`` greedy tokens
with the model's ``forward`` compiled, as Hugging Face's docs show; pass where every token is
eager's); ``infer-varlen`` and ``train-varlen`` (text
models: ``infer`` and ``train`` over a sequence of ``VARLEN_CALLS`` calls, each of a length
drawn from ``[length // 2, length]``, as an eval loop or dynamic padding brings them: every
call's outputs, or loss, checked against eager's; ``median_s`` the median call of the
sequence's second half, each call synchronized, ``first_s`` the whole sequence, compiles and
trials in it; the variants' calls interleaved call by call in one process, each variant's
model with a ``forward`` of its own code, as dynamo keeps its entries and its recompile limit
per code object; before 2026-12-04 each variant ran in a process of its own, and this
host's pace differs by up to 2x between processes). Each (model, mode)
runs in a process of its own (a crash or a hang costs one row): it checks every variant
against eager (pass or fail, and why; in inference on its first three calls, as a racing
kernel can be right once), then times those that passed in interleaved rounds
(``measure_side_by_side``), after autopar's trials are over (``settle``); ``first_s`` is
each variant's first call (for autopar: until its choice is settled); "settled after" is
autopar's calls and seconds from a signature's first call to its way kept (``verdict_calls``,
``verdict_s``: the slowest signature's, from the Dispatcher's ``settled``). The table ends with
the pass rate and, per mode, the geomean of autopar against eager, against
``torch.compile`` default, against reduce-overhead and against the strongest of the three
(``best``; each row names its strongest peer and says where autopar ties it), and, for rows
that kept autopar's own plan, the simulator's prediction against the measured time.
Models come from ``autopar.bench.models`` (Hugging Face from small configs; torchvision and
timm where installed). fp32 with TF32 off.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

try:
    from autopar.choose import results_differ
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from autopar.choose import results_differ

MODES = ("infer", "bf16", "train", "train-fused", "train-sgd", "train-module", "generate",
         "infer-varlen", "train-varlen")
GENERATE_TOKENS = 32
VARLEN_CALLS = 240  # calls of a varying-length row, each of a length drawn anew (a
# trial of ~1 ms calls counts up to TRIAL_MAX_CALLS of each way: the second half is after it)
SIM_TOL = 0.2  # the simulator's goal: each kept plan predicted within 20% of its measured time
VARIANTS = ("eager", "compile", "compile-ro", "autopar")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _outputs(out: Any) -> list[torch.Tensor]:
    from autopar.bench.models import flat_tensors

    return [t.detach().float() for t in flat_tensors(out)]


def _close(got: list[torch.Tensor], want: list[torch.Tensor], mode: str) -> str | None:
    """The trial's own check (:func:`autopar.choose.results_differ`), bf16's bound in bf16."""
    return results_differ(got, want, low_precision=mode == "bf16")


def _same_step(step: Any, model: torch.nn.Module, opt: Any, args: tuple, kwargs: dict,
               clip: float | None = None) -> str | None:
    """Why one call of ``step`` differs from an eager step taken from the same parameters and
    optimizer state (on a copy), or None: the loss and every parameter after it."""
    from autopar.bench.models import fixed_step

    twin = copy.deepcopy(model)
    twin_opt = type(opt)(twin.parameters())
    # its hyperparameters and state too, copied (load_state_dict keeps the very tensors)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    loss = fixed_step(twin, twin_opt, args, kwargs, clip)()
    bad = _close([step().float()], [loss.float()], "train")
    if bad:
        return f"loss: {bad}"
    # all parameters as one vector: Adam turns a gradient that is zero but for rounding (a
    # key bias's) into a step of lr either way, far from eager's relative to a bias near zero
    got = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    want = torch.cat([p.detach().float().flatten() for p in twin.parameters()])
    return _close([got], [want], "train")


def _changed_state(model: torch.nn.Module, base: torch.nn.Module) -> str:
    """Inference's parameters and buffers that differ from the model's they were copied from
    (" (parameters and buffers as built)" where none does): a way that wrote into them would
    pass the trial's check (eager then runs on the same tensors) and be wrong after."""
    want = dict(base.state_dict())
    bad = [k for k, v in model.state_dict().items()
           if k in want and not torch.equal(v, want[k])]
    if not bad:
        return " (parameters and buffers as built)"
    return f" ({len(bad)} parameters or buffers changed: {', '.join(bad[:4])})"


def _optimizer(mode: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """A training mode's optimizer for ``model`` (see the module's docstring)."""
    if mode == "train-sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=mode == "train-fused" or None)


def _clip(mode: str) -> float | None:
    """The gradient norm a training mode clips to (None: no clipping)."""
    return 1.0 if mode == "train-sgd" else None


def _variant(name: str, fn: Any) -> Any:
    """Variant ``name`` of ``fn``; a training step's compiled variants each compile a copy of
    its code (dynamo keeps entries per code object: the variants of one step would otherwise
    check each other's guards and share one recompile limit; a model's frames stay shared)."""
    import autopar
    from autopar.capture.dynamo import with_own_code

    if name == "eager":
        return fn
    fn = with_own_code(fn)
    if name == "compile":
        return torch.compile(fn)
    if name == "compile-ro":
        return torch.compile(fn, mode="reduce-overhead")
    return autopar.compile(fn)


def _cells(row: dict[str, Any], variants: list[str]) -> Any:
    """Each variant's name and its cell, eager first (its results are the reference), each
    cell put in ``row["variants"]``."""
    for name in ["eager", *[v for v in variants if v != "eager"]]:
        cell: dict[str, Any] = {}
        row["variants"][name] = cell
        yield name, cell


def _settle(d: Any, call: Any, cell: dict[str, Any], out: Any = None) -> Any:
    """Call autopar's variant until its trials are over (at most ``SETTLE_CALLS`` calls: its
    ``Dispatcher`` ``d``, None where there is none), as compiling is before timing; its cell
    gets the ways kept and, from ``explain``, each trial's medians and each way left out and
    why. The last call's result (``out`` where none was made)."""
    from autopar.bench.harness import SETTLE_CALLS

    for _ in range(SETTLE_CALLS):
        if d is None or not d.trials:
            break
        out = call()
    cell["kept"] = sorted(set(d.kept.values())) if d is not None else []
    if d is not None:
        cell["explain"] = d.explain()
        if d.settled:  # the trial's price: calls and seconds to the last signature's verdict
            cell["verdict_calls"] = max(calls for calls, _ in d.settled.values())
            cell["verdict_s"] = max(seconds for _, seconds in d.settled.values())
    return out


def _failure(e: Exception) -> str:
    """A variant's failure, for its cell: the exception's type and first line."""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}" if str(e).strip() \
        else type(e).__name__


def _time(row: dict[str, Any], prepared: dict[str, tuple[Any, tuple]], gpus: list[int],
          warmup: int, repeat: int) -> None:
    """Time the variants that passed side by side, each median into its cell of ``row``."""
    from autopar.bench.harness import measure_side_by_side

    times = measure_side_by_side(prepared, warmup=warmup, repeat=repeat, sync_devices=gpus,
                                 min_sample_s=0.02, min_total_s=0.3)
    for name, stats in times.items():
        if isinstance(stats, Exception):
            row["variants"][name]["fail"] = f"while timing: {type(stats).__name__}: {stats}"
            row["variants"][name].pop("pass", None)
        else:
            row["variants"][name]["median_s"] = stats.median


def run_varlen(model_name: str, mode: str, size: str, variants: list[str], batch: int | None,
               length: int) -> dict[str, Any]:
    """One (model, ``*-varlen`` mode): each variant runs the same sequence of lengths from the
    same parameters (and optimizer state), every call checked against eager's and timed."""
    import random

    from autopar.api import dispatcher_of
    from autopar.bench.harness import in_process_compiles
    from autopar.bench.models import MODELS, available, inputs_for, train_step, without_dropout
    from autopar.capture.dynamo import with_own_code

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    in_process_compiles()
    m = MODELS[model_name]
    row: dict[str, Any] = {"model": model_name, "mode": mode, "variants": {}}
    why = available(m) or ("no sequence length to vary" if m.family == "vision" else None)
    if why:
        row["skipped"] = why
        return row
    dev = _device()
    b = batch or (8 if size == "small" else 3)
    draw = random.Random(0)
    lengths = [draw.randint(max(2, length // 2), length) for _ in range(VARLEN_CALLS)]
    row["lengths"] = lengths
    batches = [inputs_for(m, size, batch=b, length=n, device=dev, seed=i)[1]
               for i, n in enumerate(lengths)]
    training = mode == "train-varlen"
    base = m.make(size).to(dev)
    if training:
        without_dropout(base.train())
    runs: dict[str, tuple[Any, Any]] = {}  # variant -> (its call, its Dispatcher's owner)
    models: dict[str, Any] = {}
    for name, cell in _cells(row, variants):
        try:
            model = models[name] = copy.deepcopy(base)
            if name != "eager":  # a forward of its own: dynamo keeps entries per code object,
                model.forward = with_own_code(model.forward)  # and its recompile limit
            if training:
                opt = _optimizer("train", model)
                keys = list(batches[0])
                fn = _variant(name, train_step(model, opt, keys, clip=None))

                def call(kw: dict, fn=fn, keys=keys) -> Any:
                    return fn(*(kw[k] for k in keys))
                runs[name] = call, fn
            else:
                compiled = _variant(name, model)

                def call(kw: dict, compiled=compiled) -> Any:
                    with torch.no_grad():
                        return compiled(**kw)
                runs[name] = call, compiled
        except Exception as e:  # one variant's failure is its cell's, not the row's
            cell["fail"] = _failure(e)
    # the variants' calls interleaved, call by call (eager's first: the reference)
    times: dict[str, list[float]] = {name: [] for name in runs}
    want: list[Any] = []
    for i, kw in enumerate(batches):
        for name, (call, _) in runs.items():
            cell = row["variants"][name]
            if "fail" in cell:
                continue
            try:
                t = time.perf_counter()
                out = call(kw)
                if dev == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t)
                got = [out.float()] if training else [o.cpu() for o in _outputs(out)]
            except Exception as e:
                cell["fail"] = f"call {i} (length {lengths[i]}): {_failure(e)}"
                continue
            if name == "eager":
                want.append(got)
            elif (bad := _close(got, want[i], "train" if training else mode)):
                cell["fail"] = f"call {i} (length {lengths[i]}): {bad}"
    want_params = None
    for name, (_, owner) in runs.items():
        cell = row["variants"][name]
        if "fail" in cell:
            continue
        calls = times[name]
        cell["first_s"] = sum(calls)
        cell["median_s"] = sorted(calls[len(calls) // 2:])[len(calls) // 4]
        cell["calls_ms"] = [round(t * 1e3, 2) for t in calls]
        if training:  # the parameters after the sequence, against eager's
            got = torch.cat([p.detach().float().flatten() for p in models[name].parameters()])
            if name == "eager":
                want_params = got
            elif want_params is not None and (bad := _close([got], [want_params], "train")):
                cell["fail"] = f"parameters after {len(lengths)} steps: {bad}"
                continue
        d = dispatcher_of(owner) if name == "autopar" else None
        if d is not None:
            cell["kept"] = sorted(set(d.kept.values()))
            cell["explain"] = d.explain()
        cell["pass"] = True
    return row


def run_generate(model_name: str, size: str, variants: list[str], batch: int | None,
                 length: int) -> dict[str, Any]:
    """One (causal LM, ``generate``): each variant's tokens against eager's, then the medians of
    whole generations, side by side, after autopar's trials are over."""
    from autopar.api import dispatcher_of
    from autopar.bench.harness import in_process_compiles
    from autopar.bench.models import MODELS, available, inputs_for

    torch.backends.cuda.matmul.allow_tf32 = False
    in_process_compiles()
    m = MODELS[model_name]
    row: dict[str, Any] = {"model": model_name, "mode": "generate", "variants": {}}
    why = available(m) or (None if m.family == "causal" else "not a causal LM")
    if why:
        row["skipped"] = why
        return row
    dev = _device()
    _, kwargs = inputs_for(m, size, batch=batch or 8, length=length, device=dev)
    kwargs.pop("labels")
    kwargs["attention_mask"][:] = 1  # no right padding: a decoder generates after its last token
    base = m.make(size).to(dev)
    prepared: dict[str, tuple[Any, tuple]] = {}
    want = None
    for name, cell in _cells(row, variants):
        try:
            model = copy.deepcopy(base)
            forward = model.forward
            model.forward = _variant(name, forward) if name != "eager" else forward

            def call(model=model, scores: bool = False) -> Any:
                with torch.no_grad():
                    return model.generate(**kwargs, max_new_tokens=GENERATE_TOKENS,
                                          do_sample=False, pad_token_id=0,
                                          output_scores=scores, return_dict_in_generate=scores)
            start = time.perf_counter()
            out = call()
            if dev == "cuda":
                torch.cuda.synchronize()
            cell["first_s"] = time.perf_counter() - start
            if name == "autopar":
                _settle(dispatcher_of(model.forward), call, cell, out)
                cell["first_s"] = time.perf_counter() - start
            got = call(scores=True)  # settled: the way that runs from now on
            if want is None:
                want = got
            elif (bad := _tokens_differ(got, want, kwargs["input_ids"].shape[1])):
                if bad.startswith("near tie"):
                    cell["note"] = bad
                else:
                    cell["fail"] = bad
                    continue
            cell["pass"] = True
            prepared[name] = (call, ())
        except Exception as e:  # one variant's failure is its cell's, not the row's
            cell["fail"] = _failure(e)
    _time(row, prepared, [torch.cuda.current_device()] if dev == "cuda" else [], warmup=1,
          repeat=5)
    return row


NEAR_TIE = 1e-3
"""Greedy tokens may part where eager's top two logits are this close (relative to the
step's largest logit) and the variant's logits are within that of eager's: a tie broken by
summation order, not a wrong result."""


def _tokens_differ(got: Any, want: Any, prompt: int) -> str | None:
    """How a generation's tokens differ from eager's (both with scores), or None; a first
    difference at a near-tie of eager's logits (``NEAR_TIE``) is said as ``near tie ...``:
    the tokens match up to there, and later ones follow another text."""
    if torch.equal(got.sequences, want.sequences):
        return None
    row, pos = (got.sequences != want.sequences).nonzero()[0].tolist()
    step = pos - prompt
    mine = torch.stack(got.scores[:step + 1])[:, row].float()
    theirs = torch.stack(want.scores[:step + 1])[:, row].float()
    drift = (mine - theirs).abs().max().item()  # the logits of the common prefix, and there
    top2 = theirs[-1].topk(2).values
    margin = (top2[0] - top2[1]).item()
    scale = theirs[-1].abs().max().item()
    said = (f"tokens differ from eager's, first at [{row}, {pos}]: eager's top two logits "
            f"there {margin:.3g} apart (largest {scale:.3g}); the variant's logits up to "
            f"there within {drift:.3g} of eager's")
    if margin <= NEAR_TIE * scale and drift <= NEAR_TIE * scale:
        return "near tie: " + said
    return said


def run_one(model_name: str, mode: str, size: str, variants: list[str], batch: int | None,
            length: int, warm: bool = False) -> dict[str, Any]:
    """One (model, mode): accuracy of each variant against eager, then their times."""
    if mode.endswith("-varlen"):
        return run_varlen(model_name, mode, size, variants, batch, length)
    if mode == "generate":
        return run_generate(model_name, size, variants, batch, length)
    from autopar.api import dispatcher_of
    from autopar.bench.harness import in_process_compiles
    from autopar.bench.models import (
        MODELS,
        available,
        fixed_step,
        inputs_for,
        without_dropout,
    )

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    in_process_compiles()
    m = MODELS[model_name]
    row: dict[str, Any] = {"model": model_name, "mode": mode, "variants": {}}
    why = available(m)
    if why:
        row["skipped"] = why
        return row
    dev = _device()
    gpus = [torch.cuda.current_device()] if dev == "cuda" else []
    b = batch or (8 if size == "small" else 3)
    args, kwargs = inputs_for(m, size, batch=b, length=length, device=dev)
    base = m.make(size).to(dev)
    training = mode.startswith("train")
    if training and mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    if training:  # dropout draws differ between ways: compare without it
        without_dropout(base.train())
    prepared: dict[str, tuple[Any, tuple]] = {}
    want: list[torch.Tensor] | None = None
    for name, cell in _cells(row, variants):
        try:
            model = copy.deepcopy(base)
            if training:
                opt = _optimizer(mode, model)
                clip = _clip(mode)
                if mode == "train-module":  # the model compiled, the loop around it eager
                    compiled = _variant(name, model)
                    fn = call = fixed_step(compiled, opt, args, kwargs, clip)
                else:
                    fn = call = _variant(name, fixed_step(model, opt, args, kwargs, clip))
            else:
                compiled = _variant(name, model)
                ctx = (lambda: torch.autocast(dev, dtype=torch.bfloat16)) if mode == "bf16" \
                    else None

                def call(compiled=compiled, ctx=ctx):
                    with torch.no_grad():
                        if ctx is None:
                            return compiled(*args, **kwargs)
                        with ctx():
                            return compiled(*args, **kwargs)
            start = time.perf_counter()
            out = call()
            if gpus:
                torch.cuda.synchronize()
            cell["first_s"] = time.perf_counter() - start
            got = [out.float()] if training else _outputs(out)
            if name == "eager":
                want = got
            else:
                bad = _close(got, want, mode)
                if bad:
                    cell["fail"] = bad if training else bad + _changed_state(model, base)
                    if not training:  # a race shows as calls that disagree with each other
                        varies = results_differ(_outputs(call()), _outputs(call()))
                        cell["fail"] += f"; two more calls differ: {varies}" if varies \
                            else "; two more calls agree"
                    continue
                if not training:  # judged on three calls: one right call of a racing kernel
                    for k in (2, 3):  # does not make a variant right (a bf16 ViT's
                        bad = _close(_outputs(call()), want, mode)  # torch.compile)
                        if bad:
                            cell["fail"] = f"call {k}: {bad}"
                            break
                    if bad:
                        continue
            if name == "autopar":  # until its trials are over, as compiling is before timing
                d = dispatcher_of(fn if training and mode != "train-module" else compiled)
                start = time.perf_counter()
                _settle(d, call, cell)
                if gpus:
                    torch.cuda.synchronize()
                cell["settle_s"] = time.perf_counter() - start
                cell["first_s"] += cell["settle_s"]
                if cell["kept"] == ["autopar"]:  # the simulator's time of one call's graphs
                    cell["predicted_s"] = sum(e.plan.placement.predicted_s
                                              for e in d.runner.executors)
                # the way kept is checked too, not only the first call's: in training, one
                # step of it against an eager step from the same parameters and state
                bad = _close(_outputs(call()), want, mode) if not training else \
                    _same_step(call, model, opt, args, kwargs, clip)
                if bad and not training:
                    bad += _changed_state(model, base)
                if bad:
                    cell["fail"] = f"after settling on {cell['kept']}: {bad}"
                    continue
            cell["pass"] = True
            prepared[name] = (call, ())
        except Exception as e:  # one variant's failure is its cell's, not the row's
            cell["fail"] = _failure(e)
    if warm:  # compiling only: the caches on disk serve the timed pass
        return row
    _time(row, prepared, gpus, warmup=2, repeat=7)
    return row


def _geomean(xs: list[float]) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


PEERS = ("eager", "compile", "compile-ro")
"""The ways a user picks by hand; the strongest of them is the one autopar is held to."""
TIE = 0.03
"""Within this fraction of the strongest peer, a row says it ties."""


def strongest(variants: dict[str, Any]) -> tuple[str, float] | None:
    """The fastest peer that passed, and its median."""
    timed = [(variants[k]["median_s"], k) for k in PEERS
             if variants.get(k, {}).get("pass") and variants[k].get("median_s")]
    if not timed:
        return None
    seconds, name = min(timed)
    return name, seconds


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Pass rate and per-mode geomeans of autopar against eager, compile, reduce-overhead and
    the strongest of them (``best``)."""
    ran = [r for r in rows if "skipped" not in r and "error" not in r
           and r["variants"].get("eager", {}).get("pass")]
    passed = [r for r in ran if r["variants"].get("autopar", {}).get("pass")]
    out: dict[str, Any] = {"rows": len(ran), "autopar_pass": len(passed)}
    for mode in MODES:
        vs: dict[str, list[float]] = {"eager": [], "compile": [], "best": [], "compile-ro": []}
        for r in passed:
            if r["mode"] != mode:
                continue
            v = r["variants"]
            a = v["autopar"].get("median_s")
            e = v["eager"].get("median_s")
            c = v.get("compile", {}).get("median_s")
            ro = v.get("compile-ro", {}).get("median_s")
            if a and e:
                vs["eager"].append(e / a)
            if a and c:
                vs["compile"].append(c / a)
            if a and (peer := strongest(v)):
                vs["best"].append(peer[1] / a)
            if a and ro:
                vs["compile-ro"].append(ro / a)
        out[mode] = {k: _geomean(x) for k, x in vs.items()}
    return out


def _fmt(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def table(rows: list[dict[str, Any]], variants: list[str]) -> str:
    head = ("| model | mode | " + " | ".join(variants)
            + " | autopar / strongest peer | kept | settled after | first s |")
    lines = [head, "|" + "---|" * (len(variants) + 6)]
    for r in rows:
        if "skipped" in r or "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | {r.get('skipped') or r['error']} |")
            continue
        v = r["variants"]
        cells = []
        for name in variants:
            c = v.get(name, {})
            cells.append(_fmt(c.get("median_s")) if c.get("pass") else
                         f"FAIL: {c.get('fail', '—')[:60]}")
        a = v.get("autopar", {}).get("median_s")
        peer = strongest(v)
        ratio = "—"
        if a and peer:
            x = peer[1] / a
            ratio = f"{x:.2f}× {peer[0]}" + (" (a tie)" if abs(x - 1) <= TIE else "")
        kept = ",".join(v.get("autopar", {}).get("kept", []))
        first = " / ".join(f"{v[k]['first_s']:.1f}" for k in ("compile", "autopar")
                           if "first_s" in v.get(k, {}))
        a_cell = v.get("autopar", {})
        settled = f"{a_cell['verdict_calls']} calls, {a_cell['verdict_s']:.1f} s" \
            if "verdict_calls" in a_cell else "—"
        lines.append(f"| {r['model']} | {r['mode']} | " + " | ".join(cells)
                     + f" | {ratio} | {kept} | {settled} | {first} |")
    s = summarize(rows)
    lines.append("")
    lines.append(f"autopar matches eager on {s['autopar_pass']} of {s['rows']} rows eager ran.")
    sim = [(r["model"], r["mode"], a["predicted_s"] / a["median_s"]) for r in rows
           if (a := r.get("variants", {}).get("autopar", {})).get("predicted_s")
           and a.get("median_s")]
    if sim:
        within = sum(abs(x - 1) <= SIM_TOL for _, _, x in sim)
        lines.append(f"simulator: predicted within {SIM_TOL:.0%} of measured on {within} of "
                     f"{len(sim)} rows that kept autopar's plan (predicted / measured: "
                     + ", ".join(f"{m} {mode} {x:.2f}" for m, mode, x in sim) + ")")
    for mode in MODES:
        g = s[mode]
        if any(g.values()):
            parts = [f"{k} {g[k]:.2f}×" for k in ("eager", "compile", "best", "compile-ro")
                     if g[k]]
            lines.append(f"{mode}: geomean speed of autopar against " + ", ".join(parts))
    return "\n".join(lines)


def main() -> None:
    from autopar.bench.models import MODELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help=f"default: all of {', '.join(MODELS)}")
    ap.add_argument("--modes", default="infer,bf16,train")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per (model, mode)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--warm-jobs", type=int, default=0,
                    help="first compile every row in this many processes at once (Inductor's "
                    "caches on disk then serve the timed pass; first_s is then a warm start)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # model:mode, in a child process
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    if a.one:
        model, mode = a.one.split(":")
        print(json.dumps(run_one(model, mode, a.size, variants, a.batch, a.length, a.warm)))
        return
    todo = [(model, mode) for model in a.models or list(MODELS) for mode in a.modes.split(",")]

    def command(model: str, mode: str) -> list[str]:
        cmd = [sys.executable, __file__, "--one", f"{model}:{mode}", "--size", a.size,
               "--variants", a.variants, "--length", str(a.length)]
        return cmd + (["--batch", str(a.batch)] if a.batch else [])

    if a.warm_jobs:
        from concurrent.futures import ThreadPoolExecutor

        def warm(t: tuple[str, str]) -> str | None:
            try:
                subprocess.run([*command(*t), "--warm"], capture_output=True, timeout=a.timeout)
            except subprocess.TimeoutExpired:  # its row runs (and times out) on its own later
                return f"{t[0]}:{t[1]}"
            return None

        start = time.perf_counter()
        with ThreadPoolExecutor(a.warm_jobs) as pool:
            slow = [w for w in pool.map(warm, todo) if w]
        print(f"warm pass: {time.perf_counter() - start:.0f} s"
              + (f" (timed out: {', '.join(slow)})" if slow else ""), flush=True)
    def child(model: str, mode: str, cmd: list[str]) -> dict[str, Any]:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                               env={**os.environ, "PYTHONUNBUFFERED": "1",  # trials said,
                                    "AUTOPAR_LOGS": os.environ.get("AUTOPAR_LOGS", "trials")})
        except subprocess.TimeoutExpired as e:  # what the row was doing: its log's last lines
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else \
                e.stderr or ""
            lines = [x for x in err.splitlines() if x.strip()]
            tail = ([x for x in lines if x.startswith("[autopar")] or lines)[-3:]
            return {"model": model, "mode": mode, "error": f"timed out after {a.timeout:.0f} s",
                    "log_tail": tail}
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
        return json.loads(line) if line.startswith("{") else {
            "model": model, "mode": mode,
            "error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1][:200]}"
            if p.stderr.strip() else f"exit {p.returncode}"}

    rows = []
    for model, mode in todo:
        start = time.perf_counter()
        row = child(model, mode, command(model, mode))
        row["wall_s"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(f"{model:18s} {mode:6s} {row['wall_s']:6.1f} s  "
              + (row.get("skipped") or row.get("error") or " ".join(
                  f"{k}={_fmt(c.get('median_s')) if c.get('pass') else 'FAIL'}"
                  for k, c in row["variants"].items())), flush=True)
        for line in row.get("log_tail", []):
            print(f"    {line[:300]}", flush=True)
        if a.json:  # after every row: a run cut short keeps what it measured
            _write(a.json, rows)
    print(table(rows, variants))
    if a.json:
        _write(a.json, rows)


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows, "summary": summarize(rows),
                                "torch": torch.__version__,
                                "device": torch.cuda.get_device_name()
                                if torch.cuda.is_available() else "cpu",
                                "argv": sys.argv}, indent=1))


if __name__ == "__main__":
    main()
