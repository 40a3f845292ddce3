"""Measure a rank's memory per tier (``cuda``, ``cpu``, ``nvme``) and emit it as ``MemorySample``s.

Built on what already measures these things: torch's caching-allocator counters, NVML (through
``torch.cuda.utilization``, where ``nvidia-ml-py`` imports), ``psutil``/``resource`` for host
RSS, and ``os.scandir`` + ``shutil.disk_usage`` for NVMe offload directories; this file only maps
them onto the telemetry contract. What each tier's used/capacity/peak/reserved/util mean, the
registry of NVMe directories and the sampler's ``defer``: docs/widgets.md, "Memory sampler and
per-rank bubbles: details".
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple, Union

from .bus import emit, has_subscribers, subscribe
from .events import MemorySample

PathArg = Union[str, "os.PathLike[str]"]
_NVME_FIX = "pass the GeminiPlugin's nvme_offload_dir after it is created"


# ---------------------------------------------------------------- NVMe directories in use
_nvme_lock = threading.Lock()
_nvme_dirs: Dict[str, int] = {}  # absolute path -> registrations (a store may be opened twice)


def register_nvme_dir(path: PathArg) -> str:
    """Count ``path`` (an existing directory) as NVMe offload storage of this process, so a
    :class:`MemorySampler` with ``registered_nvme=True`` reports its bytes. Returns the
    absolute path registered. Pair every call with :func:`unregister_nvme_dir`."""
    p = _existing_dir(path, "register_nvme_dir(path", "create it first")
    with _nvme_lock:
        _nvme_dirs[p] = _nvme_dirs.get(p, 0) + 1
    return p


def unregister_nvme_dir(path: PathArg) -> None:
    """Undo one :func:`register_nvme_dir` of ``path`` (a path never registered is ignored, so
    a store's idempotent close may call it unconditionally)."""
    p = os.path.abspath(os.fspath(path))
    with _nvme_lock:
        n = _nvme_dirs.pop(p, 0)
        if n > 1:
            _nvme_dirs[p] = n - 1


def registered_nvme_dirs() -> List[str]:
    """The NVMe offload directories registered in this process now, sorted."""
    with _nvme_lock:
        return sorted(_nvme_dirs)


def _existing_dir(path, call: str, fix: str) -> str:
    """``path`` made absolute; ``TypeError``/``FileNotFoundError`` naming ``call`` unless it is an
    existing directory."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{call}={path!r}): expected a directory path (str)")
    p = os.path.abspath(os.fspath(path))
    if not os.path.isdir(p):
        raise FileNotFoundError(f"{call}={p!r}): not a directory; {fix}")
    return p


def _as_dirs(nvme_dir, what: str) -> List[str]:
    if nvme_dir is None:
        return []
    items = [nvme_dir] if isinstance(nvme_dir, (str, os.PathLike)) else list(nvme_dir)
    return [_existing_dir(d, f"{what}(nvme_dir", _NVME_FIX) for d in items]


# ---------------------------------------------------------------- measurements per tier
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


def _nvme_sample(rank: int, now: float, dirs: Iterable[str]) -> Optional[MemorySample]:
    """One ``nvme`` sample over ``dirs`` (free bytes counted once per file system); a directory
    gone meanwhile (a registered store closing) is skipped, and ``None`` when none is left."""
    used, free, devices = 0, 0, set()
    for d in dirs:
        try:
            dev = os.stat(d).st_dev
            disk_free = shutil.disk_usage(d).free
        except FileNotFoundError:
            continue
        used += _dir_bytes(d)
        if dev not in devices:
            devices.add(dev)
            free += disk_free
    if not devices:
        return None
    return MemorySample(rank, now, "nvme", used, used + free)


_nvml_ok: Optional[bool] = None  # None: not tried yet; False: NVML unusable in this process


def _gpu_util(dev) -> Optional[float]:
    """NVML's GPU utilisation in percent, or ``None`` where NVML is not usable (no
    ``nvidia-ml-py``, no driver or permission, a MIG slice); after a failure never asked again."""
    global _nvml_ok
    if _nvml_ok is False:
        return None
    if _nvml_ok is None:
        _nvml_ok = importlib.util.find_spec("pynvml") is not None
        if not _nvml_ok:
            return None
    import torch

    try:
        return float(torch.cuda.utilization(dev))
    except Exception:  # pynvml.NVMLError and torch's wrappers of it: no utilisation here
        _nvml_ok = False
        return None


def _cuda_sample(rank: int, now: float, device, cuda: Optional[bool]) -> Optional[MemorySample]:
    try:
        import torch
    except ImportError:
        if cuda:
            raise
        return None
    if not torch.cuda.is_available():
        if cuda:
            raise RuntimeError("sample_memory(cuda=True): torch sees no CUDA device")
        return None
    if cuda is None and not torch.cuda.is_initialized():
        # a process that has not touched its GPU holds none of its memory, and measuring
        # would create a CUDA context, which itself takes hundreds of MiB of device memory
        return None
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"sample_memory(device={device!r}): expected a CUDA device such as 'cuda:0'")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    allocated = int(torch.cuda.memory_allocated(dev))
    reserved = int(torch.cuda.memory_reserved(dev))
    return MemorySample(rank, now, "cuda", allocated,
                        int(torch.cuda.get_device_properties(dev).total_memory),
                        peak=int(torch.cuda.max_memory_allocated(dev)),
                        reserved=max(0, reserved - allocated), util=_gpu_util(dev))


def _peak_rss(process) -> int:
    try:
        import resource
    except ImportError:  # Windows: psutil has the peak working set there
        return int(getattr(process.memory_info(), "peak_wset", 0))
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # bytes on macOS, KiB on Linux


def _cpu_sample(rank: int, now: float, process=None) -> MemorySample:
    import psutil

    process = process or psutil.Process()
    rss = process.memory_info().rss
    return MemorySample(rank, now, "cpu", int(rss), int(rss + psutil.virtual_memory().available),
                        peak=max(int(rss), _peak_rss(process)))


def _measure(rank: int, nvme_dirs: Sequence[str], registered: bool, device, cuda: Optional[bool],
             skip: FrozenSet[str] = frozenset(), process=None) -> List[MemorySample]:
    """This rank's samples now, but none of the tiers in ``skip``; ``registered`` adds the
    directories of :func:`register_nvme_dir` to ``nvme_dirs``."""
    now = time.time()
    out: List[Optional[MemorySample]] = []
    if "cuda" not in skip and cuda is not False:
        out.append(_cuda_sample(rank, now, device, cuda))
    if "cpu" not in skip:
        out.append(_cpu_sample(rank, now, process))
    if "nvme" not in skip:
        extra = [d for d in registered_nvme_dirs() if d not in nvme_dirs] if registered else []
        out.append(_nvme_sample(rank, now, [*nvme_dirs, *extra]))
    return [s for s in out if s is not None]


def sample_memory(rank: int, nvme_dir: Union[None, PathArg, Sequence[PathArg]] = None, device=None,
                  cuda: Optional[bool] = None, registered_nvme: bool = False) -> List[MemorySample]:
    """One ``MemorySample`` per tier present on this rank, measured now. ``cuda``: None samples
    the GPU once this process has initialised CUDA (never creating a context), True requires
    one, False skips it; ``device``: which GPU (default: the current one); ``nvme_dir``: an
    existing directory or a list of them; ``registered_nvme``: add :func:`register_nvme_dir`'s."""
    return _measure(rank, _as_dirs(nvme_dir, "sample_memory"), registered_nvme, device, cuda)


def emit_memory(rank: int, nvme_dir: Union[None, PathArg, Sequence[PathArg]] = None, device=None,
                cuda: Optional[bool] = None, registered_nvme: bool = False) -> List[MemorySample]:
    """Sample and emit on this process's bus (skipped, returning [], when nobody listens)."""
    if not has_subscribers():
        return []
    samples = sample_memory(rank, nvme_dir, device, cuda, registered_nvme)
    for s in samples:
        emit(s)
    return samples


# ---------------------------------------------------------------- the sampler thread
@dataclass
class MemorySamplerConfig:
    """What a :class:`MemorySampler` measures and how often. ``defer``: skip a tier while
    another thread emits this rank's ``MemorySample``s of it (Gemini's own accounting), for
    ``defer_s`` seconds after the last one or three times the gap between the last two if that
    is longer; a bus subscriber, so use it next to a sink that listens anyway (the relay does).
    Why: docs/widgets.md, "Memory sampler and per-rank bubbles: details"."""

    rank: int
    interval: float = 0.5  # seconds between samples: memory changes slowly, and each sample is an event
    nvme_dir: Union[None, PathArg, Sequence[PathArg]] = None
    cuda: Optional[bool] = None
    device: Union[None, int, str] = None  # the GPU to sample; None: the starting thread's device
    registered_nvme: bool = False          # also report the directories of register_nvme_dir
    defer: bool = False
    defer_s: float = 10.0


class MemorySampler:
    """A daemon thread (named ``colossal-memory``) emitting this rank's memory every
    ``interval`` seconds.

        with MemorySampler(MemorySamplerConfig(rank=dist.get_rank(), nvme_dir=d)):
            train()
    """

    THREAD_NAME = "colossal-memory"

    def __init__(self, config: MemorySamplerConfig):
        if not isinstance(config, MemorySamplerConfig):
            raise TypeError(f"MemorySampler(config={config!r}): expected a MemorySamplerConfig")
        if not (isinstance(config.interval, (int, float)) and config.interval > 0):
            raise ValueError(f"MemorySamplerConfig.interval={config.interval!r}: must be > 0 seconds")
        if not (isinstance(config.defer_s, (int, float)) and config.defer_s > 0):
            raise ValueError(f"MemorySamplerConfig.defer_s={config.defer_s!r}: must be > 0 seconds")
        if config.cuda not in (None, True, False):
            raise TypeError(f"MemorySamplerConfig.cuda={config.cuda!r}: expected None, True or False")
        self._dirs = _as_dirs(config.nvme_dir, "MemorySamplerConfig")
        self.config = config
        self.samples = 0    # events emitted
        self.deferred = 0   # tier samples left to another source (``defer``)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._tid: Optional[int] = None
        self._device = config.device
        self._others: Dict[str, Tuple[float, float]] = {}  # tier -> (last seen, gap before it)
        self._unsubscribe = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "MemorySampler":
        if self._thread is None:
            torch = sys.modules.get("torch")  # not imported yet: CUDA is not initialised either
            if self._device is None and self.config.cuda is not False and torch is not None \
                    and torch.cuda.is_available() and torch.cuda.is_initialized():
                # the CUDA current device is per thread: take the starting thread's (a rank's
                # set_device), never the new thread's default device 0
                self._device = torch.cuda.current_device()
            self._stop.clear()
            if self.config.defer:
                self._unsubscribe = subscribe(self._watch)
            self._thread = threading.Thread(target=self._loop, name=self.THREAD_NAME, daemon=True)
            self._thread.start()
        return self

    def _watch(self, e) -> None:
        # on the emitting thread (the training step): one type test for every other event
        if e.__class__ is MemorySample and e.rank == self.config.rank and threading.get_ident() != self._tid:
            now = time.monotonic()
            prev = self._others.get(e.tier)
            self._others[e.tier] = (now, now - prev[0] if prev else 0.0)

    def _deferred_tiers(self) -> FrozenSet[str]:
        now, hold = time.monotonic(), self.config.defer_s
        return frozenset(t for t, (last, gap) in list(self._others.items())
                         if now - last < max(hold, 3 * gap))

    def _loop(self) -> None:
        import psutil

        self._tid = threading.get_ident()
        c, process = self.config, psutil.Process()
        while not self._stop.is_set():
            if has_subscribers():
                skip = self._deferred_tiers()
                try:
                    samples = _measure(c.rank, self._dirs, c.registered_nvme, self._device, c.cuda, skip, process)
                except (OSError, RuntimeError):  # a named offload dir removed at teardown: stop quietly
                    return
                self.deferred += len(skip)
                for s in samples:
                    emit(s)
                self.samples += len(samples)
            self._stop.wait(c.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._thread is not None:
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=5)
            self._thread = None
        self._others.clear()

    def __enter__(self) -> "MemorySampler":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False


__all__ = ["MemorySampler", "MemorySamplerConfig", "sample_memory", "emit_memory",
           "register_nvme_dir", "unregister_nvme_dir", "registered_nvme_dirs"]
