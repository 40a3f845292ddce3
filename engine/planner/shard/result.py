"""What ``cl.autoshard`` returns: each linear's strategy and the layout reaching it, what the cost
model predicts for the choice, and the plugin arguments that apply it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from .strategies import STRATEGIES

if TYPE_CHECKING:
    from .graph import ShardGraph


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
    hf_styles: bool = False  # a transformers model: its plain cuts as transformers' style names

    @property
    def memory_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.device_memory is None or self.memory_bytes <= self.device_memory

    def tp_plan(self) -> dict:
        """``{module name: ColwiseParallel | RowwiseParallel | PrepareModuleInput}`` for
        ``HybridParallelPlugin(tp_size=..., tp_plan=...)``; replicated linears are absent, unless a
        sharded input reaches one (then a ``PrepareModuleInput`` gathers it). For a transformers model the
        cuts its own plan names are given by transformers' style names (``"colwise"``, ``"rowwise"``, ...), so
        the plugin applies them as it applies the model's plan (the vocabulary-parallel head included)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

        out = {}
        for name, s in self.strategies.items():
            kind, outk = STRATEGIES[s]
            cut_in = self.inputs.get(name) == "sharded"
            hf_name = _hf_style(kind, outk, cut_in) if self.hf_styles else None
            if hf_name is not None:
                out[name] = hf_name
                continue
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
        from ...plugins import HybridParallelPlugin

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


def _hf_style(kind: str, outk: str, cut_in: bool) -> Optional[str]:
    """The transformers style name of a cut, where one exists (its input whole for a column cut, cut for
    a row cut, or split on the rank: ``rowwise_split_input``)."""
    if kind == "col" and not cut_in:
        return "colwise_gather_output" if outk == "gather" else "colwise"
    if kind == "row" and outk == "reduce":
        return "rowwise" if cut_in else "rowwise_split_input"
    return None
