"""Telemetry event types: the one contract between the engine and the widgets.

Plain, frozen dataclasses with JSON-safe fields only, so an event can cross a process
boundary (the live relay), land in a JSONL trace, and come back as the same object. The
engine emits them and never knows who listens (see DESIGN.md, "Telemetry").
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

TIERS = ("cuda", "cpu", "nvme")
SPAN_KINDS = ("F", "B", "W", "send", "recv", "optim", "comm")


@dataclass(frozen=True)
class ChunkEvent:
    """Where one chunk is: after warm-up, once per step, and on every move.

    ``tier`` is ``"cuda"``, ``"cpu"`` or ``"nvme"``; ``state`` is the chunk's tensor state
    (e.g. ``"compute"``, ``"hold"``, ``"free"``); ``params`` names the parameters packed in it.
    ``moves`` is 0 as the engine emits it (a move shows as a new ``tier``); the relay, which
    folds one chunk's events of a step into the latest, sets it to the tier changes the chunk
    made at that step so far (docs/widgets.md, "The relay")."""

    rank: int
    step: int
    chunk_id: int
    tier: str
    state: str
    nbytes: int
    params: Tuple[str, ...] = ()
    moves: int = 0

    def __post_init__(self):
        if self.tier not in TIERS:
            raise ValueError(f"ChunkEvent.tier={self.tier!r}; expected one of {TIERS}")
        if self.moves < 0:
            raise ValueError(f"ChunkEvent.moves={self.moves!r}; expected an int >= 0")
        object.__setattr__(self, "params", tuple(self.params))


@dataclass(frozen=True)
class StageSpan:
    """One measured action of a pipeline stage: ``kind`` is ``F``, ``B`` (input grad), ``W``
    (weight grad), ``send``, ``recv``, ``optim`` or ``comm`` (time in, or blocked on, a collective
    inside a layer, e.g. context parallelism's ring passes and all-to-alls, within an ``F``/``B``);
    ``start``/``end`` are wall-clock seconds on that rank (``time.time()``), measured, never
    simulated; ``microbatch`` is -1 for the whole step's (optim); ``dp``/``tp`` are the rank's
    data- and tensor-parallel coordinates."""

    rank: int
    stage: int
    step: int
    microbatch: int
    kind: str
    start: float
    end: float
    dp: int = 0
    tp: int = 0

    def __post_init__(self):
        if self.kind not in SPAN_KINDS:
            raise ValueError(f"StageSpan.kind={self.kind!r}; expected one of {SPAN_KINDS}")

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class MemorySample:
    """Bytes in use and capacity of one memory tier on one rank at ``time`` (wall clock), with,
    where measured (else 0 / ``None``): ``peak``, the most bytes in use so far; ``reserved``,
    bytes held beyond ``used`` (torch's caching allocator); ``util``, compute utilisation in
    percent (NVML). Per tier: docs/widgets.md, "Memory sampler and per-rank bubbles: details"."""

    rank: int
    time: float
    tier: str
    used: int
    capacity: int
    peak: int = 0
    reserved: int = 0
    util: Optional[float] = None

    def __post_init__(self):
        if self.tier not in TIERS:
            raise ValueError(f"MemorySample.tier={self.tier!r}; expected one of {TIERS}")


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step: its loss (None where this rank has none), tokens and seconds."""

    rank: int
    step: int
    loss: Optional[float]
    tokens: int
    seconds: float


CHECKPOINT_OPTIONS = ("none", "layer", "attn", "mlp")  # what GPT's blocks can recompute (a model may list other parts)


@dataclass(frozen=True)
class CheckpointPlanEvent:
    """The activation-checkpoint plan one rank chose (``engine/autockpt/``), emitted when a plan
    is made (``autockpt.solve``, which ``plan_checkpointing``, GPT's ``activation_checkpointing="auto"``
    (once per batch shape) and the plugins' agreed plans end in) and when one is applied
    (``autockpt.apply``).

    ``stage`` is the model's pipeline stage where it says (an int ``stage_index`` attribute, else 0);
    ``time`` the wall clock of
    the emit (``time.time()``), which orders two plans of one ``(rank, stage)``: the later wins.
    Bytes: ``budget``, ``predicted_peak`` (the plan's predicted peak activation memory of a
    training step), ``peak_none`` (checkpointing nothing), ``peak_min`` (the lowest any plan
    reaches), ``prefix_keep`` (what the layers before the chain, e.g. the embedding, keep).
    Per layer of the chain, in order (equal lengths): ``names`` (``"blocks.3"``), ``options``
    (``"none"``, ``"layer"`` or a part such as ``"attn"`` / ``"mlp"``), ``keep`` (bytes it keeps for
    backward under its option), ``recompute_s`` (its predicted recompute seconds, the option's overhead
    included: they sum to ``predicted_recompute_s``). ``layers`` is
    what ``enable_activation_checkpointing(layers=...)`` got, as strings (``"0"``, ``"3.mlp"``).
    ``device`` is where it was profiled (``"cpu"``, ``"cuda:0"``)."""

    rank: int
    stage: int
    time: float
    budget: int
    predicted_peak: int
    predicted_recompute_s: float
    peak_none: int
    peak_min: int
    layers: Tuple[str, ...] = ()
    names: Tuple[str, ...] = ()
    options: Tuple[str, ...] = ()
    keep: Tuple[int, ...] = ()
    recompute_s: Tuple[float, ...] = ()
    prefix_keep: int = 0
    forward_s: float = 0.0
    device: str = "cpu"

    def __post_init__(self):
        # JSON gives lists back (a trace, the relay's rows): the event holds tuples so it stays
        # hashable and equal to the one emitted
        for name in ("layers", "names", "options", "keep", "recompute_s"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "layers", tuple(str(x) for x in self.layers))
        n = len(self.options)
        bad = [f for f in ("names", "keep", "recompute_s") if len(getattr(self, f)) not in (0, n)]
        if bad:
            raise ValueError(f"CheckpointPlanEvent: {bad} must have one entry per layer ({n} options), "
                             f"got lengths {[len(getattr(self, f)) for f in bad]}")


@dataclass(frozen=True)
class ExpertLoad:
    """The expert load of one MoE layer on one rank over one optimizer step (``engine/moe``): ``tokens[e]``
    is how many token-to-expert assignments this rank's router sent to expert ``e`` (global index, over
    every training forward of the step, capacity drops excluded) and ``dropped`` the assignments a
    capacity factor dropped. ``layer`` names the block (``"blocks.0.mlp"``)."""

    rank: int
    step: int
    layer: str
    tokens: Tuple[int, ...]
    dropped: int = 0

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        if self.dropped < 0 or any(t < 0 for t in self.tokens):
            raise ValueError(f"ExpertLoad: tokens={self.tokens} and dropped={self.dropped} must be counts >= 0")


Event = Union[ChunkEvent, StageSpan, MemorySample, StepMetrics, CheckpointPlanEvent, ExpertLoad]
EVENT_TYPES = {cls.__name__: cls for cls in (ChunkEvent, StageSpan, MemorySample, StepMetrics, CheckpointPlanEvent,
                                             ExpertLoad)}


# field names per event type, read once: ``to_dict``/``from_dict`` run per event on the relay's
# hot path (every rank's emit, the kernel's receiver), where ``dataclasses.asdict`` (a deep
# copy of every field) and ``dataclasses.fields`` cost far more than reading the fields
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in EVENT_TYPES.values()}
_NAMES = {name: (cls, frozenset(_FIELDS[cls])) for name, cls in EVENT_TYPES.items()}
# fields left out of ``to_dict`` while they hold their default: the engine never sets them
# (only the relay does), so a JSONL trace of the engine's own events carries only the keys
# every reader of these traces knows
_OMIT_IF_DEFAULT = {ChunkEvent: (("moves", 0),), StageSpan: (("dp", 0), ("tp", 0)),
                    MemorySample: (("peak", 0), ("reserved", 0), ("util", None))}
# tuple fields written as JSON lists by ``to_dict`` (``__post_init__`` turns them back)
_TUPLES = {CheckpointPlanEvent: ("layers", "names", "options", "keep", "recompute_s"), ExpertLoad: ("tokens",)}


def to_dict(event: Event) -> dict:
    """The event as a JSON-safe dict tagged with its type name under ``"type"``."""
    names = _FIELDS.get(type(event))
    if names is None:  # a subclass or another dataclass: the general (slower) route
        d = dataclasses.asdict(event)
    else:  # every field is a JSON scalar, or ``params``: a tuple of str
        d = {n: getattr(event, n) for n in names}
    if "params" in d:
        d["params"] = list(d["params"])
    for name in _TUPLES.get(type(event), ()):
        d[name] = list(d[name])
    for name, default in _OMIT_IF_DEFAULT.get(type(event), ()):
        if d.get(name) == default:
            del d[name]
    d["type"] = type(event).__name__
    return d


def from_dict(d: dict[str, Any]) -> Event:
    """Inverse of :func:`to_dict`; unknown keys (from a newer writer) are ignored."""
    entry = _NAMES.get(d.get("type"))
    if entry is None:
        raise ValueError(f"unknown telemetry event type {d.get('type')!r}; known: {sorted(EVENT_TYPES)}")
    cls, names = entry
    return cls(**{k: v for k, v in d.items() if k in names})


# ---------------------------------------------------------------- compact rows (the relay's wire)
# One event as a flat tuple ``(code, field, field, ...)``: the fields in declaration order,
# ``code`` the type's index in ``ROW_TYPES``. JSON of a row carries no key names (a dict per
# event repeats every key), and a row is read back positionally. For the relay, whose ranks
# and kernel run the same package; JSONL traces keep ``to_dict``'s self-describing dicts.
# append only: a type's index is its code on the relay's wire
ROW_TYPES = (ChunkEvent, StageSpan, MemorySample, StepMetrics, CheckpointPlanEvent, ExpertLoad)
_ROW_CODE = {cls: i for i, cls in enumerate(ROW_TYPES)}
_GETTERS = {cls: operator.attrgetter(*_FIELDS[cls]) for cls in ROW_TYPES}


def to_row(event: Event) -> tuple:
    """``(code, *fields)``: the event's type as an index into ``ROW_TYPES`` and its fields in
    declaration order (JSON-safe: ``params`` stays a tuple, which JSON writes as a list)."""
    cls = type(event)
    code = _ROW_CODE.get(cls)
    if code is None:
        raise TypeError(f"to_row({event!r}): not one of the telemetry event types {[c.__name__ for c in ROW_TYPES]}")
    return (code,) + _GETTERS[cls](event)


def from_row(row) -> Event:
    """Inverse of :func:`to_row` (a list, as JSON gives it back, is fine)."""
    code = row[0]
    if not (type(code) is int and 0 <= code < len(ROW_TYPES)):
        raise ValueError(f"telemetry row type code {code!r}; expected 0..{len(ROW_TYPES) - 1}")
    return ROW_TYPES[code](*row[1:])
