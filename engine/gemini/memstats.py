"""Warm-up statistics for the ``auto`` policy: chunk access order and non-model memory.

During the first training step we record the order in which chunks are touched (forward
pre-hooks, then backward pre-hooks) and the bytes autograd saves for backward that are not
chunk memory (activations: the "non-model memory" Colossal-AI's memstats collector measures
per operator). Later steps replay the access order to find, for any chunk, how far away its
next use is — the key for furthest-next-use (Belady) eviction and for prefetching.

Built on ``torch.autograd.graph.saved_tensors_hooks`` (counts what backward keeps alive on
any device) rather than allocator statistics, so the same code measures CPU and CUDA runs.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Optional, Set

import torch


class AccessTrace:
    """The chunk access sequence of one step, and a cursor replaying it."""

    def __init__(self) -> None:
        self.order: List[int] = []
        self.ready = False
        self.cursor = 0
        self.lost = False
        self._pos: Dict[int, List[int]] = {}

    def record(self, cid: int) -> None:
        if self.ready:
            self._advance(cid)
        elif not self.order or self.order[-1] != cid:
            self.order.append(cid)

    def finish_warmup(self) -> None:
        if self.ready or not self.order:
            return
        self.ready = True
        for i, c in enumerate(self.order):
            self._pos.setdefault(c, []).append(i)

    def begin_step(self) -> None:
        self.cursor = 0
        self.lost = False

    def _advance(self, cid: int) -> None:
        if self.lost:
            return
        if self.cursor > 0 and self.order[self.cursor - 1] == cid:
            return  # repeated touch of the current chunk
        pos = self._pos.get(cid, [])
        i = bisect.bisect_left(pos, self.cursor)
        if i == len(pos):
            self.lost = True  # the model ran a different graph; fall back to LRU for this step
            return
        self.cursor = pos[i] + 1

    def next_use(self, cid: int) -> float:
        """Accesses from now until ``cid`` is used again (inf when unknown)."""
        if not self.ready or self.lost:
            return float("inf")
        pos = self._pos.get(cid)
        if not pos:
            return float("inf")
        i = bisect.bisect_left(pos, self.cursor)
        if i < len(pos):
            return pos[i] - self.cursor
        return len(self.order) - self.cursor + pos[0]  # first use in the next step

    def upcoming(self, k: int) -> List[int]:
        """The next ``k`` distinct chunks the step will touch."""
        if not self.ready or self.lost:
            return []
        out: List[int] = []
        for c in self.order[self.cursor:]:
            if c not in out:
                out.append(c)
                if len(out) == k:
                    break
        return out


class NonModelMemory:
    """Bytes of activations saved for backward (non-chunk tensors), peak over the warm-up."""

    def __init__(self, chunk_storages: Optional[Set[int]] = None):
        self.chunk_storages = chunk_storages or set()
        self.current = 0
        self.peak = 0

    def hooks(self):
        def pack(t: torch.Tensor):
            try:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.chunk_storages:
                    self.current += t.untyped_storage().nbytes()
                    self.peak = max(self.peak, self.current)
            except Exception:
                pass
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
