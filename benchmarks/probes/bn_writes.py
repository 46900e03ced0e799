"""Which batch-norm ops write the running statistics they are given, and which of them a
training step's trace holds (NOTES 2026-12-05 (b)): on CUDA each of
``_native_batch_norm_legit_functional``, ``native_batch_norm`` and ``cudnn_batch_norm`` run
once on fresh statistics, then the ops of HF ResNet's captured SGD step whose name says
``batch_norm``.

    PYTHONPATH=src python benchmarks/probes/bn_writes.py [--device cuda]

On the H200 (torch 2.11, 2026-12-05): the functional op writes nothing, the other two write
the running mean; before ef4848b the step's trace held ``cudnn_batch_norm`` x16, after it the
functional op.
"""

from __future__ import annotations

import argparse
import collections

import torch


def writes(device: str) -> dict[str, str]:
    x = torch.randn(4, 8, 5, 5, device=device)
    w, b = torch.ones(8, device=device), torch.zeros(8, device=device)
    out = {}
    for name in ("_native_batch_norm_legit_functional", "native_batch_norm",
                 "cudnn_batch_norm"):
        rm, rv = torch.zeros(8, device=device), torch.ones(8, device=device)
        try:
            getattr(torch.ops.aten, name).default(x, w, b, rm, rv, True, 0.1, 1e-5)
            out[name] = "writes running_mean" if bool(rm.abs().sum() > 0) else "writes nothing"
        except Exception as e:  # cuDNN's op on a host without cuDNN
            out[name] = f"fails: {type(e).__name__}"
    return out


def traced(device: str) -> dict[str, int]:
    from autopar.bench.models import MODELS, inputs_for, train_step, without_dropout
    from autopar.capture.state import find_state
    from autopar.capture.step import capture_step

    m = MODELS["hf-resnet"]
    model = without_dropout(m.make("tiny").train().to(device))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    kwargs = inputs_for(m, "tiny", batch=4, device=device)[1]
    step = train_step(model, opt, list(kwargs))
    step(*kwargs.values())  # SGD makes its momentum buffers
    args = tuple(kwargs.values())
    graph = capture_step(step, args, state=find_state(step, args)).graph
    return dict(collections.Counter(str(n.op) for n in graph.ops if "batch_norm" in str(n.op)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    print(f"torch {torch.__version__} on {a.device}")
    for name, what in writes(a.device).items():
        print(f"  {name}: {what}")
    print("  the step's trace:", traced(a.device))


if __name__ == "__main__":
    main()
