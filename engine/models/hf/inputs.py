"""What of a transformers batch enters the pipeline stages under ``booster.execute_pipeline``.

The first stage takes ``batch[input_key]`` (``input_ids``); the per-token inputs a user's tokenizer hands
over, ``attention_mask`` (padding, right or left), ``position_ids`` and ``token_type_ids``, go to the stages
as keyword arguments, split into microbatches with the rest of the batch (torch's schedule splits a step's
keyword arguments on dim 0, as ``runtime.split_batch`` splits the batch). Every stage runs the model's own
base forward with them, so each stage builds the padded causal (or, for an encoder, bidirectional) mask with
the model's own mask helpers and its positions (rotary angles, OPT's positions counted from the mask)
exactly as the unsplit model does; ``token_type_ids`` reach the first stage only, where the embeddings are.
``labels`` stay with the criterion. Nothing here builds a mask; it only checks that what the batch holds can
be carried (a clear ``ValueError`` naming the key otherwise) and says what the model's own loss must divide
by so a padded batch's microbatches add up to the unsplit batch's mean.
"""

from __future__ import annotations

import inspect
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn

#: per-token model inputs carried to the stages, each ``(batch, tokens)`` like ``input_ids``
CARRIED = ("attention_mask", "position_ids", "token_type_ids")
#: of those, the ones only the embeddings read (a later stage's stand-in embeddings would not take them)
FIRST_STAGE_ONLY = ("token_type_ids",)
#: what the criterion takes, never the model's forward
LABEL_KEYS = ("labels",)


def _named_inputs(model: nn.Module) -> Tuple[set, set]:
    """The parameters the task model's and its base model's forwards name (``**kwargs`` aside)."""
    def names(m):
        return {n for n, p in inspect.signature(type(m).forward).parameters.items()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
    base = getattr(model, "base_model", model)
    return names(model), names(base if isinstance(base, nn.Module) else model)


def stage_inputs(model: Optional[nn.Module], batch: dict,
                 input_key: str = "input_ids") -> Tuple[dict, Tuple[str, ...]]:
    """``(batch, keys)``: the batch (``position_ids`` of one row widened to every row) and the keys of it
    every stage takes as keyword arguments. ``ValueError`` naming the key for a per-token input of the wrong
    shape, one the model's forward does not take (``token_type_ids`` for a Llama), or a model input a
    pipeline cannot carry (``inputs_embeds``, a cache, ...). Keys the model's forward does not name pass to
    the criterion only. Without ``model``, only the shapes are checked."""
    x = batch.get(input_key)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"execute_pipeline: batch[{input_key!r}] must be a (batch, tokens) tensor of token ids, "
                         f"got {got}")
    task, base = _named_inputs(model) if model is not None else (set(CARRIED), set(CARRIED))
    name = type(model).__name__ if model is not None else "the model"
    keys, out = [], dict(batch)
    for key, value in batch.items():
        if key == input_key or key in LABEL_KEYS:
            continue
        if key in CARRIED:
            if key not in task or key not in base:
                raise ValueError(f"execute_pipeline: batch[{key!r}]: {name}.forward takes no {key}; drop it "
                                 "from the batch")
            out[key] = _per_token(key, value, x)
            keys.append(key)
        elif key in task:  # a model input other than the per-token ones
            raise ValueError(f"execute_pipeline: batch[{key!r}] is an input of {name}.forward that pipeline stages "
                             f"do not take (they take {input_key!r}, {', '.join(repr(k) for k in CARRIED)} and "
                             f"'labels'); drop it from the batch, or use pp_size=1 and call the model directly")
    return out, tuple(keys)


def _per_token(key: str, value, x: torch.Tensor) -> torch.Tensor:
    """``value`` as a ``(batch, tokens)`` tensor like ``x``; one row of ``position_ids`` serves every row."""
    shape = tuple(x.shape)
    if isinstance(value, torch.Tensor) and key == "position_ids" and value.dim() == 2 and value.shape[0] == 1 \
            and value.shape[1] == shape[1]:
        return value.expand(shape[0], -1)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        fix = " (a 2-D padding mask of 1s and 0s; a 4-D mask is not carried)" if key == "attention_mask" else ""
        raise ValueError(f"execute_pipeline: batch[{key!r}] has shape {got}; pipeline stages take it shaped like "
                         f"the input ids, {shape}{fix}")
    return value


def check_rows_agree(batch: dict, keys: Tuple[str, ...], mode: str) -> None:
    """Under 3D tensor parallelism attention runs on other rows than the embedding takes: a carried input
    that differs by row (a padding mask, per-row positions or token types) would meet the wrong rows."""
    for key in keys:
        v = batch[key]
        if key == "attention_mask" and not bool(v.all()) or key != "attention_mask" and not bool((v == v[:1]).all()):
            raise ValueError(f"HybridParallelPlugin(tp_mode={mode!r}): batch[{key!r}] differs by row (padding, or "
                             "per-row positions / token types), which 3D tensor parallelism does not carry to the "
                             "attention's rows; pack sequences without padding, or use tp_mode='2d'")


def stage_kwargs(batch: dict, keys: Tuple[str, ...], first: bool) -> Dict[str, torch.Tensor]:
    """The keyword arguments one stage's forward takes of ``keys`` (the embeddings' only on the first)."""
    return {k: batch[k] for k in keys if first or k not in FIRST_STAGE_ONLY}


def label_items(model: nn.Module, batch: dict, num_microbatches: int) -> Optional[float]:
    """What each microbatch's own loss divides its summed token losses by (``num_items_in_batch``) so that
    the mean over microbatches is the whole batch's mean: the batch's target count over the microbatch
    count. Counted as transformers' own token losses count (``ForCausalLMLoss`` shifts the labels by one,
    ``ForMaskedLMLoss`` does not; ``-100`` is ignored); None (each microbatch's own mean) for other losses."""
    labels = batch.get("labels")
    fn = getattr(getattr(model, "loss_function", None), "__name__", None)
    if not isinstance(labels, torch.Tensor) or fn not in ("ForCausalLMLoss", "ForMaskedLMLoss"):
        return None
    targets = labels[..., 1:] if fn == "ForCausalLMLoss" else labels
    count = int((targets != -100).sum())
    return count / num_microbatches if count else None
