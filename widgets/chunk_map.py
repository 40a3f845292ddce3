"""ChunkMap: where every chunk of the model lives (cuda / cpu / nvme), per rank, live.

Left: a grid per rank, one cell per chunk, coloured by tier and shaped by state; hovering a
cell names its parameters and bytes; a chunk that changed tier at the newest step is drawn
with a thick black outline, so moves show as they happen. Right: a bar per tier with the
bytes of chunks there against the tier's capacity and sampled use (from ``MemorySample``), on a
log axis (a disk's capacity dwarfs what a model puts on it).

The trace list has a fixed shape (one scatter per tier, three bars); a redraw writes it as a
plain dict (``chunk_map_dict``), never through plotly's validated objects.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import plotly.graph_objects as go

from colossal_lab.engine.telemetry import TIERS, ChunkEvent, MemorySample

from ._live import LiveView, columns_layout, template_json
from .state import TIER_COLORS, ChunkState, MemoryState, reduce_all

STATE_SYMBOLS = {"compute": "square-x", "hold": "square", "free": "square-open"}
MIB = float(1 << 20)


def _hover(e) -> str:
    names = list(e.params)
    shown = ", ".join(names[:8]) + (f", … (+{len(names) - 8})" if len(names) > 8 else "")
    return (f"rank {e.rank} · chunk {e.chunk_id}<br>tier: {e.tier} · state: {e.state}"
            f"<br>{e.nbytes / MIB:.3f} MiB ({e.nbytes} B)<br>params: {shown or '—'}")


def chunk_map_dict(chunks: ChunkState, memory: MemoryState, max_cols: int = 16,
                   hover_cache: Optional[dict] = None) -> dict:
    """The ChunkMap picture of ``chunks`` and ``memory`` as a plain plotly JSON dict (pure:
    state in, dict out; no ``graph_objects``, see ``_live.py``).

    ``hover_cache`` (a dict the caller keeps between redraws) reuses each chunk's hover text
    while its latest event is the same object, so a redraw formats text only for chunks with
    a new event (formatting every chunk's text is a large share of a redraw)."""
    ranks = chunks.ranks
    by_rank: Dict[int, list] = {r: [] for r in ranks}
    for (rr, _), e in chunks.chunks.items():
        by_rank[rr].append(e)
    for lst in by_rank.values():
        lst.sort(key=lambda e: e.chunk_id)
    if hover_cache is None:
        hover_cache = {}
    ncols = max(1, min(max_cols, max((len(v) for v in by_rank.values()), default=1)))
    last = chunks.last_step()
    moved = chunks.moved_at(last) if last is not None else set()

    pts: Dict[str, Dict[str, List[Any]]] = {
        t: {"x": [], "y": [], "text": [], "sym": [], "lw": [], "cd": []} for t in TIERS}
    tickvals, ticktext, row0 = [], [], 0
    for r in ranks:
        tickvals.append(-row0)
        ticktext.append(f"rank {r}")
        for i, e in enumerate(by_rank[r]):
            p = pts[e.tier]
            p["x"].append(i % ncols)
            p["y"].append(-(row0 + i // ncols))
            key = (e.rank, e.chunk_id)
            hit = hover_cache.get(key)
            if hit is None or hit[0] is not e:
                hit = hover_cache[key] = (e, _hover(e))
            p["text"].append(hit[1])
            p["sym"].append(STATE_SYMBOLS.get(e.state, "diamond"))
            p["lw"].append(3 if (e.rank, e.chunk_id) in moved else 0.5)
            p["cd"].append([e.rank, e.chunk_id])
        row0 += max(1, math.ceil(len(by_rank[r]) / ncols)) + 1  # one blank row between ranks

    data: List[dict] = []
    for t in TIERS:
        p = pts[t]
        data.append({"type": "scatter", "name": t, "x": p["x"], "y": p["y"], "mode": "markers",
                     "hovertext": p["text"], "hoverinfo": "text", "customdata": p["cd"],
                     "legendgroup": t, "xaxis": "x", "yaxis": "y",
                     "marker": {"color": TIER_COLORS[t], "symbol": p["sym"], "size": 18,
                                "line": {"color": "black", "width": p["lw"]}}})

    chunk_bytes = chunks.bytes_by_tier()
    cap, used = memory.capacity_by_tier(), memory.used_by_tier()
    tiers = list(TIERS)
    bar = {"type": "bar", "x": tiers, "xaxis": "x2", "yaxis": "y2"}
    data.append(dict(bar, name="capacity", y=[cap.get(t, 0) / MIB for t in tiers],
                     marker={"color": "#e6e6e6"}, width=0.8, showlegend=True))
    data.append(dict(bar, name="used (sampled)", y=[used.get(t, 0) / MIB for t in tiers],
                     marker={"color": "#9a9a9a"}, width=0.6))
    data.append(dict(bar, name="chunks", y=[chunk_bytes[t] / MIB for t in tiers],
                     marker={"color": [TIER_COLORS[t] for t in tiers]}, width=0.35))

    n_moves_now = len(moved)
    title = (f"ChunkMap · {len(chunks.chunks)} chunks on {len(ranks)} rank(s)"
             + (f" · step {last} · {n_moves_now} move(s) this step" if last is not None else
                " · waiting for ChunkEvents"))
    layout = columns_layout([0.7, 0.3], 0.1, ("chunks per rank (colour = tier, shape = state)",
                                              "MiB per tier"))
    layout["xaxis"].update(visible=False, range=[-0.7, ncols - 0.3])
    layout["yaxis"].update(tickvals=tickvals, ticktext=ticktext, zeroline=False, showgrid=False,
                           range=[-(max(row0, 2) - 0.3), 0.7])
    # log scale: a disk's capacity is orders of magnitude above the bytes a small model puts
    # there, and on a linear axis the used and chunk bars of every tier but the biggest vanish
    layout["yaxis2"].update(type="log", title={"text": "MiB (log)"})
    layout.update(template=template_json(), title={"text": title}, barmode="overlay",
                  height=max(320, 60 + 26 * row0), margin={"l": 60, "r": 20, "t": 70, "b": 40},
                  hovermode="closest", legend={"orientation": "h", "y": -0.08})
    return {"data": data, "layout": layout}


def chunk_map_figure(chunks: ChunkState, memory: MemoryState, max_cols: int = 16) -> go.Figure:
    """``chunk_map_dict`` as a validated ``go.Figure`` (for static use)."""
    return go.Figure(chunk_map_dict(chunks, memory, max_cols))


class ChunkMap(LiveView):
    """Every chunk of every rank, coloured by tier; per-tier bytes vs capacity.

    ``ChunkMap()`` listens to this process's telemetry bus (with the relay attached, that is
    every rank's events); ``ChunkMap.from_trace(path)`` replays a JSONL trace.
    """

    accepts = (ChunkEvent, MemorySample)

    def _init_state(self) -> None:
        self.chunks = ChunkState()
        self.memory = MemoryState()
        self._hover: dict = {}  # (rank, chunk) -> (latest event, its hover text)

    def _fold(self, events) -> bool:
        return reduce_all(events, chunk=self.chunks, memory=self.memory) > 0

    def build_dict(self) -> dict:
        if len(self._hover) > 2 * len(self.chunks.chunks) + 64:
            self._hover.clear()  # chunks that are gone (a new run): start over
        return chunk_map_dict(self.chunks, self.memory, hover_cache=self._hover)

    def summary(self) -> str:
        if not self.chunks.chunks:
            return "ChunkMap: no ChunkEvents yet"
        per = self.chunks.bytes_by_tier()
        counts = {t: sum(1 for e in self.chunks.chunks.values() if e.tier == t) for t in TIERS}
        tiers = ", ".join(f"{t}: {counts[t]} chunks / {per[t] / MIB:.1f} MiB"
                          for t in TIERS if counts[t])
        return (f"ChunkMap: {len(self.chunks.chunks)} chunks on ranks {self.chunks.ranks} "
                f"at step {self.chunks.last_step()} ({tiers}); {len(self.chunks.moves)} moves seen")
