"""The relay on a real 2-rank cluster: events emitted on both ranks reach this process's bus
(and a Dashboard subscribed to it) while ``cluster.run`` is still running."""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("zmq")
pytest.importorskip("plotly")
pytest.importorskip("ipyparallel")

import os
import sys
import threading
import time

import pytest
from support.bus import BusSink

from colossal_lab import relay as relay_mod
from colossal_lab.engine import telemetry as T
from colossal_lab.widgets import Dashboard

# these tests count what the relay carries exactly: no memory sampler on the ranks (attach
# starts one by default; tests/front/test_memory_autosample.py covers it)
QUIET = {"memory_interval": None}


def _emit_then_wait(n_events, go, max_s):
    """Emit, then stay in the call until the test creates the file ``go`` (at most ``max_s``)."""
    import os
    import time

    import torch.distributed as dist

    from colossal_lab.engine import telemetry as T

    r = dist.get_rank()
    for i in range(n_events):
        T.emit(T.StepMetrics(rank=r, step=i, loss=float(i + r), tokens=100, seconds=0.01))
    T.emit(T.ChunkEvent(rank=r, step=0, chunk_id=0, tier="cpu" if r == 0 else "nvme",
                        state="hold", nbytes=1024, params=(f"rank{r}.w",)))
    end = time.monotonic() + max_s
    while not os.path.exists(go) and time.monotonic() < end:
        time.sleep(0.02)
    return r


def _flood(n):
    """Emit far more than the send high-water mark with nobody reading: must not block."""
    import time

    from colossal_lab.engine import telemetry as T

    t0 = time.perf_counter()
    for i in range(n):
        T.emit(T.StepMetrics(rank=0, step=i, loss=None, tokens=1, seconds=1.0))
    return time.perf_counter() - t0


def test_events_from_both_ranks_arrive_while_run_is_running(cluster, tmp_path):
    sink = BusSink()
    dash = Dashboard(live=False, max_hz=10)
    relay = relay_mod.attach(cluster, **QUIET)
    try:
        assert relay_mod.attach(cluster, **QUIET) is relay  # idempotent per cluster
        done = threading.Event()
        results = {}
        go = tmp_path / "go"  # the ranks stay in the call until this exists: no race with our checks

        def run():
            results["ranks"] = cluster.run(_emit_then_wait, 20, str(go), 60.0)
            done.set()

        th = threading.Thread(target=run)
        th.start()
        deadline = time.time() + 30
        while time.time() < deadline and not done.is_set():
            got = sink.events()
            ranks = {e.rank for e in got if isinstance(e, T.StepMetrics)}
            if ranks == {0, 1} and len(got) >= 42:
                break
            time.sleep(0.05)
        arrived_before_return = not done.is_set()
        snapshot = sink.events()
        go.touch()
        assert arrived_before_return, "events only arrived after cluster.run returned"
        assert {(e.rank, e.step) for e in snapshot if isinstance(e, T.StepMetrics)} == \
            {(r, i) for r in (0, 1) for i in range(20)}
        # the dashboard subscribed to this process's bus drew both ranks, live
        deadline = time.time() + 5
        while time.time() < deadline and len(dash.chunk_map.chunks.chunks) < 2:
            time.sleep(0.05)
        dash.flush()
        assert dash.chunk_map.chunks.tiers_in_use() == {"cpu", "nvme"}
        assert set(dash.metrics.ranks) == {0, 1}
        th.join(timeout=60)
        assert results["ranks"] == [0, 1]
        stats = relay.rank_stats()
        assert [s["sent"] for s in stats] == [21, 21] and [s["dropped"] for s in stats] == [0, 0]
        assert all(1 <= s["messages"] < s["sent"] for s in stats), stats  # batched, not one send per event
    finally:
        dash.close()
        sink.close()
        relay.detach()
    # after detach, ranks no longer send
    assert cluster.run(relay_mod._stats, relay.address) == [None, None]


def test_a_notebook_that_does_not_read_never_blocks_training(cluster):
    # a relay whose receiver is stopped (like a kernel that is too busy to read): ranks keep
    # emitting at full speed and drop what the bounded queue cannot hold
    relay = relay_mod.attach(cluster, sndhwm=100, rcvhwm=100, **QUIET)
    try:
        relay._stop.set()
        relay._thread.join(timeout=5)
        seconds = cluster.run(_flood, 20_000)
        stats = relay.rank_stats()
        assert all(s["dropped"] > 0 for s in stats), stats
        assert all(s["sent"] + s["dropped"] == 20_000 for s in stats)
        assert max(seconds) < 20  # never waited on the notebook
    finally:
        relay._stop.clear()
        relay.detach()


def test_attach_rejects_bad_input(cluster):
    with pytest.raises(TypeError, match="attach\\(cluster="):
        relay_mod.attach(None)
    with pytest.raises(ValueError, match="sndhwm"):
        relay_mod.attach(cluster, sndhwm=0)


def _emit_chunk_moves(steps, chunks, seed):
    """On a rank: a Gemini-like stream (every chunk changes tier many times per step, a
    snapshot per chunk after each step, two MemorySamples and a StepMetrics per step),
    emitted fast; returns the picture a ChunkState folds from the full stream here."""
    import random

    import torch.distributed as dist

    from colossal_lab.engine import telemetry as T
    from colossal_lab.widgets.state import ChunkState

    r, rng = dist.get_rank(), random.Random(seed + dist.get_rank())
    where = {c: "cpu" for c in range(chunks)}
    full = ChunkState()
    n = 0

    def emit(e):
        nonlocal n
        n += 1
        if isinstance(e, T.ChunkEvent):
            full.apply(e)
        T.emit(e)

    for step in range(steps):
        for _ in range(chunks * 6):
            c = rng.randrange(chunks)
            where[c] = rng.choice([t for t in T.TIERS if t != where[c]])
            emit(T.ChunkEvent(r, step, c, where[c], "hold", 1024, (f"l{c}.w", f"l{c}.b")))
        for c in range(chunks):
            emit(T.ChunkEvent(r, step + 1, c, where[c], "hold", 1024, (f"l{c}.w", f"l{c}.b")))
        emit(T.MemorySample(r, step + 0.1, "cpu", step, 100))
        emit(T.MemorySample(r, step + 0.2, "nvme", step, 100))
        emit(T.StepMetrics(r, step, 1.0, 64, 0.1))
    placement = {(k[0], k[1]): (e.step, e.tier) for k, e in full.chunks.items()}
    return n, placement, {s: full.move_count(s) for s in range(steps + 1)}, list(full.moved_at(steps - 1))


def _kernel_picture(events, steps):
    from colossal_lab.widgets.state import ChunkState, MemoryState, MetricsState, reduce_all

    cs, ms, met = ChunkState(), MemoryState(), MetricsState()
    reduce_all(events, chunk=cs, memory=ms, metrics=met)
    return cs, ms, met


def test_coalesced_relay_draws_what_each_rank_emitted_with_far_fewer_events(cluster):
    steps, chunks = 6, 5
    sink = BusSink()
    relay = relay_mod.attach(cluster, **QUIET)  # coalescing is the default
    try:
        results = cluster.run(_emit_chunk_moves, steps, chunks, 0)
        stats = relay.rank_stats()  # flushes what the ranks still hold
        n_emitted = [n for n, *_ in results]
        assert [s["sent"] for s in stats] == n_emitted and [s["dropped"] for s in stats] == [0, 0]
        assert all(s["rows"] * 3 < s["sent"] for s in stats), stats  # folded, not one row per event
        # the receiver counts a message before it re-emits its events: wait for the events
        sink.wait_for(sum(s["rows"] for s in stats), timeout=10)
        assert relay.received == sum(n_emitted) and relay.rows == sum(s["rows"] for s in stats)
        events = sink.events()
        assert len(events) == relay.rows
        cs, ms, met = _kernel_picture(events, steps)
        for rank, (_, placement, counts, moved_last) in enumerate(results):
            assert {k: (e.step, e.tier) for k, e in cs.chunks.items() if k[0] == rank} == \
                {tuple(k): tuple(v) for k, v in placement.items()}
            assert {s: sum(m.count for m in cs.moves if m.rank == rank and m.step == s)
                    for s in range(steps + 1)} == {int(k): v for k, v in counts.items()}
            assert {c for r, c in cs.moved_at(steps - 1) if r == rank} == {c for _, c in moved_last}
        assert sum(counts[steps - 1] for _, _, counts, _ in results) > 10  # chunks did move
        # the latest memory sample per rank and tier, every step's metrics
        assert {(r, t): s.time for (r, t), s in ms.samples.items()} == \
            {(r, t): steps - 1 + dt for r in (0, 1) for t, dt in (("cpu", 0.1), ("nvme", 0.2))}
        assert sorted(met.steps) == [(r, s) for r in (0, 1) for s in range(steps)]
    finally:
        sink.close()
        relay.detach()


def test_without_coalescing_every_event_arrives_as_emitted(cluster):
    sink = BusSink()
    relay = relay_mod.attach(cluster, coalesce=False, interval=0.05, **QUIET)
    try:
        results = cluster.run(_emit_chunk_moves, 3, 4, 1)
        stats = relay.rank_stats()
        assert [s["rows"] for s in stats] == [s["sent"] for s in stats] == [n for n, *_ in results]
        events = sink.wait_for(sum(s["sent"] for s in stats), timeout=10)
        assert len(events) == sum(s["sent"] for s in stats)
        assert all(e.moves == 0 for e in events if isinstance(e, T.ChunkEvent))
        for rank, (_, placement, counts, _) in enumerate(results):
            cs, _, _ = _kernel_picture([e for e in events if e.rank == rank], 3)
            assert {k: (e.step, e.tier) for k, e in cs.chunks.items()} == \
                {tuple(k): tuple(v) for k, v in placement.items()}
            assert {s: cs.move_count(s) for s in range(4)} == {int(k): v for k, v in counts.items()}
    finally:
        sink.close()
        relay.detach()


def test_kernel_does_not_decode_while_nobody_here_listens(cluster):
    from colossal_lab.engine.telemetry import bus

    # a view another test left open in this process would count as a listener: set the bus's
    # subscriber list aside for this test (restored below)
    saved, bus._subscribers = bus._subscribers, []
    relay = relay_mod.attach(cluster, **QUIET)
    try:
        results = cluster.run(_emit_chunk_moves, 2, 3, 2)
        n = sum(r[0] for r in results)
        rows_before = sum(s["rows"] for s in relay.rank_stats())
        deadline = time.time() + 10
        while time.time() < deadline and relay.received < n:
            time.sleep(0.05)
        assert relay.received == n and relay.skipped >= 2 and relay.rows == 0 and relay.bad == 0
        got = []
        unsub = T.subscribe(got.append)
        try:
            results = cluster.run(_emit_chunk_moves, 2, 3, 3)
            rows = sum(s["rows"] for s in relay.rank_stats()) - rows_before
            deadline = time.time() + 10  # every row re-emitted here, not just the first one
            while time.time() < deadline and len(got) < rows:
                time.sleep(0.05)
            assert got and relay.rows == len(got)
        finally:
            unsub()
    finally:
        relay.detach()
        bus._subscribers = saved + bus._subscribers


def test_attach_rejects_a_bad_interval_or_coalesce(cluster):
    with pytest.raises(ValueError, match="attach\\(interval=0\\)"):
        relay_mod.attach(cluster, interval=0)
    with pytest.raises(TypeError, match="attach\\(coalesce="):
        relay_mod.attach(cluster, coalesce="yes")


class _ThisProcess:
    """A one-rank 'cluster' that is this process (``attach`` takes anything whose
    ``run(fn, *args)`` runs ``fn`` on every rank): rank sink and receiver in one process."""

    running = True

    def run(self, fn, *args):
        return [fn(*args)]


def test_events_the_receiver_re_emits_are_not_sent_again_from_the_same_process():
    here = _ThisProcess()
    got = []
    unsub = T.subscribe(got.append)
    relay = relay_mod.attach(here, interval=0.02, **QUIET)
    try:
        for i in range(50):
            T.emit(T.StepMetrics(rank=0, step=i, loss=1.0, tokens=1, seconds=0.1))
        deadline = time.time() + 10
        while time.time() < deadline and (relay.received < 50 or len(got) < 100):  # 50 emitted + 50 relayed
            time.sleep(0.02)
        time.sleep(0.3)  # a loop would keep re-sending what arrived
        (stats,) = relay.rank_stats()
        assert stats["sent"] == 50 and relay.received == 50, (stats, relay.received)
        assert sorted(e.step for e in got) == sorted(list(range(50)) * 2)  # emitted + relayed once
    finally:
        unsub()
        relay.detach()


def _emit_steadily(seconds, every):
    import time

    import torch.distributed as dist

    from colossal_lab.engine import telemetry as T

    dist.barrier()  # both ranks emit over the same seconds (a late start would leave drains with one rank)
    r, i, t_end = dist.get_rank(), 0, time.monotonic() + seconds
    while time.monotonic() < t_end:
        T.emit(T.StepMetrics(rank=r, step=i, loss=1.0, tokens=1, seconds=every))
        i += 1
        time.sleep(every)
    return i


def test_the_kernel_wakes_once_per_interval_for_all_ranks(cluster):
    # each rank sends one message per interval; the receiver wakes once per interval and
    # takes both ranks' messages, instead of waking for each message
    unsub = T.subscribe(lambda e: None)
    relay = relay_mod.attach(cluster, interval=0.2, **QUIET)
    try:
        d0, m0 = relay.drains, relay.messages
        n = cluster.run(_emit_steadily, 3.0, 0.01)
        relay.rank_stats()
        deadline = time.time() + 5
        while time.time() < deadline and relay.received < sum(n):
            time.sleep(0.05)
        drains, messages = relay.drains - d0, relay.messages - m0
        assert relay.received == sum(n)
        assert messages >= 20 and messages >= 1.6 * drains, (messages, drains)
    finally:
        unsub()
        relay.detach()


def _nice_of(thread_name, expect):
    """The thread's nice once it equals ``expect`` (it sets it itself, as it starts), or the last
    value seen after 5 s."""
    seen, deadline = None, time.time() + 5
    while time.time() < deadline:
        for t in threading.enumerate():
            if t.name == thread_name and t.native_id is not None:
                seen = os.getpriority(os.PRIO_PROCESS, t.native_id)
        if seen == expect:
            break
        time.sleep(0.02)
    return seen


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_kernel_side_threads_step_back_and_the_rank_side_ones_do_not():
    # the receiver (kernel) and a dashboard's redraw thread run at nice +10 so they take the CPU
    # the ranks leave; a rank's sender shares the GIL with training, so it keeps the rank's
    # priority (a niced GIL holder preempted away would stall the training thread)
    from colossal_lab.widgets._live import Redrawer

    base = os.getpriority(os.PRIO_PROCESS, 0)
    relay = relay_mod.attach(_ThisProcess(), interval=0.05, **QUIET)
    redraw = Redrawer(max_hz=20, name="nice-probe")
    try:
        assert _nice_of("colossal-relay", min(19, base + 10)) == min(19, base + 10)
        assert _nice_of("colossal-nice-probe", min(19, base + 10)) == min(19, base + 10)
        time.sleep(0.2)  # the sender has run a few intervals: it would have stepped back by now
        assert _nice_of("colossal-relay-send", base) == base
        assert redraw.niced
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # this (the main) thread untouched
    finally:
        redraw.close()
        relay.detach()


def _autogroup_nice():
    """This process's autogroup nice; None where the file is absent or says nothing (CI's
    sandbox has ``/proc/self/autogroup`` but reads it empty)."""
    try:
        with open("/proc/self/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, IndexError, ValueError):
        return None


def test_an_unreadable_autogroup_leaves_the_session_alone(tmp_path, monkeypatch):
    # where the file is empty (seen in CI) or missing, nothing is read, written or raised
    from colossal_lab.engine.telemetry import bus

    for content in (None, "", "garbage"):
        path = tmp_path / "autogroup"
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(content)
        monkeypatch.setattr(bus, "_AUTOGROUP", str(path))
        assert bus.session_background() is None
        assert (path.read_text() if content is not None else None) == content  # not written
        if content != "garbage":
            assert bus.session_group() is None


@pytest.mark.skipif(_autogroup_nice() is None, reason="no readable Linux scheduling autogroup")
def test_the_kernel_session_steps_back_while_attached_to_ranks_in_other_sessions(cluster):
    # cl.launch's engines run in sessions of their own: Linux shares the CPU between sessions
    # before it reads a thread's nice, so the kernel's whole session steps back while it draws
    # for them, and comes back at detach
    from colossal_lab.engine.telemetry import bus

    sessions = cluster.run(bus.session_group)
    assert bus.session_group() not in sessions  # the premise: the ranks are elsewhere
    before = _autogroup_nice()
    relay = relay_mod.attach(cluster, interval=0.05, **QUIET)
    try:
        # only where it can be undone (root here and in CI; unprivileged: RLIMIT_NICE decides)
        undo = bus._can_raise_to(before)
        assert _autogroup_nice() == (max(before, bus.BACKGROUND_NICE) if undo else before)
    finally:
        relay.detach()
    assert _autogroup_nice() == before
    # ranks in this very session (here: this process itself) leave the session alone
    relay = relay_mod.attach(_ThisProcess(), interval=0.05, **QUIET)
    try:
        assert _autogroup_nice() == before
    finally:
        relay.detach()
