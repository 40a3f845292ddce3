"""Placement policies: which tier is each chunk's *home* for its parameters and its optimizer state.

Colossal-AI's policy names and meanings (``cuda``, ``cpu``, ``static``, ``auto``; docs/gemini.md,
``placement_policy`` and the ``placement.py`` row). A block that does not fit its preferred tier
spills down the stack; nothing fitting anywhere is an error raised before any memory is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from .chunk import Chunk
from .tiers import TierStack

POLICIES = ("cuda", "cpu", "auto", "static")


@dataclass
class PlacementConfig:
    policy: str = "auto"
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    nvme_offload_frac: float = 0.0
    max_prefetch: int = 2


def optim_block_bytes(c: Chunk) -> int:
    """fp32 master + exp_avg + exp_avg_sq + gradient for this rank's shard (a frozen chunk: the
    master alone)."""
    return 4 * c.shard_size * (1 if c.frozen else 4)


def shares_master(c: Chunk, param_tier: str, optim_tier: str, stack: TierStack) -> bool:
    """An fp32 chunk whose parameter shard and optimizer state share a RAM home on the compute
    device keeps one copy: the parameter shard *is* the fp32 master (4 bytes/parameter saved,
    so 16 bytes/parameter like torch's AdamW)."""
    return c.dtype == torch.float32 and param_tier == optim_tier and param_tier != "nvme" \
        and stack.get(param_tier).device == stack.compute.device


def optim_cost(c: Chunk, tier: str, stack: TierStack) -> int:
    """Bytes the optimizer block of ``c`` adds to ``tier`` given where its parameter lives."""
    return optim_block_bytes(c) - (c.shard_bytes if shares_master(c, c.param_home, tier, stack) else 0)


def working_set_bytes(chunks: List[Chunk], max_prefetch: int, capacity: Optional[int] = None) -> int:
    """Compute-tier bytes Gemini needs free at run time besides homes.

    Two chunks being computed plus ``max_prefetch`` in flight, two fp32 full-chunk gradients
    awaiting reduction; during the step the optimizer windows: the one being updated and the
    next one being read ahead, plus — when that is at most a quarter of ``capacity`` — a third for
    the one being written behind (with two, the read-ahead waits for the write-behind to land and
    NVMe reads and writes stop overlapping and the step's disk throughput drops far below the
    disk's, see docs/gemini.md, "Measured"; under a budget only a few chunks wide the third
    window would push every home off the tier).
    """
    full = max(c.full_bytes for c in chunks)
    grad = max(c.size * 4 for c in chunks)
    opt = max(optim_block_bytes(c) + c.shard_bytes for c in chunks)
    compute = (2 + max_prefetch) * full + 2 * grad
    three = max(compute, 3 * opt + 2 * full)
    if capacity is None or 4 * three <= capacity:
        return three
    return max(compute, 2 * opt + 2 * full)


def min_working_set_bytes(chunks: List[Chunk]) -> int:
    """The least the compute tier must hold: a pair of chunks in compute plus one gradient
    buffer, or (optimizer step, host = compute tier) one chunk's optimizer window."""
    full = max(c.full_bytes for c in chunks)
    grad = max(c.size * 4 for c in chunks)
    opt = max(optim_block_bytes(c) + c.shard_bytes for c in chunks)
    return max(2 * full + grad, opt)


def plan_homes(chunks: List[Chunk], stack: TierStack, cfg: PlacementConfig) -> None:
    """Set ``param_home``/``optim_home`` on every chunk; raise ValueError if it cannot fit."""
    n = len(chunks)
    dev, host = stack.compute.name, stack.host.name
    has_nvme = stack.nvme is not None
    budget = {t.name: t.capacity for t in stack.tiers}
    budget[dev] -= working_set_bytes(chunks, cfg.max_prefetch, stack.compute.capacity)

    def first_param_offloaded(frac: float) -> int:
        return n - int(round(frac * n))

    prefs = []  # (chunk, kind, preferred tier name, bytes)
    for i, c in enumerate(chunks):
        if cfg.policy == "cuda" or cfg.policy == "auto":
            p = dev
        elif cfg.policy == "cpu":
            p = host
        else:  # static
            p = host if i >= first_param_offloaded(cfg.offload_param_frac) else dev
        prefs.append((c, "param", p, c.shard_bytes))
    for i, c in enumerate(chunks):
        if cfg.policy in ("cuda", "auto"):
            o = dev
        elif cfg.policy == "cpu":
            o = host
        else:
            o = host if i >= first_param_offloaded(cfg.offload_optim_frac) else dev
        if has_nvme and i >= first_param_offloaded(cfg.nvme_offload_frac):
            o = "nvme"
        prefs.append((c, "optim", o, optim_block_bytes(c)))

    order = [t.name for t in stack.tiers]
    for c, kind, pref, nbytes in prefs:
        placed = None
        for name in order[order.index(pref):]:
            if kind == "optim":
                nbytes = optim_cost(c, name, stack)
            if budget[name] >= nbytes:
                placed = name
                break
        if placed is None:
            # fp32 parameters homed with their optimizer state share the master (16 B/param, not 20)
            need = sum(b - (c.shard_bytes if k == "optim" and c.dtype == torch.float32 else 0)
                       for c, k, _, b in prefs)
            if not has_nvme:
                raise ValueError(
                    f"GeminiPlugin: parameters and optimizer states need {need / 2**20:.1f} MiB per rank "
                    f"but device_memory_limit={stack.compute.capacity} bytes leaves room for less "
                    "(working-set reserve "
                    f"{working_set_bytes(chunks, cfg.max_prefetch, stack.compute.capacity) / 2**20:.1f} MiB); "
                    "raise device_memory_limit or set nvme_offload_dir=... to spill to NVMe")
            raise ValueError(
                f"GeminiPlugin: nvme_offload_dir has {stack.nvme.capacity / 2**30:.2f} GiB free, but the plan "
                f"needs more ({need / 2**30:.2f} GiB of state per rank in all); free disk space, choose "
                "another nvme_offload_dir, or raise device_memory_limit")
        budget[placed] -= nbytes
        if kind == "param":
            c.param_home = placed
        else:
            c.optim_home = placed
