"""``HybridParallelModule``: what ``HybridParallelPlugin.configure`` hands back as the model.

This rank's pipeline stage modules (each a ``StageModule`` whose ``inner`` keeps the unsplit model's
parameter names) and the ``PipelineRuntime`` that drives them; a direct forward without a pipeline
cuts the batch for context parallelism or the 2D/2.5D/3D grid (:mod:`.nd_call`) and runs under the
precision's autocast.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ... import comm
from ...device import to_device
from ...wrappers import _count_tokens

_CKPT_INFIX = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper adds it to parameter names


class HybridParallelModule(nn.Module):
    """The boosted model: this rank's ``stage_modules`` (parameters under the full model's names
    behind each stage's ``inner.``) and the runtime that drives them. Callable directly only
    without a pipeline (``pp_size == 1``); with one, use ``booster.execute_pipeline``."""

    def __init__(self, stage_modules: List[nn.Module], runtime, pp_size: int):
        super().__init__()
        self.stage_modules = nn.ModuleList(stage_modules)
        self.runtime = runtime
        self._plugin_pp = pp_size
        self.device = runtime.device
        self.tokens = 0  # tokens seen since the last optimizer step (StepMetrics)
        self.first_forward: Optional[float] = None
        self.nd = None  # a tp_nd.NdParallel under tp_mode 2d/2.5d/3d (set by configure)
        self.cp = None  # (group, mode) under context parallelism (set by configure)
        self.experts = None  # experts.ExpertGroups under expert parallelism (set by configure)

    def forward(self, *args, **kwargs):
        if self._plugin_pp > 1:
            raise RuntimeError("HybridParallelPlugin(pp_size>1): the model is split across ranks; "
                               "call booster.execute_pipeline(data_iter, model, criterion, optimizer)")
        args, kwargs = to_device((args, kwargs), self.device)
        stage = self.stage_modules[0]
        if self.cp is not None and getattr(stage.inner, "_colossal_cp", None) is not None:
            from ...models.hf.context import shard_inputs  # a transformers model: positions, shifted labels

            args, kwargs = (), shard_inputs(stage.inner, args, kwargs, *self.cp)
        elif self.cp is not None:  # context parallel: every (B, T, ...) argument cut to this rank's shard of T
            from ...context_parallel import shard_sequence

            group, mode = self.cp
            r, n = dist.get_rank(group), dist.get_world_size(group)
            cut = lambda a: shard_sequence(a, r, n, mode) if isinstance(a, torch.Tensor) and a.dim() >= 2 else a  # noqa: E731
            args, kwargs = tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}
        run = stage.inner
        if self.nd is not None:  # 2D/2.5D/3D: this rank's piece of the batch, the loss the batch mean
            from ...models.hf import reads_dict_plan
            from . import nd_call

            hf = reads_dict_plan(stage.inner)
            self.count(args, kwargs)  # the whole batch's tokens, as execute_pipeline counts them
            args, kwargs = nd_call.cut_call(self.nd.grid, args, kwargs, self.runtime.input_key, hf)
            grid, key = self.nd.grid, self.runtime.input_key
            run = lambda *a, **k: nd_call.forward(stage.inner, grid, a, k, key, hf)  # noqa: E731
        else:
            self.count(args, kwargs)
        if stage.autocast_dtype is None:
            return run(*args, **kwargs)
        # the whole output (GPT's (logits, loss) too), under the precision's autocast
        with torch.autocast(device_type=self.device.type, dtype=stage.autocast_dtype):
            return run(*args, **kwargs)

    def count(self, args, kwargs) -> None:
        """Count a forward's (or a pipeline batch's) tokens for this step's StepMetrics."""
        if self.first_forward is None:
            self.first_forward = time.perf_counter()
        self.tokens += _count_tokens(args, kwargs)

    def named_model_parameters(self, remove_duplicate: bool = True):
        """``(name, param)`` under the unsplit model's names (activation-checkpoint wrappers'
        infix dropped, as in ``state_dict``); ``remove_duplicate=False`` also yields the second
        name of a tied weight held by one stage."""
        for mod in self.stage_modules:
            for n, p in mod.inner.named_parameters(remove_duplicate=remove_duplicate):
                yield n.replace(_CKPT_INFIX, ""), p

    def unwrap(self) -> nn.Module:
        return self

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The unsplit model's state dict, gathered on every rank (DTensors made whole, every
        pipeline stage contributing its own parameters, the EP group its experts); names match the plain model."""
        local = {}
        for mod in self.stage_modules:
            for n, t in mod.inner.state_dict().items():
                t = t.full_tensor() if hasattr(t, "full_tensor") else t
                if self.nd is not None and n in self.nd.params:
                    t = self.nd.full(n, t)  # a collective over the tp group, in state-dict order
                if self.experts is not None and n in self.experts.names:
                    t = self.experts.full(t)  # every expert: a collective over the EP group, likewise
                local[n] = t.detach().to("cpu", copy=True)  # a snapshot, never the live tensor
        group = self.runtime.pp_group
        if group is None or dist.get_world_size(group) == 1:
            return local
        parts: List[Any] = [None] * dist.get_world_size(group)
        comm.all_gather_object(parts, local, group=group)
        return {n: t for part in parts for n, t in part.items()}
