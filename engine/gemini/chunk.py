"""A chunk: parameters packed into one flat, fixed-size buffer, plus per-tensor states.

Every parameter is a view into ``chunk.full``, whose storage is resized to 0 bytes when released
and back when gathered (FSDP2's trick), so nothing is re-bound between forward and backward.
Why chunks, and the version-counter rule: docs/gemini.md, ``chunk.py`` row.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn


class TensorState(str, enum.Enum):
    """What a parameter inside a chunk is doing right now (drives gather/release)."""

    FREE = "free"                          # payload not gathered on this rank
    COMPUTE = "compute"                    # its module is running (forward or backward)
    HOLD = "hold"                          # gathered, not in use
    HOLD_AFTER_BWD = "hold_after_bwd"      # frozen parameter whose module ran backward
    READY_FOR_REDUCE = "ready_for_reduce"  # gradient copied into the chunk, awaiting reduce


@dataclass
class TensorInfo:
    name: str
    param: nn.Parameter
    offset: int            # element offset in the full chunk
    numel: int
    shape: torch.Size
    group: int = 0         # index of its optimizer param group
    state: TensorState = TensorState.FREE

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass
class Chunk:
    """Flat buffer of ``size`` elements (padded so ``size % world == 0`` when sharded)."""

    id: int
    size: int
    dtype: torch.dtype
    world: int
    rank: int
    sharded: bool
    infos: List[TensorInfo] = field(default_factory=list)
    full: Optional[torch.Tensor] = None          # compute-tier buffer; storage 0 bytes when released
    shard: Optional[torch.Tensor] = None         # this rank's payload when resident in RAM/device
    param_home: str = "cpu"                      # tier name holding the authoritative shard
    optim_home: str = "cpu"                      # tier name holding master/exp_avg/exp_avg_sq/grad
    gathered: bool = False
    grad_full: Optional[torch.Tensor] = None     # fp32 gradient of the full chunk (backward only)
    grads_pending: int = 0                       # trainable params whose grad has not arrived
    reduced: bool = False
    frozen: bool = False                         # every parameter frozen at packing: no moments, no grads
    group: Optional[Any] = None                  # its process group of ``world`` ranks; None: the manager's

    # ---- geometry --------------------------------------------------------------------------
    @property
    def shard_size(self) -> int:
        return self.size // self.world if self.sharded else self.size

    @property
    def shard_range(self) -> Tuple[int, int]:
        if not self.sharded:
            return 0, self.size
        return self.rank * self.shard_size, (self.rank + 1) * self.shard_size

    @property
    def elem_bytes(self) -> int:
        # dtype.itemsize, not torch.empty(...).element_size(): no tensor built per read, and the
        # byte accounting (full_bytes/shard_bytes) reads this many times per step and once per
        # ChunkEvent (itemsize: torch >= 2.1)
        return self.dtype.itemsize

    @property
    def full_bytes(self) -> int:
        return self.size * self.elem_bytes

    @property
    def shard_bytes(self) -> int:
        return self.shard_size * self.elem_bytes

    @property
    def aliased(self) -> bool:
        """True when ``full`` is the shard itself (unsharded chunk resident in the compute tier)."""
        return self.full is not None and self.shard is not None and self.full.data_ptr() == self.shard.data_ptr() \
            and self.full.untyped_storage().nbytes() > 0

    @property
    def state_rows(self) -> int:
        """Rows of this chunk's fp32 state block: ``master|exp_avg|exp_avg_sq``, or only the master
        for a frozen chunk (a LoRA base model: no optimizer state for weights that never step)."""
        return 1 if self.frozen else 3

    @property
    def trainable(self) -> List[TensorInfo]:
        """Parameters that get gradients: none in a frozen chunk (``requires_grad`` is read when
        chunks are packed: at boost and at the execution-order re-pack)."""
        return [] if self.frozen else [i for i in self.infos if i.param.requires_grad]

    def names(self) -> Tuple[str, ...]:
        return tuple(i.name for i in self.infos)

    def segments(self) -> List[Tuple[TensorInfo, int, int]]:
        """``(info, lo, hi)`` in shard-local coordinates for each tensor overlapping this shard."""
        s0, s1 = self.shard_range
        out = []
        for info in self.infos:
            lo, hi = max(info.offset, s0), min(info.end, s1)
            if lo < hi:
                out.append((info, lo - s0, hi - s0))
        return out

    # ---- states -----------------------------------------------------------------------------
    def set_state(self, state: TensorState, infos=None) -> None:
        for i in (self.infos if infos is None else infos):
            i.state = state

    @property
    def in_use(self) -> bool:
        """Pinned in the compute tier: some tensor is computing or backward is not done with it."""
        return any(i.state in (TensorState.COMPUTE, TensorState.HOLD_AFTER_BWD) for i in self.infos) \
            or self.grad_full is not None

    def state_summary(self) -> str:
        """The chunk's state for telemetry: the 'busiest' tensor state inside it."""
        if not self.gathered:
            return TensorState.FREE.value
        order = [TensorState.COMPUTE, TensorState.READY_FOR_REDUCE, TensorState.HOLD_AFTER_BWD, TensorState.HOLD]
        present = {i.state for i in self.infos}
        for s in order:
            if s in present:
                return s.value
        return TensorState.HOLD.value


def search_chunk_size(numels: List[int], world: int, max_candidates: int = 64,
                      max_size: int = 32 << 20) -> int:
    """Chunk size (elements) that wastes the least padding when packing ``numels`` in order.

    A parameter never straddles chunks, so the size is at least the largest parameter. We scan
    sizes from the largest parameter up to ``max(largest, max_size)`` elements and keep the one
    with the least padding (ties -> smaller, which keeps the compute-tier working set small).
    """
    if not numels:
        raise ValueError("Gemini: the model has no parameters to place in chunks")
    lo = max(numels)
    hi = max(lo, min(max_size, sum(numels)))
    best, best_waste = None, None
    for k in range(max_candidates + 1):
        size = lo + (hi - lo) * k // max_candidates
        size = -(-size // world) * world
        waste = _waste(numels, size)
        if best_waste is None or waste < best_waste:
            best, best_waste = size, waste
    return best


def _waste(numels: List[int], size: int) -> int:
    waste, cur = 0, 0
    for n in numels:
        if cur + n > size:
            waste += size - cur
            cur = 0
        cur += n
    return waste + (size - cur)


@dataclass(frozen=True)
class ApartLayout:
    """Parameters packed into chunks of their own, over another process group: under expert
    parallelism the expert slices (``ids``), whose chunks are sharded and reduced over the expert-dp
    group (``world`` ranks holding the same experts; this rank is ``rank`` of them)."""

    ids: frozenset
    world: int
    rank: int
    group: Any


def pack_chunks(tensors: List[TensorInfo], size: int, dtype: torch.dtype, world: int, rank: int,
                shard_frac: float, apart: Optional[ApartLayout] = None) -> List[Chunk]:
    """``tensors`` in this order in chunks of ``size`` elements (a tensor never straddles two; each
    gets a fresh ``TensorInfo`` at its offset); the first ``shard_frac`` of the chunks sharded.

    Trainable and frozen parameters never share a chunk: each kind fills its own open chunk, so a
    frozen chunk gets no gradient buffer and no optimizer moments (a model with one kind packs as
    if there were no rule). The parameters of ``apart`` are a kind of their own too, and their
    chunks take its world, rank and group (``size`` divisible by ``world`` is then divisible by
    ``apart.world``, a divisor of it)."""
    groups: List[List[TensorInfo]] = []
    frozen: List[bool] = []
    kinds: List[Tuple[bool, bool]] = []
    open_: dict = {}  # kind (requires_grad, apart) -> [index in groups, elements filled]
    ids = apart.ids if apart is not None else frozenset()
    for t in tensors:
        trains = bool(getattr(t.param, "requires_grad", True))
        kind = (trains, id(t.param) in ids)
        gi, cur = open_.get(kind, (-1, 0))
        if gi < 0 or (cur + t.numel > size and groups[gi]):
            groups.append([])
            frozen.append(not trains)
            kinds.append(kind)
            gi, cur = len(groups) - 1, 0
        groups[gi].append(replace(t, offset=cur, state=TensorState.FREE))
        open_[kind] = (gi, cur + t.numel)
    if not groups:
        groups, frozen, kinds = [[]], [False], [(True, False)]
    n_shard = int(round(shard_frac * len(groups)))
    out = []
    for cid, infos in enumerate(groups):
        w, r, g = (apart.world, apart.rank, apart.group) if kinds[cid][1] else (world, rank, None)
        out.append(Chunk(id=cid, size=size, dtype=dtype, world=w, rank=r, sharded=w > 1 and cid < n_shard,
                         infos=infos, frozen=frozen[cid], group=g))
    return out
