"""``GeminiPlugin``: chunk-based ZeRO-3 with heterogeneous memory (device / host RAM / NVMe).

Colossal-AI's argument names and order; what each argument does and the trade-off it makes is
in docs/gemini.md ("Arguments and their trade-offs"), lazily built models ("Models larger than
RAM") included. The plugin validates its arguments before any work and hands the boost to
``gemini.build.build``. Call ``plugin.close()`` (or let the process exit) to remove the NVMe files.
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
