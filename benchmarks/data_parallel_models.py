"""Real models' training steps (as users write them: ``nn.Module``, ``torch.optim``,
``zero_grad``/``backward``/``step``) with the batch split by ``autopar.data_parallel``, and
their inference under ``no_grad`` (what ``autopar.compile(model)``'s split way runs), predicted
on a preset: eager on one GPU against the best split, and the planning time.

    python benchmarks/data_parallel_models.py [--machines h200x2 h200x8] [--models ...]
                                              [--worlds h200x2 h200x8 2xh200x8]
                                              [--json out.json]

Two tables. The first: one process splitting the step over its GPUs (one thread issues every
GPU's work). The second: one process per GPU under ``torchrun`` (:func:`predict_world_step`:
each rank's share predicted on one GPU, its gradients all-reduced in buckets over NVLink and,
between nodes, each GPU's NIC), on each ``--worlds`` preset (``2xh200x8``: two nodes).
Both are against the best one-GPU way (``/unspl``) and eager on one GPU (``ratio``). The
second also gives a replica's memory (parameters, gradients, optimizer state), the way the
run would take (replicated under DDP, or sharded by FSDP2 where a replica takes more than half
a GPU) and the other way's predicted step. Strong
scaling: the ranks share the model's batch (the issue's targets); weak: each rank takes that
batch (samples a second, as DDP's published scaling is measured).

Models: GPT-2 small (124M parameters, batch 16 x 512, AdamW; ``gpt2-fused``: with
``fused=True``, its update one kernel; inference 64 x 512) and a
ResNet-50 (Hugging Face's ResNet, the torchvision-shaped default config, batch 256 x 224 x 224,
SGD with momentum; inference the same batch). The trace runs on fake tensors: nothing of the
step is computed here (the optimizer's state is made by one step on zero gradients).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

try:
    import autopar  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from autopar.dataparallel import predict_step, predict_world_step
from autopar.ir.units import fmt_seconds


def _with_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Make the optimizer's state (Adam's moments, SGD's momentum) without a real step."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()


def gpt2_small(fused: bool = False) -> tuple:
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused)
    _with_state(model, opt)
    ids = torch.randint(0, 50257, (16, 512))

    def step(ids):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.detach()
    return f"GPT-2 small, 16x512, AdamW{' fused' if fused else ''}", step, (ids,), (0,)


def resnet50() -> tuple:
    import transformers

    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(transformers.ResNetConfig()).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    _with_state(model, opt)
    images, labels = torch.randn(256, 3, 224, 224), torch.randint(0, 1000, (256,))

    def step(images, labels):
        opt.zero_grad()
        loss = model(pixel_values=images, labels=labels).loss
        loss.backward()
        opt.step()
        return loss.detach()
    return "ResNet-50, 256x224x224, SGD momentum", step, (images, labels), (0, 1)


def gpt2_infer() -> tuple:
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    ids = torch.randint(0, 50257, (64, 512))

    def infer(ids):
        return model(input_ids=ids).logits
    return "GPT-2 small inference, 64x512", infer, (ids,), (0,)


def resnet50_infer() -> tuple:
    import transformers

    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(transformers.ResNetConfig()).eval()
    images = torch.randn(256, 3, 224, 224)

    def infer(images):
        return model(pixel_values=images).logits
    return "ResNet-50 inference, 256x224x224", infer, (images,), (0,)


INFERENCE = ("gpt2-infer", "resnet50-infer")  # traced under no_grad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machines", nargs="*", default=["h200x2", "h200x8"])
    ap.add_argument("--models", nargs="+", default=["gpt2", "resnet50", *INFERENCE])
    ap.add_argument("--worlds", nargs="*", default=["h200x2", "h200x8", "2xh200x8"])
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    makers = {"gpt2": gpt2_small, "gpt2-fused": lambda: gpt2_small(fused=True),
              "resnet50": resnet50, "gpt2-infer": gpt2_infer,
              "resnet50-infer": resnet50_infer}
    rows = []
    # eager: each op its own kernel on one GPU; unsplit: autopar's plan on one GPU, fused as
    # the executor runs it; split: the kept candidate (ratio against eager, and against unsplit)
    print(f"{'model':40s} {'machine':8s} {'eager':>10s} {'unsplit':>10s} {'split':>10s} "
          f"{'ratio':>6s} {'/unspl':>6s} {'devices':>6s} {'plan s':>7s}")
    for key in a.models:
        name, step, args, batch = makers[key]()
        for machine in a.machines:
            start = time.perf_counter()
            with torch.set_grad_enabled(key not in INFERENCE):
                got = predict_step(step, args, machine, batch_argnums=batch)
            planning = time.perf_counter() - start
            sharded = got.choice.sharded
            k = 1 if sharded is None else len(sharded.devices)
            unsplit = got.choice.predicted["unsplit"]
            row = {"model": name, "machine": machine, "eager_s": got.eager_s,
                   "unsplit_s": unsplit, "predicted_s": got.predicted_s,
                   "ratio": got.eager_s / got.predicted_s,
                   "ratio_unsplit": unsplit / got.predicted_s,
                   "devices": k, "planning_s": planning, "candidates_s": got.choice.predicted,
                   "unsplit": dict(sharded.unsplit) if sharded is not None else None}
            rows.append(row)
            print(f"{name:40s} {machine:8s} {fmt_seconds(got.eager_s):>10s} "
                  f"{fmt_seconds(unsplit):>10s} {fmt_seconds(got.predicted_s):>10s} "
                  f"{row['ratio']:5.2f}x {row['ratio_unsplit']:5.2f}x {k:6d} "
                  f"{planning:7.1f}", flush=True)
    worlds = _worlds(a, makers) if a.worlds else []
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows,
                                      "worlds": worlds}, indent=1, default=str))
        print(f"wrote {a.json}")
    return 0


def _worlds(a: argparse.Namespace, makers: dict) -> list[dict]:
    """One process per GPU under torchrun, on each ``--worlds`` preset (training only)."""
    rows = []
    print(f"\n{'model (torchrun, a process a GPU)':40s} {'world':9s} {'scaling':7s} {'ranks':>5s} "
          f"{'1 GPU':>10s} {'rank':>10s} {'comm':>9s} {'exposed':>9s} {'ratio':>6s} "
          f"{'/unspl':>6s} {'replica':>8s} {'way':>9s} {'other':>10s} {'plan s':>7s}")
    for key in a.models:
        if key in INFERENCE:
            continue
        name, step, args, batch = makers[key]()
        for machine, scaling in [(m, s) for m in a.worlds for s in ("strong", "weak")]:
            start = time.perf_counter()
            got = predict_world_step(step, args, machine, batch_argnums=batch, scaling=scaling)
            planning = time.perf_counter() - start
            w = got.world
            row = {"model": name, "world": machine, "scaling": scaling,
                   "ranks": got.fabric.ranks,
                   "one_gpu_s": got.one_gpu_s, "eager_s": got.eager_s,
                   "predicted_s": w.step_s, "compute_s": w.compute_s, "update_s": w.update_s,
                   "comm_s": w.comm_s, "exposed_s": w.exposed_s, "buckets": w.buckets,
                   "ratio": got.ratio_eager, "ratio_unsplit": got.ratio,
                   "replica_bytes": got.replica_bytes, "sharded_bytes": got.sharded_bytes,
                   "gpu_bytes": got.gpu_bytes, "sharded": got.sharded,
                   "other_s": got.other.step_s if got.other else None,
                   "planning_s": planning}
            rows.append(row)
            print(f"{name:40s} {machine:9s} {scaling:7s} {got.fabric.ranks:5d} "
                  f"{fmt_seconds(got.one_gpu_s):>10s} {fmt_seconds(w.step_s):>10s} "
                  f"{fmt_seconds(w.comm_s):>9s} {fmt_seconds(w.exposed_s):>9s} "
                  f"{got.ratio_eager:5.2f}x {got.ratio:5.2f}x "
                  f"{got.replica_bytes / 2**30:6.2f}G "
                  f"{'sharded' if got.sharded else 'replica':>9s} "
                  f"{fmt_seconds(got.other.step_s) if got.other else '':>10s} {planning:7.1f}",
                  flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
