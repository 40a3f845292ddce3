"""Tensor-parallel int8 serving: each rank keeps a column or row slice of every quantised linear.

The model's ``tp_plan()`` (the model contract) names the column-parallel linears (output channels
and their scales split) and the row-parallel ones (input channels split, outputs all-reduced), with
plain ``torch.distributed`` collectives: DTensor has no sharding rule for the int8 matmuls
(docs/kernels.md, "Int8 inference").
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .int8 import Int8Linear


class RowParallelInt8Linear(Int8Linear):
    """Input-channel slice; the partial products are summed over the group, bias added once."""

    group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from colossal_lab.kernels import int8_linear

        y = int8_linear(x, self.weight_int8, self.scale, None)
        comm.all_reduce(y, group=self.group)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


def _tp_styles(model: nn.Module) -> Dict[str, str]:
    # callable: a transformers model's tp_plan is a dict property (its adapter, models/hf, is not wired here)
    if not callable(getattr(model, "tp_plan", None)):
        raise ValueError(f"tensor-parallel int8: {type(model).__name__} has no tp_plan() (the model contract; "
                         "transformers models are not run here yet); it must name its column/row-parallel linears")
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
    return rank, world, group


def slice_for_tp(q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor], style: str,
                 rank: int, world: int, group, name: str = "") -> Int8Linear:
    """This rank's slice of a quantised linear (``style`` is ``"col"`` or ``"row"``)."""
    N, K = q.shape
    if style == "col":
        if N % world:
            raise ValueError(f"tensor-parallel int8: {name} has {N} output channels, not divisible by {world} ranks")
        n = N // world
        sl = slice(rank * n, (rank + 1) * n)
        return Int8Linear.from_quantized(q[sl].clone(), scale[sl].clone(), None if bias is None else bias[sl])
    if K % world:
        raise ValueError(f"tensor-parallel int8: {name} has {K} input channels, not divisible by {world} ranks")
    k = K // world
    m = RowParallelInt8Linear.from_quantized(q[:, rank * k:(rank + 1) * k].clone(), scale.clone(), bias)
    m.group = group
    return m


def shard_int8_tp(model: nn.Module, group=None) -> nn.Module:
    """Replace this rank's quantised linears named in ``model.tp_plan()`` by their TP slices, in place.

    Call on every rank of ``group`` (default: the world) after ``quantize(model, "int8")``
    with identical weights on all ranks (same seed or same checkpoint); or load with
    ``load_quantized(..., tp_group=...)`` so no rank ever holds the unsharded int8 model.
    """
    styles = _tp_styles(model)
    rank, world, group = _group_info(model, True if group is None else group)
    for name, style in styles.items():
        mod = model.get_submodule(name)
        if not isinstance(mod, Int8Linear) or isinstance(mod, RowParallelInt8Linear):
            raise ValueError(f"shard_int8_tp: {name} is a {type(mod).__name__}; quantize the model "
                             "with quantize(model, 'int8') first (and shard only once)")
        if mod.out_features * world == 0:
            continue
        model.set_submodule(name, slice_for_tp(mod.weight_int8, mod.scale, mod.bias, style, rank, world, group, name))
    return model
