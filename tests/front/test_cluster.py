"""cl.launch / cl.Cluster on a real 2-rank ipyparallel cluster with gloo.

One cluster is shared by the module (starting one is the slow part); the tests run in file
order and the last one stops it and checks that no child process is left.
"""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("psutil")
pytest.importorskip("ipyparallel")

import contextlib
import os
import signal
import threading
import time

import psutil
import pytest

import colossal_lab as cl

# --- functions run on the ranks (shipped by module reference: this folder is on the ranks' path)


def allreduce_info():
    import os

    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")},
            "pid": os.getpid()}


def rank1_raises_rank0_in_collective():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    t = torch.ones(1)
    dist.all_reduce(t)  # blocks: rank 1 never joins
    return t.item()


def every_rank_raises():
    import torch.distributed as dist

    raise KeyError(f"missing on {dist.get_rank()}")


def only_rank0_collects():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def rank1_process_dies():
    import os

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(7)
    dist.all_reduce(torch.ones(1))


def _started(folder):
    """Tell the test this rank is in its call: a file named after the rank in ``folder``."""
    import os

    import torch.distributed as dist

    open(os.path.join(folder, f"rank{dist.get_rank()}"), "w").close()


def rank0_in_collective_rank1_sleeps(started):
    import time

    import torch
    import torch.distributed as dist

    _started(started)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # never completes: rank 1 is asleep
    else:
        time.sleep(60)


def sleep_long(seconds, started):
    import time

    _started(started)
    time.sleep(seconds)
    return "slept"


def read_x():
    """Reads the rank's interactive namespace (where push and %%colossal cells put names)."""
    from IPython import get_ipython

    return get_ipython().user_ns.get("x")


#: the module's ``cluster`` (tests/conftest.py) gives up soon: a short launch timeout and short
#: grace periods after a failure or an interrupt
CLUSTER_ARGS = dict(timeout=60, failure_grace=1.0, interrupt_grace=3.0)


def test_all_reduce_ranks_env(cluster):
    assert cluster.n == 2 and cluster.ranks == [0, 1] and cluster.backend == "gloo"
    assert cl.current_cluster() is cluster
    out = cluster.run(allreduce_info)
    assert [o["rank"] for o in out] == [0, 1]
    assert [o["sum"] for o in out] == [3.0, 3.0]
    for r, o in enumerate(out):
        assert o["env"] == {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cluster.master_port)}
    assert [o["pid"] for o in out] == cluster.pids
    assert len(set(cluster.pids)) == 2 and os.getpid() not in cluster.pids


def test_push_pull_status(cluster):
    cluster.push({"x": 41})
    cluster.push({"x": 7}, ranks=[1])
    assert cluster.pull("x") == [41, 7]
    assert cluster.run_on([1], read_x) == [7]
    rows = cluster.status()
    assert [r["rank"] for r in rows] == [0, 1]
    assert [r["pid"] for r in rows] == cluster.pids
    assert all(r["dist"] and r["device"] == "cpu" and r["rss_mb"] > 10 for r in rows)
    assert "<table>" in rows._repr_html_() and "rss_mb" in str(rows)
    with pytest.raises(ValueError, match="ranks \\[5\\] do not exist"):
        cluster.run_on([5], read_x)


def test_demo_ddp_step(cluster):
    from colossal_lab.demo import train_steps

    out = cluster.run(train_steps, 1)
    assert [o["rank"] for o in out] == [0, 1]
    assert out[0]["losses"] == out[1]["losses"]  # all-reduced
    assert 4.5 < out[0]["losses"][0] < 6.5  # ~ln(256) for random tokens on a fresh model
    assert out[0]["checksum"] == pytest.approx(out[1]["checksum"], abs=1e-9)  # DDP kept weights equal


def test_every_failing_rank_is_named(cluster):
    with pytest.raises(cl.RankError) as ei:
        cluster.run(every_rank_raises)
    e = ei.value
    assert e.ranks == [0, 1]
    msg = str(e)
    assert "rank 0: KeyError" in msg and "rank 1: KeyError" in msg
    assert "----- rank 1 traceback -----" in msg and "every_rank_raises" in msg
    assert cluster.pull("x") == [41, 7]  # nothing was restarted


def _freed_or_replaced(cluster, note, old_pids):
    """Rank 0 was blocked in C++ (gloo), where SIGINT waits. Rank 1 left the process group, which ends
    rank 0's all_reduce when nothing else still holds rank 1's group (its connections close with its
    last reference): both processes are kept and the group rebuilt. An earlier call here (the demo's
    DDP) can leave a reference no collection frees: then both ranks are killed and replaced."""
    if "restarted" in note:
        assert "Ranks [0] did not respond to an interrupt" in note
        assert set(cluster.pids).isdisjoint(old_pids)
    else:
        assert "ranks [0] were blocked in a collective: the other ranks left the process group" in note, note
        assert "rebuilt" in note and cluster.pids == old_pids


def test_raising_rank_does_not_hang_the_others(cluster):
    old_pids = cluster.pids
    t0 = time.monotonic()
    with pytest.raises(cl.RankError) as ei:
        cluster.run(rank1_raises_rank0_in_collective)
    elapsed = time.monotonic() - t0
    e = ei.value
    assert e.ranks == [1]  # rank 0 was a victim, not a cause
    assert "ValueError: boom from rank one" in str(e)
    assert "rank1_raises_rank0_in_collective" in e.failures[1].traceback
    assert elapsed < cluster.config.timeout, "waited for the collective timeout instead of recovering"
    _freed_or_replaced(cluster, e.note, old_pids)
    assert [o["sum"] for o in cluster.run(allreduce_info)] == [3.0, 3.0]


def test_dead_rank_process_is_replaced(cluster):
    old_pids = cluster.pids
    with pytest.raises(cl.RankError) as ei:
        cluster.run(rank1_process_dies)
    e = ei.value
    assert 1 in e.ranks and e.failures[1].ename == "EngineError"
    assert "The process of ranks [1] died; the cluster was restarted" in str(e)
    assert set(cluster.pids).isdisjoint(old_pids)
    assert [o["sum"] for o in cluster.run(allreduce_info)] == [3.0, 3.0]


def test_collective_timeout_is_explained(cluster):
    cluster.rebuild(timeout=3)
    try:
        t0 = time.monotonic()
        with pytest.raises(cl.RankError) as ei:
            cluster.run(only_rank0_collects)
        assert time.monotonic() - t0 >= 2.5
        e = ei.value
        assert e.ranks == [0] and e.failures[0].collective_timeout
        assert "rank 0: a torch.distributed collective timed out after 3s" in str(e)
        assert "another rank failed or not every rank called the same collective" in str(e)
    finally:
        cluster.rebuild(timeout=60)
    assert [o["sum"] for o in cluster.run(allreduce_info)] == [3.0, 3.0]


@contextlib.contextmanager
def _interrupt_when_started(started):
    """Send this process's main thread SIGINT (Ctrl-C) once both ranks have said they are in their
    call (``_started``), not after a fixed delay that a slow start of the ranks would outrun.
    Yields {"interrupt_at": monotonic time of the SIGINT}."""
    main, timing, done = threading.main_thread().ident, {}, threading.Event()

    def watch():
        end = time.monotonic() + 60
        while time.monotonic() < end and not done.is_set():
            if len(os.listdir(started)) == 2:
                timing["interrupt_at"] = time.monotonic()
                signal.pthread_kill(main, signal.SIGINT)
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield timing
    finally:
        done.set()
        watcher.join()


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt, as under a terminal or a Jupyter kernel. A test runner started
    in the background (``cmd &`` in a non-interactive shell, as a CI script may) inherits SIGINT
    ignored, and Python then installs no handler: the Ctrl-C these tests send would do nothing."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_interrupt_stops_every_rank(cluster, sigint_raises, tmp_path):
    cluster.push({"x": 5})
    with _interrupt_when_started(tmp_path) as timing:
        with pytest.raises(KeyboardInterrupt, match="interrupted on ranks \\[0, 1\\]"):
            cluster.run(sleep_long, 60, str(tmp_path))
    assert time.monotonic() - timing["interrupt_at"] < 8.5  # answered: no 60 s sleep, no restart
    t1 = time.monotonic()
    assert cluster.pull("x") == [5, 5]  # same processes, nothing queued behind a sleep
    assert [o["sum"] for o in cluster.run(allreduce_info)] == [3.0, 3.0]
    assert time.monotonic() - t1 < 10


def test_interrupt_with_a_rank_stuck_in_a_collective(cluster, sigint_raises, tmp_path):
    old_pids = cluster.pids
    t0 = time.monotonic()
    with _interrupt_when_started(tmp_path):
        with pytest.raises(KeyboardInterrupt) as ei:
            cluster.run(rank0_in_collective_rank1_sleeps, str(tmp_path))
    assert time.monotonic() - t0 < cluster.config.timeout  # recovered long before the timeout
    _freed_or_replaced(cluster, str(ei.value), old_pids)
    assert [o["sum"] for o in cluster.run(allreduce_info)] == [3.0, 3.0]


def test_stop_leaves_no_process(cluster):
    me = psutil.Process()
    # multiprocessing's resource tracker and forkserver belong to this pytest process (started by
    # other tests' spawn queues and preloaded ranks), not to the cluster, and live as long as pytest does.
    def ours(p):
        cmd = " ".join(p.cmdline())
        return "multiprocessing.resource_tracker" not in cmd and "multiprocessing.forkserver" not in cmd

    before = {p.pid for p in me.children(recursive=True) if ours(p)}
    assert set(cluster.pids) <= before  # engines are our descendants (local launcher)
    # processes of other fixtures alive now (the two-host rig's sshd when tests/multihost ran first) are not the
    # cluster's: its own are the engines, their nannies and the controller, and whatever starts from here on
    roots = [psutil.Process(pid) for pid in [*cluster.pids, cluster._ipp.controller.pid]]
    unrelated = before - {p.pid for r in roots for p in [r, *r.children(recursive=True)]}
    # stopped while fresh ranks start in the background after a rank died: the restart is given up, not
    # finished (its hooks never run), and the engines it started are stopped with the rest
    finished = []
    cluster.restart_hooks.append(lambda c: finished.append(c))
    with pytest.raises(cl.RankError):
        cluster.run(rank1_process_dies)
    restarting = cluster._restarting
    assert restarting is not None and restarting.is_alive()
    with cluster:  # context-manager exit stops it
        pass
    assert not cluster.running and not restarting.is_alive() and finished == []
    alive = [p for p in me.children(recursive=True)
             if p.status() != psutil.STATUS_ZOMBIE and ours(p) and p.pid not in unrelated]
    assert alive == [], f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
    orphans = []
    for pid in before - unrelated:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                orphans.append((pid, p.cmdline()))
        except psutil.NoSuchProcess:
            pass
    assert orphans == [], f"orphaned: {orphans}"
    with pytest.raises(RuntimeError, match="no colossal-lab cluster is running"):
        cl.current_cluster()
    with pytest.raises(RuntimeError, match="stopped"):
        cluster.run(read_x)
