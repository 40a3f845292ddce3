"""Tokens sorted into expert groups: dropless, or at most ``capacity`` per expert.

A token's ``k`` choices become ``k`` assignments; a stable sort by expert puts each expert's
assignments together in token order. Under a capacity factor ``c`` an expert keeps its first
``ceil(c * N * k / E)`` assignments (in token order, as Switch/GShard do) and the rest are
dropped: their token gets nothing from that expert (the residual stream carries it), and the
number dropped is reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Routing:
    """One layer's assignments of ``N`` tokens, sorted by expert (``A`` kept assignments)."""

    token: torch.Tensor    # (A,) int64: the token of each kept assignment, grouped by expert
    weight: torch.Tensor   # (A,) its mixing weight (carries the router's gradient)
    counts: torch.Tensor   # (E,) int64: kept assignments per expert (an expert may get none)
    dropped: int           # assignments dropped by the capacity (0 dropless)
    chosen: torch.Tensor   # (E,) int64: assignments per expert before the capacity


def capacity(n_tokens: int, top_k: int, n_expert: int, factor: float) -> int:
    """Assignments an expert keeps under capacity ``factor`` (Switch's ``c * N * k / E``, rounded up)."""
    return math.ceil(factor * n_tokens * top_k / n_expert)


def route(weights: torch.Tensor, idx: torch.Tensor, n_expert: int,
          capacity_factor: Optional[float] = None) -> Routing:
    """weights, idx: (N, k) from the router -> the assignments grouped by expert."""
    N, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # expert-major, token order inside an expert
    chosen = torch.bincount(flat, minlength=n_expert)
    dropped = 0
    if capacity_factor is not None:
        cap = capacity(N, k, n_expert, capacity_factor)
        starts = torch.cumsum(chosen, 0) - chosen
        sorted_e = flat[order]
        rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[sorted_e]
        keep = rank_in_expert < cap
        dropped = int((~keep).sum())
        order = order[keep]
    counts = torch.bincount(flat[order], minlength=n_expert)
    return Routing(token=order // k, weight=weights.reshape(-1)[order], counts=counts, dropped=dropped,
                   chosen=chosen)
