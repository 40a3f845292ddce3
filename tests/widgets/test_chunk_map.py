"""ChunkMap's strip: a cell per chunk, hue = tier, shade = Gemini's state, marks on the chunks
that changed tier at the newest step, hover with parameters / bytes / tier / state / last move,
wrapped rows per rank, a trace count that does not grow with the chunks, and a cache that
gives the same picture as a fresh build while redoing only the chunks that changed; the bars of
bytes per tier beside it; out-of-order and duplicate events give the same picture."""

import pytest

pytest.importorskip("plotly")

import json
import random
import re

import plotly.graph_objects as go
from support.widgets import MIB, chunk_hover, chunk_points, trace_by_name

from colossal_lab.engine import telemetry as T
from colossal_lab.widgets import ChunkMap, chunk_map_dict
from colossal_lab.widgets import chunk_map as CM
from colossal_lab.widgets.state import TIER_COLORS, ChunkState, MemoryState


def _heat(d):
    (h,) = [t for t in d["data"] if t["type"] == "heatmap"]
    return h


def _cells(d):
    """{(rank, chunk): (row, col, colour, hover)} read from the dict's heatmap, the colour
    looked up in the heatmap's own colour scale."""
    h = _heat(d)
    scale = h["colorscale"]
    out = {}
    for r, row in enumerate(h["z"]):
        for c, k in enumerate(row):
            if k is None:
                assert h["customdata"][r][c] is None and h["text"][r][c] is None
                continue
            frac = (k - h["zmin"]) / (h["zmax"] - h["zmin"])
            (colour,) = {a[1] for a, b in zip(scale, scale[1:]) if a[0] <= frac <= b[0]}
            rank, chunk = h["customdata"][r][c]
            out[(rank, chunk)] = (r, c, colour, h["text"][r][c])
    return out


def _marks(d):
    """{(rank, chunk): mark name}: each glyph of each mark shape, by the cell its centre is in."""
    h = _heat(d)
    out = {}
    for s in d["layout"].get("shapes", []):
        for glyph in s["path"].split("Z")[:-1]:
            pts = [(float(x), float(y)) for x, y in re.findall(r"(-?[\d.]+),(-?[\d.]+)", glyph)]
            col = round(sum(p[0] for p in pts) / len(pts))
            row = round(sum(p[1] for p in pts) / len(pts))
            key = tuple(h["customdata"][row][col])
            assert key not in out
            out[key] = s["name"]
    return out


def _state(events, **kw):
    st = ChunkState(**kw)
    for e in events:
        st.apply(e)
    return st


def test_each_gemini_state_gets_its_shade_of_the_tier_colour():
    states = ["compute", "ready_for_reduce", "hold", "hold_after_bwd", "free", "bogus"]
    ev = [T.ChunkEvent(0, 0, i, tier, s, MIB, (f"p{i}",))
          for i, (tier, s) in enumerate((t, s) for t in T.TIERS for s in states)]
    d = chunk_map_dict(_state(ev), MemoryState())
    cells = _cells(d)
    want = {"compute": "computing", "ready_for_reduce": "in flight", "hold": "held",
            "hold_after_bwd": "held", "free": "freed", "bogus": "other"}
    for e in ev:
        fill = want[e.state]
        assert cells[(0, e.chunk_id)][2] == CM.fill_colour(e.tier, fill), (e.tier, e.state)
        assert f"{fill} ({e.state})" in cells[(0, e.chunk_id)][3]
    # computing is the tier's own colour; the shades of one tier all differ, and no two
    # (tier, shade) pairs share a colour
    assert {CM.fill_colour(t, "computing") for t in T.TIERS} == {TIER_COLORS[t] for t in T.TIERS}
    colours = [CM.fill_colour(t, f) for t in T.TIERS for f in CM.FILLS]
    assert len(set(colours)) == len(colours)
    # the legend: a swatch per tier and per shade in use, in their own groups
    names = {t["name"]: t.get("legendgroup") for t in d["data"] if t["type"] == "scatter"}
    assert {n for n, g in names.items() if g == "tier"} == set(T.TIERS)
    assert {n for n, g in names.items() if g == "state"} == {CM.FILL_LABELS[f] for f in CM.FILLS}
    # only shades in use get a swatch
    d2 = chunk_map_dict(_state([T.ChunkEvent(0, 0, 0, "cpu", "hold", 1, ())]), MemoryState())
    assert [t["name"] for t in d2["data"] if t.get("legendgroup") in ("tier", "state")] == \
        ["cpu", CM.FILL_LABELS["held"]]


def test_marks_are_on_exactly_the_chunks_that_moved_at_the_newest_step():
    ev = [T.ChunkEvent(r, 0, c, "cpu", "hold", MIB, ()) for r in (0, 1) for c in range(6)]
    # step 1: chunks 0 and 1 of rank 0 move; step 2: every chunk re-sent, three moves
    ev += [T.ChunkEvent(0, 1, 0, "nvme", "free", MIB, ()), T.ChunkEvent(0, 1, 1, "cuda", "compute", MIB, ())]
    step2 = {(0, 0): "nvme", (0, 1): "cuda", (0, 2): "cuda", (1, 4): "nvme", (1, 5): "cpu"}
    ev += [T.ChunkEvent(r, 2, c, step2.get((r, c), "cpu"), "hold", MIB, ()) for r in (0, 1) for c in range(6)]
    # (1, 5) went cpu -> nvme -> cpu within step 2, folded by the relay into one event (moves=2)
    ev += [T.ChunkEvent(1, 2, 5, "cpu", "hold", MIB, (), moves=2)]
    st = _state(ev)
    d = chunk_map_dict(st, MemoryState())
    marks = _marks(d)
    assert marks == {(0, 2): CM.MARKS["up"][0], (1, 4): CM.MARKS["down"][0],
                     (1, 5): CM.MARKS["other"][0]}
    assert "step 2 · 3 moved" in d["layout"]["title"]["text"]
    assert "cpu→cuda 1" in d["layout"]["title"]["text"] and "cpu→nvme 1" in d["layout"]["title"]["text"]
    # the earlier move is still in the cell's hover, not marked
    assert "last move: step 1, cpu→nvme" in _cells(d)[(0, 0)][3]
    # a newer step with no move: no marks at all
    st.apply(T.ChunkEvent(0, 3, 3, "cpu", "hold", MIB, ()))
    d3 = chunk_map_dict(st, MemoryState())
    assert _marks(d3) == {} and "shapes" not in d3["layout"]
    assert "no chunk moved" in d3["layout"]["title"]["text"]
    go.Figure(d)  # plotly accepts the shapes and their legend entries


def test_hover_names_params_bytes_tier_state_and_last_move():
    many = tuple(f"model.h.3.mlp.w{i}" for i in range(10))
    ev = [T.ChunkEvent(0, 0, 0, "cpu", "hold", 3 * MIB // 2, many),
          T.ChunkEvent(0, 0, 1, "cpu", "hold", 512, ("wte.weight",)),
          T.ChunkEvent(0, 3, 0, "nvme", "free", 3 * MIB // 2, many)]
    cells = _cells(chunk_map_dict(_state(ev), MemoryState()))
    h0, h1 = cells[(0, 0)][3], cells[(0, 1)][3]
    assert "rank 0 · chunk 0 · nvme · freed (free) · 1.50 MiB" in h0
    # ten names: the count, the common prefix once, the first few, how many are left out
    assert "params (10) model.h.3.mlp.{w0, w1, w2, … +7}" in h0 and "w9" not in h0
    assert "last move: step 3, cpu→nvme" in h0
    assert "512 B" in h1 and "params (1) wte.weight" in h1 and "last move: none seen" in h1
    assert CM.human_bytes(5 << 30) == "5.00 GiB" and CM.human_bytes(300 * 1024) == "300 KiB"
    long = ("x" * 80,)
    assert CM.abbreviate_params(long) == "(1) …" + "x" * 47


def test_eight_ranks_of_two_thousand_chunks_make_a_bounded_figure():
    rng = random.Random(0)
    ev = [T.ChunkEvent(r, 0, c, rng.choice(T.TIERS), rng.choice(["hold", "free", "compute"]), MIB, (f"p{c}",))
          for r in range(8) for c in range(2000)]
    moved = rng.sample([(r, c) for r in range(8) for c in range(2000)], 800)
    ev += [T.ChunkEvent(r, 1, c, "nvme" if ev[r * 2000 + c].tier != "nvme" else "cpu", "hold", MIB, (f"p{c}",))
           for r, c in moved]
    big = chunk_map_dict(_state(ev), MemoryState())
    small = chunk_map_dict(_state(ev[:3] + [T.ChunkEvent(0, 1, 0, "nvme", "hold", 1, ())]), MemoryState())
    # the traces do not grow with the chunks: one heatmap, swatches, three bars
    assert len(big["data"]) <= len(small["data"]) + 4 <= 20
    assert len(big["layout"]["shapes"]) <= len(CM.MARKS)
    cells = _cells(big)
    assert len(cells) == 16000 and len(_marks(big)) == 800 and set(_marks(big)) == set(moved)
    json.dumps(big)  # plain JSON


def test_long_strips_wrap_into_rows_per_rank():
    ev = [T.ChunkEvent(r, 0, c, "cpu", "hold", 1, ()) for r in (0, 2) for c in range(250)]
    d = chunk_map_dict(_state(ev), MemoryState(), max_cols=100)
    h = _heat(d)
    assert len(h["z"]) == 3 + 1 + 3 and all(len(row) == 100 for row in h["z"])
    assert h["z"][3] == [None] * 100  # the blank row between the ranks
    cells = _cells(d)
    for c in range(250):
        assert cells[(0, c)][:2] == (c // 100, c % 100)
        assert cells[(2, c)][:2] == (4 + c // 100, c % 100)
    assert h["z"][2][50:] == [None] * 50  # the last row of a rank is partly empty
    ax = d["layout"]["yaxis"]
    assert ax["ticktext"] == ["rank 0", "rank 2"] and ax["tickvals"] == [1, 5]
    assert ax["range"] == [6.5, -0.5]  # first rank on top
    # a narrow strip: one row per rank and no wider than the longest rank
    d2 = chunk_map_dict(_state(ev[:5]), MemoryState())
    assert _heat(d2)["z"] == [[CM.CODES[("cpu", "held")]] * 5]
    with pytest.raises(ValueError, match="max_cols"):
        chunk_map_dict(_state(ev), MemoryState(), max_cols=0)
    with pytest.raises(ValueError, match="max_cols"):
        ChunkMap(subscribe=False, max_cols=-1)
    assert len(_heat(ChunkMap.from_events(ev, max_cols=50).figure_dict())["z"]) == 5 + 1 + 5


def test_cached_redraws_equal_fresh_builds_and_leave_earlier_pictures_alone():
    """Random steps, moves, re-sent events, stale and duplicate events, new chunks, and few
    kept moves (so the last-move index sees moves dropped, some bursts dropping every move it
    had seen): every cached picture equals a fresh build, and pictures already handed out
    never change."""
    rng = random.Random(7)
    st, mem, cache = ChunkState(max_moves=9), MemoryState(), CM.StripCache()
    held = []
    for step in range(40):
        n = 4 + step // 10  # chunks appear over time
        for _ in range(rng.randrange(1, 12)):
            e = T.ChunkEvent(rng.randrange(3), max(0, step - rng.randrange(3)), rng.randrange(n),
                             rng.choice(T.TIERS), rng.choice(["hold", "free", "compute", "ready_for_reduce"]),
                             rng.choice([MIB, 2 * MIB]), (f"a.b{rng.randrange(2)}", "a.c"),
                             moves=rng.choice([0, 0, 0, 1, 2]))
            st.apply(e)
            if rng.random() < 0.2:
                st.apply(e)
        if step % 7 == 3:  # more moves between two redraws than the state keeps
            for k in range(15):
                st.apply(T.ChunkEvent(1, step, k % n, T.TIERS[k % 3], "hold", MIB, ()))
        got = chunk_map_dict(st, mem, cache=cache)
        assert got == chunk_map_dict(st, mem)
        held.append((got, json.dumps(got)))
        if step % 13 == 0:
            got2 = chunk_map_dict(st, mem, max_cols=3, cache=cache)  # a width change
            assert got2 == chunk_map_dict(st, mem, max_cols=3)
    assert all(json.dumps(d) == s for d, s in held)
    # the same cache handed another state (as many chunks, other ranks) starts over
    assert len(st.chunks) == 21
    chunk_map_dict(st, mem, cache=cache)  # laid out at the default width again
    other = _state([T.ChunkEvent(r, 0, c, "cpu", "hold", 1, ()) for r in (5, 6, 7) for c in range(7)]
                   + [T.ChunkEvent(6, 1, 1, "cuda", "hold", 1, ())])
    assert chunk_map_dict(other, mem, cache=cache) == chunk_map_dict(other, mem)


def test_a_redraw_rebuilds_only_the_texts_of_chunks_that_changed(monkeypatch):
    calls = []
    real = CM.hover_text
    monkeypatch.setattr(CM, "hover_text", lambda *a: calls.append(a[0].chunk_id) or real(*a))
    cm = ChunkMap(subscribe=False)
    cm.update([T.ChunkEvent(0, 0, c, "cpu", "hold", MIB, (f"p{c}",)) for c in range(100)])
    assert len(calls) == 100
    calls.clear()
    # the next step re-sends every chunk (as Gemini does); 3 moved, 2 changed state
    change = {5: ("nvme", "hold"), 6: ("cuda", "hold"), 7: ("nvme", "free"), 8: ("cpu", "compute"),
              9: ("cpu", "free")}
    cm.update([T.ChunkEvent(0, 1, c, *change.get(c, ("cpu", "hold")), MIB, (f"p{c}",)) for c in range(100)])
    assert sorted(calls) == sorted(change)
    assert cm.figure_dict() == chunk_map_dict(cm.chunks, cm.memory)
    assert set(_marks(cm.figure_dict())) == {(0, 5), (0, 6), (0, 7)}
    assert "3 moved at that step" in cm.summary()
    cm.close()


# ---------------------------------------------------------------- the figure from event streams
def _chunk_marks(fig):
    """{(rank, chunk_id): name of the move mark drawn on its cell} from the mark shapes (each
    glyph a closed polygon, centred on its cell)."""
    import re

    (h,) = [t for t in fig.data if t.type == "heatmap"]
    out = {}
    for s in fig.layout.shapes:
        for glyph in s.path.split("Z")[:-1]:
            pts = [tuple(map(float, p)) for p in re.findall(r"(-?[\d.]+),(-?[\d.]+)", glyph)]
            col = round(sum(x for x, _ in pts) / len(pts))
            row = round(sum(y for _, y in pts) / len(pts))
            rank, chunk = h.customdata[row][col]
            assert (rank, chunk) not in out, "two marks on one chunk"
            out[(rank, chunk)] = s.name
    return out


def test_chunk_map_colours_by_tier_and_marks_moves():
    ev = [T.ChunkEvent(r, 0, c, "cpu", "hold", MIB, (f"layer{c}.w",)) for r in (0, 1) for c in range(4)]
    ev += [T.ChunkEvent(0, 1, 2, "nvme", "free", MIB, ("layer2.w",)),
           T.ChunkEvent(1, 1, 3, "cuda", "compute", 2 * MIB, ("layer3.w",))]
    ev += [T.MemorySample(0, 1.0, "cpu", 5 * MIB, 64 * MIB), T.MemorySample(1, 1.0, "cpu", 7 * MIB, 64 * MIB)]
    cm = ChunkMap.from_events(ev)
    from colossal_lab.widgets.chunk_map import fill_colour

    pts = chunk_points(cm.figure)
    assert len(pts) == 8
    assert pts[(0, 2)] == ("nvme", fill_colour("nvme", "freed"), "freed")
    assert pts[(1, 3)] == ("cuda", TIER_COLORS["cuda"], "computing")  # computing: the tier's own colour
    assert pts[(0, 0)] == ("cpu", fill_colour("cpu", "held"), "held")
    # moved at the newest step -> a mark on the cell, by direction; unmoved -> none
    marks = _chunk_marks(cm.figure)
    assert marks.keys() == {(0, 2), (1, 3)}
    assert "slower" in marks[(0, 2)] and "faster" in marks[(1, 3)]
    hover = chunk_hover(cm.figure, (0, 2))
    assert "layer2.w" in hover and "1.00 MiB" in hover and "cpu→nvme" in hover
    chunks = trace_by_name(cm.figure, "chunks")
    assert dict(zip(chunks.x, chunks.y)) == {"cuda": 2.0, "cpu": 6.0, "nvme": 1.0}
    cap = trace_by_name(cm.figure, "capacity")
    assert dict(zip(cap.x, cap.y))["cpu"] == 128.0
    moves = [(m.rank, m.chunk_id, m.src, m.dst) for m in cm.chunks.moves]
    assert moves == [(0, 2, "cpu", "nvme"), (1, 3, "cpu", "cuda")]
    cm.close()


def test_chunk_map_out_of_order_and_duplicates_give_the_same_picture():
    ev = []
    for step in range(5):
        for c in range(6):
            tier = ["cpu", "nvme", "cuda"][(c + step) % 3]
            ev.append(T.ChunkEvent(c % 2, step, c, tier, "hold", (c + 1) * 1000, (f"p{c}",)))
    in_order = ChunkMap.from_events(ev)
    shuffled = ev + ev[::3]  # duplicates
    random.Random(0).shuffle(shuffled)
    scrambled = ChunkMap.from_events(shuffled)
    assert chunk_points(in_order.figure).keys() == chunk_points(scrambled.figure).keys()
    a = {k: v[:3] for k, v in chunk_points(in_order.figure).items()}
    b = {k: v[:3] for k, v in chunk_points(scrambled.figure).items()}
    assert a == b
    # the newest step wins whatever the arrival order
    assert a[(0, 0)][0] == ["cpu", "nvme", "cuda"][(0 + 4) % 3]
    # stale event after the newest one changes nothing
    before = scrambled.chunks.chunks[(0, 0)]
    scrambled.update([T.ChunkEvent(0, 1, 0, "nvme", "free", 1, ())])
    assert scrambled.chunks.chunks[(0, 0)] == before
