"""A training loop whose rank 1 fails on purpose, for ``tests/test_distributed.py``.

``python _dist_faults.py raise|kill|wait PIDDIR``: at step 3 rank 1 raises (``raise``), is
killed by SIGKILL (``kill``), or every rank trains on until stopped (``wait``). Each rank
writes its pid to PIDDIR first.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import autopar

mode, piddir = sys.argv[1], Path(sys.argv[2])
(piddir / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
model = torch.nn.Linear(8, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step(x, y, k):
    if k == 3 and os.environ["RANK"] == "1" and mode == "raise":
        raise ValueError("a bad batch, on purpose")
    if k == 3 and os.environ["RANK"] == "1" and mode == "kill":
        os.kill(os.getpid(), 9)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


step = autopar.data_parallel(step)
for k in range(10**6):
    step(torch.randn(4, 8), torch.randint(0, 3, (4,)), k)
    if mode == "wait":
        time.sleep(0.05)
