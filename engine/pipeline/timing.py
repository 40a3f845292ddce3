"""Measured pipeline timelines: every F, B, W, send, recv and optim action of a rank, timed.

torch's schedules give no timings, so we time the real calls at the seams torch already has,
without copying a schedule: each ``PipelineStage``'s ``*_one_chunk`` compute calls (wrapped on
the instance) and the schedules module's ``_batch_p2p``/``_wait_batch_p2p`` (swapped while a step
runs: a ``send``/``recv`` span is time blocked in the wait). Which seam gives which span, the
rank's coordinates on a span, and why the last stage's ``F`` is emitted only once its loss is
computed: docs/hybrid.md, "Measured timelines".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Iterator, List, Optional

from ..telemetry import StageSpan, emit, has_subscribers

_now = time.time


class _TaggedWorks(list):
    """The works of one ``_batch_p2p`` call plus the (kind, microbatch) tags of its ops."""

    tags: list


class SpanRecorder:
    """Collects :class:`StageSpan` for one rank and emits each as it closes.

    ``rank`` is the global rank, ``stage`` its pipeline position, ``dp``/``tp`` its data- and
    tensor-parallel coordinates (0 where that dimension is 1)."""

    def __init__(self, rank: int, stage: int, dp: int = 0, tp: int = 0):
        for name, v in (("rank", rank), ("stage", stage), ("dp", dp), ("tp", tp)):
            if not (isinstance(v, int) and v >= 0):
                raise ValueError(f"SpanRecorder({name}={v!r}): expected an int >= 0")
        self.rank = rank
        self.stage = stage
        self.dp = dp
        self.tp = tp
        self.step = 0
        self.spans: List[StageSpan] = []
        self._held: Optional[int] = None  # index in ``spans`` of a last-stage F awaiting its loss

    # ---- recording ---------------------------------------------------------------------
    def add(self, kind: str, microbatch: int, start: float, end: float, hold: bool = False) -> StageSpan:
        """Record a span and emit it, or with ``hold`` keep it back until :meth:`flush` (the
        last stage's ``F``, which :meth:`extend_last_forward` still stretches). A ``comm`` span
        (a collective inside a layer or the loss) leaves a held ``F`` held: it lies within it."""
        if kind != "comm":
            self.flush()
        span = StageSpan(rank=self.rank, stage=self.stage, step=self.step, microbatch=microbatch,
                         kind=kind, start=start, end=end, dp=self.dp, tp=self.tp)
        self.spans.append(span)
        if hold:
            self._held = len(self.spans) - 1
        elif has_subscribers():
            emit(span)
        return span

    def flush(self) -> None:
        """Emit the span held back by ``add(..., hold=True)``, if any."""
        if self._held is not None:
            span, self._held = self.spans[self._held], None
            if has_subscribers():
                emit(span)

    def extend_last_forward(self, end: float) -> None:
        """Stretch the latest ``F`` span to ``end`` (the loss computed after it belongs to it)
        and emit it if it was held back for this."""
        for i in range(len(self.spans) - 1, -1, -1):
            s = self.spans[i]
            if s.kind == "F" and s.step == self.step:
                self.spans[i] = dataclasses.replace(s, end=max(s.end, end))
                break
        self.flush()

    def step_spans(self, step: int) -> List[StageSpan]:
        return [s for s in self.spans if s.step == step]

    @contextlib.contextmanager
    def timed(self, kind: str, microbatch: int = -1) -> Iterator[None]:
        t0 = _now()
        try:
            yield
        finally:
            self.add(kind, microbatch, t0, _now())

    # ---- instrumenting torch's stages --------------------------------------------------
    def instrument(self, stage) -> None:
        """Wrap one ``PipelineStage``'s compute calls and tag the P2P ops it hands out."""
        rec = self

        def timed_call(fn, kind, hold=False):
            @functools.wraps(fn)
            def wrapper(chunk_id, *args, **kwargs):
                t0 = _now()
                try:
                    return fn(chunk_id, *args, **kwargs)
                finally:
                    rec.add(kind, int(chunk_id), t0, _now(), hold=hold)
            return wrapper

        def tagged(fn, kind):
            @functools.wraps(fn)
            def wrapper(chunk_id, *args, **kwargs):
                ops = fn(chunk_id, *args, **kwargs)
                for op in ops:
                    op._cl_tag = (kind, int(chunk_id))
                return ops
            return wrapper

        # the loss is computed right after the last stage's forward: hold that F until then
        stage.forward_one_chunk = timed_call(stage.forward_one_chunk, "F", hold=bool(stage.is_last))
        stage.backward_one_chunk = timed_call(stage.backward_one_chunk, "B")
        stage.backward_weight_one_chunk = timed_call(stage.backward_weight_one_chunk, "W")
        stage.get_fwd_recv_ops = tagged(stage.get_fwd_recv_ops, "recv")
        stage.get_bwd_recv_ops = tagged(stage.get_bwd_recv_ops, "recv")
        stage.get_fwd_send_ops = tagged(stage.get_fwd_send_ops, "send")
        stage.get_bwd_send_ops = tagged(stage.get_bwd_send_ops, "send")

    @contextlib.contextmanager
    def timing_p2p(self) -> Iterator[None]:
        """While active, waits on tagged P2P works become ``send``/``recv`` spans."""
        from torch.distributed.pipelining import schedules as S

        orig_batch, orig_wait = S._batch_p2p, S._wait_batch_p2p
        rec = self

        def batch_p2p(p2p_ops, desc=None):
            works = orig_batch(p2p_ops, desc=desc)
            tags = [t for t in (getattr(op, "_cl_tag", None) for op in p2p_ops) if t is not None]
            if not tags:
                return works
            out = _TaggedWorks(works)
            out.tags = tags
            return out

        def wait_batch_p2p(work):
            if not isinstance(work, _TaggedWorks):
                return orig_wait(work)
            t0 = _now()
            orig_wait(work)
            recvs = [mb for kind, mb in work.tags if kind == "recv"]
            kind, mb = ("recv", recvs[0]) if recvs else ("send", work.tags[0][1])
            rec.add(kind, mb, t0, _now())

        S._batch_p2p, S._wait_batch_p2p = batch_p2p, wait_batch_p2p
        try:
            yield
        finally:
            S._batch_p2p, S._wait_batch_p2p = orig_batch, orig_wait
