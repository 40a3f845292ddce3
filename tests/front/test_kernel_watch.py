"""What takes a cluster down when its kernel dies without cleanup, on any host: a rank's watch on
the kernel's rendezvous store (``_rank.watch_store``) and the warden beside the controller
(``python -m colossal_lab._warden``). Real processes and a real listening socket; the two-host
rig (tests/multihost) runs both inside a real cluster."""

import socket
import subprocess
import sys
import time

import pytest

# a Jupyter-side package: absent (a bare GPU image), the module skips
psutil = pytest.importorskip("psutil")

RANK = r"""
import sys, time
from colossal_lab._rank import watch_store
watch_store("127.0.0.1", int(sys.argv[1]))
print("watching", flush=True)
time.sleep(120)
"""


def _wait_gone(proc: subprocess.Popen, limit: float) -> float:
    t = time.monotonic()
    proc.wait(timeout=limit)
    return time.monotonic() - t


def test_a_rank_leaves_when_the_kernels_store_refuses_connections():
    store = socket.create_server(("127.0.0.1", 0))  # stands in for the kernel's TCPStore
    port = store.getsockname()[1]
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "watching"
        time.sleep(4)  # more than three polls with the store up: the rank stays
        assert rank.poll() is None
        store.close()  # the kernel is gone: its port is refused
        took = _wait_gone(rank, 20)
        assert rank.returncode == 3
        assert took < 10, took  # three refusals a second apart
    finally:
        rank.kill()
        store.close()


def test_the_warden_kills_the_controller_tree_when_the_kernel_dies():
    kernel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    # a "controller" with a child of its own, as ipyparallel's has its schedulers
    ctl = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                            "time.sleep(120)"])
    warden = None
    try:
        deadline = time.monotonic() + 20
        while not psutil.Process(ctl.pid).children() and time.monotonic() < deadline:
            time.sleep(0.1)
        child = psutil.Process(ctl.pid).children()[0]
        k = psutil.Process(kernel.pid)
        warden = subprocess.Popen([sys.executable, "-m", "colossal_lab._warden", str(k.pid),
                                   repr(k.create_time()), str(ctl.pid)])
        time.sleep(2)
        assert warden.poll() is None and ctl.poll() is None  # the kernel lives: nothing is touched
        kernel.kill()
        kernel.wait()  # reaped, as Jupyter's server reaps a killed kernel
        assert _wait_gone(warden, 20) < 10 and warden.returncode == 0
        assert ctl.wait(timeout=5) != 0
        psutil.wait_procs([child], timeout=5)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        for p in (kernel, ctl, warden):
            if p is not None:
                p.kill()


def test_the_warden_leaves_by_itself_when_the_cluster_stops():
    kernel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ctl = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    k = psutil.Process(kernel.pid)
    warden = subprocess.Popen([sys.executable, "-m", "colossal_lab._warden", str(k.pid),
                               repr(k.create_time()), str(ctl.pid)])
    try:
        time.sleep(1)
        ctl.kill()
        ctl.wait()  # the controller stopped normally
        assert _wait_gone(warden, 20) < 10
        assert kernel.poll() is None  # the kernel is left alone
    finally:
        for p in (kernel, ctl, warden):
            p.kill()
