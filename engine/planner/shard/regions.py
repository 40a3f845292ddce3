"""Regions: the independent pieces of the choice, and the best options of each.

Tensors that are whole under every choice (produced by an op that needs them whole, or an
elementwise op with a full-size whole operand, as a residual add) cut the graph into *regions*;
a transformer block gives two (q/k/v + attention + out-projection, and the MLP). A region's
choices are enumerated exhaustively (5 strategies per linear; over ``limit`` combinations, the 3
without an output collective, then coordinate descent), each priced by propagating layouts
through its ops, and reduced to its Pareto set of (memory, time).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from .ops import IGNORED, activation_bytes, opname, shape
from .propagate import Conflict, layout_after, layout_of
from .strategies import BYTES_PER_PARAM, price

if TYPE_CHECKING:
    from .graph import ShardGraph


@dataclass
class Option:
    """One combination of strategies for a region's linears, priced."""

    time: float
    comm: float
    compute: float
    mem: float  # state + activation bytes
    params: float  # parameter bytes (no grads/moments)
    picks: Tuple[str, ...]
    inputs: Tuple[Optional[int], ...]  # each linear's input layout


class Region:
    """Connected nodes that may carry a cut tensor, and the linears among them."""

    def __init__(self, graph: "ShardGraph", nodes, lins):
        self.g, self.nodes, self.lins = graph, nodes, lins
        inside = set(nodes)
        self.outside_users = {n for n in nodes if n in graph.output_args or any(
            u not in inside and not (u.op == "call_function" and opname(u) in IGNORED) for u in n.users)}
        self.inputs_outside = {a for n in nodes for a in n.all_input_nodes if a not in inside}

    def signature(self) -> tuple:
        """Equal for regions that price alike (the repeated blocks): solved once."""
        idx = {n: i for i, n in enumerate(self.nodes)}

        def arg(a):
            if hasattr(a, "op"):
                return ("n", idx[a]) if a in idx else ("x", shape(a))
            if isinstance(a, (list, tuple)):
                return tuple(arg(x) for x in a)
            return repr(a)

        rows = []
        for n in self.nodes:
            lin = self.g.linears.get(n)
            rows.append((str(n.target), shape(n), arg(n.args), arg(tuple(sorted(n.kwargs.items()))),
                         n in self.outside_users,
                         (lin.in_features, lin.out_features, lin.bias, lin.options) if lin else None))
        return tuple(rows)

    def evaluate(self, picks: Sequence[str], costs, tp: int, activations: bool) -> Optional[Option]:
        """``picks`` (a strategy per linear) priced, or None where a cut tensor would reach an op
        that needs it whole."""
        layouts: Dict[Any, Any] = {}
        comm = compute = params = 0.0
        mem = 0.0
        which = {l.node: p for l, p in zip(self.lins, picks)}
        inputs = []
        try:
            for node in self.nodes:
                lin = self.g.linears.get(node)
                if lin is not None and node in which:
                    lin_in = layout_of(layouts, node.args[0])
                    if lin_in is not None and lin_in != len(shape(node.args[0])) - 1:
                        raise Conflict
                    inputs.append(lin_in)
                    p = price(lin, which[node], lin_in, len(shape(node)), costs, tp)
                    compute += p.compute
                    for t in p.comm:
                        comm += t
                    params += p.elems * 4
                    mem += p.elems * BYTES_PER_PARAM
                    lay = p.layout
                else:
                    lay = layout_after(node, layouts, tp)
                layouts[node] = lay
                if activations:
                    a = activation_bytes(node)
                    mem += a / tp if isinstance(lay, int) else a
            if any(layouts.get(n) is not None for n in self.outside_users):
                raise Conflict  # a cut tensor leaves the region into an op that needs it whole
        except Conflict:
            return None
        return Option(compute + comm, comm, compute, mem, params, tuple(picks), tuple(inputs))


def pareto(opts: List[Option]) -> List[Option]:
    """The options no other beats on both memory and time, by memory."""
    opts = sorted(opts, key=lambda o: (o.mem, o.time))
    out: List[Option] = []
    for o in opts:
        if not out or o.time < out[-1].time - 1e-15:
            out.append(o)
    return out


def region_options(region: Region, costs, tp: int, activations: bool, limit: int,
                   fixed: Optional[Dict[str, str]] = None) -> List[Option]:
    """The region's Pareto set; ``fixed`` pins some linears' strategies."""
    per = [(fixed[lin.name],) if fixed and lin.name in fixed else lin.options for lin in region.lins]
    if math.prod(len(p) for p in per) > limit:
        per = [tuple(o for o in p if o in ("replicated", "column", "row")) for p in per]
    if math.prod(len(p) for p in per) <= limit:
        found = [region.evaluate(c, costs, tp, activations) for c in itertools.product(*per)]
        return pareto([o for o in found if o is not None])
    return pareto(_descend(region, per, costs, tp, activations))


def _descend(region: Region, per, costs, tp: int, activations: bool) -> List[Option]:
    """Too many combinations: coordinate descent from all-replicated, once for time and once for
    memory."""
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
    return out
