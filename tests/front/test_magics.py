"""The %colossal magics in a real notebook, executed by nbclient in a real kernel.

The notebook launches 2 gloo ranks, runs cells on them (labels per rank, --targets,
--no-stream), shows status, gets bad flags, a raising rank, a Ctrl-C (the kernel is
interrupted through its KernelManager while every rank sleeps), a restart — and is then
shut down *without* %colossal stop: the kernel's exit must leave no process behind.
"""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("psutil")
pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("ipyparallel")

import json
import os
import signal
import threading
import time

import nbformat
import psutil
import pytest
from nbclient import NotebookClient
from support.notebook import IpcKernelManager

CELLS = [
    ("load", "%load_ext colossal_lab"),
    ("launch", "%colossal launch -n 2 --backend gloo --timeout 60 --threads 1"),
    ("allreduce", "%%colossal\nimport os, torch, torch.distributed as dist\n"
                  "t = torch.tensor([float(dist.get_rank() + 1)])\ndist.all_reduce(t)\n"
                  "print(f'rank {dist.get_rank()} sum {t.item()}')\nint(t.item())"),
    ("targets", "%%colossal --targets 1 --no-stream\nprint('only', os.environ['RANK'])"),
    ("status", "%colossal status"),
    ("badflag", "%colossal launch -n 2 --bogus"),
    ("badtarget", "%%colossal --targets 0,9\npass"),
    ("badcmd", "%colossal frobnicate"),
    ("raises", "%%colossal\nif dist.get_rank() == 1:\n    raise ValueError('bad rank')\nprint('fine')"),
    ("sleep", "%%colossal\nimport time\nprint('sleeping', flush=True)\ntime.sleep(60)\nprint('woke')"),
    ("alive", "%%colossal\nprint('alive', dist.get_rank(), t.item())"),
    ("restart", "%colossal restart"),
    ("fresh", "%%colossal\nimport torch.distributed as dist\nprint('fresh', dist.get_rank(), 't' in globals())"),
    ("pids", "import json, psutil\nprint(json.dumps([p.pid for p in psutil.Process().children(recursive=True)]))"),
]


def _text(outputs):
    parts = []
    for o in outputs:
        if o.output_type == "stream":
            parts.append(o.text)
        elif o.output_type in ("display_data", "execute_result"):
            parts.append(o.data.get("text/plain", ""))
        elif o.output_type == "error":
            parts.append(f"{o.ename}: {o.evalue}\n" + "\n".join(o.traceback))
    return "\n".join(parts)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src, metadata={"name": name})
                                         for name, src in CELLS])
    path = tmp_path_factory.mktemp("nb")
    client = NotebookClient(nb, timeout=240, kernel_name="python3", allow_errors=True,
                            kernel_manager_class=IpcKernelManager, resources={"metadata": {"path": str(path)}})
    timing = {}
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            if cell.metadata["name"] == "sleep":
                def interrupt_when_sleeping(cell=cell):
                    end = time.monotonic() + 60
                    while time.monotonic() < end:
                        if _text(cell.outputs).count("sleeping") >= 2:
                            timing["interrupt_at"] = time.monotonic()
                            # what Jupyter's stop button does: SIGINT to the kernel's process group
                            os.killpg(os.getpgid(client.km.provisioner.pid), signal.SIGINT)
                            return
                        time.sleep(0.1)
                watcher = threading.Thread(target=interrupt_when_sleeping, daemon=True)
                watcher.start()
                client.execute_cell(cell, i)
                timing["returned_at"] = time.monotonic()
                watcher.join(5)
            else:
                client.execute_cell(cell, i)
    # setup_kernel's exit shut the kernel down (as closing the notebook would)
    out = {c.metadata["name"]: c.outputs for c in nb.cells}
    return out, timing


def test_launch_and_rank_labelled_output(executed):
    out, _ = executed
    assert "2 ranks up" in _text(out["launch"]) and "backend=gloo" in _text(out["launch"])
    blocks = [o.data["text/plain"] for o in out["allreduce"] if o.output_type == "display_data"
              and o.data["text/plain"]]
    assert blocks == ["[rank 0]\nrank 0 sum 3.0\nOut[rank 0]: 3\n", "[rank 1]\nrank 1 sum 3.0\nOut[rank 1]: 3\n"]
    assert all("<b>[rank" in o.data["text/html"] for o in out["allreduce"]
               if o.output_type == "display_data" and o.data["text/plain"])
    assert _text(out["targets"]).strip() == "[rank 1]\nonly 1"


def test_status_table(executed):
    out, _ = executed
    (res,) = [o for o in out["status"] if o.output_type == "execute_result"]
    html = res.data["text/html"]
    assert html.count("<tr>") == 3 and "rss_mb" in html and "<td>cpu</td>" in html


def test_bad_flags_are_one_clean_line(executed):
    out, _ = executed
    for name, needle in [("badflag", "%colossal launch: unrecognized arguments: --bogus"),
                         ("badtarget", "ranks [9] do not exist"),
                         ("badcmd",
                          "unknown command 'frobnicate': use one of launch, status, stop, restart, dashboard")]:
        text = _text(out[name])
        assert "UsageError" in text and needle in text, text
        assert "SystemExit" not in text and "Traceback" not in text, text


def test_raising_rank_reported_with_rank_and_traceback(executed):
    out, _ = executed
    (err,) = [o for o in out["raises"] if o.output_type == "error"]
    assert err.ename == "RankError"
    assert "ranks [1]" in err.evalue and "rank 1: ValueError: bad rank" in err.evalue
    assert "raise ValueError('bad rank')" in err.evalue  # the remote traceback, cell line included
    assert "[rank 0]\nfine" in _text(out["raises"])


def test_interrupt_reaches_every_rank(executed):
    out, timing = executed
    assert "interrupt_at" in timing, "the ranks never started sleeping"
    assert timing["returned_at"] - timing["interrupt_at"] < 10
    (err,) = [o for o in out["sleep"] if o.output_type == "error"]
    assert err.ename == "KeyboardInterrupt" and "interrupted on ranks [0, 1]" in err.evalue
    blocks = [o.data["text/plain"] for o in out["sleep"] if o.output_type == "display_data"
              and o.data["text/plain"]]
    assert blocks == ["[rank 0]\nsleeping\n", "[rank 1]\nsleeping\n"]
    alive = _text(out["alive"])  # same processes, state kept, collectives still fine
    assert "[rank 0]\nalive 0 3.0" in alive and "[rank 1]\nalive 1 3.0" in alive


def test_restart_gives_fresh_processes(executed):
    out, _ = executed
    assert "restarted 2 ranks" in _text(out["restart"])
    fresh = _text(out["fresh"])
    assert "fresh 0 False" in fresh and "fresh 1 False" in fresh


def test_kernel_shutdown_leaves_no_process(executed):
    out, _ = executed
    pids = json.loads(_text(out["pids"]).strip().splitlines()[-1])
    assert len(pids) >= 3  # controller + 2 engines (+ nannies)
    deadline = time.monotonic() + 15
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert alive == [], f"processes left after kernel shutdown: {[(p, psutil.Process(p).cmdline()) for p in alive]}"
