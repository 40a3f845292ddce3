"""``cl.autoshard``: per-operator tensor-parallel strategies for every ``nn.Linear``, searched on the
model's graph (issue #19's stretch; Colossal-AI's auto-parallel idea, 1D strategies only).

```python
plan = cl.autoshard(model, (example_batch,), tp_size=2, device_memory=64 << 20)
plan                      # table: each linear's strategy, predicted step time, memory per rank
plugin = HybridParallelPlugin(tp_size=2, tp_plan=plan.tp_plan())
```

**What it is built on.** The repo's GPT is not ``torch.fx.symbolic_trace``-able (``forward`` branches
on ``idx.shape`` and on Python state), so the graph comes from ``torch.export.export(model,
example_inputs, strict=False)``: an ATen-level ``torch.fx`` GraphModule with concrete shapes on every
node, in which each ``nn.Linear`` call is one ``aten.linear`` node whose weight placeholder names the
module (``graph_signature.inputs_to_parameters``). The same path traces a plain user module.
Exporting runs the model once on fake tensors; on this 2-core box it takes seconds (the tiny GPT:
~10 s under load), so a plan keeps its analysis in ``plan.graph`` and ``autoshard(...,
graph=plan.graph)`` re-plans at another budget, size of collectives or cost without tracing again.

**Strategies** of one linear (``tp`` ranks, ``N`` tokens, ``in``/``out`` features), and what DTensor
does for them (costs are forward + backward, bytes of the whole tensor):

==================  =============================================  ====================================
``replicated``      whole weight on every rank                     none (a sharded input is gathered)
``column``          weight rows cut: output ``Shard(-1)`` kept     input grad all-reduce ``N·in``
``column+gather``   the same, output all-gathered (``Replicate``)  + all-gather ``N·out``
``row``             weight columns cut: output partial, reduced    all-reduce ``N·out``
``row+scatter``     the same, output reduce-scattered ``Shard(-1)``  reduce-scatter + all-gather ``N·out``
==================  =============================================  ====================================

A ``row`` linear whose input arrives whole slices it locally (backward all-gathers ``N·in``); a
``column`` linear whose input arrives sharded gathers it (all-gather + reduce-scatter ``N·in``). Each
becomes the matching ``ColwiseParallel``/``RowwiseParallel`` (input/output layouts set) in
:meth:`ShardPlan.tp_plan`; a replicated linear is absent from it, unless a sharded input reaches it
(then a ``PrepareModuleInput`` gathers it).

**2D is not a per-operator strategy here, and says so.** :mod:`colossal_lab.engine.tp_nd`'s SUMMA
layers cannot be mixed with 1D linears: ``tp_mode`` is one choice for the whole plugin, 2D converts
every parameter of the model (a parameter without a role is an error), keeps activations in the
grid's block layout (batch rows × hidden columns) rather than DTensor's, and cuts each batch over
the grid. So ``modes=("1d", "2d")`` prices 2D only as a *whole-model* alternative, where it really
applies (a model with ``tp_nd_plan()``/``tp_plan()``, whose every parameter ``tp_nd.resolve_plan``
gives a role; ``tp_size`` a square ≥ 4; the sizes dividing by ``tp_nd.check``): its communication is ``tp_nd.volume.textbook``'s bytes per rank
as all-reduce payload plus ``6·q`` collective latencies per linear, its compute all linears' FLOPs
over ``tp``, every parameter held ``1/tp`` (``plan.mode == "2d"``; :meth:`ShardPlan.plugin_kwargs`
then gives ``tp_mode="2d"``). It is off by default.

**Layouts between operators.** A tensor is whole (``R``) or cut along one dimension (``S(d)``).
Elementwise ops keep ``S(d)`` when every operand is cut alike or broadcasts along ``d`` (size 1);
transposes/permutes move ``d``; a view/reshape keeps the cut when the elements before ``d`` are the
same on both sides and the new dimension divides by ``tp`` (the attention's head split works when
heads divide by ``tp`` and the code passes ``-1`` there, as the GPT does: the local shard runs the
same Python); SDPA takes q/k/v cut over heads; ``select``/``slice``/softmax/reductions keep a cut on
another dimension. Everything else (norms' reductions, a residual add with a whole tensor, the
output, embedding, unknown ops) needs ``R``. A layout can change only where DTensor changes it, at a
linear's input or output: a sharded tensor reaching any other op that needs it whole makes the
choice infeasible (there is no module boundary to gather it at), it is not silently priced.

**Cost model.** Step time = Σ linear FLOPs (``6·N·in·out``, over ``tp`` when sharded) / ``flops`` +
Σ collectives (``latency + bytes × s_per_byte``, all-reduce and all-gather separately; reduce-scatter
priced as an all-gather). Everything else (attention, norms, the optimizer) is the same for every
choice and left out: ``predicted_s`` is the *part that differs*, not a whole step. Memory per rank =
16 B per fp32 parameter element (weight, gradient, AdamW's two moments; ``/tp`` for sharded weights;
a row-parallel bias stays whole) + an activation estimate (every non-view op's output kept for
backward, ``/tp`` where sharded: an upper bound, ``activations=False`` drops it). ``costs``:
:class:`ShardCosts` (nominal figures), :func:`calibrate` (measured on the tp group's real ranks with
torch.distributed collectives), ``cl.autoplan``'s ``AutoPlan.calibration`` (:class:`CalibratedCosts`:
the layout search's own measurements, so both price a step alike), or any object with ``compute(flops)``, ``allreduce(k, nbytes)`` and
optionally ``allgather(k, nbytes)``.

**Solver.** Tensors that are whole under every choice (produced by an op that needs ``R``, or an
elementwise op with a full-size whole operand, as a residual add) cut the graph into independent
*regions* (a transformer block gives two: q/k/v + attention + out-projection, and the MLP). Each
region's choices are enumerated exhaustively (5 strategies per linear; regions over
``max_region_options`` fall back to 3, then to coordinate descent), propagating layouts through its
ops; identical regions (the repeated blocks) are solved once. The regions' Pareto sets (time,
memory) are merged by a dynamic program over regions (a multiple-choice knapsack on memory) that
keeps the fastest plan within ``device_memory``.

**Limits.** Linears only (embeddings and norms stay whole in 1D); no sequence parallelism; no
overlap of communication with compute; a branch point (a tensor used by several ops) is handled by
requiring every user to agree on its layout, which is conservative; the cost of elementwise ops on
a shard is not credited; a view with a hard-coded full width (not ``-1``) after a sharded linear is
judged infeasible.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

__all__ = ["autoshard", "ShardPlan", "ShardCosts", "CalibratedCosts", "ShardGraph", "calibrate", "analyse", "STRATEGIES"]

#: strategy name -> (kind, output): kind "R" | "col" | "row"
STRATEGIES: Dict[str, Tuple[str, str]] = {
    "replicated": ("R", "-"), "column": ("col", "keep"), "column+gather": ("col", "gather"),
    "row": ("row", "reduce"), "row+scatter": ("row", "scatter")}
_BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq


# ---- costs --------------------------------------------------------------------------------------

@dataclass
class ShardCosts:
    """Seconds for the pieces a strategy changes. ``flops``: one rank's matmul rate (flop/s); a
    collective over ``k > 1`` ranks of a tensor of ``nbytes`` (the whole tensor) costs ``latency +
    nbytes × s_per_byte``. The defaults are nominal (a CPU rank, loopback gloo), not measured:
    use :func:`calibrate` on the ranks for real figures."""

    flops: float = 20e9
    allreduce_s_per_byte: float = 1 / 1e9
    allreduce_latency: float = 50e-6
    allgather_s_per_byte: float = 1 / 2e9
    allgather_latency: float = 50e-6

    def compute(self, flops: float) -> float:
        return flops / self.flops

    def allreduce(self, k: int, nbytes: float) -> float:
        return 0.0 if k <= 1 or nbytes <= 0 else self.allreduce_latency + nbytes * self.allreduce_s_per_byte

    def allgather(self, k: int, nbytes: float) -> float:
        return 0.0 if k <= 1 or nbytes <= 0 else self.allgather_latency + nbytes * self.allgather_s_per_byte


def _line(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    (b0, s0), (b1, s1) = points[0], points[-1]
    slope = max(0.0, (s1 - s0) / (b1 - b0)) if b1 != b0 else 0.0
    return max(0.0, s0 - slope * b0), slope


def calibrate(group=None, sizes: Sequence[int] = (64 << 10, 4 << 20), reps: int = 3, matmul: int = 256) -> ShardCosts:
    """Measure :class:`ShardCosts` on the ranks of ``group`` (default: the world), with real
    torch.distributed collectives. Every rank of the group must call it; all return the same
    figures (the slowest rank's, agreed by an all-reduce MAX)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("autoshard.calibrate: torch.distributed is not initialised; call it on the ranks "
                           "(a %%colossal cell, a torchrun script) or pass costs=ShardCosts(...)")
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def timed(fn) -> float:
        fn()
        best = math.inf
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier(group=group)
            t = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    a = torch.randn(matmul, matmul, device=dev)
    k = dist.get_world_size(group)
    mm = timed(lambda: a @ a)
    ar, ag = [], []
    for n in sizes:
        x = torch.zeros(n // 4, device=dev)
        ar.append((float(n), timed(lambda: dist.all_reduce(x, group=group))))
        piece = torch.zeros(n // 4 // k, device=dev)
        out = [torch.empty_like(piece) for _ in range(k)]
        ag.append((float(n), timed(lambda: dist.all_gather(out, piece, group=group))))
    figures = torch.tensor([mm, *(s for _, s in ar), *(s for _, s in ag)], dtype=torch.float64, device=dev)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
    f = figures.tolist()
    n = len(sizes)
    ar = [(b, s) for (b, _), s in zip(ar, f[1:1 + n])]
    ag = [(b, s) for (b, _), s in zip(ag, f[1 + n:])]
    (arl, ars), (agl, ags) = _line(ar), _line(ag)
    return ShardCosts(flops=2 * matmul ** 3 / max(f[0], 1e-9), allreduce_s_per_byte=ars, allreduce_latency=arl,
                      allgather_s_per_byte=ags, allgather_latency=agl)


class CalibratedCosts:
    """``cl.autoplan``'s cost model for the solver: an ``AutoPlan.calibration`` (measured on the
    ranks by ``colossal_lab.engine.planner.layout.calibrate``) read as :class:`ShardCosts`'s functions, so
    both searches price a step from the same measurements. The matmul rate is the whole model's
    linear FLOPs (``6·N·in·out`` at the graph's tokens) over its measured forward+backward there,
    which charges attention, norms and the rest to the linears (a rate on the low side: the
    compute a cut saves is, if anything, over-counted); all-reduces are the calibration's curve for
    the group size (piecewise through 1 KiB, 64 KiB and 4 MiB); an all-gather is the all-reduce of
    half the bytes (a ring all-reduce is a reduce-scatter plus an all-gather)."""

    def __init__(self, calibration: Dict[str, Any], linear_flops: float, tokens: int):
        from .layout import Costs

        self.calibration, self._c = calibration, Costs(calibration)
        fb = self._c.forward_backward(1, tokens) if 1 in self._c._fb else None
        if not fb:
            raise ValueError("autoshard(costs=calibration): it has no forward+backward timed at tp 1; pass an "
                             "AutoPlan.calibration from cl.autoplan on this model")
        self.flops = linear_flops / fb

    def compute(self, flops: float) -> float:
        return flops / self.flops

    def allreduce(self, k: int, nbytes: float) -> float:
        if k <= 1 or nbytes <= 0:
            return 0.0
        if not (self.calibration["allreduce"].get(k) or self.calibration["allreduce"].get(str(k))):
            raise ValueError(f"autoshard(costs=calibration): no all-reduce measured on groups of {k}; calibrate "
                             f"with cl.autoplan on a world where tp_size={k} is a candidate")
        return self._c.allreduce(k, nbytes)

    def allgather(self, k: int, nbytes: float) -> float:
        return self.allreduce(k, nbytes / 2)


class _CostAdapter:
    """Any costs object as the three functions the solver uses (all-gather, if missing, priced as
    half an all-reduce: a ring all-reduce is a reduce-scatter plus an all-gather)."""

    def __init__(self, costs):
        for need in ("compute", "allreduce"):
            if not callable(getattr(costs, need, None)):
                raise TypeError(f"autoshard: costs={type(costs).__name__} has no {need}(); pass a "
                                "colossal_lab.engine.planner.shard.ShardCosts (or calibrate() on the ranks), or an object with "
                                "compute(flops), allreduce(k, nbytes) and allgather(k, nbytes)")
        self.c = costs

    def compute(self, flops):
        return self.c.compute(flops)

    def allreduce(self, k, nbytes):
        return self.c.allreduce(k, nbytes) if k > 1 and nbytes > 0 else 0.0

    def allgather(self, k, nbytes):
        if k <= 1 or nbytes <= 0:
            return 0.0
        own = getattr(self.c, "allgather", None)
        return own(k, nbytes) if callable(own) else 0.5 * self.c.allreduce(k, nbytes)


# ---- the graph ----------------------------------------------------------------------------------

class _Conflict(Exception):
    """A layout no module boundary can fix: this combination of strategies is infeasible."""


@dataclass
class _Linear:
    name: str
    node: Any
    in_features: int
    out_features: int
    bias: bool
    tokens: int
    elem: int  # bytes per activation element
    options: Tuple[str, ...]


def _shape(node) -> Optional[Tuple[int, ...]]:
    v = node.meta.get("val") if hasattr(node, "meta") else None
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def _nbytes(node) -> int:
    v = node.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


_VIEWS = {"view", "reshape", "_unsafe_view", "unflatten", "flatten", "unsqueeze", "squeeze", "alias", "detach",
          "transpose", "permute", "t", "select", "slice", "expand", "contiguous"}
_PASS = {"dropout", "native_dropout", "to", "_to_copy", "type_as", "clone", "contiguous", "alias", "detach",
         "lift_fresh_copy"}
_IGNORED = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"}


def _opname(node) -> str:
    t = node.target
    name = getattr(getattr(t, "_overloadpacket", None), "__name__", None)
    return name or getattr(t, "__name__", str(t))


def _is_pointwise(node) -> bool:
    tags = getattr(node.target, "tags", ()) or ()
    return torch.Tag.pointwise in tags or _opname(node) in _PASS


class ShardGraph:
    """The analysed graph: the linears with their strategies, the regions, constant memory. Reused
    across plans (``autoshard(..., graph=plan.graph)``); not picklable (it holds the fx graph)."""

    def __init__(self, model: nn.Module, example_inputs: tuple, tp_size: int, trace_s: float, gm):
        self.model_name, self.tp_size, self.trace_s = type(model).__name__, tp_size, trace_s
        self.gm = gm
        graph = gm.graph
        self.nodes = [n for n in graph.nodes if n.op == "call_function"]
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.output_args = set()
        for n in graph.nodes:
            if n.op == "output":
                torch.fx.node.map_arg(n.args, lambda a: self.output_args.add(a))
        self.linears: Dict[Any, _Linear] = {}
        self.lin_by_name: Dict[str, _Linear] = {}
        self.param_elems: Dict[str, int] = {}
        self.const_param_elems = 0
        self._find_linears(model)
        self._maybe()
        self._regions()

    # which linear nodes are nn.Linear modules, with their allowed strategies
    def _find_linears(self, model: nn.Module) -> None:
        sig = self.gm_signature
        to_param = dict(getattr(sig, "inputs_to_parameters", {}) or {})
        mods = dict(model.named_modules())
        owners: Dict[int, List[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), []).append(n)
        tp = self.tp_size
        covered = set()
        for node in self.nodes:
            if _opname(node) != "linear":
                continue
            w = node.args[1]
            pname = to_param.get(getattr(w, "name", None))
            if not pname or not pname.endswith(".weight") and pname != "weight":
                continue
            mname = pname[:-len("weight")].rstrip(".")
            mod = mods.get(mname)
            if not isinstance(mod, nn.Linear):
                continue
            tied = len(owners.get(id(mod.weight), ())) > 1
            opts = ["replicated"]
            if tp > 1 and not tied and mname not in self.lin_by_name:
                if mod.out_features % tp == 0:
                    opts += ["column", "column+gather"]
                if mod.in_features % tp == 0:
                    opts += ["row", "row+scatter"]
            x = node.args[0]
            xs = _shape(x)
            lin = _Linear(mname, node, mod.in_features, mod.out_features, mod.bias is not None,
                          int(math.prod(xs) // mod.in_features) if xs else 0,
                          x.meta["val"].element_size() if xs else 4, tuple(opts))
            if mname in self.lin_by_name:  # called twice: one strategy for both calls is not modelled
                self.lin_by_name[mname].options = ("replicated",)
                lin.options = ("replicated",)
            self.linears[node] = lin
            self.lin_by_name.setdefault(mname, lin)
            covered.add(id(mod.weight))
            if mod.bias is not None:
                covered.add(id(mod.bias))
        seen = set()
        for n, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) not in covered:
                self.const_param_elems += p.numel()
        self.linear_names = list(self.lin_by_name)

    # a node whose output can be sharded under some choice of strategies
    def _maybe(self) -> None:
        maybe = set()
        for node in self.nodes:
            if node in self.linears:
                if len(self.linears[node].options) > 1 or any(a in maybe for a in node.all_input_nodes):
                    maybe.add(node)
                continue
            name = _opname(node)
            ins = [a for a in node.all_input_nodes if a in maybe]
            if not ins or name in _IGNORED or not _flexible(node):
                continue
            if _is_pointwise(node) and name not in ("type_as", "to", "_to_copy"):
                out = _shape(node)
                if out is not None and any(a not in maybe and _shape(a) == out for a in _tensor_args(node)):
                    continue  # a full-size whole operand (a residual add): the result is whole or infeasible
            maybe.add(node)
        self.maybe = maybe

    def _regions(self) -> None:
        parent = {n: n for n in self.maybe}

        def find(n):
            while parent[n] is not n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        for node in self.maybe:
            for a in node.all_input_nodes:
                if a in self.maybe:
                    parent[find(a)] = find(node)
        groups: Dict[Any, List[Any]] = {}
        for n in self.maybe:
            groups.setdefault(find(n), []).append(n)
        self.regions = []
        for members in groups.values():
            members.sort(key=self.order.__getitem__)
            lins = [self.linears[n] for n in members if n in self.linears]
            if lins:
                self.regions.append(_Region(self, members, lins))
        self.regions.sort(key=lambda r: self.order[r.nodes[0]])
        in_region = set().union(*(set(r.nodes) for r in self.regions)) if self.regions else set()
        self.const_act = sum(_act_bytes(n) for n in self.nodes if n not in in_region)

    @property
    def gm_signature(self):
        return self._sig

    def __getstate__(self):
        raise TypeError("ShardGraph holds the traced fx graph and is not picklable; ship the ShardPlan (it drops it)")


def _tensor_args(node) -> List[Any]:
    return [a for a in node.all_input_nodes if _shape(a) is not None]


_FLEX = {"select", "slice", "stack", "cat", "scaled_dot_product_attention", "softmax", "_softmax", "log_softmax",
         "_log_softmax", "mean", "sum", "matmul", "bmm", "getitem", "transpose", "permute", "t"}
_RESHAPES = {"view", "reshape", "_unsafe_view", "unflatten", "flatten", "unsqueeze", "squeeze"}


def _flexible(node) -> bool:
    name = _opname(node)
    return name in _FLEX or name in _RESHAPES or _is_pointwise(node)


def _act_bytes(node) -> int:
    name = _opname(node)
    if name in _VIEWS or name in _IGNORED:
        return 0
    if name in ("to", "_to_copy", "type_as") and node.all_input_nodes:
        a = node.all_input_nodes[0]
        va, vn = a.meta.get("val"), node.meta.get("val")
        if isinstance(va, torch.Tensor) and isinstance(vn, torch.Tensor) and va.dtype == vn.dtype:
            return 0
    if name == "dropout" and len(node.args) > 1 and node.args[1] == 0.0:
        return 0
    return _nbytes(node)


# ---- layout propagation -------------------------------------------------------------------------

def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _layout_of(layouts, a):
    return layouts.get(a) if hasattr(a, "op") else None


def _view_rule(node, lay: int, tp: int) -> Optional[int]:
    src = node.args[0]
    ins, out = _shape(src), _shape(node)
    left = math.prod(ins[:lay])
    o = next((i for i in range(len(out)) if math.prod(out[:i]) == left and out[i] > 1), None)
    if o is None or out[o] % tp or math.prod(out[o:]) != math.prod(ins[lay:]):
        raise _Conflict
    name = _opname(node)
    if name in ("view", "reshape", "_unsafe_view"):
        sizes = node.args[1]
        if len(sizes) == len(out) and sizes[o] != -1:  # the local shard runs view(..., full width, ...)
            raise _Conflict
    elif name == "unflatten":
        d0, sizes = _dim(node.args[1], len(ins)), node.args[2]
        if d0 <= o < d0 + len(sizes) and sizes[o - d0] != -1:
            raise _Conflict
    return o


def _propagate(node, layouts, tp: int):
    """The layout of ``node``'s output from its inputs' (``None`` whole, ``int`` the cut dim, a tuple
    for tuple outputs); raises :class:`_Conflict`."""
    name = _opname(node)
    ins = [(a, _layout_of(layouts, a)) for a in node.all_input_nodes]
    cut = [(a, l) for a, l in ins if l is not None]
    out = _shape(node)
    if name == "getitem":
        src, i = node.args
        lay = layouts.get(src)
        return lay[i] if isinstance(lay, tuple) else lay
    if not cut:
        return None
    if name in ("type_as", "to", "_to_copy", "clone", "contiguous", "alias", "detach", "dropout", "lift_fresh_copy"):
        return _layout_of(layouts, node.args[0])
    if name == "native_dropout":
        lay = _layout_of(layouts, node.args[0])
        return (lay, lay)
    if _is_pointwise(node):
        ndim, d = len(out), None
        for a, l in cut:
            dd = l + ndim - len(_shape(a))
            if d not in (None, dd) or _shape(a)[l] != out[dd]:
                raise _Conflict
            d = dd
        for a, l in ins:
            if l is None and _shape(a) is not None:
                k = d - (ndim - len(_shape(a)))
                if k >= 0 and _shape(a)[k] != 1:
                    raise _Conflict  # a whole operand along the cut: no boundary to gather at
        return d
    (src, lay), = cut if len(cut) == 1 else [(None, None)]
    if name in _RESHAPES:
        if src is not node.args[0]:
            raise _Conflict
        return _view_rule(node, lay, tp)
    if name in ("transpose",):
        n = len(out)
        d0, d1 = _dim(node.args[1], n), _dim(node.args[2], n)
        return d1 if lay == d0 else d0 if lay == d1 else lay
    if name == "t":
        return 1 - lay
    if name == "permute":
        perm = [_dim(p, len(out)) for p in node.args[1]]
        return perm.index(lay)
    if name == "select":
        d = _dim(node.args[1], len(_shape(src)))
        if d == lay:
            raise _Conflict
        return lay - (d < lay)
    if name == "slice":
        d = _dim(node.args[1] if len(node.args) > 1 else 0, len(out))
        if d == lay and out[d] != _shape(src)[d]:
            raise _Conflict
        return lay
    if name in ("softmax", "_softmax", "log_softmax", "_log_softmax"):
        if _dim(node.args[1], len(out)) == lay:
            raise _Conflict
        return lay
    if name in ("mean", "sum"):
        src_nd = len(_shape(src))
        dims = node.args[1] if len(node.args) > 1 else None
        if not dims:
            raise _Conflict
        dims = [_dim(x, src_nd) for x in dims]
        keep = len(node.args) > 2 and node.args[2]
        if lay in dims:
            raise _Conflict
        return lay if keep else lay - sum(1 for x in dims if x < lay)
    if name in ("stack", "cat"):
        tensors = node.args[0]
        lays = {_layout_of(layouts, t) for t in tensors}
        if len(lays) != 1:
            raise _Conflict
        lay = lays.pop()
        nd = len(_shape(tensors[0]))
        if name == "cat":
            if _dim(node.args[1] if len(node.args) > 1 else 0, nd) == lay:
                raise _Conflict
            return lay
        d = _dim(node.args[1] if len(node.args) > 1 else 0, nd + 1)
        return lay + (d <= lay)
    if name == "scaled_dot_product_attention":
        q, k, v = node.args[:3]
        if {_layout_of(layouts, t) for t in (q, k, v)} != {1} or len(out) != 4:
            raise _Conflict
        for a in node.all_input_nodes:
            if a not in (q, k, v) and _layout_of(layouts, a) is None and _shape(a) and len(_shape(a)) == 4 \
                    and _shape(a)[1] != 1:
                raise _Conflict
        return 1
    if name in ("matmul", "bmm"):
        a, b = node.args[:2]
        la, lb = _layout_of(layouts, a), _layout_of(layouts, b)
        na, nb = len(_shape(a)), len(_shape(b))
        if la is not None and lb is not None and la == lb and la < na - 2 and na == nb:
            return la
        if lb is None and la is not None and la == na - 2:
            return len(out) - 2
        raise _Conflict
    raise _Conflict  # an op that needs the whole tensor


@dataclass
class _Option:
    time: float
    comm: float
    compute: float
    mem: float  # state + activation bytes
    params: float  # parameter bytes (no grads/moments)
    picks: Tuple[str, ...]
    inputs: Tuple[Optional[int], ...]  # each linear's input layout


class _Region:
    def __init__(self, graph: ShardGraph, nodes, lins):
        self.g, self.nodes, self.lins = graph, nodes, lins
        inside = set(nodes)
        self.outside_users = {n for n in nodes if n in graph.output_args or any(
            u not in inside and not (u.op == "call_function" and _opname(u) in _IGNORED) for u in n.users)}
        self.inputs_outside = {a for n in nodes for a in n.all_input_nodes if a not in inside}

    def signature(self) -> tuple:
        idx = {n: i for i, n in enumerate(self.nodes)}

        def arg(a):
            if hasattr(a, "op"):
                return ("n", idx[a]) if a in idx else ("x", _shape(a))
            if isinstance(a, (list, tuple)):
                return tuple(arg(x) for x in a)
            return repr(a)

        rows = []
        for n in self.nodes:
            lin = self.g.linears.get(n)
            rows.append((str(n.target), _shape(n), arg(n.args), arg(tuple(sorted(n.kwargs.items()))),
                         n in self.outside_users,
                         (lin.in_features, lin.out_features, lin.bias, lin.options) if lin else None))
        return tuple(rows)

    def evaluate(self, picks: Sequence[str], costs: _CostAdapter, tp: int, activations: bool) -> Optional[_Option]:
        g = self.g
        layouts: Dict[Any, Any] = {}
        comm = compute = params = 0.0
        mem = 0.0
        which = {l.node: p for l, p in zip(self.lins, picks)}
        inputs = []
        try:
            for node in self.nodes:
                lin = g.linears.get(node)
                if lin is not None and node in which:
                    kind, outk = STRATEGIES[which[node]]
                    x = node.args[0]
                    lin_in = _layout_of(layouts, x)
                    nd = len(_shape(x))
                    if lin_in is not None and lin_in != nd - 1:
                        raise _Conflict
                    inputs.append(lin_in)
                    N, el = lin.tokens, lin.elem
                    bin_, bout = N * lin.in_features * el, N * lin.out_features * el
                    w = lin.in_features * lin.out_features
                    b = lin.out_features if lin.bias else 0
                    flops = 6.0 * N * lin.in_features * lin.out_features
                    if kind == "R":
                        compute += costs.compute(flops)
                        comm += costs.allgather(tp, bin_) if lin_in is not None else 0.0
                        elems, lay = w + b, None
                    elif kind == "col":
                        compute += costs.compute(flops / tp)
                        comm += costs.allreduce(tp, bin_) if lin_in is None else 2 * costs.allgather(tp, bin_)
                        elems = (w + b) / tp
                        if outk == "gather":
                            comm += costs.allgather(tp, bout)
                            lay = None
                        else:
                            lay = len(_shape(node)) - 1
                    else:
                        compute += costs.compute(flops / tp)
                        comm += costs.allgather(tp, bin_) if lin_in is None else 0.0
                        elems = w / tp + b
                        if outk == "scatter":
                            comm += 2 * costs.allgather(tp, bout)
                            lay = len(_shape(node)) - 1
                        else:
                            comm += costs.allreduce(tp, bout)
                            lay = None
                    params += elems * 4
                    mem += elems * _BYTES_PER_PARAM
                else:
                    lay = _propagate(node, layouts, tp)
                layouts[node] = lay
                if activations:
                    a = _act_bytes(node)
                    mem += a / tp if isinstance(lay, int) else a
            for n in self.outside_users:
                if layouts.get(n) is not None:
                    raise _Conflict  # a cut tensor leaves the region into an op that needs it whole
        except _Conflict:
            return None
        return _Option(compute + comm, comm, compute, mem, params, tuple(picks), tuple(inputs))


def _pareto(opts: List[_Option]) -> List[_Option]:
    opts = sorted(opts, key=lambda o: (o.mem, o.time))
    out: List[_Option] = []
    for o in opts:
        if not out or o.time < out[-1].time - 1e-15:
            out.append(o)
    return out


def _region_options(region: _Region, costs, tp, activations, limit, fixed=None) -> List[_Option]:
    per = [(fixed[lin.name],) if fixed and lin.name in fixed else lin.options for lin in region.lins]
    if math.prod(len(p) for p in per) > limit:
        per = [tuple(o for o in p if o in ("replicated", "column", "row")) for p in per]
    if math.prod(len(p) for p in per) <= limit:
        found = [region.evaluate(c, costs, tp, activations) for c in itertools.product(*per)]
        return _pareto([o for o in found if o is not None])
    # too many: coordinate descent from all-replicated, for time and for memory
    out = []
    for key in (lambda o: o.time, lambda o: o.mem):
        cur = ["replicated"] * len(per)
        best = region.evaluate(cur, costs, tp, activations)
        improved = True
        while improved:
            improved = False
            for i, p in enumerate(per):
                for s in p:
                    trial = cur[:i] + [s] + cur[i + 1:]
                    o = region.evaluate(trial, costs, tp, activations)
                    if o is not None and (best is None or key(o) < key(best)):
                        best, cur, improved = o, trial, True
        if best is not None:
            out.append(best)
    return _pareto(out)


# ---- the plan -----------------------------------------------------------------------------------

@dataclass
class ShardPlan:
    """The chosen strategy of every linear, with what the cost model predicts for it."""

    tp_size: int
    mode: str  # "1d" (per-operator) or "2d" (tp_nd SUMMA, whole model)
    strategies: Dict[str, str]  # linear name -> STRATEGIES key
    inputs: Dict[str, str]  # linear name -> "whole" | "sharded" (the layout reaching it)
    predicted_s: float  # the part of a step the choice changes: linear compute + its collectives
    compute_s: float
    comm_s: float
    param_bytes: int  # parameter bytes per rank (sharded weights: this rank's piece)
    state_bytes: int  # parameters + grads + AdamW moments per rank (16 B per fp32 element)
    activation_bytes: int  # estimate (0 with activations=False)
    device_memory: Optional[int]
    frontier: List[Tuple[int, float]] = field(default_factory=list)  # (memory, seconds) of the best plans
    alternatives: Dict[str, Tuple[float, int]] = field(default_factory=dict)  # mode -> (seconds, memory)
    plan_s: float = 0.0
    trace_s: float = 0.0
    model_name: str = ""
    graph: Optional[ShardGraph] = field(default=None, repr=False, compare=False)

    @property
    def memory_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.device_memory is None or self.memory_bytes <= self.device_memory

    def tp_plan(self) -> dict:
        """``{module name: ColwiseParallel | RowwiseParallel | PrepareModuleInput}`` for
        ``HybridParallelPlugin(tp_size=..., tp_plan=...)``; replicated linears are absent, unless a
        sharded input reaches one (then a ``PrepareModuleInput`` gathers it)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

        out = {}
        for name, s in self.strategies.items():
            kind, outk = STRATEGIES[s]
            cut_in = self.inputs.get(name) == "sharded"
            if kind == "R":
                if cut_in:
                    out[name] = PrepareModuleInput(input_layouts=(Shard(-1),), desired_input_layouts=(Replicate(),),
                                                   use_local_output=True)
            elif kind == "col":
                kw = {"input_layouts": Shard(-1)} if cut_in else {}
                if outk == "gather":
                    kw["output_layouts"] = Replicate()
                out[name] = ColwiseParallel(**kw)
            else:
                kw = {} if cut_in else {"input_layouts": Replicate()}
                if outk == "scatter":
                    kw["output_layouts"] = Shard(-1)
                out[name] = RowwiseParallel(**kw)
        return out

    def plugin_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of ``HybridParallelPlugin`` for this plan."""
        if self.mode == "2d":
            return {"tp_size": self.tp_size, "tp_mode": "2d"}
        return {"tp_size": self.tp_size, "tp_plan": self.tp_plan()}

    def plugin(self, **kw):
        from ..plugins import HybridParallelPlugin

        return HybridParallelPlugin(**{**self.plugin_kwargs(), **kw})

    def table(self) -> str:
        mib = 1 << 20
        budget = "no limit" if self.device_memory is None else f"{self.device_memory / mib:.2f} MiB"
        lines = [f"autoshard {self.model_name} tp={self.tp_size} mode={self.mode}: predicted "
                 f"{self.predicted_s * 1e3:.3f} ms (linears {self.compute_s * 1e3:.3f} + collectives "
                 f"{self.comm_s * 1e3:.3f}), memory/rank {self.memory_bytes / mib:.2f} MiB (params+grads+adam "
                 f"{self.state_bytes / mib:.2f}, activations {self.activation_bytes / mib:.2f}), budget {budget}"
                 f"{'' if self.fits else ' (OVER)'}"]
        if self.mode == "1d":
            w = max([len(n) for n in self.strategies] + [6])
            lines.append(f"{'linear':<{w}}  {'strategy':<14} input")
            for n, s in self.strategies.items():
                lines.append(f"{n:<{w}}  {s:<14} {self.inputs.get(n, 'whole')}")
        for mode, (t, m) in self.alternatives.items():
            if mode != self.mode:
                lines.append(f"alternative {mode}: {t * 1e3:.3f} ms, {m / mib:.2f} MiB/rank")
        lines.append(f"planned in {self.plan_s:.2f} s (trace {self.trace_s:.2f} s)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self.table())

    def __getstate__(self):
        d = dict(self.__dict__)
        d["graph"] = None  # the fx graph stays where it was traced
        return d


# ---- entry points -------------------------------------------------------------------------------

def analyse(model: nn.Module, example_inputs, tp_size: int) -> ShardGraph:
    """Trace ``model`` on ``example_inputs`` with ``torch.export`` (non-strict) and analyse its
    linears and regions for ``tp_size`` ranks."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    t = time.perf_counter()
    was = model.training
    try:
        ep = torch.export.export(model, example_inputs, strict=False)
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes one clear error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"autoshard: torch.export could not trace {type(model).__name__} on these example inputs "
            f"({type(exc).__name__}: {first[:300]}). Fix: make forward's Python branch only on shapes and "
            "Python values, not on tensor values (use torch.where / torch.cond for data-dependent branches), "
            "keep I/O to tensors and Python containers, and pass example_inputs as forward's positional "
            "arguments") from exc
    finally:
        model.train(was)
    gm = ep.graph_module
    g = ShardGraph.__new__(ShardGraph)
    g._sig = ep.graph_signature
    g.__init__(model, example_inputs, tp_size, time.perf_counter() - t, gm)
    return g


def _check_args(model, tp_size, device_memory) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"autoshard: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"autoshard: tp_size={tp_size!r} must be an int >= 1 (the ranks of the tensor-parallel group)")
    if device_memory is not None and (isinstance(device_memory, bool) or not isinstance(device_memory, (int, float))
                                      or not device_memory > 0):
        raise ValueError(f"autoshard: device_memory={device_memory!r} must be bytes per rank > 0 (e.g. 256 << 20), "
                         "or None for no limit")


def _nd_alternative(model, graph: ShardGraph, mode: str, costs: _CostAdapter, activations: bool):
    """(seconds, memory bytes, param bytes) of the whole model under ``tp_nd``'s ``mode``, or None
    where it does not apply."""
    from .. import tp_nd
    from ..tp_nd.grid import factor

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
    act = (graph.const_act + sum(_act_bytes(n) for r in graph.regions for n in r.nodes)) / tp if activations else 0
    return compute + comm, int(elems * _BYTES_PER_PARAM / tp + act), int(elems * 4 / tp), compute, comm


def autoshard(model: nn.Module, example_inputs, tp_size: int, *, device_memory: Optional[float] = None,
              costs=None, activations: bool = True, modes: Sequence[str] = ("1d",),
              max_region_options: int = 4096, graph: Optional[ShardGraph] = None,
              fixed: Optional[Dict[str, str]] = None) -> ShardPlan:
    """Choose a tensor-parallel strategy for every ``nn.Linear`` of ``model`` (module docstring).

    ``example_inputs``: forward's positional arguments for one rank's batch of a step (shapes set the
    token counts and activations). ``device_memory``: bytes per rank (None: no limit). ``costs``:
    :class:`ShardCosts` / :func:`calibrate`'s result / ``cl.autoplan``'s ``AutoPlan.calibration``
    (:class:`CalibratedCosts`: the same measurements as the layout search) / a costs-like object; None: calibrate on the
    ranks when torch.distributed is up (every rank must call), else nominal :class:`ShardCosts`.
    ``modes``: add ``"2d"`` to price tp_nd's SUMMA for the whole model. ``graph``: a previous plan's
    ``plan.graph`` (same model, inputs and ``tp_size``) to skip tracing. ``fixed``: ``{linear name:
    strategy}`` pinned (a :data:`STRATEGIES` key); the rest are searched."""
    _check_args(model, tp_size, device_memory)
    bad = [m for m in modes if m not in ("1d", "2d")]
    if bad or not modes:
        raise ValueError(f"autoshard: modes={tuple(modes)!r}; choose from ('1d', '2d')")
    fixed = dict(fixed or {})
    bad = {n: s for n, s in fixed.items() if s not in STRATEGIES}
    if bad:
        raise ValueError(f"autoshard: fixed={bad!r}: strategies are {tuple(STRATEGIES)}")
    if graph is not None and graph.tp_size != tp_size:
        raise ValueError(f"autoshard: graph= was analysed for tp_size={graph.tp_size}, not {tp_size}")
    if costs is None:
        import torch.distributed as dist

        costs = calibrate() if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 \
            else ShardCosts()
    t0 = time.perf_counter()
    g = graph if graph is not None else analyse(model, example_inputs, tp_size)
    t1 = time.perf_counter()
    if isinstance(costs, dict) and "compute" in costs and "allreduce" in costs:  # an AutoPlan.calibration
        tokens = max(l.tokens for l in g.linears.values()) if g.linears else 1
        costs = CalibratedCosts(costs, sum(6.0 * l.tokens * l.in_features * l.out_features
                                           for l in g.linears.values()), tokens)
    cost = _CostAdapter(costs)
    if not g.linears:
        raise ValueError(f"autoshard: {type(model).__name__} calls no nn.Linear on these inputs; nothing to shard")
    if tp_size > 1 and all(len(l.options) == 1 for l in g.linears.values()):
        feats = sorted({(l.in_features, l.out_features) for l in g.linears.values()})[:6]
        raise ValueError(f"autoshard: tp_size={tp_size} divides the features of no nn.Linear of {type(model).__name__} "
                         f"(in, out: {feats}); choose a tp_size dividing them")
    for name, strat in fixed.items():
        lin = g.lin_by_name.get(name)
        if lin is None:
            raise ValueError(f"autoshard: fixed names {name!r}, which is not an nn.Linear the forward calls; the linears "
                             f"are {g.linear_names[:8]}{' ...' if len(g.linear_names) > 8 else ''}")
        if strat not in lin.options:
            kind = STRATEGIES[strat][0]
            why = (f"tp_size={tp_size} does not divide its {'out' if kind == 'col' else 'in'}_features="
                   f"{lin.out_features if kind == 'col' else lin.in_features}" if tp_size > 1 and kind != "R"
                   else f"tp_size={tp_size}" if kind != "R" else "")
            why = why or "it is tied to another module's parameter or called more than once"
            raise ValueError(f"autoshard: fixed {name!r} to {strat!r}, which cannot apply: {why}")
    cache: Dict[tuple, List[_Option]] = {}
    per_region = []
    for r in g.regions:
        key = (r.signature(), tuple(fixed.get(l.name) for l in r.lins))
        if key not in cache:
            cache[key] = _region_options(r, cost, tp_size, activations, max_region_options, fixed)
        if not cache[key]:
            if any(l.name in fixed for l in r.lins):
                raise ValueError(f"autoshard: fixed={ {l.name: fixed[l.name] for l in r.lins if l.name in fixed} } leaves "
                                 f"no consistent layout for {[l.name for l in r.lins]} (a sharded tensor would reach an "
                                 "op that needs it whole)")
            raise RuntimeError(f"autoshard: no consistent layout for linears {[l.name for l in r.lins]} (not even "
                               "replicated); please report this model")
        per_region.append(cache[key])
    const = g.const_param_elems * _BYTES_PER_PARAM + (g.const_act if activations else 0)
    # multiple-choice knapsack over regions: Pareto sets of (memory, time), bucketed to stay small
    budget = math.inf if device_memory is None else float(device_memory)
    frontier: List[Tuple[float, float, tuple]] = [(float(const), 0.0, ())]
    for opts in per_region:
        merged = [(m + o.mem, t + o.time, (path, o)) for m, t, path in frontier for o in opts if m + o.mem <= budget]
        if not merged:
            least = sum(min(o.mem for o in opts) for opts in per_region) + const
            raise ValueError(f"autoshard: {type(model).__name__} needs at least {least / (1 << 20):.2f} MiB per rank at "
                             f"tp_size={tp_size} (every linear sharded), over device_memory="
                             f"{device_memory / (1 << 20):.2f} MiB; raise tp_size or the budget"
                             f"{', or pass activations=False to count parameters only' if activations else ''}")
        merged.sort(key=lambda x: (x[0], x[1]))
        frontier = []
        for m, t, p in merged:
            if not frontier or t < frontier[-1][1] - 1e-15:
                frontier.append((m, t, p))
        if len(frontier) > 4096:
            step = len(frontier) / 4096
            frontier = [frontier[int(i * step)] for i in range(4096)] + [frontier[-1]]
    mem, best_t, path = min(frontier, key=lambda x: (x[1], x[0]))
    chosen: List[_Option] = []
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
                     frontier=[(int(m), t) for m, t, _ in frontier], model_name=g.model_name, graph=g)
    plan.alternatives["1d"] = (best_t, plan.memory_bytes)
    if "2d" in modes and tp_size > 1:
        alt = _nd_alternative(model, g, "2d", cost, activations)
        if alt is not None:
            t2, m2, p2, c2, k2 = alt
            plan.alternatives["2d"] = (t2, m2)
            if m2 <= budget and (t2 < best_t or "1d" not in modes):
                plan.mode, plan.predicted_s, plan.compute_s, plan.comm_s = "2d", t2, c2, k2
                plan.param_bytes, plan.state_bytes = p2, p2 * 4
                plan.activation_bytes = m2 - p2 * 4
        elif "1d" not in modes:
            raise ValueError(f"autoshard: 2D does not apply to {type(model).__name__} at tp_size={tp_size} (a square "
                             ">= 4 whose root divides every sharded size, every parameter given a tp_nd role)")
    plan.plan_s, plan.trace_s = time.perf_counter() - t0, (t1 - t0)
    return plan
