"""PyTorch's OpInfo database through ``autopar.compile`` on two CPU workers: nothing may raise
where eager succeeds (and ``aot_eager`` does: an op torch's own tracing can't take is exempt).

Each op with float32 samples on the CPU, its first ``SAMPLES`` samples, each called once through
``autopar.compile(fn, devices="cpu:0,cpu:1", policy="round_robin")`` with eager and autopar's
way as the candidates: the capture, the plan and the check of the capturing call's results
against eager's all run. A capture that fails where eager runs must run eagerly (the
Dispatcher's fallback), sparse and complex-half outputs included. Values are not compared here:
random and uninitialized (``empty``) outputs differ by design; the Dispatcher compares the
capturing call's results itself and keeps eager where they differ.
"""

import logging
import warnings

import pytest
import torch

import autopar

pytest.importorskip("expecttest")  # torch's OpInfo module imports it
from torch.testing._internal.common_methods_invocations import op_db

SAMPLES = 2


def _samples():
    for op in op_db:
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
        except Exception:  # the database's own samples that can't be built here
            continue
        for k, sample in enumerate(samples[:SAMPLES]):
            yield f"{op.name}{'.' + op.variant_test_name if op.variant_test_name else ''}[{k}]", \
                op, sample


def _raises(fn, call) -> str | None:
    try:
        fn(*call)
    except Exception as e:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}"
    return None


def test_nothing_raises_under_autopar_where_eager_runs(caplog):
    caplog.set_level(logging.ERROR)
    failed, ran = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, op, sample in _samples():
            def fn(x, *args, op=op, kw=sample.kwargs):
                return op.op(x, *args, **kw)
            call = (sample.input, *sample.args)
            if _raises(fn, call) is not None:
                continue  # eager raises: not autopar's to run
            ran += 1
            compiled = autopar.compile(fn, devices="cpu:0,cpu:1", policy="round_robin",
                                       candidates=["eager", "autopar"])
            why = _raises(compiled, call)
            if why is not None and _raises(torch.compile(fn, backend="aot_eager"), call) is None:
                failed.append(f"{name}: {why}")
            torch._dynamo.reset()  # each sample's own trace, as a fresh function's
    assert ran > 1000, ran  # the database is there, and its samples run
    assert failed == [], "\n".join(failed)
