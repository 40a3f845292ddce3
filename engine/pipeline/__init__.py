"""Pipeline parallelism on ``torch.distributed.pipelining``, with measured timelines.

* :mod:`.schedules` — which torch schedule a ``pp_style`` means, and up-front validation;
* :mod:`.stage` — cutting a model (its ``pipeline_stage``, or an ``nn.Sequential``'s children)
  into stage modules and torch stages;
* :mod:`.timing` — wall-clock ``StageSpan``s for every F/B/W/send/recv/optim action;
* :mod:`.runtime` — one step: microbatches in, loss and per-stage bubble fractions out;
* :mod:`.checkpoint` — save/load under the unsplit model's names.
"""

from .runtime import PipelineRuntime, split_batch
from .schedules import MULTI_STAGE_STYLES, PP_STYLES, ScheduleSpec, validate_schedule
from .timing import SpanRecorder

__all__ = ["PipelineRuntime", "split_batch", "PP_STYLES", "MULTI_STAGE_STYLES", "ScheduleSpec",
           "validate_schedule", "SpanRecorder"]
