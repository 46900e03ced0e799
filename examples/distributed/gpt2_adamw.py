"""GPT-2 (a small config) trained with AdamW, written for one device.

    python examples/distributed/gpt2_adamw.py                                   # one process
    torchrun --standalone --nproc-per-node 2 examples/distributed/gpt2_adamw.py # two ranks
    autopar run examples/distributed/gpt2_adamw.py                               # every GPU

Every rank builds the same global batch; autopar gives each its rows, and the losses, weights
and optimizer state are one process's. ``--out FILE`` saves them (rank 0).
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import autopar

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch", type=int, default=5)
parser.add_argument("--out", default=None)
args = parser.parse_args()

torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=32,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: exact
model = GPT2LMHeadModel(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(ids):
    opt.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


step = autopar.data_parallel(step)
data = torch.Generator().manual_seed(1)
losses = []
for _ in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (args.batch, 16), generator=data)
    losses.append(float(step(ids)))
print("losses", " ".join(f"{x:.6f}" for x in losses))

if args.out and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
    torch.save({"losses": losses, "model": model.state_dict(), "opt": opt.state_dict(),
                "parameters": [name for name, _ in model.named_parameters()]}, args.out)
