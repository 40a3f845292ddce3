"""The relay on a real 2-rank cluster: events emitted on both ranks reach this process's bus
(and a Dashboard subscribed to it) while ``cluster.run`` is still running."""

import threading
import time

import pytest

import colossal_lab as cl
from colossal_lab import relay as relay_mod
from colossal_lab.engine import telemetry as T
from colossal_lab.widgets import Dashboard


def _emit_then_sleep(n_events, sleep_s):
    import time

    import torch.distributed as dist

    from colossal_lab.engine import telemetry as T

    r = dist.get_rank()
    for i in range(n_events):
        T.emit(T.StepMetrics(rank=r, step=i, loss=float(i + r), tokens=100, seconds=0.01))
    T.emit(T.ChunkEvent(rank=r, step=0, chunk_id=0, tier="cpu" if r == 0 else "nvme",
                        state="hold", nbytes=1024, params=(f"rank{r}.w",)))
    time.sleep(sleep_s)
    return r


def _flood(n):
    """Emit far more than the send high-water mark with nobody reading: must not block."""
    import time

    from colossal_lab.engine import telemetry as T

    t0 = time.perf_counter()
    for i in range(n):
        T.emit(T.StepMetrics(rank=0, step=i, loss=None, tokens=1, seconds=1.0))
    return time.perf_counter() - t0


@pytest.fixture(scope="module")
def cluster():
    c = cl.launch(n=2, backend="gloo", threads=1)
    try:
        yield c
    finally:
        c.stop()


def test_events_from_both_ranks_arrive_while_run_is_running(cluster):
    got, lock = [], threading.Lock()

    def sink(e):
        with lock:
            got.append(e)

    unsub = T.subscribe(sink)
    dash = Dashboard(live=False, max_hz=10)
    relay = relay_mod.attach(cluster)
    try:
        assert relay_mod.attach(cluster) is relay  # idempotent per cluster
        done = threading.Event()
        results = {}

        def run():
            results["ranks"] = cluster.run(_emit_then_sleep, 20, 6.0)
            done.set()

        th = threading.Thread(target=run)
        th.start()
        deadline = time.time() + 30
        while time.time() < deadline and not done.is_set():
            with lock:
                ranks = {e.rank for e in got if isinstance(e, T.StepMetrics)}
                n = len(got)
            if ranks == {0, 1} and n >= 42:
                break
            time.sleep(0.05)
        arrived_before_return = not done.is_set()
        with lock:
            snapshot = list(got)
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
        unsub()
        relay.detach()
    # after detach, ranks no longer send
    assert cluster.run(relay_mod._stats, relay.address) == [None, None]


def test_a_notebook_that_does_not_read_never_blocks_training(cluster):
    # a relay whose receiver is stopped (like a kernel that is too busy to read): ranks keep
    # emitting at full speed and drop what the bounded queue cannot hold
    relay = relay_mod.attach(cluster, sndhwm=100, rcvhwm=100)
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
