"""The router's auxiliary losses.

``load_balancing_loss`` is Switch Transformer's ``E * sum_e f_e * P_e`` (``f_e``: the share of the
token-to-expert choices that went to expert ``e``, ``P_e``: its mean score; 1.0 when perfectly
even), computed per sequence and averaged over sequences, as DeepSeek-V3's sequence-wise balance
loss: a batch cut into whole sequences over data-parallel ranks then averages to the same value
as one process on the whole batch. ``router_z_loss`` is ST-MoE's mean squared ``logsumexp`` of the
router logits (keeps them small, so the softmax stays well conditioned).
"""

from __future__ import annotations

import torch


def load_balancing_loss(scores: torch.Tensor, idx: torch.Tensor, n_expert: int) -> torch.Tensor:
    """scores: (B, T, E) router scores; idx: (B, T, k) chosen experts -> a scalar."""
    B, T, k = idx.shape
    f = torch.zeros(B, n_expert, device=idx.device, dtype=scores.dtype)
    f.scatter_add_(1, idx.reshape(B, T * k), torch.ones(B, T * k, device=idx.device, dtype=scores.dtype))
    f = f / (T * k)  # (B, E): share of the choices per expert
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)  # (B, E): mean normalised score
    return n_expert * (f * p).sum(-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """logits: (..., E) -> mean over tokens of ``logsumexp(logits)^2``."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
