"""Mixed precision: the precision names, autocast policy, dynamic loss scaling, fp8 checks.

The torch.amp recipe, shared by every plugin: fp32 parameters are the master weights, the math runs
in fp16/bf16 under ``torch.autocast``, fp16 adds :class:`DynamicLossScaler` (docs/engine.md, "Mixed
precision").
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .fp8 import fp8_unavailable_reason, require_fp8
from .loss_scaler import DynamicLossScaler

PRECISIONS = ("fp32", "fp16", "bf16", "fp8")

#: The one precision-name -> dtype table. fp8 has no entry: its matmuls run in float8 inside
#: ``Fp8Linear`` and everything else in bf16 (see :func:`autocast_dtype`).
TORCH_DTYPE_MAP = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def validate_precision(mixed_precision: str, supported: Optional[Sequence[str]] = None,
                       who: str = "Booster") -> str:
    """Return ``mixed_precision`` or raise ``ValueError`` naming the valid choices."""
    if not isinstance(mixed_precision, str) or mixed_precision not in PRECISIONS:
        raise ValueError(f"{who}(mixed_precision={mixed_precision!r}): unknown precision; "
                         f"choose one of {list(PRECISIONS)}")
    if supported is not None and mixed_precision not in supported:
        raise ValueError(f"{who}: mixed_precision={mixed_precision!r} is not supported by this plugin; "
                         f"it supports {list(supported)}")
    return mixed_precision


def autocast_dtype(mixed_precision: str) -> Optional[torch.dtype]:
    """The dtype the forward runs in (None = plain fp32). fp8 keeps bf16 for non-matmul ops."""
    if mixed_precision == "fp32":
        return None
    return torch.bfloat16 if mixed_precision == "fp8" else TORCH_DTYPE_MAP[mixed_precision]


def resolve_precision(mixed_precision: Optional[str], plugin_precision: str, who: str) -> str:
    """The one rule for who chooses the precision: ``Booster(mixed_precision=...)`` decides
    whenever it is given (fp32 included); left at its default None, the plugin's own
    ``precision`` argument does (Gemini's default is bf16, the hybrid plugin's fp32)."""
    chosen = plugin_precision if mixed_precision is None else mixed_precision
    if chosen not in TORCH_DTYPE_MAP:
        raise ValueError(f"{who} does not support mixed_precision={chosen!r}; use one of {list(TORCH_DTYPE_MAP)}")
    return chosen


def needs_loss_scaling(mixed_precision: str) -> bool:
    return mixed_precision == "fp16"


__all__ = ["PRECISIONS", "TORCH_DTYPE_MAP", "validate_precision", "autocast_dtype", "resolve_precision",
           "needs_loss_scaling",
           "DynamicLossScaler", "require_fp8", "fp8_unavailable_reason"]
