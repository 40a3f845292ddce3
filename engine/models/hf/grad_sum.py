"""A module kept whole on every tensor-parallel rank whose parameters' gradients are partial.

transformers' ``replicated_with_grad_allreduce``: a norm between a column and a row layer that
normalises each head on its own (Qwen3's ``q_norm``/``k_norm``, over ``head_dim``) sees only this
rank's heads, so each rank's gradient of its (whole, replicated) weight covers its heads only. The
parameters stay plain tensors; a hook on each sums every backward's contribution over the tp group
before it is accumulated (so gradient accumulation over several backwards stays right). Built on
``torch.Tensor.register_hook`` and :func:`colossal_lab.engine.comm.all_reduce`.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle

from ... import comm


def sum_grads_over(module: nn.Module, group) -> None:
    """Every backward's gradient of ``module``'s own parameters is summed over ``group`` before it accumulates."""
    for p in module.parameters(recurse=False):
        if p.requires_grad:
            p.register_hook(lambda g: comm.all_reduce(g.clone(), group=group))


class ReplicatedGradSum(ParallelStyle):
    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        sum_grads_over(module, device_mesh.get_group())
        return module
