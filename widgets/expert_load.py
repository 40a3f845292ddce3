"""ExpertLoadView: how many tokens each expert of each MoE layer got, step by step, live.

``engine/moe`` emits an ``ExpertLoad(rank, step, layer, tokens, dropped)`` per MoE layer, rank and
optimizer step (docs/moe.md, "Telemetry"). This view draws, per layer (one panel each, in model
order, ``blocks.2`` before ``blocks.10``):

* a heatmap, experts (y) × steps (x), each cell the token-to-expert assignments routed to that
  expert at that step summed over the ranks that reported it; one colour scale for every layer
  (from 0), so a hot expert in one layer reads as hot next to another layer's. Hover gives the
  expert's share of the step's routed tokens and the per-rank breakdown (up to ``HOVER_CELLS``
  cells in all: past that only the tokens, so a redraw's message stays small);
* under it, a bar per step: the assignments a capacity factor dropped (summed over ranks);
* in the panel's title, at the newest step: the imbalance (the busiest expert's load over the
  mean, 1.0 = balanced) and the dropped share.

The newest ``ExpertLoadState.keep_steps`` steps are kept (older ones fall off the left), so a long
run's redraw stays bounded. It is built on plotly's ``heatmap`` and ``bar`` traces and the shared
``LiveView`` machinery (queue, throttled redraw), like its siblings; it reads the events' plain
fields only (DESIGN.md).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import plotly.graph_objects as go

from colossal_lab.engine.telemetry.events import ExpertLoad

from ._live import LiveView, template_json
from .state import ExpertLoad2D, ExpertLoadState, reduce_all

DROPPED_COLOR = "#d62728"
HEAT_PX, BAR_PX, GAP_PX, TOP_PX = 14, 60, 70, 70  # px per expert row, dropped bars, between panels, title
HOVER_RANKS = 8  # ranks listed in a cell's hover (the busiest, past that)
# cells (experts x steps, all layers) up to which the hover carries the share and per-rank breakdown:
# past it, every redraw would send megabytes of hover text, so cells hover with their tokens only
HOVER_CELLS = 16_384


def imbalance(tokens: List[int]) -> float:
    """The busiest expert's load over the mean load (1.0 = balanced; 0.0 when nothing was routed)."""
    total = sum(tokens)
    return max(tokens) * len(tokens) / total if total else 0.0


def _axis(kind: str, k: int) -> str:
    """Layout key (``xaxis``, ``yaxis3``) of axis number ``k`` (1-based)."""
    return f"{kind}axis" if k == 1 else f"{kind}axis{k}"


def _ref(kind: str, k: int) -> str:
    return kind if k == 1 else f"{kind}{k}"


def _breakdown(by_rank: Dict[int, Tuple[int, ...]], expert: int) -> str:
    """Hover lines ``rank r: tokens`` of one cell; past ``HOVER_RANKS`` ranks the busiest ones and a
    count of the rest (the hover text is sent with every redraw: it stays bounded on a large job)."""
    got = [(r, t[expert] if expert < len(t) else 0) for r, t in by_rank.items()]
    if len(got) > HOVER_RANKS:
        rest = len(got) - HOVER_RANKS
        got = sorted(got, key=lambda rt: -rt[1])[:HOVER_RANKS]
        return "<br>".join(f"rank {r}: {t:,}" for r, t in got) + f"<br>… +{rest} ranks"
    return "<br>".join(f"rank {r}: {t:,}" for r, t in got)


def _panel_title(layer: str, g: ExpertLoad2D) -> str:
    col = [row[-1] for row in g.z]
    routed, dropped = sum(col), g.dropped[-1]
    share = dropped / (routed + dropped) if routed + dropped else 0.0
    return (f"{layer} · {len(g.z)} experts · step {g.steps[-1]}: max/mean {imbalance(col):.2f}"
            f" · dropped {dropped:,} ({share:.1%})")


def expert_load_dict(state: ExpertLoadState) -> dict:
    """One heatmap (experts × steps) and one dropped-tokens bar row per layer, as a plain plotly dict."""
    layers = state.layers
    if not layers:
        return {"data": [], "layout": {"template": template_json(), "height": 200,
                                       "title": {"text": "ExpertLoadView · waiting for ExpertLoad events"}}}
    grids = [state.grid(layer) for layer in layers]
    # panel heights in px, top to bottom: title gap, heatmap, dropped bars
    heights = [(GAP_PX, max(120, HEAT_PX * len(g.z)), BAR_PX) for g in grids]
    plot_h = sum(sum(h) for h in heights)  # the plot area (between the margins), in px
    total = TOP_PX + plot_h + 40
    zmax = max((max(max(row) for row in g.z) for g in grids if g.z), default=1) or 1
    data, notes = [], []
    detail = sum(len(g.z) * len(g.steps) for g in grids) <= HOVER_CELLS
    layout = {"template": template_json(), "height": total, "showlegend": False,
              "margin": {"l": 60, "r": 20, "t": TOP_PX, "b": 40},
              "coloraxis": {"colorscale": "Viridis", "cmin": 0, "cmax": zmax,
                            "colorbar": {"title": {"text": "tokens"}, "thickness": 12}}}
    pos = plot_h  # px above the plot area's bottom edge, walking down panel by panel
    for i, (layer, g, (gap, hh, bh)) in enumerate(zip(layers, grids, heights)):
        kh, kb = 2 * i + 1, 2 * i + 2
        pos -= gap
        heat = [max(0.0, (pos - hh) / plot_h), pos / plot_h]
        title_y = pos / plot_h
        pos -= hh
        bar = [max(0.0, (pos - bh) / plot_h), (pos - 8) / plot_h]
        pos -= bh
        n = len(g.z)
        hm = {"type": "heatmap", "name": layer, "x": g.steps, "y": list(range(n)), "z": g.z,
                "coloraxis": "coloraxis", "xaxis": _ref("x", kh), "yaxis": _ref("y", kh), "xgap": 1, "ygap": 1,
                "hovertemplate": f"{layer} · step %{{x}} · expert %{{y}}<br>%{{z:,}} tokens<extra></extra>"}
        if detail:  # the share of the step and the per-rank breakdown per cell: bytes per cell
            per_step = [sum(row[c] for row in g.z) for c in range(len(g.steps))]
            hm["customdata"] = [[round(row[c] / per_step[c], 3) if per_step[c] else 0.0
                                   for c in range(len(g.steps))] for row in g.z]
            ranks = [state.per_rank(layer, s) for s in g.steps]
            hm["text"] = [[_breakdown(ranks[c], e) for c in range(len(g.steps))] for e in range(n)]
            hm["hovertemplate"] = (f"{layer} · step %{{x}} · expert %{{y}}<br>%{{z:,}} tokens "
                                     "(%{customdata:.0%} of the step's)<br>%{text}<extra></extra>")
        data.append(hm)
        data.append({"type": "bar", "name": f"dropped · {layer}", "x": g.steps, "y": g.dropped,
                     "marker": {"color": DROPPED_COLOR}, "xaxis": _ref("x", kb), "yaxis": _ref("y", kb),
                     "customdata": g.ranks,
                     "hovertemplate": "step %{x}: %{y:,} dropped (%{customdata} rank(s))<extra></extra>"})
        layout[_axis("x", kh)] = {"domain": [0, 1], "anchor": _ref("y", kh), "showticklabels": False}
        layout[_axis("y", kh)] = {"domain": heat, "anchor": _ref("x", kh), "title": {"text": "expert"},
                                  "autorange": "reversed", **({"dtick": 1} if n <= 16 else {})}
        layout[_axis("x", kb)] = {"domain": [0, 1], "anchor": _ref("y", kb), "matches": _ref("x", kh),
                                  "title": {"text": "step"} if i == len(layers) - 1 else None}
        layout[_axis("y", kb)] = {"domain": bar, "anchor": _ref("x", kb), "title": {"text": "dropped"},
                                  "rangemode": "tozero"}
        notes.append({"xref": "paper", "yref": "paper", "x": 0, "y": title_y, "xanchor": "left",
                      "yanchor": "bottom", "showarrow": False, "text": _panel_title(layer, g),
                      "font": {"size": 13}})
    steps = state.steps
    layout["annotations"] = notes
    layout["title"] = {"text": f"ExpertLoadView · {len(layers)} MoE layer(s) · steps {steps[0]}–{steps[-1]}"
                               f" · {len(state.ranks)} rank(s)"}
    return {"data": data, "layout": layout}


def expert_load_figure(state: ExpertLoadState) -> go.Figure:
    """``expert_load_dict`` as a validated ``go.Figure`` (for static use)."""
    return go.Figure(expert_load_dict(state))


class ExpertLoadView(LiveView):
    """Per MoE layer, a heatmap of tokens per expert per step (summed over ranks) with the dropped
    tokens under it. ``on_first_load``, when set, is called once (on the thread that folds) when
    the first ``ExpertLoad`` arrives: the ``Dashboard`` shows the view from then on."""

    accepts = (ExpertLoad,)

    def _init_state(self) -> None:
        self.experts = ExpertLoadState()
        self.on_first_load = None

    def _fold(self, events) -> bool:
        had = bool(self.experts.loads)
        changed = reduce_all(events, experts=self.experts) > 0
        if changed and not had and self.on_first_load is not None:
            self.on_first_load(self)
        return changed

    def build_dict(self) -> dict:
        return expert_load_dict(self.experts)

    @property
    def layers(self) -> List[str]:
        return self.experts.layers

    def load(self, layer: str) -> ExpertLoad2D:
        """``layer``'s grid as drawn: ``steps``, ``z[expert][step]`` (summed over ranks), ``dropped``."""
        with self._lock:
            return self.experts.grid(layer)

    def per_rank(self, layer: str, step: Optional[int] = None) -> Dict[int, Tuple[int, ...]]:
        """``{rank: tokens per expert}`` of ``layer`` at ``step`` (default: its newest)."""
        with self._lock:
            if step is None:
                step = self.experts.grid(layer).steps[-1]
            return self.experts.per_rank(layer, step)

    def summary(self) -> str:
        with self._lock:
            layers = self.experts.layers
            if not layers:
                return "ExpertLoadView: no ExpertLoad events yet"
            parts = []
            for layer in layers:
                g = self.experts.grid(layer)
                col = [row[-1] for row in g.z]
                parts.append(f"{layer} step {g.steps[-1]}: max/mean {imbalance(col):.2f}, "
                             f"dropped {g.dropped[-1]:,}")
            return "ExpertLoadView: " + "; ".join(parts)
