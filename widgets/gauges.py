"""MemoryGauges: one gauge per rank x tier from ``MemorySample`` events, live.

Each gauge shows MiB in use against the tier's capacity on that rank (GPU memory from
torch.cuda, host RSS against RSS + available, NVMe directory bytes against bytes + free disk:
see ``colossal_lab.engine.telemetry.memory``). Rows are ranks, columns tiers; a gauge turns
orange above 80 % and red above 95 % of capacity. Where a sample carries the optional detail
it is drawn too: ``peak`` as a dark tick on the gauge's arc and in the caption, ``reserved``
(bytes held beyond ``used``, e.g. torch's allocator cache) as a pale band right after the
bar, ``util`` (GPU utilisation, %) in the caption.
"""

from __future__ import annotations

import plotly.graph_objects as go

from colossal_lab.engine.telemetry import MemorySample

from ._live import LiveView, template_json
from .state import TIER_COLORS, MemoryState, reduce_all

MIB = float(1 << 20)


def _caption(s: MemorySample) -> str:
    """The small line under a gauge's title: capacity, then the detail the sample carries."""
    parts = [f"of {s.capacity / MIB:,.0f} MiB"]
    if s.peak:
        parts.append(f"peak {s.peak / MIB:,.0f}")
    if s.reserved:
        parts.append(f"+{s.reserved / MIB:,.0f} reserved")
    if s.util is not None:
        parts.append(f"util {s.util:.0f}%")
    return " · ".join(parts)


def gauges_dict(memory: MemoryState) -> dict:
    """One indicator per rank x tier, as a plain plotly dict."""
    ranks, tiers = memory.ranks, memory.tiers
    data = []
    nr, nc = max(1, len(ranks)), max(1, len(tiers))
    for i, r in enumerate(ranks):
        for j, t in enumerate(tiers):
            s = memory.samples.get((r, t))
            if s is None:
                continue
            cap = max(s.capacity, s.used + s.reserved, s.peak, 1) / MIB
            frac = s.used / max(s.capacity, 1)
            color = "#d62728" if frac > 0.95 else "#ff7f0e" if frac > 0.8 else TIER_COLORS[t]
            gauge = {"axis": {"range": [0, cap]}, "bar": {"color": color}}
            if s.reserved:
                gauge["steps"] = [{"range": [s.used / MIB, (s.used + s.reserved) / MIB],
                                   "color": "rgba(127,127,127,0.25)"}]
            if s.peak:
                gauge["threshold"] = {"value": s.peak / MIB, "thickness": 0.9,
                                      "line": {"color": "#333333", "width": 2}}
            data.append({
                "type": "indicator", "mode": "gauge+number", "value": s.used / MIB,
                "name": f"rank {r} {t}",
                "number": {"suffix": " MiB", "valueformat": ",.1f", "font": {"size": 16}},
                "title": {"text": f"rank {r} · {t}<br><span style='font-size:0.7em'>"
                                  f"{_caption(s)}</span>", "font": {"size": 13}},
                "gauge": gauge,
                "domain": {"row": i, "column": j}})
    layout = {"template": template_json(),
              "grid": {"rows": nr, "columns": nc, "pattern": "independent"},
              "height": max(200, 190 * nr), "margin": {"l": 30, "r": 30, "t": 60, "b": 10},
              "title": {"text": "MemoryGauges" + ("" if ranks else " · waiting for MemorySamples")}}
    return {"data": data, "layout": layout}


def gauges_figure(memory: MemoryState) -> go.Figure:
    """``gauges_dict`` as a validated ``go.Figure`` (for static use)."""
    return go.Figure(gauges_dict(memory))


class MemoryGauges(LiveView):
    """Per rank x tier gauges of used vs capacity bytes."""

    accepts = (MemorySample,)

    def _init_state(self) -> None:
        self.memory = MemoryState()

    def _fold(self, events) -> bool:
        return reduce_all(events, memory=self.memory) > 0

    def build_dict(self) -> dict:
        return gauges_dict(self.memory)

    def values(self):
        """``{(rank, tier): (used bytes, capacity bytes)}`` as currently drawn."""
        return {k: (s.used, s.capacity) for k, s in sorted(self.memory.samples.items())}

    def details(self):
        """``{(rank, tier): MemorySample}``: the sample each gauge draws, with its optional
        ``peak`` / ``reserved`` / ``util`` (0 / ``None`` where not measured)."""
        return dict(sorted(self.memory.samples.items()))

    def summary(self) -> str:
        if not self.memory.samples:
            return "MemoryGauges: no MemorySamples yet"
        parts = [f"rank {r} {t}: {s.used / MIB:,.0f}/{s.capacity / MIB:,.0f} MiB"
                 + (f" (peak {s.peak / MIB:,.0f})" if s.peak else "")
                 + (f" util {s.util:.0f}%" if s.util is not None else "")
                 for (r, t), s in self.details().items()]
        return "MemoryGauges: " + "; ".join(parts)
