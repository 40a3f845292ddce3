"""Bare parameters sharded by a transformers plan, and the module that reads them as local tensors.

transformers 5 plans may shard a parameter that has no forward of its own to hook: attention sinks, one
learned logit per head (GPT-OSS-style attention in Granite-SWA, MiMo-V2-Flash, Beam, ...), planned as
``"layers.*.self_attn.sinks": "colwise"`` beside ``"layers.*.self_attn": "local_params"`` (transformers'
``LocalParamsParallel``: the owner runs its forward with its own sharded parameters as local tensors). Here
the parameter becomes a ``Shard(dim)`` DTensor (so the optimizer, clipping and checkpoints see the whole
tensor, as for every other sharded weight) and the owner's forward sees ``to_local()`` of it: this rank's
heads' values, beside the q/k/v projections the plan shards by the same heads. ``to_local`` is
differentiable, so the gradient comes back as this rank's shard; no collective is needed, as each head's
value is used by that head's rank alone. Built on ``torch.distributed.tensor`` (``distribute_tensor``,
``DTensor.to_local``) and ``ParallelStyle``; written here only the hooks that put the local view in front
of the parameter during the forward (an instance attribute, found before ``nn.Module.__getattr__``'s
parameter lookup) and take it away after.
"""

from __future__ import annotations

from typing import Dict

import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class LocalParams(ParallelStyle):
    """Shard ``module``'s own parameters ``shards`` (name -> tensor dimension) over the tp mesh; its forward
    reads each as this rank's local shard."""

    def __init__(self, shards: Dict[str, int]):
        super().__init__()
        self.shards = dict(shards)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, dim in self.shards.items():
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(distribute_tensor(p.data, device_mesh, [Shard(dim)]),
                                                    requires_grad=p.requires_grad)
        names = tuple(self.shards)

        def local(mod, args):
            for n in names:
                mod.__dict__[n] = mod._parameters[n].to_local()

        def drop(mod, args, out):
            for n in names:
                mod.__dict__.pop(n, None)

        module.register_forward_pre_hook(local)
        module.register_forward_hook(drop, always_call=True)
        return module
