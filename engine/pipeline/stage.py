"""Cut a model into pipeline stage modules and wrap them as torch ``PipelineStage``s.

A model is cut by the model contract's ``num_layers()``/``pipeline_stage(i, n)``, or, as an
``nn.Sequential``, evenly by its children (docs/hybrid.md); a transformers model is cut by its adapter
(``models.hf``: its ``base_model_pp_plan``), which is asked first (docs/hf.md).
:class:`StageModule` keeps the first item of a tuple output (torch's stages want tensors) and runs the
stage under autocast when asked.
"""

from __future__ import annotations

import copy
from typing import List, Optional

import torch
import torch.nn as nn


class StageModule(nn.Module):
    """One pipeline stage: the model part (``inner``, whose parameter names are the unsplit
    model's behind an ``inner.`` prefix) plus the bits a schedule needs around it."""

    def __init__(self, inner: nn.Module, autocast_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.inner = inner
        self.autocast_dtype = autocast_dtype

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """``kwargs``: the batch's entries every stage takes (a transformers model's ``attention_mask``, ...)."""
        if self.autocast_dtype is not None:
            with torch.autocast(device_type=x.device.type, dtype=self.autocast_dtype):
                out = self.inner(x, **kwargs)
        else:
            out = self.inner(x, **kwargs)
        if isinstance(out, tuple):  # e.g. GPT's (logits_or_hidden, loss)
            out = out[0]
        return out


def _no_split(model: nn.Module, method: str) -> TypeError:
    return TypeError(
        f"pipeline parallelism: {type(model).__name__} has no {method} (the model contract, "
        "colossal_lab.engine.models.protocol) and is not an nn.Sequential; implement num_layers() and "
        "pipeline_stage(stage, num_stages), or wrap your layers in nn.Sequential (one child per splittable unit)")


def num_layers(model: nn.Module) -> int:
    """How many units the model splits into (its ``num_layers()``, or Sequential children)."""
    from ..models import hf

    if hf.is_hf_model(model):
        return hf.num_layers(model)
    if callable(getattr(model, "num_layers", None)):
        return model.num_layers()
    if isinstance(model, nn.Sequential):
        return len(model)
    raise _no_split(model, "num_layers()")


def check_divisible(model: nn.Module, num_stages: int) -> None:
    """``ValueError`` naming the valid stage counts when the layers do not divide evenly."""
    n = num_layers(model)
    if n % num_stages:
        valid = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(
            f"HybridParallelPlugin: {n} layers cannot be split evenly into pp_size * num_model_chunks = "
            f"{num_stages} stages; choose pp_size * num_model_chunks in {valid}"
        )


def split_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """A copy of ``model`` holding only stage ``stage``'s part."""
    from ..models import hf

    check_divisible(model, num_stages)
    if hf.is_hf_model(model):
        return hf.pipeline_stage(model, stage, num_stages)
    if callable(getattr(model, "pipeline_stage", None)):
        return model.pipeline_stage(stage, num_stages)
    if not isinstance(model, nn.Sequential):
        raise _no_split(model, "pipeline_stage(stage, num_stages)")
    per = len(model) // num_stages
    return copy.deepcopy(model[stage * per:(stage + 1) * per])


def build_stages(model: nn.Module, stage_ids: List[int], num_stages: int, group, device: torch.device,
                 autocast_dtype: Optional[torch.dtype] = None, prepare=None):
    """``(modules, stages)`` for this rank's stage ids; ``prepare(module)`` runs before wrapping
    (tensor parallelism is applied there, so the stage sees sharded parameters)."""
    from torch.distributed.pipelining import PipelineStage

    from ..models.hf.empty import needs_empty, to_empty_for_load

    modules, stages = [], []
    for s in stage_ids:
        part = split_stage(model, s, num_stages)
        if prepare is not None:
            part = prepare(part) or part
        mod = StageModule(part, autocast_dtype)
        # a transformers model built on meta: storage for this stage's (shards of) tensors only, for load_model
        mod = to_empty_for_load(mod, device) if needs_empty(mod) else mod.to(device)
        modules.append(mod)
        stages.append(_load_not_counted(PipelineStage(mod, s, num_stages, device, group=group)))
    return modules, stages


def _load_not_counted(stage):
    """The stage's shape inference (a real forward on its first step, on placeholder tensors past the first
    stage) kept out of the MoE blocks' expert load (``moe.not_counted``); torch names it
    ``_forward_metadata_inference`` (2.13), an older torch infers shapes otherwise and needs nothing here."""
    from ..moe.layer import not_counted

    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is not None:
        def uncounted(*args, **kwargs):
            with not_counted():
                return infer(*args, **kwargs)

        stage._forward_metadata_inference = uncounted
    return stage
