"""Widgets: event streams -> figure data, out-of-order and duplicate events, live redraw,
replay from a JSONL trace, Chrome trace export, static/text fallback."""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

import json
import os
import random
import threading
import time

import plotly.graph_objects as go
import pytest

from colossal_lab.engine import telemetry as T
from colossal_lab.engine.telemetry.memory import MemorySampler, MemorySamplerConfig, sample_memory
from colossal_lab.widgets import ChunkMap, Dashboard, MemoryGauges, PipelineTimeline
from colossal_lab.widgets.state import TIER_COLORS

MIB = 1 << 20


def _trace_by_name(fig, name):
    (t,) = [t for t in fig.data if t.name == name]
    return t


def _chunk_points(fig):
    """{(rank, chunk_id): (tier, colour, shade)} read back from the ChunkMap's strip: each
    heatmap cell's code through the figure's own colour scale, the colour matched against
    every (tier, shade) colour."""
    from colossal_lab.widgets.chunk_map import FILLS, fill_colour

    by_colour = {fill_colour(t, f): (t, f) for t in T.TIERS for f in FILLS}
    (h,) = [t for t in fig.data if t.type == "heatmap"]
    scale = [(float(p), c) for p, c in h.colorscale]
    out = {}
    for r, row in enumerate(h.z):
        for c, k in enumerate(row):
            if k is None:
                continue
            frac = (k - h.zmin) / (h.zmax - h.zmin)
            (colour,) = {a[1] for a, b in zip(scale, scale[1:]) if a[0] <= frac <= b[0]}
            rank, chunk = h.customdata[r][c]
            out[(rank, chunk)] = (by_colour[colour][0], colour, by_colour[colour][1])
    return out


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


def _chunk_hover(fig, key):
    (h,) = [t for t in fig.data if t.type == "heatmap"]
    (text,) = [h.text[r][c] for r, row in enumerate(h.customdata) for c, k in enumerate(row)
               if k is not None and tuple(k) == key]
    return text


def test_chunk_map_colours_by_tier_and_marks_moves():
    ev = [T.ChunkEvent(r, 0, c, "cpu", "hold", MIB, (f"layer{c}.w",)) for r in (0, 1) for c in range(4)]
    ev += [T.ChunkEvent(0, 1, 2, "nvme", "free", MIB, ("layer2.w",)),
           T.ChunkEvent(1, 1, 3, "cuda", "compute", 2 * MIB, ("layer3.w",))]
    ev += [T.MemorySample(0, 1.0, "cpu", 5 * MIB, 64 * MIB), T.MemorySample(1, 1.0, "cpu", 7 * MIB, 64 * MIB)]
    cm = ChunkMap.from_events(ev)
    from colossal_lab.widgets.chunk_map import fill_colour

    pts = _chunk_points(cm.figure)
    assert len(pts) == 8
    assert pts[(0, 2)] == ("nvme", fill_colour("nvme", "freed"), "freed")
    assert pts[(1, 3)] == ("cuda", TIER_COLORS["cuda"], "computing")  # computing: the tier's own colour
    assert pts[(0, 0)] == ("cpu", fill_colour("cpu", "held"), "held")
    # moved at the newest step -> a mark on the cell, by direction; unmoved -> none
    marks = _chunk_marks(cm.figure)
    assert marks.keys() == {(0, 2), (1, 3)}
    assert "slower" in marks[(0, 2)] and "faster" in marks[(1, 3)]
    hover = _chunk_hover(cm.figure, (0, 2))
    assert "layer2.w" in hover and "1.00 MiB" in hover and "cpu→nvme" in hover
    chunks = _trace_by_name(cm.figure, "chunks")
    assert dict(zip(chunks.x, chunks.y)) == {"cuda": 2.0, "cpu": 6.0, "nvme": 1.0}
    cap = _trace_by_name(cm.figure, "capacity")
    assert dict(zip(cap.x, cap.y))["cpu"] == 128.0
    assert [(m.rank, m.chunk_id, m.src, m.dst) for m in cm.chunks.moves] == [(0, 2, "cpu", "nvme"), (1, 3, "cpu", "cuda")]
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
    assert _chunk_points(in_order.figure).keys() == _chunk_points(scrambled.figure).keys()
    a = {k: v[:3] for k, v in _chunk_points(in_order.figure).items()}
    b = {k: v[:3] for k, v in _chunk_points(scrambled.figure).items()}
    assert a == b
    # the newest step wins whatever the arrival order
    assert a[(0, 0)][0] == ["cpu", "nvme", "cuda"][(0 + 4) % 3]
    # stale event after the newest one changes nothing
    before = scrambled.chunks.chunks[(0, 0)]
    scrambled.update([T.ChunkEvent(0, 1, 0, "nvme", "free", 1, ())])
    assert scrambled.chunks.chunks[(0, 0)] == before


def _pipeline_spans(step=3, t0=100.0, mb=2):
    """Two stages, GPipe-like, with known busy times: stage 0 busy 0.4 of a 1.0 s window."""
    s = []
    for m in range(mb):
        s.append(T.StageSpan(0, 0, step, m, "F", t0 + 0.1 * m, t0 + 0.1 * m + 0.1))
        s.append(T.StageSpan(0, 0, step, m, "send", t0 + 0.1 * m + 0.1, t0 + 0.1 * m + 0.12))
        s.append(T.StageSpan(1, 1, step, m, "recv", t0 + 0.1 * m + 0.1, t0 + 0.1 * m + 0.12))
        s.append(T.StageSpan(1, 1, step, m, "F", t0 + 0.2 + 0.1 * m, t0 + 0.3 + 0.1 * m))
        s.append(T.StageSpan(1, 1, step, m, "B", t0 + 0.4 + 0.1 * m, t0 + 0.5 + 0.1 * m))
        s.append(T.StageSpan(0, 0, step, m, "B", t0 + 0.7 + 0.1 * m, t0 + 0.8 + 0.1 * m))
    s.append(T.StageSpan(0, 0, step, -1, "optim", t0 + 0.9, t0 + 1.0))
    s.append(T.StageSpan(1, 1, step, -1, "optim", t0 + 0.9, t0 + 1.0))
    return s


def test_timeline_bars_and_bubbles():
    spans = _pipeline_spans()
    tl = PipelineTimeline.from_events(spans)
    f = _trace_by_name(tl.figure, "F")
    assert len(f.x) == 4
    # bars start at ms since the step's first span, length = measured duration
    bars = sorted(zip(f.y, f.base, f.x))
    assert bars[0][0].startswith("stage 0 · dp 0 · tp 0 · rank 0")
    assert bars[0][1] == pytest.approx(0.0, abs=1e-6) and bars[0][2] == pytest.approx(100.0)
    assert sorted(_trace_by_name(tl.figure, "B").text) == ["0", "0", "1", "1"]
    assert _trace_by_name(tl.figure, "optim").text == ("", "")
    # bubbles: the shared analysis function, and what the row labels say
    expect = T.bubble_fractions(spans)[3]
    assert tl.bubbles() == expect
    assert expect[0] == pytest.approx(1 - 0.5 / 1.0) and expect[1] == pytest.approx(1 - 0.5 / 1.0)
    assert any("bubble 50%" in y for y in f.y)
    # duplicates and shuffling do not change the bubbles or the bar count
    dup = spans + spans[:5]
    random.Random(1).shuffle(dup)
    tl2 = PipelineTimeline.from_events(dup)
    assert tl2.bubbles() == pytest.approx(expect)
    assert sum(len(t.x) for t in tl2.figure.data) == len(spans)


def test_timeline_draws_comm_spans():
    spans = _pipeline_spans() + [T.StageSpan(0, 0, 3, -1, "comm", 100.02, 100.05)]
    tl = PipelineTimeline.from_events(spans)
    comm = _trace_by_name(tl.figure, "comm")
    assert len(comm.x) == 1 and comm.x[0] == pytest.approx(30.0) and comm.base[0] == pytest.approx(20.0)
    assert comm.marker.color != _trace_by_name(tl.figure, "F").marker.color
    assert tl.bubbles() == T.bubble_fractions(spans)[3]


def test_timeline_step_selector_and_chrome_export(tmp_path):
    tl = PipelineTimeline.from_events(_pipeline_spans(step=1, t0=0.0) + _pipeline_spans(step=2, t0=5.0, mb=3))
    assert "step 2" in tl.figure.layout.title.text
    assert len(_trace_by_name(tl.figure, "F").x) == 6
    tl.select_step(1)
    assert "step 1" in tl.figure.layout.title.text and len(_trace_by_name(tl.figure, "F").x) == 4
    with pytest.raises(ValueError, match="select_step"):
        tl.select_step(99)
    path = tl.export_chrome_trace(tmp_path / "t.json")
    trace = json.loads(open(path).read())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(tl.timeline.spans) == 14 + 20
    assert {e["name"] for e in xs} >= {"F0", "B2", "optim", "send1"}
    with pytest.raises(FileNotFoundError, match="export_chrome_trace"):
        tl.export_chrome_trace(tmp_path / "nope" / "t.json")



def test_timeline_dropdown_shows_latest_and_picks_steps():
    """The ipywidgets dropdown: "latest" is a real selection (a value of None would show a blank
    box), new steps extend it while following the run, picking a step pins the figure."""
    tl = PipelineTimeline(live=True, subscribe=False)
    box = tl.widget()
    dd = box.children[0]
    assert dd.label == "latest" and dd.index == 0
    tl.update(_pipeline_spans(step=1, t0=0.0))
    tl.update(_pipeline_spans(step=2, t0=5.0, mb=3))
    assert [o[0] for o in dd.options] == ["latest", "step 1", "step 2"] and dd.label == "latest"
    assert "step 2" in tl.figure.layout.title.text
    dd.value = 1  # the user picks step 1
    assert tl.step == 1 and "step 1" in tl.figure.layout.title.text
    tl.update(_pipeline_spans(step=3, t0=9.0))
    assert dd.label == "step 1" and "step 1" in tl.figure.layout.title.text  # stays pinned
    dd.index = 0
    assert tl.step is None and "step 3" in tl.figure.layout.title.text


def test_gauges_values_latest_sample_wins():
    ev = [T.MemorySample(0, 2.0, "cpu", 300 * MIB, 1000 * MIB),
          T.MemorySample(0, 1.0, "cpu", 100 * MIB, 1000 * MIB),  # older, arrives late
          T.MemorySample(1, 1.5, "nvme", 50 * MIB, 500 * MIB),
          T.MemorySample(1, 1.5, "nvme", 50 * MIB, 500 * MIB)]   # duplicate
    g = MemoryGauges.from_events(ev)
    assert g.values() == {(0, "cpu"): (300 * MIB, 1000 * MIB), (1, "nvme"): (50 * MIB, 500 * MIB)}
    inds = {t.name: t for t in g.figure.data}
    assert set(inds) == {"rank 0 cpu", "rank 1 nvme"}
    assert inds["rank 0 cpu"].value == pytest.approx(300.0)
    assert inds["rank 0 cpu"].gauge.axis.range == (0, 1000.0)
    assert inds["rank 1 nvme"].domain.row == 1 and inds["rank 1 nvme"].domain.column == 1


def test_dashboard_curves_and_replay_from_trace(tmp_path):
    path = tmp_path / "run.jsonl"
    with T.record(path):
        for step in range(1, 4):
            for r in (0, 1):
                T.emit(T.StepMetrics(r, step, 3.0 - step * 0.5 if r == 1 else None, 256, 0.5 * (r + 1)))
        for s in _pipeline_spans(step=3):
            T.emit(s)
        T.emit(T.ChunkEvent(0, 3, 0, "cpu", "hold", MIB, ("w",)))
        T.emit(T.MemorySample(0, 1.0, "cpu", MIB, 10 * MIB))
    d = Dashboard.from_trace(path)
    loss = _trace_by_name(d.figure, "loss")
    assert list(loss.x) == [1, 2, 3] and list(loss.y) == [2.5, 2.0, 1.5]
    assert list(_trace_by_name(d.figure, "rank 0 tok/s").y) == [512.0] * 3
    assert list(_trace_by_name(d.figure, "rank 1 tok/s").y) == [256.0] * 3
    assert set(d.figures) == {"metrics", "chunk_map", "timeline", "gauges"}
    assert d.timeline.bubbles() == T.bubble_fractions(_pipeline_spans(step=3))[3]
    assert len(d.chunk_map.chunks.chunks) == 1 and d.gauges.values()[(0, "cpu")] == (MIB, 10 * MIB)
    with pytest.raises(FileNotFoundError, match="from_trace"):
        ChunkMap.from_trace(tmp_path / "missing.jsonl")


def test_static_fallback_outside_a_widget_frontend():
    d = Dashboard.from_events([T.StepMetrics(0, 1, 2.0, 10, 1.0), T.ChunkEvent(0, 1, 0, "nvme", "hold", MIB, ())])
    bundle = d._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" not in bundle
    assert "plotly" in bundle["text/html"].lower() and "ChunkMap: 1 chunks" in bundle["text/plain"]
    assert "loss 2.0000" in repr(d)
    assert isinstance(d.figure, go.Figure)


def test_live_subscription_redraws_throttled_and_never_blocks_the_emitter():
    cm = ChunkMap(live=False, max_hz=5)
    try:
        n = 3000
        t0 = time.perf_counter()
        for i in range(n):
            T.emit(T.ChunkEvent(i % 2, i // 60, i % 60, ("cpu", "nvme")[i % 2], "hold", 1000, ()))
        emit_s = time.perf_counter() - t0
        # the redraw thread took every event, folded it and redrew (it counts a tick's events last)
        assert _wait_for(lambda: cm._throttle.events >= n)
        assert len(_chunk_points(cm.figure)) == 60  # the redraw thread drew the latest state
        # coalesced: thousands of events, a handful of redraws at <= 5 Hz
        assert cm._throttle.calls <= 2 + 5 * (time.perf_counter() - t0)
        assert emit_s / n < 1e-3  # the subscriber only queues
        assert not cm._throttle.errors
    finally:
        cm.close()
    before = len(cm.chunks.chunks)
    T.emit(T.ChunkEvent(5, 0, 0, "cpu", "hold", 1, ()))
    cm.flush()
    assert len(cm.chunks.chunks) == before  # closed: unsubscribed


def test_live_widget_redraws_from_a_background_thread():
    """Live views draw into an anywidget ``PlotlyView`` (see _frontend.py for why not an Output
    with the plotly mime bundle, nor FigureWidget); the redraw thread replaces its ``figure``
    trait with the full, latest picture."""
    import anywidget
    import ipywidgets as W

    from colossal_lab.widgets._frontend import ESM

    g = MemoryGauges(live=True, max_hz=10)
    try:
        out = g.widget()
        assert isinstance(out, anywidget.AnyWidget) and isinstance(g.figure, go.Figure)
        assert out._esm == ESM and "Plotly.react" in ESM  # updated in place in the browser
        th = threading.Thread(target=lambda: T.emit(T.MemorySample(3, time.time(), "cpu", 42 * MIB, 84 * MIB)))
        th.start(); th.join()
        deadline = time.time() + 5
        while time.time() < deadline and not g.figure.data:
            time.sleep(0.05)
        assert g.figure.data[0].value == pytest.approx(42.0)
        fig = out.figure
        assert fig["data"][0]["value"] == pytest.approx(42.0) and "rank 3" in g.summary()
        json.dumps(fig)  # plain JSON (no numpy), what the browser's plotly.js receives
        bundle = g._repr_mimebundle_()
        assert "application/vnd.jupyter.widget-view+json" in bundle and "text/html" in bundle
    finally:
        g.close()
    d = Dashboard(live=True, subscribe=False)
    assert isinstance(d.widget(), W.VBox) and len(d.widget().children) == 4
    d.update([T.StepMetrics(0, 1, 2.5, 10, 1.0), T.ChunkEvent(0, 1, 0, "nvme", "hold", MIB, ())])
    names = {t.get("name") for t in d.chunk_map.widget().figure["data"]}
    assert "nvme" in names


def test_memory_sampler_measures_real_host_and_nvme_dir(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "chunk0.bin").write_bytes(b"x" * 123_457)
    by_tier = {s.tier: s for s in sample_memory(rank=2, nvme_dir=str(tmp_path), cuda=False)}
    assert set(by_tier) == {"cpu", "nvme"}
    assert by_tier["nvme"].used == 123_457 and by_tier["nvme"].capacity > by_tier["nvme"].used
    assert 0 < by_tier["cpu"].used < by_tier["cpu"].capacity and by_tier["cpu"].rank == 2
    with pytest.raises(FileNotFoundError, match="nvme_dir"):
        sample_memory(0, nvme_dir=str(tmp_path / "missing"))
    got = []

    def two_of_each():  # the sampler thread appends to ``got`` while this reads it
        tiers = [e.tier for e in list(got) if isinstance(e, T.MemorySample)]
        return tiers.count("nvme") >= 2 and tiers.count("cpu") >= 2

    unsub = T.subscribe(got.append)
    try:
        with MemorySampler(MemorySamplerConfig(rank=1, interval=0.05, nvme_dir=str(tmp_path), cuda=False)):
            assert _wait_for(two_of_each)
    finally:
        unsub()
    tiers = [e.tier for e in got if isinstance(e, T.MemorySample)]
    assert tiers.count("nvme") >= 2 and tiers.count("cpu") >= 2
    g = MemoryGauges.from_events(got)
    assert g.values()[(1, "nvme")][0] == 123_457


def test_live_bundle_is_the_plain_dict_and_figure_matches_it():
    """The redraw path sends a plain dict (no plotly objects); ``.figure`` is that same picture,
    validated by plotly; an unchanged picture is not sent again."""
    import ipywidgets as W  # noqa: F401

    from colossal_lab.widgets import chunk_map_dict
    from colossal_lab.widgets.chunk_map import fill_colour

    ev = [T.ChunkEvent(r, 1, c, ("cpu", "nvme", "cuda")[c % 3], "hold", MIB, (f"p{c}",))
          for r in (0, 1) for c in range(5)] + [T.MemorySample(0, 1.0, "cpu", MIB, 8 * MIB)]
    cm = ChunkMap(live=True, subscribe=False)
    cm.update(ev)
    sent = cm.widget().figure
    assert sent is cm.figure_dict() and sent == chunk_map_dict(cm.chunks, cm.memory)
    assert json.loads(json.dumps(sent)) == sent  # already plain JSON: nothing to convert
    as_fig = json.loads(cm.figure.to_json())
    assert as_fig["data"] == sent["data"]
    assert {k: v for k, v in as_fig["layout"].items()} == json.loads(json.dumps(sent["layout"]))
    assert cm.figure is cm.figure  # built once per redraw, on read
    n, out = cm.redraws, cm.widget().figure
    cm.update(ev)          # duplicates: state unchanged, nothing folded
    cm.redraw()            # same picture: skipped, nothing sent
    assert cm.redraws == n and cm.skipped >= 1 and cm.widget().figure is out
    cm.update([T.ChunkEvent(0, 2, 0, "nvme", "free", MIB, ("p0",))])
    assert cm.redraws == n + 1 and cm.widget().figure is not out
    # the hover texts cached between redraws are those of the newest events
    assert cm.figure_dict() == chunk_map_dict(cm.chunks, cm.memory)
    assert "freed (free)" in _chunk_hover(cm.figure, (0, 0))
    assert _chunk_points(cm.figure)[(0, 0)][:3] == ("nvme", fill_colour("nvme", "freed"), "freed")


def _colossal_threads():
    return {t for t in threading.enumerate() if t.name.startswith("colossal-") and t.is_alive()}


def _wait_for(cond, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline and not cond():
        time.sleep(0.02)
    return cond()


def test_dashboard_one_thread_serves_all_four_views_and_coalesces():
    before = _colossal_threads()
    d = Dashboard(live=False, max_hz=5)
    try:
        mine = _colossal_threads() - before
        assert len(mine) == 1  # one redraw thread for the four views, not one each
        th = d._throttle
        assert all(v._throttle is th for v in d.views.values())
        # the bus calls the queue's own C append: nothing else runs on the emitting thread
        from colossal_lab.engine.telemetry import bus
        assert any(getattr(s, "__self__", None) is th.queue for s in bus._subscribers)
        start = {k: v.redraws for k, v in d.views.items()}
        calls0, t0 = th.calls, time.perf_counter()

        def emit_all():
            for step in range(1, 41):
                T.emit(T.StepMetrics(0, step, 3.0 - step / 100, 512, 0.01))
                for c in range(8):
                    T.emit(T.ChunkEvent(0, step, c, ("cpu", "nvme")[(c + step) % 2], "hold", MIB, (f"p{c}",)))
                for s in _pipeline_spans(step=step, t0=float(step)):
                    T.emit(s)
                T.emit(T.MemorySample(0, float(step), "cpu", step * MIB, 64 * MIB))
                time.sleep(0.01)

        emitter = threading.Thread(target=emit_all)
        emitter.start()
        emitter.join()
        # the thread counts a tick's events after it folded and redrew every view
        assert _wait_for(lambda: th.events >= 40 * (1 + 8 + len(_pipeline_spans()) + 1))
        assert _wait_for(lambda: d.metrics.loss_curve()[0][-1:] == [40]
                         and d.chunk_map.chunks.last_step() == 40
                         and d.timeline.timeline.steps[-1:] == [40]
                         and d.gauges.values().get((0, "cpu"), (0,))[0] == 40 * MIB)
        elapsed = time.perf_counter() - t0
        calls = th.calls - calls0
        # ~1000 events of four types, a few ticks at <= 5 Hz, every view redrawn from them
        assert 1 <= calls <= 2 + 5 * elapsed
        for k, v in d.views.items():
            assert 1 <= v.redraws - start[k] <= calls, k
        assert th.events == 40 * (1 + 8 + len(_pipeline_spans()) + 1) and not th.errors
        assert "step 40" in d.figure_dict()["layout"]["title"]["text"]
        assert "step 40" in d.timeline.figure_dict()["layout"]["title"]["text"]
        # idle: the thread keeps waking but folds and redraws nothing
        redraws, calls = dict(d.redraw_counts), th.calls
        wakes = th.wakes
        assert _wait_for(lambda: th.wakes >= wakes + 2)
        assert th.calls == calls and d.redraw_counts == redraws
    finally:
        d.close()
    assert _wait_for(lambda: not (_colossal_threads() - before), timeout=3)


def test_closing_one_view_of_a_dashboard_keeps_the_others_drawing():
    d = Dashboard(live=False, max_hz=10)
    try:
        T.emit(T.ChunkEvent(0, 1, 0, "cpu", "hold", MIB, ()))
        assert _wait_for(lambda: len(d.chunk_map.chunks.chunks) == 1)
        d.chunk_map.close()
        assert d.chunk_map not in d._throttle.views and d._throttle._thread.is_alive()
        T.emit(T.ChunkEvent(0, 2, 1, "nvme", "hold", MIB, ()))
        T.emit(T.StepMetrics(0, 2, 1.5, 10, 1.0))
        assert _wait_for(lambda: d.metrics.loss_curve()[0] == [2])
        d.flush()
        assert len(d.chunk_map.chunks.chunks) == 1  # closed: no longer fed
    finally:
        d.close()
    assert not d._throttle._thread.is_alive()


def test_dashboard_feed_routes_each_event_to_the_view_that_draws_it():
    d = Dashboard(live=False, subscribe=False)
    d.feed(T.StepMetrics(0, 1, 2.0, 10, 1.0))
    d.feed(T.ChunkEvent(0, 1, 0, "nvme", "hold", MIB, ()))
    d.feed(T.MemorySample(0, 1.0, "cpu", MIB, 8 * MIB))
    d.feed(_pipeline_spans(step=1)[0])
    assert d._throttle is None and d.metrics.loss_curve()[0] == []  # queued, not folded
    d.flush()
    assert d.metrics.loss_curve() == ([1], [2.0])
    assert len(d.chunk_map.chunks.chunks) == 1 and d.gauges.values()[(0, "cpu")] == (MIB, 8 * MIB)
    assert d.chunk_map.memory.samples  # the chunk map's bars use MemorySamples too
    assert d.timeline.timeline.steps == [1]


def test_chunk_moves_index_matches_a_scan_of_the_moves_kept():
    from colossal_lab.widgets.state import ChunkState

    rng = random.Random(3)
    st = ChunkState(max_moves=7)
    for _ in range(400):
        step = rng.randrange(0, 12)
        st.apply(T.ChunkEvent(rng.randrange(2), step, rng.randrange(5), rng.choice(["cpu", "nvme", "cuda"]),
                              "hold", 1, ()))
        assert len(st.moves) <= 7
        for s in range(12):
            assert st.moved_at(s) == {(m.rank, m.chunk_id) for m in st.moves if m.step == s}
    # a state built with moves given is indexed too
    st2 = ChunkState(moves=list(st.moves), max_moves=7)
    assert all(st2.moved_at(s) == st.moved_at(s) for s in range(12))
    with pytest.raises(ValueError, match="max_moves"):
        ChunkState(max_moves=0)


def test_timeline_step_index_matches_the_spans_kept():
    from colossal_lab.widgets.state import TimelineState

    spans = [s for step in range(10) for s in _pipeline_spans(step=step, t0=10.0 * step)]
    random.Random(5).shuffle(spans)
    st = TimelineState(keep_steps=4)
    ref: set = set()
    for e in spans + spans[:20]:
        st.apply(e)
        # the reference: keep every span, then drop all but the newest ``keep_steps`` steps
        ref.add(e)
        steps = sorted({s.step for s in ref})
        if len(steps) > 4:
            ref = {s for s in ref if s.step >= steps[-4]}
        assert st.spans == ref and st.steps == sorted({s.step for s in ref})
    for step in st.steps:
        got = st.spans_of(step)
        assert set(got) == {s for s in ref if s.step == step} and len(got) == len(set(got))
        assert [(s.stage, s.start) for s in got] == sorted((s.stage, s.start) for s in got)
    assert TimelineState(spans=set(spans), keep_steps=4).steps == [6, 7, 8, 9]


def test_live_update_message_is_what_ipywidgets_would_send():
    """The PlotlyView's lean ``figure`` update (no binary-buffer walk) sends exactly the message
    ipywidgets' own ``send_state`` builds, through a real comm."""
    import comm
    from comm.base_comm import BaseComm
    from ipywidgets.widgets.widget import _remove_buffers

    sent = []

    class CaptureComm(BaseComm):
        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            sent.append((msg_type, json.loads(json.dumps(data)), buffers))

    old = comm.create_comm
    comm.create_comm = CaptureComm
    try:
        cm = ChunkMap(live=True, subscribe=False)
        cm.update([T.ChunkEvent(0, 1, c, "cpu", "hold", MIB, (f"p{c}",)) for c in range(3)])
        out = cm.widget()
        state, paths, bufs = _remove_buffers(out.get_state(key="figure"))
        expect = {"method": "update", "state": state, "buffer_paths": paths}
        updates = [(d, b) for t, d, b in sent if t == "comm_msg" and d.get("method") == "update"]
        assert updates and updates[-1][0] == json.loads(json.dumps(expect)) and not bufs
        assert updates[-1][0]["state"]["figure"] == json.loads(json.dumps(cm.figure_dict()))
        n = len(updates)
        out.layout.width = "50%"  # any other key still goes through ipywidgets' own path
        out.plotly_version = "0.0.1"
        assert [d for t, d, b in sent if t == "comm_msg"][-1]["state"] == {"plotly_version": "0.0.1"}
        assert len([1 for t, d, b in sent if t == "comm_msg" and "figure" in d.get("state", {})]) == n
    finally:
        comm.create_comm = old


def test_long_runs_thin_the_metrics_curves():
    from colossal_lab.engine.telemetry import StepMetrics
    from colossal_lab.widgets.dashboard import MAX_POINTS, metrics_dict
    from colossal_lab.widgets.state import MetricsState

    st = MetricsState()
    n = 5003
    for i in range(n):
        for r in (0, 1):
            st.apply(StepMetrics(rank=r, step=i, loss=float(i), tokens=100, seconds=0.5))
    fig = metrics_dict(st)
    assert len(fig["data"]) == 3
    for tr in fig["data"]:
        assert 0 < len(tr["x"]) <= MAX_POINTS and tr["x"][-1] == n - 1  # newest step drawn last
        assert tr["x"] == sorted(tr["x"])
    loss = fig["data"][0]
    # bucket means of a linear curve: the thinned curve stays on it, ends at the last bucket's mean
    assert abs(loss["y"][-1] - (n - 1 - (len(range(0, n)) // len(loss["x"]) - 1) / 2)) < 5
    assert all(abs(y - 200.0) < 1e-9 for y in fig["data"][1]["y"])  # tokens/s unchanged by averaging
    short = MetricsState()
    for i in range(10):
        short.apply(StepMetrics(rank=0, step=i, loss=1.0 / (i + 1), tokens=1, seconds=1.0))
    assert metrics_dict(short)["data"][0]["x"] == list(range(10))  # short runs: every step
