"""Gemini's tests share one loop: the tiny GPT trained with fp32 AdamW through ``GeminiPlugin``,
and the same steps in plain PyTorch as the reference it must match."""

from __future__ import annotations

import torch

from colossal_lab.engine import Booster

STEPS = 10
LR = 1e-2


def token_batches(n, batch=4, seq=32, seed=1):
    """``n`` (inputs, targets) pairs of random tokens, the same for every caller with one seed."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (batch, seq), generator=g), torch.randint(0, 256, (batch, seq), generator=g))
            for _ in range(n)]


def adamw_reference(model, batches):
    """Plain PyTorch fp32 AdamW on the full batches: losses and final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for x, y in batches:
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_gemini(model, batches, plugin, rank=0, world=1, on_step=None):
    """The same steps boosted with ``plugin``, each rank on its rows of every batch; returns the
    booster, the boosted model and optimizer, and this rank's losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    booster = Booster(plugin=plugin, mixed_precision="fp32")
    gm, gopt, *_ = booster.boost(model, opt)
    losses = []
    for x, y in batches:
        b = x.shape[0] // world
        _, loss = gm(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
        booster.backward(loss, gopt)
        gopt.step()
        gopt.zero_grad()
        losses.append(loss.item())
        if on_step is not None:
            on_step(gm)
    return booster, gm, gopt, losses
