"""BERT (a small config) trained for masked language modelling with AdamW, written for one
device: padded rows, and a random 15% of tokens predicted, so each rank's share holds another
number of tokens to average over.

    python examples/distributed/bert_adamw.py
    torchrun --standalone --nproc-per-node 2 examples/distributed/bert_adamw.py

``--out FILE`` saves the losses, weights and optimizer state (rank 0).
"""

import argparse

import torch
from transformers import BertConfig, BertForMaskedLM

import autopar

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch", type=int, default=5)
parser.add_argument("--out", default=None)
args = parser.parse_args()

torch.manual_seed(0)
config = BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=64,
                    intermediate_size=128, vocab_size=128, max_position_embeddings=32,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model = BertForMaskedLM(config)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def step(ids, mask, labels):
    opt.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    opt.step()
    return loss.detach()


step = autopar.data_parallel(step)
data = torch.Generator().manual_seed(1)
losses = []
for _ in range(args.steps):
    ids = torch.randint(1, config.vocab_size, (args.batch, 16), generator=data)
    lengths = torch.randint(4, 17, (args.batch,), generator=data)
    mask = (torch.arange(16) < lengths[:, None]).long()
    chosen = (torch.rand(ids.shape, generator=data) < 0.15) & mask.bool()
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    losses.append(float(step(ids * mask, mask, labels)))
print("losses", " ".join(f"{x:.6f}" for x in losses))

if args.out and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
    torch.save({"losses": losses, "model": model.state_dict(), "opt": opt.state_dict(),
                "parameters": [name for name, _ in model.named_parameters()]}, args.out)
