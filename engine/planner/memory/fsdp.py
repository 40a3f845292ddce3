"""Memory model of ``LowLevelZeroPlugin(stage=2)``: FSDP2's ``fully_shard`` per block and the root,
``reshard_after_forward=False``.

Shards padded to the world (dim 0) and sharded moments persist; every group is gathered in forward
and kept unsharded until its backward is done, freed as its last gradient lands (gradients arrive
in reverse order of first use, read off the trace); one group's all-gather/reduce-scatter buffer
is held throughout.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch.nn as nn

from .peaks import _max_cats, _opt_bytes, _peak_over, _step_temp, _tier
from .result import RankPlan, _fmt
from .trace import _nbytes, _Trace


def zero2(rep, plugin, precision: str) -> Tuple[List[RankPlan], Dict[str, int], List[str]]:
    """The rank group, traffic and notes of ZeRO-2 for ``rep`` (``replicated._Replica``)."""
    m, tr, w, opt = rep.m, rep.tr, rep.world, rep.opt
    dev = rep.env.compute_tier
    groups_fsdp = _fsdp_groups(m)
    ud = rep.low.itemsize if (rep.low is not None and precision != "fp8") else None

    def shard(p):  # FSDP2 pads dim 0 to a multiple of the world
        rows = p.shape[0] if p.dim() else 1
        return -(-rows // w) * (p.numel() // max(1, rows)) * p.dtype.itemsize

    Ps = sum(shard(p) for _, p in m.params)
    Gs = sum(shard(p) for _, p in rep.train)
    Ss = _opt_bytes(sum(shard(p) // p.dtype.itemsize for _, p in rep.train), opt)
    unsh = {gname: sum(p.numel() * (ud or p.dtype.itemsize) for _, p in ps) for gname, ps in groups_fsdp.items()}
    U = sum(unsh.values())
    big_group = max((sum(_nbytes(p) for _, p in ps if p.requires_grad) for ps in groups_fsdp.values()), default=0)
    done_at = _group_release(m, tr, groups_fsdp)

    def grads_live(g):  # sharded gradients so far + the current groups' unsharded ones
        done = done_at(g)
        gdone = sum(sum(_nbytes(p) for _, p in groups_fsdp[gn] if p.requires_grad) for gn in done)
        return g - gdone + int(gdone / w)

    def params_at(g):  # shards, buffers, and the groups still unsharded
        return Ps + rep.Bf + U - sum(unsh[gn] for gn in done_at(g))

    fb, ph, _ = _peak_over(tr, lambda i, o, g, s: {"params": params_at(g), "grads": grads_live(g),
                                                     "optimizer": Ss, "activations": o, "working": big_group})
    step = {"params": Ps + rep.Bf, "grads": Gs, "optimizer": Ss,
            "working": _step_temp(-(-rep.largest // w), Gs, dev, opt)}
    cats, phase = _max_cats((fb, ph), (step, "optimizer step"))
    group = RankPlan(list(range(w)), "ZeRO-2 shard", {dev: _tier(dev, rep.env.capacity(dev), cats, phase)})
    traffic = {"allgather": int(U * (w - 1) / w), "reduce_scatter": int(rep.G * (w - 1) / w)}
    notes = [f"ZeRO-2 (FSDP2): {len(groups_fsdp)} groups gathered in forward and kept through backward "
             f"({_fmt(U)} unsharded), shards padded to the world"]
    if getattr(plugin, "cpu_offload", False) and dev == "cuda":
        notes.append("cpu_offload=True: sharded parameters, gradients and states live in host memory "
                     "(not split out by tier in this estimate)")
    return [group], traffic, notes


def _fsdp_groups(m) -> Dict[str, List[Tuple[str, nn.Parameter]]]:
    """FSDP2's parameter groups as ``LowLevelZeroPlugin`` shards: each of its blocks
    (``fsdp_blocks``: the shallowest ModuleList/ModuleDicts' members), then the root with what is left."""
    from ...plugins.low_level_zero import fsdp_blocks

    groups: Dict[str, List[Tuple[str, nn.Parameter]]] = {}
    owner: Dict[int, str] = {}
    for bname, block in fsdp_blocks(m.meta):
        for _, p in block.named_parameters():
            owner.setdefault(id(p), bname)
    for n, p in m.params:
        groups.setdefault(owner.get(id(p), ""), []).append((n, p))
    return groups


def _group_release(m, tr: _Trace, groups) -> Callable[[int], List[str]]:
    """``done(g)``: the groups whose every gradient has arrived once ``g`` gradient bytes exist
    (gradients arrive in reverse order of first use)."""
    order = [n for n in tr.order] + [n for n, _ in m.params if n not in set(tr.order)]
    sizes = {n: _nbytes(p) for n, p in m.params if p.requires_grad}
    arrival = [n for n in reversed(order) if n in sizes]
    cum, acc = [], 0
    for n in arrival:
        acc += sizes[n]
        cum.append(acc)
    gof = {n: gn for gn, ps in groups.items() for n, _ in ps}
    last_needed: Dict[str, int] = {}
    for i, n in enumerate(arrival):
        last_needed[gof[n]] = i
    thresholds = sorted((cum[i], gn) for gn, i in last_needed.items())

    def done(g: int) -> List[str]:
        return [gn for t, gn in thresholds if t <= g]

    return done
