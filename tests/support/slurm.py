"""A one-node Slurm of Debian's packages (munged, slurmctld, slurmd), started in a folder of its own for
a test module and stopped with everything it ran.

Nothing touches the machine's own Slurm or munge set-up: the key, the socket, the state, the logs and
``slurm.conf`` live under ``root``; the daemons listen on loopback ports picked free; the clients
(``sbatch``, ``squeue``, ``scancel``, and ipyparallel's launcher through them) find the cluster through
``SLURM_CONF``. The node is this machine under the name Slurm requires (its short hostname), with its
CPUs, so a job asking more tasks than cores is refused the way a real site refuses it.

Needs root (slurmd starts jobs as any user) and the packages ``slurmctld slurmd slurm-client munge``
(``bash scripts/setup.sh --hosts`` installs them); :func:`missing` says what is absent.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")


def missing() -> Optional[str]:
    """Why a one-node Slurm cannot start here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as their users)"
    absent = [p for p in PROGRAMS if shutil.which(p) is None and not os.path.exists(f"/usr/sbin/{p}")]
    if absent:
        return (f"{', '.join(absent)} not installed (bash scripts/setup.sh --hosts, or apt-get install "
                f"slurmctld slurmd slurm-client munge)")
    return None


def _which(program: str) -> str:
    return shutil.which(program) or f"/usr/sbin/{program}"


def _free_ports(k: int) -> List[int]:
    socks = [socket.socket() for _ in range(k)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class OneNodeSlurm:
    """``start()`` brings munged, slurmctld and slurmd up under ``root`` and waits until the node is
    idle; ``stop()`` cancels every job and stops the daemons. ``env`` is what a client needs."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env: Dict[str, str] = {"SLURM_CONF": str(self.conf)}
        self._pids: List[Path] = []

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 60.0) -> "OneNodeSlurm":
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        self._start_munge()
        self._write_conf()
        self._run([_which("slurmctld"), "-f", str(self.conf), "-i"])  # -i: no state from an earlier run
        self._run([_which("slurmd"), "-f", str(self.conf), "-N", self.node])
        self._pids = [self.root / "munge" / "munged.pid", self.root / "slurmctld.pid", self.root / "slurmd.pid"]
        self._wait_idle(timeout)
        return self

    def _start_munge(self) -> None:
        m = self.root / "munge"
        self._run([_which("mungekey"), "-c", "-k", str(m / "munge.key"), "-b", "1024"])
        (m / "munge.key").chmod(0o600)
        # --force: munged refuses root and a socket folder others cannot enter unless told
        self._run([_which("munged"), f"--key-file={m / 'munge.key'}", f"--socket={m / 'munge.sock'}",
                   f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                   f"--seed-file={m / 'seed'}", "--force"])

    def _write_conf(self) -> None:
        r = self.root
        ctld, slurmd = _free_ports(2)
        self.conf.write_text("\n".join([
            "ClusterName=cltest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctld}",
            f"SlurmdPort={slurmd}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge' / 'munge.sock'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            # no cgroups in a container: track a job's processes by their parent, bind nothing
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "SwitchType=switch/none",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            ""]))

    def _run(self, cmd: List[str]) -> None:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=self.client_env())
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}{r.stderr}\n{self.logs()}")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            r = subprocess.run([_which("sinfo"), "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                               env=self.client_env(), timeout=30)
            state = r.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node is {state!r}, not idle, after {timeout:g}s\n{self.logs()}")

    # ------------------------------------------------------------------ use
    def client_env(self) -> Dict[str, str]:
        return dict(os.environ, **self.env)

    def jobs(self) -> List[str]:
        """``"<id> <state>"`` of every job the controller still knows."""
        r = subprocess.run([_which("squeue"), "-h", "-o", "%i %T"], capture_output=True, text=True,
                           env=self.client_env(), timeout=30)
        return [line for line in r.stdout.splitlines() if line.strip()]

    def logs(self) -> str:
        out = []
        for p in sorted((self.root / "log").glob("*.log")) + [self.root / "munge" / "munged.log"]:
            if p.exists():
                out.append(f"[{p.name}]\n" + "".join(p.read_text(errors="replace").splitlines(True)[-15:]))
        return "\n".join(out)

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        subprocess.run([_which("scancel"), "--full", "-u", "root"], capture_output=True, env=self.client_env(),
                       timeout=30)
        deadline = time.monotonic() + 15
        while self.jobs() and time.monotonic() < deadline:
            time.sleep(0.3)
        for pidfile in reversed(self._pids):  # slurmd, slurmctld, munged
            try:
                pid = int(pidfile.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                continue
            end = time.monotonic() + 10
            while time.monotonic() < end and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
