"""The view of a transformers model under 2D / 2.5D / 3D tensor parallelism, for the HF checkpoint code.

Under ``tp_mode="2d" | "2.5d" | "3d"`` each converted parameter is a plain tensor holding this rank's
block of the full one (``engine/tp_nd``): its grid ``Spec`` names, per dimension, the grid axes that cut
it, and a packed output (GPT-2's q | k | v) is reordered before the cut. The ``NdParallel`` object the
plugin keeps (``model.nd``) knows both, under the unsplit model's names. This view is
:class:`~.hf_layout.ModuleView` with those blocks made whole for a save (``NdParallel.full``: one
all-gather over the tp group, every rank walking the tensors in one order) and read back as boxes of
index runs for a load, so each rank reads from the safetensors files only the bytes of its own block.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Set, Tuple

import torch

from .hf_files import HFReader, Runs
from .hf_layout import ModuleView, _runs


class NdView(ModuleView):
    """The tensors of ``hf`` converted in place to N-d blocks, ``nd`` the plugin's ``NdParallel``."""

    def __init__(self, hf, nd):
        super().__init__(hf)
        self.nd = nd
        self.blocked = {n for n in self.tensors if n in nd.params}

    def entries(self) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
        return [(n, tuple(self.nd.full_shape(n)) if n in self.blocked else tuple(t.shape), t.dtype)
                for n, t in self.tensors.items()]

    def iter_full(self, keep: Set[str]) -> Iterator[Tuple[str, torch.Tensor]]:
        for n, t in self.tensors.items():
            if n in keep:  # every rank walks the same names: full() is a collective over the tp group
                yield n, (self.nd.full(n, t.detach()) if n in self.blocked else t.detach())

    def _indices(self, name: str) -> List[torch.Tensor]:
        """Per dimension, the full tensor's indices of this rank's block, in the block's order."""
        entry, grid = self.nd.params[name], self.nd.grid
        spec, shape = entry[0], entry[1]
        idx = [torch.arange(s) for s in shape]
        if len(entry) > 2:  # a packed output: the block is cut from the reordered features
            dim, order = entry[2]
            idx[dim] = order.cpu()
        for d, axes in enumerate(spec):
            if axes:
                c = shape[d] // grid.size(axes)
                idx[d] = idx[d][grid.index(axes) * c:(grid.index(axes) + 1) * c]
        return idx

    def _box(self, name: str) -> Tuple[List[Runs], List[torch.Tensor]]:
        """The runs to read (each dimension's indices sorted) and, per dimension, where each of the
        block's indices sits among the sorted ones (identity unless a packed order interleaves)."""
        idx = self._indices(name)
        sort = [i.sort() for i in idx]
        return [_runs(s.values) for s in sort], [torch.argsort(s.indices) for s in sort]

    def check_reads(self, source: Dict[str, str]) -> List[str]:
        bad = super().check_reads({n: s for n, s in source.items() if n not in self.blocked})
        for n in self.blocked & set(source):
            want = tuple(len(i) for i in self._indices(n))
            if want != tuple(self.tensors[n].shape):
                bad.append(f"{n}: this rank's block has shape {tuple(self.tensors[n].shape)}, its grid spec "
                           f"{self.nd.params[n][0]} gives a slice of shape {want}")
        return bad

    @torch.no_grad()
    def load(self, reader: HFReader, source: Dict[str, str], done: Set[int]) -> None:
        for n in self.blocked:
            t = self.tensors[n]
            if n not in source or id(t) in done:
                continue
            done.add(id(t))
            runs, where = self._box(n)
            data = reader.read_runs(source[n], runs)
            for d, pos in enumerate(where):  # back into the block's own order (a packed output's parts)
                if not torch.equal(pos, torch.arange(len(pos))):
                    data = data.index_select(d, pos)
            if tuple(data.shape) != tuple(t.shape):  # check_reads ruled this out on every rank first
                raise RuntimeError(f"load_model: {n!r}: this rank's block has shape {tuple(t.shape)} but "
                                   f"{tuple(data.shape)} was read for it")
            t.copy_(data.to(dtype=t.dtype))
        super().load(reader, {n: s for n, s in source.items() if n not in self.blocked}, done)
