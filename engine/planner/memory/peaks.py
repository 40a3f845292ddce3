"""Composing a plugin's plan from a trace: its persistent bytes laid over the trace op by op, the
peak kept with its phase, and the optimizer step as a second moment whose peak is compared with the
backward's. What every plugin's memory model (``replicated.py``, ``fsdp.py``, ``gemini.py``,
``hybrid.py``) returns is a :class:`_Result`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from .result import CATEGORIES, RankPlan, TierPlan
from .trace import _Trace

_OPT_STATE = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}  # fp32 tensors per parameter


@dataclass
class _Result:
    """One plugin's memory model applied: rank groups, traffic, activations, layout, notes."""

    ranks: List[RankPlan]
    traffic: Dict[str, int]
    act: Dict[str, Any]
    layout: Dict[str, Any]
    notes: List[str] = field(default_factory=list)


def _opt_bytes(numel: int, opt: str) -> int:
    return _OPT_STATE[opt] * 4 * numel


def _step_temp(largest: int, total: int, device: str, opt: str) -> int:
    """Bytes torch's optimizer step allocates on top of its state: on CPU (no foreach) AdamW's
    single-tensor update makes ``exp_avg_sq.sqrt()`` and its quotient for one parameter at a time;
    on CUDA the foreach path makes the square roots of every state at once."""
    if opt in ("sgd",):
        return 0
    return 2 * largest if device == "cpu" else total


def _acts_summary(m, ac: bool, **kw) -> Dict[str, Any]:
    """Activation bytes per rank with and without checkpointing (end of forward, one microbatch
    times what is in flight is the caller's business)."""
    off = m.trace(ac=False, **kw).act_end
    on = m.trace(ac=True, **kw).act_end if m.supports_ac() else None
    return {"without_checkpointing": off, "with_checkpointing": on, "checkpointing": bool(ac)}


def _peak_over(trace: _Trace, fn: Callable[[int, int, int, int], Dict[str, int]]) -> Tuple[Dict[str, int], str, int]:
    """``fn(i, other, grad, saved)`` -> categories at op ``i``; the categories at the largest total."""
    best, best_i = None, 0
    for i in range(len(trace.other)):
        cats = fn(i, trace.other[i], trace.grad[i], trace.saved[i])
        tot = sum(cats.values())
        if best is None or tot > sum(best.values()):
            best, best_i = cats, i
    phase = trace.phase[best_i] if trace.phase else "fwd"
    return best or {}, ("backward" if phase == "bwd" else "forward"), best_i


def _tier(tier: str, capacity: Optional[int], cats: Dict[str, int], phase: str) -> TierPlan:
    return TierPlan(tier=tier, capacity=capacity, phase=phase,
                    **{c: int(max(0, cats.get(c, 0))) for c in CATEGORIES})


def _max_cats(*cands: Tuple[Dict[str, int], str]) -> Tuple[Dict[str, int], str]:
    return max(cands, key=lambda c: sum(c[0].values()))
