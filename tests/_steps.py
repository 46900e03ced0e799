"""Small training steps written as a user writes them for one device, and their inputs; how many
blocks the real models of the model tests have where it is fewer than the tiny size's."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mlp_inputs(batch: int = 7, d_in: int = 6, hidden: int = 5, classes: int = 3,
               seed: int = 0) -> tuple:
    """W6's arguments at a small size: (w1, b1, w2, b2) requiring grad, then x and labels t."""
    g = torch.Generator().manual_seed(seed)
    params = (torch.randn(hidden, d_in, generator=g), torch.randn(hidden, generator=g),
              torch.randn(classes, hidden, generator=g), torch.randn(classes, generator=g))
    x = torch.randn(batch, d_in, generator=g)
    t = torch.randint(0, classes, (batch,), generator=g)
    return (*(p.requires_grad_() for p in params), x, t)


def small_net(device: str) -> torch.nn.Module:
    """A 32-64-8 MLP with GELU on ``device``, the same weights every time."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 8)).to(device)


def batches_on(device: str, n: int, seed: int = 1):
    """``n`` batches ``(x, y)`` of 64 rows for :func:`small_net`, drawn on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    for _ in range(n):
        yield (torch.randn(64, 32, device=device, generator=g),
               torch.randint(0, 8, (64,), device=device, generator=g))


def module_step(model: torch.nn.Module, opt: torch.optim.Optimizer):
    """A training step as users write it over ``model`` and ``opt``: cross-entropy of
    ``model(x)`` against labels ``y``, ``backward()``, ``opt.step()``."""
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def scaler_step(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler, device_type: str,
                dtype: torch.dtype = torch.float16):
    """:func:`module_step` under ``dtype`` autocast with a ``GradScaler``: scaled backward,
    ``scaler.step(opt)``, ``scaler.update()``."""
    def step(x, y):
        opt.zero_grad()
        with torch.autocast(device_type, dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()
    return step


def bn_step(w, gamma, beta, x):
    """A linear layer, batch norm over the batch (training mode), SGD on all three."""
    h = F.batch_norm(x @ w.t(), None, None, gamma, beta, training=True)
    loss = torch.relu(h).sum()
    loss.backward()
    with torch.no_grad():
        for p in (w, gamma, beta):
            p -= 0.1 * p.grad
            p.grad = None
    return loss.detach()


def bn_inputs(batch: int = 7) -> tuple:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(4, 3, generator=g).requires_grad_(),
            torch.rand(4, generator=g).add(0.5).requires_grad_(),
            torch.randn(4, generator=g).requires_grad_(), torch.randn(batch, 3, generator=g))


BLOCKS = {"t5": 1}
"""Blocks a stack of the real models whose tests build fewer than the tiny size's two
(``MODELS[name].make("tiny", layers=BLOCKS.get(name))``): T5's training step is twice a
decoder-only model's graph, and one encoder and one decoder block make the tests' point at
about half their CI time (28 and 43 s with two on 2026-12-03's VM)."""
