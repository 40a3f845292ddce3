"""The top-k router: for each token, ``top_k`` experts and the weights their outputs are mixed with.

Scores are ``softmax`` (Mixtral, Qwen-MoE) or ``sigmoid`` (DeepSeek-V3) of one linear map of the
token; with ``top_k > 1`` the chosen scores are renormalised to sum to one. ``expert_bias`` (a
buffer, zeros) is added to the scores for the *choice only*, never to the weights: DeepSeek-V3's
auxiliary-free balancing nudges it between steps, and a test can push an expert out of every
token's choice with it.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn

GATINGS = ("softmax", "sigmoid")


class TopKRouter(nn.Module):
    def __init__(self, dim: int, n_expert: int, top_k: int, gating: str = "softmax"):
        super().__init__()
        if gating not in GATINGS:
            raise ValueError(f"TopKRouter(gating={gating!r}): choose one of {GATINGS}")
        if not 1 <= top_k <= n_expert:
            raise ValueError(f"TopKRouter(top_k={top_k}): must be in [1, n_expert={n_expert}]")
        self.n_expert, self.top_k, self.gating = n_expert, top_k, gating
        self.gate = nn.Linear(dim, n_expert, bias=False)
        self.register_buffer("expert_bias", torch.zeros(n_expert))

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.softmax(-1) if self.gating == "softmax" else logits.sigmoid()

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, d) -> weights (N, k) in x's dtype, expert indices (N, k) int64, logits (N, E) fp32."""
        logits = self.gate(x).float()
        scores = self.scores(logits)
        _, idx = torch.topk(scores.detach() + self.expert_bias, self.top_k, dim=-1)
        w = scores.gather(-1, idx)
        if self.top_k > 1:
            w = w / w.sum(-1, keepdim=True)
        return w.type_as(x), idx, logits
