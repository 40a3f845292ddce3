"""Column parallelism for a multi-query attention's packed projection: query heads split, the one key/value head
shared by every rank.

Multi-query attention (GPT-BigCode / StarCoder; Falcon-7B's layout) packs its projection's output as
``q | k | v`` with ``q`` all heads wide and ``k``, ``v`` one head each. Every query head attends to that one
key/value head, so under tensor parallelism a rank computes with its own query heads' rows
``[r*q/tp, (r+1)*q/tp)`` and the whole ``k | v`` tail.

What a rank *stores* is a plain row shard of the packed weight (and bias): a DTensor ``Shard(0)`` of the model's
own layout, ``(q + tail) / tp`` rows, so its memory, gradient and optimizer state split as any column weight's,
and checkpoints, the clip norm and the optimizer read it through its placement (``full_tensor()`` is the model's
packed weight). No placement stores the rows a rank computes with (its query rows next to a tail every rank
holds), so each forward gathers the weight (``full_tensor``: an all-gather) and takes those rows; the gather's
gradient is marked partial (a rank's gradient covers its own query rows and its heads' share of ``k | v``), so
backward reduce-scatters it onto the shards: the shared tail's gradient summed over tp, each query row's from
the rank that used it. An all-gather plus a reduce-scatter of the weight moves the bytes of one all-reduce of its
gradient. The replicated input's gradient is summed over tp, as for any column layer. The output is this rank's
``q_r | k | v``, which the attention splits by its per-rank ``embed_dim`` (the table's ``per_rank``). Built on
``torch.distributed.tensor`` (``distribute_tensor``, ``full_tensor(grad_placements=...)``, ``Partial``) and
:class:`.local_linear.LocalColwise` (so sequence parallelism treats it as the column layer opening a region).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from .local_linear import LocalColwise


class MultiQueryColwise(LocalColwise):
    """``nn.Linear`` whose output is ``q | k | v``, ``q`` as wide as its input (the hidden size) and ``k | v`` the
    shared head(s): stored as a row shard, computed with this rank's ``q`` rows and the whole tail."""

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
        module.weight = nn.Parameter(distribute_tensor(module.weight.data, device_mesh, [Shard(0)]))
        if module.bias is not None:
            module.bias = nn.Parameter(distribute_tensor(module.bias.data, device_mesh, [Shard(0)]))

        def rows_of(t: DTensor, idx: torch.Tensor) -> torch.Tensor:
            # all-gather the rows; backward: the ranks' partial gradients reduce-scattered onto the shards
            return t.full_tensor(grad_placements=[Partial()]).index_select(0, idx)

        def forward(mod, x):
            # replicated input: forward unchanged, backward sums the ranks' partial input gradients
            x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            idx = rows.to(x.device)
            b = rows_of(mod.bias, idx) if mod.bias is not None else None
            return F.linear(x, rows_of(mod.weight, idx), b)  # (..., q / tp + tail)

        module.forward = types.MethodType(forward, module)
        return module
