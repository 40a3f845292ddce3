"""Gradient clipping under Gemini: same norms and same training as torch's clip_grad_norm_."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from support.dist import run_distributed
from support.engine import tiny_model
from support.gemini import LR, token_batches

from colossal_lab.engine import Booster
from colossal_lab.engine.plugins import GeminiPlugin

STEPS = 6
MAX = {2.0: 0.5, float("inf"): 0.05}  # below the tiny GPT's gradient norms, so clipping binds


def _reference(model, batches, norm_type):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, norms = [], []
    for x, y in batches:
        _, loss = model(x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX[norm_type], norm_type=norm_type)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _gemini(model, batches, plugin, norm_type, rank=0, world=1):
    booster = Booster(plugin=plugin, mixed_precision="fp32")
    gm, gopt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    losses, norms = [], []
    for x, y in batches:
        b = x.shape[0] // world
        _, loss = gm(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])
        booster.backward(loss, gopt)
        norms.append(float(booster.clip_grad_by_norm(gopt, MAX[norm_type], norm_type=norm_type)))
        gopt.step()
        gopt.zero_grad()
        losses.append(loss.item())
    plugin.close()
    return losses, norms


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_matches_torch_single_process(tmp_path, norm_type):
    base = tiny_model()
    batches = token_batches(STEPS)
    ref_losses, ref_norms = _reference(copy.deepcopy(base), batches, norm_type)
    assert max(ref_norms) > MAX[norm_type]  # clipping binds
    for plugin in (GeminiPlugin(placement_policy="cpu", precision="fp32"),
                   GeminiPlugin(placement_policy="auto", precision="fp32", device_memory_limit=400_000,
                                nvme_offload_dir=str(tmp_path), chunk_size_mb=0.07, max_prefetch=1)):
        losses, norms = _gemini(copy.deepcopy(base), batches, plugin, norm_type)
        assert norms == pytest.approx(ref_norms, rel=1e-4), plugin.placement_policy
        assert losses == pytest.approx(ref_losses, abs=1e-5), plugin.placement_policy


def _worker(rank, world, tmp):
    base = tiny_model()
    batches = token_batches(STEPS, batch=4)
    out = {}
    for norm_type in (2.0, float("inf")):
        ref_losses, ref_norms = _reference(copy.deepcopy(base), batches, norm_type)
        plugin = GeminiPlugin(placement_policy="static", shard_param_frac=0.5, precision="fp32", chunk_size_mb=0.07,
                              nvme_offload_dir=os.path.join(tmp, f"nv{rank}"), nvme_offload_frac=0.5)
        losses, norms = _gemini(copy.deepcopy(base), batches, plugin, norm_type, rank, world)
        mean = torch.tensor(losses)
        torch.distributed.all_reduce(mean)
        mean /= world
        out[str(norm_type)] = {"norm_err": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
                               "loss_err": max(abs(a - b) for a, b in zip(mean.tolist(), ref_losses))}
    return out


def test_clip_two_ranks_sharded_and_replicated_chunks(tmp_path):
    for res in run_distributed(_worker, 2, str(tmp_path), timeout=300):
        for k, r in res.items():
            assert r["norm_err"] < 1e-4 and r["loss_err"] < 1e-4, (k, r)
