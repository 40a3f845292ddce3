"""The plan and the solver: a dynamic program over the chain keeps the Pareto front of (bytes
kept, recompute seconds) and returns the fastest plan under the budget (:func:`solve`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch.nn as nn

from .chain import _setter
from .events import _emit, _stage_of
from .measure import profile_checkpointing
from .profile import NONE, CheckpointProfile, Entry, _fmt

MAX_STATES = 20000  # the most states a front keeps before kept bytes are rounded to a grid


@dataclass
class CheckpointPlan:
    """Which layers recompute, and what the profile predicts for a step under it."""

    budget: int
    choice: Tuple[str, ...]          # per layer: "none", "layer" or a part ("attn", "mlp")
    layers: List[Entry]              # for enable_activation_checkpointing(layers=...)
    predicted_peak: int
    predicted_recompute_s: float
    peak_none: int                   # predicted peak with no checkpointing
    peak_min: int                    # the lowest peak any plan reaches
    forward_s: float                 # the measured forward of the layers, for scale
    names: Tuple[str, ...]
    profile: Optional[CheckpointProfile] = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {"budget": self.budget, "layers": list(self.layers), "choice": dict(zip(self.names, self.choice)),
                "predicted_peak": self.predicted_peak, "predicted_recompute_s": self.predicted_recompute_s,
                "peak_none": self.peak_none, "peak_min": self.peak_min, "forward_s": self.forward_s}

    def __repr__(self) -> str:
        n_ck = sum(o != NONE for o in self.choice)
        lines = [f"CheckpointPlan: {n_ck}/{len(self.choice)} layers recompute; predicted peak "
                 f"{_fmt(self.predicted_peak)} within budget {_fmt(self.budget)}; recompute "
                 f"{self.predicted_recompute_s * 1e3:.1f} ms/step (layers' forward {self.forward_s * 1e3:.1f} ms)",
                 f"  no checkpointing: {_fmt(self.peak_none)}; lowest any plan reaches: {_fmt(self.peak_min)}",
                 f"  layers={self.layers}"]
        if self.profile is not None:
            lines.append(f"  {'layer':<14}{'recomputes':<12}{'keeps':>11}{'recompute ms':>14}")
            for u, o in zip(self.profile.units, self.choice):
                c = u.options[o]
                lines.append(f"  {u.name:<14}{'-' if o == NONE else o:<12}{_fmt(c.keep):>11}{c.cost_s * 1e3:>14.2f}")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:  # IPython
        p.text(repr(self))


def _frontier_dp(prof: CheckpointProfile, budget: float, objective: str):
    """The dynamic program of the module docstring. ``objective`` "recompute": least recompute
    seconds with every peak <= budget; "peak": least peak (budget ignored). Returns (value, choice)
    or None when nothing fits."""
    k, after = prof.terms()
    n = len(prof.units)
    opts = prof.options
    fixed = prof.fixed_peaks(k, after)
    if objective == "recompute" and fixed > budget:
        return None
    states: Dict[int, float] = {prof.prefix_keep: 0.0 if objective == "recompute" else float(fixed)}
    back: List[Dict[int, Tuple[int, str]]] = []
    for u in range(n):
        new: Dict[int, float] = {}
        ptr: Dict[int, Tuple[int, str]] = {}
        for s, val in states.items():
            for o in opts:
                c = prof.units[u].options[o]
                need = s + prof.unit_need(u, o, k, after)
                if objective == "recompute":
                    if need > budget:
                        continue
                    v = val + c.cost_s
                else:
                    v = max(val, float(need))
                s2 = s + c.keep
                if s2 not in new or v < new[s2]:
                    new[s2], ptr[s2] = v, (s, o)
        # the Pareto front: a state keeping more bytes and no less value can never do better
        front, best = {}, math.inf
        for s2 in sorted(new):
            if new[s2] < best:
                best = new[s2]
                front[s2] = new[s2]
        if len(front) > MAX_STATES:  # coarsen: round kept bytes up to a grid (overestimates memory)
            lo, hi = min(front), max(front)
            q = max(1, -(-(hi - lo) // MAX_STATES))
            coarse: Dict[int, float] = {}
            cptr: Dict[int, Tuple[int, str]] = {}
            for s2, v in front.items():
                c2 = lo + -(-(s2 - lo) // q) * q
                if c2 not in coarse or v < coarse[c2]:
                    coarse[c2], cptr[c2] = v, ptr[s2]
            front, ptr = coarse, cptr
        states = front
        back.append({s2: ptr[s2] for s2 in states})
        if not states:
            return None
    tail = prof.tail_need()
    best_s, best_v = None, math.inf
    for s, v in sorted(states.items()):
        v2 = v if objective == "recompute" else max(v, float(s + tail))
        if objective == "recompute" and s + tail > budget:
            continue
        if v2 < best_v:
            best_s, best_v = s, v2
    if best_s is None:
        return None
    choice, s = [], best_s
    for u in range(n - 1, -1, -1):
        s_prev, o = back[u][s]
        choice.append(o)
        s = s_prev
    return best_v, tuple(reversed(choice))


def min_peak(profile: CheckpointProfile) -> Tuple[int, Tuple[str, ...]]:
    """The lowest peak any plan reaches, and that plan's options."""
    v, choice = _frontier_dp(profile, math.inf, "peak")
    return profile.predict(choice)[0], choice


def solve(profile: CheckpointProfile, budget: int, *, report: bool = True) -> CheckpointPlan:
    """The plan with the least predicted recompute time whose predicted peak is <= ``budget`` bytes.

    With ``report`` (the default) the plan goes on this process's telemetry bus as a
    ``CheckpointPlanEvent`` (nothing is built when nobody listens): every route to a plan in use
    (``plan_checkpointing``, GPT's ``"auto"``, a plugin's agreed plan) ends here. A caller that
    solves what-ifs (a planner's search, a table over budgets) passes ``report=False``."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0 or math.isinf(budget):
        raise ValueError(f"solve: budget={budget!r} must be a number of bytes > 0 (the peak activation memory of "
                         "a training step), e.g. budget=512 << 20")
    budget = int(budget)
    lowest, lowest_choice = min_peak(profile)
    res = _frontier_dp(profile, budget, "recompute")
    if res is None:
        raise ValueError(
            f"plan_checkpointing: budget={budget} bytes ({_fmt(budget)}) is below the lowest peak activation memory "
            f"any checkpointing plan reaches on inputs {profile.inputs}: {lowest} bytes ({_fmt(lowest)}, recomputing "
            f"{sum(o != NONE for o in lowest_choice)} of {len(lowest_choice)} layers). "
            "Raise the budget to at least that, or make the step smaller (batch size, sequence length)")
    _, choice = res
    peak, t = profile.predict(choice)
    entries = [e for u, o in zip(profile.units, choice) if (e := u.entry(o)) is not None]
    plan = CheckpointPlan(budget=budget, choice=choice, layers=entries, predicted_peak=peak, predicted_recompute_s=t,
                          peak_none=profile.predict([NONE] * len(profile.units))[0], peak_min=lowest,
                          forward_s=profile.forward_s, names=tuple(u.name for u in profile.units), profile=profile)
    if report:
        _emit(plan, profile.stage)
    return plan


def plan_checkpointing(model: nn.Module, sample_inputs, budget: int, loss_fn: Optional[Callable] = None, *,
                       repeats: int = 1) -> CheckpointPlan:
    """Profile ``model`` on ``sample_inputs`` (:func:`profile_checkpointing`) and :func:`solve` for
    ``budget`` bytes. The model is left with checkpointing off; :func:`apply` the plan."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ValueError(f"plan_checkpointing: budget={budget!r} must be a number of bytes > 0 (the peak activation "
                         "memory of a training step), e.g. budget=512 << 20")
    return solve(profile_checkpointing(model, sample_inputs, loss_fn, repeats=repeats), budget)  # reports it


def apply(model: nn.Module, plan: CheckpointPlan) -> nn.Module:
    """Switch ``plan``'s layers to recompute (``model.enable_activation_checkpointing(layers=plan.layers)``,
    or ``checkpoint_wrapper`` on a Sequential's children) and keep the plan as ``model.checkpoint_plan``."""
    if not isinstance(plan, CheckpointPlan):
        raise TypeError(f"apply(model, plan): plan is a {type(plan).__name__}, not a CheckpointPlan "
                        "(plan_checkpointing's result)")
    _setter(model)(plan.layers)
    model.checkpoint_plan = plan
    _emit(plan, _stage_of(model, plan.profile.stage if plan.profile is not None else 0))
    return model
