"""Measure a rank's memory per tier and emit it as ``MemorySample`` events.

Built on what already measures these things: ``torch.cuda.memory_allocated`` and
``torch.cuda.mem_get_info`` for the GPU, ``psutil`` for host RSS and available RAM, and
``os.scandir`` + ``shutil.disk_usage`` for an NVMe offload directory. What this file adds is
only the mapping onto the telemetry contract:

* ``cuda``: used = bytes allocated by torch's caching allocator on the device; capacity = the
  device's total memory;
* ``cpu``: used = this process's RSS; capacity = RSS + the host's available memory (what
  this rank could still grow to, not the whole machine's RAM, which ranks share);
* ``nvme``: used = bytes of the files under the offload directory; capacity = used + free
  bytes on its file system.

Engine-side and Jupyter-free: the engine (or a user) calls :func:`sample_memory` /
:func:`emit_memory` at step boundaries, or runs a :class:`MemorySampler` thread.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import List, Optional

from .bus import emit, has_subscribers
from .events import MemorySample


def _dir_bytes(path: str) -> int:
    total, stack = 0, [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:  # an offload file removed while we walk
                        pass
        except FileNotFoundError:
            pass
    return total


def sample_memory(rank: int, nvme_dir: Optional[str] = None, device=None,
                  cuda: Optional[bool] = None) -> List[MemorySample]:
    """One ``MemorySample`` per tier present on this rank, measured now.

    ``cuda=None`` samples the GPU tier when torch sees a CUDA device; ``nvme_dir`` (an
    existing directory) adds the NVMe tier.
    """
    if nvme_dir is not None and not os.path.isdir(nvme_dir):
        raise FileNotFoundError(f"sample_memory(nvme_dir={nvme_dir!r}): not a directory; "
                                "pass the GeminiPlugin's nvme_offload_dir after it is created")
    import psutil

    now = time.time()
    out: List[MemorySample] = []
    if cuda is None or cuda:
        try:
            import torch

            if torch.cuda.is_available():
                dev = torch.device("cuda", torch.cuda.current_device()) if device is None else device
                _, total = torch.cuda.mem_get_info(dev)
                out.append(MemorySample(rank, now, "cuda", int(torch.cuda.memory_allocated(dev)),
                                        int(total)))
            elif cuda:
                raise RuntimeError("sample_memory(cuda=True): torch sees no CUDA device")
        except ImportError:
            if cuda:
                raise
    rss = psutil.Process().memory_info().rss
    out.append(MemorySample(rank, now, "cpu", int(rss), int(rss + psutil.virtual_memory().available)))
    if nvme_dir is not None:
        used = _dir_bytes(nvme_dir)
        out.append(MemorySample(rank, now, "nvme", used, used + shutil.disk_usage(nvme_dir).free))
    return out


def emit_memory(rank: int, nvme_dir: Optional[str] = None, device=None,
                cuda: Optional[bool] = None) -> List[MemorySample]:
    """Sample and emit on this process's bus (skipped, returning [], when nobody listens)."""
    if not has_subscribers():
        return []
    samples = sample_memory(rank, nvme_dir=nvme_dir, device=device, cuda=cuda)
    for s in samples:
        emit(s)
    return samples


@dataclass
class MemorySamplerConfig:
    rank: int
    interval: float = 0.5  # seconds between samples: memory changes slowly, and each sample is an event
    nvme_dir: Optional[str] = None
    cuda: Optional[bool] = None


class MemorySampler:
    """A daemon thread emitting this rank's memory every ``interval`` seconds.

        with MemorySampler(MemorySamplerConfig(rank=dist.get_rank(), nvme_dir=d)):
            train()
    """

    def __init__(self, config: MemorySamplerConfig):
        if not config.interval > 0:
            raise ValueError(f"MemorySamplerConfig.interval={config.interval!r}: must be > 0 seconds")
        if config.nvme_dir is not None and not os.path.isdir(config.nvme_dir):
            raise FileNotFoundError(f"MemorySamplerConfig.nvme_dir={config.nvme_dir!r}: not a directory")
        self.config = config
        self.samples = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "MemorySampler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="colossal-memory", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        c = self.config
        while not self._stop.is_set():
            try:
                self.samples += len(emit_memory(c.rank, nvme_dir=c.nvme_dir, cuda=c.cuda))
            except (OSError, RuntimeError):  # offload dir removed at teardown: stop quietly
                return
            self._stop.wait(c.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "MemorySampler":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False
