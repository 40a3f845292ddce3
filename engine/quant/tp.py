"""Tensor-parallel int8 serving: each rank keeps a column or row slice of every quantised linear.

The model's plan names the column-parallel linears (output channels and their scales split) and the
row-parallel ones (input channels split, outputs all-reduced): the model contract's ``tp_plan()``, or a
transformers model's own plan read by its adapter (``models/hf/cuts.py``: the plan the training plugin
applies, a built-in table for GPT-2 / OPT / BLOOM / BERT; an LM head gathers its output, a packed q|k|v weight
is cut part by part, the table's head counts become one rank's share, an ALiBi bias is sliced to its heads).
Plain ``torch.distributed`` collectives: DTensor has no sharding rule for the int8 matmuls (docs/kernels.md,
"Int8 inference").
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .int8 import Int8Linear


class RowParallelInt8Linear(Int8Linear):
    """Input-channel slice; the partial products are summed over the group, bias added once. With
    ``split_input`` the whole input arrives and this rank takes its slice of it first."""

    group = None
    split_input = None  # (rank, world) where the input arrives whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from colossal_lab.kernels import int8_linear

        if self.split_input is not None:
            rank, world = self.split_input
            x = x.chunk(world, dim=-1)[rank]
        y = int8_linear(x, self.weight_int8, self.scale, None)
        comm.all_reduce(y, group=self.group)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


class GatherColInt8Linear(Int8Linear):
    """Output-channel slice whose outputs are gathered whole over the group (an LM head)."""

    group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x).contiguous()
        parts = [torch.empty_like(y) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=-1)


def _tp_styles(model: nn.Module) -> Dict[str, object]:
    """``{linear name: "col" | "row" | models.hf.cuts.Cut}`` from the model's plan."""
    from ..models.hf import reads_dict_plan

    if reads_dict_plan(model):  # a transformers model: its plan read by the adapter (never model.tp_plan())
        from ..models.hf.cuts import linear_cuts

        try:
            return dict(linear_cuts(model))
        except ValueError as exc:
            raise ValueError(f"tensor-parallel int8: {exc}") from None
    if not callable(getattr(model, "tp_plan", None)):
        raise ValueError(f"tensor-parallel int8: {type(model).__name__} has no tp_plan() (the model contract) and "
                         "is not a transformers model; it must name its column/row-parallel linears")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {}
    for name, style in model.tp_plan().items():
        if isinstance(style, ColwiseParallel):
            styles[name] = "col"
        elif isinstance(style, RowwiseParallel):
            styles[name] = "row"
        else:
            raise ValueError(f"tensor-parallel int8: {name}: style {type(style).__name__} is not supported "
                             "(only ColwiseParallel / RowwiseParallel)")
    return styles


def _group_info(model: nn.Module, group):
    if not dist.is_initialized():
        raise RuntimeError("tensor-parallel int8: torch.distributed is not initialised; "
                           "call it on every rank of a launched cluster")
    group = None if group is True else group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if callable(getattr(model, "check_tp", None)):  # the model contract: e.g. heads must divide
        model.check_tp(world)
    from ..models.hf import reads_dict_plan

    if reads_dict_plan(model):  # a transformers model: whole heads and key/value heads per rank
        from ..models.hf import check_heads

        try:
            check_heads(model, world)
        except ValueError as exc:
            raise ValueError(f"tensor-parallel int8 over {world} ranks: {exc}") from None
    return rank, world, group


def slice_for_tp(q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor], style,
                 rank: int, world: int, group, name: str = "") -> Int8Linear:
    """This rank's slice of a quantised linear (``style``: ``"col"``, ``"row"`` or a ``models.hf.cuts.Cut``)."""
    kind = style if isinstance(style, str) else style.kind
    N, K = q.shape
    if kind == "col":
        parts = 1 if isinstance(style, str) else style.parts
        if N % (parts * world):
            raise ValueError(f"tensor-parallel int8: {name} has {N} output channels"
                             f"{f' in {parts} packed parts' if parts > 1 else ''}, not divisible by {world} ranks")
        n, part = N // (parts * world), N // parts
        rows = torch.cat([torch.arange(p * part + rank * n, p * part + (rank + 1) * n) for p in range(parts)])
        gather = not isinstance(style, str) and style.gather
        m = (GatherColInt8Linear if gather else Int8Linear).from_quantized(
            q[rows].clone(), scale[rows].clone(), None if bias is None else bias[rows])
        if gather:
            m.group = group
        return m
    if K % world:
        raise ValueError(f"tensor-parallel int8: {name} has {K} input channels, not divisible by {world} ranks")
    k = K // world
    m = RowParallelInt8Linear.from_quantized(q[:, rank * k:(rank + 1) * k].clone(), scale.clone(), bias)
    m.group = group
    if not isinstance(style, str) and style.split_input:
        m.split_input = (rank, world)
    return m


def divide_heads(model: nn.Module, styles: Dict[str, object], world: int, rank: int) -> None:
    """A transformers model's head-count attributes as one rank's share and an ALiBi bias sliced to its
    heads (the plugin's rule), once its linears are sliced."""
    from ..models.hf import reads_dict_plan

    if reads_dict_plan(model):
        from ..models.hf.cuts import divide_heads as divide

        divide(model, styles, world, rank)


def shard_int8_tp(model: nn.Module, group=None) -> nn.Module:
    """Replace this rank's quantised linears named in the model's plan (``model.tp_plan()``, or a transformers
    model's own plan) by their TP slices, in place.

    Call on every rank of ``group`` (default: the world) after ``quantize(model, "int8")``
    with identical weights on all ranks (same seed or same checkpoint); or load with
    ``load_quantized(..., tp_group=...)`` so no rank ever holds the unsharded int8 model.
    """
    styles = _tp_styles(model)
    rank, world, group = _group_info(model, True if group is None else group)
    if getattr(model, "_int8_tp_sharded", False):  # column slices are plain Int8Linears: mark the model itself
        raise ValueError(f"shard_int8_tp: {type(model).__name__} is already sharded; shard only once")
    for name in styles:  # every linear checked before any is cut: a refused model is left as it was
        mod = model.get_submodule(name)
        if not isinstance(mod, Int8Linear) or isinstance(mod, (RowParallelInt8Linear, GatherColInt8Linear)):
            raise ValueError(f"shard_int8_tp: {name} is a {type(mod).__name__}; quantize the model "
                             "with quantize(model, 'int8') first (and shard only once)")
    for name, style in styles.items():
        mod = model.get_submodule(name)
        if mod.out_features * world == 0:
            continue
        model.set_submodule(name, slice_for_tp(mod.weight_int8, mod.scale, mod.bias, style, rank, world, group, name))
    divide_heads(model, styles, world, rank)
    model._int8_tp_sharded = True
    return model
