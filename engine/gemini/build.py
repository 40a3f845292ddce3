"""Gemini's one entry point: a model and its optimizer in, the boosted pair and their manager out.

Everything that can fail (the optimizer, the chunk size, the compute tier against the largest chunk
pair, every chunk's home) is checked before any memory is touched; only then are the NVMe store and
the manager made and the chunks filled, one at a time. ``GeminiPlugin.configure`` calls it.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from .. import comm
from ..device import default_device
from ..mixed_precision import TORCH_DTYPE_MAP
from .chunk import ApartLayout, TensorInfo, pack_chunks, search_chunk_size
from .chunk_manager import ChunkManager
from .hostmem import bound_host_heap
from .materialize import ParamSource
from .nvme import NVMeStore
from .placement import PlacementConfig, min_working_set_bytes, plan_homes
from .repack import PackSpec
from .tiers import TierStack
from .zero_model import GeminiModel
from .zero_optim import GeminiOptimizer, check_optimizer


def max_chunk_elems(elem: int, device_memory_limit: Optional[int], max_prefetch: int) -> int:
    """Largest chunk the size search may pick: under ``device_memory_limit`` the run-time working
    set (chunks in compute and in flight, fp32 gradient buffers, an optimizer window) must stay an
    eighth of the budget, or everything spills and the limit is hit by the working set alone."""
    default = 32 << 20
    if device_memory_limit is None:
        return default
    per_elem = max((2 + max_prefetch) * elem + 8, 3 * (16 + elem) + 2 * elem)  # see working_set_bytes
    return max(1, min(default, device_memory_limit // (8 * per_elem)))


def chunk_elems(infos: Sequence[TensorInfo], elem: int, world: int, chunk_size_mb: Optional[float],
                device_memory_limit: Optional[int], max_prefetch: int) -> Tuple[int, Optional[int]]:
    """Elements per chunk for ``infos`` (in packing order) over ``world`` ranks, and the cap the size
    search ran under (None when ``chunk_size_mb`` fixes the size; the execution-order re-pack
    searches again under that cap). Touches nothing, so ``cl.plan`` sizes chunks with it too.
    Raises ValueError when ``chunk_size_mb`` is below the largest parameter."""
    numels = [t.numel for t in infos]
    if chunk_size_mb is None:
        search_max = max_chunk_elems(elem, device_memory_limit, max_prefetch)
        return search_chunk_size(numels, world, max_size=search_max), search_max
    size = int(chunk_size_mb * 2 ** 20) // elem
    if size < max(numels):
        big = max(infos, key=lambda t: t.numel)
        raise ValueError(
            f"GeminiPlugin(chunk_size_mb={chunk_size_mb}): a chunk holds {size} elements but parameter "
            f"{big.name!r} has {big.numel}; parameters never straddle chunks, so set chunk_size_mb >= "
            f"{max(numels) * elem / 2 ** 20:.3f} or None to search")
    return -(-size // world) * world, None


def build(model: nn.Module, optimizer: Optional[Optimizer], precision: str, *,
          device: Optional[torch.device] = None, group=None, world: int = 1, rank: int = 0,
          placement_policy: str = "auto", shard_param_frac: float = 1.0,
          offload_optim_frac: float = 0.0, offload_param_frac: float = 0.0, nvme_offload_dir: Optional[str] = None,
          nvme_offload_frac: float = 0.0, device_memory_limit: Optional[int] = None,
          chunk_size_mb: Optional[float] = None, max_prefetch: int = 2, pin_memory: bool = True,
          nvme_direct_io: bool = False, pack_order: str = "execution", experts=None,
          ) -> Tuple[GeminiModel, Optional[GeminiOptimizer], ChunkManager]:
    """Pack ``model``'s parameters into chunks over ``world`` data-parallel ranks (``group``),
    place them, fill them and wrap model and optimizer to compute on ``device`` (default: this
    rank's). The other keyword arguments are ``GeminiPlugin``'s (see there); ``precision`` is the
    resolved one. ``experts``: the plugin's ``ExpertGroups`` under expert parallelism (its expert
    slices are packed in chunks of their own over the expert-dp group); None without."""
    if optimizer is not None:
        check_optimizer(optimizer)
    dtype, device = TORCH_DTYPE_MAP[precision], device or default_device()
    named, seen = [], set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            named.append(TensorInfo(name=name, param=p, offset=0, numel=p.numel(), shape=p.shape))
    size, search_max = chunk_elems(named, dtype.itemsize, world, chunk_size_mb, device_memory_limit,
                                   max_prefetch)
    apart = None
    if experts is not None:
        g = experts.expert_dp_group
        apart = ApartLayout(ids=frozenset(experts.params), world=dist.get_world_size(g) if g is not None else 1,
                            rank=dist.get_rank(g) if g is not None else 0, group=g)
        pack_order = "registration"  # the execution-order re-pack moves state over one group only (docs/moe.md)
    chunks = pack_chunks(named, size, dtype, world, rank, shard_param_frac, apart=apart)
    stack = TierStack.build(device, device_memory_limit, nvme_offload_dir)
    pair = min_working_set_bytes(chunks)
    if stack.compute.capacity < pair:
        raise ValueError(
            f"GeminiPlugin(device_memory_limit={device_memory_limit}): the compute tier must hold at least "
            f"the largest chunk pair being computed with its gradient ({pair} bytes, chunk size {size} elements); "
            "raise device_memory_limit or lower chunk_size_mb")
    cfg = PlacementConfig(policy=placement_policy, offload_optim_frac=offload_optim_frac,
                          offload_param_frac=offload_param_frac, nvme_offload_frac=nvme_offload_frac,
                          max_prefetch=max_prefetch)
    plan_homes(chunks, stack, cfg)  # raises before any memory is touched
    # ---- work starts here ------------------------------------------------------------------
    if stack.compute.device.type == "cpu" and device_memory_limit is not None:
        bound_host_heap()  # RSS must follow the compute tier's accounting (see hostmem.py)
    nvme = NVMeStore(nvme_offload_dir, direct=nvme_direct_io) if nvme_offload_dir is not None else None
    mgr = ChunkManager(chunks, stack, cfg, device, group=group, nvme=nvme, pin_memory=pin_memory,
                       telemetry_rank=dist.get_rank() if comm.initialized() else 0, world=world)
    source = ParamSource(model)  # meta (lazy_init) parameters are materialised chunk by chunk
    mgr.materialize(source)
    source.finish(torch.device("cpu"))
    for m in model.modules():  # buffers go to the compute device; parameters went into chunks
        for bname, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[bname] = b.to(device)
    spec = PackSpec(order=pack_order, shard_param_frac=shard_param_frac, search_max=search_max)
    gmodel = GeminiModel(model, mgr, pack=spec, experts=experts)  # re-packs in execution order at the first forward
    goptim = None
    if optimizer is not None:
        goptim = GeminiOptimizer(optimizer, mgr, precision, group=group, model=gmodel, experts=experts)
    mgr.snapshot()
    return gmodel, goptim, mgr
