"""CheckpointPlanView: the activation-checkpoint plan each rank chose, block by block, live.

``engine/autockpt/`` emits a ``CheckpointPlanEvent`` when it makes a plan (``plan_checkpointing``,
GPT's ``activation_checkpointing="auto"``) and when one is applied (``autockpt.apply``). This view
draws, per ``(rank, stage)`` one row of a shared figure (ordered by stage, then rank):

* a bar per block of the chain (x), its height the bytes that block keeps for backward under its
  option, its colour what it recomputes (``none``, ``layer`` = the whole block, or a part such as
  ``attn`` / ``mlp``), so where the memory goes and what buys it back sit side by side;
* a line: the bytes kept so far along the chain (the prefix's, then each block's added), which is
  what the blocks' backward peaks stand on;
* horizontal lines: the budget, the plan's predicted peak, the peak with no checkpointing;
* where ``MemorySample`` events of that rank carry a measured ``peak`` on the plan's device tier
  (``cuda`` for a CUDA plan, else ``cpu``): that peak as a line too. It is the tier's whole peak
  (on CUDA ``max_memory_allocated``, on CPU peak RSS: parameters, optimizer state and all) where
  the plan's figures count a step's activations only, so it sits above the predicted peak by
  what was live before the step; a peak more than ``OFF_SCALE`` times the plan's largest figure
  is written in the row's title, not drawn (it would flatten the bars).

A later plan of a ``(rank, stage)`` replaces the earlier one (``state.CheckpointPlanState``).
The view reads the events' plain fields only (DESIGN.md: widgets import telemetry types, plotly
and ipywidgets, nothing of the engine's internals).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import plotly.graph_objects as go

from colossal_lab.engine.telemetry import MemorySample, format_bytes
from colossal_lab.engine.telemetry.events import CheckpointPlanEvent

from ._live import LiveView, template_json
from .state import CheckpointPlanState, reduce_all

OPTION_COLORS = {"none": "#bab0ac", "layer": "#e45756", "attn": "#f58518", "mlp": "#4c78a8"}
OTHER_COLOR = "#b279a2"  # a part another model lists in checkpoint_parts()
LINE_STYLES = {"budget": {"color": "#d62728", "width": 2},
               "predicted peak": {"color": "#222222", "width": 2, "dash": "dash"},
               "no checkpointing": {"color": "#7f7f7f", "width": 1, "dash": "dot"},
               "measured peak": {"color": "#2ca02c", "width": 2, "dash": "dashdot"}}
OFF_SCALE = 4.0
ROW_HEIGHT = 260


def _unit(top: float) -> Tuple[float, str]:
    for div, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if top >= div:
            return float(div), unit
    return 1.0, "B"


_fmt = format_bytes


def plan_tier(e: CheckpointPlanEvent) -> str:
    """The memory tier whose ``MemorySample.peak`` compares with this plan: its device's."""
    return "cuda" if str(e.device).startswith("cuda") else "cpu"


def _row_title(e: CheckpointPlanEvent, measured: Optional[int], off_scale: bool) -> str:
    n_ck = sum(o != "none" for o in e.options)
    fits = "≤" if e.predicted_peak <= e.budget else ">"
    title = (f"rank {e.rank} · stage {e.stage} · {n_ck}/{len(e.options)} blocks recompute · predicted peak "
             f"{_fmt(e.predicted_peak)} {fits} budget {_fmt(e.budget)} · recompute "
             f"{e.predicted_recompute_s * 1e3:,.1f} ms/step · lowest any plan {_fmt(e.peak_min)} ({e.device})")
    if measured is not None and off_scale:
        title += f"<br>measured {plan_tier(e)} peak {_fmt(measured)} (whole process; off this scale)"
    return title


def checkpoint_plan_dict(state: CheckpointPlanState) -> dict:
    """The figure as a plain plotly dict: one row of axes per ``(rank, stage)``."""
    keys = state.keys()
    n = len(keys)
    spacing = 0.28 / max(n, 1) if n > 1 else 0.0
    height = max(1.0 - spacing * (n - 1), 0.0) / max(n, 1)
    plans = [state.plans[k] for k in keys]
    top = max([max(e.budget, e.predicted_peak, e.peak_none, e.prefix_keep + sum(e.keep)) for e in plans] + [1])
    div, unit = _unit(top)
    data: List[dict] = []
    layout: dict = {"template": template_json(), "barmode": "overlay", "annotations": [],
                    "height": max(260, 90 + ROW_HEIGHT * n), "margin": {"l": 70, "r": 20, "t": 90, "b": 60},
                    "legend": {"orientation": "h", "y": -0.12 if n > 1 else -0.25}}
    legend_seen = set()

    def shown(name: str) -> bool:  # one legend entry per name across the rows
        first = name not in legend_seen
        legend_seen.add(name)
        return first

    for i, (key, e) in enumerate(zip(keys, plans)):
        sfx = "" if i == 0 else str(i + 1)
        xa, ya = "x" + sfx, "y" + sfx
        y1 = 1.0 - i * (height + spacing)
        blocks = len(e.options)
        names = list(e.names) or [f"block {u}" for u in range(blocks)]
        keep = list(e.keep) or [0] * blocks
        rec = list(e.recompute_s) or [0.0] * blocks
        xs = list(range(blocks))
        order = [o for o in OPTION_COLORS if o in e.options] + sorted(set(e.options) - set(OPTION_COLORS))
        for o in order:
            us = [u for u in xs if e.options[u] == o]
            data.append({
                "type": "bar", "name": o, "legendgroup": o, "showlegend": shown("opt:" + o),
                "x": us, "y": [keep[u] / div for u in us], "xaxis": xa, "yaxis": ya,
                "marker": {"color": OPTION_COLORS.get(o, OTHER_COLOR)},
                "text": [o for _ in us], "textposition": "inside", "insidetextanchor": "middle",
                "customdata": [[names[u], o, keep[u], rec[u] * 1e3] for u in us],
                "hovertemplate": ("%{customdata[0]}: recomputes %{customdata[1]}<br>keeps %{y:,.2f} "
                                  f"{unit}<br>recompute %{{customdata[3]:.2f}} ms<extra>rank {e.rank} "
                                  f"stage {e.stage}</extra>")})
        if e.keep:
            run, cum = e.prefix_keep, []
            for k in keep:
                run += k
                cum.append(run / div)
            data.append({"type": "scatter", "mode": "lines+markers", "name": "kept so far", "legendgroup": "cum",
                         "showlegend": shown("cum"), "x": xs, "y": cum, "xaxis": xa, "yaxis": ya,
                         "line": {"color": "#9467bd", "width": 1.5}, "marker": {"size": 5}, "customdata": names,
                         "hovertemplate": f"kept through %{{customdata}}: %{{y:,.2f}} {unit}<extra></extra>"})
        measured = state.measured_peak(e.rank, plan_tier(e))
        off_scale = measured is not None and measured > OFF_SCALE * top
        lines = [("budget", e.budget), ("predicted peak", e.predicted_peak), ("no checkpointing", e.peak_none)]
        if measured is not None and not off_scale:
            lines.append(("measured peak", measured))
        for name, v in lines:
            data.append({"type": "scatter", "mode": "lines", "name": name, "legendgroup": name,
                         "showlegend": shown(name), "x": [-0.5, blocks - 0.5], "y": [v / div, v / div],
                         "xaxis": xa, "yaxis": ya, "line": LINE_STYLES[name],
                         "hovertemplate": f"{name}: {_fmt(v)}<extra>rank {e.rank} stage {e.stage}</extra>"})
        layout["xaxis" + sfx] = {"anchor": ya, "domain": [0.0, 1.0], "range": [-0.5, blocks - 0.5],
                                 "tickmode": "array", "tickvals": xs, "ticktext": names, "zeroline": False}
        layout["yaxis" + sfx] = {"anchor": xa, "domain": [max(y1 - height, 0.0), y1], "rangemode": "tozero",
                                 "title": {"text": unit}}
        layout["annotations"].append({"text": _row_title(e, measured, off_scale), "showarrow": False,
                                      "xref": "paper", "x": 0.5, "xanchor": "center", "yref": "paper",
                                      "y": y1, "yanchor": "bottom", "font": {"size": 12}})
    if n:
        title = f"Checkpoint plan · {n} rank/stage plan(s)" if n > 1 else "Checkpoint plan"
    else:
        title = "Checkpoint plan · waiting for CheckpointPlanEvents"
    layout["title"] = {"text": title, "y": 0.98, "yanchor": "top"}
    return {"data": data, "layout": layout}


def checkpoint_plan_figure(state: CheckpointPlanState) -> go.Figure:
    """``checkpoint_plan_dict`` as a validated ``go.Figure`` (for static use)."""
    return go.Figure(checkpoint_plan_dict(state))


class CheckpointPlanView(LiveView):
    """Per ``(rank, stage)``: each block's option (colour) and kept bytes (height) beside the
    budget, the predicted peak and, where sampled, the measured peak.

    ``CheckpointPlanView()`` subscribes to this process's telemetry bus like every view;
    ``CheckpointPlanView.from_trace(path)`` draws a saved JSONL trace. ``on_first_plan``, when
    set, is called once (on the thread that folds) when the first plan arrives: the
    ``Dashboard`` shows the view from then on.
    """

    accepts = (CheckpointPlanEvent, MemorySample)

    def _init_state(self) -> None:
        self.plans = CheckpointPlanState()
        self.on_first_plan = None

    def _fold(self, events) -> bool:
        had = bool(self.plans.plans)
        changed = reduce_all(events, plans=self.plans) > 0
        if not self.plans.plans:
            return False  # memory samples only: nothing to draw yet (peaks are kept for later)
        if not had and self.on_first_plan is not None:
            self.on_first_plan(self)
        return changed

    def build_dict(self) -> dict:
        return checkpoint_plan_dict(self.plans)

    def blocks(self, rank: int = 0, stage: int = 0) -> List[Tuple[str, str, int]]:
        """``[(block name, option, kept bytes)]`` of the plan drawn for ``(rank, stage)``."""
        e = self.plans.plans.get((rank, stage))
        if e is None:
            raise KeyError(f"CheckpointPlanView.blocks(rank={rank}, stage={stage}): no plan from it; "
                           f"plans seen: {self.plans.keys()}")
        keep = e.keep or (0,) * len(e.options)
        return list(zip(e.names or [f"block {u}" for u in range(len(e.options))], e.options, keep))

    def latest(self) -> Dict[Tuple[int, int], CheckpointPlanEvent]:
        """``{(rank, stage): the plan drawn}``."""
        return {k: self.plans.plans[k] for k in self.plans.keys()}

    def summary(self) -> str:
        if not self.plans.plans:
            return "CheckpointPlanView: no CheckpointPlanEvents yet"
        parts = []
        for (rank, stage), e in self.latest().items():
            measured = self.plans.measured_peak(rank, plan_tier(e))
            parts.append(f"rank {rank} stage {stage}: {sum(o != 'none' for o in e.options)}/{len(e.options)} blocks "
                         f"recompute ({', '.join(e.layers) or 'none'}); predicted peak {_fmt(e.predicted_peak)} of "
                         f"budget {_fmt(e.budget)}; recompute {e.predicted_recompute_s * 1e3:,.1f} ms/step"
                         + (f"; measured {plan_tier(e)} peak {_fmt(measured)} (whole process)"
                            if measured is not None else ""))
        return "CheckpointPlanView: " + "; ".join(parts)
