"""Column parallelism for a multi-query attention's packed projection: query heads split, the one key/value head
shared by every rank.

Multi-query attention (GPT-BigCode / StarCoder; Falcon-7B's layout) packs its projection's output as
``q | k | v`` with ``q`` all heads wide and ``k``, ``v`` one head each. Every query head attends to that one
key/value head, so under tensor parallelism a rank needs its own query heads' rows and the whole ``k | v`` tail:
no DTensor placement of the one weight gives that (a shard is a contiguous or strided slice of every part). The
weight therefore stays whole on every rank, a plain parameter the model's own checkpoints and the optimizer see
as it is; each rank's forward uses the rows ``[r*q/tp, (r+1)*q/tp)`` and the tail (the compute is split, the
weight's memory is not). A rank's gradient covers its own query rows and its heads' share of the key/value rows,
so a hook sums each backward's gradient over the tp group (as :mod:`.grad_sum`); the replicated input's gradient
is summed over tp too, as for any column layer. The output is this rank's ``q_r | k | v``, which the attention
splits by its per-rank ``embed_dim`` (the table's ``per_rank``). Built on ``torch.distributed.tensor``
(``DTensor.from_local``, ``Partial``) and :class:`.local_linear.LocalColwise` (so sequence parallelism treats it
as the column layer opening a region).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate

from .grad_sum import sum_grads_over
from .local_linear import LocalColwise


class MultiQueryColwise(LocalColwise):
    """``nn.Linear`` whose output is ``q | k | v``, ``q`` as wide as its input (the hidden size) and ``k | v`` the
    shared head(s): ``q`` cut by rows over tp, the tail whole on every rank; the weight kept whole."""

    def __init__(self):
        super().__init__(parts=1, gather=False)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"multi-query column-parallel: {type(module).__name__} is not nn.Linear")
        q, tail, tp = module.in_features, module.out_features - module.in_features, device_mesh.size()
        if tail <= 0 or q % tp:
            raise ValueError(f"multi-query column-parallel: an output of {module.out_features} features is not "
                             f"q ({q}, divisible by tp={tp}) followed by a shared key/value tail")
        r = device_mesh.get_local_rank()
        rows = torch.cat([torch.arange(r * q // tp, (r + 1) * q // tp), torch.arange(q, q + tail)])
        sum_grads_over(module, device_mesh.get_group())  # each rank's gradient covers its own rows only

        def forward(mod, x):
            # replicated input: forward unchanged, backward sums the ranks' partial input gradients
            x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            idx = rows.to(mod.weight.device)
            b = mod.bias.index_select(0, idx) if mod.bias is not None else None
            return F.linear(x, mod.weight.index_select(0, idx), b)  # (..., q / tp + tail)

        module.forward = types.MethodType(forward, module)
        return module
