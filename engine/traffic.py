"""The engine's one account of its collectives: bytes sent, by kind and label, and ``comm`` spans.

Every collective of the engine goes through :mod:`.comm`, which reports each call here; 1D tensor
parallelism's DTensor collectives (torch's own) are reported by ``tp_nd.count_dtensor``. A call has a
*kind* (:data:`KINDS`: what the collective is) and a *label* (who sent it, dotted: ``tp_nd.summa.bcast_x``,
``tp_nd.dtensor.all_reduce``, ``cp.ring_kv``; ``""`` for the engine's own bookkeeping: votes, gradient
syncs, gathers for checkpoints and for the pipeline's bubble).

Bytes are what *this rank* sends under the bandwidth-optimal algorithm of each collective over a
group of ``p`` ranks, for a tensor of ``n`` bytes (``n`` the input of all-gather, reduce-scatter and
all-to-all; :func:`sent_bytes`):

=================  ==============================================================
broadcast          root ``n * (p - 1)`` (a copy to each peer), others 0
reduce             each non-root ``n``, root 0
all_reduce         ``2 * (p - 1) / p * n`` (reduce-scatter + all-gather, ring)
all_gather         ``(p - 1) * n`` (its piece to every peer)
reduce_scatter     ``(p - 1) / p * n``
all_to_all         ``n * (p - 1) // p`` (the input minus the block it keeps)
p2p                ``n`` (the tensor sent)
barrier, object    0: the call is counted; an object's pickled size is torch's business
=================  ==============================================================

A group of one rank communicates nothing and is not counted.

Spans: while :func:`spans` is active, every *labelled* collective is timed as
``recorder.add("comm", -1, start, end)`` (the pipeline runtime's ``SpanRecorder``: a
``StageSpan(kind="comm")`` on the telemetry bus), so a step's ``comm`` spans are its layers'
communication; the engine's unlabelled bookkeeping is counted but not timed.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable, Dict, Iterator, Tuple

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "p2p", "barrier",
         "object")


def sent_bytes(kind: str, n: int, p: int, root: bool = False):
    """Bytes this rank sends in one collective of ``kind`` over ``p`` ranks on ``n`` bytes (the
    table above); ``root``: this rank is the broadcast's source or the reduce's destination."""
    if kind == "broadcast":
        return n * (p - 1) if root else 0
    if kind == "reduce":
        return 0 if root else n
    if kind == "all_reduce":
        return 2 * (p - 1) / p * n
    if kind == "all_gather":
        return n * (p - 1)
    if kind == "reduce_scatter":
        return (p - 1) / p * n
    if kind == "all_to_all":
        return n * (p - 1) // p
    if kind == "p2p":
        return n
    if kind in KINDS:
        return 0
    raise ValueError(f"sent_bytes: kind={kind!r} is not one of {KINDS}")


class Counter:
    """Bytes this process sent through collectives and the number of calls, per ``(label, kind)``."""

    def __init__(self):
        self._bytes: Dict[Tuple[str, str], float] = defaultdict(int)
        self._calls: Dict[Tuple[str, str], int] = defaultdict(int)

    def add(self, kind: str, nbytes, label: str = "") -> None:
        if kind not in KINDS:
            raise ValueError(f"Counter.add: kind={kind!r} is not one of {KINDS}")
        key = (label or "", kind)
        self._bytes[key] += nbytes
        self._calls[key] += 1

    def _sum(self, table, prefix: str, by_label: bool) -> Dict[str, float]:
        out: Dict[str, float] = defaultdict(int)
        for (label, kind), v in table.items():
            if label.startswith(prefix):
                out[label[len(prefix):] if by_label else kind] += v
        return dict(out)

    def by_kind(self, prefix: str = "") -> Dict[str, float]:
        """Bytes per kind (of the labels starting with ``prefix``)."""
        return self._sum(self._bytes, prefix, by_label=False)

    def by_label(self, prefix: str = "") -> Dict[str, float]:
        """Bytes per label starting with ``prefix``, keyed without it."""
        return self._sum(self._bytes, prefix, by_label=True)

    def calls_by_kind(self, prefix: str = "") -> Dict[str, int]:
        return self._sum(self._calls, prefix, by_label=False)

    def calls_by_label(self, prefix: str = "") -> Dict[str, int]:
        return self._sum(self._calls, prefix, by_label=True)

    @property
    def total(self) -> float:
        return sum(self._bytes.values())

    def reset(self, prefix: str = "") -> None:
        """Forget the calls whose label starts with ``prefix`` (every call by default)."""
        for key in [k for k in self._bytes if k[0].startswith(prefix)]:
            del self._bytes[key], self._calls[key]

    def view(self, prefix: str, number: Callable = float) -> "CounterView":
        return CounterView(self, prefix, number)


class CounterView:
    """The labels of a :class:`Counter` that start with ``prefix``, keyed without it, with bytes
    as ``number`` (``float`` or ``int``): what an area of the engine shows as its own counter
    (``tp_nd.COUNTER``, ``context_parallel.COMM``). ``reset`` forgets only this area's calls."""

    def __init__(self, counter: Counter, prefix: str, number: Callable = float):
        self.counter, self.prefix, self.number = counter, prefix, number

    @property
    def bytes(self) -> Dict[str, float]:
        return defaultdict(self.number, {k: self.number(v) for k, v in self.counter.by_label(self.prefix).items()})

    @property
    def calls(self) -> Dict[str, int]:
        return defaultdict(int, self.counter.calls_by_label(self.prefix))

    @property
    def total(self):
        return sum(self.bytes.values())

    def by_kind(self) -> Dict[str, float]:
        return self.counter.by_kind(self.prefix)

    def reset(self) -> None:
        self.counter.reset(self.prefix)

    def snapshot(self) -> Dict[str, float]:
        return dict(self.bytes)

    def __repr__(self) -> str:
        return f"CounterView({self.prefix!r}, total={self.total})"


COUNTER = Counter()
_recorder = None  # the pipeline runtime's SpanRecorder while a step runs (see spans)


@contextlib.contextmanager
def spans(recorder) -> Iterator[None]:
    """While active, every labelled collective is recorded as ``recorder.add("comm", -1, start,
    end)`` (anything with the ``SpanRecorder``'s ``add``)."""
    global _recorder
    prev, _recorder = _recorder, recorder
    try:
        yield
    finally:
        _recorder = prev


@contextlib.contextmanager
def timed(label: str) -> Iterator[None]:
    """A ``comm`` span around the block when ``label`` is given and :func:`spans` is active."""
    rec = _recorder
    if rec is None or not label:
        yield
        return
    t0 = time.time()
    try:
        yield
    finally:
        rec.add("comm", -1, t0, time.time())


__all__ = ["KINDS", "COUNTER", "Counter", "CounterView", "sent_bytes", "spans", "timed"]
