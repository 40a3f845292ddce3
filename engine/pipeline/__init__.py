"""Pipeline parallelism on ``torch.distributed.pipelining``, with measured timelines: which
schedule (:mod:`.schedules`), cutting a model into stages (:mod:`.stage`), timing every action
(:mod:`.timing`), one step (:mod:`.runtime`), checkpoints under the unsplit names (:mod:`.checkpoint`).
"""

from .runtime import PipelineRuntime, split_batch
from .schedules import MULTI_STAGE_STYLES, PP_STYLES, ScheduleSpec, validate_schedule
from .timing import SpanRecorder

__all__ = ["PipelineRuntime", "split_batch", "PP_STYLES", "MULTI_STAGE_STYLES", "ScheduleSpec",
           "validate_schedule", "SpanRecorder"]
