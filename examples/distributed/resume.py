"""Elastic restarts: a training script that checkpoints, so that ``torchrun --max-restarts N``
resumes it after a rank fails.

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 \
        examples/distributed/resume.py --checkpoint /tmp/ckpt.pt

torch's agent restarts every rank when one fails; each run starts from the last checkpoint,
so the run ends where an uninterrupted one would. ``--fail-at STEP`` makes rank 1 fail once
at that step (a marker file beside the checkpoint remembers it did).
"""

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F

import autopar

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--checkpoint", type=Path, required=True)
parser.add_argument("--every", type=int, default=2, help="checkpoint every this many steps")
parser.add_argument("--fail-at", type=int, default=None)
parser.add_argument("--out", default=None)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
start = 0
if args.checkpoint.exists():  # every rank reads the same file: they resume in step
    saved = torch.load(args.checkpoint)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    start = saved["step"]


def step(x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


step = autopar.data_parallel(step)
rank = int(os.environ.get("RANK", "0"))
marker = args.checkpoint.with_suffix(".failed")
for k in range(start, args.steps):
    if k == args.fail_at and rank == 1 and not marker.exists():
        marker.touch()
        raise RuntimeError(f"rank 1 fails at step {k}, once, on purpose")
    data = torch.Generator().manual_seed(k)  # step k's batch, whatever run makes it
    loss = step(torch.randn(6, 16, generator=data), torch.randint(0, 4, (6,), generator=data))
    if (k + 1) % args.every == 0 and rank == 0:
        tmp = args.checkpoint.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": k + 1}, tmp)
        tmp.replace(args.checkpoint)  # a reader never sees half a file
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # the checkpoint is written before any rank goes on
print(f"rank {rank} done at step {args.steps}, from step {start}")
if args.out and rank == 0:
    torch.save({"model": model.state_dict()}, args.out)
