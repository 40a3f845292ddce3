"""``StepMetrics`` for every plugin: one event per optimizer step, whoever built the optimizer.

DDP/ZeRO's ``OptimizerWrapper`` emits its own; Gemini and the hybrid-parallel runtime return
optimizers of their own, so the Booster attaches this meter to those instead of asking every
plugin to repeat the bookkeeping. Tokens are counted from the model's forward inputs (or, under a
pipeline, from the batches ``execute_pipeline`` draws), the loss is the last one passed to
``booster.backward`` / returned by ``execute_pipeline``, seconds run from the previous step.
"""

from __future__ import annotations

import time
from typing import Iterator, Optional

import torch.distributed as dist
import torch.nn as nn

from . import telemetry
from .wrappers import _count_tokens


class StepMeter:
    def __init__(self, model: Optional[nn.Module], optimizer) -> None:
        self.tokens = 0
        self.loss: Optional[float] = None
        self.step = 0
        self._t_last: Optional[float] = None
        self.in_pipeline = False
        if isinstance(model, nn.Module):
            model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        inner_step = optimizer.step

        def step(*args, **kwargs):
            out = inner_step(*args, **kwargs)
            self._emit()
            return out

        optimizer.step = step  # an instance attribute: the class and other instances are untouched

    def _on_forward(self, module, args, kwargs):
        if self.in_pipeline:
            return
        if self._t_last is None:
            self._t_last = time.perf_counter()
        self.tokens += _count_tokens(args, kwargs)

    def count_batches(self, data_iter: Iterator) -> Iterator:
        """Wrap a pipeline's batch iterator so the tokens it hands out are counted."""
        for batch in data_iter:
            if self._t_last is None:
                self._t_last = time.perf_counter()
            x = batch.get("idx", batch.get("input_ids")) if isinstance(batch, dict) else batch
            self.tokens += _count_tokens((x,), {})
            yield batch

    def record_loss(self, loss) -> None:
        if loss is not None:
            self.loss = float(loss.detach()) if hasattr(loss, "detach") else float(loss)

    def _emit(self) -> None:
        now = time.perf_counter()
        if telemetry.has_subscribers():
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            telemetry.emit(telemetry.StepMetrics(rank=rank, step=self.step, loss=self.loss, tokens=int(self.tokens),
                                                 seconds=now - (self._t_last if self._t_last is not None else now)))
        self.step += 1
        self.tokens, self.loss, self._t_last = 0, None, now
