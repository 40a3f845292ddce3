"""ALiBi under tensor parallelism (BLOOM): each rank's attention keeps only its own heads' biases.

BLOOM builds one ALiBi bias for every head in the base model's forward, shaped
``(batch * heads, 1, keys)``, and hands it to each attention layer by keyword (``alibi=``), which
reshapes it by its own head count. Once a rank holds heads ``[r*h, (r+1)*h)`` (its query/key/value
projection cut by output features, its ``num_heads`` one rank's share), a forward pre-hook on the
attention slices the bias to those heads; the base model keeps the whole head count, so the slopes
are the model's own. Falcon (``config.alibi``) hands it as ``(batch, heads, 1, keys)`` and also folds
the bias into the 4-D mask it hands each layer, ``(batch, heads, queries, keys)``: the hook slices that
mask to the rank's heads too. Other per-head biases built once in the base model and handed to each attention
(CPM-Ant's relative ``position_bias``, ``(batch, heads, queries, keys)``, by position) are sliced the same way by
:func:`slice_head_bias`, named by argument in the table's ``head_bias``. Built on
``nn.Module.register_forward_pre_hook(with_kwargs=True)``.
"""

from __future__ import annotations

import fnmatch
import inspect
from functools import partial
from typing import Container, Dict, Iterable

import torch
import torch.nn as nn


def slice_alibi(model: nn.Module, patterns: Iterable[str], rank: int, tp: int, only: Container[str]) -> int:
    """Hook every attention module matching ``patterns`` (and named in ``only``: those whose heads the
    plan cut) so the ``alibi`` it receives is this rank's heads' rows; returns how many were hooked."""
    hooked = 0
    for name, mod in model.named_modules():
        if name in only and any(name.count(".") == p.count(".") and fnmatch.fnmatchcase(name, p) for p in patterns):
            mod.register_forward_pre_hook(partial(_own_heads, rank, tp), with_kwargs=True)
            hooked += 1
    return hooked


def _own_heads(rank: int, tp: int, module: nn.Module, args, kwargs):
    alibi = kwargs.get("alibi")
    if alibi is None:
        return None
    h = module.num_heads  # this rank's share (the plan's per-rank attribute)
    if alibi.dim() == 4:  # Falcon: already (batch, all heads, 1, keys)
        kwargs = {**kwargs, "alibi": alibi[:, rank * h:(rank + 1) * h]}
    else:
        rows, rest = alibi.shape[0], alibi.shape[1:]
        b = rows // (h * tp)  # (batch * all heads, 1, keys) -> (batch, all heads, 1, keys)
        mine = alibi.view(b, h * tp, *rest)[:, rank * h:(rank + 1) * h]
        kwargs = {**kwargs, "alibi": mine.reshape(b * h, *rest)}
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == h * tp > 1:  # the bias folded in
        kwargs["attention_mask"] = mask[:, rank * h:(rank + 1) * h]
    return args, kwargs


def slice_head_bias(model: nn.Module, patterns: Dict[str, str], rank: int, tp: int, only: Container[str]) -> int:
    """Hook every module matching a pattern of ``patterns`` (pattern -> argument name; named in ``only``: those
    whose heads the plan cut) so the ``(batch, heads, queries, keys)`` bias it receives in that argument, by
    keyword or position, is this rank's heads; returns how many were hooked."""
    hooked = 0
    for name, mod in model.named_modules():
        for p, arg in patterns.items():
            if name in only and name.count(".") == p.count(".") and fnmatch.fnmatchcase(name, p):
                index = list(inspect.signature(mod.forward).parameters).index(arg)
                mod.register_forward_pre_hook(partial(_own_bias_heads, rank, tp, arg, index), with_kwargs=True)
                hooked += 1
    return hooked


def _own_bias_heads(rank: int, tp: int, arg: str, index: int, module: nn.Module, args, kwargs):
    h = module.num_heads  # this rank's share (the plan's per-rank attribute)

    def mine(bias):
        if isinstance(bias, torch.Tensor) and bias.dim() == 4 and bias.shape[1] == h * tp:
            return bias[:, rank * h:(rank + 1) * h]
        return bias

    if arg in kwargs:
        return args, {**kwargs, arg: mine(kwargs[arg])}
    if len(args) > index:
        return (*args[:index], mine(args[index]), *args[index + 1:]), kwargs
    return None
