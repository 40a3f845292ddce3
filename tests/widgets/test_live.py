"""The live path of the views (widgets/_live.py, widgets/_frontend.py): a subscribed view redraws on
its own thread, throttled, never blocking the emitter; a live view draws into an anywidget whose
``figure`` is the plain dict it sends, by the message ipywidgets itself would send; the timeline's
step picker follows the run until a step is picked."""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

import json
import threading
import time

import plotly.graph_objects as go
from support.widgets import MIB, chunk_hover, chunk_points, pipeline_spans, wait_for

from colossal_lab.engine import telemetry as T
from colossal_lab.widgets import ChunkMap, Dashboard, MemoryGauges, PipelineTimeline


def test_timeline_dropdown_shows_latest_and_picks_steps():
    """The ipywidgets dropdown: "latest" is a real selection (a value of None would show a blank
    box), new steps extend it while following the run, picking a step pins the figure."""
    tl = PipelineTimeline(live=True, subscribe=False)
    box = tl.widget()
    dd = box.children[0]
    assert dd.label == "latest" and dd.index == 0
    tl.update(pipeline_spans(step=1, t0=0.0))
    tl.update(pipeline_spans(step=2, t0=5.0, mb=3))
    assert [o[0] for o in dd.options] == ["latest", "step 1", "step 2"] and dd.label == "latest"
    assert "step 2" in tl.figure.layout.title.text
    dd.value = 1  # the user picks step 1
    assert tl.step == 1 and "step 1" in tl.figure.layout.title.text
    tl.update(pipeline_spans(step=3, t0=9.0))
    assert dd.label == "step 1" and "step 1" in tl.figure.layout.title.text  # stays pinned
    dd.index = 0
    assert tl.step is None and "step 3" in tl.figure.layout.title.text


def test_live_subscription_redraws_throttled_and_never_blocks_the_emitter():
    cm = ChunkMap(live=False, max_hz=5)
    try:
        n = 3000
        t0 = time.perf_counter()
        for i in range(n):
            T.emit(T.ChunkEvent(i % 2, i // 60, i % 60, ("cpu", "nvme")[i % 2], "hold", 1000, ()))
        emit_s = time.perf_counter() - t0
        # the redraw thread took every event, folded it and redrew (it counts a tick's events last)
        assert wait_for(lambda: cm._throttle.events >= n)
        assert len(chunk_points(cm.figure)) == 60  # the redraw thread drew the latest state
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
        th.start()
        th.join()
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
    assert "freed (free)" in chunk_hover(cm.figure, (0, 0))
    assert chunk_points(cm.figure)[(0, 0)][:3] == ("nvme", fill_colour("nvme", "freed"), "freed")


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
