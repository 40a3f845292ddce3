"""``ParallelDims``: the sizes of the hybrid mesh ``(dp, pp, cp, tp)`` and every group cut from it.

One object owns the ``DeviceMesh`` and the groups made beside it (the gradient group dp × cp), as
torchtitan's ``ParallelDims`` does, so the steps that parallelise a model ask it for a group or a
coordinate instead of slicing the mesh themselves, and ``close()`` knows what to give back. ``tp``
is innermost and ``cp`` sits between ``pp`` and ``tp``, so a cp group's ranks are neighbours after
tp's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch.distributed as dist

NAMES = ("dp", "pp", "cp", "tp")


class CheckpointGroups(tuple):
    """The groups whose collectives run inside a stage's layers (its tp group, then its cp group), as a
    stage module carries them (``_checkpoint_groups``, read by ``autockpt_dist.collective_groups``): a
    deep copy of the module shares them (a process group cannot be copied)."""

    def __deepcopy__(self, memo):
        return self


@dataclass
class ParallelDims:
    """Sizes of the four mesh dimensions; :meth:`build` makes the mesh and the groups (collective:
    every rank calls it in the same order)."""

    dp: int
    pp: int
    cp: int
    tp: int
    mesh: Any = None  # the DeviceMesh, named NAMES, once built
    grad_group: Any = None  # every rank holding the same parameters: dp x cp (None: this rank alone)
    sub: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def for_world(cls, world: int, pp: int, cp: int, tp: int) -> "ParallelDims":
        """The dims of a ``world``-rank job: data parallelism takes what the other three leave."""
        if world % (pp * cp * tp):
            raise ValueError(f"HybridParallelPlugin(tp_size={tp}, pp_size={pp}, cp_size={cp}): their product does "
                             f"not divide the world size {world}")
        return cls(dp=world // (pp * cp * tp), pp=pp, cp=cp, tp=tp)

    def build(self, device_type: str) -> "ParallelDims":
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device_type, (self.dp, self.pp, self.cp, self.tp), mesh_dim_names=NAMES)
        self.sub = {n: self.mesh[n] for n in NAMES}  # one-dimensional meshes, sliced once
        self.grad_group = self.dp_group
        if self.cp > 1:
            self.grad_group = self._dp_by_cp_group()
        return self

    def _dp_by_cp_group(self):
        """This rank's group of the ranks with its (pp, tp) coordinates: gradients are averaged over dp x cp."""
        me, mine = dist.get_rank(), None
        for p in range(self.pp):
            for t in range(self.tp):
                ranks = self.mesh.mesh[:, p, :, t].flatten().tolist()
                g = dist.new_group(ranks)  # every rank creates every group, in the same order
                if me in ranks:
                    mine = g
        return mine

    # ---- groups and coordinates -----------------------------------------------------------
    @property
    def dp_group(self):
        return self.sub["dp"].get_group() if self.dp > 1 else None

    @property
    def cp_group(self):
        return self.sub["cp"].get_group() if self.cp > 1 else None

    @property
    def pp_group(self):
        return self.sub["pp"].get_group()

    @property
    def tp_mesh(self):
        return self.sub["tp"]

    @property
    def tp_group(self):
        return self.sub["tp"].get_group()

    def rank(self, name: str) -> int:
        """This rank's coordinate along ``name`` (0 before the mesh is built)."""
        return self.sub[name].get_local_rank() if self.mesh is not None else 0

    @property
    def checkpoint_groups(self) -> CheckpointGroups:
        """The tp and cp groups of more than one rank: the ranks an activation-checkpoint plan is agreed over."""
        return CheckpointGroups(g for g, n in ((self.tp_group, self.tp), (self.cp_group, self.cp)) if n > 1)

    def tp_rank_lists(self) -> List[List[int]]:
        """The global ranks of every tp group of the world (an N-d grid is cut from each)."""
        return self.mesh.mesh.reshape(-1, self.tp).tolist()

    def pipelines(self) -> List[List[int]]:
        """The global ranks of every pipeline (one per (dp, cp, tp) coordinate), in pp order."""
        ranks = self.mesh.mesh
        return ranks.permute(0, 2, 3, 1).reshape(-1, ranks.shape[1]).tolist()

    def groups(self) -> List[Any]:
        """The groups of this rank this object holds: the mesh's, then the gradient group."""
        if self.mesh is None:
            return []
        return [self.mesh.get_group(n) for n in self.mesh.mesh_dim_names] + [self.grad_group]

    def forget(self) -> None:
        """Drop the mesh and groups (after they were destroyed)."""
        self.mesh, self.grad_group, self.sub = None, None, {}
