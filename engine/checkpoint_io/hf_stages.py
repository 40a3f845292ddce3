"""A pipelined transformers model as one HF checkpoint: each stage writes its own tensors, reads its own.

A pipeline stage (``engine/models/hf/pipeline.py``) is a copy of the task model holding only its part
under the unsplit model's names (stand-ins have no parameters), so the checkpoint of the whole model is
the union of the stages' tensors. :class:`StagesView` serves ``hf.py``'s loader and :func:`save_stages`
writes: every rank shares what each stage holds (one ``all_gather_object`` of names, shapes and dtypes,
no tensor data), so all ranks compute the same plan of files -- each stage's tensors in its own files
(``size_per_shard`` bounding each), numbered over the whole model, one ``model.safetensors.index.json``
covering every stage. The lowest rank holding a stage (its tp/dp rank 0) writes that stage's files; the
other ranks of its tp group take part in making each tensor whole (``DTensor.full_tensor()``). A tied
weight (the embedding on the first stage, its head copy on the last) is written once, under the name
transformers' ``save_pretrained`` keeps, and loaded into both copies from it. Built on
``ModuleView`` (``hf_layout.py``), ``ShardWriter`` (``hf_files.py``) and ``atomic_dir``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .atomic import atomic_dir
from .hf_files import INDEX, HFReader, ShardWriter, file_names, plan_files, write_index
from .hf_layout import ModuleView, tied_aliases

Entry = Tuple[str, Tuple[int, ...], torch.dtype]


class StagesView:
    """This rank's pipeline stages (``inners``: stage copies with a ``stage_index``) and what every stage of
    the pipeline holds (collective: every rank builds one)."""

    def __init__(self, inners: List[nn.Module]):
        self.hf = inners[0]
        self.views = [(int(m.stage_index), ModuleView(m)) for m in inners]
        mine = [(s, v.entries()) for s, v in self.views]
        gathered = [None] * (dist.get_world_size() if comm.initialized() else 1)
        if comm.initialized():
            comm.all_gather_object(gathered, mine)
        else:
            gathered[0] = mine
        self.owner: Dict[int, int] = {}  # stage -> the rank that writes it (the lowest holding it)
        self.stage_entries: Dict[int, List[Entry]] = {}
        for rank, items in enumerate(gathered):
            for s, entries in items:
                if s not in self.owner:
                    self.owner[s], self.stage_entries[s] = rank, entries
        # each name belongs to the first stage holding it (a persistent buffer every stage copied: once)
        self.home: Dict[str, int] = {}
        for s in sorted(self.stage_entries):
            for n, _, _ in self.stage_entries[s]:
                self.home.setdefault(n, s)
        self._aliases = tied_aliases(self.hf, set(self.home))

    def all_names(self) -> List[str]:
        return list(self.home)

    def aliases(self) -> Dict[str, str]:
        return dict(self._aliases)

    def entries(self) -> List[Entry]:
        """This rank's tensors (its stages', each name once)."""
        seen: Dict[str, Entry] = {}
        for _, v in self.views:
            for e in v.entries():
                seen.setdefault(e[0], e)
        return list(seen.values())

    def check_reads(self, source: Dict[str, str]) -> List[str]:
        return [b for _, v in self.views for b in v.check_reads(source)]

    def load(self, reader: HFReader, source: Dict[str, str], done: Set[int]) -> None:
        for _, v in self.views:
            v.load(reader, source, done)

    def plan(self, size_per_shard: float) -> Tuple[Dict[int, List[List[str]]], Dict[int, List[str]], int, int]:
        """The files of the whole model: ``({stage: its files' names lists}, {stage: its file names},
        total bytes, total parameters)``; the same on every rank."""
        limit = int(size_per_shard * 1024 * 1024)
        per_stage: Dict[int, List[List[str]]] = {}
        total_size = total_params = 0
        for s in sorted(self.stage_entries):
            sizes = []
            for n, shape, dtype in self.stage_entries[s]:
                if self.home[n] != s or n in self._aliases:
                    continue
                numel = 1
                for d in shape:
                    numel *= d
                sizes.append((n, numel * dtype.itemsize))
                total_size, total_params = total_size + numel * dtype.itemsize, total_params + numel
            per_stage[s] = plan_files(sizes, limit) if sizes else []
        names = file_names(sum(len(p) for p in per_stage.values()))
        stage_names, at = {}, 0
        for s, p in per_stage.items():
            stage_names[s], at = names[at:at + len(p)], at + len(p)
        return per_stage, stage_names, total_size, total_params


def save_stages(view: StagesView, path, size_per_shard: float, write_configs) -> Optional[List[str]]:
    """Write the pipelined model as one HF checkpoint directory (collective over the world). Returns the
    files written by the whole pipeline on world rank 0, None elsewhere."""
    per_stage, stage_names, total_size, total_params = view.plan(size_per_shard)
    rank = dist.get_rank() if comm.initialized() else 0
    with atomic_dir(path, collective=True) as tmp:
        for s, v in view.views:
            if not per_stage[s]:
                continue
            keep = {n for file in per_stage[s] for n in file}
            writer = ShardWriter(tmp, per_stage[s], write=view.owner[s] == rank, names=stage_names[s])
            for name, t in v.iter_full(keep):  # every rank of the stage's tp group walks the same names
                writer.add(name, t)
            writer.finish_files()
        if rank == 0:
            plan = [file for s in sorted(per_stage) for file in per_stage[s]]
            names = [n for s in sorted(stage_names) for n in stage_names[s]]
            if len(names) > 1:
                write_index(Path(tmp), plan, names, total_size, total_params)
                names = names + [INDEX]
            return names + write_configs(view.hf, Path(tmp))
    return None
