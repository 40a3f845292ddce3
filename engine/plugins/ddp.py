"""``DDPPlugin``: plain data parallelism on ``torch.nn.parallel.DistributedDataParallel``.

DDP already buckets and overlaps the gradient all-reduce with the backward; the plugin adds the
Booster's wrappers and the default checkpoint IO, and leaves a one-rank model unwrapped
(docs/engine.md, "Plugins").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import comm
from ..wrappers import ModelWrapper, OptimizerWrapper
from .base import Plugin, default_device


@dataclass
class DDPPlugin(Plugin):
    """Arguments are DDP's own (see ``torch.nn.parallel.DistributedDataParallel``)."""

    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    static_graph: bool = False

    def __post_init__(self):
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"DDPPlugin(bucket_cap_mb={self.bucket_cap_mb}): must be > 0 MB")

    supported_precisions = ("fp32", "fp16", "bf16", "fp8")

    def _wrap_module(self, module: nn.Module) -> nn.Module:
        if not comm.initialized() or self.dp_size == 1:
            return module
        dev = default_device()
        # broadcast_buffers is passed only when changed: torch 2.13 warns that it is deprecated
        extra = {} if self.broadcast_buffers else {"broadcast_buffers": False}
        return DDP(module, device_ids=[dev.index] if dev.type == "cuda" else None,
                   process_group=self.dp_group, **extra,
                   bucket_cap_mb=self.bucket_cap_mb, find_unused_parameters=self.find_unused_parameters,
                   gradient_as_bucket_view=self.gradient_as_bucket_view, static_graph=self.static_graph)

    def configure(self, model, optimizer, criterion, dataloader, lr_scheduler, mixed_precision):
        model = prepare_module(model, mixed_precision)
        wrapped = ModelWrapper(self._wrap_module(model), mixed_precision)
        if optimizer is not None:
            optimizer = OptimizerWrapper(optimizer, wrapped, mixed_precision, group=self.dp_group)
        return wrapped, optimizer, criterion, dataloader, lr_scheduler

    def no_sync(self, model, optimizer=None):
        inner = model.unwrap() if hasattr(model, "unwrap") else model
        if isinstance(inner, DDP):
            return inner.no_sync()
        return contextlib.nullcontext()


def prepare_module(model: nn.Module, mixed_precision: str) -> nn.Module:
    """Move ``model`` to this rank's device and apply precision-specific module changes (fp8
    swaps eligible Linear layers; parameters stay fp32 masters in every mode)."""
    from ..models.hf.empty import needs_empty, to_empty_for_load

    if needs_empty(model):  # a transformers model built on meta, for booster.load_model to fill
        model = to_empty_for_load(model, default_device())
    else:
        model = model.to(default_device())
    if mixed_precision == "fp8":
        from ..mixed_precision.fp8 import convert_to_fp8

        convert_to_fp8(model)
    return model
