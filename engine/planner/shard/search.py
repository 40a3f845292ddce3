"""``cl.autoshard``: a tensor-parallel strategy for every ``nn.Linear``, the fastest predicted
within a memory budget per rank.

Each region's Pareto set of (memory, time) (:mod:`.regions`; identical regions solved once) is
merged with the others' by a dynamic program over regions, a multiple-choice knapsack on memory
that keeps the fastest plan within ``device_memory``; the final Pareto set is ``plan.frontier``.
2D (``tp_nd``'s SUMMA) is one setting for the whole plugin that converts every parameter, so it
is priced as a whole-model alternative (``modes=("1d", "2d")``), not as a per-operator strategy.
"""
from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch.nn as nn

from .costs import CalibratedCosts, CostAdapter, ShardCosts, calibrate_shard_costs, is_layout_calibration
from .graph import ShardGraph, analyse
from .ops import activation_bytes
from .regions import Option, region_options
from .result import ShardPlan
from .strategies import BYTES_PER_PARAM, STRATEGIES

_FRONTIER_POINTS = 4096  # the knapsack's Pareto set is thinned to about this many plans


def autoshard(model: nn.Module, example_inputs, tp_size: int, *, device_memory: Optional[float] = None,
              costs=None, activations: bool = True, modes: Sequence[str] = ("1d",),
              max_region_options: int = 4096, graph: Optional[ShardGraph] = None,
              fixed: Optional[Dict[str, str]] = None) -> ShardPlan:
    """Choose a tensor-parallel strategy for every ``nn.Linear`` of ``model`` (docs/autoshard.md).

    ``example_inputs``: forward's positional arguments for one rank's batch of a step (shapes set the
    token counts and activations). ``device_memory``: bytes per rank (None: no limit). ``costs``:
    :class:`ShardCosts` / :func:`calibrate_shard_costs`'s result / ``cl.autoplan``'s ``AutoPlan.calibration``
    (:class:`CalibratedCosts`: the same measurements as the layout search) / a costs-like object; None: calibrate on the
    ranks when torch.distributed is up (every rank must call), else nominal :class:`ShardCosts`.
    ``modes``: add ``"2d"`` to price tp_nd's SUMMA for the whole model. ``graph``: a previous plan's
    ``plan.graph`` (same model, inputs and ``tp_size``) to skip tracing. ``fixed``: ``{linear name:
    strategy}`` pinned (a :data:`STRATEGIES` key); the rest are searched."""
    fixed = _check_args(model, tp_size, device_memory, modes, fixed, graph)
    if costs is None:
        costs = _default_costs()
    t0 = time.perf_counter()
    g = graph if graph is not None else analyse(model, example_inputs, tp_size)
    t1 = time.perf_counter()
    if is_layout_calibration(costs):
        tokens = max(l.tokens for l in g.linears.values()) if g.linears else 1
        costs = CalibratedCosts(costs, sum(6.0 * l.tokens * l.in_features * l.out_features
                                           for l in g.linears.values()), tokens)
    cost = CostAdapter(costs)
    _check_graph(model, g, tp_size, fixed)
    per_region = _options(g, cost, tp_size, activations, max_region_options, fixed)
    const = g.const_param_elems * BYTES_PER_PARAM + (g.const_act if activations else 0)
    budget = math.inf if device_memory is None else float(device_memory)
    frontier = _knapsack(per_region, const, budget, model, tp_size, device_memory, activations)
    plan = _plan(g, frontier, tp_size, device_memory, activations)
    if "2d" in modes and tp_size > 1:
        _consider_2d(plan, model, g, cost, activations, budget, modes)
    plan.plan_s, plan.trace_s = time.perf_counter() - t0, (t1 - t0)
    return plan


def _check_args(model, tp_size, device_memory, modes, fixed, graph) -> Dict[str, str]:
    """Every argument checked before tracing; returns ``fixed`` as a dict."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"autoshard: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"autoshard: tp_size={tp_size!r} must be an int >= 1 (the ranks of the tensor-parallel group)")
    if device_memory is not None and (isinstance(device_memory, bool) or not isinstance(device_memory, (int, float))
                                      or not device_memory > 0):
        raise ValueError(f"autoshard: device_memory={device_memory!r} must be bytes per rank > 0 (e.g. 256 << 20), "
                         "or None for no limit")
    bad = [m for m in modes if m not in ("1d", "2d")]
    if bad or not modes:
        raise ValueError(f"autoshard: modes={tuple(modes)!r}; choose from ('1d', '2d')")
    fixed = dict(fixed or {})
    bad = {n: s for n, s in fixed.items() if s not in STRATEGIES}
    if bad:
        raise ValueError(f"autoshard: fixed={bad!r}: strategies are {tuple(STRATEGIES)}")
    if graph is not None and graph.tp_size != tp_size:
        raise ValueError(f"autoshard: graph= was analysed for tp_size={graph.tp_size}, not {tp_size}")
    return fixed


def _default_costs():
    """Measured on the ranks when torch.distributed is up with more than one, else nominal."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return calibrate_shard_costs()
    return ShardCosts()


def _check_graph(model, g: ShardGraph, tp_size: int, fixed: Dict[str, str]) -> None:
    """Something to shard, and every pinned strategy applicable."""
    if not g.linears:
        raise ValueError(f"autoshard: {type(model).__name__} calls no nn.Linear on these inputs; nothing to shard")
    if tp_size > 1 and g.hf_plan and all(len(l.options) == 1 for l in g.linears.values()):
        raise ValueError(f"autoshard: the tensor-parallel plan of {type(model).__name__} cuts no nn.Linear that "
                         f"tp_size={tp_size} divides (its cut layers may be Conv1D or packed weights, which are not "
                         f"searched); use its own plan: HybridParallelPlugin(tp_size={tp_size})")
    if tp_size > 1 and all(len(l.options) == 1 for l in g.linears.values()):
        feats = sorted({(l.in_features, l.out_features) for l in g.linears.values()})[:6]
        raise ValueError(f"autoshard: tp_size={tp_size} divides the features of no nn.Linear of {type(model).__name__} "
                         f"(in, out: {feats}); choose a tp_size dividing them")
    for name, strat in fixed.items():
        lin = g.lin_by_name.get(name)
        if lin is None:
            raise ValueError(f"autoshard: fixed names {name!r}, which is not an nn.Linear the forward calls; "
                             f"the linears are {g.linear_names[:8]}{' ...' if len(g.linear_names) > 8 else ''}")
        if strat not in lin.options:
            kind = STRATEGIES[strat][0]
            why = (f"tp_size={tp_size} does not divide its {'out' if kind == 'col' else 'in'}_features="
                   f"{lin.out_features if kind == 'col' else lin.in_features}" if tp_size > 1 and kind != "R"
                   else f"tp_size={tp_size}" if kind != "R" else "")
            why = why or "it is tied to another module's parameter or called more than once"
            raise ValueError(f"autoshard: fixed {name!r} to {strat!r}, which cannot apply: {why}")


def _options(g: ShardGraph, cost: CostAdapter, tp_size: int, activations: bool, limit: int,
             fixed: Dict[str, str]) -> List[List[Option]]:
    """Each region's Pareto set, identical regions (same signature and pins) solved once."""
    cache: Dict[tuple, List[Option]] = {}
    per_region = []
    for r in g.regions:
        key = (r.signature(), tuple(fixed.get(l.name) for l in r.lins))
        if key not in cache:
            cache[key] = region_options(r, cost, tp_size, activations, limit, fixed)
        if not cache[key]:
            if any(l.name in fixed for l in r.lins):
                raise ValueError(f"autoshard: fixed={ {l.name: fixed[l.name] for l in r.lins if l.name in fixed} } "
                                 f"leaves no consistent layout for {[l.name for l in r.lins]} "
                                 "(a sharded tensor would reach an op that needs it whole)")
            raise RuntimeError(f"autoshard: no consistent layout for linears {[l.name for l in r.lins]} (not even "
                               "replicated); please report this model")
        per_region.append(cache[key])
    return per_region


def _knapsack(per_region: List[List[Option]], const: float, budget: float, model, tp_size: int,
              device_memory, activations: bool) -> List[Tuple[float, float, tuple]]:
    """The Pareto set of (memory, time, path) over all regions' choices within ``budget``, each
    path a linked list ``(path, option)`` back to ``()``, thinned to stay small."""
    frontier: List[Tuple[float, float, tuple]] = [(float(const), 0.0, ())]
    for opts in per_region:
        merged = [(m + o.mem, t + o.time, (path, o)) for m, t, path in frontier for o in opts if m + o.mem <= budget]
        if not merged:
            least = sum(min(o.mem for o in opts) for opts in per_region) + const
            raise ValueError(f"autoshard: {type(model).__name__} needs at least {least / (1 << 20):.2f} MiB per rank "
                             f"at tp_size={tp_size} (every linear sharded), over device_memory="
                             f"{device_memory / (1 << 20):.2f} MiB; raise tp_size or the budget"
                             f"{', or pass activations=False to count parameters only' if activations else ''}")
        merged.sort(key=lambda x: (x[0], x[1]))
        frontier = []
        for m, t, p in merged:
            if not frontier or t < frontier[-1][1] - 1e-15:
                frontier.append((m, t, p))
        if len(frontier) > _FRONTIER_POINTS:
            step = len(frontier) / _FRONTIER_POINTS
            frontier = [frontier[int(i * step)] for i in range(_FRONTIER_POINTS)] + [frontier[-1]]
    return frontier


def _plan(g: ShardGraph, frontier, tp_size: int, device_memory, activations: bool) -> ShardPlan:
    """The fastest plan of the frontier, as each linear's strategy and input layout."""
    mem, best_t, path = min(frontier, key=lambda x: (x[1], x[0]))
    chosen: List[Option] = []
    while path:
        path, o = path
        chosen.append(o)
    chosen.reverse()
    strategies = {n: "replicated" for n in g.linear_names}
    inputs = {n: "whole" for n in g.linear_names}
    params = g.const_param_elems * 4.0
    for r, o in zip(g.regions, chosen):
        for lin, s, i in zip(r.lins, o.picks, o.inputs):
            strategies[lin.name], inputs[lin.name] = s, ("whole" if i is None else "sharded")
        params += o.params
    state = int(round(params * 4))
    plan = ShardPlan(tp_size=tp_size, mode="1d", strategies=strategies, inputs=inputs, predicted_s=best_t,
                     compute_s=sum(o.compute for o in chosen), comm_s=sum(o.comm for o in chosen),
                     param_bytes=int(round(params)), state_bytes=state,
                     activation_bytes=max(0, int(round(mem)) - state) if activations else 0,
                     device_memory=None if device_memory is None else int(device_memory),
                     frontier=[(int(m), t) for m, t, _ in frontier], model_name=g.model_name, graph=g,
                     hf_styles=g.hf_plan)
    plan.alternatives["1d"] = (best_t, plan.memory_bytes)
    return plan


def _consider_2d(plan: ShardPlan, model, g: ShardGraph, cost: CostAdapter, activations: bool, budget: float,
                 modes: Sequence[str]) -> None:
    """Price 2D for the whole model; take it where it is faster within the budget (or the only
    mode asked for)."""
    alt = _nd_alternative(model, g, "2d", cost, activations)
    if alt is not None:
        t2, m2, p2, c2, k2 = alt
        plan.alternatives["2d"] = (t2, m2)
        if m2 <= budget and (t2 < plan.predicted_s or "1d" not in modes):
            plan.mode, plan.predicted_s, plan.compute_s, plan.comm_s = "2d", t2, c2, k2
            plan.param_bytes, plan.state_bytes = p2, p2 * 4
            plan.activation_bytes = m2 - p2 * 4
    elif "1d" not in modes:
        raise ValueError(f"autoshard: 2D does not apply to {type(model).__name__} at tp_size={g.tp_size} (a square "
                         ">= 4 whose root divides every sharded size, every parameter given a tp_nd role)")


def _nd_alternative(model, graph: ShardGraph, mode: str, costs: CostAdapter, activations: bool):
    """(seconds, memory bytes, param bytes, compute seconds, comm seconds) of the whole model under
    ``tp_nd``'s ``mode``, or None where it does not apply: ``tp_nd.volume.textbook``'s bytes as
    all-reduce payload plus ``6·q`` latencies per linear, all linears' FLOPs over ``tp``, every
    parameter and activation ``1/tp``."""
    from ... import tp_nd
    from ...tp_nd.grid import factor

    tp = graph.tp_size
    try:
        sizes = factor(mode, tp, 1)
        if not (callable(getattr(model, "tp_nd_plan", None)) or callable(getattr(model, "tp_plan", None))):
            return None  # the plugin takes 2D roles from the model contract only
        plan1d = None
        roles = tp_nd.resolve_plan(model, plan1d)
        tp_nd.check(model, roles, mode, sizes, tp)
    except (ValueError, KeyError, TypeError):
        return None
    q = sizes["row"]
    tokens = max((l.tokens for l in graph.linears.values()), default=0)
    nbytes = sum(tp_nd.textbook(model, mode, tp, tokens, tp_plan=plan1d).values())
    n_lin = sum(1 for r in roles.values() if r[0] in ("colwise", "rowwise", "head"))
    lat = costs.allreduce(tp, 1)  # per collective; the bytes as all-reduce payload, as cl.autoplan prices N-d
    comm = nbytes * (costs.allreduce(tp, 1 << 21) - costs.allreduce(tp, 1 << 20)) / (1 << 20) + n_lin * 6 * q * lat
    compute = sum(costs.compute(6.0 * l.tokens * l.in_features * l.out_features / tp) for l in graph.linears.values())
    elems = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    act = ((graph.const_act + sum(activation_bytes(n) for r in graph.regions for n in r.nodes)) / tp
           if activations else 0)
    return compute + comm, int(elems * BYTES_PER_PARAM / tp + act), int(elems * 4 / tp), compute, comm
