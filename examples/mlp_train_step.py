"""W6: one training step of a 2-layer MLP, written for one device.

    autopar explain examples/mlp_train_step.py:step --machine h200x2 --inputs-on cuda:0 --run \
        --graph docs/mlp_train_step.png
"""

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4096, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def step(x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def example_inputs():
    return torch.randn(8192, 4096), torch.randint(0, 10, (8192,))
