"""Fused AdamW: one Triton kernel reads param, grad, exp_avg, exp_avg_sq once and writes
param and both moments back — the update for GPU-resident fp32 chunks (Gemini hands it flat
chunk buffers), beside a plain-torch reference with torch.optim.AdamW's exact semantics.

Update (decoupled weight decay, bias-corrected, as ``torch.optim.AdamW`` with
``amsgrad=False``)::

    p  *= 1 - lr * wd
    m   = b1 * m + (1 - b1) * g
    v   = b2 * v + (1 - b2) * g²
    p  -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)

``backend=None``: Triton for CUDA fp32 tensors; elsewhere torch's own fused CPU/CUDA kernel
(``torch._fused_adamw_``) when it exists, else the reference.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Iterable, Optional, Sequence, Tuple

import torch

from .dispatch import check_backend, choose, lazy_kernels


def adamw_reference(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], step: int,
                    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    bc1 = 1 - beta1 ** step
    bc2_sqrt = math.sqrt(1 - beta2 ** step)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bc1)


def _build():
    global triton, tl  # Triton resolves a kernel's names through its module globals
    import triton
    import triton.language as tl

    @triton.jit
    def step_kernel(P, G, M, V, n, lr, beta1, beta2, eps, decay, step_size, bc2_sqrt, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(P + offs, mask=mask)
        g = tl.load(G + offs, mask=mask).to(tl.float32)
        m = tl.load(M + offs, mask=mask)
        v = tl.load(V + offs, mask=mask)
        p = p * decay
        m = m + (1.0 - beta1) * (g - m)
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(P + offs, p, mask=mask)
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)

    return SimpleNamespace(step=step_kernel)


_kernels = lazy_kernels(_build)


def fused_adamw(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], step: int, *,
                lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 1e-2, backend: Optional[str] = None) -> None:
    """One AdamW step in place over lists of same-shaped (param, grad, exp_avg, exp_avg_sq)."""
    check_backend("fused_adamw", backend)
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs)):
        raise ValueError("fused_adamw: params, grads, exp_avgs, exp_avg_sqs must have the same length")
    if step < 1:
        raise ValueError(f"fused_adamw: step={step} must be >= 1 (the count of steps taken, this one included)")
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"fused_adamw: betas ({beta1}, {beta2}) must be in [0, 1)")
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"fused_adamw: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
    if not params:
        return
    why = None
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if not (p.shape == g.shape == m.shape == v.shape):
            raise ValueError(f"fused_adamw: tensor {i}: param/grad/state shapes differ "
                             f"({tuple(p.shape)}, {tuple(g.shape)}, {tuple(m.shape)}, {tuple(v.shape)})")
        if any(t.dtype != torch.float32 for t in (p, m, v)) or not all(t.is_contiguous() for t in (p, g, m, v)):
            why = f"tensor {i}: the kernel takes contiguous fp32 params and states"
    which = choose("fused_adamw", params[0], backend, why)
    if which == "triton":
        k = _kernels(params[0])
        BLOCK = 1024 if params[0].is_cuda else 4096
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            n = p.numel()
            k.step[((n + BLOCK - 1) // BLOCK,)](p, g, m, v, n, lr, beta1, beta2, eps, 1 - lr * weight_decay,
                                                lr / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step), BLOCK=BLOCK)
        return
    if backend is None and hasattr(torch, "_fused_adamw_") and why is None:
        steps = [torch.tensor(float(step), device=p.device) for p in params]
        torch._fused_adamw_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [], steps,
                            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                            amsgrad=False, maximize=False)
        return
    adamw_reference(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay)


class FusedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (amsgrad off) whose step runs :func:`fused_adamw`.

    Same constructor and state names (``step``, ``exp_avg``, ``exp_avg_sq``) as torch's, so
    its state dicts are interchangeable with ``torch.optim.AdamW``'s.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, backend: Optional[str] = None):
        check_backend("FusedAdamW", backend)
        if lr < 0:
            raise ValueError(f"FusedAdamW: lr={lr} must be >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.backend = backend

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # group tensors by step count (they share one after the first step)
            by_step: dict = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("FusedAdamW: sparse gradients are not supported")
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                by_step.setdefault(int(st["step"].item()), []).append((p, p.grad, st["exp_avg"], st["exp_avg_sq"]))
            b1, b2 = group["betas"]
            for step, items in by_step.items():
                ps, gs, ms, vs = (list(x) for x in zip(*items))
                fused_adamw(ps, gs, ms, vs, step, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                            weight_decay=group["weight_decay"], backend=self.backend)
        return loss
