"""Pure reducers: telemetry event stream -> the state each widget draws.

Why a separate layer: the widgets are "pure functions of the event stream plus a throttled
redraw" (DESIGN.md). Keeping the folding here, free of plotly and ipywidgets, lets the same
state be built live (events pushed by the bus or the relay), from a replayed JSONL trace, or
in a test, and lets the tests check numbers instead of pixels.

Every reducer is order- and duplicate-tolerant, because events reach the notebook from many
ranks over a lossy relay and can be replayed:

* ``ChunkState``: latest place per ``(rank, chunk_id)``; an event from an older step than the
  one held is ignored, within one step the later arrival wins (a chunk can move twice in a
  step; ``ChunkEvent`` has no clock). A tier change is recorded as a *move*. Events the relay
  coalesced carry ``ChunkEvent.moves``, the chunk's tier changes at that step so far: it
  orders them within a step (a smaller count than the one held is stale) and the increase
  over the count held is recorded as that many moves.
* ``TimelineState``: a set of ``StageSpan`` (exact duplicates collapse); a row per rank, in
  (stage, dp, tp) order; bubbles per rank and per stage (the mean over its ranks) come from
  ``telemetry``'s bubble functions, so the widget and the pipeline runtime report one number.
* ``MemoryState``: latest ``MemorySample`` per ``(rank, tier)`` by its own ``time``.
* ``MetricsState``: one ``StepMetrics`` per ``(rank, step)``.
* ``CheckpointPlanState``: latest ``CheckpointPlanEvent`` per ``(rank, stage)`` by its own
  ``time``, and the highest ``MemorySample.peak`` measured per ``(rank, tier)``.
* ``ExpertLoadState``: one ``ExpertLoad`` per ``(layer, step, rank)`` (a later arrival of the same
  key replaces it, an equal one changes nothing), the newest ``keep_steps`` steps kept; per layer,
  the tokens per expert and the dropped tokens per step summed over the ranks that reported.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

from colossal_lab.engine.telemetry import (
    TIERS,
    ChunkEvent,
    MemorySample,
    StageSpan,
    StepMetrics,
    fractions_from_busy,
    rank_busy,
    stage_means,
)
from colossal_lab.engine.telemetry.events import CheckpointPlanEvent, ExpertLoad

TIER_COLORS = {"cuda": "#76b900", "cpu": "#1f77b4", "nvme": "#ff7f0e"}
KIND_COLORS = {"F": "#4c78a8", "B": "#e45756", "W": "#f58518", "send": "#9d9da1",
               "recv": "#c9c9cc", "optim": "#54a24b", "comm": "#b279a2"}


class Move(NamedTuple):
    """A chunk's tier change (a named tuple: one is built on every move, and a named tuple is
    much cheaper to build than a frozen dataclass). ``count`` > 1 when the relay folded several
    moves of the chunk at ``step`` into one event: ``src`` is then where this state last saw
    the chunk (``""`` if nowhere) and ``dst`` where the moves left it."""

    rank: int
    chunk_id: int
    step: int
    src: str
    dst: str
    count: int = 1


@dataclass
class ChunkState:
    chunks: Dict[Tuple[int, int], ChunkEvent] = field(default_factory=dict)
    moves: Deque[Move] = field(default_factory=deque)  # the last ``max_moves`` tier changes
    max_moves: int = 10_000
    # step -> {(rank, chunk_id): moves at that step still in ``moves``}: the chunk map asks
    # "what moved at the newest step" every redraw, in O(moves of that step), not O(max_moves)
    _moved: Dict[int, Dict[Tuple[int, int], int]] = field(default_factory=dict, repr=False,
                                                          compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.max_moves, int) and self.max_moves > 0):
            raise ValueError(f"ChunkState(max_moves={self.max_moves!r}): must be a positive int")
        given, self.moves, self._moved = list(self.moves), deque(maxlen=self.max_moves), {}
        for m in given:
            self._add_move(m)

    def _add_move(self, m: Move) -> None:
        if len(self.moves) == self.max_moves:  # the oldest falls out of the deque: unindex it
            old = self.moves[0]
            at = self._moved[old.step]
            key = (old.rank, old.chunk_id)
            at[key] -= 1
            if not at[key]:
                del at[key]
                if not at:
                    del self._moved[old.step]
        self.moves.append(m)
        at = self._moved.setdefault(m.step, {})
        key = (m.rank, m.chunk_id)
        at[key] = at.get(key, 0) + 1

    def moved_at(self, step: int) -> Set[Tuple[int, int]]:
        """``(rank, chunk_id)`` of the chunks that changed tier at ``step`` (among the moves kept)."""
        return set(self._moved.get(step, ()))

    def apply(self, e: ChunkEvent) -> bool:
        key = (e.rank, e.chunk_id)
        old = self.chunks.get(key)
        same_step = old is not None and e.step == old.step
        if old is not None and (e.step < old.step or (same_step and (e == old or e.moves < old.moves))):
            return False  # stale (out of order) or an exact duplicate
        self.chunks[key] = e
        if e.moves:  # coalesced by the relay: it counted the moves at this step so far
            n = e.moves - (old.moves if same_step else 0)
            if n > 0:
                self._add_move(Move(e.rank, e.chunk_id, e.step, old.tier if old is not None else "",
                                    e.tier, n))
        elif old is not None and old.tier != e.tier:
            self._add_move(Move(e.rank, e.chunk_id, e.step, old.tier, e.tier))
        return True

    def move_count(self, step: Optional[int] = None) -> int:
        """Tier changes among the moves kept (at ``step``, or all), counting folded ones."""
        return sum(m.count for m in self.moves if step is None or m.step == step)

    @property
    def ranks(self) -> List[int]:
        return sorted({r for r, _ in self.chunks})

    def bytes_by_tier(self, rank: Optional[int] = None) -> Dict[str, int]:
        out = {t: 0 for t in TIERS}
        for (r, _), e in self.chunks.items():
            if rank is None or r == rank:
                out[e.tier] += e.nbytes
        return out

    def tiers_in_use(self) -> Set[str]:
        return {e.tier for e in self.chunks.values()}

    def last_step(self) -> Optional[int]:
        return max((e.step for e in self.chunks.values()), default=None)


class TimelineRow(NamedTuple):
    """One rank's row on the timeline: its place in the job and its bubble fraction."""

    rank: int
    stage: int
    dp: int
    tp: int
    bubble: float


@dataclass
class TimelineState:
    spans: Set[StageSpan] = field(default_factory=set)
    keep_steps: int = 64  # spans of older steps are dropped so a long run stays bounded
    # step -> its spans (the same objects as in ``spans``): a redraw reads one step's spans
    # without scanning every span kept, and a new span costs O(1) unless it opens a new step
    _by_step: Dict[int, Set[StageSpan]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.keep_steps, int) and self.keep_steps > 0):
            raise ValueError(f"TimelineState(keep_steps={self.keep_steps!r}): must be a positive int")
        given, self.spans, self._by_step = set(self.spans), set(), {}
        for e in given:
            self.apply(e)

    def apply(self, e: StageSpan) -> bool:
        if e in self.spans:
            return False
        self.spans.add(e)
        bucket = self._by_step.get(e.step)
        if bucket is None:
            bucket = self._by_step[e.step] = set()
        bucket.add(e)
        if len(self._by_step) > self.keep_steps:
            cutoff = sorted(self._by_step)[-self.keep_steps]
            for step in [s for s in self._by_step if s < cutoff]:
                self.spans -= self._by_step.pop(step)
        return True

    @property
    def steps(self) -> List[int]:
        return sorted(self._by_step)

    def spans_of(self, step: int) -> List[StageSpan]:
        """``step``'s spans in row order (stage, dp, tp, rank), then by start."""
        return sorted(self._by_step.get(step, ()), key=lambda s: (s.stage, s.dp, s.tp, s.rank, s.start))

    def rows(self, step: int) -> List[TimelineRow]:
        """A row per rank of ``step``, ordered by stage, then dp, then tp (then rank), each with
        its bubble fraction (``telemetry.bubble_fractions_by_rank``)."""
        ranks = rank_busy(self.spans_of(step)).get(step, {})
        fractions = fractions_from_busy(ranks)
        rows = [TimelineRow(r, b.stage, b.dp, b.tp, fractions[r]) for r, b in ranks.items()]
        return sorted(rows, key=lambda row: (row.stage, row.dp, row.tp, row.rank))

    def rank_bubbles(self, step: int) -> Dict[int, float]:
        """``{rank: bubble fraction}`` of ``step``."""
        return fractions_from_busy(rank_busy(self.spans_of(step)).get(step, {}))

    def bubbles(self, step: int) -> Dict[int, float]:
        """``{stage: bubble fraction}`` of ``step``: the mean over the stage's ranks."""
        ranks = rank_busy(self.spans_of(step)).get(step, {})
        return stage_means(fractions_from_busy(ranks), ranks)


@dataclass
class MemoryState:
    samples: Dict[Tuple[int, str], MemorySample] = field(default_factory=dict)

    def apply(self, e: MemorySample) -> bool:
        key = (e.rank, e.tier)
        old = self.samples.get(key)
        if old is not None and e.time <= old.time:
            return False  # older or same instant: keep what we have
        self.samples[key] = e
        return True

    @property
    def ranks(self) -> List[int]:
        return sorted({r for r, _ in self.samples})

    @property
    def tiers(self) -> List[str]:
        present = {t for _, t in self.samples}
        return [t for t in TIERS if t in present]

    def capacity_by_tier(self) -> Dict[str, int]:
        out: Dict[str, int] = defaultdict(int)
        for (_, t), s in self.samples.items():
            out[t] += s.capacity
        return dict(out)

    def used_by_tier(self) -> Dict[str, int]:
        out: Dict[str, int] = defaultdict(int)
        for (_, t), s in self.samples.items():
            out[t] += s.used
        return dict(out)


@dataclass
class MetricsState:
    steps: Dict[Tuple[int, int], StepMetrics] = field(default_factory=dict)

    def apply(self, e: StepMetrics) -> bool:
        key = (e.rank, e.step)
        if self.steps.get(key) == e:
            return False
        self.steps[key] = e
        return True

    @property
    def ranks(self) -> List[int]:
        return sorted({r for r, _ in self.steps})

    def loss_curve(self) -> Tuple[List[int], List[float]]:
        """Per step, the mean loss over the ranks that report one (the last pipeline stage)."""
        by_step: Dict[int, List[float]] = defaultdict(list)
        for (_, step), m in self.steps.items():
            if m.loss is not None:
                by_step[step].append(m.loss)
        xs = sorted(by_step)
        return xs, [sum(by_step[s]) / len(by_step[s]) for s in xs]

    def tokens_per_s(self, rank: int) -> Tuple[List[int], List[float]]:
        ms = sorted((m for (r, _), m in self.steps.items() if r == rank), key=lambda m: m.step)
        ms = [m for m in ms if m.seconds > 0]
        return [m.step for m in ms], [m.tokens / m.seconds for m in ms]


@dataclass
class CheckpointPlanState:
    """The activation-checkpoint plans seen, one per ``(rank, stage)`` (a later ``time`` replaces
    an earlier one: a new batch shape's plan, or the plan applied after the one made), and the
    highest ``MemorySample.peak`` per ``(rank, tier)`` (samples without a measured peak, 0, are
    left out: ``used`` is not a peak)."""

    plans: Dict[Tuple[int, int], CheckpointPlanEvent] = field(default_factory=dict)
    peaks: Dict[Tuple[int, str], int] = field(default_factory=dict)

    def apply(self, e) -> bool:
        if isinstance(e, CheckpointPlanEvent):
            key = (e.rank, e.stage)
            old = self.plans.get(key)
            if old is not None and (e.time < old.time or e == old):
                return False  # older, or the same plan again
            self.plans[key] = e
            return True
        if isinstance(e, MemorySample) and e.peak > self.peaks.get((e.rank, e.tier), 0):
            self.peaks[(e.rank, e.tier)] = int(e.peak)
            return True
        return False

    def keys(self) -> List[Tuple[int, int]]:
        """``(rank, stage)`` of the plans, in drawing order: by stage, then rank."""
        return sorted(self.plans, key=lambda k: (k[1], k[0]))

    def measured_peak(self, rank: int, tier: str) -> Optional[int]:
        return self.peaks.get((rank, tier))


def _natural(name: str) -> tuple:
    """Sort key that puts ``blocks.2.mlp`` before ``blocks.10.mlp``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


@dataclass
class ExpertLoad2D:
    """One layer's load as a grid: ``z[e][i]`` tokens routed to expert ``e`` at ``steps[i]``,
    summed over the ranks that reported that step; ``dropped[i]`` likewise; ``ranks[i]`` how
    many ranks reported it (a step still arriving shows fewer)."""

    steps: List[int]
    z: List[List[int]]
    dropped: List[int]
    ranks: List[int]


@dataclass
class ExpertLoadState:
    loads: Dict[Tuple[str, int, int], ExpertLoad] = field(default_factory=dict)  # (layer, step, rank)
    keep_steps: int = 128  # older steps are dropped so a long run's picture stays bounded
    # layer -> step -> {rank: event} (the same objects as in ``loads``): a redraw reads a layer
    # without scanning every event kept
    _by_layer: Dict[str, Dict[int, Dict[int, ExpertLoad]]] = field(default_factory=dict, repr=False,
                                                                   compare=False)

    # step -> events of that step kept: ``steps`` and the trimming read it, not every event
    _per_step: Dict[int, int] = field(default_factory=dict, repr=False, compare=False)
    # (layer, step) -> (tokens per expert, dropped), summed over ranks: ``totals`` fills it, ``apply``
    # forgets the key it changes, so a many-layer summary redraw sums only what changed
    _totals: Dict[Tuple[str, int], Tuple[Tuple[int, ...], int]] = field(default_factory=dict, repr=False,
                                                                        compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.keep_steps, int) and self.keep_steps > 0):
            raise ValueError(f"ExpertLoadState(keep_steps={self.keep_steps!r}): must be a positive int")
        given, self.loads, self._by_layer, self._per_step = list(self.loads.values()), {}, {}, {}
        self._totals = {}
        for e in given:
            self.apply(e)

    def apply(self, e: ExpertLoad) -> bool:
        key = (e.layer, e.step, e.rank)
        old = self.loads.get(key)
        if old == e:
            return False  # a replayed duplicate
        if (e.step not in self._per_step and len(self._per_step) >= self.keep_steps
                and e.step < min(self._per_step)):
            return False  # older than every step kept: it would be dropped at once
        self.loads[key] = e
        self._by_layer.setdefault(e.layer, {}).setdefault(e.step, {})[e.rank] = e
        self._totals.pop((e.layer, e.step), None)
        if old is None:
            self._per_step[e.step] = self._per_step.get(e.step, 0) + 1
        if len(self._per_step) > self.keep_steps:
            cutoff = sorted(self._per_step)[-self.keep_steps]
            for s in [s for s in self._per_step if s < cutoff]:
                del self._per_step[s]
            for k in [k for k in self.loads if k[1] < cutoff]:
                del self.loads[k]
            for by_step in self._by_layer.values():
                for s in [s for s in by_step if s < cutoff]:
                    del by_step[s]
            for k in [k for k in self._totals if k[1] < cutoff]:
                del self._totals[k]
        return True

    @property
    def layers(self) -> List[str]:
        """Layer names in model order (numbers inside names compared as numbers)."""
        return sorted((n for n, by_step in self._by_layer.items() if by_step), key=_natural)

    @property
    def steps(self) -> List[int]:
        return sorted(self._per_step)

    @property
    def ranks(self) -> List[int]:
        return sorted({r for _, _, r in self.loads})

    def n_experts(self, layer: str) -> int:
        return max((len(e.tokens) for by_rank in self._by_layer.get(layer, {}).values()
                    for e in by_rank.values()), default=0)

    def grid(self, layer: str) -> ExpertLoad2D:
        """``layer``'s tokens per expert × step, summed over ranks (see ``ExpertLoad2D``)."""
        by_step = self._by_layer.get(layer)
        if not by_step:
            raise KeyError(f"ExpertLoadState.grid(layer={layer!r}): no ExpertLoad for it; layers seen: {self.layers}")
        n, steps = self.n_experts(layer), sorted(by_step)
        z = [[0] * len(steps) for _ in range(n)]
        dropped, ranks = [0] * len(steps), [0] * len(steps)
        for i, s in enumerate(steps):
            for e in by_step[s].values():
                for x, t in enumerate(e.tokens):
                    z[x][i] += t
                dropped[i] += e.dropped
                ranks[i] += 1
        return ExpertLoad2D(steps, z, dropped, ranks)

    def totals(self, layer: str, step: int) -> Optional[Tuple[Tuple[int, ...], int]]:
        """``(tokens per expert, dropped)`` of ``layer`` at ``step`` summed over the ranks that
        reported it, or None when none did (cached until an event for that key arrives)."""
        key = (layer, step)
        got = self._totals.get(key)
        if got is None:
            by_rank = self._by_layer.get(layer, {}).get(step)
            if not by_rank:
                return None
            n = max(len(e.tokens) for e in by_rank.values())
            tokens = [0] * n
            for e in by_rank.values():
                for x, t in enumerate(e.tokens):
                    tokens[x] += t
            got = self._totals[key] = (tuple(tokens), sum(e.dropped for e in by_rank.values()))
        return got

    def per_rank(self, layer: str, step: int) -> Dict[int, Tuple[int, ...]]:
        """``{rank: tokens per expert}`` of ``layer`` at ``step``."""
        return {r: e.tokens for r, e in sorted(self._by_layer.get(layer, {}).get(step, {}).items())}


def reduce_all(events: Iterable, chunk: Optional[ChunkState] = None,
               timeline: Optional[TimelineState] = None, memory: Optional[MemoryState] = None,
               metrics: Optional[MetricsState] = None, plans: Optional[CheckpointPlanState] = None,
               experts: Optional[ExpertLoadState] = None) -> int:
    """Fold ``events`` into whichever states are given; returns how many changed something.
    Event types no state given here reads (a newer writer's, say) are skipped."""
    changed = 0
    for e in events:
        if isinstance(e, ChunkEvent) and chunk is not None:
            changed += chunk.apply(e)
        elif isinstance(e, StageSpan) and timeline is not None:
            changed += timeline.apply(e)
        elif isinstance(e, MemorySample):
            if memory is not None:
                changed += memory.apply(e)
            if plans is not None:
                changed += plans.apply(e)
        elif isinstance(e, StepMetrics) and metrics is not None:
            changed += metrics.apply(e)
        elif isinstance(e, CheckpointPlanEvent) and plans is not None:
            changed += plans.apply(e)
        elif isinstance(e, ExpertLoad) and experts is not None:
            changed += experts.apply(e)
    return changed
