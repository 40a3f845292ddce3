"""Every collective of N-d tensor parallelism, counted (bytes sent) and timed (``comm`` spans).

Built on torch: the collectives are ``torch.distributed``'s blocking ``broadcast``, ``reduce``,
``all_reduce``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` on the grid's groups; 1D's
DTensor collectives are seen through a torch dispatch mode (as torch's ``CommDebugMode`` sees them:
the functional collectives DTensor issues, forward and backward). By hand: the byte count per call and
the ``StageSpan(kind="comm")`` around each one.

Bytes are what *this rank* sends under the bandwidth-optimal algorithm of each collective over a
group of ``p`` ranks, for a tensor of ``n`` bytes (``n`` the input of all-gather and reduce-scatter):

=================  ============================================
broadcast          root ``n * (p - 1)`` (a copy to each peer), others 0
reduce             each non-root ``n``, root 0
all-reduce         ``2 * (p - 1) / p * n`` (reduce-scatter + all-gather, ring)
all-gather         ``(p - 1) * n`` (its piece to every peer)
reduce-scatter     ``(p - 1) / p * n``
=================  ============================================

so over SUMMA's ``q`` broadcast steps, where every rank is the root once, each rank sends what a
ring all-gather would. The bench reports the mean over ranks (and the max). A group of one rank
communicates nothing and is not counted.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Dict, Iterator

import torch
import torch.distributed as dist

from .. import comm


class Counter:
    """Bytes this process sent through N-d tensor-parallel collectives, by ``kind`` (e.g.
    ``summa.bcast_x``), and the number of calls per kind."""

    def __init__(self):
        self.bytes: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] += float(nbytes)
        self.calls[kind] += 1

    @property
    def total(self) -> float:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> Dict[str, float]:
        return dict(self.bytes)


COUNTER = Counter()
_recorder = None  # the pipeline runtime's SpanRecorder while a step runs (comm_spans)


@contextlib.contextmanager
def comm_spans(recorder) -> Iterator[None]:
    """While active, every collective here is recorded as ``recorder.add("comm", -1, start, end)``
    (the runtime's ``SpanRecorder``: a ``StageSpan(kind="comm")`` on the telemetry bus)."""
    global _recorder
    prev, _recorder = _recorder, recorder
    try:
        yield
    finally:
        _recorder = prev


@contextlib.contextmanager
def _timed() -> Iterator[None]:
    rec = _recorder
    if rec is None:
        yield
        return
    t0 = time.time()
    try:
        yield
    finally:
        rec.add("comm", -1, t0, time.time())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def broadcast(t: torch.Tensor, src: int, g, kind: str) -> torch.Tensor:
    """Broadcast ``t`` in place from group rank ``src`` of ``g`` (a ``grid.Group``)."""
    if g.pg is None:
        return t
    if g.rank == src:
        COUNTER.add(kind, _nbytes(t) * (g.size - 1))
    else:
        COUNTER.add(kind, 0)
    with _timed():
        dist.broadcast(t, group=g.pg, group_src=src)
    return t


def reduce(t: torch.Tensor, dst: int, g, kind: str) -> torch.Tensor:
    """Sum ``t`` over ``g`` into group rank ``dst`` (in place there; others' ``t`` is scratch)."""
    if g.pg is None:
        return t
    COUNTER.add(kind, 0 if g.rank == dst else _nbytes(t))
    with _timed():
        dist.reduce(t, group=g.pg, group_dst=dst)
    return t


def all_reduce(t: torch.Tensor, g, kind: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if g.pg is None:
        return t
    COUNTER.add(kind, 2 * (g.size - 1) / g.size * _nbytes(t))
    with _timed():
        dist.all_reduce(t, op=op, group=g.pg)
    return t


def all_gather(t: torch.Tensor, g, kind: str, dim: int = 0) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim`` in group-rank order."""
    if g.pg is None:
        return t
    t = t.movedim(dim, 0).contiguous() if dim != 0 else t.contiguous()
    out = t.new_empty((g.size * t.shape[0],) + tuple(t.shape[1:]))
    COUNTER.add(kind, _nbytes(t) * (g.size - 1))
    with _timed():
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, t, group=g.pg)
    return out.movedim(0, dim) if dim != 0 else out


def reduce_scatter(t: torch.Tensor, g, kind: str, dim: int = 0) -> torch.Tensor:
    """The sum over ``g`` of ``t``, cut along ``dim`` into ``g.size`` pieces: this rank's piece."""
    if g.pg is None:
        return t
    t = t.movedim(dim, 0).contiguous() if dim != 0 else t.contiguous()
    out = t.new_empty((t.shape[0] // g.size,) + tuple(t.shape[1:]))
    COUNTER.add(kind, (g.size - 1) / g.size * _nbytes(t))
    with _timed():
        if t.device.type == "cpu" and "gloo" in str(dist.get_backend(g.pg)):
            _reduce_scatter_gloo(out, t, g)
        else:
            # under cl.plan's fake process group: the copy of the input that gloo's reduce-scatter takes
            scratch = t.clone() if _SIMULATE_GLOO else None
            (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, t, group=g.pg)
            del scratch
    return out.movedim(0, dim) if dim != 0 else out


def _reduce_scatter_gloo(out: torch.Tensor, t: torch.Tensor, g) -> None:
    """gloo's own reduce-scatter of host tensors, done here: ``t`` cloned, the clone all-reduced in
    place, this rank's piece copied to ``out`` (as ``ProcessGroupGloo`` does, same bytes and copies).
    Done here so the clone is freed on this thread when the call returns: gloo's work would free it
    whenever its worker thread dropped the work, a race with this thread (``comm.release``)."""
    buf = t.clone()
    dist.all_reduce(buf, group=g.pg)
    out.copy_(buf.chunk(g.size)[g.rank])
    comm.release(buf)


_SIMULATE_GLOO = False


@contextlib.contextmanager
def simulate_gloo() -> Iterator[None]:
    """For ``cl.plan``'s trace on a fake process group (which moves nothing and allocates nothing):
    allocate what a collective on gloo allocates on the calling thread, so the trace holds it too.
    A reduce-scatter on gloo clones its input (:func:`_reduce_scatter_gloo`; measured: a 3D rank of
    the small GPT peaks 0.69 MiB higher, one such copy, than the trace without it), freed when the
    call returns. Not for real runs."""
    global _SIMULATE_GLOO
    old, _SIMULATE_GLOO = _SIMULATE_GLOO, True
    try:
        yield
    finally:
        _SIMULATE_GLOO = old


# ---- 1D: DTensor's collectives ------------------------------------------------------------------

def _dtensor_mode():
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class DTensorBytes(TorchDispatchMode):
        """A dispatch mode like torch's ``CommDebugMode`` (without its module tracker): a DTensor
        op is handed back to DTensor (``NotImplemented``), which issues plain ops and functional
        collectives; each collective's bytes (the convention above) go to ``COUNTER`` under
        ``dtensor.<op>`` and its count to ``counts``."""

        def __init__(self):
            super().__init__()
            self.counts: Dict[str, int] = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(t is DTensor for t in types):
                return NotImplemented
            name = _count_funcol(func, args)
            if name:
                self.counts[name] += 1
            return func(*args, **kwargs)

    return DTensorBytes()


def _count_funcol(func, args) -> str:
    from torch.distributed.distributed_c10d import _resolve_process_group

    packet = getattr(func, "_overloadpacket", None)
    name = getattr(packet, "__name__", "")
    ns = getattr(packet, "_qualified_op_name", "") or ""
    if "c10d_functional" not in ns or not args or not isinstance(args[0], torch.Tensor):
        return ""
    n = _nbytes(args[0])
    if name == "all_reduce":
        p = _resolve_process_group(args[2]).size()
        COUNTER.add("dtensor.all_reduce", 2 * (p - 1) / p * n)
    elif name == "all_gather_into_tensor":
        p = int(args[1])
        COUNTER.add("dtensor.all_gather", (p - 1) * n)
    elif name == "reduce_scatter_tensor":
        p = int(args[2])
        COUNTER.add("dtensor.reduce_scatter", (p - 1) / p * n)
    elif name == "all_to_all_single":
        p = _resolve_process_group(args[-1]).size()
        COUNTER.add("dtensor.all_to_all", (p - 1) / p * n)
    elif name == "broadcast":
        pg = _resolve_process_group(args[2])
        COUNTER.add("dtensor.broadcast", n * (pg.size() - 1) if dist.get_rank(pg) == int(args[1]) else 0)
    else:
        return ""
    return name


@contextlib.contextmanager
def count_dtensor() -> Iterator[object]:
    """Count 1D (DTensor) tensor parallelism's collectives, forward and backward, into
    ``COUNTER`` (kinds ``dtensor.*``); yields the mode (``.counts``: calls per collective)."""
    mode = _dtensor_mode()
    with mode:
        yield mode


__all__ = ["COUNTER", "Counter", "comm_spans", "broadcast", "reduce", "all_reduce", "all_gather",
           "reduce_scatter", "count_dtensor"]
