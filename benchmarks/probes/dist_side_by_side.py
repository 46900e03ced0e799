"""DDP compiled whole against autopar's compiled regions, side by side in one torchrun world.

    torchrun --standalone --nproc-per-node 2 benchmarks/probes/dist_side_by_side.py

Two twins of a GPT-2 (2 layers, 4 x 32), trained alternately step by step: one under
``torch.compile(DistributedDataParallel(model))`` on each rank's rows, one under
``autopar.data_parallel(step, candidates="inductor")`` passed the global batch. Prints each
way's median step (a barrier before each) and, per way, the ops that take the most time and
the collectives a step makes (``torch.profiler``, 5 steps, rank 0).
"""

import statistics
import time

import torch
import torch.distributed as dist
import transformers
from torch.profiler import profile

import autopar


def make():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, n_layer=2,
                                  n_head=2, n_embd=64, vocab_size=128, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    (a, opt_a), (b, opt_b) = make(), make()
    ddp = torch.compile(torch.nn.parallel.DistributedDataParallel(a))
    mine = ids[rank * 2:(rank + 1) * 2]

    def ddp_step():
        opt_a.zero_grad()
        loss = ddp(input_ids=mine, labels=mine).loss
        loss.backward()
        opt_a.step()

    def step(ids):
        opt_b.zero_grad()
        loss = b(input_ids=ids, labels=ids).loss
        loss.backward()
        opt_b.step()

    ours = autopar.data_parallel(step, candidates="inductor")
    ways = {"DDP compiled": ddp_step, "autopar inductor": lambda: ours(ids)}
    for _ in range(5):
        for f in ways.values():
            f()
    times = {name: [] for name in ways}
    for _ in range(40):
        for name, f in ways.items():
            dist.barrier()
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    if rank == 0:
        print(", ".join(f"{n} {statistics.median(t) * 1e3:.2f} ms" for n, t in times.items()))
    for name, f in ways.items():
        with profile() as p:
            for _ in range(5):
                f()
        if rank == 0:
            top = sorted(p.key_averages(), key=lambda e: -e.cpu_time_total)[:10]
            print(name + ": " + " | ".join(f"{e.key[:40]} {e.cpu_time_total / 5e3:.2f} ms"
                                           for e in top))
            comms = {e.key: e.count / 5 for e in p.key_averages() if e.key.startswith("gloo:")}
            print(f"  collectives a step: {comms}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
