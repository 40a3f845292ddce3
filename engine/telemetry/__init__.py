"""Telemetry: small event dataclasses, an in-process bus, and JSONL traces.

    from colossal_lab.engine import telemetry
    unsubscribe = telemetry.subscribe(print)
    telemetry.emit(telemetry.StepMetrics(rank=0, step=1, loss=2.3, tokens=512, seconds=0.1))
    with telemetry.record("trace.jsonl"):
        ...                                    # every event of this process goes to the file
    events = telemetry.read_trace("trace.jsonl")
"""

from .analysis import (
                     RankBusy,
                     bubble_fractions,
                     bubble_fractions_by_rank,
                     dedupe,
                     fractions_from_busy,
                     rank_busy,
                     rank_label,
                     stage_means,
                     to_chrome_trace,
)
from .bus import emit, has_subscribers, subscribe
from .events import (
                     EVENT_TYPES,
                     ROW_TYPES,
                     SPAN_KINDS,
                     TIERS,
                     ChunkEvent,
                     Event,
                     ExpertLoad,
                     MemorySample,
                     StageSpan,
                     StepMetrics,
                     from_dict,
                     from_row,
                     to_dict,
                     to_row,
)
from .trace import read_trace, record, write_trace
from .units import format_bytes

__all__ = [
    "format_bytes",
    "ChunkEvent", "StageSpan", "MemorySample", "StepMetrics", "ExpertLoad", "Event", "EVENT_TYPES", "TIERS",
    "SPAN_KINDS", "emit", "subscribe", "has_subscribers", "record", "read_trace", "write_trace",
    "to_dict", "from_dict", "to_row", "from_row", "ROW_TYPES", "bubble_fractions", "dedupe", "to_chrome_trace",
    "bubble_fractions_by_rank", "rank_busy", "RankBusy", "fractions_from_busy", "stage_means", "rank_label",
]
