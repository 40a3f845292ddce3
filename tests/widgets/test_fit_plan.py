"""widgets.FitPlan: the plan's bars are its numbers, measured peaks land on them, the Dashboard holds one."""

import ast

import pytest

# widget packages this module needs: absent (a bare GPU image), it skips
pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from support import ROOT

import colossal_lab as cl
from colossal_lab.engine import telemetry as T
from colossal_lab.engine.models import GPTConfig
from colossal_lab.engine.plugins import GeminiPlugin, HybridParallelPlugin
from colossal_lab.widgets import Dashboard, FitPlan

MIB = float(1 << 20)


@pytest.fixture(scope="module")
def pp_plan():
    # two pipeline stages: two rank groups, one tier each, tight capacity so the tick is drawn
    return cl.plan(GPTConfig.preset("small"), HybridParallelPlugin(pp_size=2, num_microbatches=2), world_size=2,
                   batch=2, seq=64, host_memory=40 << 20)


def test_bars_stack_the_plans_categories_per_rank_group_and_tier(pp_plan):
    v = FitPlan(pp_plan, subscribe=False, live=False)
    d = v.figure_dict()
    bars = [t for t in d["data"] if t["type"] == "bar"]
    assert [t["name"] for t in bars] == ["params", "grads", "optimizer", "activations", "working"]
    assert d["layout"]["barmode"] == "stack"
    assert bars[0]["x"] == ["rank 0 (stage 0)<br>cpu", "rank 1 (stage 1)<br>cpu"]
    for i, g in enumerate(pp_plan.ranks):  # stacked heights add up to the plan's peak, in MiB
        assert sum(t["y"][i] for t in bars) == pytest.approx(g.tiers["cpu"].peak / MIB)
    cap = next(t for t in d["data"] if t["name"] == "capacity")
    assert cap["y"] == [40.0, 40.0]
    assert "measured peak" not in [t["name"] for t in d["data"]]
    assert v.figure.data[0].type == "bar"  # a valid plotly figure
    assert "FitPlan" in v.summary() and "stage 1" in v.summary()


def test_memory_samples_add_measured_markers_and_the_error(pp_plan):
    v = FitPlan(pp_plan.to_dict(), subscribe=False, live=False)  # the plain dict works as well
    pred0 = pp_plan.peak("cpu", rank=0)
    v.update([T.MemorySample(0, 1.0, "cpu", used=int(pred0 * 0.5), capacity=0, peak=int(pred0 * 0.95)),
              T.MemorySample(0, 2.0, "cpu", used=int(pred0 * 0.4), capacity=0),        # lower: the peak stays
              T.MemorySample(1, 1.0, "cpu", used=int(pred0 * 1.2), capacity=0),
              T.MemorySample(1, 1.0, "nvme", used=123, capacity=0),                  # a tier the plan lacks
              T.StepMetrics(0, 1, 2.0, 10, 0.1)])                                    # ignored
    assert v.measured[(0, "cpu")] == int(pred0 * 0.95)
    cmp = v.compare()
    assert set(cmp) == {(0, "cpu"), (1, "cpu")}
    assert cmp[(0, "cpu")][2] == pytest.approx(100 * (pred0 - int(pred0 * 0.95)) / int(pred0 * 0.95))
    marks = next(t for t in v.figure_dict()["data"] if t["name"] == "measured peak")
    assert marks["x"] == ["rank 0 (stage 0)<br>cpu", "rank 1 (stage 1)<br>cpu"]
    assert marks["y"][0] == pytest.approx(int(pred0 * 0.95) / MIB)


def test_from_trace_and_huge_capacity_is_written_not_drawn(tmp_path):
    plan = cl.plan(GPTConfig.preset("small"), GeminiPlugin(placement_policy="auto", precision="fp32",
                                                          device_memory_limit=24 << 20, nvme_offload_dir=str(tmp_path),
                                                          nvme_offload_frac=1.0), world_size=2, batch=2, seq=64)
    path = tmp_path / "run.jsonl"
    with T.record(str(path)):
        T.emit(T.MemorySample(0, 1.0, "nvme", used=30 << 20, capacity=1 << 40, peak=31 << 20))
        T.emit(T.MemorySample(1, 1.0, "cpu", used=27 << 20, capacity=1 << 40))
    v = FitPlan.from_trace(str(path), plan=plan)
    assert v.measured == {(0, "nvme"): 31 << 20, (1, "cpu"): 27 << 20}
    d = v.figure_dict()
    assert "capacity" not in [t["name"] for t in d["data"]]  # disk and RAM are far above the bars
    assert all(a["text"].startswith("cap ") for a in d["layout"]["annotations"])
    with pytest.raises(TypeError, match="plan"):
        FitPlan.from_trace(str(path))


def test_dashboard_with_a_plan_overlays_measured_peaks(pp_plan):
    d = Dashboard(live=False, subscribe=False, plan=pp_plan)
    assert set(d.views) == {"metrics", "chunk_map", "timeline", "gauges", "fit_plan"}
    d.feed(T.MemorySample(1, 1.0, "cpu", 20 << 20, 40 << 20, peak=25 << 20))
    d.feed(T.StepMetrics(0, 1, 2.0, 10, 1.0))
    d.flush()
    assert d.fit_plan.measured == {(1, "cpu"): 25 << 20}
    assert d.gauges.values()[(1, "cpu")] == (20 << 20, 40 << 20)
    assert "fit_plan" in d.figures and "FitPlan" in d.summary()
    d.close()
    plain = Dashboard(live=False, subscribe=False)
    assert "fit_plan" not in plain.views and plain.fit_plan is None


def test_live_dashboard_thread_feeds_the_plan_view(pp_plan):
    import time

    d = Dashboard(live=False, max_hz=20, plan=pp_plan)
    try:
        assert d.fit_plan._throttle is d._throttle  # one redraw thread for every view
        T.emit(T.MemorySample(0, 1.0, "cpu", 10 << 20, 40 << 20, peak=12 << 20))
        deadline = time.time() + 10
        while time.time() < deadline and not d.fit_plan.measured:
            time.sleep(0.02)
        assert d.fit_plan.measured == {(0, "cpu"): 12 << 20}
    finally:
        d.close()


def test_the_widget_reads_plain_data_and_imports_no_engine_internals():
    src = (ROOT / "widgets" / "fit_plan.py").read_text()
    mods = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom):
            mods.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    allowed = {"__future__", "typing", "plotly.graph_objects", "colossal_lab.engine.telemetry", "._live"}
    assert mods <= allowed, mods - allowed
    with pytest.raises(TypeError, match="cl.plan"):
        FitPlan(object(), subscribe=False, live=False)
