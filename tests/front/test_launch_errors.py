"""cl.launch past one machine: a launcher that lacks something on this host fails before any
process starts, naming the missing piece and the fix; an engine that dies while starting is
reported at once with its own log; ``start_timeout`` is the wait that fires.

Real processes throughout: a real interpreter without mpi4py (a venv made here), PATHs made
here without the programs, engines that really exit, a real mpiexec where one is installed.
"""

import pytest

# Jupyter-side packages this module needs: absent (a bare GPU image), it skips.
pytest.importorskip("psutil")
pytest.importorskip("ipyparallel")

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import psutil
import pytest
from support.mpi import open_mpi
from traitlets.config import Config

import colossal_lab as cl

ROOT = Path(__file__).resolve().parents[2]


def _children():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _no_new_children(before, wait=10.0):
    """Processes a failed launch started are gone (ipyparallel's stop is asynchronous)."""
    end = time.monotonic() + wait
    while _children() - before and time.monotonic() < end:
        time.sleep(0.1)
    assert _children() - before == set()


def _mpi_config() -> Config:
    """An MPI config that also runs as root under Open MPI (containers, CI) and on one core."""
    c = Config()
    if open_mpi():
        c.MPIEngineSetLauncher.mpi_args = ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return c


@pytest.fixture(scope="module")
def python_without_mpi4py(tmp_path_factory) -> Path:
    """A real interpreter that has everything this venv has except mpi4py: a venv on the same base
    Python whose site-packages links every entry of ours but mpi4py's."""
    where = tmp_path_factory.mktemp("venv") / "nompi"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", "--system-site-packages", str(where)],
                   check=True, timeout=60)
    ours = Path(sysconfig.get_paths()["purelib"])
    theirs = Path(subprocess.run([str(where / "bin" / "python"), "-c",
                                  "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    for entry in ours.iterdir():
        if not entry.name.lower().startswith("mpi4py"):
            (theirs / entry.name).symlink_to(entry)
    python = where / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; print(u.find_spec('mpi4py') is None, "
                            "u.find_spec('ipyparallel') is not None)"], capture_output=True, text=True, timeout=60)
    assert probe.stdout.split() == ["True", "True"], probe
    return python


# ---------------------------------------------------------------------- mpi
def test_mpi_without_mpi4py_fails_fast_in_a_python_without_it(python_without_mpi4py):
    """The issue's call, in an interpreter that lacks mpi4py: the engines would run that same
    interpreter, so the check is in-process; the error comes before any process starts."""
    # this test is about mpi4py: without an MPI here, any program stands in for mpiexec
    mpi_cmd = "mpiexec" if shutil.which("mpiexec") else sys.executable
    script = f"""
import json, time, psutil
from traitlets.config import Config
import colossal_lab as cl
c = Config()
c.MPIEngineSetLauncher.mpi_cmd = [{mpi_cmd!r}]
t = time.perf_counter()
try:
    cl.launch(n=2, backend="gloo", launcher="mpi", timeout=180, config=c)
    out = {{"error": None}}
except ValueError as e:
    out = {{"error": type(e).__name__, "message": str(e), "missing": e.missing}}
out["seconds"] = time.perf_counter() - t
out["children"] = len(psutil.Process().children(recursive=True))
print(json.dumps(out))
"""
    r = subprocess.run([str(python_without_mpi4py), "-c", script], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] == "LauncherSetupError", out
    assert out["missing"] == "mpi4py"
    assert "launcher='mpi' needs mpi4py" in out["message"]
    assert str(python_without_mpi4py) in out["message"]  # the interpreter that lacks it
    assert 'pip install "colossal-lab[mpi]"' in out["message"]
    assert out["seconds"] < 5, out
    assert out["children"] == 0
    print(f"mpi4py error after {out['seconds']:.3f}s")


def test_mpi_engines_in_another_python_without_mpi4py(python_without_mpi4py):
    """Engines configured to run another interpreter: that interpreter is asked."""
    c = Config()
    c.MPIEngineSetLauncher.mpi_cmd = ["mpiexec" if shutil.which("mpiexec") else sys.executable]
    c.MPIEngineSetLauncher.engine_cmd = [str(python_without_mpi4py), "-m", "ipyparallel.engine"]
    before = _children()
    t = time.perf_counter()
    with pytest.raises(cl.LauncherSetupError, match=r"launcher='mpi' needs mpi4py.*colossal-lab\[mpi\]") as e:
        cl.launch(n=2, backend="gloo", launcher="mpi", config=c)
    assert time.perf_counter() - t < 5
    assert isinstance(e.value, ValueError) and e.value.launcher == "mpi"
    assert _children() == before


# the launcher's own program missing from a real PATH: refused at once, naming it, the package and the setting
MISSING_PROGRAM = {
    "mpi": r"launcher='mpi' needs 'mpiexec': 'mpiexec' is not on the PATH.*apt-get install openmpi-bin.*mpi_cmd",
    "slurm": r"launcher='slurm' needs 'sbatch': 'sbatch' \(to submit the engines' job\) is not on the PATH.*"
             r"slurm-client.*submit_command",
}


@pytest.mark.parametrize("launcher", list(MISSING_PROGRAM))
def test_a_launcher_whose_program_is_not_on_the_path(tmp_path, monkeypatch, launcher):
    monkeypatch.setenv("PATH", str(tmp_path))  # a real PATH with none of the launcher's programs on it
    before = _children()
    t = time.perf_counter()
    with pytest.raises(cl.LauncherSetupError, match=MISSING_PROGRAM[launcher]):
        cl.launch(n=2, backend="gloo", launcher=launcher)
    assert time.perf_counter() - t < 5
    assert _children() == before


def test_mpi_with_a_configured_mpi_cmd_that_is_missing():
    c = Config()
    c.MPIEngineSetLauncher.mpi_cmd = ["/nonexistent/bin/mpirun"]
    with pytest.raises(cl.LauncherSetupError, match=r"needs '/nonexistent/bin/mpirun'"):
        cl.launch(n=2, backend="gloo", launcher="mpi", config=c)


# ---------------------------------------------------------------------- ssh, slurm
def test_ssh_without_hosts():
    before = _children()
    with pytest.raises(cl.LauncherSetupError,
                       match=r"launcher='ssh' needs the hosts to start engines on: no hosts were given.*"
                             r"c.SSHEngineSetLauncher.engines = "):
        cl.launch(n=2, backend="gloo", launcher="ssh")
    assert _children() == before


def test_ssh_with_fewer_slots_than_ranks():
    c = Config()
    c.SSHEngineSetLauncher.engines = {"node1": 1}
    with pytest.raises(cl.LauncherSetupError, match=r"launcher='ssh' needs 2 engine slots.*have 1 in all"):
        cl.launch(n=2, backend="gloo", launcher="ssh", config=c)


def test_ssh_without_an_ssh_client(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    c = Config()
    c.SSHEngineSetLauncher.engines = {"node1": 2}
    with pytest.raises(cl.LauncherSetupError, match=r"launcher='ssh' needs 'ssh'.*openssh-client"):
        cl.launch(n=2, backend="gloo", launcher="ssh", config=c)


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client here (checked before the address)")
def test_ssh_hosts_elsewhere_with_a_loopback_master_addr():
    """Engines on another host connect back to master_addr: a loopback address is refused, naming it; by
    default the address is this machine's on the route to the first host, never a loopback one."""
    c = Config()
    c.SSHEngineSetLauncher.engines = {"node1": 1, "root@192.0.2.7": 1}  # 192.0.2.0/24: documentation only
    t = time.perf_counter()
    with pytest.raises(cl.LauncherSetupError, match=r"launcher='ssh' needs an address the other hosts can reach: "
                                                    r"master_addr='127\.0\.0\.1' is a loopback address.*"
                                                    r"node1, 192\.0\.2\.7.*Fix: pass master_addr="):
        cl.launch(n=2, backend="gloo", launcher="ssh", config=c, master_addr="127.0.0.1")
    assert time.perf_counter() - t < 5
    from colossal_lab.launch import make_config
    from colossal_lab.startup import route_address

    here = route_address("192.0.2.7")
    c.SSHEngineSetLauncher.engines = {"192.0.2.7": 2}
    if here is None:  # no route off this machine at all: the default is refused like the explicit loopback
        with pytest.raises(cl.LauncherSetupError, match="loopback"):
            make_config(2, "gloo", "ssh", config=c)
    else:
        assert make_config(2, "gloo", "ssh", config=c).master_addr == here
    c.SSHEngineSetLauncher.engines = {"localhost": 2}  # all on this machine: any address will do
    assert make_config(2, "gloo", "ssh", config=c, master_addr="127.0.0.1").master_addr == "127.0.0.1"
    # the first ssh to each host waits start_timeout (tests/multihost/test_two_hosts.py probes it through a real ssh)
    got = make_config(2, "gloo", "ssh", config=c, master_addr="127.0.0.1", start_timeout=77)
    assert got.ipp_kw["config"].PatientSSHEngineSetLauncher.probe_timeout == 77.0
    from colossal_lab.startup import engine_launcher

    assert engine_launcher("ssh").__name__ == "PatientSSHEngineSetLauncher" and engine_launcher("mpi") == "mpi"


def test_magic_reports_the_missing_piece_as_a_usage_error(tmp_path, monkeypatch):
    from IPython.core.error import UsageError

    from colossal_lab.magics import ColossalMagics

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UsageError, match=r"%colossal launch: launcher='slurm' needs 'sbatch'"):
        ColossalMagics(shell=None).colossal("launch -n 2 --launcher slurm")


# ---------------------------------------------------------------------- start_timeout
@pytest.mark.parametrize("value", [0, -5, "60", True, None])
def test_bad_start_timeout(value):
    with pytest.raises(ValueError, match=r"start_timeout=.*must be a positive number of seconds"):
        cl.launch(n=2, start_timeout=value)


def test_engine_timeout_points_to_start_timeout():
    with pytest.raises(ValueError, match=r"engine_timeout=30 is ipyparallel's wait.*start_timeout="):
        cl.launch(n=2, engine_timeout=30)


def test_start_timeout_is_the_wait_that_fires():
    before = _children()
    t = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"[12] of 2 engines were not ready within start_timeout=0.2s "
                                           r"\([01] ready, launcher='local'\)") as e:
        cl.launch(n=2, backend="gloo", start_timeout=0.2, timeout=600)
    assert time.perf_counter() - t < 30  # neither timeout=600 nor ipyparallel's 60 s
    assert "timeout= is the collective timeout" in str(e.value)
    assert "engine process" in str(e.value)  # the engines' log tails follow
    _no_new_children(before)


# ---------------------------------------------------------------------- engines that die
def test_engine_that_dies_at_start_is_reported_at_once_with_its_log():
    c = Config()
    c.LocalEngineSetLauncher.engine_cmd = [sys.executable, "-m", "colossal_lab_no_such_engine"]
    before = _children()
    t = time.perf_counter()
    with pytest.raises(cl.EngineStartError,
                       match=r"(?s)engine process \d.* exited during start-up.*launcher='local'.*end of its log:\n"
                             r".*No module named colossal_lab_no_such_engine") as e:
        cl.launch(n=2, backend="gloo", config=c, start_timeout=120)
    assert time.perf_counter() - t < 30  # not after start_timeout
    assert "No module named colossal_lab_no_such_engine" in e.value.log_tail
    _no_new_children(before)


@pytest.mark.skipif(not (open_mpi() and os.geteuid() == 0), reason="needs Open MPI's mpiexec, run as root")
def test_mpiexec_that_refuses_to_start_is_reported_with_its_message(monkeypatch):
    """Open MPI's mpiexec exits at once as root unless allowed: its own explanation is the error."""
    monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT", raising=False)
    monkeypatch.delenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", raising=False)
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed: the up-front check stops this launch first")
    before = _children()
    t = time.perf_counter()
    with pytest.raises(cl.EngineStartError, match=r"the engine launcher mpiexec \(pid \d+\) exited during "
                                                  r"start-up(.|\n)*allow-run-as-root"):
        cl.launch(n=2, backend="gloo", launcher="mpi", start_timeout=120)
    assert time.perf_counter() - t < 30
    _no_new_children(before)


# ---------------------------------------------------------------------- mpi that works
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on the PATH (apt-get install openmpi-bin)")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None,
                    reason='mpi4py is not installed (pip install "colossal-lab[mpi]")')
def test_mpi_launch_runs_on_both_ranks():
    before = _children()
    with cl.launch(n=2, backend="gloo", launcher="mpi", config=_mpi_config(), master_addr="127.0.0.1",
                   threads=1, start_timeout=120) as cluster:
        import torch.distributed as dist

        assert cluster.run(dist.get_rank) == [0, 1]
        assert cluster.run(dist.get_world_size) == [2, 2]
        assert cluster.config.launcher == "mpi"
    _no_new_children(before)
