"""A ResNet (Hugging Face's, a small config) with batch norm, trained with SGD and momentum,
written for one device. Under torchrun each batch-norm layer normalizes with the whole batch's
statistics, as one process does.

    python examples/distributed/resnet_sgd.py
    torchrun --standalone --nproc-per-node 2 examples/distributed/resnet_sgd.py

``--out FILE`` saves the losses, weights, running statistics and optimizer state (rank 0).
"""

import argparse

import torch
from transformers import ResNetConfig, ResNetForImageClassification

import autopar

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch", type=int, default=5)
parser.add_argument("--out", default=None)
args = parser.parse_args()

torch.manual_seed(0)
config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                      layer_type="basic", num_labels=10)
model = ResNetForImageClassification(config)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def step(images, labels):
    opt.zero_grad()
    loss = model(pixel_values=images, labels=labels).loss
    loss.backward()
    opt.step()
    return loss.detach()


step = autopar.data_parallel(step)
data = torch.Generator().manual_seed(1)
losses = []
for _ in range(args.steps):
    images = torch.randn(args.batch, 3, 32, 32, generator=data)
    labels = torch.randint(0, config.num_labels, (args.batch,), generator=data)
    losses.append(float(step(images, labels)))
print("losses", " ".join(f"{x:.6f}" for x in losses))

if args.out and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
    torch.save({"losses": losses, "model": model.state_dict(), "opt": opt.state_dict(),
                "parameters": [name for name, _ in model.named_parameters()]}, args.out)
