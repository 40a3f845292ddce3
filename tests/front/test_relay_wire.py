"""The relay's wire, without processes: compact rows, the rank-side coalescing, and that a
coalesced stream folds to the same picture as the full one (what the widgets draw)."""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("zmq")
pytest.importorskip("plotly")

import random

import pytest

from colossal_lab import relay as R
from colossal_lab.engine import telemetry as T
from colossal_lab.widgets.state import ChunkState, MemoryState, MetricsState, TimelineState, reduce_all


def _gemini_like(ranks=(0, 1), chunks=5, steps=6, seed=0):
    """What Gemini emits with NVMe offload: each chunk bounces cpu <-> nvme (sometimes via
    cuda) several times per step, a snapshot per chunk after each step, a MemorySample per
    tier and a StepMetrics per step, interleaved like the engine interleaves them."""
    rng = random.Random(seed)
    out = []
    where = {(r, c): "cpu" for r in ranks for c in range(chunks)}
    for step in range(steps):
        for _ in range(chunks * 8):
            r, c = rng.choice(ranks), rng.randrange(chunks)
            tier = rng.choice([t for t in T.TIERS if t != where[(r, c)]])
            where[(r, c)] = tier
            out.append(T.ChunkEvent(r, step, c, tier, "hold" if tier != "nvme" else "free", 1024 * (c + 1),
                                    (f"layer{c}.w", f"layer{c}.b")))
            if rng.random() < 0.1:
                out.append(T.StageSpan(r, r, step, rng.randrange(4), "F", step + rng.random(), step + 1.5))
        for r in ranks:
            for c in range(chunks):  # the end-of-step snapshot: same tier, next step
                out.append(T.ChunkEvent(r, step + 1, c, where[(r, c)], "hold", 1024 * (c + 1),
                                        (f"layer{c}.w", f"layer{c}.b")))
            for k, tier in enumerate(("cpu", "nvme")):
                out.append(T.MemorySample(r, step + 0.5 + k * 0.01, tier, 100 * step + k, 10_000))
            out.append(T.StepMetrics(r, step, 2.0 - step * 0.1 if r == 1 else None, 512, 0.2))
    return out


def _through_the_wire(events, batch_sizes, coalesce=True):
    """Cut ``events`` into batches as a rank's sender would, encode and decode each."""
    last_tier, out, i, k = {}, [], 0, 0
    while i < len(events):
        n = batch_sizes[k % len(batch_sizes)]
        batch, i, k = events[i:i + n], i + n, k + 1
        rows = R.coalesced_rows(batch, last_tier) if coalesce else [T.to_row(e) for e in batch]
        frames = R.encode(rows, len(batch))
        assert R.decode_header(frames) == len(batch)
        out.extend(R.decode(frames))
    return out


def _picture(events):
    cs, ms, met, tl = ChunkState(), MemoryState(), MetricsState(), TimelineState()
    reduce_all(events, chunk=cs, memory=ms, metrics=met, timeline=tl)
    steps = range(-1, 10)
    return {
        "placement": {k: (e.step, e.tier, e.state, e.nbytes, e.params) for k, e in cs.chunks.items()},
        "moved_at": {s: cs.moved_at(s) for s in steps},
        "move_count": {s: cs.move_count(s) for s in steps},
        "memory": dict(ms.samples),
        "metrics": dict(met.steps),
        "spans": set(tl.spans),
    }


def test_rows_round_trip_every_event_type():
    events = [T.ChunkEvent(0, 1, 3, "nvme", "hold", 1024, ("a.w", "b.w")),
              T.ChunkEvent(1, 2, 0, "cuda", "compute", 8, (), moves=3),
              T.StageSpan(1, 1, 2, 0, "F", 1.5, 2.0),
              T.MemorySample(0, 3.0, "cpu", 10, 100),
              T.StepMetrics(0, 1, 2.5, 128, 0.25), T.StepMetrics(1, 1, None, 128, 0.25)]
    assert [T.from_row(T.to_row(e)) for e in events] == events
    assert R.decode(R.encode([T.to_row(e) for e in events], 6)) == events
    # rows carry no key names: the JSON is far smaller than to_dict's
    frames = R.encode([T.to_row(e) for e in events], 6)
    assert b"chunk_id" not in frames[1] and b"ChunkEvent" not in frames[1]
    with pytest.raises(TypeError, match="to_row"):
        T.to_row({"type": "ChunkEvent"})
    with pytest.raises(ValueError, match="type code"):
        T.from_row([9, 1, 2])


def test_to_dict_leaves_out_moves_when_zero_and_keeps_it_otherwise():
    plain = T.ChunkEvent(0, 1, 3, "nvme", "hold", 1024, ("a.w",))
    assert "moves" not in T.to_dict(plain)  # JSONL traces of engine events read as before
    folded = T.ChunkEvent(0, 1, 3, "nvme", "hold", 1024, ("a.w",), moves=4)
    assert T.to_dict(folded)["moves"] == 4
    assert T.from_dict(T.to_dict(folded)) == folded and T.from_dict(T.to_dict(plain)) == plain
    with pytest.raises(ValueError, match="moves"):
        T.ChunkEvent(0, 1, 3, "nvme", "hold", 1024, (), moves=-1)


def test_wire_rejects_other_versions_and_frames():
    frames = R.encode([], 0)
    with pytest.raises(ValueError, match="wire version"):
        R.decode_header([b"1 5", frames[1]])
    with pytest.raises(ValueError, match="frames"):
        R.decode_header([frames[1]])


def test_coalescing_folds_one_chunk_one_step_to_the_latest_with_its_move_count():
    ev = [T.ChunkEvent(0, 4, 2, "cpu", "hold", 8, ("w",)),
          T.ChunkEvent(0, 4, 2, "nvme", "free", 8, ("w",)),
          T.StepMetrics(0, 3, 1.0, 10, 0.1),
          T.ChunkEvent(0, 4, 2, "cpu", "hold", 8, ("w",)),
          T.ChunkEvent(0, 4, 2, "cuda", "compute", 8, ("w",)),
          T.ChunkEvent(0, 5, 2, "cuda", "hold", 8, ("w",)),   # next step: its own row, no move
          T.MemorySample(0, 1.0, "cpu", 1, 9), T.MemorySample(0, 2.0, "cpu", 2, 9),
          T.MemorySample(0, 1.5, "cpu", 3, 9)]                 # older sample: the 2.0 one stays
    last = {(0, 2): (3, "nvme", 7)}  # this rank's last event of chunk 2: step 3, on nvme
    got = R.decode(R.encode(R.coalesced_rows(ev, last), len(ev)))
    assert got == [T.ChunkEvent(0, 4, 2, "cuda", "compute", 8, ("w",), moves=4),  # nvme>cpu>nvme>cpu>cuda
                   T.StepMetrics(0, 3, 1.0, 10, 0.1),
                   T.ChunkEvent(0, 5, 2, "cuda", "hold", 8, ("w",)),
                   T.MemorySample(0, 2.0, "cpu", 2, 9)]
    assert last == {(0, 2): (5, "cuda", 0)}
    # the count runs on across batches within a step
    last = {(0, 2): (4, "nvme", 7)}
    assert R.decode(R.encode(R.coalesced_rows(ev[:2], last), 2)) == \
        [T.ChunkEvent(0, 4, 2, "nvme", "free", 8, ("w",), moves=9)]


@pytest.mark.parametrize("batch_sizes", [[1], [7], [60], [13, 2, 41], [100_000]])
def test_a_coalesced_stream_draws_what_the_full_stream_draws(batch_sizes):
    events = _gemini_like()
    wire = _through_the_wire(events, batch_sizes)
    if min(batch_sizes) >= 60:  # a batch spans ~a step here: most events fold
        assert len(wire) < len(events) / 2, (len(wire), len(events))
    full, folded = _picture(events), _picture(wire)
    assert full["move_count"][3] > 20  # the stream does move chunks a lot
    for k in full:
        assert folded[k] == full[k], k


def test_coalesced_stream_with_duplicates_and_reordered_steps_draws_the_same():
    # what a lossy, replayed relay can deliver: every message twice, and messages of whole
    # steps out of order. Exact duplicates must change nothing; a message from an older step
    # arriving after a newer one must not move a chunk back.
    events = _gemini_like(steps=5, seed=1)
    wire = _through_the_wire(events, [25])
    in_order = _picture(wire)
    by_step = {}
    for e in wire:
        by_step.setdefault(getattr(e, "step", -1), []).append(e)
    dup = [e for s in sorted(by_step) for e in by_step[s] + by_step[s]]
    assert _picture(dup) == in_order
    # newest placement wins whatever the arrival order of the steps
    late = [e for s in sorted(by_step, reverse=True) for e in by_step[s]]
    cs = ChunkState()
    reduce_all(late, chunk=cs)
    assert {k: (e.step, e.tier) for k, e in cs.chunks.items()} == \
        {k: v[:2] for k, v in in_order["placement"].items()}
    # within a step the running move count orders a chunk's rows: reversed, or with an
    # older row replayed after a newer one, the picture and the move counts are the same
    reversed_in_step = [e for s in sorted(by_step) for e in by_step[s][::-1]]
    assert _picture(reversed_in_step) == in_order
    replayed = [e for s in sorted(by_step) for e in by_step[s] + by_step[s][: len(by_step[s]) // 2]]
    assert _picture(replayed) == in_order


def test_without_coalescing_every_event_arrives_as_emitted():
    events = _gemini_like(steps=2)
    assert _through_the_wire(events, [50], coalesce=False) == events
