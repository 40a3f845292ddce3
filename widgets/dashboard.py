"""Dashboard: loss and tokens/s curves, ChunkMap, PipelineTimeline and MemoryGauges in one.

``Dashboard.figure`` is its own picture (loss and per-rank tokens/s from ``StepMetrics``);
the three other views are ``.chunk_map``, ``.timeline`` and ``.gauges``, each with its own
``figure`` and state. ``Dashboard(plan=cl.plan(...))`` adds a fifth, ``.fit_plan``: the predicted
bytes per rank and tier as stacked bars, with each rank's measured peak (from ``MemorySample``
events) marked on them once the run starts. ``.checkpoint_plan`` (a ``CheckpointPlanView``) is
always fed but shown (in ``views``, the widget, the static HTML and the summary) only from the
first ``CheckpointPlanEvent`` on, so a run that never plans activation checkpointing gets no empty
panel for it. ``.expert_load`` (an ``ExpertLoadView``: tokens per expert per step, per MoE layer)
is shown the same way, from the first ``ExpertLoad`` on, so a dense run looks as before. One
bus subscription and one redraw thread serve all the views: each wake it routes the queued
events by type to the views that draw them and redraws only the views whose state changed
(one thread for all of them keeps the wake-ups and GIL hand-offs down, and the emitting
thread pays one queue append per event whatever the number of views).
``%colossal dashboard`` attaches the relay to the running cluster and shows one of these.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import plotly.graph_objects as go

from colossal_lab.engine.telemetry import StepMetrics

from ._live import LiveView, columns_layout, template_json
from .checkpoint_plan import CheckpointPlanView
from .chunk_map import ChunkMap
from .expert_load import ExpertLoadView
from .fit_plan import FitPlan
from .gauges import MemoryGauges
from .state import MetricsState, reduce_all
from .timeline import PipelineTimeline

MAX_POINTS = 1000  # per curve: a long run's redraw (and its comm message) stays bounded


def thin(xs: List[int], ys: List[float], n: int = MAX_POINTS) -> Tuple[List[int], List[float]]:
    """At most ``n`` points: consecutive steps averaged in equal buckets, each bucket drawn at its
    last step (so the newest step is always the last x)."""
    if len(xs) <= n:
        return list(xs), list(ys)
    k = -(-len(xs) // n)
    ox, oy = [], []
    for i in range(len(xs) - k * (-(-len(xs) // k)), len(xs), k):  # buckets aligned to the end
        lo = max(0, i)
        bx, by = xs[lo:i + k], ys[lo:i + k]
        ox.append(bx[-1])
        oy.append(sum(by) / len(by))
    return ox, oy


def metrics_dict(metrics: MetricsState) -> dict:
    """Loss and per-rank tokens/s curves as a plain plotly dict (long runs thinned to
    ``MAX_POINTS`` per curve)."""
    xs, ys = metrics.loss_curve()
    lx, ly = thin(xs, ys)
    mode = "lines+markers" if len(lx) < 200 else "lines"
    data = [{"type": "scatter", "name": "loss", "x": lx, "y": ly,
             "mode": mode, "xaxis": "x", "yaxis": "y"}]
    for r in metrics.ranks:
        sx, sy = thin(*metrics.tokens_per_s(r))
        data.append({"type": "scatter", "name": f"rank {r} tok/s", "x": sx, "y": sy,
                     "mode": mode, "xaxis": "x2", "yaxis": "y2"})
    last = f" · step {xs[-1]} loss {ys[-1]:.4f}" if xs else " · waiting for StepMetrics"
    layout = columns_layout([1, 1], 0.12, ("loss", "tokens/s per rank"))
    layout["xaxis"]["title"] = {"text": "step"}
    layout["xaxis2"]["title"] = {"text": "step"}
    layout.update(template=template_json(), title={"text": "Training" + last}, height=300,
                  margin={"l": 50, "r": 20, "t": 60, "b": 40},
                  legend={"orientation": "h", "y": -0.25})
    return {"data": data, "layout": layout}


def metrics_figure(metrics: MetricsState) -> go.Figure:
    """``metrics_dict`` as a validated ``go.Figure`` (for static use)."""
    return go.Figure(metrics_dict(metrics))


class Dashboard(LiveView):
    """The views in one layout (metrics, chunk map, timeline, gauges; the fit plan when given a
    plan; the checkpoint plan once one arrives; the expert load once an ``ExpertLoad`` arrives),
    all fed from this process's telemetry bus through one subscription and one redraw thread
    (``_throttle``, shared by every view).

    ``max_hz`` (5 by default) bounds the redraws of each view: a tick redraws only the views
    whose state changed, and in the browser each redraw is one ``Plotly.react`` on a plot that
    already exists (``_frontend.py``), cheap enough for the page to keep up with every view at
    that rate."""

    accepts = (StepMetrics,)

    def __init__(self, *, subscribe: bool = True, live: Optional[bool] = None,
                 max_hz: float = 5.0, plan=None):
        kw = dict(subscribe=False, live=live, max_hz=max_hz)  # the parts: served by our thread
        self.chunk_map = ChunkMap(**kw)
        self.timeline = PipelineTimeline(**kw)
        self.gauges = MemoryGauges(**kw)
        # the prediction (``cl.plan``'s FitPlan or its to_dict()), measured peaks laid over it
        self.fit_plan = FitPlan(plan, **kw) if plan is not None else None
        # fed from the start (it keeps measured peaks), shown once a plan arrives
        self.checkpoint_plan = CheckpointPlanView(**kw)
        self.checkpoint_plan.on_first_plan = self._show_checkpoint_plan
        # fed from the start, shown once the first ExpertLoad arrives (an MoE run)
        self.expert_load = ExpertLoadView(**kw)
        self.expert_load.on_first_load = self._show_checkpoint_plan
        self._box = None
        super().__init__(subscribe=subscribe, live=live, max_hz=max_hz)

    def _parts(self) -> List[LiveView]:
        """The views shown besides this one (the metrics), in display order."""
        parts: List[LiveView] = [self.chunk_map, self.timeline, self.gauges]
        parts += [self.fit_plan] if self.fit_plan is not None else []
        parts += [self.checkpoint_plan] if self.checkpoint_plan.plans.plans else []
        return parts + ([self.expert_load] if self.expert_load.experts.loads else [])

    def _fed_parts(self) -> List[LiveView]:
        """Every view besides this one that events are routed to, shown or not yet."""
        parts = self._parts()
        return parts + [v for v in (self.checkpoint_plan, self.expert_load) if v not in parts]

    def _served_views(self) -> List[LiveView]:
        return [self] + self._fed_parts()

    def _show_checkpoint_plan(self, view: LiveView) -> None:
        """The first plan (or expert load) arrived: add the view to the live widget (if one is
        shown already)."""
        box, w = self._box, view.widget()
        if box is not None and w is not None and w not in box.children:
            box.children = tuple(box.children) + (w,)

    @property
    def views(self) -> Dict[str, LiveView]:
        out = {"metrics": self, "chunk_map": self.chunk_map, "timeline": self.timeline,
               "gauges": self.gauges}
        if self.fit_plan is not None:
            out["fit_plan"] = self.fit_plan
        if self.checkpoint_plan.plans.plans:
            out["checkpoint_plan"] = self.checkpoint_plan
        if self.expert_load.experts.loads:
            out["expert_load"] = self.expert_load
        return out

    @property
    def figures(self) -> Dict[str, go.Figure]:
        return {k: v.figure for k, v in self.views.items()}

    def _init_state(self) -> None:
        self.metrics = MetricsState()

    def _fold(self, events) -> bool:
        return reduce_all(events, metrics=self.metrics) > 0

    def build_dict(self) -> dict:
        return metrics_dict(self.metrics)

    def feed(self, event) -> None:
        """Queue one event for whichever of the views draws its type."""
        for v in self._served_views():
            if isinstance(event, v.accepts):
                v._queue.append(event)

    def update(self, events: Iterable) -> None:
        events = list(events)
        super().update(events)
        for v in self._fed_parts():
            v.update([e for e in events if isinstance(e, v.accepts)])

    def flush(self) -> None:
        super().flush()  # the shared queue, into every view
        for v in self._fed_parts():
            with v._lock:
                v._take([])
            v.redraw()

    @property
    def redraw_counts(self) -> Dict[str, int]:
        return {k: v.redraws for k, v in self.views.items()}

    def widget(self):
        if self._box is None:
            import ipywidgets as W

            parts = [self._out] + [v.widget() for v in self._parts()]
            if any(p is None for p in parts):
                return None
            self._box = W.VBox(parts)
        return self._box

    def static_html(self) -> str:
        return "\n".join(v.static_figure().to_html(full_html=False,
                                                    include_plotlyjs="cdn" if i == 0 else False)
                         for i, v in enumerate(self.views.values()))

    def summary(self) -> str:
        xs, ys = self.metrics.loss_curve()
        head = (f"Dashboard: step {xs[-1]}, loss {ys[-1]:.4f}" if xs
                else "Dashboard: no StepMetrics yet")
        return "\n".join([head] + [v.summary() for v in self._parts()])

    def close(self) -> None:
        for v in self._fed_parts():
            v.close()
        super().close()
