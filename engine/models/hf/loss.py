"""The criterion contract of a transformers model under ``booster.execute_pipeline``.

Batches are Hugging Face dicts (``{"input_ids": x, "attention_mask": m, "labels": y}``); the first stage
takes ``batch["input_ids"]``, every stage the per-token inputs :mod:`.inputs` carries. The criterion is
called as ``criterion(outputs, batch)`` on each microbatch, where ``outputs`` has ``.logits`` (the head's
output) and ``.loss``: the model's *own* loss on ``batch["labels"]`` (``model.loss_function``: the shifted
LM loss of a causal LM, the masked-LM loss of BERT), computed when first read. ``criterion=None`` means
``outputs.loss``. A microbatch's own loss is its summed token losses over the whole batch's target count
per microbatch (``num_items_in_batch``, :func:`.inputs.label_items`), so the step's loss, the mean over
microbatches, is the unsplit batch's mean however ``-100`` (padding) spreads over the microbatches. Under
2D/2.5D/3D the logits are first gathered to the whole vocabulary of the rank's rows
(:func:`.nd.whole_logits`), and each microbatch's loss is its own mean. Under a pipeline with 1D tensor
parallelism the last stage's logits stay vocabulary-sharded (:mod:`.vocab_parallel`): the model's own loss runs
on the shards, and ``outputs.logits`` is gathered whole only when a criterion reads it.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn


class StageOutputs:
    """What the criterion sees of the last stage: ``logits`` and the model's own ``loss`` (lazy)."""

    def __init__(self, logits: torch.Tensor, batch: dict, model: nn.Module, items: Optional[float] = None):
        self._logits, self._batch, self._model, self._loss = logits, batch, model, None
        self._items = items  # num_items_in_batch for the model's own loss (None: the microbatch's mean)

    @property
    def logits(self) -> torch.Tensor:
        """The head's output, whole (vocabulary-sharded logits are gathered when first read)."""
        if hasattr(self._logits, "full_tensor"):
            self._logits = self._logits.full_tensor()
        return self._logits

    @property
    def loss(self) -> torch.Tensor:
        if self._loss is None:
            labels = self._batch.get("labels")
            if labels is None:
                raise ValueError("execute_pipeline: the model's own loss needs batch['labels'] (e.g. "
                                 "{'input_ids': x, 'labels': x}); or pass criterion(outputs, batch) -> loss")
            config = getattr(self._model, "config", None)
            kw = {} if self._items is None else {"num_items_in_batch": self._items}
            if self._batch.get("shift_labels") is not None:  # context parallelism: shifted on the whole sequence
                kw["shift_labels"] = self._batch["shift_labels"]
            loss = self._model.loss_function(logits=self._logits, labels=labels,  # sharded: inside loss_parallel()
                                             vocab_size=getattr(config, "vocab_size", None), **kw)
            # a replicated DTensor scalar; its local tensor is a view, which the zero-bubble schedules' split
            # backward cannot detach in place: a copy
            self._loss = loss.to_local().clone() if hasattr(loss, "to_local") else loss
        return self._loss

    def __getitem__(self, key: str):
        return getattr(self, key)


def check_batch(batch: dict, model: Optional[nn.Module] = None,
                input_key: str = "input_ids") -> Tuple[dict, Tuple[str, ...]]:
    """``(batch, keys)``: the batch as the stages take it and the keys of it every stage is handed
    (:func:`.inputs.stage_inputs`; ``ValueError`` naming a key they cannot take; without ``model`` only the
    shapes are checked)."""
    from .inputs import stage_inputs

    return stage_inputs(model, batch, input_key)


def pipeline_criterion(last: nn.Module, criterion: Optional[Callable], items: Optional[float] = None) -> Callable:
    """``criterion`` (or the model's own loss) in the engine's ``(output, microbatch) -> loss`` form,
    ``last`` the module holding the head (its ``loss_function`` and config); ``items`` the
    ``num_items_in_batch`` of the model's own loss (:func:`.inputs.label_items`)."""
    from .nd import whole_logits
    from .vocab_parallel import sharded_logits

    def run(output, mb: dict) -> torch.Tensor:
        logits = getattr(output, "logits", output)  # pp_size == 1 hands back the model's own output
        sharded = sharded_logits(last, logits)  # a pipeline's vocabulary-parallel head: its block
        logits = whole_logits(last, logits) if sharded is None else sharded  # 2D/2.5D/3D: this rank's rows
        outputs = StageOutputs(logits, mb, last, items)
        return outputs.loss if criterion is None else criterion(outputs, mb)
    return run


def whole_outputs(last: nn.Module, outputs):
    """The last stage's outputs as ``execute_pipeline(return_outputs=True)`` hands them back: whole logits (a
    vocabulary-parallel head's blocks gathered over tp, a collective of the last stage's tp ranks)."""
    from .vocab_parallel import sharded_logits

    sharded = sharded_logits(last, outputs)
    if sharded is None:
        return outputs
    with torch.no_grad():
        return sharded.full_tensor()
