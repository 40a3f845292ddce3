"""Telemetry: bus fan-out, JSONL round trip, torn last line, validation."""

import json

import pytest

from colossal_lab.engine import telemetry as t


def sample_events():
    return [
        t.ChunkEvent(rank=0, step=1, chunk_id=3, tier="nvme", state="hold", nbytes=1024, params=("a.w", "b.w")),
        t.StageSpan(rank=1, stage=1, step=2, microbatch=0, kind="F", start=1.5, end=2.0),
        t.MemorySample(rank=0, time=3.0, tier="cpu", used=10, capacity=100),
        t.StepMetrics(rank=0, step=1, loss=2.5, tokens=128, seconds=0.25),
        t.StepMetrics(rank=1, step=1, loss=None, tokens=128, seconds=0.25),
    ]


def test_subscribe_and_unsubscribe():
    seen = []
    unsub = t.subscribe(seen.append)
    e = sample_events()[0]
    t.emit(e)
    unsub()
    t.emit(e)
    assert seen == [e]


def test_broken_subscriber_does_not_break_emit():
    seen = []

    def bad(_):
        raise RuntimeError("boom")

    u1, u2 = t.subscribe(bad), t.subscribe(seen.append)
    with pytest.warns(UserWarning, match="boom"):
        t.emit(sample_events()[1])
    u1(), u2()
    assert len(seen) == 1


def test_record_and_read_back(tmp_path):
    path = tmp_path / "trace.jsonl"
    with t.record(path):
        for e in sample_events():
            t.emit(e)
    t.emit(sample_events()[0])  # after the block: not recorded
    assert t.read_trace(path) == sample_events()


def test_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "trace.jsonl"
    t.write_trace(path, sample_events())
    with open(path, "a") as f:
        f.write('{"type":"StageSpan","rank":0,')
    assert t.read_trace(path) == sample_events()


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [json.dumps(t.to_dict(e)) for e in sample_events()]
    lines.insert(1, "not json")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        t.read_trace(path)


def test_validation():
    with pytest.raises(ValueError, match="tier"):
        t.ChunkEvent(rank=0, step=0, chunk_id=0, tier="gpu", state="hold", nbytes=0)
    with pytest.raises(ValueError, match="kind"):
        t.StageSpan(rank=0, stage=0, step=0, microbatch=0, kind="X", start=0, end=1)
    with pytest.raises(ValueError, match="unknown telemetry event type"):
        t.from_dict({"type": "Nope"})


def test_bubble_fractions_two_stage_gpipe_shape():
    # stage 0: F0 [0,1], F1 [1,2], B1 [4,5], B0 [5,6]; stage 1: F0 [1,2] F1 [2,3] B1 [3,4] B0 [4,5]
    S = t.StageSpan
    spans = [S(0, 0, 1, 0, "F", 0, 1), S(0, 0, 1, 1, "F", 1, 2), S(0, 0, 1, 1, "B", 4, 5), S(0, 0, 1, 0, "B", 5, 6),
             S(1, 1, 1, 0, "F", 1, 2), S(1, 1, 1, 1, "F", 2, 3), S(1, 1, 1, 1, "B", 3, 4), S(1, 1, 1, 0, "B", 4, 5),
             S(1, 1, 1, 0, "recv", 0, 1)]
    spans_dup = spans + spans[:3]  # duplicates change nothing
    fr = t.bubble_fractions(spans_dup)
    assert fr == {1: {0: pytest.approx(2 / 6), 1: pytest.approx(2 / 6)}}


def test_comm_spans_round_trip_and_are_not_busy_time(tmp_path):
    """``comm`` (a collective inside a layer) is a span kind: it survives a trace and the relay's
    rows, and, like send/recv, counts as communication, not busy time, in a bubble."""
    S = t.StageSpan
    spans = [S(0, 0, 1, 0, "F", 0.0, 1.0), S(0, 0, 1, -1, "comm", 1.0, 2.0)]
    t.write_trace(tmp_path / "c.jsonl", spans)
    assert t.read_trace(tmp_path / "c.jsonl") == spans
    assert [t.from_row(t.to_row(s)) for s in spans] == spans
    assert t.bubble_fractions(spans) == {1: {0: pytest.approx(0.5)}}


def test_chrome_trace_has_one_complete_event_per_span():
    S = t.StageSpan
    spans = [S(0, 0, 1, 0, "F", 0.0, 0.5), S(1, 1, 1, -1, "optim", 1.0, 1.25)]
    tr = t.to_chrome_trace(spans + spans)
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"]) for e in xs] == [("F0", 0.0, 500000.0), ("optim", 1e6, 250000.0)]
