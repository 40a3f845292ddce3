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

Past ``max_panels`` layers (8; a DeepSeek-V3-sized model has 58) the figure starts with one
summary heatmap, layers (y, model order) × steps (x), each cell the layer's imbalance at that step,
and draws detail panels for ``max_panels`` layers only: the highest imbalance at their newest step
(listed in model order), or those pinned by ``view.select([...])``. The summary sums each
(layer, step) once (``ExpertLoadState.totals``), so its redraw costs one cell per layer × kept step.

The newest ``ExpertLoadState.keep_steps`` steps are kept (older ones fall off the left), so a long
run's redraw stays bounded. It is built on plotly's ``heatmap`` and ``bar`` traces and the shared
``LiveView`` machinery (queue, throttled redraw), like its siblings; it reads the events' plain
fields only (DESIGN.md).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

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
MAX_PANELS = 8  # detail panels past which the view starts with the layers x steps summary
SUMMARY_ROW_PX, SUMMARY_X_PX = 12, 40  # px per layer row of the summary, its step ticks under it
TITLE_LINE_PX = 24  # the title's second line (the shown layers) when the summary is drawn


def imbalance(tokens: Sequence[int]) -> float:
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


def imbalance_grid(state: ExpertLoadState) -> Tuple[List[str], List[int], List[List[Optional[float]]],
                                                    List[List[Optional[int]]]]:
    """``(layers, steps, imb, dropped)``: ``imb[l][i]`` the ``imbalance`` of ``layers[l]`` at
    ``steps[i]`` (tokens summed over ranks), ``dropped[l][i]`` likewise; None where that layer has no
    event at that step. One cell per layer × kept step, from ``state.totals`` (summed once per key)."""
    layers, steps = state.layers, state.steps
    imb: List[List[Optional[float]]] = []
    dropped: List[List[Optional[int]]] = []
    for layer in layers:
        ri, rd = [], []
        for s in steps:
            got = state.totals(layer, s)
            ri.append(None if got is None else imbalance(got[0]))
            rd.append(None if got is None else got[1])
        imb.append(ri)
        dropped.append(rd)
    return layers, steps, imb, dropped


def busiest_layers(state: ExpertLoadState, n: int) -> List[str]:
    """The ``n`` layers of the highest imbalance at their newest step (ties: model order), listed in
    model order, so the panels keep their places while the chosen set stays the same."""
    layers, steps = state.layers, state.steps[::-1]
    newest = []
    for i, layer in enumerate(layers):
        tokens = next(got[0] for got in (state.totals(layer, s) for s in steps) if got is not None)
        newest.append((-imbalance(tokens), i))
    return [layers[i] for _, i in sorted(sorted(newest)[:n], key=lambda t: t[1])]


def shown_layers(state: ExpertLoadState, max_panels: Optional[int] = None,
                 selected: Optional[List[str]] = None) -> Tuple[List[str], bool]:
    """``(layers drawn as detail panels in model order, whether they are a pinned choice)``: the
    ``selected`` layers still kept, else every layer up to ``max_panels`` (None: no limit), else the
    ``busiest_layers``."""
    layers, sel = state.layers, set(selected or ())
    pinned = [n for n in layers if n in sel]
    if pinned:
        return pinned, True
    if max_panels is None or len(layers) <= max_panels:
        return layers, False
    return busiest_layers(state, max_panels), False


def _summary_trace(state: ExpertLoadState, shown: List[str], k: int, domain: List[float]) -> Tuple[dict, dict]:
    """The layers × steps heatmap of each cell's imbalance (its own colour axis ``coloraxis2``) on
    axes number ``k``; the shown layers' names are marked with a dot."""
    layers, steps, imb, dropped = imbalance_grid(state)
    on = set(shown)
    trace = {"type": "heatmap", "name": "imbalance", "x": steps, "y": layers, "z": imb, "customdata": dropped,
             "coloraxis": "coloraxis2", "xaxis": _ref("x", k), "yaxis": _ref("y", k), "xgap": 1, "ygap": 1,
             "hovertemplate": "%{y} · step %{x}<br>max/mean %{z:.2f} · dropped %{customdata:,}<extra></extra>"}
    axes = {_axis("x", k): {"domain": [0, 1], "anchor": _ref("y", k), "title": {"text": "step"}},
            _axis("y", k): {"domain": domain, "anchor": _ref("x", k), "autorange": "reversed",
                            "tickmode": "array", "tickvals": layers, "tickfont": {"size": 9},
                            "ticktext": [f"● {n}" if n in on else n for n in layers]}}
    return trace, axes


def expert_load_dict(state: ExpertLoadState, max_panels: Optional[int] = None,
                     selected: Optional[List[str]] = None) -> dict:
    """One heatmap (experts × steps) and one dropped-tokens bar row per layer, as a plain plotly dict.

    Past ``max_panels`` layers (or with ``selected`` given) the figure starts with one layers × steps
    heatmap of the imbalance and draws detail panels for ``selected`` only (default: the
    ``busiest_layers``)."""
    all_layers = state.layers
    if not all_layers:
        return {"data": [], "layout": {"template": template_json(), "height": 200,
                                       "title": {"text": "ExpertLoadView · waiting for ExpertLoad events"}}}
    layers, pinned = shown_layers(state, max_panels, selected)
    many = pinned or len(layers) < len(all_layers)
    grids = [state.grid(layer) for layer in layers]
    # panel heights in px, top to bottom: title gap, heatmap, dropped bars
    heights = [(GAP_PX, max(120, HEAT_PX * len(g.z)), BAR_PX) for g in grids]
    summary_h = max(120, SUMMARY_ROW_PX * len(all_layers)) + SUMMARY_X_PX if many else 0
    plot_h = summary_h + sum(sum(h) for h in heights)  # the plot area (between the margins), in px
    top = TOP_PX + (TITLE_LINE_PX if many else 0)  # the title's second line names the shown layers
    total = top + plot_h + 40
    zmax = max((max(max(row) for row in g.z) for g in grids if g.z), default=1) or 1
    data, notes = [], []
    detail = sum(len(g.z) * len(g.steps) for g in grids) <= HOVER_CELLS
    layout = {"template": template_json(), "height": total, "showlegend": False,
              "margin": {"l": 60 if not many else 140, "r": 20, "t": top, "b": 40},
              "coloraxis": {"colorscale": "Viridis", "cmin": 0, "cmax": zmax,
                            "colorbar": {"title": {"text": "tokens"}, "thickness": 12}}}
    pos = plot_h - summary_h  # px above the plot area's bottom edge, walking down panel by panel
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
    layout["title"] = {"text": f"ExpertLoadView · {len(all_layers)} MoE layer(s) · steps {steps[0]}–{steps[-1]}"
                               f" · {len(state.ranks)} rank(s)"}
    if many:
        k = 2 * len(layers) + 1
        # the summary's step ticks sit in SUMMARY_X_PX under it, above the first panel's title gap
        trace, axes = _summary_trace(state, layers, k, [(plot_h - summary_h + SUMMARY_X_PX) / plot_h, 1.0])
        data.insert(0, trace)
        layout.update(axes)
        layout["coloraxis2"] = {"colorscale": "YlOrRd", "cmin": 1,
                                "colorbar": {"title": {"text": "max/mean"}, "thickness": 12, "yanchor": "top",
                                             "y": 1.0, "len": summary_h / plot_h}}
        layout["coloraxis"]["colorbar"].update({"yanchor": "bottom", "y": 0, "len": 1 - summary_h / plot_h})
        how = "pinned by view.select" if pinned else "highest max/mean at the newest step"
        layout["title"]["text"] += (f"<br>{len(layers)} shown ({how}): " + ", ".join(layers))
    return {"data": data, "layout": layout}


def expert_load_figure(state: ExpertLoadState, max_panels: Optional[int] = None,
                       selected: Optional[List[str]] = None) -> go.Figure:
    """``expert_load_dict`` as a validated ``go.Figure`` (for static use)."""
    return go.Figure(expert_load_dict(state, max_panels, selected))


class ExpertLoadView(LiveView):
    """Per MoE layer, a heatmap of tokens per expert per step (summed over ranks) with the dropped
    tokens under it. ``on_first_load``, when set, is called once (on the thread that folds) when
    the first ``ExpertLoad`` arrives: the ``Dashboard`` shows the view from then on.

    Past ``max_panels`` layers the figure starts with one layers × steps heatmap of each layer's
    imbalance and draws detail panels for ``max_panels`` layers only: the busiest at the newest step,
    or those pinned by ``select``."""

    accepts = (ExpertLoad,)

    def __init__(self, *, max_panels: int = MAX_PANELS, **kw):
        if not (isinstance(max_panels, int) and not isinstance(max_panels, bool) and max_panels > 0):
            raise ValueError(f"ExpertLoadView(max_panels={max_panels!r}): must be a positive int "
                             f"(the detail panels drawn; default {MAX_PANELS})")
        self.max_panels = max_panels
        self._selected: Optional[List[str]] = None
        super().__init__(**kw)

    def _init_state(self) -> None:
        self.experts = ExpertLoadState()
        self.on_first_load = None

    def select(self, layers: Optional[Iterable[str]]) -> None:
        """Pin the detail panels to ``layers`` (names from ``view.layers``, at most ``max_panels``),
        or ``None`` to go back to the busiest layers at the newest step. Redraws now."""
        with self._lock:
            if layers is None:
                self._selected = None
            else:
                if isinstance(layers, str):
                    raise ValueError(f"ExpertLoadView.select(layers={layers!r}): pass a list of layer "
                                     f"names, e.g. select([{layers!r}])")
                want = list(dict.fromkeys(layers))
                known = self.experts.layers
                unknown = [n for n in want if n not in set(known)]
                if unknown or not want:
                    raise ValueError(f"ExpertLoadView.select(layers={want!r}): "
                                     + (f"unknown layer(s) {unknown}" if unknown else "no layer given")
                                     + f"; known layers: {known} (select(None) for automatic)")
                if len(want) > self.max_panels:
                    raise ValueError(f"ExpertLoadView.select(layers=<{len(want)} names>): more than "
                                     f"max_panels={self.max_panels}; pick fewer or make the view with "
                                     f"ExpertLoadView(max_panels={len(want)})")
                self._selected = want
        self.redraw()

    @property
    def shown(self) -> List[str]:
        """The layers drawn as detail panels now, in model order."""
        with self._lock:
            return shown_layers(self.experts, self.max_panels, self._selected)[0]

    def _fold(self, events) -> bool:
        had = bool(self.experts.loads)
        changed = reduce_all(events, experts=self.experts) > 0
        if changed and not had and self.on_first_load is not None:
            self.on_first_load(self)
        return changed

    def build_dict(self) -> dict:
        return expert_load_dict(self.experts, self.max_panels, self._selected)

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
