"""The fake world an N-d tensor-parallel rank is traced in.

A rank of a 2D / 2.5D / 3D layout runs the grid-form layers of ``engine/tp_nd`` (SUMMA, Tesseract,
3D) on its parameter blocks and its rows; their broadcasts, reduces and gathers go to torch's
``fake`` process group (``torch.testing._internal.distributed.fake_pg``: collectives that move
nothing), so the blocks a rank receives and the logits it gathers are in the trace. One process
holds one default group, so this needs a process without one (the notebook, a planner); elsewhere
:class:`_NoFakeWorld` is raised and the planner falls back to 1D over the grid's hidden cut.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, Optional


class _NdKey:
    """An N-d tensor-parallel layout (``tp_mode`` 2d/2.5d/3d) in a trace's key: the mode, the grid's
    axis sizes, and the plugin's 1D ``tp_plan`` override (the model's ``tp_nd_plan()`` first)."""

    def __init__(self, mode: str, sizes: Dict[str, int], depth: int, plan: Optional[dict]):
        from ...tp_nd.grid import layouts

        self.mode, self.sizes, self.depth, self.plan = mode, tuple(sorted(sizes.items())), depth, plan
        self.tp_size = math.prod(sizes.values())
        self.batch_shards = math.prod(sizes[a] for a in layouts(mode)[0].batch)

    def __hash__(self):
        return hash((self.mode, self.sizes))

    def __eq__(self, other):
        return isinstance(other, _NdKey) and (self.mode, self.sizes) == (other.mode, other.sizes)


@contextlib.contextmanager
def _fake_world(size: int):
    """A default process group of ``size`` ranks that never communicates (torch's ``fake`` backend,
    ``torch.testing._internal.distributed.fake_pg``): this process plays rank 0 of an N-d grid while
    the fake tensors run its layers. Only where no process group exists (the notebook, a planner):
    one process can hold one default group."""
    import torch.distributed as dist

    if not dist.is_available():
        raise _NoFakeWorld("torch.distributed is not available")
    if dist.is_initialized():
        raise _NoFakeWorld("a process group exists in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _NoFakeWorld(RuntimeError):
    pass
