"""W4: two chains of matmuls written for one device.

    autopar explain examples/two_chains.py:two_chains --machine h200x2 --inputs-on cuda:0
"""

import torch


def run(x):
    return [x.mm(x) for _ in range(50)]


def two_chains(x1, x2):
    return run(x1), run(x2)


def example_inputs():
    return torch.rand(4000, 4000), torch.rand(4000, 4000)
