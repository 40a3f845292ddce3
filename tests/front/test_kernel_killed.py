"""A notebook kernel killed without any cleanup (SIGKILL, or SIGTERM with Python's default
handler) leaves no process behind: the ranks watch the kernel and take down themselves, the
controller and the controller's own children (ipyparallel's schedulers)."""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("psutil")
pytest.importorskip("ipyparallel")

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import psutil  # noqa: E402

KERNEL = r"""
import json, sys, time
import psutil
import colossal_lab as cl
c = cl.launch(n=2, backend="gloo", threads=1)
ctl = psutil.Process(c._ipp.controller.process.pid)
pids = [ctl.pid] + [p.pid for p in ctl.children(recursive=True)] + list(c.pids)
pids += [p.pid for e in c.pids for p in psutil.Process(e).children(recursive=True)]
print(json.dumps(sorted(set(pids))), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_kernel_leaves_no_process(sig):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        pids = json.loads(kernel.stdout.readline())
        assert len(pids) >= 4, pids  # controller (+ its schedulers) and two engines
        kernel.send_signal(sig)
        kernel.wait(timeout=30)
        deadline = time.monotonic() + 20  # the ranks poll the kernel once a second
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.5)
            alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert alive == [], [(p, " ".join(psutil.Process(p).cmdline())[:80]) for p in alive]
    finally:
        kernel.kill()
