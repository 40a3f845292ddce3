"""The experts: one SwiGLU per expert, stored as grouped weights ``[E, d, h]`` / ``[E, h, d]``.

Tokens arrive sorted by expert (``counts[e]`` rows for expert ``e``, possibly zero) and each
projection is one grouped matmul over all the groups: ``torch._grouped_mm`` (torch's grouped
GEMM, the one torchtitan's MoE calls) where it runs, on the CPU in any float dtype and on CUDA in
bf16 from sm90; elsewhere one ``bmm`` over the groups padded to the largest. Never a Python loop
of small matmuls. Grouped weights also mean an expert that gets no token in a step still has a
gradient (a zero slice), so no rank waits on a gradient that never comes.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

IMPLS = ("auto", "grouped_mm", "bmm")


def _grouped_mm_runs(x: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type == "cuda" and x.dtype == torch.bfloat16:
        return torch.cuda.get_device_capability(x.device)[0] >= 9
    return False


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    # offs: where each group ends (int32, cumulative; equal neighbours = an empty group)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return torch._grouped_mm(x, w, offs=offs)


def _padded(x: torch.Tensor, counts: torch.Tensor):
    """x (A, d) sorted by group -> (E, M, d) zero-padded groups and each row's slot in (E * M)."""
    E, M = counts.numel(), int(counts.max()) if counts.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(E, device=x.device), counts)
    slot = group * M + torch.arange(x.shape[0], device=x.device) - starts[group]
    xp = x.new_zeros(E * M, x.shape[1]).index_copy(0, slot, x)
    return xp.view(E, M, x.shape[1]), slot


def grouped_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                   impl: str = "auto") -> torch.Tensor:
    """x: (A, d) rows sorted by expert, ``counts`` (E,) rows per expert -> (A, d):
    ``(silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]`` for each row's expert ``e``."""
    if impl not in IMPLS:
        raise ValueError(f"grouped_swiglu(impl={impl!r}): choose one of {IMPLS}")
    if impl == "grouped_mm" or impl == "auto" and _grouped_mm_runs(x):
        h = F.silu(_grouped_mm(x, w1, counts)) * _grouped_mm(x, w3, counts)
        return _grouped_mm(h, w2, counts)
    xp, slot = _padded(x, counts)  # (E, M, d)
    h = F.silu(torch.bmm(xp, w1)) * torch.bmm(xp, w3)  # (E, M, h)
    y = torch.bmm(h, w2)  # (E, M, d)
    return y.reshape(-1, y.shape[-1])[slot]


class GroupedExperts(nn.Module):
    """``n_expert`` SwiGLU experts ``d -> hidden -> d`` (of them this module holds ``w1.shape[0]``:
    all, or an expert-parallel rank's share)."""

    def __init__(self, n_expert: int, dim: int, hidden: int, out_std: Optional[float] = None, impl: str = "auto"):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_expert, dim, hidden))  # gate
        self.w3 = nn.Parameter(torch.empty(n_expert, dim, hidden))  # up
        self.w2 = nn.Parameter(torch.empty(n_expert, hidden, dim))  # down
        self.out_std = out_std if out_std is not None else 0.02 / math.sqrt(2)
        self.impl = impl
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, std=0.02)
        nn.init.normal_(self.w3, std=0.02)
        nn.init.normal_(self.w2, std=self.out_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return grouped_swiglu(x, self.w1, self.w3, self.w2, counts, self.impl)
