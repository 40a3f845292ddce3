"""FitPlan: ``cl.plan``'s prediction as stacked bars per rank group × tier, measured peaks on top.

One bar per (group of identical ranks, tier), stacked by category (parameters, gradients,
optimizer state, activations, working set), a capacity tick on each bar, and — once the run
starts — a marker per rank at the highest bytes measured on that tier (``MemorySample.peak``
where the sampler sets it, else ``used``), so prediction and reality sit on one axis.

The view reads the plan's plain data only (``plan.to_dict()``, or that dict itself), duck-typed:
widgets never import the engine's internals or the planner (DESIGN.md).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import plotly.graph_objects as go

from colossal_lab.engine.telemetry import MemorySample

from ._live import LiveView, template_json

CATEGORY_COLORS = {"params": "#4c78a8", "grads": "#f58518", "optimizer": "#54a24b",
                   "activations": "#e45756", "working": "#b279a2"}
CAP_OFF_SCALE = 4.0  # a capacity more than this many times the tallest bar is written, not drawn


def _plan_data(plan: Any) -> dict:
    if isinstance(plan, dict):
        data = plan
    elif callable(getattr(plan, "to_dict", None)):
        data = plan.to_dict()
    else:
        raise TypeError(f"FitPlan(plan={type(plan).__name__}): pass what cl.plan returns (or its to_dict())")
    if not isinstance(data.get("ranks"), list):
        raise ValueError("FitPlan(plan=...): the plan has no 'ranks' list; pass what cl.plan returns")
    return data


def _unit(peak: float) -> Tuple[float, str]:
    return (float(1 << 30), "GiB") if peak >= (1 << 30) else (float(1 << 20), "MiB")


def _group_label(g: dict) -> str:
    rs = sorted(g["ranks"])
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        s = f"ranks {rs[0]}-{rs[-1]}"
    else:
        s = ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))
    return s + (f" ({g['role']})" if g.get("role") else "")


def bars(plan: dict) -> List[Tuple[str, dict, dict]]:
    """``(x label, rank group, tier dict)`` for every bar, in the plan's order."""
    tiers = plan.get("tiers") or ["cuda", "cpu", "nvme"]
    out = []
    for g in plan["ranks"]:
        for t in tiers:
            tp = g["tiers"].get(t)
            if tp is not None:
                out.append((f"{_group_label(g)}<br>{t}", g, tp))
    return out


def fit_plan_dict(plan: dict, measured: Optional[Dict[Tuple[int, str], int]] = None) -> dict:
    """The plotly figure as a plain dict: stacked category bars, capacity ticks, measured markers."""
    measured = measured or {}
    cats = plan.get("categories") or list(CATEGORY_COLORS)
    bs = bars(plan)
    xs = [x for x, _, _ in bs]
    tallest = max([tp["peak"] for _, _, tp in bs] + [v for v in measured.values()] + [1])
    div, unit = _unit(tallest)
    data: List[dict] = []
    for c in cats:
        data.append({"type": "bar", "name": c, "x": xs, "y": [tp.get(c, 0) / div for _, _, tp in bs],
                     "marker": {"color": CATEGORY_COLORS.get(c)},
                     "hovertemplate": f"%{{x}}<br>{c}: %{{y:,.2f}} {unit}<extra></extra>"})
    cap_x, cap_y, notes = [], [], []
    for x, g, tp in bs:
        cap = tp.get("capacity")
        if cap is None:
            continue
        if cap <= CAP_OFF_SCALE * tallest:
            cap_x.append(x)
            cap_y.append(cap / div)
        else:
            notes.append({"x": x, "y": tp["peak"] / div, "yshift": 14, "showarrow": False,
                          "text": f"cap {cap / div:,.0f} {unit}", "font": {"size": 10}})
    if cap_x:
        data.append({"type": "scatter", "mode": "markers", "name": "capacity", "x": cap_x, "y": cap_y,
                     "marker": {"symbol": "line-ew-open", "size": 40, "line": {"width": 3, "color": "#222"}},
                     "hovertemplate": f"%{{x}}<br>capacity %{{y:,.2f}} {unit}<extra></extra>"})
    mx, my, mt = [], [], []
    for x, g, tp in bs:
        for r in g["ranks"]:
            v = measured.get((r, tp["tier"]))
            if v is not None:
                mx.append(x)
                my.append(v / div)
                pred = tp["peak"]
                mt.append(f"rank {r} measured {v / div:,.2f} {unit} "
                          f"({100.0 * (pred - v) / v:+.1f}% predicted)" if v else f"rank {r} measured 0")
    if mx:
        data.append({"type": "scatter", "mode": "markers", "name": "measured peak", "x": mx, "y": my, "text": mt,
                     "marker": {"symbol": "diamond", "size": 11, "color": "#111",
                                "line": {"width": 1, "color": "white"}},
                     "hovertemplate": "%{x}<br>%{text}<extra></extra>"})
    verdict = "fits" if plan.get("fits") else "does NOT fit"
    title = (f"FitPlan · {plan.get('plugin', '')} · world {plan.get('world_size', '?')} · "
             f"batch {plan.get('batch', '?')} × seq {plan.get('seq', '?')} · {verdict}")
    layout = {"template": template_json(), "barmode": "stack", "title": {"text": title},
              "yaxis": {"title": {"text": unit}, "rangemode": "tozero"},
              "xaxis": {"type": "category"}, "annotations": notes,
              "height": 360, "margin": {"l": 60, "r": 20, "t": 60, "b": 80},
              "legend": {"orientation": "h", "y": -0.3}}
    return {"data": data, "layout": layout}


def fit_plan_figure(plan: Any, measured: Optional[Dict[Tuple[int, str], int]] = None) -> go.Figure:
    """``fit_plan_dict`` as a validated ``go.Figure`` (for static use)."""
    return go.Figure(fit_plan_dict(_plan_data(plan), measured))


class FitPlan(LiveView):
    """The plan as stacked bars; fed ``MemorySample`` events, it adds each rank's measured peak.

    ``FitPlan(plan)`` subscribes to this process's telemetry bus like every view
    (``subscribe=False`` for a still picture); ``Dashboard(plan=plan)`` holds one.
    """

    accepts = (MemorySample,)

    def __init__(self, plan: Any, *, subscribe: bool = True, live: Optional[bool] = None, max_hz: float = 5.0):
        self.plan = _plan_data(plan)
        super().__init__(subscribe=subscribe, live=live, max_hz=max_hz)

    @classmethod
    def from_trace(cls, path, plan: Any = None, **kw):  # type: ignore[override]
        """The plan with the peaks of a saved JSONL trace's ``MemorySample`` events."""
        if plan is None:
            raise TypeError("FitPlan.from_trace(path, plan=...): the plan is not in the trace; pass it")
        return super().from_trace(path, plan=plan, **kw)

    @classmethod
    def from_events(cls, events, plan: Any = None, **kw):  # type: ignore[override]
        if plan is None:
            raise TypeError("FitPlan.from_events(events, plan=...): pass the plan")
        return super().from_events(events, plan=plan, **kw)

    def _init_state(self) -> None:
        self.measured: Dict[Tuple[int, str], int] = {}

    def _fold(self, events) -> bool:
        changed = False
        for e in events:
            if not isinstance(e, MemorySample):
                continue
            v = max(int(e.used), int(e.peak or 0))
            key = (e.rank, e.tier)
            if v > self.measured.get(key, -1):
                self.measured[key] = v
                changed = True
        return changed

    def build_dict(self) -> dict:
        return fit_plan_dict(self.plan, self.measured)

    def predicted(self) -> Dict[Tuple[int, str], int]:
        """``{(rank, tier): predicted peak bytes}`` from the plan."""
        return {(r, tp["tier"]): tp["peak"] for _, g, tp in bars(self.plan) for r in g["ranks"]}

    def compare(self) -> Dict[Tuple[int, str], Tuple[int, int, float]]:
        """``{(rank, tier): (predicted, measured, error %)}`` where a measurement exists."""
        pred = self.predicted()
        return {k: (pred[k], v, 100.0 * (pred[k] - v) / v if v else float("inf"))
                for k, v in sorted(self.measured.items()) if k in pred}

    def summary(self) -> str:
        p = self.plan
        head = (f"FitPlan: {p.get('plugin', '')}, world {p.get('world_size', '?')}, "
                f"{'fits' if p.get('fits') else 'does NOT fit'}")
        parts = []
        for x, g, tp in bars(p):
            div, unit = _unit(tp["peak"])
            cap = tp.get("capacity")
            parts.append(f"{x.replace('<br>', ' ')}: {tp['peak'] / div:,.1f} {unit}"
                         + (f" of {cap / div:,.1f}" if cap is not None else ""))
        for (r, t), (pr, me, err) in self.compare().items():
            parts.append(f"rank {r} {t} measured {me / (1 << 20):,.1f} MiB ({err:+.1f}%)")
        return "\n".join([head] + parts + [f"advice: {a}" for a in p.get("advice", [])])
