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


Event = Union[ChunkEvent, StageSpan, MemorySample, StepMetrics]
EVENT_TYPES = {cls.__name__: cls for cls in (ChunkEvent, StageSpan, MemorySample, StepMetrics)}


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


def to_dict(event: Event) -> dict:
    """The event as a JSON-safe dict tagged with its type name under ``"type"``."""
    names = _FIELDS.get(type(event))
    if names is None:  # a subclass or another dataclass: the general (slower) route
        d = dataclasses.asdict(event)
    else:  # every field is a JSON scalar, or ``params``: a tuple of str
        d = {n: getattr(event, n) for n in names}
    if "params" in d:
        d["params"] = list(d["params"])
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
ROW_TYPES = (ChunkEvent, StageSpan, MemorySample, StepMetrics)
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
