"""PipelineTimeline: what every rank of a pipeline did in a step, as a Gantt chart, live.

A row per rank, grouped by pipeline stage (ordered by stage, then dp, then tp), labelled
``stage s · dp d · tp t · rank r · bubble b``; a bar per measured ``StageSpan``
(F/B/W/send/recv/optim, labelled with its microbatch), times in ms from the step's first span.
Ranks that share a stage (data or tensor parallelism) each get their own row and bubble: each
can stand idle on its own, and one merged row would hide it. Where a stage has several ranks,
a line separates the stage groups and each group carries the stage's bubble (the mean over its
ranks); the title gives the mean over all ranks. Bubbles come from ``telemetry``'s bubble
functions, the same ones the pipeline runtime logs with, so the widget and the log never
disagree. A step selector (a dropdown; "latest" follows the run) picks the step;
``export_chrome_trace(path)`` writes every span seen as a Chrome/Perfetto trace via
``telemetry.to_chrome_trace``.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import plotly.graph_objects as go

from colossal_lab.engine.telemetry import SPAN_KINDS, StageSpan, rank_label, to_chrome_trace

from ._live import LiveView, template_json
from .state import KIND_COLORS, TimelineRow, TimelineState, reduce_all


def _row_label(row: TimelineRow) -> str:
    return f"{rank_label(row.rank, row.stage, row.dp, row.tp)} · bubble {row.bubble:.0%}"


def _stage_groups(rows: List[TimelineRow], stage_bubbles: Dict[int, float]):
    """Separator lines between stage groups and a ``stage s · bubble b`` note on each group, in
    the y axis's category positions (row ``i`` from the top sits at ``len(rows) - 1 - i``)."""
    n = len(rows)
    shapes, notes = [], []
    for i, row in enumerate(rows):
        if i and row.stage == rows[i - 1].stage:
            continue
        top = n - 1 - i + 0.5  # the upper edge of the group's first row
        if i:
            shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y",
                           "y0": top, "y1": top, "line": {"color": "#888", "width": 1, "dash": "dot"}})
        notes.append({"xref": "paper", "x": 1.0, "xanchor": "right", "yref": "y", "y": top,
                      "yanchor": "middle", "showarrow": False, "font": {"size": 11},
                      "bgcolor": "rgba(255,255,255,0.8)",
                      "text": f"stage {row.stage} · bubble {stage_bubbles[row.stage]:.0%}"})
    return shapes, notes


def timeline_dict(state: TimelineState, step: Optional[int] = None) -> dict:
    """The Gantt chart of ``step`` (default: the newest step seen) as a plain plotly dict."""
    steps = state.steps
    if step is None and steps:
        step = steps[-1]
    spans = state.spans_of(step) if step is not None else []
    rows = state.rows(step) if spans else []
    labels = {row.rank: _row_label(row) for row in rows}
    t0 = min((s.start for s in spans), default=0.0)

    data = []
    for kind in SPAN_KINDS:
        ks = [s for s in spans if s.kind == kind]
        data.append({
            "type": "bar", "name": kind, "orientation": "h", "y": [labels[s.rank] for s in ks],
            "base": [(s.start - t0) * 1e3 for s in ks], "x": [s.duration * 1e3 for s in ks],
            "text": ["" if s.microbatch < 0 else str(s.microbatch) for s in ks],
            "textposition": "inside", "insidetextanchor": "middle",
            "customdata": [[s.stage, s.microbatch, s.start, s.end, s.dp, s.tp, s.rank] for s in ks],
            "hovertemplate": (f"{kind}" + " mb %{customdata[1]} · stage %{customdata[0]} · dp %{customdata[4]}"
                              " · tp %{customdata[5]} · rank %{customdata[6]}"
                              "<br>%{base:.2f} → %{x:.2f} ms long<extra></extra>"),
            "marker": {"color": KIND_COLORS[kind], "line": {"color": "white", "width": 0.5}}})
    shapes, notes = [], []
    if rows:
        stage_bubbles = state.bubbles(step)
        mean = sum(row.bubble for row in rows) / len(rows)
        title = (f"PipelineTimeline · step {step} of {len(steps)} seen · "
                 f"{len(stage_bubbles)} stage(s) × {len(rows)} rank(s) · mean bubble {mean:.0%}")
        if len(stage_bubbles) < len(rows):  # some stage has several ranks: mark the groups
            shapes, notes = _stage_groups(rows, stage_bubbles)
    else:
        title = "PipelineTimeline · waiting for StageSpans"
    order = [labels[row.rank] for row in rows]
    per_row = 48 if len(rows) <= 16 else 28
    layout = {"template": template_json(), "title": {"text": title}, "barmode": "overlay",
              "height": max(260, 90 + per_row * len(rows)),
              "margin": {"l": 40, "r": 20, "t": 60, "b": 40},
              "legend": {"orientation": "h", "y": -0.2}, "bargap": 0.25,
              # the unit on the ticks, not as an axis title: the legend sits under the axis
              "xaxis": {"ticksuffix": " ms", "hoverformat": ".2f"},
              "yaxis": {"categoryorder": "array", "categoryarray": order[::-1],
                        "automargin": True},
              "shapes": shapes, "annotations": notes}
    return {"data": data, "layout": layout}


def timeline_figure(state: TimelineState, step: Optional[int] = None) -> go.Figure:
    """``timeline_dict`` as a validated ``go.Figure`` (for static use)."""
    return go.Figure(timeline_dict(state, step))


class PipelineTimeline(LiveView):
    """Gantt rows per rank grouped by stage, bubbles per rank and per stage, a step selector,
    Chrome-trace export."""

    accepts = (StageSpan,)

    def _init_state(self) -> None:
        self.timeline = TimelineState()
        self.step: Optional[int] = None  # None = follow the newest step
        self._selector = None

    def _fold(self, events) -> bool:
        changed = reduce_all(events, timeline=self.timeline) > 0
        if changed and self._selector is not None:
            self._sync_selector()
        return changed

    def build_dict(self) -> dict:
        step = self.step if self.step in self.timeline.steps else None
        return timeline_dict(self.timeline, step)

    def select_step(self, step: Optional[int]) -> None:
        """Show ``step`` (``None`` follows the newest step)."""
        if step is not None and step not in self.timeline.steps:
            raise ValueError(f"select_step(step={step!r}): no spans for that step; "
                             f"steps seen: {self.timeline.steps[-10:]}")
        self.step = step
        self.redraw()

    def _shown(self, step: Optional[int]) -> Optional[int]:
        steps = self.timeline.steps
        return step if step is not None else (self.step if self.step in steps else
                                              (steps[-1] if steps else None))

    def bubbles(self, step: Optional[int] = None):
        """``{stage: bubble fraction}`` of ``step`` (default: the one shown); a stage's is the
        mean over its ranks."""
        step = self._shown(step)
        return self.timeline.bubbles(step) if step is not None else {}

    def rank_bubbles(self, step: Optional[int] = None):
        """``{rank: bubble fraction}`` of ``step`` (default: the one shown)."""
        step = self._shown(step)
        return self.timeline.rank_bubbles(step) if step is not None else {}

    def export_chrome_trace(self, path) -> str:
        """Write every span seen as a Chrome/Perfetto JSON trace; returns the path."""
        path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"export_chrome_trace(path={path!r}): folder {parent!r} "
                                    "does not exist")
        with self._lock:
            trace = to_chrome_trace(self.timeline.spans)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(trace, f)
        return path

    # the dropdown's value for "follow the newest step": ipywidgets shows a value of None as
    # "nothing selected" (a blank box), so "latest" needs a real value
    _LATEST = -1

    def _sync_selector(self) -> None:
        opts = [("latest", self._LATEST)] + [(f"step {s}", s) for s in self.timeline.steps]
        if list(self._selector.options) != opts:
            keep = self.step if self.step in self.timeline.steps else self._LATEST
            self._syncing = True  # replacing options resets the selection: not a user's pick
            try:
                self._selector.options = opts
                self._selector.value = keep
            finally:
                self._syncing = False

    def widget(self):
        if self._out is None:
            return None
        if self._selector is None:
            import ipywidgets as W

            self._selector = W.Dropdown(description="step", options=[("latest", self._LATEST)],
                                        value=self._LATEST, layout=W.Layout(width="220px"))
            self._sync_selector()
            self._selector.observe(self._on_select, names="value")
            self._box = W.VBox([self._selector, self._out])
        return self._box

    def _on_select(self, change) -> None:
        new = change["new"]
        if new is None or getattr(self, "_syncing", False):
            return  # options being replaced, not the user picking
        self.select_step(None if new == self._LATEST else new)

    def summary(self) -> str:
        steps = self.timeline.steps
        if not steps:
            return "PipelineTimeline: no StageSpans yet"
        rows = self.timeline.rows(steps[-1])
        b = self.timeline.bubbles(steps[-1])
        n = {s: sum(row.stage == s for row in rows) for s in b}
        bs = ", ".join(f"stage {s}: {v:.0%}" + (f" (mean of {n[s]} ranks)" if n[s] > 1 else "")
                       for s, v in b.items())
        return (f"PipelineTimeline: {len(self.timeline.spans)} spans over {len(steps)} step(s); "
                f"step {steps[-1]} bubbles: {bs}")
