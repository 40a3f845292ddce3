"""``measure``: the peak bytes a run really holds, per tier, on this process — what ``cl.plan``'s
predictions are checked against (``bench/plan.py``, ``tests/planner/test_memory.py``).

The CPU peak is the live tensor bytes of PyTorch's CPU allocator, from the profiler's allocation
events (``profile_memory=True``) replayed with c10's process-wide counter (``engine/telemetry/
alloc_replay.py``), not RSS, which holds allocator slack and libraries; CUDA's is
``max_memory_allocated``; NVMe's the most bytes the offload directory's files held, sampled.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Dict, Optional

import torch

_MARK = 7_999_993  # odd byte counts no tensor of ours has: a mark in the allocator's event stream


def _count_every_thread() -> None:
    """Turn on c10's process-wide CPU allocation counter (``FLAGS_caffe2_report_cpu_memory_usage``,
    an exported flag of ``libc10``). With it, ``ProfiledCPUMemoryReporter`` keeps one table and one
    running total of live CPU blocks for *every* thread — gloo's and Gemini's IO workers included —
    and the profiler's allocation events carry that total. It stays on for the process (turning it
    off would leave the table with blocks it can no longer uncount); its per-block log line is at
    INFO level, below c10's default WARNING."""
    import ctypes

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


class measure:
    """Peak bytes a run really holds, per tier, on this process.

        with measure(nvme_dir=d) as meter:
            model, optim, *_ = booster.boost(model, optim)
            meter.start_window()            # optional: peaks from here on (e.g. after boost)
            train()
        meter.peak                           # {"cpu": bytes, "nvme": bytes} (and "cuda" on a GPU)

    * ``cpu``: the peak of live tensor bytes held through PyTorch's CPU allocator, counted from the
      ``with`` (what was live before is not counted). ``torch.profiler.profile(profile_memory=True)``
      records this thread's allocations and frees; with c10's process-wide counter on
      (:func:`_count_every_thread`) each event carries the live total of every thread, so a block
      another thread frees (gloo's worker dropping a collective's buffer) or allocates is in it.
      Not RSS (allocator slack, the Python heap, libraries). Between two events of this thread a
      short-lived block of another thread can be missed.
    * ``cuda``: ``torch.cuda.max_memory_allocated`` over the window.
    * ``nvme``: the most bytes of files this process's offload directory held (Gemini's
      ``gemini-<pid>-*`` under ``nvme_dir``), sampled every ``interval`` seconds on a thread.

    ``samples(rank)`` gives the peaks as ``MemorySample`` events (``used = peak = bytes``) for the
    dashboard's FitPlan overlay.
    """

    def __init__(self, nvme_dir: Optional[str] = None, interval: float = 0.002):
        self.nvme_dir, self.interval = nvme_dir, interval
        self.peak: Dict[str, int] = {}
        self.final = 0
        self._marks = 0
        self._nvme_peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "measure":
        from torch.profiler import ProfilerActivity, profile

        _count_every_thread()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        self._mark()  # the baseline: the live total when the with began
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if self.nvme_dir is not None:
            self._thread = threading.Thread(target=self._sample_nvme, name="plan-measure-nvme", daemon=True)
            self._thread.start()
        return self

    def _mark(self) -> None:
        self._marks += 1
        torch.empty(_MARK + self._marks, dtype=torch.uint8)  # freed at once: a mark in the event stream

    def start_window(self) -> None:
        """Peaks count from here (what was allocated since the ``with`` began still counts as live)."""
        self._mark()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._nvme_peak = self._nvme_now()

    def _nvme_now(self) -> int:
        root, pid = self.nvme_dir, f"gemini-{os.getpid()}-"
        try:
            mine = [os.path.join(root, d) for d in os.listdir(root) if d.startswith(pid)]
        except FileNotFoundError:
            return 0
        total = 0
        for d in mine:
            for base, _, files in os.walk(d):
                for f in files:
                    try:
                        total += os.stat(os.path.join(base, f)).st_size
                    except FileNotFoundError:  # removed while we walk
                        pass
        return total

    def _sample_nvme(self) -> None:
        while not self._stop.is_set():
            self._nvme_peak = max(self._nvme_peak, self._nvme_now())
            self._stop.wait(self.interval)

    def __exit__(self, *exc) -> bool:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._nvme_peak = max(self._nvme_peak, self._nvme_now())
            self.peak["nvme"] = self._nvme_peak
        self._prof.__exit__(*exc)
        if torch.cuda.is_available():
            self.peak["cuda"] = int(torch.cuda.max_memory_allocated())
        self.peak["cpu"] = self._replay()
        return False

    def _replay(self) -> int:
        from ...telemetry.alloc_replay import cpu_allocations, replay

        r = replay(cpu_allocations(self._prof), _MARK, self._marks, live="total")
        self.final = r.final
        return int(r.peak_after[-1]) if r.peak_after else 0

    def samples(self, rank: int = 0) -> list:
        """The peaks as telemetry ``MemorySample`` events (``used`` and ``peak`` = the peak)."""
        from ...telemetry import MemorySample

        now = time.time()
        return [MemorySample(rank=rank, time=now, tier=t, used=int(v), capacity=0, peak=int(v))
                for t, v in self.peak.items()]
