"""The OpInfo sweep of ``tests/test_opinfo.py``, run in a process of its own: importing torch's
test utilities changes process-wide state (``torch.backends.disable_global_flags()``), which
later tests in the same process would trip over.

Prints one JSON line: the samples eager ran, and each one that raised under autopar where
eager and ``aot_eager`` ran (``"op[k]: error"``).
"""

import json
import logging
import warnings

import torch
from torch.testing._internal.common_methods_invocations import op_db

import autopar

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
            variant = f".{op.variant_test_name}" if op.variant_test_name else ""
            yield f"{op.name}{variant}[{k}]", op, sample


def _raises(fn, call) -> str | None:
    try:
        fn(*call)
    except Exception as e:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}"
    return None


def main() -> None:
    logging.disable(logging.ERROR)
    warnings.simplefilter("ignore")
    failed, ran = [], 0
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
    print(json.dumps({"ran": ran, "failed": failed}))


if __name__ == "__main__":
    main()
