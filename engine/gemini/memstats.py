"""Warm-up statistics for the ``auto`` policy: chunk access order and non-model memory.

The first training step records the order chunks are touched and, at each touch, the bytes
autograd holds for backward outside chunks (counted through ``saved_tensors_hooks``, so CPU and
CUDA alike); later steps replay the order for furthest-next-use eviction, prefetch and
``nonmodel_ahead``. See docs/gemini.md, ``memstats.py`` row.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Optional, Set

import torch


class AccessTrace:
    """The chunk access sequence of one step, and a cursor replaying it."""

    def __init__(self) -> None:
        self.order: List[int] = []
        self.nonmodel_at: List[int] = []     # non-model bytes live at each access (warm-up)
        self._ahead: List[int] = []          # max of nonmodel_at from each position to the end
        self.ready = False
        self.cursor = 0
        self.lost = False
        self._pos: Dict[int, List[int]] = {}

    def record(self, cid: int, nonmodel_bytes: int = 0) -> None:
        if self.ready:
            self._advance(cid)
        elif not self.order or self.order[-1] != cid:
            self.order.append(cid)
            self.nonmodel_at.append(nonmodel_bytes)
        else:
            self.nonmodel_at[-1] = max(self.nonmodel_at[-1], nonmodel_bytes)

    def finish_warmup(self) -> None:
        if self.ready or not self.order:
            return
        self.ready = True
        for i, c in enumerate(self.order):
            self._pos.setdefault(c, []).append(i)
        self._ahead = list(self.nonmodel_at)
        for i in range(len(self._ahead) - 2, -1, -1):
            self._ahead[i] = max(self._ahead[i], self._ahead[i + 1])

    def nonmodel_ahead(self, default: int) -> int:
        """Most non-model bytes live from the current access to the end of the step (``default``
        when the step left the warm-up's graph or no per-access figures were recorded)."""
        if not self.ready or self.lost or len(self._ahead) != len(self.order):
            return default
        i = max(0, self.cursor - 1)  # the access in progress still needs its activations
        return self._ahead[i] if i < len(self._ahead) else 0

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


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage that survives ``resize_``: a chunk buffer is released by
    resizing its storage to 0 bytes and re-allocated on gather, so its ``data_ptr`` changes
    with every gather while the storage object stays the same."""
    return t.untyped_storage()._cdata


class NonModelMemory:
    """Bytes of activations saved for backward (non-chunk tensors), peak over the warm-up.

    ``chunk_storages`` holds the chunk buffers' ``storage_key``s: parameters autograd saves are
    views of those and are model memory, whether the chunk is resident or gathered on demand.
    """

    def __init__(self, chunk_storages: Optional[Set[int]] = None):
        self.chunk_storages = chunk_storages or set()
        self.current = 0
        self.peak = 0
        self._live: Dict[int, List[int]] = {}  # storage ptr -> [bytes, saved references not yet unpacked]

    def hooks(self):
        def pack(t: torch.Tensor):
            try:
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if st._cdata not in self.chunk_storages:
                    ent = self._live.get(ptr)
                    if ent is None:  # a storage saved by several nodes is counted once
                        self._live[ptr] = [st.nbytes(), 1]
                        self.current += st.nbytes()
                        self.peak = max(self.peak, self.current)
                    else:
                        ent[1] += 1
                    return (t, ptr)
            except Exception:
                pass
            return (t, None)

        def unpack(packed):
            t, ptr = packed
            ent = self._live.get(ptr) if ptr is not None else None
            if ent is not None:
                ent[1] -= 1
                if ent[1] == 0:  # its last saving node is running backward: freed right after
                    del self._live[ptr]
                    self.current -= ent[0]
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
