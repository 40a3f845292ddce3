"""Pure functions over stage spans: bubble fractions and Chrome/Perfetto trace export.

Shared by the pipeline runtime (which logs bubbles per step) and the timeline widget, so both
report the same number. Definitions:

* a step's *window* is from the earliest span start to the latest span end over all stages
  of that step (the wall time the whole pipeline needed);
* a stage's *busy* time is the union of its compute spans (``F``, ``B``, ``W``, ``optim``);
  communication (``send``/``recv``) is not compute: a stage waiting on a recv is in a bubble;
* bubble fraction = 1 - busy / window.

Clocks: spans carry wall-clock times from each rank (``time.time()``); on one machine those
share a clock. Across machines, skew shows up as a shift in the timeline, not in a stage's
own busy time.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Tuple

from .events import StageSpan

COMPUTE_KINDS = ("F", "B", "W", "optim")


def _union_length(intervals: List[Tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def dedupe(spans: Iterable[StageSpan]) -> List[StageSpan]:
    """Spans in time order with exact duplicates (a replayed or re-sent event) dropped."""
    return sorted(set(spans), key=lambda s: (s.start, s.stage, s.end))


def bubble_fractions(spans: Iterable[StageSpan]) -> Dict[int, Dict[int, float]]:
    """``{step: {stage: bubble fraction}}`` from measured spans (duplicates ignored)."""
    by_step: Dict[int, List[StageSpan]] = defaultdict(list)
    for s in set(spans):
        by_step[s.step].append(s)
    out: Dict[int, Dict[int, float]] = {}
    for step, ss in sorted(by_step.items()):
        t0, t1 = min(s.start for s in ss), max(s.end for s in ss)
        window = t1 - t0
        stages: Dict[int, List[Tuple[float, float]]] = defaultdict(list)
        for s in ss:
            stages[s.stage]  # every stage seen gets an entry, even if it only communicated
            if s.kind in COMPUTE_KINDS:
                stages[s.stage].append((s.start, s.end))
        out[step] = {
            stage: (1.0 - _union_length(iv) / window) if window > 0 else 0.0
            for stage, iv in sorted(stages.items())
        }
    return out


def to_chrome_trace(spans: Iterable[StageSpan]) -> dict:
    """A Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev): one track per stage."""
    spans = dedupe(spans)
    events = []
    seen_tracks = set()
    for s in spans:
        if (s.rank, s.stage) not in seen_tracks:
            seen_tracks.add((s.rank, s.stage))
            events.append({"name": "thread_name", "ph": "M", "pid": s.rank, "tid": s.stage,
                           "args": {"name": f"stage {s.stage}"}})
            events.append({"name": "process_name", "ph": "M", "pid": s.rank, "tid": s.stage,
                           "args": {"name": f"rank {s.rank}"}})
        name = s.kind if s.microbatch < 0 else f"{s.kind}{s.microbatch}"
        events.append({
            "name": name, "cat": s.kind, "ph": "X", "pid": s.rank, "tid": s.stage,
            "ts": s.start * 1e6, "dur": max(0.0, (s.end - s.start) * 1e6),
            "args": {"step": s.step, "microbatch": s.microbatch},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}
