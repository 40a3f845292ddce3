"""The checkpoint contract every plugin's IO follows (Colossal-AI's ``CheckpointIO`` shape).

A plugin returns one from ``get_checkpoint_io()``; ``Booster.save_*``/``load_*`` forward to
it. Subclasses override only what their layout changes (Gemini: where a chunk's bytes live;
hybrid: which ranks hold which slice). ``model``/``optimizer`` may be the boosted wrappers or
plain torch objects: :func:`unwrap_model` and :func:`unwrap_optimizer` find the torch objects.
"""

from __future__ import annotations

import os
from typing import Any, Tuple, Union

import torch.nn as nn

PathLike = Union[str, os.PathLike]


def unwrap_model(model: Any) -> nn.Module:
    """The module whose state dict is saved: a boosted ``ModelWrapper``'s inner module (which may
    itself be DDP/FSDP-wrapped; torch's state-dict helpers strip those), or the module itself."""
    while hasattr(model, "unwrap") and callable(model.unwrap):
        inner = model.unwrap()
        if inner is model:
            break
        model = inner
    return model


def unwrap_optimizer(optimizer: Any) -> Tuple[Any, nn.Module]:
    """``(torch optimizer holding this rank's state, model it steps)`` of a boosted optimizer.

    The boosted ``OptimizerWrapper`` exposes ``checkpoint_target()``; a plain optimizer needs the
    model passed separately (see :meth:`CheckpointIO.save_optimizer`).
    """
    if hasattr(optimizer, "checkpoint_target"):
        return optimizer.checkpoint_target()
    return optimizer, None


class CheckpointIO:
    """Save/load of model, optimizer and LR scheduler. Paths are directories unless noted."""

    def save_model(self, model, path: PathLike, shard: bool = True, size_per_shard: float = 1024) -> None:
        raise NotImplementedError

    def load_model(self, model, path: PathLike, strict: bool = True) -> None:
        raise NotImplementedError

    def save_optimizer(self, optimizer, path: PathLike, model=None) -> None:
        raise NotImplementedError

    def load_optimizer(self, optimizer, path: PathLike, model=None) -> None:
        raise NotImplementedError

    def save_lr_scheduler(self, lr_scheduler, path: PathLike) -> None:
        raise NotImplementedError

    def load_lr_scheduler(self, lr_scheduler, path: PathLike) -> None:
        raise NotImplementedError
