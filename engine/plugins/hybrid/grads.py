"""The gradient sync a hybrid step runs at ``optimizer.step()``: tied copies, then the data-parallel mean.

A pipeline split may put the copies of a tied weight (GPT's embedding and head) on different stages;
:meth:`TiedCopies.find` finds them once at boost, and every step sums their gradients (locally for
copies on one rank, over a group of the ranks holding them otherwise). :class:`GradSync` then
averages every gradient over the ranks holding the same parameters (dp × cp) and, under 2D/2.5D/3D
tensor parallelism, over the batch pieces, bucketed per dtype into one all-reduce.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ... import comm


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _as_placed(p: torch.Tensor) -> None:
    """Give a DTensor parameter's gradient the parameter's placements: autograd may leave another layout
    (a vocabulary-sharded embedding's gradient comes back replicated), and the copies of a tied weight on
    different stages are summed shard by shard."""
    g = p.grad
    if g is not None and hasattr(g, "placements") and hasattr(p, "placements") and g.placements != p.placements:
        p.grad = g.redistribute(p.device_mesh, p.placements)


class TiedCopies:
    """This rank's copies of each tied weight with the group summing them (``copies``), and the names
    of copies a gradient norm skips (``skip``: after the sync every copy holds the same gradient, so a
    norm counts one, the first of the lowest pipeline rank)."""

    def __init__(self):
        self.copies: List[tuple] = []  # ([this rank's copies of one tied weight], group of the holders or None)
        self.skip: set = set()

    @classmethod
    def find(cls, model, tied: List[List[str]], dims) -> "TiedCopies":
        """Collective over the world: every rank says which tied weights it holds, then every rank makes
        the holders' group of each tied weight per pipeline (same dp, cp and tp coordinates)."""
        out = cls()
        which = {n: i for i, names in enumerate(tied) for n in names}
        local: Dict[int, List[tuple]] = {}  # tied weight -> this rank's distinct copies (name, param)
        for n, p in model.named_model_parameters():
            if n in which and all(q is not p for _, q in local.get(which[n], [])):
                local.setdefault(which[n], []).append((n, p))
        held: List[Any] = [None] * dist.get_world_size()
        comm.all_gather_object(held, sorted(local))
        me = dist.get_rank()
        for i in range(len(tied)):
            for pipeline in dims.pipelines():
                holders = [r for r in pipeline if i in held[r]]
                group = dist.new_group(holders) if len(holders) > 1 else None  # every rank, same order
                if me in holders:
                    out.copies.append(([p for _, p in local[i]], group))
                    out.skip.update(n for n, _ in local[i][int(me == holders[0]):])
        return out

    def sum_grads(self) -> None:
        """Each tied weight's copies all hold the sum of their gradients. A rank whose copies got no gradient
        this step (a stage that did not use its copy) still joins the sum, with zeros, while any holder has
        one: skipping the collective would leave the others waiting in it. No gradient anywhere: left None,
        as one process leaves an unused weight's."""
        for params, group in self.copies:
            for p in params:
                _as_placed(p)
            grads = [p.grad for p in params if p.grad is not None]
            if group is not None:
                anyone = torch.tensor([float(bool(grads))], device=params[0].device)
                comm.all_reduce(anyone, group=group)
                if anyone.item() and not grads:
                    params[0].grad = torch.zeros_like(params[0])
                    grads = [params[0].grad]
            if not grads:
                continue
            total = sum(grads[1:], grads[0])
            if group is not None:
                comm.all_reduce(_local(total), group=group)
            for p in params:  # the copies that had no gradient get the sum too
                if p.grad is None:
                    p.grad = total.clone()
            for g in grads:
                g.copy_(total)  # a no-op on the one copy a rank holds alone

    def groups(self) -> List[Any]:
        return [g for _, g in self.copies]


class GradSync:
    """``sync(model)``: tied copies summed, then the mean over ``group`` (dp × cp; None: this rank
    alone) and the N-d batch pieces."""

    def __init__(self, ties: TiedCopies, group: Optional[Any], experts: Optional[Any] = None,
                 reduced: frozenset = frozenset()):
        self.ties, self.group = ties, group
        self.experts = experts  # an experts.ExpertGroups under expert parallelism (its parameters reduce apart)
        self.reduced = reduced  # ids of parameters whose gradients FSDP2 reduced in backward (zero_stage=2)

    def __call__(self, model) -> None:
        self.ties.sum_grads()
        named = [(n, p) for n, p in model.named_model_parameters() if id(p) not in self.reduced]
        if self.experts is not None:  # summed over their expert-dp group, divided as the rest (hybrid/experts.py)
            own = self.experts.params
            self._sync_experts([p for _, p in named if id(p) in own])
            named = [(n, p) for n, p in named if id(p) not in own]
        # N-d: each rank's loss is the mean over its piece of the batch and the grid's reductions sum
        # the pieces, so gradients are averaged over the nb pieces as over data parallelism
        nb = model.nd.grid.batch_shards if model.nd is not None else 1
        # (context parallelism likewise: each rank's loss is the mean over its shard of the sequence)
        if self.group is None:
            if nb > 1:
                for _, p in named:
                    if p.grad is not None:
                        p.grad.div_(nb)
            return
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for _, p in named:
            if p.grad is not None:
                g = _local(p.grad)
                by_dtype.setdefault(g.dtype, []).append(g)
        n = dist.get_world_size(self.group) * nb
        for gs in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in gs])
            comm.all_reduce(flat, group=self.group)
            flat.div_(n)
            off = 0
            for g in gs:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
            comm.release(flat)  # freed here, not whenever gloo's worker drops the all-reduce

    def _sync_experts(self, params: List[torch.Tensor]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.experts.expert_dp_group is not None:
            comm.all_reduce(flat, group=self.experts.expert_dp_group)
        flat.div_(dist.get_world_size(self.group))
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
        comm.release(flat)
