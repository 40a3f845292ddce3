"""Mixed precision: the precision names, autocast policy, dynamic loss scaling, fp8 checks.

Design (the torch.amp recipe, shared by every plugin): the model's parameters stay fp32 — they
*are* the fp32 master weights the optimizer updates — and the forward/backward math runs in
fp16/bf16 under ``torch.autocast``. fp16 adds :class:`DynamicLossScaler` (growth/backoff, a step
with an inf/nan gradient on *any* rank is skipped on *every* rank). What this does not do is
halve parameter memory: Gemini (chunked fp16/bf16 params with fp32 master chunks) is the plugin
for that. We did not take ``torch.amp.GradScaler`` as is because its inf check is per process:
with ZeRO-2 each rank sees only its gradient shard, so the check must be all-reduced.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .fp8 import fp8_unavailable_reason, require_fp8
from .loss_scaler import DynamicLossScaler

PRECISIONS = ("fp32", "fp16", "bf16", "fp8")

_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


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
    return _DTYPES[mixed_precision]


def needs_loss_scaling(mixed_precision: str) -> bool:
    return mixed_precision == "fp16"


__all__ = ["PRECISIONS", "validate_precision", "autocast_dtype", "needs_loss_scaling",
           "DynamicLossScaler", "require_fp8", "fp8_unavailable_reason"]
