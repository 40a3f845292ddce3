"""Int8 weight-only linear: ``y = (x @ W_int8ᵀ) * scale + bias``, dequantisation fused.

Weights are int8 ``(N, K)`` with one fp scale per output channel (symmetric, see
``colossal_lab.engine.quant``). Paths:

* Triton (CUDA): each tile of ``W`` is loaded as int8 (¼ of fp32's bytes — decode is
  memory-bound, so that is the win), converted to the activation dtype in registers, fed to
  ``tl.dot`` with an fp32 accumulator, and scaled per column once at the end.
* CPU, fp32 inputs with at most ``DECODE_ROWS`` rows (decode steps, the memory-bound case):
  our C kernel (``int8_linear_cpu.py``: fp32 activations × int8 weights widened in registers,
  scale and bias fused, one call, no bf16 rounding). Without a C compiler: torch's
  ``aten._weight_int8pack_mm``, whose fast CPU kernel takes bf16/fp16 activations only (the
  fp32 variant runs a scalar loop), so fp32 inputs are cast to bf16 and back around it.
* CPU, bf16/fp16 inputs: ``aten._weight_int8pack_mm`` directly (in-features a multiple of
  ``PACK_K``; others dequantise). Larger fp32 inputs (prefill, perplexity) dequantise into an
  fp32 GEMM, which is compute-bound there anyway.
* ``backend="torch"``: the reference, dequantise then ``F.linear`` in ``x``'s dtype.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F

from . import int8_linear_cpu as _cpu
from .dispatch import check_backend, choose, lazy_kernels

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DECODE_ROWS = _cpu.MAX_ROWS
GEMV_ROWS = 16  # up to this many rows a call is decode-shaped (a GEMV's class in the kernel measurements)
PACK_K = 32  # in-features the aten int8 kernel handles safely here


def int8_linear_reference(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    y = F.linear(x, weight_int8.to(x.dtype)) * scale.to(x.dtype)
    return y + bias.to(x.dtype) if bias is not None else y


_SCALES: dict = {}  # id(scale) -> (weakref to scale, its version, low-precision copy)


def _scale_as(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale.to(dtype)``, cached per scale tensor (a decode step would otherwise convert every
    layer's scales every token); invalidated when the scale is modified in place."""
    if scale.dtype == dtype:
        return scale
    key = id(scale)
    hit = _SCALES.get(key)
    if hit is None or hit[0]() is not scale or hit[1] != scale._version or hit[2].dtype != dtype:
        ref = weakref.ref(scale, lambda _r, k=key: _SCALES.pop(k, None))
        hit = (ref, scale._version, scale.to(dtype))
        _SCALES[key] = hit
    return hit[2]


def _cpu_fast(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor,
              bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Best plain-torch path off CUDA (see module docstring)."""
    if _cpu.supports(x, weight_int8, scale, bias):
        return _cpu.int8_linear_cpu(x, weight_int8, scale, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x.dtype == torch.float32 and x2.shape[0] > DECODE_ROWS:
        return int8_linear_reference(x, weight_int8, scale, bias)
    if x.device.type != "cpu" or x.dtype == torch.float64 or x.shape[-1] % PACK_K:
        # the aten kernel reads K in blocks and can fault on other in-features; dequantise instead
        return int8_linear_reference(x, weight_int8, scale, bias)
    if x.requires_grad and torch.is_grad_enabled():  # aten's int8 op has no derivative
        return int8_linear_reference(x, weight_int8, scale, bias)
    cdt = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
    y = torch.ops.aten._weight_int8pack_mm(x2.to(cdt).contiguous(), weight_int8, _scale_as(scale, cdt))
    y = y.to(x.dtype).reshape(*x.shape[:-1], weight_int8.shape[0])
    return y + bias.to(x.dtype) if bias is not None else y


def _build():
    global triton, tl  # Triton resolves a kernel's names through its module globals
    import triton
    import triton.language as tl

    @triton.jit
    def mm(X, W, S, B, Y, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr, F32: tl.constexpr,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(X + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(W + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0)
            if F32:  # fp32 activations (and the CPU interpreter, whose bf16 dot is wrong): exact fp32 dot
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w.to(a.dtype))
        s = tl.load(S + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc * s[None, :]
        if HAS_BIAS:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rm[:, None] * sym + rn[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return SimpleNamespace(mm=mm)


_kernels = lazy_kernels(_build)


def _triton(x, weight_int8, scale, bias):
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x2.shape
    N = weight_int8.shape[0]
    w = weight_int8.contiguous()
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if x.is_cuda:
        BM = 16 if M <= 16 else (32 if M <= 32 else 64)
        BN, BK, extra = 64, 128, {"num_warps": 4}
    else:
        BM, BN, BK, extra = 16, 64, 64, {}
    grid = ((M + BM - 1) // BM, (N + BN - 1) // BN)
    f32 = x.dtype == torch.float32 or (not x.is_cuda and x.dtype == torch.bfloat16)
    _kernels(x).mm[grid](x2, w, scale.contiguous(), bias if bias is not None else scale, y, M, N, K,
                         x2.stride(0), w.stride(0), y.stride(0), HAS_BIAS=bias is not None, F32=f32,
                         BM=BM, BN=BN, BK=BK, **extra)
    return y.reshape(*x.shape[:-1], N)


class _Int8Linear(torch.autograd.Function):
    """Triton forward; backward to ``x`` only (weights are frozen int8)."""

    @staticmethod
    def forward(ctx, x, weight_int8, scale, bias):
        ctx.save_for_backward(weight_int8, scale)
        return _triton(x, weight_int8, scale, bias)

    @staticmethod
    def backward(ctx, dy):
        w, s = ctx.saved_tensors
        return (dy * s.to(dy.dtype)) @ w.to(dy.dtype), None, None, None


def int8_linear(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor,
                bias: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """``x (…, K)`` × int8 ``weight (N, K)`` with per-output-channel ``scale (N,)`` (+ ``bias (N,)``)."""
    check_backend("int8_linear", backend)
    if not isinstance(weight_int8, torch.Tensor) or weight_int8.dtype != torch.int8 or weight_int8.dim() != 2:
        raise ValueError(f"int8_linear: weight_int8 must be a 2-D torch.int8 tensor (N, K), got "
                         f"{getattr(weight_int8, 'dtype', type(weight_int8).__name__)} "
                         f"{tuple(getattr(weight_int8, 'shape', ()))}; quantise with colossal_lab.engine.quant")
    N, K = weight_int8.shape
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"int8_linear: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.shape[-1] != K:
        raise ValueError(f"int8_linear: x's last dim {x.shape[-1]} != weight_int8's in-features {K}")
    if scale.shape != (N,) or not scale.is_floating_point():
        raise ValueError(f"int8_linear: scale must be a float tensor of shape ({N},) (one per output channel), "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"int8_linear: bias must have shape ({N},), got {tuple(bias.shape)}")
    why = None if x.dtype in DTYPES else f"dtype {x.dtype} (the kernel takes {DTYPES})"
    rows = x.numel() // max(1, x.shape[-1])
    which = choose("int8_linear", x, backend, why, klass="decode" if rows <= GEMV_ROWS else "prefill")
    if which == "triton":
        return _Int8Linear.apply(x, weight_int8, scale, bias)
    if backend == "torch":
        return int8_linear_reference(x, weight_int8, scale, bias)
    return _cpu_fast(x, weight_int8, scale, bias)
