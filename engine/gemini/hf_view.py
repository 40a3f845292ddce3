"""A Gemini model's tensors for the HF checkpoint code (``checkpoint_io/hf.py``), chunk by chunk.

Built on the chunk manager's own accessors: ``read_state`` (this rank's fp32 master shard of a chunk,
wherever its home is), ``gather_full`` (the whole chunk, a collective) and ``write_state(params=True)``
(a model load). Saving makes one chunk whole at a time, so a rank holds at most one full chunk beyond
its shard. Loading reads, for each tensor, only the flat range of it that falls in this rank's shard of
the chunk (``HFReader.read_flat``: the covering rows, at most a partial row too many at each end).
Buffers are not in chunks: they are read and written whole, from the wrapped module.

Under ``GeminiPlugin(ep_size=k)`` (``gmodel.experts``) a grouped expert weight's chunk holds this EP rank's
rows ``[lo, hi)`` only: it is listed with its whole shape, all-gathered over the EP group after its chunk is
made whole (``ExpertGroups.full``; every rank walks the same chunks and names, so the gathers pair up), and
loaded from the flat range of the whole tensor those rows start at (the rows are contiguous in the file's
row-major layout), so the files are transformers' layout and load at any EP size.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Set, Tuple

import torch

from ..checkpoint_io.hf_files import HFReader
from .zero_model import GeminiModel


class GeminiView:
    def __init__(self, gmodel: GeminiModel):
        self.g = gmodel
        self.hf = gmodel.module
        self.mgr = gmodel.manager
        self.experts = gmodel.experts  # hybrid.experts.ExpertGroups under expert parallelism, else None
        params = {i.name for c in self.mgr.chunks for i in c.infos}
        self.buffers: Dict[str, torch.Tensor] = {
            n: t for n, t in self.hf.state_dict(keep_vars=True).items()
            if n not in params and not isinstance(t, torch.nn.Parameter)}

    def _expert(self, name: str) -> bool:
        return self.experts is not None and name in self.experts.names

    def entries(self) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
        out = [(i.name, self.experts.full_shape(i) if self._expert(i.name) else tuple(i.shape), torch.float32)
               for c in self.mgr.chunks for i in c.infos]
        return out + [(n, tuple(t.shape), t.dtype) for n, t in self.buffers.items()]

    def iter_full(self, keep: Set[str]) -> Iterator[Tuple[str, torch.Tensor]]:
        mgr = self.mgr
        for c in mgr.chunks:
            if not any(i.name in keep for i in c.infos):
                continue  # every rank skips the same chunks: the gathers stay matched
            full = mgr.gather_full(c, mgr.read_state(c)[:c.shard_size].contiguous())
            for i in c.infos:
                if i.name in keep:
                    t = full[i.offset:i.end].view(i.shape)
                    yield i.name, self.experts.full(t) if self._expert(i.name) else t
            del full
        for n, t in self.buffers.items():
            if n in keep:
                yield n, t.detach()

    @torch.no_grad()
    def load(self, reader: HFReader, source: Dict[str, str], done: Set[int]) -> None:
        mgr = self.mgr
        for c in mgr.chunks:
            wanted = [i for i in c.infos if i.name in source]
            if not wanted:
                continue
            state = mgr.read_state(c)
            lo, hi = c.shard_range
            for i in wanted:
                a, b = max(i.offset, lo), min(i.end, hi)
                # an expert slice's rows start this far into the whole grouped weight in the file
                at = self.experts.rows(i)[0] * (i.numel // i.shape[0]) if self._expert(i.name) else 0
                if a < b:  # the part of this tensor in this rank's shard
                    state[a - lo:b - lo].copy_(reader.read_flat(source[i.name], at + a - i.offset,
                                                                at + b - i.offset))
            mgr.write_state(c, state, params=True)
        for n, t in self.buffers.items():
            if n in source:
                t.copy_(reader.read(source[n]).to(dtype=t.dtype))
