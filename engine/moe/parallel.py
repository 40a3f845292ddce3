"""Expert parallelism: each rank of an EP group holds ``E / ep`` experts; tokens travel to them and back.

A rank routes its own tokens over all ``E`` experts (the router is replicated), sorts them by
expert (:mod:`.dispatch`), then:

1. tells every rank how many rows it will send to each of that rank's experts (one all-to-all of
   ``E`` counts, equal slots);
2. sends the rows (all-to-all with variable splits); they arrive grouped by source rank, then
   local expert, and are regrouped expert-major for the grouped matmul;
3. after the experts, undoes the regrouping and sends each row back (the reverse all-to-all).

Both row all-to-alls are differentiable (the backward is the all-to-all with the splits swapped)
and go through :func:`...comm.all_to_all_single`, so ``COMM`` (labels ``moe.counts``,
``moe.dispatch``, ``moe.combine``) counts exactly the rows sent to other ranks, forward and
backward. Built on ``torch.distributed.all_to_all_single``; the same scheme as torchtitan's
``ExpertParallel`` and Colossal-AI's ``MoeHybridParallelPlugin``, without their fused kernels.
torch's ``_functional_collectives.all_to_all_single_autograd`` (torchtitan's) would do the
autograd part too, but bypasses ``comm``'s counter, the engine's one route to collectives.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from .. import comm
from ..traffic import COUNTER

COMM = COUNTER.view("moe.", int)  # this rank's expert-parallel traffic, by label without "moe."


class _AllToAll(torch.autograd.Function):
    """Rows ``in_splits[r]`` to group rank ``r``, ``out_splits[r]`` from it; backward swaps them."""

    @staticmethod
    def forward(ctx, x, in_splits: List[int], out_splits: List[int], group, label: str):
        ctx.splits, ctx.group, ctx.label = (in_splits, out_splits), group, label
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        return comm.all_to_all_single(out, x.contiguous(), group, label, in_splits, out_splits)

    @staticmethod
    def backward(ctx, g):
        in_splits, out_splits = ctx.splits
        gx = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        comm.all_to_all_single(gx, g.contiguous(), ctx.group, ctx.label, out_splits, in_splits)
        return gx, None, None, None, None


class ExpertParallel:
    """An EP group's handle (one per plugin, shared by every MoE layer): ``dispatch`` and ``combine``."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def local_experts(self, n_expert: int) -> Tuple[int, int]:
        """The global indices ``[lo, hi)`` of this rank's experts."""
        per = n_expert // self.size
        return self.rank * per, (self.rank + 1) * per

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor):
        """x: (A, d) this rank's rows sorted by global expert, ``counts`` (E,) -> (rows for this rank's
        experts, expert-major; their counts (E/ep,); the state ``combine`` needs)."""
        ep, E = self.size, counts.numel()
        per = E // ep
        dev = comm.comm_device(self.group)
        recv = torch.empty(E, dtype=torch.int64, device=dev)
        comm.all_to_all_single(recv, counts.to(dev), self.group, "moe.counts")
        recv = recv.view(ep, per).to(x.device)  # [source rank, local expert]
        in_splits = counts.view(ep, per).sum(1).tolist()
        out_splits = recv.sum(1).tolist()
        rows = _AllToAll.apply(x, in_splits, out_splits, self.group, "moe.dispatch")
        # arrived (source, local expert)-major: regroup expert-major for the grouped matmul
        src = torch.arange(ep, device=x.device).repeat_interleave(per)
        loc = torch.arange(per, device=x.device).repeat(ep)
        key = torch.repeat_interleave(loc * ep + src, recv.reshape(-1))
        perm = torch.argsort(key, stable=True)
        return rows[perm], recv.sum(0), (perm, in_splits, out_splits)

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        """The experts' outputs (``dispatch``'s order) back to the ranks and order they came from."""
        perm, in_splits, out_splits = state
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=perm.device)
        return _AllToAll.apply(y[back], out_splits, in_splits, self.group, "moe.combine")
