"""Pure functions over stage spans: bubble fractions and Chrome/Perfetto trace export.

Shared by the pipeline runtime (which logs bubbles per step) and the timeline widget, so both
report the same number. Bubbles are measured per *rank* (one device; with data or tensor
parallelism several share a stage) against the window of the whole step, and a stage's bubble is
the mean over its ranks; the definitions and why a union over a stage's ranks is wrong:
docs/widgets.md, "Memory sampler and per-rank bubbles: details".
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Mapping, NamedTuple, Tuple

from .events import StageSpan

COMPUTE_KINDS = ("F", "B", "W", "optim")


class RankBusy(NamedTuple):
    """One rank's step reduced to what a bubble needs: its place, its first span start and last
    span end (any kind), its busy seconds (the union of its compute spans). The pipeline runtime
    gathers these instead of every span."""

    stage: int
    dp: int
    tp: int
    start: float
    end: float
    busy: float


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


def _spans(spans: Iterable[StageSpan], caller: str) -> set:
    out = set()
    for s in spans:
        if not isinstance(s, StageSpan):
            raise TypeError(f"{caller}: expected StageSpan events, got {type(s).__name__} ({s!r})")
        out.add(s)
    return out


def dedupe(spans: Iterable[StageSpan]) -> List[StageSpan]:
    """Spans in time order with exact duplicates (a replayed or re-sent event) dropped."""
    return sorted(set(spans), key=lambda s: (s.start, s.stage, s.dp, s.tp, s.rank, s.end))


def rank_busy(spans: Iterable[StageSpan]) -> Dict[int, Dict[int, RankBusy]]:
    """``{step: {rank: RankBusy}}`` from measured spans (duplicates ignored); ``ValueError`` when
    one rank's spans of one step disagree on its stage/dp/tp (spans of two runs mixed)."""
    by_key: Dict[Tuple[int, int], List[StageSpan]] = defaultdict(list)
    for s in _spans(spans, "rank_busy"):
        by_key[(s.step, s.rank)].append(s)
    out: Dict[int, Dict[int, RankBusy]] = defaultdict(dict)
    for (step, rank), ss in sorted(by_key.items()):
        places = {(s.stage, s.dp, s.tp) for s in ss}
        if len(places) > 1:
            shown = ", ".join(f"stage {p[0]} · dp {p[1]} · tp {p[2]}" for p in sorted(places))
            raise ValueError(f"rank {rank} reports more than one place in step {step} ({shown}); "
                             "a rank holds one stage/dp/tp position per step; are spans of two "
                             "runs mixed in one trace?")
        (stage, dp, tp), = places
        busy = _union_length([(s.start, s.end) for s in ss if s.kind in COMPUTE_KINDS])
        out[step][rank] = RankBusy(stage, dp, tp, min(s.start for s in ss), max(s.end for s in ss), busy)
    return dict(out)


def fractions_from_busy(ranks: Mapping[int, RankBusy]) -> Dict[int, float]:
    """``{rank: bubble fraction}`` of one step from every rank's :class:`RankBusy` (the window
    spans all of them): the runtime's and the widget's one formula."""
    if not ranks:
        return {}
    window = max(b.end for b in ranks.values()) - min(b.start for b in ranks.values())
    return {rank: (1.0 - b.busy / window) if window > 0 else 0.0 for rank, b in sorted(ranks.items())}


def stage_means(fractions: Mapping[int, float], ranks: Mapping[int, RankBusy]) -> Dict[int, float]:
    """``{stage: mean bubble over its ranks}`` from per-rank fractions of one step."""
    per_stage: Dict[int, List[float]] = defaultdict(list)
    for rank in sorted(fractions):
        per_stage[ranks[rank].stage].append(fractions[rank])
    return {stage: sum(v) / len(v) for stage, v in sorted(per_stage.items())}


def bubble_fractions_by_rank(spans: Iterable[StageSpan]) -> Dict[int, Dict[int, float]]:
    """``{step: {rank: bubble fraction}}`` from measured spans (duplicates ignored)."""
    return {step: fractions_from_busy(ranks) for step, ranks in rank_busy(spans).items()}


def bubble_fractions(spans: Iterable[StageSpan]) -> Dict[int, Dict[int, float]]:
    """``{step: {stage: bubble fraction}}``: each stage's mean over its ranks' fractions (see
    :func:`bubble_fractions_by_rank`); with one rank per stage, that rank's fraction."""
    return {step: stage_means(fractions_from_busy(ranks), ranks)
            for step, ranks in rank_busy(spans).items()}


def rank_label(rank: int, stage: int, dp: int, tp: int) -> str:
    """How a rank is named on the timeline and in traces: ``stage s · dp d · tp t · rank r``."""
    return f"stage {stage} · dp {dp} · tp {tp} · rank {rank}"


def to_chrome_trace(spans: Iterable[StageSpan]) -> dict:
    """A Chrome/Perfetto trace: one process per rank, named by :func:`rank_label` and sorted by
    stage, dp, tp, with one track (thread) per stage it ran."""
    spans = dedupe(_spans(spans, "to_chrome_trace"))
    events = []
    places: Dict[int, Tuple[int, int, int]] = {}
    for s in spans:  # a rank's first place names its process (a rank keeps one per run)
        places.setdefault(s.rank, (s.stage, s.dp, s.tp))
    order = sorted(places, key=lambda r: (places[r], r))
    for i, rank in enumerate(order):
        stage, dp, tp = places[rank]
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": rank_label(rank, stage, dp, tp)}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": i}})
    seen_tracks = set()
    for s in spans:
        if (s.rank, s.stage) not in seen_tracks:
            seen_tracks.add((s.rank, s.stage))
            events.append({"name": "thread_name", "ph": "M", "pid": s.rank, "tid": s.stage,
                           "args": {"name": f"stage {s.stage} · dp {s.dp} · tp {s.tp}"}})
        name = s.kind if s.microbatch < 0 else f"{s.kind}{s.microbatch}"
        events.append({
            "name": name, "cat": s.kind, "ph": "X", "pid": s.rank, "tid": s.stage,
            "ts": s.start * 1e6, "dur": max(0.0, (s.end - s.start) * 1e6),
            "args": {"step": s.step, "microbatch": s.microbatch, "stage": s.stage, "dp": s.dp, "tp": s.tp},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}
