"""Multi-rank prefetch: async all-gathers issued ahead of use, in the same order on every rank."""

from __future__ import annotations

import copy
import os

import torch
from support.dist import run_distributed
from support.engine import tiny_model
from support.gemini import STEPS, adamw_reference, token_batches, train_gemini


def _worker(rank, world, tmp):
    from colossal_lab.engine.plugins import GeminiPlugin

    base = tiny_model()
    batches = token_batches(STEPS, batch=4)
    ref_losses, ref_params = adamw_reference(copy.deepcopy(base), batches)
    out = {}
    for name, kw in {
        # homes in RAM, the compute tier a cache: shards all-gathered ahead of use
        "auto_ram": dict(device_memory_limit=3_000_000),
        # parameters on NVMe: read at one access, all-gathered at the next, used after that
        "auto_nvme": dict(device_memory_limit=300_000, nvme_offload_dir=os.path.join(tmp, f"nv{rank}")),
    }.items():
        plugin = GeminiPlugin(placement_policy="auto", precision="fp32", chunk_size_mb=0.07, max_prefetch=2, **kw)
        _, gm, _, losses = train_gemini(copy.deepcopy(base), batches, plugin, rank, world)
        mean = torch.tensor(losses)
        torch.distributed.all_reduce(mean)
        mean /= world
        sd = gm.state_dict()
        mgr = gm.manager
        out[name] = {"loss_err": max(abs(a - b) for a, b in zip(mean.tolist(), ref_losses)),
                     "param_err": max((sd[k] - v).abs().max().item() for k, v in ref_params.items()),
                     "hits": mgr.prefetch_hits, "sharded": all(c.sharded for c in mgr.chunks),
                     "homes": sorted({c.param_home for c in mgr.chunks})}
        plugin.close()
    return out


def test_two_ranks_prefetch_gathers_and_match(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path), timeout=300)
    for res in results:
        for name, r in res.items():
            assert r["sharded"], name
            assert r["loss_err"] < 1e-4 and r["param_err"] < 1e-4, (name, r)
            assert r["hits"] > STEPS, (name, r)  # chunks were in flight before they were used
        assert "nvme" in res["auto_nvme"]["homes"]
    assert results[0]["auto_ram"]["hits"] == results[1]["auto_ram"]["hits"]  # same schedule on both ranks
