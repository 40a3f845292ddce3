"""The MoE block: router -> tokens grouped by expert -> grouped experts (local, or over an EP
group) -> outputs mixed back by the router's weights, plus optional always-on shared experts.

The auxiliary losses (load balance, z-loss) are not returned: they enter backward through the
block's output, as Megatron's ``MoEAuxLossAutoScaler`` does (forward passes the output through,
backward hands the aux loss a gradient of one), so they train the router whatever loss the user
computes from the logits (a plugin's criterion, ``execute_pipeline``). Their values, the tokens
each expert got and the tokens dropped are kept per layer in ``last`` for logging.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dispatch import route
from .experts import GroupedExperts
from .losses import load_balancing_loss, router_z_loss
from .router import TopKRouter


class _AuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux`` gets the gradient ``scale`` (its weight in the loss, fixed at
    the forward) times the backward's own multiplier (:func:`aux_loss_backward_scale`: a loss scaler's)."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, g):
        return g, torch.full((), ctx.scale * _BACKWARD_SCALE[0], dtype=torch.float32, device=g.device), None


_BACKWARD_SCALE = [1.0]  # set by ``aux_loss_backward_scale`` around a backward


@contextlib.contextmanager
def aux_loss_backward_scale(scale: float):
    """The auxiliary losses' gradients in the backwards run inside are multiplied by ``scale``: a loss scaler
    back-propagates ``S * loss``, so the aux losses that enter through the block outputs must weigh ``S`` too,
    or they come out ``1/S`` of their weight after unscaling (Megatron's ``MoEAuxLossAutoScaler.set_loss_scale``).
    Where the forward already fixed the scale (``aux_loss_scale(module, S / m)`` in a microbatch loop), the
    backward is not wrapped."""
    was, _BACKWARD_SCALE[0] = _BACKWARD_SCALE[0], float(scale)
    try:
        yield
    finally:
        _BACKWARD_SCALE[0] = was


@dataclass
class MoEStats:
    """One forward of one MoE layer on this rank (detached numbers, for logging)."""

    tokens_per_expert: Tuple[int, ...]  # this rank's kept assignments per global expert
    dropped: int                        # assignments dropped by the capacity
    balance_loss: float
    z_loss: float


class SharedExperts(nn.Module):
    """DeepSeek's shared experts: one SwiGLU of ``n * hidden`` every token goes through."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """``y = MoE(...)(x)`` for x (B, T, d). ``ep``: an :class:`~.parallel.ExpertParallel` (set by the
    plugin, which also cuts ``experts`` to this rank's share); None: every expert here."""

    aux_grad_scale = 1.0  # the aux losses' gradient weight (a loss scaler would multiply it)

    def __init__(self, dim: int, hidden: int, n_expert: int, top_k: int, gating: str = "softmax",
                 n_shared: int = 0, capacity_factor: Optional[float] = None, aux_loss_coef: float = 0.0,
                 z_loss_coef: float = 0.0, out_std: Optional[float] = None):
        super().__init__()
        self.n_expert, self.top_k, self.capacity_factor = n_expert, top_k, capacity_factor
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = TopKRouter(dim, n_expert, top_k, gating)
        self.experts = GroupedExperts(n_expert, dim, hidden, out_std)
        self.shared = SharedExperts(dim, n_shared * hidden) if n_shared else None
        self.ep = None
        self.last: Optional[MoEStats] = None
        self.step_load: Optional[List[int]] = None  # tokens per expert over this step's training forwards
        self.step_dropped = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        xf = x.reshape(-1, d)  # (N, d)
        w, idx, logits = self.router(xf)  # (N, k), (N, k), (N, E)
        r = route(w, idx, self.n_expert, self.capacity_factor)
        rows = xf[r.token]  # (A, d) grouped by expert
        if self.ep is None:
            ys = self.experts(rows, r.counts)
        else:
            local, counts, state = self.ep.dispatch(rows, r.counts)
            ys = self.ep.combine(self.experts(local, counts), state)
        out = torch.zeros_like(xf).index_add(0, r.token, ys * r.weight.unsqueeze(1))
        if self.shared is not None:
            out = out + self.shared(xf)
        bal = load_balancing_loss(self.router.scores(logits).view(B, T, -1), idx.view(B, T, -1), self.n_expert)
        z = router_z_loss(logits)
        if torch.is_grad_enabled() and (self.aux_loss_coef or self.z_loss_coef):
            out = _AuxLoss.apply(out, self.aux_loss_coef * bal + self.z_loss_coef * z, self.aux_grad_scale)
        self.last = MoEStats(tuple(r.counts.tolist()), r.dropped, float(bal.detach()), float(z.detach()))
        # a recompute is no new load, nor a pipeline's metadata inference (``not_counted``)
        if self.training and torch.is_grad_enabled() and not _in_backward() and _COUNTING[0]:
            load = self.step_load or [0] * self.n_expert
            self.step_load = [a + b for a, b in zip(load, self.last.tokens_per_expert)]
            self.step_dropped += r.dropped
        return out.view(B, T, d)


_COUNTING = [True]  # False inside ``not_counted``


@contextlib.contextmanager
def not_counted():
    """Forwards run inside add nothing to the step's expert load: torch's pipeline stages run one real
    forward per stage at their first step to learn the shapes they send (on placeholder tensors past the
    first stage), which trains nothing."""
    was, _COUNTING[0] = _COUNTING[0], False
    try:
        yield
    finally:
        _COUNTING[0] = was


def _in_backward() -> bool:
    """True inside autograd's backward (an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def aux_loss_scale(module: nn.Module, scale: float):
    """The auxiliary losses of the forwards run inside get the gradient weight ``scale`` (each MoE layer's
    ``aux_grad_scale``): a microbatch loop that back-propagates ``loss / m`` gives them ``1 / m``, as the
    unsplit batch's loss would (Megatron's schedules set ``MoEAuxLossAutoScaler``'s scale the same way)."""
    layers = [m for _, m in moe_layers(module)]
    for m in layers:
        m.aux_grad_scale = scale
    try:
        yield
    finally:
        for m in layers:
            del m.aux_grad_scale  # back to the class default


def moe_layers(module: nn.Module) -> Iterator[Tuple[str, MoE]]:
    """Every MoE block in ``module``, with its name."""
    for name, m in module.named_modules():
        if isinstance(m, MoE):
            yield name, m
