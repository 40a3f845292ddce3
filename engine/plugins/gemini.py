"""``GeminiPlugin``: chunk-based ZeRO-3 with heterogeneous memory (device / host RAM / NVMe).

Colossal-AI's argument names and order. Arguments and the trade-off each makes:

* ``placement_policy`` — ``"cuda"``: everything on the compute device (fastest, most device
  memory); ``"cpu"``: parameters and optimizer state in host RAM, chunks visit the device to
  compute (least device memory, most traffic); ``"static"``: fixed fractions below;
  ``"auto"``: fill the device, spill to host then NVMe, and at run time keep gathered chunks
  cached on the device, evicting the one used furthest in the future (learned in warm-up).
* ``shard_param_frac`` — fraction of chunks sharded over data-parallel ranks (ZeRO-3); the rest
  are replicated (no all-gather, but ``world``× their memory).
* ``offload_optim_frac`` / ``offload_param_frac`` — ``static`` only: fraction of optimizer
  states / parameter chunks homed in host RAM instead of the device.
* ``nvme_offload_dir`` / ``nvme_offload_frac`` — directory for the NVMe tier and the fraction of
  optimizer states kept there (slowest tier, nearly unlimited). With a directory, anything that
  does not fit the tiers above spills to it as well.
* ``nvme_direct_io`` — ``O_DIRECT`` file IO for the NVMe tier (bypasses the page cache: bandwidth
  is the disk's, no RAM is used behind the process's back; needs a local file system such as
  ext4/xfs). The default, buffered IO, lets the kernel cache recently written chunks in free RAM.
* ``device_memory_limit`` — bytes Gemini may use on the compute device (emulates a smaller
  card; on a CPU-only machine the budget of the RAM compute tier, and glibc's mmap threshold is
  fixed process-wide so freed chunk buffers return to the OS). It also caps the searched chunk size.
* ``chunk_size_mb`` — chunk payload size; ``None`` searches the size that wastes least padding.
  Bigger chunks mean fewer, larger transfers but a larger working set.
* ``max_prefetch`` — chunks loaded ahead of use (overlap vs. memory held for them).
* ``precision`` — compute dtype of parameters: ``bf16`` (default), ``fp16`` (dynamic loss
  scale) or ``fp32``; master weights and Adam states are always fp32. A ``Booster``
  ``mixed_precision``, when given, takes precedence (``mixed_precision.resolve_precision``).
* ``pin_memory`` — page-locked host buffers for faster host↔device copies (CUDA only).
* ``pack_order`` — ``"execution"`` (default): at the first training forward the model is run once
  on the meta device to learn the order parameters are first used, and the chunks are re-packed
  in that order before the real forward (a forward then walks chunks front to back, which is
  what eviction and prefetch are best at); costs one read and one write of every chunk's
  optimizer state, once, and falls back to registration order (with a warning) when the forward
  cannot run on meta (``.item()``, data-dependent control flow). ``"registration"``: keep
  ``named_parameters()`` order (no trace, no move).

Models built under ``engine.lazy.lazy_init()`` (meta parameters) are accepted: each parameter is
materialised straight into its chunk as the chunk is packed and the chunk goes to its home tier
(RAM or an NVMe file) before the next is built, so the full model never exists in RAM; with a CPU
``device_memory_limit`` peak RSS is that limit plus a fixed margin, independent of model size.

Call ``plugin.close()`` (or let the process exit) to remove the NVMe files.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..mixed_precision import TORCH_DTYPE_MAP, resolve_precision
from .base import Plugin, default_device


@dataclass
class GeminiPlugin(Plugin):
    placement_policy: str = "auto"
    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    nvme_offload_dir: Optional[str] = None
    nvme_offload_frac: float = 0.0
    device_memory_limit: Optional[int] = None
    chunk_size_mb: Optional[float] = None
    max_prefetch: int = 2
    precision: str = "bf16"
    pin_memory: bool = True
    nvme_direct_io: bool = False
    pack_order: str = "execution"
    _managers: List = field(default_factory=list, init=False, repr=False)

    supported_precisions = ("fp32", "fp16", "bf16")
    controls_precision = True

    def __post_init__(self):
        from ..gemini.placement import POLICIES

        if self.placement_policy not in POLICIES:
            raise ValueError(f"GeminiPlugin(placement_policy={self.placement_policy!r}): unknown policy; "
                             f"choose one of {list(POLICIES)}")
        for name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac", "nvme_offload_frac"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"GeminiPlugin({name}={v!r}): must be a fraction in [0, 1]")
        if self.precision not in TORCH_DTYPE_MAP:
            raise ValueError(f"GeminiPlugin(precision={self.precision!r}): choose one of {list(TORCH_DTYPE_MAP)}")
        if self.placement_policy != "static" and (self.offload_optim_frac or self.offload_param_frac):
            raise ValueError("GeminiPlugin: offload_optim_frac/offload_param_frac apply to "
                             "placement_policy='static' only; set placement_policy='static' or leave them at 0")
        if self.placement_policy == "cuda" and not torch.cuda.is_available():
            raise ValueError("GeminiPlugin(placement_policy='cuda'): no CUDA device is available; use "
                             "placement_policy='cpu' or 'auto' (with device_memory_limit) on this machine")
        if self.nvme_offload_frac > 0 and not self.nvme_offload_dir:
            raise ValueError(f"GeminiPlugin(nvme_offload_frac={self.nvme_offload_frac}): needs nvme_offload_dir=... "
                             "(a writable directory on a fast disk), or set nvme_offload_frac=0")
        if self.device_memory_limit is not None and (not isinstance(self.device_memory_limit, int)
                                                     or self.device_memory_limit <= 0):
            raise ValueError(f"GeminiPlugin(device_memory_limit={self.device_memory_limit!r}): must be a positive "
                             "number of bytes (e.g. 2 << 30 for 2 GiB) or None")
        if self.chunk_size_mb is not None and not self.chunk_size_mb > 0:
            raise ValueError(f"GeminiPlugin(chunk_size_mb={self.chunk_size_mb!r}): must be > 0 or None (search)")
        if not isinstance(self.max_prefetch, int) or self.max_prefetch < 0:
            raise ValueError(f"GeminiPlugin(max_prefetch={self.max_prefetch!r}): must be an int >= 0")
        from ..gemini.repack import ORDERS

        if self.pack_order not in ORDERS:
            raise ValueError(f"GeminiPlugin(pack_order={self.pack_order!r}): choose one of {list(ORDERS)}")
        if self.nvme_direct_io and not self.nvme_offload_dir:
            raise ValueError("GeminiPlugin(nvme_direct_io=True): needs nvme_offload_dir=... (a directory on a "
                             "local disk), or set nvme_direct_io=False")
        if self.nvme_offload_dir is not None:
            self._check_dir(self.nvme_offload_dir)
            if self.nvme_direct_io:
                from ..gemini.nvme import check_direct_io

                check_direct_io(self.nvme_offload_dir)

    @staticmethod
    def _check_dir(d: str) -> None:
        try:
            os.makedirs(d, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=d, prefix=".gemini-probe-"):
                pass
        except OSError as exc:
            raise ValueError(f"GeminiPlugin(nvme_offload_dir={d!r}): the directory is not writable ({exc.strerror}); "
                             "pass a directory you can write to on a fast local disk") from None

    # ---- the boost -----------------------------------------------------------------------
    def configure(self, model: nn.Module, optimizer, criterion, dataloader, lr_scheduler, mixed_precision=None):
        from ..gemini.chunk import Chunk, TensorInfo, pack, search_chunk_size
        from ..gemini.chunk_manager import ChunkManager
        from ..gemini.hostmem import bound_host_heap
        from ..gemini.materialize import ParamSource
        from ..gemini.nvme import NVMeStore
        from ..gemini.placement import PlacementConfig, min_working_set_bytes, plan_homes
        from ..gemini.repack import PackSpec
        from ..gemini.tiers import TierStack
        from ..gemini.zero_model import GeminiModel
        from ..gemini.zero_optim import SUPPORTED, GeminiOptimizer

        precision = resolve_precision(mixed_precision, self.precision, "GeminiPlugin")
        dtype = TORCH_DTYPE_MAP[precision]
        if optimizer is not None and not isinstance(optimizer, SUPPORTED):
            raise ValueError(f"GeminiPlugin: optimizer={type(optimizer).__name__} is not supported; pass "
                             "torch.optim.AdamW or torch.optim.Adam (Gemini runs fused AdamW on chunk shards)")
        world, rank = self.dp_size, self.dp_rank
        device = default_device()
        named, seen = [], set()
        for name, p in model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        numels = [p.numel() for _, p in named]
        elem = torch.empty((), dtype=dtype).element_size()
        if self.chunk_size_mb is not None:
            size = int(self.chunk_size_mb * 2 ** 20) // elem
            if size < max(numels):
                big = max(named, key=lambda np_: np_[1].numel())
                raise ValueError(
                    f"GeminiPlugin(chunk_size_mb={self.chunk_size_mb}): a chunk holds {size} elements but parameter "
                    f"{big[0]!r} has {big[1].numel()}; parameters never straddle chunks, so set chunk_size_mb >= "
                    f"{max(numels) * elem / 2 ** 20:.3f} or None to search")
            size = -(-size // world) * world
        else:
            size = search_chunk_size(numels, world, max_size=self._max_chunk_elems(elem))
        groups = pack(numels, size)
        n_shard = int(round(self.shard_param_frac * len(groups)))
        chunks = []
        for cid, idxs in enumerate(groups):
            c = Chunk(id=cid, size=size, dtype=dtype, world=world, rank=rank,
                      sharded=world > 1 and cid < n_shard)
            off = 0
            for i in idxs:
                name, p = named[i]
                c.infos.append(TensorInfo(name=name, param=p, offset=off, numel=p.numel(), shape=p.shape))
                off += p.numel()
            chunks.append(c)
        stack = TierStack.build(device, self.device_memory_limit, self.nvme_offload_dir)
        pair = min_working_set_bytes(chunks)
        if stack.compute.capacity < pair:
            raise ValueError(
                f"GeminiPlugin(device_memory_limit={self.device_memory_limit}): the compute tier must hold at least "
                f"the largest chunk pair being computed with its gradient ({pair} bytes, chunk size {size} elements); raise "
                "device_memory_limit or lower chunk_size_mb")
        cfg = PlacementConfig(policy=self.placement_policy, offload_optim_frac=self.offload_optim_frac,
                              offload_param_frac=self.offload_param_frac, nvme_offload_frac=self.nvme_offload_frac,
                              max_prefetch=self.max_prefetch)
        plan_homes(chunks, stack, cfg)  # raises before any memory is touched
        # ---- work starts here --------------------------------------------------------------
        if stack.compute.device.type == "cpu" and self.device_memory_limit is not None:
            bound_host_heap()  # RSS must follow the compute tier's accounting (see gemini/hostmem.py)
        nvme = NVMeStore(self.nvme_offload_dir, direct=self.nvme_direct_io) if self.nvme_offload_dir is not None else None
        telemetry_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        mgr = ChunkManager(chunks, stack, cfg, device, group=self.dp_group, nvme=nvme,
                           pin_memory=self.pin_memory, telemetry_rank=telemetry_rank)
        source = ParamSource(model)  # meta (lazy_init) parameters are materialised chunk by chunk
        mgr.materialize(source)
        source.finish(torch.device("cpu"))
        for m in model.modules():  # buffers go to the compute device; parameters went into chunks
            for bname, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[bname] = b.to(device)
        self._managers.append(mgr)
        spec = PackSpec(order=self.pack_order, shard_param_frac=self.shard_param_frac,
                        search_max=None if self.chunk_size_mb is not None else self._max_chunk_elems(elem))
        gmodel = GeminiModel(model, mgr, pack=spec)  # re-packs in execution order at the first training forward
        goptim = GeminiOptimizer(optimizer, mgr, precision, group=self.dp_group) if optimizer is not None else None
        mgr.snapshot()
        return gmodel, goptim, criterion, dataloader, lr_scheduler

    def _max_chunk_elems(self, elem: int) -> int:
        """Largest chunk the size search may pick: under ``device_memory_limit`` the run-time working
        set (chunks in compute and in flight, fp32 gradient buffers, an optimizer window) must stay an
        eighth of the budget, or everything spills and the limit is hit by the working set alone."""
        default = 32 << 20
        if self.device_memory_limit is None:
            return default
        per_elem = max((2 + self.max_prefetch) * elem + 8, 3 * (16 + elem) + 2 * elem)  # see working_set_bytes
        return max(1, min(default, self.device_memory_limit // (8 * per_elem)))

    def get_checkpoint_io(self):
        from ..gemini.checkpoint import GeminiCheckpointIO

        return GeminiCheckpointIO(self.dp_group)

    def close(self) -> None:
        """Finish pending IO and delete this plugin's NVMe files."""
        for m in self._managers:
            m.close()
        self._managers.clear()
