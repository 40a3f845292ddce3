"""The widgets' state (widgets/state.py): what the views fold events into.

ChunkState with events the relay coalesced (``ChunkEvent.moves`` = the chunk's tier changes
at that step so far): moves still recorded, counted, ordered within a step; engine events
(``moves`` 0) keep their old semantics. ChunkState's index of moves by step and TimelineState's
index of spans by step agree with a scan of what they keep."""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("plotly")

import random

from support.widgets import pipeline_spans

from colossal_lab.engine import telemetry as T
from colossal_lab.widgets.state import ChunkState, Move


def C(step, tier, moves=0, chunk=0, rank=0, state="hold"):
    return T.ChunkEvent(rank, step, chunk, tier, state, 64, ("w",), moves=moves)


def test_a_coalesced_event_records_its_moves_even_when_the_tier_came_back():
    st = ChunkState()
    st.apply(C(3, "cpu"))
    # the chunk went cpu -> nvme -> cpu -> nvme -> cpu at step 4: one event, same tier as held
    assert st.apply(C(4, "cpu", moves=4))
    assert st.moved_at(4) == {(0, 0)} and st.move_count(4) == 4 and st.move_count() == 4
    assert list(st.moves) == [Move(0, 0, 4, "cpu", "cpu", 4)]
    # later in the same step: only the increase is new
    assert st.apply(C(4, "nvme", moves=5))
    assert st.move_count(4) == 5 and st.chunks[(0, 0)].tier == "nvme"
    # an engine event (moves 0) after that: compared by tier as always
    assert st.apply(C(5, "cpu"))
    assert st.move_count(5) == 1 and list(st.moves)[-1] == Move(0, 0, 5, "nvme", "cpu")


def test_within_a_step_a_smaller_count_is_stale_and_an_equal_one_is_a_duplicate():
    st = ChunkState()
    assert st.apply(C(7, "nvme", moves=6, state="free"))
    assert not st.apply(C(7, "cpu", moves=3))             # older row of the same step
    assert not st.apply(C(7, "nvme", moves=6, state="free"))  # replayed
    assert not st.apply(C(6, "cuda", moves=9))            # older step
    assert st.chunks[(0, 0)] == C(7, "nvme", moves=6, state="free")
    assert st.move_count() == 6
    # same count, other state (no tier change since): the later arrival wins, no new move
    assert st.apply(C(7, "nvme", moves=6, state="hold"))
    assert st.move_count() == 6 and st.chunks[(0, 0)].state == "hold"


def test_a_view_opened_mid_step_counts_the_moves_it_is_told_about():
    st = ChunkState()
    assert st.apply(C(2, "cuda", moves=3, chunk=5, rank=1))
    assert st.moved_at(2) == {(1, 5)} and list(st.moves) == [Move(1, 5, 2, "", "cuda", 3)]


def test_engine_events_without_counts_fold_as_before():
    st = ChunkState()
    for e in [C(1, "cpu"), C(1, "nvme"), C(1, "cpu"), C(1, "cpu"), C(0, "cuda")]:
        st.apply(e)
    assert [(m.src, m.dst, m.count) for m in st.moves] == [("cpu", "nvme", 1), ("nvme", "cpu", 1)]
    assert st.chunks[(0, 0)].tier == "cpu"


# ---------------------------------------------------------------- indexes by step
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

    spans = [s for step in range(10) for s in pipeline_spans(step=step, t0=10.0 * step)]
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
