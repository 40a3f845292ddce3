"""Where each rank's tiers are and how big: the compute device (``cuda``, or host RAM on a CPU-only
machine), host RAM and an NVMe directory, per rank, from the arguments or this machine."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class _Env:
    """Per-rank tier capacities (None: unbounded or unknown)."""

    device: str                       # compute device type: "cuda" or "cpu"
    world: int
    compute: Optional[int]            # capacity of the compute tier per rank
    host: Optional[int]               # host RAM per rank (the cpu tier on a GPU machine)
    nvme: Optional[int]               # free bytes per rank in the NVMe directory
    nvme_dir: Optional[str]

    @property
    def compute_tier(self) -> str:
        return self.device

    def capacity(self, tier: str) -> Optional[int]:
        if tier == "nvme":
            return self.nvme
        if tier == self.device:
            return self.compute
        return self.host


def _check_dir(d: str) -> int:
    """Free bytes of a writable directory, or a ValueError naming ``nvme_dir``."""
    try:
        os.makedirs(d, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".plan-probe-"):
            pass
    except OSError as exc:
        raise ValueError(f"cl.plan(nvme_dir={d!r}): the directory is not writable ({exc.strerror}); pass a "
                         "directory you can write to on a fast local disk, or nvme_dir=None") from None
    return shutil.disk_usage(d).free


def _env(device, world, device_memory, host_memory, nvme_dir) -> _Env:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"cl.plan(device={device!r}): choose 'cuda', 'cpu' or None (this machine's)")
    for name, v in (("device_memory", device_memory), ("host_memory", host_memory)):
        if v is not None and (not isinstance(v, int) or v <= 0):
            raise ValueError(f"cl.plan({name}={v!r}): a positive number of bytes per rank (e.g. 8 << 30) or None")
    if host_memory is None:
        try:
            import psutil

            host_memory = psutil.virtual_memory().total // world  # ranks share this machine's RAM
        except ImportError:  # pragma: no cover
            host_memory = None
    if device == "cuda":
        if device_memory is None and torch.cuda.is_available():
            device_memory = torch.cuda.get_device_properties(0).total_memory
        compute = device_memory
    else:  # CPU-only: the compute device *is* host RAM (Gemini's device_memory_limit plays this role)
        given = [v for v in (device_memory, host_memory) if v is not None]
        compute = min(given) if given else None
    nvme = _check_dir(nvme_dir) // world if nvme_dir is not None else None
    return _Env(device=device, world=world, compute=compute, host=host_memory if device == "cuda" else compute,
                nvme=nvme, nvme_dir=nvme_dir)
