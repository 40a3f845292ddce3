"""Expert parallelism inside data parallelism: ``HybridParallelPlugin(ep_size=k)``.

With 1D tensor parallelism the MoE blocks stay whole on every tp rank (GPT's ``tp_plan`` leaves them out,
they take the replicated residual stream as a norm does) and the EP groups are cut per tp coordinate.

The ``dp`` ranks of one ``(pp, cp, tp)`` coordinate are cut into EP groups of ``k`` neighbours
(dp index ``outer * k + e``): the ranks of an EP group hold different experts (``E / k`` each)
and exchange tokens by all-to-all (:mod:`...moe.parallel`); the ranks with the same ``e`` (the
expert-dp group, ``dp / k`` of them) hold the same experts. Gradients: non-expert parameters are
averaged over the whole dp (× cp) group as before; an expert's gradient already sums the tokens of
its whole EP group (the all-to-all's backward brought them), so it is summed over the expert-dp
group and divided by the same dp (× cp) size: both are then the gradient of the mean loss over
every rank's batch. A grouped expert weight gets a (zero) gradient even when no token reached it,
so every rank reduces the same tensors every step. ZeRO-1 shards the two kinds' optimizer state over
those same two groups (:mod:`.expert_zero`). The same split as Colossal-AI's
``MoeHybridParallelPlugin`` (its ``moe_dp_group``) and torchtitan's ``dp_shard_mod_ep``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Set

import torch.distributed as dist
import torch.nn as nn


def _moe_layers(model: nn.Module):
    from ...moe import moe_layers

    return list(moe_layers(model))


def check_expert_parallel(model: nn.Module, plugin, world: Optional[int]) -> None:
    """Refuse an EP layout before any group exists, naming what works."""
    ep = plugin.ep_size
    layers = _moe_layers(model)
    if layers and plugin.tp_size > 1 and (plugin.sequence_parallel or plugin.tp_mode != "1d"):
        raise ValueError(f"HybridParallelPlugin(tp_size={plugin.tp_size}, tp_mode={plugin.tp_mode!r}, "
                         f"sequence_parallel={plugin.sequence_parallel}): MoE blocks stay whole on every tp rank, "
                         "which only 1D tensor parallelism without sequence parallelism gives them so far; use "
                         "tp_mode='1d', sequence_parallel=False")
    from ...models.hf import moe as hf_moe

    hf_layers = hf_moe.check(model, plugin)  # a transformers MoE family's experts (models/hf/moe.py), counts checked
    if ep == 1:
        return
    if not layers and not hf_layers:
        raise ValueError(f"HybridParallelPlugin(ep_size={ep}): {type(model).__name__} has no MoE block "
                         "(engine/moe.MoE, or a transformers MoE family's experts) to split; build it with experts "
                         "(the reference model: n_expert=8, top_k=2 in its config) or set ep_size=1")
    for name, moe in layers:
        if moe.top_k > moe.n_expert:
            raise ValueError(f"HybridParallelPlugin(ep_size={ep}): {name} routes top_k={moe.top_k} of "
                             f"n_expert={moe.n_expert} experts; use top_k <= {moe.n_expert}")
        if moe.n_expert % ep:
            ok = [d for d in range(1, moe.n_expert + 1) if moe.n_expert % d == 0]
            raise ValueError(f"HybridParallelPlugin(ep_size={ep}): n_expert={moe.n_expert} ({name}) does not "
                             f"divide over {ep} ranks; use an ep_size in {ok}")
    if plugin.cp_size > 1:
        raise ValueError(f"HybridParallelPlugin(ep_size={ep}, cp_size={plugin.cp_size}): expert parallelism composes "
                         "with data, tensor and pipeline parallelism so far (docs/moe.md); set cp_size=1")
    check_world(ep, plugin.tp_size * plugin.pp_size * plugin.cp_size, world)


def check_world(ep: int, other: int, world: Optional[int]) -> None:
    """The EP groups sit inside dp: ``ep_size`` must divide ``world / (tp * pp * cp)``."""
    if world is None or (world // other) % ep == 0 and world % other == 0:
        return
    dp = world // other
    ok = [d for d in range(1, dp + 1) if dp % d == 0]
    raise ValueError(f"HybridParallelPlugin(ep_size={ep}): expert-parallel groups are cut from the {dp} "
                     f"data-parallel ranks of a world of {world}; use an ep_size in {ok}")


class ExpertGroups:
    """This rank's EP group (the :class:`~...moe.ExpertParallel` handle over it) and expert-dp group."""

    def __init__(self, ep: int):
        self.ep_size = ep
        self.handle = None  # moe.ExpertParallel over this rank's EP group
        self.ep_group: Any = None
        self.expert_dp_group: Any = None  # None: one replica of each expert (dp == ep)
        self.params: Set[int] = set()  # ids of this rank's expert parameters
        self.names: Set[str] = set()  # their names in the (stage) module
        self._made: List[Any] = []

    def build(self, dims) -> "ExpertGroups":
        """Collective over the world: every rank creates every group, in the same order."""
        from ...moe import ExpertParallel

        ep, me = self.ep_size, dist.get_rank()
        mesh = dims.mesh.mesh  # (dp, pp, cp, tp) ranks
        for p in range(dims.pp):
            for c in range(dims.cp):
                for t in range(dims.tp):
                    dp_ranks = mesh[:, p, c, t].tolist()
                    for o in range(0, len(dp_ranks), ep):  # EP groups: neighbours in dp
                        g = self._new(dp_ranks[o:o + ep])
                        if me in dp_ranks[o:o + ep]:
                            self.ep_group = g
                    if len(dp_ranks) > ep:  # expert-dp groups: the same place in every EP group
                        for e in range(ep):
                            g = self._new(dp_ranks[e::ep])
                            if me in dp_ranks[e::ep]:
                                self.expert_dp_group = g
        self.handle = ExpertParallel(self.ep_group)
        return self

    def _new(self, ranks: List[int]):
        g = dist.new_group(ranks)
        self._made.append(g)
        return g

    def shard(self, module: nn.Module) -> None:
        """Cut every MoE block's grouped experts to this rank's share and hand it the EP handle."""
        for layer, moe in _moe_layers(module):
            lo, hi = self.handle.local_experts(moe.n_expert)
            ex = moe.experts
            for name in ("w1", "w3", "w2"):
                full = getattr(ex, name)
                setattr(ex, name, nn.Parameter(full.detach()[lo:hi].clone(), requires_grad=full.requires_grad))
                self.params.add(id(getattr(ex, name)))
                self.names.add(f"{layer}.experts.{name}")
            moe.ep = self.handle
        from ...models.hf import moe as hf_moe

        for name, p in hf_moe.shard(module, self.handle):  # a transformers MoE family's grouped weights
            self.params.add(id(p))
            self.names.add(name)

    def full_shape(self, t) -> tuple:
        """The whole grouped weight's shape, of which ``t`` is this rank's slice (``E / ep`` experts)."""
        return (t.shape[0] * self.ep_size,) + tuple(t.shape[1:])

    def rows(self, t) -> tuple:
        """``[lo, hi)``: the rows (global experts) of the whole weight that slice ``t`` holds."""
        lo = dist.get_rank(self.ep_group) * t.shape[0]
        return lo, lo + t.shape[0]

    def full(self, t):
        """This rank's slice of a grouped expert weight -> every expert's (all-gathered over the EP group)."""
        import torch

        from ... import comm

        parts = [torch.empty_like(t) for _ in range(self.ep_size)]
        comm.all_gather(parts, t.contiguous(), group=self.ep_group)
        return torch.cat(parts, 0)

    def groups(self) -> List[Any]:
        return list(self._made)
