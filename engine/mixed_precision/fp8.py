"""fp8 (e4m3) matmuls for ``mixed_precision="fp8"`` — only where the hardware has them.

:class:`Fp8Linear` quantises input and weight with dynamic per-tensor scales for
``torch._scaled_mm`` (CUDA, compute capability >= 8.9) and runs the backward in bf16; elsewhere
asking for fp8 is a clear error. What is and is not done: docs/engine.md, "Mixed precision".
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

E4M3_MAX = 448.0


def fp8_unavailable_reason() -> Optional[str]:
    """None when fp8 matmuls can run here, else why not (one sentence)."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no float8_e4m3fn/_scaled_mm"
    if not torch.cuda.is_available():
        return "fp8 matmuls need a CUDA GPU of compute capability >= 8.9 and this machine has no CUDA device"
    cc = torch.cuda.get_device_capability()
    if cc < (8, 9):
        return (f"fp8 matmuls need compute capability >= 8.9 (Ada/Hopper or newer); "
                f"{torch.cuda.get_device_name()} has {cc[0]}.{cc[1]}")
    return None


def require_fp8(who: str = "Booster") -> None:
    reason = fp8_unavailable_reason()
    if reason is not None:
        raise ValueError(f"{who}(mixed_precision='fp8'): {reason}; use mixed_precision='bf16' instead")


def _to_fp8(t: torch.Tensor):
    amax = t.detach().abs().max().float().clamp(min=1e-12)
    scale = amax / E4M3_MAX  # dequant scale: t ~= fp8 * scale
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor):
        ctx.save_for_backward(x2d, weight)
        xq, sx = _to_fp8(x2d)
        wq, sw = _to_fp8(weight)
        # _scaled_mm wants the second operand column-major: weight (out, in) row-major -> .t()
        return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        g = grad_out.to(torch.bfloat16)
        grad_x = g @ weight.to(torch.bfloat16)
        grad_w = g.t() @ x2d.to(torch.bfloat16)
        return grad_x.to(x2d.dtype), grad_w.to(weight.dtype)


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose forward matmul runs in fp8 (same parameters and state-dict names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2d = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if x2d.shape[0] % 16:  # _scaled_mm needs every dim % 16; odd token counts fall back
            return F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16), self.bias)
        y = _Fp8Matmul.apply(x2d, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)


def convert_to_fp8(model: nn.Module) -> int:
    """Turn eligible ``nn.Linear`` layers of ``model`` into :class:`Fp8Linear` in place; returns
    how many. Parameters are untouched (the class is swapped), so checkpoints are unchanged."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.in_features % 16 == 0 and m.out_features % 16 == 0:
            m.__class__ = Fp8Linear
            n += 1
    return n
