"""MemoryGauges: one gauge per rank x tier from ``MemorySample`` events, live.

Each gauge shows MiB in use against the tier's capacity on that rank (GPU memory from
torch.cuda, host RSS against RSS + available, NVMe directory bytes against bytes + free disk:
see ``colossal_lab.engine.telemetry.memory``). Rows are ranks, columns tiers; a gauge turns
orange above 80 % and red above 95 % of capacity.
"""

from __future__ import annotations

import plotly.graph_objects as go

from ._live import LiveView
from .state import TIER_COLORS, MemoryState, reduce_all

MIB = float(1 << 20)


def gauges_figure(memory: MemoryState) -> go.Figure:
    ranks, tiers = memory.ranks, memory.tiers
    fig = go.Figure()
    nr, nc = max(1, len(ranks)), max(1, len(tiers))
    for i, r in enumerate(ranks):
        for j, t in enumerate(tiers):
            s = memory.samples.get((r, t))
            if s is None:
                continue
            cap = max(s.capacity, s.used, 1) / MIB
            frac = s.used / max(s.capacity, 1)
            color = "#d62728" if frac > 0.95 else "#ff7f0e" if frac > 0.8 else TIER_COLORS[t]
            fig.add_trace(go.Indicator(
                mode="gauge+number", value=s.used / MIB, name=f"rank {r} {t}",
                number=dict(suffix=" MiB", valueformat=",.1f", font=dict(size=16)),
                title=dict(text=f"rank {r} · {t}<br><span style='font-size:0.7em'>"
                                f"of {s.capacity / MIB:,.0f} MiB</span>", font=dict(size=13)),
                gauge=dict(axis=dict(range=[0, cap]), bar=dict(color=color)),
                domain=dict(row=i, column=j)))
    fig.update_layout(grid=dict(rows=nr, columns=nc, pattern="independent"),
                      height=max(200, 190 * nr), margin=dict(l=30, r=30, t=60, b=10),
                      title="MemoryGauges" + ("" if ranks else " · waiting for MemorySamples"))
    return fig


class MemoryGauges(LiveView):
    """Per rank x tier gauges of used vs capacity bytes."""

    def _init_state(self) -> None:
        self.memory = MemoryState()

    def _fold(self, events) -> bool:
        return reduce_all(events, memory=self.memory) > 0

    def build_figure(self) -> go.Figure:
        return gauges_figure(self.memory)

    def values(self):
        """``{(rank, tier): (used bytes, capacity bytes)}`` as currently drawn."""
        return {k: (s.used, s.capacity) for k, s in sorted(self.memory.samples.items())}

    def summary(self) -> str:
        if not self.memory.samples:
            return "MemoryGauges: no MemorySamples yet"
        parts = [f"rank {r} {t}: {u / MIB:,.0f}/{c / MIB:,.0f} MiB"
                 for (r, t), (u, c) in self.values().items()]
        return "MemoryGauges: " + "; ".join(parts)
