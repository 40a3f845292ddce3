"""Expert load per step: the ``ExpertLoad`` telemetry events of a model's MoE layers.

Each MoE block adds up, over the training forwards of a step, the tokens its router sent to each
expert and the tokens a capacity dropped (not a checkpoint's recompute); ``take_load`` reads and
clears them, one event per layer. ``HybridParallelPlugin``'s optimizer emits them after every
step; a plain loop calls :func:`emit_load` itself.
"""

from __future__ import annotations

from typing import List

import torch.nn as nn

from .layer import moe_layers


def take_load(model: nn.Module, rank: int, step: int) -> List:
    """This step's ``ExpertLoad`` per MoE layer of ``model`` (layers without a training forward skipped),
    and the counts cleared for the next step."""
    from ..telemetry.events import ExpertLoad

    out = []
    for name, moe in moe_layers(model):
        if moe.step_load is not None:
            out.append(ExpertLoad(rank=rank, step=step, layer=name, tokens=tuple(moe.step_load),
                                  dropped=moe.step_dropped))
        moe.step_load, moe.step_dropped = None, 0
    from ..models.hf.moe import load_counters

    for name, counter in load_counters(model):  # a transformers MoE family's experts under ep (models/hf/moe.py)
        if counter.step_load is not None:
            out.append(ExpertLoad(rank=rank, step=step, layer=name, tokens=tuple(counter.step_load), dropped=0))
        counter.step_load = None
    return out


def emit_load(model: nn.Module, rank: int, step: int) -> None:
    """Emit this step's load events (when anyone listens) and clear the counts either way."""
    from .. import telemetry

    events = take_load(model, rank, step)
    if telemetry.has_subscribers():
        for e in events:
            telemetry.emit(e)
