"""Weight-only int8: symmetric, one scale per output channel, layers swapped in place.

``quantize(model, "int8")`` replaces every ``nn.Linear`` (and transformers' ``Conv1D``, GPT-2's linears, its
``(in, out)`` weight transposed) by :class:`Int8Linear` and, by default,
every plain ``nn.Embedding`` by :class:`Int8Embedding` (a subclass with its own ``forward``, e.g. OPT's learned
positions or a scaled word embedding, stays in full precision: a lookup alone would drop what it adds);
tied weights stay one int8 tensor. Why weight-only
and hand-built, and which matmul runs where: docs/kernels.md, "Int8 inference".
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from colossal_lab.kernels import int8_linear
from colossal_lab.kernels import int8_linear_cpu as _cpu

MODES = ("int8",)
_F32 = torch.float32


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(N, K)`` float → int8 ``(N, K)`` and fp32 scales ``(N,)``: ``w ≈ q * scale[:, None]``."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError("quantize_weight: expected a 2-D floating-point weight, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """``y = x @ (q * scale)ᵀ + bias`` with int8 ``q``; a drop-in for an ``nn.Linear`` at inference."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None) -> "Int8Linear":
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.out_features, m.in_features = q.shape
        m.register_buffer("weight_int8", q)
        m.register_buffer("scale", scale)
        m.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        return m

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        q, s = quantize_weight(linear.weight)
        return cls.from_quantized(q, s, linear.bias)

    _plan = None  # colossal_lab.kernels.int8_linear_cpu.Plan for the current buffers, once built

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Decode on CPU (fp32, a few rows, no autograd): one call into the C kernel with the
        # weights checked once (the plan); a decode step is too short for more Python per layer.
        p, b = self._plan, self._buffers
        if (p is not None and _cpu.ENABLED and x.dtype is _F32 and x.is_cpu and x.shape[-1] == p.K
                and x.numel() <= p.max_numel and x.is_contiguous() and p.q is b["weight_int8"]
                and p.scale is b["scale"] and p.bias is b["bias"]
                and not (x.requires_grad and torch.is_grad_enabled())):
            return p.run(x)
        return self._forward_slow(x)

    def _forward_slow(self, x: torch.Tensor) -> torch.Tensor:
        q, s, bias = self.weight_int8, self.scale, self.bias
        y = int8_linear(x, q, s, bias)  # validates the shapes
        p = self._plan
        if p is not None and not (p.q is q and p.scale is s and p.bias is bias):
            self._plan = p = None  # buffers replaced (.to(), assignment, load with assign=True)
        if (p is None and _cpu.supports(x, q, s, bias) and q.is_cpu and s.is_cpu and (bias is None or bias.is_cpu)
                and q.numel() and q.is_contiguous() and s.is_contiguous() and (bias is None or bias.is_contiguous())):
            self._plan = _cpu.Plan(q, s, bias)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


class Int8Embedding(nn.Module):
    """Embedding rows stored int8 with one scale per row; lookups dequantise only the rows used."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, padding_idx: Optional[int] = None,
                 out_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.shape
        self.padding_idx = padding_idx
        self.out_dtype = out_dtype  # the dtype the rest of the model computes in
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # int8 rows × fp32 scales promotes to fp32 in the multiply itself (no separate cast)
        y = F.embedding(idx, self.weight_int8) * self.scale[idx].unsqueeze(-1)
        return y if y.dtype is self.out_dtype else y.to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"quantize: mode={mode!r} is not supported; choose one of {list(MODES)} "
                         "(weight-only, symmetric, per output channel)")


ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_dtype(dtype: Optional[torch.dtype]) -> None:
    if dtype is not None and dtype not in ACT_DTYPES:
        raise ValueError(f"quantize: dtype={dtype} is not supported for activations; choose one of "
                         f"{[str(d) for d in ACT_DTYPES]} or None (keep the model's)")


@torch.no_grad()
def cast_unquantized(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast every floating tensor except int8 scales to ``dtype``; int8 embeddings emit ``dtype``."""
    for m in model.modules():
        if isinstance(m, Int8Embedding):
            m.out_dtype = dtype
            continue
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None or not t.is_floating_point() or t.dtype == dtype:
                    continue
                if isinstance(m, Int8Linear) and name == "scale":
                    continue  # scales stay fp32: a per-channel rounding error would bias whole channels
                if isinstance(t, nn.Parameter):
                    t.data = t.data.to(dtype)
                else:
                    table[name] = t.to(dtype)


@torch.no_grad()
def quantize(model: nn.Module, mode: str = "int8", *, embeddings: bool = True,
             skip: Iterable[str] = (), dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Swap ``model``'s linear (and embedding) layers for int8 ones in place; returns ``model``.

    ``skip``: module names to leave in full precision (e.g. ``["lm_head"]``).
    ``dtype``: compute dtype for activations and the tensors left unquantised (e.g.
    ``torch.bfloat16``: on CPU the int8 matmul then runs without any per-layer casts);
    ``None`` keeps the model's.
    """
    check_mode(mode)
    check_dtype(dtype)
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize: model must be an nn.Module, got {type(model).__name__}")
    skip = set(skip)
    unknown = skip - {n for n, _ in model.named_modules()}
    if unknown:
        raise ValueError(f"quantize: skip names {sorted(unknown)} are not modules of this model")
    linears = [(n, m) for n, m in model.named_modules() if _is_linear(m) and n not in skip]
    if not linears:
        raise ValueError(f"quantize: {type(model).__name__} has no nn.Linear layers to quantize "
                         "(already quantized, or all skipped?)")
    targets = linears + ([(n, m) for n, m in model.named_modules() if is_plain_embedding(m) and n not in skip]
                         if embeddings else [])
    for n, m in targets:
        w = m.weight
        if w.is_meta:
            raise ValueError(f"quantize: {n}.weight is on the meta device; materialise the model first, "
                             "or load it with colossal_lab.engine.quant.load_quantized")
        if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"quantize: {n}.weight has dtype {w.dtype}; int8 quantization takes "
                             "float32, float16 or bfloat16 weights")
    memo: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
    for n, m in targets:
        key = id(m.weight)
        if key not in memo:
            memo[key] = quantize_weight(_out_in(m))
        q, s = memo[key]
        if _is_linear(m):
            new = Int8Linear.from_quantized(q, s, m.bias)
        else:
            new = Int8Embedding(q, s, m.padding_idx)
        model.set_submodule(n, new)
    if dtype is not None:
        cast_unquantized(model, dtype)
    return model


def _is_linear(m: nn.Module) -> bool:
    """An ``nn.Linear``, or a transformers ``Conv1D`` (GPT-2's linears, weight stored ``(in, out)``)."""
    from ..models.hf.local_linear import is_conv1d

    return isinstance(m, nn.Linear) or is_conv1d(m)


def is_plain_embedding(m: nn.Module) -> bool:
    """An ``nn.Embedding`` whose forward is the plain lookup: what :class:`Int8Embedding` replaces exactly."""
    return isinstance(m, nn.Embedding) and type(m).forward is nn.Embedding.forward


def _out_in(m: nn.Module) -> torch.Tensor:
    """The layer's weight as ``(out, in)``: a ``Conv1D``'s transposed (``y = x @ W + b``)."""
    from ..models.hf.local_linear import is_conv1d

    return m.weight.t() if is_conv1d(m) else m.weight


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.device) if not t.is_meta else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
