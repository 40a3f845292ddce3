"""MemoryGauges: one gauge per rank x tier from ``MemorySample`` events, live.

Each gauge shows MiB in use against the tier's capacity on that rank (GPU memory from
torch.cuda, host RSS against RSS + available, NVMe directory bytes against bytes + free disk:
see ``colossal_lab.engine.telemetry.memory``). Rows are ranks, columns tiers; a gauge turns
orange above 80 % and red above 95 % of capacity.
"""

from __future__ import annotations

import plotly.graph_objects as go

from colossal_lab.engine.telemetry import MemorySample

from ._live import LiveView, template_json
from .state import TIER_COLORS, MemoryState, reduce_all

MIB = float(1 << 20)


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
            cap = max(s.capacity, s.used, 1) / MIB
            frac = s.used / max(s.capacity, 1)
            color = "#d62728" if frac > 0.95 else "#ff7f0e" if frac > 0.8 else TIER_COLORS[t]
            data.append({
                "type": "indicator", "mode": "gauge+number", "value": s.used / MIB,
                "name": f"rank {r} {t}",
                "number": {"suffix": " MiB", "valueformat": ",.1f", "font": {"size": 16}},
                "title": {"text": f"rank {r} · {t}<br><span style='font-size:0.7em'>"
                                  f"of {s.capacity / MIB:,.0f} MiB</span>", "font": {"size": 13}},
                "gauge": {"axis": {"range": [0, cap]}, "bar": {"color": color}},
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

    def summary(self) -> str:
        if not self.memory.samples:
            return "MemoryGauges: no MemorySamples yet"
        parts = [f"rank {r} {t}: {u / MIB:,.0f}/{c / MIB:,.0f} MiB"
                 for (r, t), (u, c) in self.values().items()]
        return "MemoryGauges: " + "; ".join(parts)
