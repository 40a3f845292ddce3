"""Flash attention (FlashAttention-2 forward and backward) in Triton, beside its torch reference.

Why our own: a Triton kernel JITs on any CUDA GPU at first call, so users get fused attention
without building CUDA extensions at install time (Colossal-AI's most common complaint). The
algorithm is FlashAttention-2 as in Triton's fused-attention tutorial: an online softmax over
key blocks in the forward (storing only the per-row log-sum-exp), and a backward that
recomputes the probabilities block by block (one kernel for dK/dV, one for dQ).

Shapes are ``(B, H, T, D)``. The Triton kernel supports fp16/bf16, head dims 16/32/64/128,
causal (``Tq == Tk``) and non-causal (any ``Tq``, ``Tk``, e.g. a decoding query against a KV
cache). ``backend=None`` falls back to ``torch.nn.functional.scaled_dot_product_attention``
for anything else (fp32, other head dims) and on CPU.

``flash_attention_forward`` / ``flash_attention_backward`` are the same attention split into its
two halves with the per-row log-sum-exp exposed and no autograd graph: the building blocks of
ring attention (``colossal_lab.engine.context_parallel``), which merges blocks by their lse and
recomputes each block's gradient from the *whole* softmax's output and lse (a block's share of
the gradient needs only those two, so the shares of all blocks sum to the whole's). Their torch
path off CUDA is ATen's fused CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``
and its backward: O(T) memory, as SDPA), else the fp32 reference.

Logit soft-capping (``softcap=c``: scores ``s -> c * tanh(s / c)`` before the softmax, Gemma 2's) is taken by
the two halves on the fp32 reference path only, whatever the device: neither the Triton kernel nor ATen's CPU
flash kernel can apply it. That path computes each call's ``(Tq, Tk)`` scores explicitly (O(Tq * Tk) memory
per call: per ring block under context parallelism); its backward multiplies dS by ``1 - tanh^2``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F

from .dispatch import check_backend, choose, lazy_kernels

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        scale: Optional[float] = None) -> torch.Tensor:
    """Plain softmax attention in fp32 (the numbers the kernel is checked against)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if causal:
        Tq, Tk = q.shape[-2], k.shape[-2]
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def _import_triton() -> None:
    """Bind ``triton`` and ``tl`` as module globals (not closure names): Triton resolves a
    kernel's names through its globals."""
    global triton, tl
    import triton
    import triton.language as tl


def _build_fwd():
    """The forward kernel: one program per (query block, batch*head); an online softmax over
    key blocks, storing the output and the per-row log-sum-exp (base 2) in ``L``."""

    @triton.jit
    def fwd(Q, K, V, O, L, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
            H, Tq, Tk, qk_scale, CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            D: tl.constexpr, UP: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                    mask=offs_m[:, None] < Tq, other=0.0)
        if UP:  # Triton 3.x's CPU interpreter gets bf16 tl.dot wrong
            q = q.to(tl.float32)
        m_i = tl.zeros([BM], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, D], dtype=tl.float32)
        hi = Tk
        if CAUSAL:
            hi = tl.minimum((pid_m + 1) * BM, Tk)
        for start in range(0, hi, BN):
            n = start + offs_n
            kt = tl.load(K + b * skb + h * skh + n[None, :] * skn + offs_d[:, None],
                         mask=n[None, :] < Tk, other=0.0)
            if UP:  # Triton 3.x's CPU interpreter gets bf16 tl.dot wrong
                kt = kt.to(tl.float32)
            qk = tl.dot(q, kt) * qk_scale
            keep = n[None, :] < Tk
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= n[None, :])
            qk = tl.where(keep, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + b * svb + h * svh + n[:, None] * svn + offs_d[None, :],
                        mask=n[:, None] < Tk, other=0.0)
            if UP:  # Triton 3.x's CPU interpreter gets bf16 tl.dot wrong
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(L + bh * Tq + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < Tq)
        tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :],
                 acc.to(O.dtype.element_ty), mask=offs_m[:, None] < Tq)

    return fwd


def _build_bwd_dkdv():
    """The backward's dK/dV kernel: one program per (key block, batch*head), looping over the
    query blocks that see it and recomputing their probabilities from ``L``."""

    @triton.jit
    def bwd_dkdv(Q, K, V, DO, L, DELTA, DK, DV, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                 H, Tq, Tk, qk_scale, sm_scale, CAUSAL: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, D: tl.constexpr, UP: tl.constexpr):
        # Q/DO share strides (sq*), K/DK share (sk*), V/DV share (sv*): callers pass contiguous.
        pid_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_m0 = tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        kmask = offs_n[:, None] < Tk
        k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :], mask=kmask, other=0.0)
        if UP:  # Triton 3.x's CPU interpreter gets bf16 tl.dot wrong
            k = k.to(tl.float32)
        v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :], mask=kmask, other=0.0)
        if UP:  # Triton 3.x's CPU interpreter gets bf16 tl.dot wrong
            v = v.to(tl.float32)
        dk = tl.zeros([BN, D], dtype=tl.float32)
        dv = tl.zeros([BN, D], dtype=tl.float32)
        lo = 0
        if CAUSAL:
            lo = (pid_n * BN // BM) * BM
        for start in range(lo, Tq, BM):
            m = start + offs_m0
            qmask = m[:, None] < Tq
            q = tl.load(Q + b * sqb + h * sqh + m[:, None] * sqm + offs_d[None, :], mask=qmask, other=0.0)
            if UP:  # Triton 3.x's CPU interpreter gets bf16 tl.dot wrong
                q = q.to(tl.float32)
            do = tl.load(DO + b * sqb + h * sqh + m[:, None] * sqm + offs_d[None, :], mask=qmask, other=0.0)
            if UP:  # Triton 3.x's CPU interpreter gets bf16 tl.dot wrong
                do = do.to(tl.float32)
            lse = tl.load(L + bh * Tq + m, mask=m < Tq, other=0.0)
            delta = tl.load(DELTA + bh * Tq + m, mask=m < Tq, other=0.0)
            qkT = tl.dot(k, tl.trans(q)) * qk_scale  # (BN, BM)
            keep = (m[None, :] < Tq) & (offs_n[:, None] < Tk)
            if CAUSAL:
                keep = keep & (m[None, :] >= offs_n[:, None])
            pT = tl.where(keep, tl.math.exp2(qkT - lse[None, :]), 0.0)
            dv += tl.dot(pT.to(do.dtype), do)
            dpT = tl.dot(v, tl.trans(do))
            dsT = pT * (dpT - delta[None, :])
            dk += tl.dot(dsT.to(q.dtype), q)
        dk = dk * sm_scale
        tl.store(DK + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=kmask)
        tl.store(DV + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=kmask)

    return bwd_dkdv


def _build_bwd_dq():
    """The backward's dQ kernel: one program per (query block, batch*head), looping over the
    key blocks it sees."""

    @triton.jit
    def bwd_dq(Q, K, V, DO, L, DELTA, DQ, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
               H, Tq, Tk, qk_scale, sm_scale, CAUSAL: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, D: tl.constexpr, UP: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n0 = tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        qmask = offs_m[:, None] < Tq
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=qmask, other=0.0)
        if UP:  # Triton 3.x's CPU interpreter gets bf16 tl.dot wrong
            q = q.to(tl.float32)
        do = tl.load(DO + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=qmask, other=0.0)
        if UP:  # Triton 3.x's CPU interpreter gets bf16 tl.dot wrong
            do = do.to(tl.float32)
        lse = tl.load(L + bh * Tq + offs_m, mask=offs_m < Tq, other=0.0)
        delta = tl.load(DELTA + bh * Tq + offs_m, mask=offs_m < Tq, other=0.0)
        dq = tl.zeros([BM, D], dtype=tl.float32)
        hi = Tk
        if CAUSAL:
            hi = tl.minimum((pid_m + 1) * BM, Tk)
        for start in range(0, hi, BN):
            n = start + offs_n0
            k = tl.load(K + b * skb + h * skh + n[:, None] * skn + offs_d[None, :], mask=n[:, None] < Tk, other=0.0)
            if UP:  # Triton 3.x's CPU interpreter gets bf16 tl.dot wrong
                k = k.to(tl.float32)
            v = tl.load(V + b * svb + h * svh + n[:, None] * svn + offs_d[None, :], mask=n[:, None] < Tk, other=0.0)
            if UP:  # Triton 3.x's CPU interpreter gets bf16 tl.dot wrong
                v = v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k)) * qk_scale
            keep = (offs_m[:, None] < Tq) & (n[None, :] < Tk)
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= n[None, :])
            p = tl.where(keep, tl.math.exp2(qk - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        dq = dq * sm_scale
        tl.store(DQ + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=qmask)

    return bwd_dq


def _build():
    """Import Triton and decorate the three kernels (``lazy_kernels`` calls this once per mode)."""
    _import_triton()
    return SimpleNamespace(fwd=_build_fwd(), bwd_dkdv=_build_bwd_dkdv(), bwd_dq=_build_bwd_dq())


_kernels = lazy_kernels(_build)
_LOG2E = 1.4426950408889634


def _blocks(x: torch.Tensor, D: int):
    if not x.is_cuda:
        return 32, 32, 1  # the interpreter: few, larger programs are fastest
    return (64, 64, 4) if D <= 64 else (64, 32, 4)


def _triton_fwd(q, k, v, causal, scale):
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(B * H, Tq, device=q.device, dtype=torch.float32)
    BM, BN, warps = _blocks(q, D)
    kern = _kernels(q)
    grid = (triton_cdiv(Tq, BM), B * H)
    extra = {"num_warps": warps} if q.is_cuda else {}
    kern.fwd[grid](q, k, v, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                   k.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
                   H, Tq, Tk, scale * _LOG2E, CAUSAL=causal, BM=BM, BN=BN, D=D, UP=_upcast(q), **extra)
    return o, lse


def _triton_bwd(q, k, v, o, lse, do, causal, scale):
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1).reshape(B * H, Tq).contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    BM, BN, warps = _blocks(q, D)
    kern = _kernels(q)
    extra = {"num_warps": warps} if q.is_cuda else {}
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2))
    kern.bwd_dkdv[(triton_cdiv(Tk, BN), B * H)](q, k, v, do, lse, delta, dk, dv, *strides, H, Tq, Tk,
                                                 scale * _LOG2E, scale,
                                                 CAUSAL=causal, BM=BM, BN=BN, D=D, UP=_upcast(q), **extra)
    kern.bwd_dq[(triton_cdiv(Tq, BM), B * H)](q, k, v, do, lse, delta, dq, *strides, H, Tq, Tk,
                                               scale * _LOG2E, scale,
                                               CAUSAL=causal, BM=BM, BN=BN, D=D, UP=_upcast(q), **extra)
    return dq, dk, dv


def _upcast(x: torch.Tensor) -> bool:
    return (not x.is_cuda) and x.dtype == torch.bfloat16


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = _triton_fwd(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _triton_bwd(q, k, v, o, lse, do, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def _unsupported(q, k, v, causal) -> Optional[str]:
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (the kernel takes float16 or bfloat16)"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} (the kernel takes {HEAD_DIMS})"
    return None


def _check(op: str, q, k, v, causal: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{op}: {name} must be a 4-D (B, H, T, D) tensor, "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
        if not t.is_floating_point():
            raise ValueError(f"{op}: {name} has dtype {t.dtype}; pass floating-point tensors")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must share "
                         "B, H and D, and k/v must have the same shape")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"{op}: q/k/v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"{op}: causal=True needs as many queries as keys (got Tq={q.shape[2]}, "
                         f"Tk={k.shape[2]}); a decode step against a KV cache uses causal=False")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    backend: Optional[str] = None, scale: Optional[float] = None) -> torch.Tensor:
    """Softmax attention over ``(B, H, T, D)`` tensors; differentiable on every backend.

    ``causal=True`` requires ``Tq == Tk`` (a decode step against a cache is ``causal=False``).
    """
    check_backend("flash_attention", backend)
    _check("flash_attention", q, k, v, causal)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    which = choose("flash_attention", q, backend, _unsupported(q, k, v, causal))
    if which == "triton":
        return _FlashAttention.apply(q, k, v, causal, scale)
    if backend == "torch":
        return attention_reference(q, k, v, causal, scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


# ---- the two halves with the log-sum-exp (ring attention's building blocks) -------------------

_LN2 = math.log(2.0)


def _reference_scores(q, k, causal, scale, softcap=None):
    """``(scores, tanh)``: the scaled (and soft-capped) scores, masked with -inf above the diagonal when
    ``causal``, and ``tanh(raw / softcap)`` unmasked (None without a cap) for the backward's ``1 - tanh^2``."""
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return s, t


def _check_softcap(op: str, softcap) -> None:
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"{op}: softcap={softcap!r} must be a positive number (scores -> softcap * tanh(scores / "
                         "softcap)) or None")


def attention_reference_lse(q, k, v, causal: bool = True, scale: Optional[float] = None,
                            softcap: Optional[float] = None):
    """``(out, lse)`` of plain fp32 softmax attention; ``lse`` is ``(B, H, Tq)`` fp32, natural log.
    ``softcap``: scores ``s -> softcap * tanh(s / softcap)`` before the softmax (after ``scale``)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s, _ = _reference_scores(q, k, causal, scale, softcap)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.exp(s - lse[..., None]), v.float())
    return o.to(q.dtype), lse


def attention_backward_reference(do, q, k, v, o, lse, causal: bool = True, scale: Optional[float] = None,
                                 softcap: Optional[float] = None):
    """FlashAttention-2's backward in fp32 from a softmax's ``o`` and ``lse``: probabilities are
    recomputed as ``exp(s - lse)`` and ``delta = rowsum(do * o)``, so passing a larger softmax's
    ``o``/``lse`` gives this key block's share of that softmax's gradient. With ``softcap`` the
    gradient of the capped scores is carried back through the cap: times ``1 - tanh^2(s / softcap)``."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s, t = _reference_scores(q, k, causal, scale, softcap)
    p = torch.exp(s - lse.float()[..., None])
    dof = do.float()
    dv = torch.matmul(p.transpose(-2, -1), dof)
    dp = torch.matmul(dof, v.float().transpose(-2, -1))
    delta = (dof * o.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    if t is not None:
        ds = ds * (1 - t * t)
    dq = torch.matmul(ds, k.float())
    dk = torch.matmul(ds.transpose(-2, -1), q.float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _cpu_flash():
    """ATen's fused CPU flash attention ops (forward returning the lse, and backward), if this torch has them."""
    fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return (fwd, bwd) if fwd is not None and bwd is not None else None


def _lse_path(op: str, q, k, v, causal, backend, softcap=None) -> str:
    """``"triton"``, ``"cpu_flash"`` or ``"reference"`` by the dispatch rule; always ``"reference"`` with a
    ``softcap`` (which neither kernel applies)."""
    check_backend(op, backend)
    _check(op, q, k, v, causal)
    _check_softcap(op, softcap)
    if softcap is not None:
        return "reference"
    if choose(op, q, backend, _unsupported(q, k, v, causal)) == "triton":
        return "triton"
    if backend is None and q.device.type == "cpu" and _cpu_flash() is not None:
        return "cpu_flash"
    return "reference"


@torch.no_grad()
def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                            backend: Optional[str] = None, scale: Optional[float] = None,
                            softcap: Optional[float] = None):
    """``(out, lse)``: attention's output (``q``'s dtype) and each query row's log-sum-exp of its
    scaled scores, ``(B, H, Tq)`` fp32 (fp64 for fp64 inputs on the CPU flash path), natural log. No
    autograd graph: pair it with :func:`flash_attention_backward` inside your own
    ``autograd.Function`` (for a differentiable call use :func:`flash_attention`). Same dispatch,
    shapes and checks as ``flash_attention``; the torch path off CUDA is ATen's fused CPU flash
    kernel, the fallback the fp32 reference. ``softcap`` (logit soft-capping) always takes the fp32
    reference (O(Tq * Tk) memory)."""
    path = _lse_path("flash_attention_forward", q, k, v, causal, backend, softcap)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if path == "triton":
        B, H, Tq, _ = q.shape
        o, lse2 = _triton_fwd(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale)
        return o, (lse2 * _LN2).view(B, H, Tq)  # the kernel keeps log2
    if path == "cpu_flash":
        o, lse = _cpu_flash()[0](q, k, v, 0.0, causal, scale=scale)
        return o, lse if q.dtype == torch.float64 else lse.float()
    return attention_reference_lse(q, k, v, causal, scale, softcap)


@torch.no_grad()
def flash_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             o: torch.Tensor, lse: torch.Tensor, causal: bool = True,
                             backend: Optional[str] = None, scale: Optional[float] = None,
                             softcap: Optional[float] = None):
    """``(dq, dk, dv)`` of attention of ``q`` over the keys ``k``/``v`` given the upstream gradient
    ``do`` and a softmax's ``o`` and ``lse`` (as :func:`flash_attention_forward` returns them). When
    ``k``/``v`` are one block of a longer key sequence and ``o``/``lse`` belong to the softmax over
    all of it, the result is that block's share of the whole gradient (``dq`` shares sum; ``dk``,
    ``dv`` are the block's own): what ring attention needs. ``softcap`` as in :func:`flash_attention_forward`."""
    path = _lse_path("flash_attention_backward", q, k, v, causal, backend, softcap)
    if do.shape != q.shape or o.shape != q.shape or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"flash_attention_backward: do {tuple(do.shape)} and o {tuple(o.shape)} must have q's "
                         f"shape {tuple(q.shape)}, lse {tuple(lse.shape)} must be {tuple(q.shape[:3])}")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if path == "triton":
        B, H, Tq, _ = q.shape
        lse2 = (lse.float() / _LN2).reshape(B * H, Tq).contiguous()
        return _triton_bwd(q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(), lse2, do,
                           causal, scale)
    if path == "cpu_flash":
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        return _cpu_flash()[1](do, q, k, v, o, lse, 0.0, causal, scale=scale)
    return attention_backward_reference(do, q, k, v, o, lse, causal, scale, softcap)
