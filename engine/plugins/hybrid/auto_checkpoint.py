"""``activation_checkpointing="auto"`` under ``HybridParallelPlugin``: one plan per stage and input shape.

:class:`StageCheckpointHook` is a forward pre-hook on a stage's module that, at its first training
forward of each input shape, profiles the stage on that very input (a microbatch, or a received
activation), merges the profile over the stage's tp and cp ranks, solves it for the stage's share of
the budget (``activation_budget // in-flight microbatches``) and applies the plan
(``autockpt.apply``: ``module.checkpoint_plan``). The last stage's loss is the criterion on the
microbatch being run; an earlier stage's stands for the gradient it will receive (an output-sized
tensor held through backward).

In a pipeline a stage whose share is below the lowest peak any plan reaches does not raise inside the
schedule (the other stages would wait for its activations until the collective timeout): it runs this
step under that lowest-peak plan and records the error in the :class:`PipelineStep`, and
``execute_pipeline`` raises it on every rank after the step.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn


@dataclass
class PipelineStep:
    """What the ``execute_pipeline`` call in progress tells the stage hooks: its microbatches (None: a
    direct forward, no call in progress) and the plans that failed on this rank's stages."""

    microbatches: Optional[int] = None
    errors: List[str] = field(default_factory=list)


class StageCheckpointHook:
    """The pre-hook of one stage (module docstring). ``share(m)``: the stage's budget per microbatch
    when ``m`` microbatches run; ``pipelined``: the stages run as a pipeline (``pp_size > 1``)."""

    def __init__(self, step: PipelineStep, runtime, groups, pp_rank: int, share: Callable[[int], int],
                 is_last: bool, pipelined: bool):
        self.step, self.runtime, self.groups = step, runtime, groups
        self.pp_rank, self.share, self.is_last, self.pipelined = pp_rank, share, is_last, pipelined
        self.plans: Dict[tuple, Any] = {}
        self.busy = False  # profiling calls the module: the hook stays out of its own steps

    def loss_fn(self):
        if self.step.microbatches is None:
            return None  # a direct forward (pp_size == 1): the model's own loss, as the caller's backward
        if self.is_last:
            crit, mb = self.runtime.criterion, self.runtime.microbatches[0]
            return lambda out, inputs: crit(out[0] if isinstance(out, tuple) else out, mb)

        def received(out, inputs):  # the next stage's gradient: an output-sized tensor through backward
            o = out[0] if isinstance(out, tuple) else out
            return (o * torch.ones_like(o)).sum()
        return received

    def __call__(self, module: nn.Module, args, kwargs):
        if self.busy or not (module.training and torch.is_grad_enabled()):
            return None
        from ...autockpt import apply

        tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
        if not tensors or any(t.is_meta for t in tensors):
            return None  # torch's shape inference, on meta tensors
        key = tuple((tuple(t.shape), t.dtype) for t in tensors) + (torch.is_autocast_enabled(tensors[0].device.type),)
        plan = self.plans.get(key)
        if plan is None:
            sample = dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments) if kwargs else tuple(args)
            plan = self._plan(module, sample)
            if plan is None:
                return None  # failed in a pipeline: this step runs under the lowest-peak plan
            self.plans[key] = plan
        if getattr(module, "checkpoint_plan", None) is not plan:
            apply(module, plan)
        return None

    def _plan(self, module: nn.Module, sample):
        from ...autockpt import apply, min_peak, solve
        from ...autockpt_dist import agreed_profile

        self.busy = True
        try:
            prof = agreed_profile(module, sample, self.loss_fn(), groups=self.groups)
        finally:
            self.busy = False
        try:
            return solve(prof, self.share(self.step.microbatches or 1))
        except ValueError as exc:
            if self.step.microbatches is None or not self.pipelined:
                raise  # every rank of this stage (all of them, without a pipeline) raises alike
            self.step.errors.append(f"pipeline stage on pp rank {self.pp_rank}: {exc}")
            apply(module, solve(prof, min_peak(prof)[0]))  # this step runs; execute_pipeline raises after
            return None
