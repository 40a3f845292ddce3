"""The criterion contract of a transformers model under ``booster.execute_pipeline``.

Batches are Hugging Face dicts (``{"input_ids": x, "labels": y}``); the first stage takes
``batch["input_ids"]``. The criterion is called as ``criterion(outputs, batch)`` on each microbatch, where
``outputs`` has ``.logits`` (the head's output) and ``.loss``: the model's *own* loss on
``batch["labels"]`` (``model.loss_function``: the shifted LM loss of a causal LM, the masked-LM loss of
BERT), computed when first read. ``criterion=None`` means ``outputs.loss``. A microbatch's loss is the mean
over its tokens and the step's the mean over microbatches, which equals the unsplit batch's mean when
every microbatch counts as many label tokens (no ``-100`` padding spread unevenly). Under 2D/2.5D/3D
the logits are first gathered to the whole vocabulary of the rank's rows (:func:`.nd.whole_logits`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn


class StageOutputs:
    """What the criterion sees of the last stage: ``logits`` and the model's own ``loss`` (lazy)."""

    def __init__(self, logits: torch.Tensor, batch: dict, model: nn.Module):
        self.logits, self._batch, self._model, self._loss = logits, batch, model, None

    @property
    def loss(self) -> torch.Tensor:
        if self._loss is None:
            labels = self._batch.get("labels")
            if labels is None:
                raise ValueError("execute_pipeline: the model's own loss needs batch['labels'] (e.g. "
                                 "{'input_ids': x, 'labels': x}); or pass criterion(outputs, batch) -> loss")
            config = getattr(self._model, "config", None)
            self._loss = self._model.loss_function(logits=self.logits, labels=labels,
                                                   vocab_size=getattr(config, "vocab_size", None))
        return self._loss

    def __getitem__(self, key: str):
        return getattr(self, key)


def check_batch(batch: dict) -> None:
    """Only ``input_ids`` travels into the first stage: a padding mask would be lost, so it is refused."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise ValueError("execute_pipeline: batch['attention_mask'] masks padding, which pipeline stages of a "
                         "transformers model do not carry yet (every stage builds the causal mask of unpadded "
                         "sequences); pack sequences without padding, or use pp_size=1")


def pipeline_criterion(last: nn.Module, criterion: Optional[Callable]) -> Callable:
    """``criterion`` (or the model's own loss) in the engine's ``(output, microbatch) -> loss`` form,
    ``last`` the module holding the head (its ``loss_function`` and config)."""
    from .nd import whole_logits

    def run(output, mb: dict) -> torch.Tensor:
        logits = getattr(output, "logits", output)  # pp_size == 1 hands back the model's own output
        logits = whole_logits(last, logits)  # 2D/2.5D/3D: the vocabulary of this rank's rows
        outputs = StageOutputs(logits, mb, last)
        return outputs.loss if criterion is None else criterion(outputs, mb)
    return run
