"""Column/row tensor parallelism computed on local shards, for layers DTensor's styles cannot take.

Two cases need it: transformers' ``Conv1D`` (GPT-2 and kin: ``y = x @ W + b`` with ``W`` of shape
``(in, out)``, the transpose of ``nn.Linear``'s) and fused projections whose output packs ``k`` parts
(GPT-2's ``c_attn`` packs q | k | v). A packed weight is sharded with DTensor's ``_StridedShard``, so
rank ``r`` holds ``[q_r | k_r | v_r]`` (its heads of every part) while the parameter stays a DTensor
whose ``full_tensor()`` is the model's own layout (checkpoints, clipping and the optimizer see it whole).

The forward runs on the local shards (``to_local()`` is differentiable: parameter gradients come back as
DTensors of the same placement) with the two Megatron collectives written as DTensor redistributions:
a column layer's replicated input gets a partial gradient (summed over the tp group in backward), a row
layer's partial output is summed over the group in forward. Built on
``torch.distributed.tensor`` (``distribute_tensor``, ``DTensor.from_local``, ``Partial``) and
``torch.distributed.tensor.parallel.ParallelStyle``.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (found by class name: the engine does not import transformers for it)."""
    return any(c.__name__ == "Conv1D" for c in type(module).__mro__)


def out_dim(module: nn.Module) -> int:
    """The weight dimension that indexes output features: 0 for ``nn.Linear`` (out, in), 1 for ``Conv1D``."""
    return 1 if is_conv1d(module) else 0


def _matmul(module: nn.Module, x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    if is_conv1d(module):  # (..., in) @ (in, out): Conv1D's own addmm, on the local shards
        y = x.reshape(-1, x.size(-1)) @ w
        y = y + b if b is not None else y
        return y.view(*x.shape[:-1], w.size(-1))
    return F.linear(x, w, b)


class LocalColwise(ParallelStyle):
    """Output features sharded (``parts`` > 1: each of ``parts`` equal blocks sharded alike, so a rank
    keeps its slice of every block in order); the input enters whole, its gradient is summed over tp;
    the output is this rank's local slice (``gather=True``: all of it, gathered)."""

    def __init__(self, parts: int = 1, gather: bool = False):
        super().__init__()
        if gather and parts > 1:
            raise ValueError("column-parallel (local): gathering a packed output is not supported")
        self.parts, self.gather = parts, gather

    def _placement(self, dim: int):
        return _StridedShard(dim, split_factor=self.parts) if self.parts > 1 else Shard(dim)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise ValueError(f"column-parallel (local): {type(module).__name__} is neither nn.Linear nor Conv1D")
        w_place = [self._placement(out_dim(module))]
        module.weight = nn.Parameter(distribute_tensor(module.weight.data, device_mesh, w_place))
        if module.bias is not None:
            module.bias = nn.Parameter(distribute_tensor(module.bias.data, device_mesh, [self._placement(0)]))
        style = self

        def forward(mod, x):
            # replicated input: forward unchanged, backward sums the ranks' partial input gradients
            x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            b = mod.bias.to_local() if mod.bias is not None else None
            y = _matmul(mod, x, mod.weight.to_local(), b)
            if not style.gather:
                return y  # (..., out / tp): this rank's slice of every packed part
            return DTensor.from_local(y, device_mesh, [Shard(y.dim() - 1)], run_check=False).full_tensor()

        module.forward = types.MethodType(forward, module)
        return module


class LocalRowwise(ParallelStyle):
    """Input features sharded (the input arrives as this rank's slice), the partial outputs summed over
    tp in forward; the bias is kept whole and added once, after the sum."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise ValueError(f"row-parallel (local): {type(module).__name__} is neither nn.Linear nor Conv1D")
        in_dim = 1 - out_dim(module)
        module.weight = nn.Parameter(distribute_tensor(module.weight.data, device_mesh, [Shard(in_dim)]))
        if module.bias is not None:
            module.bias = nn.Parameter(distribute_tensor(module.bias.data, device_mesh, [Replicate()]))

        def forward(mod, x):
            y = _matmul(mod, x, mod.weight.to_local(), None)
            y = DTensor.from_local(y, device_mesh, [Partial()], run_check=False).redistribute(
                device_mesh, [Replicate()]).to_local()
            return y + mod.bias.to_local() if mod.bias is not None else y

        module.forward = types.MethodType(forward, module)
        return module
