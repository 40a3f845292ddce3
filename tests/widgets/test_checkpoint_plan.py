"""The activation-checkpoint plan in telemetry and the dashboard (issue #19): a real plan of a tiny
GPT emits one ``CheckpointPlanEvent`` whose fields are the plan's, the event survives a JSONL
trace, the relay's rows and its coalescing, ``CheckpointPlanView`` draws each block's option and
kept bytes beside the budget (one row per rank, the latest plan of a rank winning, measured peaks
laid on), the ``Dashboard`` shows the view only once a plan arrived, and GPT's
``activation_checkpointing="auto"`` emits the plan it makes."""

import dataclasses
import json
import time

import pytest

pytest.importorskip("plotly")

import torch

from colossal_lab import relay as R
from colossal_lab.engine import telemetry as T
from colossal_lab.engine.autockpt import apply, min_peak, plan_checkpointing, profile_checkpointing, solve
from colossal_lab.engine.models import GPT, GPTConfig
from colossal_lab.engine.telemetry.events import CheckpointPlanEvent
from colossal_lab.widgets import CheckpointPlanView, Dashboard
from colossal_lab.widgets.checkpoint_plan import plan_tier

N_LAYER, B, SEQ = 3, 2, 32


class Caught:
    """The events emitted on this process's bus inside the block (a real subscriber)."""

    def __enter__(self):
        self.events = []
        self._unsub = T.subscribe(self.events.append)
        return self

    def __exit__(self, *exc):
        self._unsub()

    def plans(self):
        return [e for e in self.events if isinstance(e, CheckpointPlanEvent)]


def _want(plan) -> dict:
    """The event's fields as read straight off the plan and its profile (all but rank, stage, time)."""
    units = plan.profile.units
    return dict(budget=plan.budget, predicted_peak=plan.predicted_peak,
                predicted_recompute_s=plan.predicted_recompute_s, peak_none=plan.peak_none, peak_min=plan.peak_min,
                layers=tuple(str(x) for x in plan.layers), names=tuple(u.name for u in units), options=plan.choice,
                keep=tuple(u.options[o].keep for u, o in zip(units, plan.choice)),
                recompute_s=tuple(u.options[o].cost_s for u, o in zip(units, plan.choice)),
                prefix_keep=plan.profile.prefix_keep, forward_s=plan.forward_s, device="cpu")


def _fields(e: CheckpointPlanEvent) -> dict:
    d = dataclasses.asdict(e)
    for k in ("rank", "stage", "time"):
        d.pop(k)
    return d


@pytest.fixture(scope="module")
def planned():
    """A tiny GPT planned for a budget halfway between the lowest peak any plan reaches and the
    peak without checkpointing (so some blocks must recompute), with the events that emitted."""
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny", n_layer=N_LAYER)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (B, SEQ))
    prof = profile_checkpointing(model, (idx, idx))  # nobody listens: emits nothing
    lo, hi = min_peak(prof)[0], prof.predict(["none"] * N_LAYER)[0]
    budget = (lo + hi) // 2
    with Caught() as caught:
        plan = plan_checkpointing(model, (idx, idx), budget)
    return model, idx, plan, caught.events


def test_plan_checkpointing_emits_exactly_the_plan(planned):
    model, _, plan, events = planned
    assert plan.peak_min < plan.budget < plan.peak_none and plan.layers  # some block must recompute
    (e,) = [x for x in events if isinstance(x, CheckpointPlanEvent)]
    assert len(events) == 1
    assert _fields(e) == _want(plan)
    assert (e.rank, e.stage) == (0, 0) and abs(e.time - time.time()) < 120
    assert e.names == ("blocks.0", "blocks.1", "blocks.2") and len(e.options) == len(e.keep) == N_LAYER
    # the layers handed to enable_activation_checkpointing are the non-"none" options, as strings
    assert list(e.layers) == [str(u) if o == "layer" else f"{u}.{o}" for u, o in enumerate(e.options) if o != "none"]
    # what the blocks keep is a floor of the predicted peak, which fits the budget
    assert e.prefix_keep + sum(e.keep) <= e.predicted_peak <= e.budget
    # a what-if solve reports nothing
    with Caught() as caught:
        assert solve(plan.profile, plan.budget, report=False).choice == plan.choice
    assert caught.events == []
    # applying the plan reports it again, later
    with Caught() as caught:
        assert apply(model, plan) is model
    (again,) = caught.plans()
    assert _fields(again) == _fields(e) and again.time >= e.time
    model.enable_activation_checkpointing([])


def test_event_round_trips_a_trace_rows_and_the_relay(planned, tmp_path):
    model, _, plan, _ = planned
    path = tmp_path / "plan.jsonl"
    with Caught() as caught, T.record(path):
        apply(model, plan)
        T.emit(T.MemorySample(0, 1.0, "cpu", 10, 100, peak=plan.budget))
    model.enable_activation_checkpointing([])
    (e,) = caught.plans()
    back = T.read_trace(path)
    assert back == caught.events and back[0] == e and isinstance(back[0].keep, tuple)
    line = json.loads(path.read_text().splitlines()[0])
    assert line["type"] == "CheckpointPlanEvent" and line["options"] == list(plan.choice)
    # the relay's wire: appended last, so the four older types keep their codes
    assert T.ROW_TYPES[:4] == (T.ChunkEvent, T.StageSpan, T.MemorySample, T.StepMetrics)
    row = T.to_row(e)
    assert row[0] == 4 and T.from_row(json.loads(json.dumps(row))) == e
    # through the rank side's coalescing and the kernel's decoding, between other events
    older = dataclasses.replace(e, time=e.time - 1.0, budget=e.budget + 1)
    batch = [T.StepMetrics(0, 1, 2.0, 64, 0.1), older, T.MemorySample(0, 2.0, "cpu", 10, 100), e]
    got = R.decode(R.encode(R.coalesced_rows(batch, {}), len(batch)))
    assert [x for x in got if isinstance(x, CheckpointPlanEvent)] == [older, e]
    view = CheckpointPlanView.from_events(got, live=False)
    assert view.latest() == {(0, 0): e}  # the latest plan of a rank wins, in either order
    view.update([older])
    assert view.latest() == {(0, 0): e}


def _bars(fig, yaxis="y"):
    """{option: (block positions, heights)} of the option bars on one row."""
    return {t.name: (list(t.x), list(t.y)) for t in fig.data if t.type == "bar" and t.yaxis == yaxis}


def _line(fig, name, yaxis="y"):
    ys = [t.y for t in fig.data if t.type == "scatter" and t.name == name and t.yaxis == yaxis]
    return ys[0][0] if ys else None


def test_view_draws_options_keep_budget_and_measured_peak(planned, tmp_path):
    model, _, plan, _ = planned
    path = tmp_path / "plan.jsonl"
    with T.record(path):
        apply(model, plan)
    model.enable_activation_checkpointing([])
    (e,) = T.read_trace(path)
    view = CheckpointPlanView.from_trace(path, live=False)
    assert view.blocks(0, 0) == list(zip(e.names, e.options, e.keep))
    fig = view.figure
    unit = fig.layout.yaxis.title.text
    div = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]
    bars = _bars(fig)
    assert set(bars) == set(plan.choice)
    for opt, (xs, ys) in bars.items():
        us = [u for u, o in enumerate(plan.choice) if o == opt]
        assert xs == us and ys == pytest.approx([e.keep[u] / div for u in us])
    assert list(fig.layout.xaxis.ticktext) == list(e.names)
    assert _line(fig, "budget") == pytest.approx(plan.budget / div)
    assert _line(fig, "predicted peak") == pytest.approx(plan.predicted_peak / div)
    assert _line(fig, "no checkpointing") == pytest.approx(plan.peak_none / div)
    assert _line(fig, "measured peak") is None  # nothing measured yet
    kept = [t for t in fig.data if t.name == "kept so far"][0]
    assert kept.y[-1] == pytest.approx((e.prefix_keep + sum(e.keep)) / div)
    assert f"{len(plan.layers)}/{N_LAYER} blocks recompute" in fig.layout.annotations[0].text
    # a measured peak of the plan's tier on this rank is laid on; another rank's or tier's is not
    assert plan_tier(e) == "cpu"
    view.update([T.MemorySample(0, 1.0, "cpu", 1, 1 << 40, peak=plan.peak_none + 1000),
                 T.MemorySample(1, 1.0, "cpu", 1, 1 << 40, peak=7 * plan.peak_none),
                 T.MemorySample(0, 1.0, "nvme", 1, 1 << 40, peak=3)])
    assert _line(view.figure, "measured peak") == pytest.approx((plan.peak_none + 1000) / div)
    # a second rank: a row of its own; its peak far off the plan's scale is written, not drawn
    other = dataclasses.replace(e, rank=1, budget=e.budget + 4096)
    view.update([other])
    fig = view.figure
    assert view.plans.keys() == [(0, 0), (1, 0)] and fig.layout.yaxis2.domain[1] <= fig.layout.yaxis.domain[0]
    assert _bars(fig, "y2") == _bars(fig, "y")
    assert _line(fig, "budget", "y2") == pytest.approx((e.budget + 4096) / div)
    assert _line(fig, "measured peak", "y2") is None and "off this scale" in fig.layout.annotations[1].text
    assert "rank 1 stage 0" in view.summary() and "measured cpu peak" in view.summary()


def test_dashboard_shows_the_view_only_once_a_plan_arrives(planned):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    model, _, plan, _ = planned
    d = Dashboard(live=True, subscribe=False)
    try:
        n = len(d.widget().children)
        d.update([T.MemorySample(0, 1.0, "cpu", 1, 1 << 30, peak=plan.budget), T.StepMetrics(0, 1, 2.0, 64, 0.1)])
        assert "checkpoint_plan" not in d.views and "CheckpointPlan" not in d.summary()
        assert d.checkpoint_plan.redraws == 1  # samples alone draw nothing (its first, empty picture only)
        with Caught() as caught:
            apply(model, plan)
        model.enable_activation_checkpointing([])
        (e,) = caught.plans()
        d.feed(e)
        d.flush()
        assert d.views["checkpoint_plan"] is d.checkpoint_plan and d.checkpoint_plan.latest() == {(0, 0): e}
        assert len(d.widget().children) == n + 1 and d.widget().children[-1] is d.checkpoint_plan.widget()
        # the sample that came before the plan is on it
        assert _line(d.figures["checkpoint_plan"], "measured peak") is not None
        assert "CheckpointPlanView: rank 0 stage 0" in d.summary()
    finally:
        d.close()


def test_gpt_auto_emits_its_plan_to_a_live_dashboard(planned):
    _, idx, plan, _ = planned
    torch.manual_seed(0)
    auto = GPT(GPTConfig.preset("tiny", n_layer=N_LAYER, activation_checkpointing="auto",
                                activation_budget=plan.budget))
    d = Dashboard(live=False, max_hz=20)
    try:
        with Caught() as caught:
            _, loss = auto(idx, idx)
            loss.backward()
        made = auto.checkpoint_plan
        got = caught.plans()
        assert made is not None and got and all(_fields(e) == _want(made) for e in got)
        assert got[-1].budget == plan.budget and got[-1].options == made.choice
        with Caught() as caught:
            auto(idx, idx)[1].backward()  # the same shape: the plan is reused, nothing new to report
        assert caught.plans() == []
        deadline = time.time() + 10
        while time.time() < deadline and "checkpoint_plan" not in d.views:
            time.sleep(0.02)
        assert d.checkpoint_plan.latest() == {(0, 0): got[-1]} and not d._throttle.errors
    finally:
        d.close()
