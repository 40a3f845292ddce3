"""A plan on the telemetry bus, as a ``CheckpointPlanEvent`` (what ``CheckpointPlanView`` draws)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch.nn as nn

if TYPE_CHECKING:
    from .solver import CheckpointPlan


def _stage_of(model: nn.Module, default: int = 0) -> int:
    """The model's pipeline stage where it says (an int ``stage_index``, as torch's
    ``PipelineStage`` names it, or ``pipeline_stage_index``), else ``default``."""
    for name in ("stage_index", "pipeline_stage_index"):
        v = getattr(model, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return default


def plan_event(plan: CheckpointPlan, rank: int = 0, stage: int = 0):  # -> telemetry CheckpointPlanEvent
    """``plan`` as a telemetry ``CheckpointPlanEvent`` (per layer: option, bytes kept and predicted
    recompute seconds under it, overhead included (``OptionCost.cost_s``, so they sum to the plan's
    ``predicted_recompute_s``), from the plan's profile; without a profile those two are left empty)."""
    from ..telemetry.events import CheckpointPlanEvent

    prof = plan.profile
    units = prof.units if prof is not None and len(prof.units) == len(plan.choice) else None
    return CheckpointPlanEvent(
        rank=int(rank), stage=int(stage), time=time.time(), budget=int(plan.budget),
        predicted_peak=int(plan.predicted_peak), predicted_recompute_s=float(plan.predicted_recompute_s),
        peak_none=int(plan.peak_none), peak_min=int(plan.peak_min), layers=tuple(str(e) for e in plan.layers),
        names=tuple(plan.names), options=tuple(plan.choice),
        keep=tuple(int(u.options[o].keep) for u, o in zip(units, plan.choice)) if units else (),
        recompute_s=tuple(float(u.options[o].cost_s) for u, o in zip(units, plan.choice)) if units else (),
        prefix_keep=int(prof.prefix_keep) if prof is not None else 0, forward_s=float(plan.forward_s),
        device=prof.device if prof is not None else "cpu")


def _emit(plan: CheckpointPlan, stage: int) -> None:
    """Put the plan on this process's telemetry bus (rank: this process's in the default group,
    else 0); one list check when nobody listens."""
    from ..telemetry import bus

    if not bus.has_subscribers():
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    bus.emit(plan_event(plan, rank, stage))
