"""ChunkMap: where every chunk of the model lives (cuda / cpu / nvme), what it is doing, and
what moved at the newest step, per rank, live.

Left: per rank a strip of cells, one per chunk in chunk-id order, wrapped into rows of at most
``max_cols`` cells, so thousands of chunks make a compact block per rank instead of a line
running off the screen (ranks are separated by a blank row). A cell's hue is the chunk's tier
(``state.TIER_COLORS``) and its shade what the chunk is doing (``FILLS``: computing = the full
colour, in flight = dark, held = light, freed = nearly blank), read from the tensor state
Gemini emits (``STATE_FILL``). Chunks that changed tier at the newest step carry a mark
(``MARKS``): a white ▲ moved to a faster tier (brought back for compute), a black ▼ moved to
a slower tier (evicted), a yellow ◆ moved and came back within the step or came from a tier
this view never saw. The legend names the tiers, shades and marks in use; the title counts
the step's moved chunks by src→dst (each chunk by its last move). Hovering a cell gives the
chunk's parameters (their common prefix once, the first few when many), bytes, tier, state
and last move (step, src→dst).
Right: a bar per tier with the bytes of chunks there against the tier's capacity and sampled
use (``MemorySample``), on a log axis (a disk's capacity dwarfs what a model puts on it).

Why a heatmap and shapes, not a marker per chunk: a redraw has to stay cheap at many ranks ×
thousands of chunks, in the kernel (the redraw thread shares the GIL with training) and in
the browser (``Plotly.react``), where every SVG marker is a node styled on each redraw. All
chunk cells of all ranks are one ``heatmap`` trace (one image) whose value is a code into a
discrete colour scale (tier × shade), and the marks of one direction are one path shape (one
SVG node, whatever the number of moves). The trace list has a fixed shape apart from the
legend swatches of the tiers and shades in use.

The kernel side keeps a ``StripCache`` between redraws: the cell layout (rebuilt only when
chunks appear or the width changes); each cell's code and hover text, rebuilt only for
chunks whose event draws differently (tier, state, bytes, parameters: Gemini re-sends every
chunk each step) or whose last move changed, with rows copied on write so pictures already
sent stay intact; each chunk's abbreviated parameter list; the bytes per tier; and each
chunk's last move, advanced by the moves appended since the previous redraw. The figure is
written as a plain dict (``chunk_map_dict``), never through plotly's validated objects; with
or without a cache the dict is the same.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import plotly.graph_objects as go

from colossal_lab.engine.telemetry import TIERS, ChunkEvent, MemorySample, format_bytes

from ._live import LiveView, columns_layout, template_json
from .state import TIER_COLORS, ChunkState, MemoryState, Move, reduce_all

MIB = float(1 << 20)
MAX_COLS = 100  # cells per row of a rank's strip before it wraps
Key = Tuple[int, int]

# Gemini's per-chunk state (``Chunk.state_summary``: the busiest ``TensorState`` inside it)
# -> the shade a cell is drawn with
STATE_FILL = {"compute": "computing", "ready_for_reduce": "in flight", "hold": "held",
              "hold_after_bwd": "held", "free": "freed"}
FILLS = ("computing", "in flight", "held", "freed", "other")
FILL_LABELS = {"computing": "computing (compute)",
               "in flight": "in flight (grad awaiting reduce)",
               "held": "held (hold, hold_after_bwd)",
               "freed": "freed (free: not gathered)",
               "other": "other state"}
# a shade: the tier's colour mixed with (colour, its weight)
_FILL_MIX = {"computing": ("#ffffff", 0.0), "in flight": ("#000000", 0.45),
             "held": ("#ffffff", 0.5), "freed": ("#ffffff", 0.8), "other": ("#808080", 0.7)}
_SWATCH_BASE = "#6f6f6f"  # the shade swatches in the legend, on a neutral colour

# direction of a move -> (legend name, glyph outline in cell units around the cell's centre,
# fill, outline colour). A glyph is a polygon drawn in data units, so it scales with the cell
MARKS = {"up": ("▲ moved to a faster tier", ((-0.36, 0.3), (0.0, -0.34), (0.36, 0.3)),
                "#ffffff", "#000000"),
         "down": ("▼ moved to a slower tier (evicted)", ((-0.36, -0.3), (0.0, 0.34), (0.36, -0.3)),
                  "#000000", "#ffffff"),
         "other": ("◆ moved and back / from an unseen tier",
                   ((0.0, -0.36), (0.36, 0.0), (0.0, 0.36), (-0.36, 0.0)), "#ffd400", "#000000")}
_SPEED = {t: i for i, t in enumerate(TIERS)}  # lower = faster (the compute tier first)
MAX_PARAMS_SHOWN = 3
MAX_NAME_CHARS = 48


def _mix(colour: str, other: str, w: float) -> str:
    a = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    b = [int(other[i:i + 2], 16) for i in (1, 3, 5)]
    return "#%02x%02x%02x" % tuple(round(x * (1 - w) + y * w) for x, y in zip(a, b))


def fill_colour(tier: str, fill: str) -> str:
    """The colour of a cell of ``tier`` drawn with shade ``fill`` (one of ``FILLS``)."""
    other, w = _FILL_MIX[fill]
    return _mix(TIER_COLORS[tier], other, w)


# a cell's code: tier-major, shade-minor; the heatmap maps code k to its colour through a
# discrete scale of len(CODES) equal bands, code k in the middle of band k
CODES: Dict[Tuple[str, str], int] = {(t, f): i * len(FILLS) + j
                                     for i, t in enumerate(TIERS) for j, f in enumerate(FILLS)}
_N_CODES = len(CODES)
COLORSCALE: List[list] = [pair for (t, f), k in sorted(CODES.items(), key=lambda kv: kv[1])
                          for pair in ([k / _N_CODES, fill_colour(t, f)],
                                       [(k + 1) / _N_CODES, fill_colour(t, f)])]
_CODE_TIER_FILL = {k: tf for tf, k in CODES.items()}


def cell_code(e: ChunkEvent) -> int:
    return CODES[(e.tier, STATE_FILL.get(e.state, "other"))]


human_bytes = format_bytes  # a chunk's size in its hover label


def abbreviate_params(names: Sequence[str], limit: int = MAX_PARAMS_SHOWN) -> str:
    """``"(n) prefix.{a, b, c, … +k}"``: how many parameters, their common dotted prefix
    written once, the first ``limit`` of them (each cut to its tail past ``MAX_NAME_CHARS``)
    and how many are left out; a chunk can pack hundreds of parameters."""
    if not names:
        return "(0) —"
    prefix = ""
    if len(names) > 1:
        prefix = os.path.commonprefix(list(names))
        prefix = prefix[:prefix.rfind(".") + 1]  # whole dotted components only
    cut = len(prefix)
    shown = [s[cut:] for s in names[:limit]]
    shown = [s if len(s) <= MAX_NAME_CHARS else "…" + s[-(MAX_NAME_CHARS - 1):] for s in shown]
    more = len(names) - len(shown)
    body = ", ".join(shown) + (f", … +{more}" if more else "")
    return f"({len(names)}) " + (f"{prefix}{{{body}}}" if prefix else body)


def move_text(m: Move) -> str:
    return f"step {m.step}, {m.src or '?'}→{m.dst}" + (f" (×{m.count})" if m.count > 1 else "")


def move_direction(m: Move) -> str:
    """``"up"`` (to a faster tier), ``"down"`` (to a slower one) or ``"other"`` (folded moves
    that ended where they began, or a source this view never saw)."""
    if m.src in _SPEED and m.src != m.dst:
        return "up" if _SPEED[m.dst] < _SPEED[m.src] else "down"
    return "other"


def hover_text(e: ChunkEvent, last_move: Optional[Move], params: Optional[str] = None) -> str:
    """A cell's hover: which chunk, tier, shade (and the state it comes from), bytes, the
    parameters packed in it (``params``: ``abbreviate_params(e.params)`` if already made)
    and its last move."""
    return (f"rank {e.rank} · chunk {e.chunk_id} · {e.tier} · "
            f"{STATE_FILL.get(e.state, 'other')} ({e.state}) · {human_bytes(e.nbytes)}"
            f"<br>params {abbreviate_params(e.params) if params is None else params}"
            f"<br>last move: {move_text(last_move) if last_move is not None else 'none seen'}")


class _MoveIndex:
    """Each chunk's last move among ``ChunkState.moves``, kept current in O(moves appended +
    moves dropped since the previous call) instead of a scan of every move kept.

    ChunkState appends a chunk's moves in step order (an event older than the one held is
    stale and records nothing), so a chunk's newest kept move is its last move. New moves are
    found by walking the deque from the right to the newest move seen before (by identity);
    the deque only appends on the right and drops on the left, so the moves dropped are the
    oldest ones this index mirrors (all of them when the newest one seen is gone too: the
    walk then takes every move kept as new)."""

    def __init__(self) -> None:
        self.last: Dict[Key, Move] = {}
        self._src: Optional[Deque[Move]] = None
        self._mirror: Deque[Move] = deque()

    def update(self, moves: Deque[Move]) -> None:
        if moves is not self._src:  # another ChunkState
            self._src, self._mirror, self.last = moves, deque(), {}
        mirror, last = self._mirror, self.last
        tail = mirror[-1] if mirror else None
        new: List[Move] = []
        for m in reversed(moves):
            if m is tail:
                break
            new.append(m)
        for _ in range(len(mirror) + len(new) - len(moves)):  # dropped on the left
            old = mirror.popleft()
            key = (old.rank, old.chunk_id)
            if last.get(key) is old:
                del last[key]
        for m in reversed(new):
            mirror.append(m)
            last[(m.rank, m.chunk_id)] = m


class StripCache:
    """What one ``ChunkMap`` keeps between redraws (see the module docstring): the layout of
    cells, their codes and hover texts, and the last-move index. Pass the same object to every
    ``chunk_map_dict`` call of one ``ChunkState``."""

    def __init__(self) -> None:
        self.moves = _MoveIndex()
        self._state: Optional[ChunkState] = None
        self._n = -1
        self.max_cols = 0
        self.ncols = 1
        self.nrows = 0
        self.ranks: List[int] = []
        self.tickvals: List[float] = []
        self.pos: Dict[Key, Tuple[int, int]] = {}
        # chunk -> (the event its cell is drawn from, its last move then, its params text)
        self.seen: Dict[Key, Tuple[ChunkEvent, Optional[Move], str]] = {}
        self.tier_bytes: Dict[str, int] = dict.fromkeys(TIERS, 0)
        self.z: List[list] = []
        self.text: List[list] = []
        self.cd: List[list] = []
        self.code_counts = [0] * _N_CODES

    def _lay_out(self, chunks: ChunkState, max_cols: int) -> None:
        by_rank: Dict[int, List[int]] = {}
        for r, c in chunks.chunks:
            lst = by_rank.get(r)
            if lst is None:
                lst = by_rank[r] = []
            lst.append(c)
        self.ranks = sorted(by_rank)
        ncols = max(1, min(max_cols, max((len(v) for v in by_rank.values()), default=1)))
        pos: Dict[Key, Tuple[int, int]] = {}
        cd: List[list] = []
        self.tickvals, row0 = [], 0
        for r in self.ranks:
            ids = sorted(by_rank[r])
            nrow = -(-len(ids) // ncols)
            if row0:
                cd.append([None] * ncols)  # a blank row between ranks
                row0 += 1
            rows = [[None] * ncols for _ in range(nrow)]
            for i, c in enumerate(ids):
                pos[(r, c)] = (row0 + i // ncols, i % ncols)
                rows[i // ncols][i % ncols] = [r, c]
            cd.extend(rows)
            self.tickvals.append(row0 + (nrow - 1) / 2)
            row0 += nrow
        self._state, self._n, self.max_cols = chunks, len(chunks.chunks), max_cols
        self.ncols, self.nrows, self.pos, self.cd = ncols, row0, pos, cd
        self.z = [[None] * ncols for _ in range(row0)]
        self.text = [[None] * ncols for _ in range(row0)]
        self.seen = {}
        self.tier_bytes = dict.fromkeys(TIERS, 0)
        self.code_counts = [0] * _N_CODES

    def refresh(self, chunks: ChunkState, max_cols: int) -> None:
        """Bring the cells up to ``chunks``: a new layout when chunks appeared (ChunkState only
        ever adds keys, so a changed count means a changed set) or the width changed; then new
        codes and texts for the chunks whose event draws differently or whose last move changed."""
        self.moves.update(chunks.moves)
        fresh = (chunks is not self._state or len(chunks.chunks) != self._n
                 or max_cols != self.max_cols)
        if fresh:
            self._lay_out(chunks, max_cols)
        z, text, seen, pos, last = self.z, self.text, self.seen, self.pos, self.moves.last
        counts, tier_bytes = self.code_counts, self.tier_bytes
        # rows already handed out in a picture are copied before a cell in them changes
        dirty = set(range(self.nrows)) if fresh else set()
        for key, e in chunks.chunks.items():
            m = last.get(key)
            s = seen.get(key)
            params = None
            if s is not None:
                o = s[0]
                # Gemini re-sends every chunk each step: an event drawn the same (tier, state,
                # bytes, parameters) as the one drawn keeps its cell and text
                same = o is e or (o.tier == e.tier and o.state == e.state
                                  and o.nbytes == e.nbytes and o.params == e.params)
                if same and s[1] is m:
                    continue
                if o.params is e.params or o.params == e.params:
                    params = s[2]
                tier_bytes[o.tier] -= o.nbytes
            if params is None:
                params = abbreviate_params(e.params)
            seen[key] = (e, m, params)
            tier_bytes[e.tier] += e.nbytes
            r, c = pos[key]
            if r not in dirty:
                z[r] = list(z[r])
                text[r] = list(text[r])
                dirty.add(r)
            old = z[r][c]
            if old is not None:
                counts[old] -= 1
            code = cell_code(e)
            counts[code] += 1
            z[r][c] = code
            text[r][c] = hover_text(e, m, params)

    def in_use(self) -> Tuple[List[str], List[str]]:
        """(tiers, shades) that some cell is drawn with, in ``TIERS`` / ``FILLS`` order."""
        used = [_CODE_TIER_FILL[k] for k, n in enumerate(self.code_counts) if n]
        return ([t for t in TIERS if any(u[0] == t for u in used)],
                [f for f in FILLS if any(u[1] == f for u in used)])


def _swatch(name: str, group: str, title: str, symbol: str, colour: str, line: str) -> dict:
    """A legend entry with nothing to draw (the heatmap has no legend of its own)."""
    return {"type": "scatter", "name": name, "x": [None], "y": [None], "mode": "markers",
            "legendgroup": group, "legendgrouptitle": {"text": title}, "hoverinfo": "skip",
            "xaxis": "x", "yaxis": "y",
            "marker": {"symbol": symbol, "size": 12, "color": colour,
                       "line": {"color": line, "width": 1}}}


def chunk_map_dict(chunks: ChunkState, memory: MemoryState, max_cols: int = MAX_COLS,
                   cache: Optional[StripCache] = None) -> dict:
    """The ChunkMap picture of ``chunks`` and ``memory`` as a plain plotly JSON dict (pure:
    state in, dict out; no ``graph_objects``, see ``_live.py``).

    ``cache`` (a ``StripCache`` the caller keeps between redraws of one ``ChunkState``) makes
    a redraw redo only the cells whose chunk changed; without one everything is built anew,
    giving the same dict."""
    if not (isinstance(max_cols, int) and max_cols > 0):
        raise ValueError(f"chunk_map_dict(max_cols={max_cols!r}): must be a positive int")
    if cache is None:
        cache = StripCache()
    cache.refresh(chunks, max_cols)
    ncols, nrows = cache.ncols, cache.nrows
    row_px = max(6, min(24, 1000 // max(nrows, 1)))

    last = chunks.last_step()
    moved = sorted(chunks.moved_at(last)) if last is not None else []
    marks: Dict[str, List[str]] = {d: [] for d in MARKS}
    by_pair: Counter = Counter()
    for key in moved:
        m = cache.moves.last.get(key)
        if m is None:
            continue
        r, c = cache.pos[key]
        d = move_direction(m)
        marks[d].append("M" + "L".join(f"{c + dx:.2f},{r + dy:.2f}" for dx, dy in MARKS[d][1]) + "Z")
        by_pair[f"{m.src or '?'}→{m.dst}"] += 1

    data: List[dict] = [{
        "type": "heatmap", "name": "chunk cells", "z": list(cache.z), "text": list(cache.text),
        "customdata": cache.cd, "hovertemplate": "%{text}<extra></extra>", "hoverongaps": False,
        "colorscale": COLORSCALE, "zmin": -0.5, "zmax": _N_CODES - 0.5, "showscale": False,
        "xgap": 1 if row_px >= 8 else 0, "ygap": 1 if row_px >= 8 else 0,
        "xaxis": "x", "yaxis": "y"}]
    tiers_used, fills_used = cache.in_use()
    for t in tiers_used:
        data.append(_swatch(t, "tier", "tier (hue)", "square", TIER_COLORS[t], TIER_COLORS[t]))
    for f in fills_used:
        other, w = _FILL_MIX[f]
        data.append(_swatch(FILL_LABELS[f], "state", "state (shade)", "square",
                            _mix(_SWATCH_BASE, other, w), _SWATCH_BASE))

    chunk_bytes = cache.tier_bytes
    cap, used = memory.capacity_by_tier(), memory.used_by_tier()
    tiers = list(TIERS)
    bar = {"type": "bar", "x": tiers, "xaxis": "x2", "yaxis": "y2", "legendgroup": "bytes",
           "legendgrouptitle": {"text": "MiB per tier"}}
    data.append(dict(bar, name="capacity", y=[cap.get(t, 0) / MIB for t in tiers],
                     marker={"color": "#e6e6e6"}, width=0.8, showlegend=True))
    data.append(dict(bar, name="used (sampled)", y=[used.get(t, 0) / MIB for t in tiers],
                     marker={"color": "#9a9a9a"}, width=0.6))
    data.append(dict(bar, name="chunks", y=[chunk_bytes[t] / MIB for t in tiers],
                     marker={"color": [TIER_COLORS[t] for t in tiers]}, width=0.35))

    if last is None:
        title = f"ChunkMap · {len(chunks.chunks)} chunks · waiting for ChunkEvents"
    else:
        pairs = ", ".join(f"{k} {n}" for k, n in by_pair.most_common(4))
        if len(by_pair) > 4:
            pairs += f" (+{len(by_pair) - 4} more)"
        title = (f"ChunkMap · {len(chunks.chunks)} chunks on {len(cache.ranks)} rank(s) · "
                 f"step {last} · " + (f"{len(moved)} moved: {pairs}" if moved
                                      else "no chunk moved this step"))
    layout = columns_layout([0.78, 0.22], 0.07,
                            ("chunks per rank, in id order (hue = tier, shade = state)",
                             "MiB per tier"))
    layout["xaxis"].update(visible=False, range=[-0.5, ncols - 0.5])
    layout["yaxis"].update(tickvals=cache.tickvals, ticktext=[f"rank {r}" for r in cache.ranks],
                           zeroline=False, showgrid=False, range=[max(nrows, 1) - 0.5, -0.5])
    # log scale: a disk's capacity is orders of magnitude above the bytes a small model puts
    # there, and on a linear axis the used and chunk bars of every tier but the biggest vanish
    layout["yaxis2"].update(type="log", title={"text": "MiB (log)"})
    # the marks: one path shape per direction holding the glyphs of all its chunks (see the
    # module docstring); the cell underneath names the move in its hover
    shapes = [
        {"type": "path", "path": "".join(marks[d]), "xref": "x", "yref": "y", "layer": "above",
         "fillcolor": fill, "line": {"color": line, "width": 1}, "name": label,
         "showlegend": True, "legendgroup": "moves",
         "legendgrouptitle": {"text": "moved at the newest step"}}
        for d, (label, _, fill, line) in MARKS.items() if marks[d]]
    if shapes:  # plotly writes no empty list (``.figure`` and this dict stay equal)
        layout["shapes"] = shapes
    layout.update(template=template_json(), title={"text": title}, barmode="overlay",
                  height=max(360, 230 + row_px * nrows),
                  margin={"l": 70, "r": 20, "t": 80, "b": 40}, hovermode="closest",
                  uirevision="chunk-map",  # a zoom into the strip survives redraws
                  plot_bgcolor="#ffffff",  # pale (freed) cells stay visible on it
                  legend={"orientation": "h", "y": -0.12, "yanchor": "top"})  # below the tier bars' labels
    return {"data": data, "layout": layout}


def chunk_map_figure(chunks: ChunkState, memory: MemoryState, max_cols: int = MAX_COLS) -> go.Figure:
    """``chunk_map_dict`` as a validated ``go.Figure`` (for static use)."""
    return go.Figure(chunk_map_dict(chunks, memory, max_cols))


class ChunkMap(LiveView):
    """Every chunk of every rank: tier, state and the newest step's moves; per-tier bytes vs
    capacity.

    ``ChunkMap()`` listens to this process's telemetry bus (with the relay attached, that is
    every rank's events); ``ChunkMap.from_trace(path)`` replays a JSONL trace. ``max_cols``:
    cells per row of a rank's strip before it wraps.
    """

    accepts = (ChunkEvent, MemorySample)

    def __init__(self, *, max_cols: int = MAX_COLS, **kw):
        if not (isinstance(max_cols, int) and max_cols > 0):
            raise ValueError(f"ChunkMap(max_cols={max_cols!r}): must be a positive int")
        self.max_cols = max_cols
        super().__init__(**kw)

    def _init_state(self) -> None:
        self.chunks = ChunkState()
        self.memory = MemoryState()
        self._cache = StripCache()

    def _fold(self, events) -> bool:
        return reduce_all(events, chunk=self.chunks, memory=self.memory) > 0

    def build_dict(self) -> dict:
        return chunk_map_dict(self.chunks, self.memory, self.max_cols, cache=self._cache)

    def summary(self) -> str:
        if not self.chunks.chunks:
            return "ChunkMap: no ChunkEvents yet"
        per = self.chunks.bytes_by_tier()
        counts = Counter(e.tier for e in self.chunks.chunks.values())
        tiers = ", ".join(f"{t}: {counts[t]} chunks / {per[t] / MIB:.1f} MiB"
                          for t in TIERS if counts[t])
        last = self.chunks.last_step()
        return (f"ChunkMap: {len(self.chunks.chunks)} chunks on ranks {self.chunks.ranks} "
                f"at step {last} ({tiers}); {len(self.chunks.moved_at(last))} moved at that "
                f"step, {len(self.chunks.moves)} moves seen")
