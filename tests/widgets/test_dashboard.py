"""The Dashboard: the metrics curves (thinned on long runs), replay from a JSONL trace, the static
fallback outside a widget frontend, one redraw thread serving its four views, and each event fed
to the view that draws it."""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

import threading
import time

import plotly.graph_objects as go
from support.widgets import MIB, pipeline_spans, trace_by_name, wait_for

from colossal_lab.engine import telemetry as T
from colossal_lab.widgets import ChunkMap, Dashboard


def test_dashboard_curves_and_replay_from_trace(tmp_path):
    path = tmp_path / "run.jsonl"
    with T.record(path):
        for step in range(1, 4):
            for r in (0, 1):
                T.emit(T.StepMetrics(r, step, 3.0 - step * 0.5 if r == 1 else None, 256, 0.5 * (r + 1)))
        for s in pipeline_spans(step=3):
            T.emit(s)
        T.emit(T.ChunkEvent(0, 3, 0, "cpu", "hold", MIB, ("w",)))
        T.emit(T.MemorySample(0, 1.0, "cpu", MIB, 10 * MIB))
    d = Dashboard.from_trace(path)
    loss = trace_by_name(d.figure, "loss")
    assert list(loss.x) == [1, 2, 3] and list(loss.y) == [2.5, 2.0, 1.5]
    assert list(trace_by_name(d.figure, "rank 0 tok/s").y) == [512.0] * 3
    assert list(trace_by_name(d.figure, "rank 1 tok/s").y) == [256.0] * 3
    assert set(d.figures) == {"metrics", "chunk_map", "timeline", "gauges"}
    assert d.timeline.bubbles() == T.bubble_fractions(pipeline_spans(step=3))[3]
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


def _colossal_threads():
    return {t for t in threading.enumerate() if t.name.startswith("colossal-") and t.is_alive()}


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
                for s in pipeline_spans(step=step, t0=float(step)):
                    T.emit(s)
                T.emit(T.MemorySample(0, float(step), "cpu", step * MIB, 64 * MIB))
                time.sleep(0.01)

        emitter = threading.Thread(target=emit_all)
        emitter.start()
        emitter.join()
        # the thread counts a tick's events after it folded and redrew every view
        assert wait_for(lambda: th.events >= 40 * (1 + 8 + len(pipeline_spans()) + 1))
        assert wait_for(lambda: d.metrics.loss_curve()[0][-1:] == [40]
                         and d.chunk_map.chunks.last_step() == 40
                         and d.timeline.timeline.steps[-1:] == [40]
                         and d.gauges.values().get((0, "cpu"), (0,))[0] == 40 * MIB)
        elapsed = time.perf_counter() - t0
        calls = th.calls - calls0
        # ~1000 events of four types, a few ticks at <= 5 Hz, every view redrawn from them
        assert 1 <= calls <= 2 + 5 * elapsed
        for k, v in d.views.items():
            assert 1 <= v.redraws - start[k] <= calls, k
        assert th.events == 40 * (1 + 8 + len(pipeline_spans()) + 1) and not th.errors
        assert "step 40" in d.figure_dict()["layout"]["title"]["text"]
        assert "step 40" in d.timeline.figure_dict()["layout"]["title"]["text"]
        # idle: the thread keeps waking but folds and redraws nothing
        redraws, calls = dict(d.redraw_counts), th.calls
        wakes = th.wakes
        assert wait_for(lambda: th.wakes >= wakes + 2)
        assert th.calls == calls and d.redraw_counts == redraws
    finally:
        d.close()
    assert wait_for(lambda: not (_colossal_threads() - before), timeout=3)


def test_closing_one_view_of_a_dashboard_keeps_the_others_drawing():
    d = Dashboard(live=False, max_hz=10)
    try:
        T.emit(T.ChunkEvent(0, 1, 0, "cpu", "hold", MIB, ()))
        assert wait_for(lambda: len(d.chunk_map.chunks.chunks) == 1)
        d.chunk_map.close()
        assert d.chunk_map not in d._throttle.views and d._throttle._thread.is_alive()
        T.emit(T.ChunkEvent(0, 2, 1, "nvme", "hold", MIB, ()))
        T.emit(T.StepMetrics(0, 2, 1.5, 10, 1.0))
        assert wait_for(lambda: d.metrics.loss_curve()[0] == [2])
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
    d.feed(pipeline_spans(step=1)[0])
    assert d._throttle is None and d.metrics.loss_curve()[0] == []  # queued, not folded
    d.flush()
    assert d.metrics.loss_curve() == ([1], [2.0])
    assert len(d.chunk_map.chunks.chunks) == 1 and d.gauges.values()[(0, "cpu")] == (MIB, 8 * MIB)
    assert d.chunk_map.memory.samples  # the chunk map's bars use MemorySamples too
    assert d.timeline.timeline.steps == [1]


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
