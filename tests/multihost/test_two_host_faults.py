"""Faults across the rig's two hosts (``support.hosts``), on one SSH cluster with a rank on each,
in order: Ctrl-C stops the ranks on both hosts; the far host's rank killed mid-step is reported as
a RankError naming its rank and host, the near rank is stopped and both are replaced; the driver
(the notebook kernel) killed with SIGKILL leaves no process on either host."""

import os
import signal
import time

import pytest
from support.hosts import cmdline

KILL_TO_ERROR_S = 150  # kill -> RankError, including the restart over ssh (see the measured times printed)
INTERRUPT_S = 150  # Ctrl-C -> KeyboardInterrupt, every rank stopped (a restart over ssh included)
GONE_S = 60  # driver killed -> nothing left on either host


@pytest.fixture(scope="module")
def driver(rig):
    d = rig.launch("ssh", {rig.a.name: 1, rig.b.name: 1})
    try:
        d.line(timeout=300)
        yield d
    finally:
        d.close()


def _pids(driver):
    return [r["pid"] for r in driver.result("where")["ranks"]]


def _start_steps(driver, tmp_path, seconds=120):
    """The ranks in a loop of all_reduces across the hosts, for ``seconds``; returns once both are in it."""
    started = tmp_path / "started"
    started.mkdir()
    driver.send("steps", seconds=seconds, started=str(started))
    assert "started" in driver.line(timeout=30)
    deadline = time.monotonic() + 60
    while len(list(started.iterdir())) < 2:
        assert time.monotonic() < deadline, "the ranks did not enter the loop within 60s"
        time.sleep(0.1)
    time.sleep(1)


def test_ctrl_c_stops_the_ranks_on_both_hosts(rig, driver, tmp_path):
    before = _pids(driver)
    _start_steps(driver, tmp_path)
    t = time.monotonic()
    os.kill(driver.pid, signal.SIGINT)  # what Jupyter's interrupt sends the kernel
    out = driver.line(timeout=INTERRUPT_S + 60)
    took = time.monotonic() - t
    print(f"Ctrl-C -> KeyboardInterrupt: {took:.1f}s ({out['error'].split('. ', 1)[-1][:60]})")
    assert out["type"] == "KeyboardInterrupt" and "interrupted on ranks [0, 1]" in out["error"], out
    assert took < INTERRUPT_S
    # both ranks left the 120 s loop: they answer at once. Either both took the interrupt (the same
    # processes, the process group rebuilt), or one was left blocked in an all_reduce by its peer's
    # interrupt and both were replaced: then neither old process is left on either host
    t = time.monotonic()
    after = _pids(driver)
    assert time.monotonic() - t < 30
    if "restarted" in out["error"]:
        assert not (set(before) & (set(rig.a.pids()) | set(rig.b.pids()))), before
    else:
        assert "were interrupted" in out["error"] and after == before, (out, before, after)


def test_far_rank_killed_mid_step_is_named_with_its_host(rig, driver, tmp_path):
    near, far = _pids(driver)
    assert far in rig.b.pids() and near in rig.a.pids()
    _start_steps(driver, tmp_path)
    victims = [p for p in rig.b.pids() if "ipyparallel.engine" in cmdline(p)]  # the engine and its nanny
    assert far in victims
    t = time.monotonic()
    for p in victims:
        os.kill(p, signal.SIGKILL)
    out = driver.line(timeout=KILL_TO_ERROR_S + 60)
    took = time.monotonic() - t
    print(f"far rank killed -> RankError: {took:.1f}s")
    assert out["type"] == "RankError", out
    assert 1 in out["ranks"] and out["hosts"]["1"] == rig.b.name, out
    assert f"rank 1 on {rig.b.name}: EngineError" in out["error"]
    assert f"ranks [1] (on {rig.b.name}) died" in out["error"]
    assert took < KILL_TO_ERROR_S
    # the near rank was stopped too: neither old process is left on either host
    left = set(rig.a.pids()) | set(rig.b.pids())
    assert near not in left and far not in left
    after = driver.result("where")["ranks"]  # fresh processes on both hosts, gloo across again
    assert [r["host"] for r in after] == [rig.a.name, rig.b.name] and [r["sum"] for r in after] == [3.0, 3.0]


def test_killed_driver_leaves_nothing_on_either_host(rig, driver):
    assert rig.others(rig.b), "the far host runs the cluster's rank"
    driver.proc.kill()  # SIGKILL, like a kernel killed by the OOM killer: no cleanup runs
    driver.proc.wait()  # its parent reaps it, as Jupyter's server does
    t = time.monotonic()
    left = rig.others(rig.a) + rig.others(rig.b)
    while left and time.monotonic() - t < GONE_S:
        time.sleep(0.5)
        left = rig.others(rig.a) + rig.others(rig.b)
    print(f"driver killed -> nothing left on either host: {time.monotonic() - t:.1f}s")
    assert left == [], [(p, cmdline(p)[:120]) for p in left]
