"""Fused RMSNorm forward and backward in Triton, beside its torch reference.

Why fused: the unfused norm reads ``x`` three times and writes two temporaries; the kernel
reads a tile of rows once, keeps the row's sum of squares in registers and writes ``y`` (and
in the backward ``dx`` plus per-tile partial ``dweight`` sums, reduced by one torch ``sum``).

Numbers match the reference GPT's norm exactly in structure: statistics in fp32, the
normalised ``x`` rounded to ``x``'s dtype, then multiplied by ``weight`` in the promoted dtype.
The torch path *is* that reference (it is already the best plain-torch form on CPU).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from .dispatch import check_backend, choose, lazy_kernels

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_DIM = 65536


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def _build():
    global triton, tl  # Triton resolves a kernel's names through its module globals
    import triton
    import triton.language as tl

    @triton.jit
    def fwd(X, W, Y, RSTD, M, N, eps, BM: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(X + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / N + eps)
        xhat = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(Y + rows[:, None] * N + cols[None, :], (xhat * w[None, :]).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rows < M)

    @triton.jit
    def bwd(X, W, DY, RSTD, DX, DWP, M, N, BM: tl.constexpr, BN: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BM + tl.arange(0, BM)
        cols = tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(X + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
        xf = x.to(tl.float32)
        dy = tl.load(DY + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
        xhat = xf * rstd[:, None]
        # dweight: per-tile partial sums of dy * round(xhat); reduced over tiles by the caller
        tl.store(DWP + pid * N + cols, tl.sum(dy * xhat.to(x.dtype).to(tl.float32), 0), mask=cols < N)
        g = dy * w[None, :]
        c = tl.sum(g * xhat, 1) / N
        dx = rstd[:, None] * (g - xhat * c[:, None])
        tl.store(DX + rows[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

    return SimpleNamespace(fwd=fwd, bwd=bwd)


_kernels = lazy_kernels(_build)


def _tiles(N: int, cuda: bool):
    BN = triton_next_pow2(N)
    BM = max(1, min(16 if cuda else 64, 8192 // BN))
    return BM, BN


def triton_next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        w = weight.contiguous()
        M, N = x2.shape
        y = torch.empty(M, N, device=x.device, dtype=torch.result_type(x, weight))
        rstd = torch.empty(M, device=x.device, dtype=torch.float32)
        BM, BN = _tiles(N, x.is_cuda)
        _kernels(x).fwd[(triton_cdiv(M, BM),)](x2, w, y, rstd, M, N, eps, BM=BM, BN=BN)
        ctx.save_for_backward(x2, w, rstd)
        ctx.shape = shape
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        M, N = x2.shape
        BM, BN = _tiles(N, x2.is_cuda)
        tiles = triton_cdiv(M, BM)
        dx = torch.empty_like(x2)
        dwp = torch.empty(tiles, N, device=x2.device, dtype=torch.float32)
        _kernels(x2).bwd[(tiles,)](x2, w, dy.reshape(M, N).contiguous(), rstd, dx, dwp, M, N, BM=BM, BN=BN)
        return dx.reshape(ctx.shape), dwp.sum(0).to(w.dtype), None


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             backend: Optional[str] = None) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim; differentiable on every backend."""
    check_backend("rms_norm", backend)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"rms_norm: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} must be ({x.shape[-1]},), "
                         "the size of x's last dim")
    if not eps > 0:
        raise ValueError(f"rms_norm: eps={eps} must be > 0")
    why = None
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        why = f"dtypes x={x.dtype}, weight={weight.dtype} (the kernel takes {DTYPES})"
    elif x.shape[-1] > MAX_DIM:
        why = f"last dim {x.shape[-1]} > {MAX_DIM} (one row must fit a tile)"
    elif x.device != weight.device:
        why = "x and weight on different devices"
    if choose("rms_norm", x, backend, why) == "triton":
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
