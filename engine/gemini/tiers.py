"""The ordered tier stack: compute device → host RAM → NVMe, each with a byte capacity.

``cuda, cpu, nvme`` on a GPU machine, ``cpu, nvme`` on a CPU-only one (``device_memory_limit`` is
then the compute tier's budget); one placement/eviction algorithm runs over either.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import List, Optional

import torch

UNLIMITED = 1 << 62


@dataclass
class Tier:
    name: str                 # "cuda" | "cpu" | "nvme" (telemetry's names)
    capacity: int             # bytes Gemini may keep here
    device: Optional[torch.device] = None  # None for nvme (files)
    used: int = 0
    peak: int = 0

    def alloc(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def free(self, nbytes: int) -> None:
        self.used -= nbytes
        assert self.used >= 0, f"tier {self.name}: freed more than allocated"

    def room(self) -> int:
        return self.capacity - self.used


@dataclass
class TierStack:
    tiers: List[Tier] = field(default_factory=list)

    @property
    def compute(self) -> Tier:
        return self.tiers[0]

    @property
    def host(self) -> Tier:
        """The host-RAM tier (the compute tier itself on a CPU-only machine)."""
        return self.get("cpu")

    @property
    def nvme(self) -> Optional[Tier]:
        return self.get("nvme", missing_ok=True)

    def get(self, name: str, missing_ok: bool = False) -> Optional[Tier]:
        for t in self.tiers:
            if t.name == name:
                return t
        if missing_ok:
            return None
        raise KeyError(name)

    @classmethod
    def of(cls, device: torch.device, device_total: Optional[int], device_memory_limit: Optional[int],
           nvme_bytes: Optional[int]) -> "TierStack":
        """The stack for capacities already known, touching nothing: ``device_total`` bytes of a CUDA
        compute device (None: not known), Gemini's ``device_memory_limit`` over it (or over host RAM
        on a CPU-only machine), ``nvme_bytes`` for the NVMe tier (None: no NVMe tier). :meth:`build`
        measures the machine's; ``cl.plan`` passes the ones it plans for."""
        tiers: List[Tier] = []
        if device.type == "cuda":
            cap = min(x for x in (device_total, device_memory_limit, UNLIMITED) if x is not None)
            tiers.append(Tier("cuda", cap, device))
            tiers.append(Tier("cpu", UNLIMITED, torch.device("cpu")))
        else:
            tiers.append(Tier("cpu", device_memory_limit or UNLIMITED, torch.device("cpu")))
        if nvme_bytes is not None:
            tiers.append(Tier("nvme", nvme_bytes, None))
        return cls(tiers)

    @classmethod
    def build(cls, device: torch.device, device_memory_limit: Optional[int],
              nvme_dir: Optional[str]) -> "TierStack":
        """The stack of this machine: the device's total memory, the NVMe directory's free space."""
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        free = shutil.disk_usage(nvme_dir).free if nvme_dir is not None else None
        return cls.of(device, total, device_memory_limit, free)
