"""ChunkState with events the relay coalesced (``ChunkEvent.moves`` = the chunk's tier changes
at that step so far): moves still recorded, counted, ordered within a step; engine events
(``moves`` 0) keep their old semantics."""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("plotly")

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
