"""Shared small training setups for tests/train."""
from __future__ import annotations

import functools

import torch
from torch import nn

from fewbits.train import Engine, Telemetry


@functools.lru_cache(maxsize=1)
def digits():
    from fewbits.study.tasks import digits_data
    return digits_data()


def mlp(hidden=64, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def train_digits(policy, steps, make_opt, loss_mult=1.0, batch=128, seed=0, hidden=64, every=10):
    """Train an MLP on scikit-learn digits; returns (mean loss of the last 20 steps, engine, losses).
    loss_mult multiplies the loss that is back-propagated (the reported loss is unmultiplied)."""
    x, y = digits()
    model = mlp(hidden, seed)
    engine = Engine(model, make_opt(model.parameters()), policy, telemetry=Telemetry(every=every), seed=seed)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,), generator=g)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        engine.train_step(loss * loss_mult)
        losses.append(float(loss.detach()))
    return sum(losses[-20:]) / 20, engine, losses
