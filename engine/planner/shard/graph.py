"""The model's graph, analysed once: its linears and their strategies, its regions, and what no
choice changes (the parameters outside linears, the activations outside regions).

The graph is ``torch.export.export(model, example_inputs, strict=False)``'s: an ATen-level
``torch.fx`` GraphModule with concrete shapes (a model whose ``forward`` branches on shapes and
Python state, as the repo's GPT, cannot be ``torch.fx.symbolic_trace``d). Each ``nn.Linear`` call
is one ``aten.linear`` node whose weight placeholder names the module (the export's
``graph_signature``); views keep the sizes the code passed (``-1`` included), which tells whether
a view still works on a shard. Exporting runs the model once on fake tensors and takes seconds,
so a plan keeps its graph (``autoshard(..., graph=plan.graph)`` re-plans without tracing).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn

from .ops import IGNORED, activation_bytes, flexible, is_pointwise, opname, shape, tensor_args
from .regions import Region


@dataclass
class Linear:
    """One ``nn.Linear`` call in the graph, and the strategies it may take."""

    name: str
    node: Any
    in_features: int
    out_features: int
    bias: bool
    tokens: int
    elem: int  # bytes per activation element
    options: Tuple[str, ...]


class ShardGraph:
    """The analysed graph: the linears with their strategies, the regions, constant memory. Reused
    across plans (``autoshard(..., graph=plan.graph)``); not picklable (it holds the fx graph)."""

    def __init__(self, model: nn.Module, example_inputs: tuple, tp_size: int, trace_s: float, gm, signature=None):
        self.model_name, self.tp_size, self.trace_s = type(model).__name__, tp_size, trace_s
        self.gm, self._sig = gm, signature
        graph = gm.graph
        self.nodes = [n for n in graph.nodes if n.op == "call_function"]
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.output_args = set()
        for n in graph.nodes:
            if n.op == "output":
                torch.fx.node.map_arg(n.args, lambda a: self.output_args.add(a))
        self.linears: Dict[Any, Linear] = {}
        self.lin_by_name: Dict[str, Linear] = {}
        self.param_elems: Dict[str, int] = {}
        self.const_param_elems = 0
        self.hf_plan = False  # the linears' cuts read from a transformers model's plan (``_hf_allowed``)
        covered = self._find_linears(model)
        self._count_other_params(model, covered)
        self.maybe = self._maybe_cut()
        self._regions()

    def _find_linears(self, model: nn.Module) -> set:
        """Which linear nodes are ``nn.Linear`` modules, with their allowed strategies; returns the
        ids of their parameters. A linear whose weight is tied to another module's, or that is
        called twice, stays replicated; a cut ``tp`` does not divide is not offered."""
        to_param = dict(getattr(self._sig, "inputs_to_parameters", {}) or {})
        mods = dict(model.named_modules())
        owners: Dict[int, List[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), []).append(n)
        tp = self.tp_size
        covered = set()
        allowed = _hf_allowed(model, tp)  # a transformers model: the cuts its own plan allows, else None
        self.hf_plan = allowed is not None
        for node in self.nodes:
            if opname(node) != "linear":
                continue
            pname = to_param.get(getattr(node.args[1], "name", None))
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
                if allowed is not None:
                    opts = [o for o in opts if o in allowed.get(mname, ("replicated",))]
            x = node.args[0]
            xs = shape(x)
            lin = Linear(mname, node, mod.in_features, mod.out_features, mod.bias is not None,
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
        self.linear_names = list(self.lin_by_name)
        return covered

    def _count_other_params(self, model: nn.Module, covered: set) -> None:
        seen = set()
        for n, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) not in covered:
                self.const_param_elems += p.numel()

    def _maybe_cut(self) -> set:
        """The nodes whose output can be cut under some choice of strategies."""
        maybe = set()
        for node in self.nodes:
            if node in self.linears:
                if len(self.linears[node].options) > 1 or any(a in maybe for a in node.all_input_nodes):
                    maybe.add(node)
                continue
            name = opname(node)
            ins = [a for a in node.all_input_nodes if a in maybe]
            if not ins or name in IGNORED or not flexible(node):
                continue
            if is_pointwise(node) and name not in ("type_as", "to", "_to_copy"):
                out = shape(node)
                if out is not None and any(a not in maybe and shape(a) == out for a in tensor_args(node)):
                    continue  # a full-size whole operand (a residual add): the result is whole or infeasible
            maybe.add(node)
        return maybe

    def _regions(self) -> None:
        """The maybe-cut nodes' connected pieces that hold a linear, in graph order; the
        activations of every other node (``const_act``)."""
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
                self.regions.append(Region(self, members, lins))
        self.regions.sort(key=lambda r: self.order[r.nodes[0]])
        in_region = set().union(*(set(r.nodes) for r in self.regions)) if self.regions else set()
        self.const_act = sum(activation_bytes(n) for n in self.nodes if n not in in_region)

    @property
    def gm_signature(self):
        return self._sig

    def __getstate__(self):
        raise TypeError("ShardGraph holds the traced fx graph and is not picklable; ship the ShardPlan (it drops it)")


def analyse(model: nn.Module, example_inputs, tp_size: int) -> ShardGraph:
    """Trace ``model`` on ``example_inputs`` with ``torch.export`` (non-strict) and analyse its
    linears and regions for ``tp_size`` ranks."""
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    t = time.perf_counter()
    was = model.training
    try:
        # traced as in inference: a family's training-only randomness (OPT's layer drop draws a random number
        # and branches on it in older transformers) is data-dependent control flow torch.export refuses; the
        # linears and the regions between them are the same in both modes
        model.eval()
        ep = torch.export.export(model, example_inputs, kwargs=_export_kwargs(model), strict=False)
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
    return ShardGraph(model, example_inputs, tp_size, time.perf_counter() - t, ep.graph_module, ep.graph_signature)


def _hf_allowed(model: nn.Module, tp: int):
    """``{linear name: strategies}`` a transformers model's plan allows (read by ``models.hf.cuts``: the
    plan's own cut of each linear, or replicated), None for any other model (every cut is searched)."""
    from ...models.hf import reads_dict_plan

    if tp < 2 or not reads_dict_plan(model):
        return None
    import fnmatch

    from ...models.hf.cuts import linear_cuts
    from ...models.hf.plan import per_rank_attributes

    counted = list(per_rank_attributes(model))  # modules whose head counts the plugin divides once a child is cut
    out = {}
    for name, cut in linear_cuts(model, None, tp).items():
        if cut.parts > 1 or cut.conv1d:
            continue  # packed and Conv1D weights are not searched (not nn.Linear calls): kept whole
        parent = name.rpartition(".")[0]
        if any(parent.count(".") == p.count(".") and fnmatch.fnmatchcase(parent, p) for p in counted):
            continue  # cut alone, a linear there would leave the others whole under divided head counts
        out[name] = ("replicated", "column+gather" if cut.gather else "column") if cut.kind == "col" else \
            ("replicated", "row")
    return out


def _export_kwargs(model: nn.Module) -> dict:
    """A transformers model is traced as training calls it: without its key/value cache (a ``DynamicCache``
    output torch.export cannot flatten), ``return_dict`` left as the model's own."""
    import inspect

    from ...models.hf import is_hf_model

    if is_hf_model(model) and "use_cache" in inspect.signature(model.forward).parameters:
        return {"use_cache": False}
    return {}
