"""Tracing a mixture-of-experts block on fake tensors: its routing taken as balanced.

The engine's ``MoE`` block (``engine/moe/layer.py``) counts the rows each expert gets (``bincount``)
and keeps statistics as Python numbers (``counts.tolist()``, ``float(loss)``): data-dependent, which
fake tensors cannot give. On the planner's fake copy each block therefore runs :func:`balanced_forward`:
the same router, grouped expert weights, mixing ``index_add`` and auxiliary losses (the engine's own
modules and functions), with the ``N * top_k`` assignments sorted by their chosen expert as ``route``
sorts them and the experts' rows taken equal (``ceil(N * top_k / E)`` each, zero-padded as
``grouped_swiglu``'s ``bmm`` path pads): the rows a dropless layer computes whatever the routing, so a
rank's activations are those of any routing up to that padding. The grouped matmul is three ``bmm``
over ``(E, rows, d)`` (torch's ``_grouped_mm`` has a bf16-only meta kernel; its outputs have the same
shapes); the statistics are left out. A transformers family's experts module (grouped
``gate_up_proj`` / ``down_proj``, called with the tokens, top-k ids and weights) runs
:func:`hf_balanced_forward` likewise (its own ``act_fn``; transformers' eager forward loops over the experts
hit, its ``grouped_mm`` one needs bf16 on fake tensors). The user's model is never touched (the copy is
the planner's).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn


def balanced(model: nn.Module) -> int:
    """Give every ``MoE`` block of the (fake) copy ``model`` the balanced forward; how many there were."""
    from ...moe import moe_layers

    n = 0
    for _, moe in moe_layers(model):
        moe.forward = types.MethodType(balanced_forward, moe)
        n += 1
    for mod in model.modules():
        if _hf_experts(mod):
            mod.forward = types.MethodType(hf_balanced_forward, mod)
            n += 1
    return n


def _hf_experts(mod: nn.Module) -> bool:
    """transformers 5's grouped experts module: 3-d ``gate_up_proj`` and ``down_proj`` of one expert count."""
    gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3
            and gu.shape[0] == down.shape[0] and callable(getattr(mod, "act_fn", None)))


def _sorted_rows(x: torch.Tensor, idx: torch.Tensor, n: int):
    """Rows of ``x`` (A = N * k of them) sorted by chosen expert as ``dispatch.route`` sorts them, laid out
    ``(n, ceil(A / n), d)`` (zero-padded), with each row's token and its place in the sort."""
    a, d = idx.numel(), x.shape[-1]
    order = torch.argsort(idx.reshape(-1), stable=True)
    token = order // idx.shape[1]
    rows = x[token]
    per = -(-a // n)
    if per * n != a:
        rows = torch.cat([rows, rows.new_zeros(per * n - a, d)])
    return rows.view(n, per, d), token, order


def _mm(x: torch.Tensor, w: torch.Tensor, out: int) -> torch.Tensor:
    """``x (E, M, i) @ w[e]`` for grouped weights stored ``(E, out, i)`` (nn.Linear's) or ``(E, i, out)``."""
    return torch.bmm(x, w.transpose(1, 2) if w.shape[1] == out and w.shape[2] == x.shape[-1] else w)


def hf_balanced_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts module's forward with every expert taking an equal share of the rows."""
    n, d = self.gate_up_proj.shape[0], hidden_states.shape[-1]
    xp, token, order = _sorted_rows(hidden_states, top_k_index, n)
    two_h = self.gate_up_proj.shape[1] if self.gate_up_proj.shape[2] == d else self.gate_up_proj.shape[2]
    gate, up = _mm(xp, self.gate_up_proj, two_h).chunk(2, dim=-1)
    y = _mm(self.act_fn(gate) * up, self.down_proj, d).reshape(-1, d)[:token.numel()]
    y = y * top_k_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token, y.to(hidden_states.dtype))


def _swiglu(x: torch.Tensor, idx: torch.Tensor, experts):
    """``grouped_swiglu`` of the rows sorted by expert, every expert taking ``ceil(N * k / E)`` of them:
    (outputs in sorted order, each row's token, its place in the sort)."""
    import torch.nn.functional as F

    xp, token, order = _sorted_rows(x, idx, experts.w1.shape[0])
    h = F.silu(torch.bmm(xp, experts.w1)) * torch.bmm(xp, experts.w3)
    return torch.bmm(h, experts.w2).reshape(-1, x.shape[-1])[:token.numel()], token, order


def balanced_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``MoE.forward`` with balanced counts and no statistics (see the module docstring)."""
    from ...moe import layer as moe_layer
    from ...moe.losses import load_balancing_loss, router_z_loss

    B, T, d = x.shape
    xf = x.reshape(-1, d)
    w, idx, logits = self.router(xf)
    ys, token, order = _swiglu(xf, idx, self.experts)
    weight = w.reshape(-1)[order]
    out = torch.zeros_like(xf).index_add(0, token, ys * weight.unsqueeze(1))
    if self.shared is not None:
        out = out + self.shared(xf)
    if torch.is_grad_enabled() and (self.aux_loss_coef or self.z_loss_coef):
        bal = load_balancing_loss(self.router.scores(logits).view(B, T, -1), idx.view(B, T, -1), self.n_expert)
        aux = self.aux_loss_coef * bal + self.z_loss_coef * router_z_loss(logits)
        out = moe_layer._AuxLoss.apply(out, aux, self.aux_grad_scale)
    return out.view(B, T, d)
