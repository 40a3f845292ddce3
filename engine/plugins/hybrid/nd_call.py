"""A direct forward of the boosted model under ``tp_mode`` 2d / 2.5d / 3d: the plain training loop.

Each rank of the grid holds a piece of the batch (``tp_nd.Grid``: the stream layout's batch pieces for
the input, the inner layout's for what is compared with the logits; the same in 2D/2.5D). A direct
call therefore takes the whole (data-parallel replica's) batch on every rank, as under 1D, and cuts it
here; the loss it returns has the value of the mean over the batch pieces (what one process reports
on the whole batch when each piece counts as many target tokens) and the gradient of this rank's own
mean, which the gradient sync averages over the pieces (``grads.GradSync``), so
``booster.backward(loss, optimizer)`` gives the one-process gradients.

* A transformers model: ``labels`` is cut like the logits and kept out of the model's forward; the
  model's own ``loss_function`` then runs on this rank's rows with the whole vocabulary (gathered:
  ``models.hf.nd.whole_logits``), so every family's loss (shifted causal LM, masked LM) is its own.
  ``outputs.logits`` are those whole-vocabulary logits of this rank's rows.
* A model of the contract (``logits, loss = model(idx, targets)``): the first argument is the input,
  every other tensor is cut like the logits; its loss is computed by the model (the reference GPT's is
  vocab-parallel on the head's blocks, ``tp_nd.cross_entropy``); ``logits`` stay this rank's block.

Built on torch.distributed (one all-reduce of the loss value); by hand: which tensor is cut how.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ... import comm

TARGET_KEYS = ("labels", "targets")


def cut_call(grid, args: tuple, kwargs: Dict[str, Any], input_key: str, hf: bool) -> Tuple[tuple, dict]:
    """``args``/``kwargs`` with each batch tensor (dim 0) cut to this rank's piece."""
    def cut(v, layout, what):
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return grid.batch_piece(v, layout, what)
        return v

    def layout_of(key):
        like_logits = key in TARGET_KEYS if hf else key != input_key
        return grid.inner if like_logits else grid.stream

    if grid.mode == "3d" and hf:
        _check_rows_agree(kwargs)
    args = tuple(cut(a, grid.stream if (i == 0 or hf) else grid.inner, f"argument {i}") for i, a in enumerate(args))
    kwargs = {k: cut(v, layout_of(k), f"batch[{k!r}]") for k, v in kwargs.items()}
    return args, kwargs


def _check_rows_agree(kwargs: Dict[str, Any]) -> None:
    """3D runs attention on other rows (the inner layout's) than the embedding takes (the stream's): a
    mask or positions that differ by row would be applied to the wrong rows."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise ValueError("tp_mode='3d': batch['attention_mask'] masks padding, which 3D tensor parallelism does not "
                         "carry to the attention's rows yet; pack sequences without padding, or use tp_mode='2d'")
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() >= 2 and not bool((pos == pos[:1]).all()):
        raise ValueError("tp_mode='3d': batch['position_ids'] differ by row, which 3D tensor parallelism does not "
                         "carry to the attention's rows yet; use one row of positions for the batch, or tp_mode='2d'")


def global_loss(grid, local: torch.Tensor) -> torch.Tensor:
    """The mean of every batch piece's loss as this rank's ``local`` loss (value all-reduced over the
    logits' batch group; the gradient stays ``local``'s)."""
    g = grid.group(grid.inner.batch)
    if g.pg is None:
        return local
    (total,) = comm.reduce_values([float(local.detach())], group=g.pg)
    return local + (total / g.size - local.detach())


def forward(inner: torch.nn.Module, grid, args: tuple, kwargs: Dict[str, Any], input_key: str, hf: bool):
    """``inner(*args, **kwargs)`` on this rank's piece of the batch (already cut), its loss made the
    batch mean (see the module docstring)."""
    if not hf:
        out = inner(*args, **kwargs)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) and out[1].dim() == 0:
            return out[0], global_loss(grid, out[1])
        return out
    from ...models.hf.nd import whole_logits

    labels = kwargs.pop("labels", None)
    out = inner(*args, **kwargs)
    if getattr(out, "logits", None) is None:
        if labels is not None:
            raise ValueError(f"tp_mode={grid.mode!r}: {type(inner).__name__} returned no .logits to compute its "
                             "loss on (return_dict=False?); call it with return_dict=True (the default)")
        return out
    logits = whole_logits(inner, out.logits)
    out["logits"] = logits
    if labels is not None:
        config = getattr(inner, "config", None)
        local = inner.loss_function(logits=logits, labels=labels, vocab_size=getattr(config, "vocab_size", None))
        out["loss"] = global_loss(grid, local)
    return out
