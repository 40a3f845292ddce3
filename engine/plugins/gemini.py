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
from dataclasses import dataclass, field, fields
from typing import List, Optional

import torch
import torch.nn as nn

from ..gemini.build import build
from ..gemini.checkpoint import GeminiCheckpointIO
from ..gemini.nvme import check_direct_io
from ..gemini.placement import POLICIES
from ..gemini.repack import ORDERS
from ..mixed_precision import TORCH_DTYPE_MAP, resolve_precision
from .base import Plugin


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
        if self.pack_order not in ORDERS:
            raise ValueError(f"GeminiPlugin(pack_order={self.pack_order!r}): choose one of {list(ORDERS)}")
        if self.nvme_direct_io and not self.nvme_offload_dir:
            raise ValueError("GeminiPlugin(nvme_direct_io=True): needs nvme_offload_dir=... (a directory on a "
                             "local disk), or set nvme_direct_io=False")
        if self.nvme_offload_dir is not None:
            self._check_dir(self.nvme_offload_dir)
            if self.nvme_direct_io:
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
        precision = resolve_precision(mixed_precision, self.precision, "GeminiPlugin")
        options = {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name != "precision"}
        gmodel, goptim, manager = build(model, optimizer, precision, device=self.compute_device(),
                                        group=self.dp_group, world=self.dp_size, rank=self.dp_rank, **options)
        self._managers.append(manager)
        return gmodel, goptim, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self):
        return GeminiCheckpointIO(self.dp_group)

    def close(self) -> None:
        """Finish pending IO and delete this plugin's NVMe files."""
        for m in self._managers:
            m.close()
        self._managers.clear()
