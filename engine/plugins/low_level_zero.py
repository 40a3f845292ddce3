"""``LowLevelZeroPlugin``: ZeRO stage 1 and 2 over the data-parallel ranks, on torch's parts.

Stage 1: DDP plus ``torch.distributed.optim.ZeroRedundancyOptimizer``; stage 2: FSDP2's
``fully_shard`` on every block and the root with ``reshard_after_forward=False``. Nothing here is
hand-written; stage 3 is Gemini's job. What each stage shards, mixed precision and
``cpu_offload``: docs/engine.md, "Plugins".
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import comm
from ..wrappers import ModelWrapper, OptimizerWrapper, rebuild_optimizer
from .base import Plugin, default_device
from .ddp import prepare_module


@dataclass
class LowLevelZeroPlugin(Plugin):
    stage: int = 1
    cpu_offload: bool = False

    supported_precisions = ("fp32", "fp16", "bf16", "fp8")

    def __post_init__(self):
        if self.stage == 3:
            raise ValueError("LowLevelZeroPlugin(stage=3): ZeRO-3 (sharded parameters) is GeminiPlugin's "
                             "job; use GeminiPlugin(placement_policy='static') or stage=1|2")
        if self.stage not in (1, 2):
            raise ValueError(f"LowLevelZeroPlugin(stage={self.stage!r}): stage must be 1 or 2")
        if self.cpu_offload and self.stage == 1 and torch.cuda.is_available():
            raise ValueError("LowLevelZeroPlugin(stage=1, cpu_offload=True) is not implemented on CUDA; "
                             "use stage=2 (FSDP2's CPU offload) or GeminiPlugin")

    # ---- stage 1 -------------------------------------------------------------------------
    def _stage1(self, model: nn.Module, optimizer):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        dev = default_device()
        module = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                     process_group=self.dp_group) if comm.initialized() else model
        if optimizer is None:
            return module, None, None
        names = {id(p): n for n, p in model.named_parameters()}
        zero_class = functools.partial(ZeroRedundancyOptimizer, optimizer_class=type(optimizer),
                                       process_group=self.dp_group)
        zero = rebuild_optimizer(optimizer, names, dict(model.named_parameters()), optimizer_class=zero_class)
        return module, zero, zero.optim  # zero.optim: the local shard's torch optimizer

    # ---- stage 2 -------------------------------------------------------------------------
    def _stage2(self, model: nn.Module, optimizer, mixed_precision: str = "fp32"):
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from ..mixed_precision import autocast_dtype

        if not comm.initialized():  # one process: nothing to shard
            return model, optimizer, optimizer
        dev = default_device().type
        mesh = (init_device_mesh(dev, (dist.get_world_size(),)) if self.dp_group is None
                else DeviceMesh.from_group(self.dp_group, dev))
        names = {id(p): n for n, p in model.named_parameters()}
        kw = dict(mesh=mesh, reshard_after_forward=False)
        if self.cpu_offload and dev == "cuda":
            kw["offload_policy"] = CPUOffloadPolicy()
        low = autocast_dtype(mixed_precision)
        if low is not None and mixed_precision != "fp8":
            # gather parameters in 16 bits (half the all-gather bytes), reduce gradients in fp32;
            # the sharded fp32 parameters stay the master copy the optimizer updates
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        for block in _blocks(model):
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        if optimizer is None:
            return model, None, None
        new = rebuild_optimizer(optimizer, names, dict(model.named_parameters()))
        return model, new, new

    def configure(self, model, optimizer, criterion, dataloader, lr_scheduler, mixed_precision):
        model = prepare_module(model, mixed_precision)
        if self.stage == 1:
            module, optim, local = self._stage1(model, optimizer)
        else:
            module, optim, local = self._stage2(model, optimizer, mixed_precision)
        wrapped = ModelWrapper(module, mixed_precision)
        if optim is not None:
            optim = OptimizerWrapper(optim, wrapped, mixed_precision, group=self.dp_group, checkpoint_optim=local)
        return wrapped, optim, criterion, dataloader, lr_scheduler

    def no_sync(self, model, optimizer=None):
        inner = model.unwrap() if hasattr(model, "unwrap") else model
        if isinstance(inner, DDP):
            return inner.no_sync()
        if hasattr(inner, "set_requires_gradient_sync"):
            return _fsdp_no_sync(inner)
        return contextlib.nullcontext()


def fsdp_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The repeated layers stage 2 shards one by one, ``(qualified name, module)``: the members of the
    shallowest ModuleList/ModuleDicts, found breadth-first (our GPT's ``blocks`` are children of the root;
    a transformers model's layers sit one or more levels down, ``model.layers``, ``transformer.h``,
    ``bert.encoder.layer``, and deeper under peft's wrappers). None found: the root alone is one unit.
    The memory planner (planner/memory/fsdp.py) groups parameters by the same rule."""
    level = [("", model)]
    while level:
        lists = [(n, m) for n, m in level if isinstance(m, (nn.ModuleList, nn.ModuleDict))]
        if lists:
            return [(f"{n}.{k}" if n else k, b) for n, lst in lists for k, b in lst.named_children()]
        level = [(f"{n}.{k}" if n else k, c) for n, m in level for k, c in m.named_children()]
    return []


def _blocks(model: nn.Module):
    return [b for _, b in fsdp_blocks(model)]


@contextlib.contextmanager
def _fsdp_no_sync(module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


