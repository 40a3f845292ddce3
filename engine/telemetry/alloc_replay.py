"""Live CPU tensor bytes, replayed from the PyTorch profiler's allocation events.

``torch.profiler.profile(profile_memory=True)`` records every allocation and free of PyTorch's
CPU allocator with its size and the allocator's live total. Replaying them in time order gives
the live bytes at any moment; marks cut that stream into windows. A mark is a block allocated and
freed at once whose byte count no tensor of the measured work has (``mark_base + k`` for the k-th
mark: ``torch.empty(mark_base + k, dtype=torch.uint8)``), so it is found again among the events.

Two ways to count what is live (``live=``):

* ``"running"``: the sum of the events' sizes since the profiler started: what the threads the
  profiler follows allocated and did not free;
* ``"total"``: the total each event carries, less its value at the first mark (what was live
  then). With c10's process-wide counter on (``FLAGS_caffe2_report_cpu_memory_usage``) that total
  holds every thread's blocks, so a block another thread frees or allocates is in it.

The planner's meter (``engine/planner/memory/meter.py``) and activation checkpointing's profile
(``engine/autockpt/``) both read their peaks from :func:`replay`. Only torch is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, NamedTuple


class Allocation(NamedTuple):
    time_ns: int
    size: int        # bytes; negative for a free
    total: int       # the allocator's live total after this event


@dataclass
class Replay:
    """Live bytes at each mark, the peak from each mark to the next (the last: to the end), and
    the live bytes after the last event."""

    live: List[int] = field(default_factory=list)
    peak_after: List[int] = field(default_factory=list)
    final: int = 0


def cpu_allocations(prof) -> List[Allocation]:
    """The CPU allocation events of a finished ``torch.profiler.profile``, in time order; at one
    instant allocations before frees (so a peak is never under-counted), then by size."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == "cpu":
                events.append(Allocation(e.start_time_ns, f.alloc_size, f.total_allocated))
        else:
            stack.extend(e.children)
    events.sort(key=lambda a: (a.time_ns, a.size < 0, a.size))
    return events


def replay(events: List[Allocation], mark_base: int, marks: int, live: str = "running") -> Replay:
    """Walk ``events`` (:func:`cpu_allocations`) with marks ``mark_base + 1 .. mark_base + marks``;
    the marks' own bytes are never counted. ``live`` is ``"running"`` or ``"total"`` (above)."""
    if live not in ("running", "total"):
        raise ValueError(f"replay(live={live!r}): choose 'running' or 'total'")
    out = Replay()
    now, peak, origin = 0, None, None
    for ev in events:
        is_mark = mark_base < abs(ev.size) <= mark_base + marks
        if is_mark and ev.size > 0:  # a window starts: from what is live now
            if origin is None:
                origin = ev.total - ev.size
            if live == "total":
                now = ev.total - ev.size - origin
            if peak is not None:
                out.peak_after.append(peak)
            out.live.append(now)
            peak = now
            continue
        if live == "running":
            if not is_mark:
                now += ev.size
        elif origin is None:
            continue  # before the first mark: its total is the origin
        else:
            now = ev.total - origin
        if peak is not None:
            peak = max(peak, now)
        out.final = now
    if peak is not None:
        out.peak_after.append(peak)
    return out
