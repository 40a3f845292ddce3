"""PipelineTimeline with data/tensor parallelism: a row and a bubble per rank, not per stage.

Ranks that share a pipeline stage (dp or tp > 1) each stand idle on their own; one merged row
per stage would take the union of their busy time and call two half-idle ranks fully busy.
The pure tests use hand-made spans with known answers; the end-to-end test runs a real
dp2 × tp2 × pp2 job on 8 gloo processes and checks the rows and bubbles its spans give against
what each rank's own pipeline runtime computed. The figure's bars, comm spans, step selector and
Chrome trace export come from hand-made spans of two stages.
"""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("plotly")

import dataclasses
import json
import random

import torch
from support.dist import run_distributed
from support.engine import lm_loss
from support.widgets import pipeline_spans, trace_by_name

from colossal_lab.engine import telemetry as T
from colossal_lab.widgets import PipelineTimeline

STEP = 7
T0 = 1000.0


def _spans():
    """Two stages × two dp replicas, rank numbers deliberately not in row order.

    Window [T0, T0 + 1]. Stage 0: rank 2 (dp 0) computes the first half and waits in a recv for
    the second, rank 0 (dp 1) the other way round: each is idle half the window, while the union
    of their compute covers all of it. Stage 1: rank 1 (dp 0) busy throughout, rank 3 (dp 1)
    busy 0.625 of it (B then W, then nothing).
    """
    S = lambda rank, stage, dp, mb, kind, a, b: dataclasses.replace(  # noqa: E731
        _span(rank, stage, mb, kind, a, b), dp=dp)
    return [
        S(2, 0, 0, 0, "F", 0.0, 0.5), S(2, 0, 0, 1, "recv", 0.5, 1.0),
        S(0, 0, 1, 1, "recv", 0.0, 0.5), S(0, 0, 1, 0, "F", 0.5, 1.0),
        S(1, 1, 0, 0, "F", 0.0, 0.5), S(1, 1, 0, 0, "B", 0.5, 1.0),
        S(3, 1, 1, 0, "B", 0.0, 0.25), S(3, 1, 1, 0, "W", 0.25, 0.625),
    ]


def _span(rank, stage, mb, kind, a, b, step=STEP):
    from colossal_lab.engine.telemetry import StageSpan

    return StageSpan(rank=rank, stage=stage, step=step, microbatch=mb, kind=kind, start=T0 + a, end=T0 + b)


RANK_BUBBLES = {0: 0.5, 1: 0.0, 2: 0.5, 3: 1 - 0.625}
ROWS = ["stage 0 · dp 0 · tp 0 · rank 2 · bubble 50%", "stage 0 · dp 1 · tp 0 · rank 0 · bubble 50%",
        "stage 1 · dp 0 · tp 0 · rank 1 · bubble 0%", "stage 1 · dp 1 · tp 0 · rank 3 · bubble 38%"]


def _rows_top_down(fig_dict):
    return list(fig_dict["layout"]["yaxis"]["categoryarray"])[::-1]


def test_two_ranks_of_one_stage_each_idle_half_the_window_have_bubble_half():
    from colossal_lab.engine import telemetry as T
    from colossal_lab.widgets import PipelineTimeline

    spans = _spans()
    assert T.bubble_fractions_by_rank(spans) == {STEP: RANK_BUBBLES}
    # a stage's bubble is the mean over its ranks
    assert T.bubble_fractions(spans) == {STEP: {0: 0.5, 1: (0.0 + 0.375) / 2}}
    # the per-stage union (spans merged onto one row per stage) says stage 0 never idles:
    # that is the answer this fix replaces, and the one the assertions above reject
    merged = [dataclasses.replace(s, rank=s.stage, dp=0) for s in spans]
    assert T.bubble_fractions_by_rank(merged)[STEP][0] == 0.0

    tl = PipelineTimeline.from_events(spans)
    fig = tl.figure_dict()
    assert _rows_top_down(fig) == ROWS
    assert tl.rank_bubbles() == RANK_BUBBLES and tl.bubbles() == {0: 0.5, 1: 0.1875}
    # every bar sits on its own rank's row
    for trace in fig["data"]:
        for y, cd in zip(trace["y"], trace["customdata"]):
            assert f"· rank {cd[6]} ·" in y and y.startswith(f"stage {cd[0]} · dp {cd[4]} · tp {cd[5]}")
    assert sum(len(t["y"]) for t in fig["data"]) == len(spans)
    title = fig["layout"]["title"]["text"]
    assert "2 stage(s) × 4 rank(s)" in title and "mean bubble 34%" in title  # (0.5+0.5+0+0.375)/4
    # the stage groups: one separator between them, each group noting its stage's mean bubble
    assert [a["text"] for a in fig["layout"]["annotations"]] == ["stage 0 · bubble 50%", "stage 1 · bubble 19%"]
    assert len(fig["layout"]["shapes"]) == 1 and fig["layout"]["shapes"][0]["y0"] == 1.5
    assert "stage 0: 50% (mean of 2 ranks)" in tl.summary()

    # duplicates and arrival order change nothing
    shuffled = spans + spans[:3]
    random.Random(0).shuffle(shuffled)
    again = PipelineTimeline.from_events(shuffled)
    assert _rows_top_down(again.figure_dict()) == ROWS and again.rank_bubbles() == RANK_BUBBLES


def test_one_rank_per_stage_keeps_plain_rows_and_the_old_numbers():
    """With one rank per stage a stage's bubble is its rank's, and no group marks are drawn."""
    from colossal_lab.engine import telemetry as T
    from colossal_lab.widgets import PipelineTimeline

    spans = [_span(0, 0, 0, "F", 0.0, 0.25), _span(1, 1, 0, "recv", 0.0, 0.25), _span(1, 1, 0, "F", 0.25, 1.0)]
    assert T.bubble_fractions(spans) == {STEP: {0: 0.75, 1: 0.25}}
    assert T.bubble_fractions_by_rank(spans) == {STEP: {0: 0.75, 1: 0.25}}
    fig = PipelineTimeline.from_events(spans).figure_dict()
    assert _rows_top_down(fig) == ["stage 0 · dp 0 · tp 0 · rank 0 · bubble 75%",
                                   "stage 1 · dp 0 · tp 0 · rank 1 · bubble 25%"]
    assert fig["layout"]["shapes"] == [] and fig["layout"]["annotations"] == []


def test_chrome_trace_names_and_orders_a_process_per_rank(tmp_path):
    from colossal_lab.widgets import PipelineTimeline

    tl = PipelineTimeline.from_events(_spans())
    trace = json.loads(open(tl.export_chrome_trace(tmp_path / "t.json")).read())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    order = {e["pid"]: e["args"]["sort_index"] for e in trace if e["name"] == "process_sort_index"}
    assert names == {2: "stage 0 · dp 0 · tp 0 · rank 2", 0: "stage 0 · dp 1 · tp 0 · rank 0",
                     1: "stage 1 · dp 0 · tp 0 · rank 1", 3: "stage 1 · dp 1 · tp 0 · rank 3"}
    assert sorted(order, key=order.get) == [2, 0, 1, 3]
    xs = [e for e in trace if e["ph"] == "X"]
    assert len(xs) == 8 and {(e["pid"], e["args"]["dp"]) for e in xs} == {(2, 0), (0, 1), (1, 0), (3, 1)}


def test_bad_spans_are_clear_errors():
    from colossal_lab.engine import telemetry as T

    # one rank cannot hold two places in one step (spans of two runs mixed into one trace)
    mixed = [_span(0, 0, 0, "F", 0.0, 1.0), _span(0, 1, 0, "F", 1.0, 2.0)]
    with pytest.raises(ValueError, match=r"rank 0 reports more than one place in step 7 .*stage 0 .*stage 1"):
        T.bubble_fractions_by_rank(mixed)
    with pytest.raises(TypeError, match="expected StageSpan events, got StepMetrics"):
        T.bubble_fractions([T.StepMetrics(0, 1, None, 0, 0.1)])


def test_span_recorder_stamps_coordinates_and_emits_the_last_forward_once_stretched():
    from colossal_lab.engine import telemetry as T
    from colossal_lab.engine.pipeline import SpanRecorder

    with pytest.raises(ValueError, match=r"SpanRecorder\(dp=-1\)"):
        SpanRecorder(rank=0, stage=0, dp=-1)
    rec = SpanRecorder(rank=5, stage=1, dp=1, tp=1)
    seen = []
    unsub = T.subscribe(seen.append)
    try:
        rec.add("F", 0, 1.0, 2.0, hold=True)  # the last stage's F: its loss comes next
        assert seen == []
        rec.extend_last_forward(2.5)
        assert seen == [T.StageSpan(5, 1, 0, 0, "F", 1.0, 2.5, dp=1, tp=1)]
        rec.add("F", 1, 3.0, 4.0, hold=True)
        rec.add("B", 1, 4.0, 5.0)  # the next span flushes a held F whose loss never came
        assert [s.kind for s in seen] == ["F", "F", "B"] and seen[1].end == 4.0
    finally:
        unsub()
    assert seen == rec.spans


# ---------------------------------------------------------------- bars, steps and export
def test_timeline_bars_and_bubbles():
    spans = pipeline_spans()
    tl = PipelineTimeline.from_events(spans)
    f = trace_by_name(tl.figure, "F")
    assert len(f.x) == 4
    # bars start at ms since the step's first span, length = measured duration
    bars = sorted(zip(f.y, f.base, f.x))
    assert bars[0][0].startswith("stage 0 · dp 0 · tp 0 · rank 0")
    assert bars[0][1] == pytest.approx(0.0, abs=1e-6) and bars[0][2] == pytest.approx(100.0)
    assert sorted(trace_by_name(tl.figure, "B").text) == ["0", "0", "1", "1"]
    assert trace_by_name(tl.figure, "optim").text == ("", "")
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
    spans = pipeline_spans() + [T.StageSpan(0, 0, 3, -1, "comm", 100.02, 100.05)]
    tl = PipelineTimeline.from_events(spans)
    comm = trace_by_name(tl.figure, "comm")
    assert len(comm.x) == 1 and comm.x[0] == pytest.approx(30.0) and comm.base[0] == pytest.approx(20.0)
    assert comm.marker.color != trace_by_name(tl.figure, "F").marker.color
    assert tl.bubbles() == T.bubble_fractions(spans)[3]


def test_timeline_step_selector_and_chrome_export(tmp_path):
    tl = PipelineTimeline.from_events(pipeline_spans(step=1, t0=0.0) + pipeline_spans(step=2, t0=5.0, mb=3))
    assert "step 2" in tl.figure.layout.title.text
    assert len(trace_by_name(tl.figure, "F").x) == 6
    tl.select_step(1)
    assert "step 1" in tl.figure.layout.title.text and len(trace_by_name(tl.figure, "F").x) == 4
    with pytest.raises(ValueError, match="select_step"):
        tl.select_step(99)
    path = tl.export_chrome_trace(tmp_path / "t.json")
    trace = json.loads(open(path).read())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(tl.timeline.spans) == 14 + 20
    assert {e["name"] for e in xs} >= {"F0", "B2", "optim", "send1"}
    with pytest.raises(FileNotFoundError, match="export_chrome_trace"):
        tl.export_chrome_trace(tmp_path / "nope" / "t.json")



# ---------------------------------------------------------------- a real 3-D job on 8 ranks
def _train_3d(rank, world):
    """Two steps of a tiny GPT under dp2 × tp2 × pp2; what the parent checks, per rank."""
    from colossal_lab.engine import Booster, telemetry
    from colossal_lab.engine.models import GPT, GPTConfig
    from colossal_lab.engine.plugins import HybridParallelPlugin

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_layer=2, n_embd=32, n_head=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin = HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2)
    booster = Booster(plugin=plugin)
    emitted = []
    unsub = telemetry.subscribe(emitted.append)
    model, opt, *_ = booster.boost(model, opt, lm_loss)
    x = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(1 + plugin.dp_rank))
    runtime_bubbles = []
    for _ in range(2):
        out = booster.execute_pipeline(iter([{"idx": x, "targets": torch.roll(x, -1, 1)}]), model, lm_loss, opt)
        opt.step()
        opt.zero_grad()
        runtime_bubbles.append({"rank": out["rank_bubble"], "stage": out["bubble"]})
    unsub()
    return {"place": (plugin.mesh["pp"].get_local_rank(), plugin.dp_rank, plugin.mesh["tp"].get_local_rank()),
            "emitted": [e for e in emitted if isinstance(e, telemetry.StageSpan)],
            "recorded": list(model.runtime.recorder.spans), "bubbles": runtime_bubbles}


def test_dp2_tp2_pp2_job_gives_a_row_per_rank_with_the_runtime_bubble():
    from colossal_lab.engine import telemetry as T
    from colossal_lab.widgets import PipelineTimeline

    results = run_distributed(_train_3d, 8, timeout=240)
    places = {r: res["place"] for r, res in enumerate(results)}  # (stage, dp, tp) from the mesh
    assert sorted(places.values()) == [(s, d, t) for s in (0, 1) for d in (0, 1) for t in (0, 1)]
    spans = []
    for r, res in enumerate(results):
        # listeners saw exactly what the recorder keeps (the last stage's F with its loss),
        # each span stamped with its rank's place in the mesh
        assert set(res["emitted"]) == set(res["recorded"]) and len(res["emitted"]) == len(res["recorded"])
        assert {(s.rank, s.stage, s.dp, s.tp) for s in res["emitted"]} == {(r, *places[r])}
        spans += res["emitted"]

    tl = PipelineTimeline.from_events(spans)
    assert tl.timeline.steps == [0, 1]
    in_row_order = sorted(places, key=lambda r: (places[r], r))
    for step in (0, 1):
        # each rank's runtime computed every rank's bubble over the schedule (before optim):
        # the same numbers the spans give, and the same on every rank
        schedule = [s for s in spans if s.step == step and s.kind != "optim"]
        want = T.bubble_fractions_by_rank(schedule)[step]
        assert sorted(want) == list(range(8))
        for r, res in enumerate(results):
            got = res["bubbles"][step]
            assert got["rank"] == want, f"rank {r} step {step}: runtime {got['rank']} vs spans {want}"
            for stage in (0, 1):
                mine = [want[q] for q in sorted(want) if places[q][0] == stage]
                assert len(mine) == 4 and got["stage"][stage] == pytest.approx(sum(mine) / 4, abs=1e-12)
        # the widget: 8 rows in (stage, dp, tp) order, each with its rank's bubble (optim counts)
        tl.select_step(step)
        fig = tl.figure_dict()
        shown = T.bubble_fractions_by_rank([s for s in spans if s.step == step])[step]
        assert tl.rank_bubbles() == shown and all(0.0 < b < 1.0 for b in shown.values())
        rows = _rows_top_down(fig)
        assert rows == [f"stage {places[r][0]} · dp {places[r][1]} · tp {places[r][2]} · rank {r} · "
                        f"bubble {shown[r]:.0%}" for r in in_row_order]
        mean = sum(shown.values()) / 8
        assert f"2 stage(s) × 8 rank(s) · mean bubble {mean:.0%}" in fig["layout"]["title"]["text"]
        for trace in fig["data"]:
            for y, cd in zip(trace["y"], trace["customdata"]):
                assert y == rows[in_row_order.index(cd[6])]
        stage_mean = {st: sum(shown[r] for r in places if places[r][0] == st) / 4 for st in (0, 1)}
        assert tl.bubbles() == pytest.approx(stage_mean, abs=1e-12)
        assert [a["text"] for a in fig["layout"]["annotations"]] == \
            [f"stage {st} · bubble {stage_mean[st]:.0%}" for st in (0, 1)]
