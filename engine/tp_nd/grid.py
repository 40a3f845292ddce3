"""The grid of an N-d tensor-parallel group: its axes, this rank's coordinates, the process groups.

Built on torch: the groups are ``torch.distributed.new_subgroups_by_enumeration`` over the ranks of
the plugin's ``DeviceMesh`` tensor-parallel sub-mesh (every tp group of the world at once, so all
ranks create the same groups in the same order). By hand: how a tp group of ``tp_size`` ranks is cut
into axes, the factorisation check (a ``ValueError`` naming sizes that work, before any group is
made), the two activation *layouts* of each mode, and the block layout of parameters (which slice
of a full tensor each rank holds, so checkpoints gather back to full tensors).

Axes (a tp rank ``t`` of its group has coordinates by mixed radix, the first axis outermost):

* ``"2d"`` (SUMMA, Optimus): ``tp = q*q``; axes ``dep`` (size 1), ``row`` and ``col`` (size ``q``).
* ``"2.5d"`` (Tesseract): ``tp = q*q*d``; axes ``dep`` (``d``), ``row``, ``col`` (``q``): ``d``
  layers of the 2D grid, each on its own part of the batch.
* ``"3d"``: ``tp = q**3``; axes ``x``, ``y``, ``z`` (``q`` each).

An activation ``(B, S, h)`` is held by a rank as ``(B / nb, S, h / q)``: the batch cut by the
layout's *batch axes* (``nb`` pieces, the batch index a mixed radix over them) and the hidden
dimension by its *hidden axis*. 2D/2.5D have one layout (hidden ``col``, batch ``dep, row``); 3D has
two, ``stream`` (hidden ``y``, batch ``x, z``: the residual stream, norms, embeddings) and ``inner``
(hidden ``z``, batch ``x, y``: between a column-parallel and a row-parallel linear, where
attention runs, and the logits). Layouts and formulas: docs/hybrid.md, "N-dimensional tensor
parallelism".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import comm

MODES = ("1d", "2d", "2.5d", "3d")
AXES = {"2d": ("dep", "row", "col"), "2.5d": ("dep", "row", "col"), "3d": ("x", "y", "z")}

#: a parameter's block layout: per tensor dimension, the grid axes (outermost first) that cut it
Spec = Tuple[Tuple[str, ...], ...]


@dataclass(frozen=True)
class Layout:
    """How an activation ``(B, ..., h)`` is cut: ``hidden`` cuts its last dimension, ``batch``
    (outermost first) its first."""

    hidden: str
    batch: Tuple[str, ...]


def _iroot(n: int, k: int) -> Optional[int]:
    r = round(n ** (1.0 / k))
    for c in (r - 1, r, r + 1):
        if c >= 1 and c ** k == n:
            return c
    return None


def factor(mode: str, tp_size: int, depth: int = 1) -> Dict[str, int]:
    """The axis sizes of ``mode`` at ``tp_size`` ranks, or a ``ValueError`` naming the sizes that
    would work. ``depth`` is 2.5D's ``d`` (``tp_depth``); the other modes take ``depth=1``."""
    if mode not in MODES:
        raise ValueError(f"HybridParallelPlugin(tp_mode={mode!r}): choose one of {MODES}")
    if not (isinstance(depth, int) and depth >= 1):
        raise ValueError(f"HybridParallelPlugin(tp_depth={depth!r}): must be an int >= 1")
    if mode != "2.5d" and depth != 1:
        raise ValueError(f"HybridParallelPlugin(tp_mode={mode!r}, tp_depth={depth}): tp_depth is 2.5D's d; "
                         "use tp_mode='2.5d' or leave tp_depth=1")
    if mode == "1d":
        return {"tp": tp_size}
    if mode == "2d":
        q = _iroot(tp_size, 2)
        if q is None:
            ok = [n * n for n in range(1, 6)]
            raise ValueError(f"HybridParallelPlugin(tp_mode='2d', tp_size={tp_size}): 2D tensor parallelism runs "
                             f"on a q x q grid, so tp_size must be a square q**2; use tp_size in {ok}")
        return {"dep": 1, "row": q, "col": q}
    if mode == "2.5d":
        q = _iroot(tp_size // depth, 2) if tp_size % depth == 0 else None
        if q is None:
            ok = [n * n * depth for n in range(1, 5)]
            depths = [d for d in range(1, tp_size + 1) if tp_size % d == 0 and _iroot(tp_size // d, 2)]
            raise ValueError(f"HybridParallelPlugin(tp_mode='2.5d', tp_size={tp_size}, tp_depth={depth}): 2.5D runs "
                             f"on a q x q x d grid, so tp_size must be q**2 * d; with tp_depth={depth} use tp_size in "
                             f"{ok}, or with tp_size={tp_size} use tp_depth in {depths}")
        return {"dep": depth, "row": q, "col": q}
    q = _iroot(tp_size, 3)
    if q is None:
        ok = [n ** 3 for n in range(1, 5)]
        raise ValueError(f"HybridParallelPlugin(tp_mode='3d', tp_size={tp_size}): 3D tensor parallelism runs on "
                         f"a q x q x q grid, so tp_size must be a cube q**3; use tp_size in {ok}")
    return {"x": q, "y": q, "z": q}


def layouts(mode: str) -> Tuple[Layout, Layout]:
    """``(stream, inner)``: the layout of the residual stream (embedding and norm outputs, a
    column-parallel linear's input) and of what a column-parallel linear makes (attention, a
    row-parallel linear's input, the logits)."""
    if mode == "3d":
        return Layout("y", ("x", "z")), Layout("z", ("x", "y"))
    lay = Layout("col", ("dep", "row"))
    return lay, lay


def needed_groups(mode: str) -> List[Tuple[str, ...]]:
    """The axis combinations a mode communicates over (each in grid order)."""
    if mode == "3d":
        return [("x",), ("y",), ("z",), ("x", "z"), ("x", "y"), ("x", "y", "z")]
    return [("col",), ("row",), ("dep",), ("dep", "row"), ("dep", "row", "col")]


@dataclass
class Group:
    """One process group of the grid: ``ranks`` (global, ascending = group-rank order = the
    mixed radix of its axes), this rank's ``rank`` in it, its ``size``. ``pg`` is None for a
    group of one (nothing to communicate)."""

    axes: Tuple[str, ...]
    pg: object
    ranks: Tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)


class Grid:
    """This rank's place in its tp group's grid, and the groups of every axis combination the
    mode needs. ``tp_groups``: the global ranks of every tp group of the world (each ascending,
    a tp group's ``t``-th rank having tp coordinate ``t``); every rank must build its Grid with the
    same list, at the same time (it creates process groups)."""

    def __init__(self, mode: str, sizes: Dict[str, int], tp_groups: Sequence[Sequence[int]], rank: int):
        if mode not in AXES:
            raise ValueError(f"Grid: mode={mode!r} is not an N-d mode ({tuple(AXES)})")
        self.mode = mode
        self.axes = AXES[mode]
        self.sizes = {a: sizes[a] for a in self.axes}
        self.tp_size = math.prod(self.sizes.values())
        self.stream, self.inner = layouts(mode)
        mine = [list(g) for g in tp_groups if rank in g]
        if len(mine) != 1 or any(len(g) != self.tp_size for g in tp_groups):
            raise ValueError(f"Grid: rank {rank} must be in exactly one tp group of {self.tp_size} ranks")
        self.tp_ranks = mine[0]
        self.tp_rank = self.tp_ranks.index(rank)
        self.coords = self.coords_of(self.tp_rank)
        self.groups: Dict[Tuple[str, ...], Group] = {}
        for axes in needed_groups(mode):
            self.groups[axes] = self._make(axes, tp_groups, rank)

    # ---- coordinates ------------------------------------------------------------------------
    def coords_of(self, t: int) -> Dict[str, int]:
        out = {}
        for a in reversed(self.axes):
            t, out[a] = divmod(t, self.sizes[a])
        return out

    def size(self, axes: Sequence[str]) -> int:
        return math.prod(self.sizes[a] for a in axes)

    def index(self, axes: Sequence[str], coords: Optional[Dict[str, int]] = None) -> int:
        """The mixed radix of ``coords`` (this rank's by default) over ``axes``, outermost first."""
        c = self.coords if coords is None else coords
        i = 0
        for a in axes:
            i = i * self.sizes[a] + c[a]
        return i

    @property
    def q(self) -> int:
        return self.sizes["y" if self.mode == "3d" else "row"]

    @property
    def depth(self) -> int:
        return self.sizes.get("dep", 1)

    @property
    def batch_shards(self) -> int:
        """How many pieces a batch is cut into (``nb``: 2D ``q``, 2.5D ``d*q``, 3D ``q**2``)."""
        return self.size(self.stream.batch)

    def group(self, axes: Sequence[str]) -> Group:
        return self.groups[tuple(a for a in self.axes if a in axes)]

    @property
    def tp_group(self) -> Group:
        return self.groups[self.axes]

    def _make(self, axes: Tuple[str, ...], tp_groups, rank: int) -> Group:
        others = [a for a in self.axes if a not in axes]
        lists: Dict[tuple, List[int]] = {}
        for g in tp_groups:
            for t, r in enumerate(g):
                c = self.coords_of(t)
                lists.setdefault((tuple(g), tuple(c[a] for a in others)), []).append(r)
        ranks = [sorted(v) for v in lists.values()]
        mine = next(v for v in ranks if rank in v)
        pg = None
        if len(mine) > 1:
            pg, _ = dist.new_subgroups_by_enumeration(ranks)
        return Group(axes, pg, tuple(mine), mine.index(rank))

    # ---- activations ------------------------------------------------------------------------
    def batch_piece(self, x: torch.Tensor, layout: Layout, what: str = "batch") -> torch.Tensor:
        """This rank's piece of a whole-batch tensor (dim 0) under ``layout``."""
        n = self.size(layout.batch)
        B = x.shape[0]
        if B % n:
            raise ValueError(f"tp_mode={self.mode!r}: the {what} has {B} rows, which do not split into the "
                             f"{n} batch shards of this grid ({'x'.join(str(self.sizes[a]) for a in self.axes)}); "
                             f"use a batch size that is a multiple of {n}")
        b = B // n
        return x.narrow(0, self.index(layout.batch) * b, b)

    # ---- parameter blocks ------------------------------------------------------------------
    def block(self, full: torch.Tensor, spec: Spec) -> torch.Tensor:
        """This rank's block of ``full`` under ``spec`` (a view)."""
        out = full
        for dim, axes in enumerate(spec):
            if axes:
                n = self.size(axes)
                c = full.shape[dim] // n
                out = out.narrow(dim, self.index(axes) * c, c)
        return out

    def full(self, block: torch.Tensor, spec: Spec) -> torch.Tensor:
        """The whole tensor from every tp rank's ``block`` (a collective over the tp group; no
        autograd). Ranks that hold the same block (an axis the spec does not use) agree on it."""
        g = self.tp_group
        shape = [s * (self.size(axes) if axes else 1) for s, axes in zip(block.shape, spec)]
        if g.pg is None:
            return block.detach().clone().reshape(shape)
        parts = [torch.empty_like(block) for _ in range(g.size)]
        comm.all_gather(parts, block.detach().contiguous(), group=g.pg)
        out = block.new_empty(shape)
        for t, part in enumerate(parts):
            c = self.coords_of(t)
            view = out
            for dim, axes in enumerate(spec):
                if axes:
                    n = block.shape[dim]
                    view = view.narrow(dim, self.index(axes, c) * n, n)
            view.copy_(part)
        return out

    def describe(self) -> str:
        return f"{self.mode} grid " + " x ".join(f"{a}={self.sizes[a]}" for a in self.axes)


def check_spec(name: str, shape: Sequence[int], spec: Spec, sizes: Dict[str, int], mode: str, tp_size: int) -> None:
    """``ValueError`` when ``shape`` does not cut evenly under ``spec`` (before any group exists)."""
    for dim, axes in enumerate(spec):
        n = math.prod(sizes[a] for a in axes) if axes else 1
        if shape[dim] % n:
            raise ValueError(f"HybridParallelPlugin(tp_mode={mode!r}, tp_size={tp_size}): {name} has size "
                             f"{shape[dim]} in dimension {dim}, which must be cut into {n} equal blocks "
                             f"({'*'.join(axes)} of the grid); use a size that is a multiple of {n}, or a tp_size "
                             f"whose grid divides it")
