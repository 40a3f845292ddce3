"""Triton kernels, each beside its plain-torch reference, behind one dispatch rule.

``backend=None`` picks Triton for CUDA tensors where it has earned its place (measured at least as fast as
torch on that GPU: ``earned``, ``measured``; ``chosen()`` says what ran) and the best torch path elsewhere (SDPA for
attention, a small C kernel or ``aten._weight_int8pack_mm`` for int8 on CPU, torch's fused AdamW); ``"triton"``
forces the kernel (CPU too, under ``TRITON_INTERPRET=1``); ``"torch"`` runs the reference.
Triton is imported on first use only, so this package imports where Triton is missing.
See ``docs/kernels.md``.
"""

from .adamw import FusedAdamW, adamw_reference, fused_adamw
from .dispatch import BACKENDS, interpret_mode, triton_available
from .earned import chosen
from .flash_attention import (
                              attention_backward_reference,
                              attention_reference,
                              attention_reference_lse,
                              flash_attention,
                              flash_attention_backward,
                              flash_attention_forward,
)
from .int8_matmul import int8_linear, int8_linear_reference
from .rms_norm import rms_norm, rms_norm_reference

__all__ = [
    "BACKENDS", "FusedAdamW", "adamw_reference", "attention_backward_reference", "attention_reference",
    "attention_reference_lse", "chosen", "flash_attention", "flash_attention_backward", "flash_attention_forward",
    "fused_adamw",
    "int8_linear", "int8_linear_reference", "interpret_mode", "rms_norm", "rms_norm_reference",
    "triton_available",
]
