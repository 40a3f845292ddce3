"""Memory model of ``HybridParallelPlugin``: per pipeline stage (and tensor-parallel shard) the
stage's own parameters and moments, its microbatches in flight, the receive buffers torch's
``PipelineStage`` keeps, and the data-parallel gradient sync.

Each stage is traced on its own part (``pipeline_stage``), fed a fake tensor shaped like the
previous stage's output; a 1D tensor-parallel rank on its parameters at their shard's shape, an
N-d one on its grid-form layers (``nd.py``). Microbatches in flight at backward ``j`` on stage
``s``: GPipe ``m - j``, 1F1B ``min(m - j, pp - s)`` (interleaved and zero-bubble approximated as
1F1B × chunks).

Under ``ep_size=k`` (expert parallelism, ``experts.py``) a rank holds ``1/k`` of every grouped expert
weight, its gradient and its optimizer state (ZeRO-1: the experts' state over the expert-dp group of
``dp / k`` ranks, the rest over dp); the experts' gradients are all-reduced over the expert-dp group,
the rest over dp, and the step's all-to-alls are in the traffic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...models.hf import reads_dict_plan
from . import experts as moe_plan
from .env import _Env
from .model import _PlanKey, _tp_shapes
from .nd import _NdKey
from .peaks import _acts_summary, _max_cats, _opt_bytes, _peak_over, _Result, _step_temp, _tier
from .result import RankPlan
from .trace import _nbytes, _Trace, _unique_params


@dataclass
class _Layout:
    """The hybrid layout being planned, and how to trace one of its (virtual) stages."""

    m: Any
    plugin: Any
    env: _Env
    opt: str
    ac: bool
    low: Optional[torch.dtype]
    mb_n: int                  # microbatches per step
    micro: int                 # samples per microbatch
    tp_arg: Optional[tuple]    # (tp_size, _PlanKey | _NdKey), or None without tensor parallelism
    spec: Any                  # pipeline.schedules.ScheduleSpec
    dp: int
    moe: Optional[list] = None  # experts.moe_layers under ep_size > 1, else None
    ep: int = 1

    def key(self, sid: int) -> Optional[Tuple[int, int]]:
        n = self.spec.num_stages
        return (sid, n) if n > 1 else None

    def trace(self, sid: int) -> _Trace:
        return self.m.trace(ac=self.ac, autocast=self.low, micro=self.micro, stage=self.key(sid), tp=self.tp_arg)


def plan_hybrid(m, plugin, env: _Env, precision: str, opt: str, ac: bool) -> _Result:
    """HybridParallelPlugin: per pipeline stage (and tensor-parallel shard) the stage's own
    parameters, its microbatches in flight, receive buffers, and the data-parallel gradient sync."""
    from ...mixed_precision import autocast_dtype
    from ...pipeline.schedules import ScheduleSpec

    w, tp, pp = env.world, plugin.tp_size, plugin.pp_size
    mb_n = _microbatches(plugin, m.batch)
    notes: List[str] = []
    tp_arg = _tp_arg(m, plugin, mb_n, notes)
    lay = _Layout(m, plugin, env, opt, ac, autocast_dtype(precision) if precision != "fp32" else None, mb_n,
                  m.batch // mb_n, tp_arg, ScheduleSpec(plugin.pp_style, pp, plugin.num_model_chunks, mb_n),
                  w // (tp * pp))
    lay.moe = moe_plan.check(m.meta, plugin, w)  # the plugin's own refusals (ep not dividing experts or dp)
    lay.ep = getattr(plugin, "ep_size", 1) if lay.moe is not None else 1
    groups: List[RankPlan] = []
    traffic: Dict[str, int] = {}
    worst_act = {"without_checkpointing": 0, "with_checkpointing": 0 if m.supports_ac() else None, "checkpointing": ac}
    for s in range(pp):
        group, grads, boundary = _stage_plan(lay, s, worst_act, notes)
        groups.append(group)
        ge, edp = group.states.get("expert_grads", 0), lay.dp // lay.ep  # experts: over the expert-dp group
        sync = 2 * (lay.dp - 1) / lay.dp * (grads - ge) + 2 * (edp - 1) / edp * ge
        if sync:
            traffic["allreduce"] = max(traffic.get("allreduce", 0), int(sync))
        if group.states.get("all_to_all"):
            traffic["all_to_all"] = max(traffic.get("all_to_all", 0), group.states["all_to_all"])
        if pp > 1:  # activations in, gradients out at each boundary
            traffic["p2p"] = max(traffic.get("p2p", 0), 2 * mb_n * boundary)
    notes += _tp_notes(lay)
    layout = {"dp": lay.dp, "tp": tp, "pp": pp, "microbatches": mb_n, "microbatch": lay.micro,
              "pp_style": plugin.pp_style, "zero_stage": plugin.zero_stage}
    if tp > 1 and _nd_mode(plugin) != "1d":
        layout.update(tp_mode=_nd_mode(plugin), tp_grid=dict(plugin.tp_grid))
    if lay.moe is not None:
        layout.update(ep=lay.ep, expert_dp=lay.dp // lay.ep, moe_layers=len(lay.moe),
                      experts_per_rank=lay.moe[0].n_expert // lay.ep if lay.moe else 0)
        notes += _ep_notes(lay)
    return _Result(groups, traffic, worst_act, layout, notes)


def _nd_mode(plugin) -> str:
    return getattr(plugin, "tp_mode", "1d")


def _microbatches(plugin, b: int) -> int:
    if plugin.num_microbatches is not None:
        mb_n = plugin.num_microbatches
    elif plugin.microbatch_size is not None:
        mb_n = b // plugin.microbatch_size
    else:
        mb_n = 1
    if b % mb_n:
        raise ValueError(f"cl.plan(batch={b}): HybridParallelPlugin splits it into {mb_n} microbatches; pass a batch "
                         f"that is a multiple of {mb_n}")
    return mb_n


def _tp_arg(m, plugin, mb_n: int, notes: List[str]) -> Optional[tuple]:
    """The tensor-parallel part of a trace's key, after checking the model can be cut that way."""
    tp, b, nd_mode = plugin.tp_size, m.batch, _nd_mode(plugin)
    if tp > 1 and nd_mode != "1d":
        from ...tp_nd import apply as nd_apply

        nd_plan = nd_apply.resolve_plan(m.meta, plugin.tp_plan)  # ValueError naming what has no role
        nd_apply.check(m.meta, nd_plan, nd_mode, plugin.tp_grid, tp)  # blocks that do not cut evenly
        if callable(getattr(m.meta, "check_tp", None)):
            m.meta.check_tp(plugin.tp_grid["y" if nd_mode == "3d" else "row"])  # heads over the hidden cut
        key_nd = _NdKey(nd_mode, plugin.tp_grid, plugin.tp_depth, plugin.tp_plan)
        if b % (mb_n * key_nd.batch_shards):
            raise ValueError(f"cl.plan(batch={b}): HybridParallelPlugin(tp_mode={nd_mode!r}) cuts each batch into "
                             f"{key_nd.batch_shards} row pieces, then {mb_n} microbatches; pass a batch that is a "
                             f"multiple of {key_nd.batch_shards * mb_n}")
        return tp, key_nd
    if tp > 1 and reads_dict_plan(m.meta):  # a transformers model: the plan and the checks its plugin uses
        from ...models.hf import check_tensor_parallel, resolve_plan

        check_tensor_parallel(m.meta, plugin)  # the plugin's own refusals (heads, styles, ties), word for word
        # the plugin keeps the LM head's logits vocabulary-sharded (``loss_parallel``) without a pipeline
        return tp, _PlanKey(resolve_plan(m.meta, plugin.tp_plan, tp)[0], plugin.sequence_parallel,
                            getattr(plugin, "loss_parallel", False) and plugin.pp_size == 1)
    if tp > 1:
        tplan = plugin.tp_plan if plugin.tp_plan is not None else (
            m.meta.tp_plan(sequence_parallel=plugin.sequence_parallel)
            if callable(getattr(m.meta, "tp_plan", None)) else None)
        if tplan is None:
            raise ValueError(f"cl.plan: HybridParallelPlugin(tp_size={tp}) needs the model's tp_plan() or tp_plan=...")
        if callable(getattr(m.meta, "check_tp", None)):
            m.meta.check_tp(tp)
        if plugin.sequence_parallel:
            notes.append("sequence_parallel: activations estimated as without it (norm inputs taken whole)")
        return tp, _PlanKey(tplan)
    return None


def _stage_plan(lay: _Layout, s: int, worst_act: dict, notes: List[str]) -> Tuple[RankPlan, int, int]:
    """Pipeline rank ``s``'s group; its gradient bytes and the output bytes at its stage boundaries
    (one microbatch, each direction)."""
    pl, pp, tp, mb_n, v = lay.plugin, lay.plugin.pp_size, lay.plugin.tp_size, lay.mb_n, lay.plugin.num_model_chunks
    dev = lay.env.compute_tier
    stage_ids = lay.spec.stage_indices(s)
    traces, params, bufs = _stage_traces(lay, stage_ids, worst_act)
    full = sum(params.values())
    params, states = _expert_share(lay, params)  # under ep: this rank's 1/ep of each grouped expert weight
    P = sum(params.values())
    G = sum(params.values())  # gradients in the parameters' dtype (fp32 masters)
    largest = max(params.values(), default=0)
    S = _state_bytes(lay, params, states, notes)
    states.update(params=P, grads=G, optimizer=S)
    scale = G / full if full else 1.0  # the trace's gradients hold every expert: this rank's share of them
    # receive buffers, one per microbatch, kept by torch's PipelineStage: activations in, gradients in
    boundary = _boundary_bytes(lay, traces)
    recv = mb_n * boundary
    cands = []
    for sid, tr in traces:
        act = tr.act_end
        n0 = _in_flight(pl.pp_style, pp, s, mb_n, 0) * (v if v > 1 else 1)
        n1 = _in_flight(pl.pp_style, pp, s, mb_n, 1) * (v if v > 1 else 1) if mb_n > 1 else 0

        def at(grads_fn, k):
            return lambda i, o, g, sv: {"params": P + bufs, "grads": grads_fn(g), "optimizer": S,
                                        "activations": o + (k - 1) * act, "working": recv}

        cands.append(_peak_over(tr, at(lambda g: int(g * scale), n0))[:2])  # the first backward: gradients arriving
        if n1:
            cands.append(_peak_over(tr, at(lambda g: G, n1))[:2])  # later ones: every gradient exists
    # _sync_grads concatenates the gradients per dtype for one all-reduce; under ep the experts' first, apart
    ge = states.get("expert_grads", 0)
    flat = max(G - ge if lay.dp > 1 else 0, ge)
    step = {"params": P + bufs, "grads": G, "optimizer": S,
            "working": recv + flat + _step_temp(largest, G, dev, lay.opt)}
    cats, phase = _max_cats(*cands, (step, "optimizer step"))
    ranks = [d * pp * tp + s * tp + t for d in range(lay.dp) for t in range(tp)]
    role = f"stage {s}" + (f" (stages {stage_ids})" if len(stage_ids) > 1 else "") if pp > 1 else ""
    if tp > 1:
        nd_mode = _nd_mode(pl)
        role = (role + " · " if role else "") + f"tp shard 1/{tp}" + (f" ({nd_mode})" if nd_mode != "1d" else "")
    group = RankPlan(ranks, role, {dev: _tier(dev, lay.env.capacity(dev), cats, phase)}, states)
    return group, G, boundary


def _expert_share(lay: _Layout, params: Dict[str, int]) -> Tuple[Dict[str, int], Dict[str, int]]:
    """A rank's parameter bytes by name under ep (each grouped expert weight ``1/ep``), and the model
    states it holds, the experts' apart (``RankPlan.states``); the step's all-to-all bytes there too."""
    if lay.moe is None:
        return params, {}
    names = moe_plan.expert_names(lay.moe)
    out = {n: (b // lay.ep if moe_plan.is_expert(n, names) else b) for n, b in params.items()}
    ge = sum(b for n, b in out.items() if moe_plan.is_expert(n, names))
    mine = moe_plan.layers_in(lay.moe, params)
    dtype = next((p.dtype for p in lay.m.meta.parameters() if p.is_floating_point()), torch.float32)
    rows = lay.micro * lay.m.seq  # every tp rank of an EP group routes the same rows
    a2a = moe_plan.all_to_all_bytes(mine, rows, lay.ep, dtype.itemsize, lay.mb_n)
    return out, {"expert_params": ge, "expert_grads": ge, "moe_layers": len(mine), "all_to_all": a2a}


def _state_bytes(lay: _Layout, params: Dict[str, int], states: Dict[str, int], notes: List[str]) -> int:
    """Optimizer state of a rank: AdamW's moments per element; ZeRO-1 splits the non-expert part over dp and
    the experts' over the expert-dp group (``dp / ep`` ranks; none to split when ``dp == ep``)."""
    ge = states.get("expert_params", 0)
    expert = ge // 4
    dense = sum(n // 4 for n in params.values()) - expert  # elements as fp32 masters, per tensor as before
    if lay.plugin.zero_stage == 1 and lay.dp > 1:
        edp = lay.dp // lay.ep
        notes.append("ZeRO-1 over dp: optimizer state taken as an even split "
                     "(ZeroRedundancyOptimizer's greedy partition)")
        se = _opt_bytes(-(-expert // edp), lay.opt)
        sd = _opt_bytes(-(-dense // lay.dp), lay.opt)
    else:
        se, sd = _opt_bytes(expert, lay.opt), _opt_bytes(dense, lay.opt)
    if lay.moe is not None:
        states["expert_optimizer"] = se
    return sd + se


def _ep_notes(lay: _Layout) -> List[str]:
    return [f"expert parallel ep={lay.ep}: each rank holds 1/{lay.ep} of every grouped expert weight, its gradient "
            f"and optimizer state (gradients all-reduced over the expert-dp group of {lay.dp // lay.ep}); "
            "all-to-all bytes for routing balanced over the EP group; activations traced with every expert local "
            "(as many rows per rank as under balanced routing), the all-to-all buffers not in the trace"]


def _stage_traces(lay: _Layout, stage_ids, worst_act: dict) -> Tuple[List[Tuple[int, _Trace]], Dict[str, int], int]:
    """The traces of a pipeline rank's (virtual) stages, its parameters' bytes by name and its buffer
    bytes; the largest activations of any stage go to ``worst_act``."""
    traces, params, bufs = [], {}, 0
    for sid in stage_ids:
        key = lay.key(sid)
        tr = lay.trace(sid)
        traces.append((sid, tr))
        part = ((dict(tr.param_bytes), tr.buffer_bytes) if tr.param_bytes is not None
                else _stage_params(lay.m, key, lay.tp_arg))
        params.update(part[0])
        bufs += part[1]
        summ = _acts_summary(lay.m, lay.ac, autocast=lay.low, micro=lay.micro, stage=key, tp=lay.tp_arg)
        worst_act["without_checkpointing"] = max(worst_act["without_checkpointing"], summ["without_checkpointing"])
        if worst_act["with_checkpointing"] is not None and summ["with_checkpointing"] is not None:
            worst_act["with_checkpointing"] = max(worst_act["with_checkpointing"], summ["with_checkpointing"])
    return traces, params, bufs


def _boundary_bytes(lay: _Layout, traces) -> int:
    """One microbatch's bytes crossing this rank's stage boundaries: the previous stage's output
    coming in, this stage's going out (each also comes back as a gradient)."""
    n, total = lay.spec.num_stages, 0
    for sid, tr in traces:
        if sid > 0:
            total += _meta_bytes(lay.trace(sid - 1).out_meta)
        if sid < n - 1:
            total += _meta_bytes(tr.out_meta)
    return total


def _tp_notes(lay: _Layout) -> List[str]:
    pl = lay.plugin
    if pl.tp_size > 1 and _nd_mode(pl) != "1d":
        return [f"tensor parallel {_nd_mode(pl)}: each rank's layers traced in their grid form on its blocks and rows, "
                "collectives on a fake process group (what they receive and gather is counted)"]
    if pl.tp_size > 1:
        tr0 = lay.trace(0)
        if lay.spec.num_stages == 1 and reads_dict_plan(lay.m.meta) and not lay.m.shapes_only:
            head = ("vocabulary-sharded, the loss computed on the shards (loss_parallel)" if lay.tp_arg[1].loss_parallel
                    else "gathered whole (loss_parallel=False)")
            notes = ["tensor parallel: each rank traced as the plugin shards it (DTensor over a fake process group: "
                     f"its shards and the collectives' buffers); the LM head's logits {head}"]
        else:
            notes = ["tensor parallel: parameters of the plan's Linear/Embedding layers at their shard's shape; "
                     "the all-reduce of row-parallel outputs is not in the trace"]
        if tr0.error:
            notes.append(tr0.error)
        return notes
    return []


def _in_flight(style: str, pp: int, s: int, m: int, j: int) -> int:
    """Microbatches forwarded but not yet backwarded on pipeline rank ``s`` when backward ``j``
    starts: GPipe holds all of them, 1F1B (and, approximately, the interleaved and zero-bubble
    schedules) ``pp - s`` at most."""
    if pp == 1:
        return 1
    if style == "gpipe":
        return m - j
    return max(1, min(m - j, pp - s))


def _meta_bytes(meta) -> int:
    shape, dtype = meta
    return math.prod(shape) * dtype.itemsize


def _stage_params(m, stage, tp_arg) -> Tuple[Dict[str, int], int]:
    """``({name: bytes}, buffer bytes)`` of one pipeline stage's part on one tensor-parallel rank."""
    if tp_arg and isinstance(tp_arg[1], _NdKey):  # the converted modules' own blocks
        tr = m.trace(ac=False, stage=stage, tp=tp_arg)
        return dict(tr.param_bytes), tr.buffer_bytes
    part = m.meta
    if stage is not None:
        from ...pipeline.stage import split_stage

        part = split_stage(m.meta, *stage)
    shapes = _tp_shapes(m.meta, tp_arg[0], tp_arg[1].plan) if tp_arg else {}
    out = {}
    for n, p in _unique_params(part):
        shape = shapes.get(n, p.shape)
        out[n] = math.prod(shape) * p.dtype.itemsize
    return out, sum(_nbytes(b) for b in part.buffers())
