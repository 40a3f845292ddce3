"""Activation checkpointing plans under the plugins: one plan agreed by every rank that shares a
layer's collectives, and the budget each plugin hands down (docs/activation_checkpointing.md,
"Under the plugins").

**Agreement.** Under tensor, sequence or context parallelism a layer's forward holds collectives,
and so does its recompute: a layer recomputed on one rank but not on its tensor-parallel peer
deadlocks. :func:`engine.autockpt.profile_checkpointing` gives every layer option ``(u + r) % K``
in profiling step ``r``, a function of the layer's position only, so every rank of a group runs the
same layers under the same options, hence the same collectives in the same order, while profiling.
The ranks' profiles then differ only in their measured numbers; :func:`merge_profiles` takes the
worst case of every figure over the group (one all-reduce MAX of a float64 tensor of them: most
bytes kept, highest peaks, least freed, slowest recompute), and every rank solves the same merged
profile, so every rank chooses the same plan. Taking the maximum over one group and then another
(tensor-parallel, then context-parallel) is the maximum over every rank of their product.

**Budgets.** A plugin's ``activation_budget`` is the peak activation memory of one training step on
one rank. A pipeline stage holds several microbatches in flight (1F1B: up to ``pp - s`` on pipeline
rank ``s``; GPipe: all ``m``; times the chunks a rank holds under the interleaved schedules), each
planned alike, so a stage plans one microbatch for ``budget // in_flight`` (:func:`stage_budget`,
the rule ``cl.plan`` uses for its activation memory).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import replace
from typing import Iterable, List, Optional, Sequence

import torch.distributed as dist
import torch.nn as nn

from .autockpt import CheckpointPlan, CheckpointProfile, OptionCost, UnitProfile, profile_checkpointing, solve

__all__ = ["agreed_profile", "check_budget", "collective_groups", "in_flight", "merge_profiles", "plan_agreed",
           "stage_budget"]

_FIXED = ("prefix_keep", "prefix_peak", "prefix_bwd_peak", "tail_keep", "tail_peak", "tail_bwd_delta", "tail_bwd_peak")
_COST = ("keep", "fwd_peak", "bwd_delta", "bwd_peak", "recompute_s", "saved", "overhead_s")


def _flat(prof: CheckpointProfile) -> List[float]:
    out = [float(getattr(prof, k)) for k in _FIXED]
    for u in prof.units:
        for o in prof.options:
            c = u.options[o]
            out += [float(getattr(c, k)) for k in _COST]
        out += [float(u.forward_s), float(u.saved)]
        for p in prof.parts:
            b, s = u.parts.get(p, (0, 0.0))
            out += [float(b), float(s)]
    return out


def _unflat(prof: CheckpointProfile, vals: Sequence[float]) -> CheckpointProfile:
    it = iter(vals)
    fixed = {k: int(next(it)) for k in _FIXED}
    units = []
    for u in prof.units:
        opts = {}
        for o in prof.options:
            c = dict(zip(_COST, (next(it) for _ in _COST)))
            opts[o] = OptionCost(keep=int(c["keep"]), fwd_peak=int(c["fwd_peak"]), bwd_delta=int(c["bwd_delta"]),
                                 bwd_peak=int(c["bwd_peak"]), recompute_s=c["recompute_s"], saved=int(c["saved"]),
                                 overhead_s=c["overhead_s"])
        forward_s, saved = next(it), int(next(it))
        parts = {p: (int(next(it)), next(it)) for p in prof.parts}
        units.append(UnitProfile(name=u.name, index=u.index, options=opts, forward_s=forward_s, saved=saved,
                                 parts=parts))
    return replace(prof, units=units, **fixed)


def merge_profiles(profile: CheckpointProfile, group=None) -> CheckpointProfile:
    """The worst case of ``profile`` over the ranks of ``group`` (None: the world): every figure the
    largest any rank measured. Collective: every rank of ``group`` calls it with a profile of the same
    layers and options (a ``ValueError`` on every rank otherwise). Without a process group, or on a
    group of one, ``profile`` comes back as it is."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return profile
    from . import comm

    shape = [float(len(profile.units)), float(len(profile.options)),
             float(zlib.crc32(",".join(profile.options).encode()))]
    got = comm.reduce_values(shape + [-v for v in shape], op=dist.ReduceOp.MAX, group=group)
    if got[:3] != [-v for v in got[3:]]:
        raise ValueError(f"merge_profiles: the ranks of the group profiled different layers or options (this rank: "
                         f"{len(profile.units)} layers, options {profile.options}); every rank sharing the layers' "
                         "collectives must plan the same model part")
    vals = comm.reduce_values(_flat(profile), op=dist.ReduceOp.MAX, group=group)
    merged = _unflat(profile, vals)
    merged.profile_s = max(profile.profile_s, merged.profile_s)
    return merged


def collective_groups(model: nn.Module) -> Optional[List]:
    """The process groups whose collectives run inside ``model``'s layers, so whose ranks must
    recompute the same layers: ``model._checkpoint_groups`` when a plugin set it (it knows its mesh),
    else the groups of the device meshes of DTensor parameters (tensor parallelism) and of a
    ``context_parallel`` handle. ``[]``: none (each rank may plan alone); ``None``: collectives
    whose group is not known (2D/2.5D/3D layers): the caller merges over the world."""
    given = getattr(model, "_checkpoint_groups", None)
    if given is not None:
        return list(given)
    from torch.distributed.tensor import DTensor

    groups, seen, unknown = [], set(), False
    base = __name__.rsplit(".", 1)[0]  # colossal_lab.engine

    def add(g):
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            groups.append(g)

    cp = getattr(model, "context_parallel", None)
    if cp is not None:
        add(getattr(cp, "group", None))
    for m in model.modules():
        if type(m).__module__.startswith(base + ".tp_nd"):
            unknown = True
        for p in m.parameters(recurse=False):
            if isinstance(p, DTensor):
                mesh = p.device_mesh
                for d in range(mesh.ndim):
                    if mesh.size(d) > 1:
                        add(mesh.get_group(d))
    return None if unknown else groups


def agreed_profile(model: nn.Module, sample_inputs, loss_fn=None, groups: Optional[Iterable] = (),
                   *, repeats: int = 1) -> CheckpointProfile:
    """:func:`autockpt.profile_checkpointing` merged over each of ``groups`` (``None``: the world;
    ``()``: this rank alone). Every rank of each group calls it at the same point (its collectives and
    the profiling steps' match)."""
    with _dtensor_storages():
        prof = profile_checkpointing(model, sample_inputs, loss_fn, repeats=repeats)
    for g in ([None] if groups is None else list(groups)):
        prof = merge_profiles(prof, g)
    return prof


def plan_agreed(model: nn.Module, sample_inputs, budget: int, loss_fn=None, groups: Optional[Iterable] = (),
                *, repeats: int = 1) -> CheckpointPlan:
    """:func:`autockpt.plan_checkpointing` on :func:`agreed_profile`: every rank of ``groups`` gets
    the same plan (or the same ``ValueError``)."""
    return solve(agreed_profile(model, sample_inputs, loss_fn, groups, repeats=repeats), budget)


@contextlib.contextmanager
def _dtensor_storages():
    """While profiling: a DTensor's ``untyped_storage()`` is its local shard's. The profiler tells
    parameters and saved tensors apart by their storages, and a DTensor (tensor parallelism's
    parameters, and what autograd saves around them) has none of its own, so ``untyped_storage()``
    raises on it; its bytes are its local tensor's, which the allocator events count. (Scoped to the
    profiling steps; ``engine/autockpt/`` reading ``to_local()`` itself would make this unneeded.)"""
    from torch.distributed.tensor import DTensor

    had = "untyped_storage" in DTensor.__dict__
    old = DTensor.__dict__.get("untyped_storage")
    DTensor.untyped_storage = lambda self: self._local_tensor.untyped_storage()
    try:
        yield
    finally:
        if had:
            DTensor.untyped_storage = old
        else:
            del DTensor.untyped_storage


def in_flight(style: str, pp: int, pp_rank: int, m: int, chunks: int = 1) -> int:
    """Microbatches a pipeline rank holds forwarded but not yet backwarded when its first backward
    starts: GPipe all ``m``, 1F1B (and, as ``cl.plan`` takes it, the interleaved and zero-bubble
    schedules) ``pp - pp_rank`` at most; times the model chunks a rank holds. 1 without a pipeline."""
    if pp <= 1:
        return 1
    n = m if style == "gpipe" else max(1, min(m, pp - pp_rank))
    return n * max(1, chunks)


def stage_budget(budget: int, style: str, pp: int, pp_rank: int, m: int, chunks: int = 1) -> int:
    """The per-microbatch budget a stage plans with: ``budget // in_flight(...)``."""
    return int(budget) // in_flight(style, pp, pp_rank, m, chunks)


def check_budget(owner: str, activation_checkpointing, activation_budget, *, budget_optional: bool = False) -> None:
    """``ValueError`` naming the argument and the fix, for a plugin's pair of arguments."""
    ac, b = activation_checkpointing, activation_budget
    if not (isinstance(ac, bool) or ac == "auto"):
        raise ValueError(f"{owner}(activation_checkpointing={ac!r}): choose False, True (every layer recomputes) "
                         "or 'auto' (the layers chosen to stay under activation_budget)")
    if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or math.isinf(b) or not b > 0):
        raise ValueError(f"{owner}(activation_budget={b!r}): must be a number of bytes > 0 (the peak activation "
                         "memory of one training step on one rank), e.g. activation_budget=2 << 30")
    if ac == "auto" and b is None and not budget_optional:
        raise ValueError(f"{owner}(activation_checkpointing='auto') needs activation_budget=<bytes> > 0: the peak "
                         "activation memory of one training step on one rank the plan must stay under (e.g. "
                         "activation_budget=2 << 30), or activation_checkpointing=True to recompute every layer")
    if ac != "auto" and b is not None:
        raise ValueError(f"{owner}(activation_budget={b!r}) is read only with activation_checkpointing='auto'; "
                         "set activation_checkpointing='auto' or drop activation_budget")
