"""Two "hosts" on one machine, made by the test itself: network namespaces joined by a veth pair.

Each host is a Linux network namespace (``ip netns``) with its own UTS namespace (its own
hostname) and an address that exists only inside the pair, so a process on one host reaches the
other only over the veth link, by address or by name. Names resolve through ``ip netns exec``'s
own mechanism: the files in ``/etc/netns/<name>/`` (here ``hosts``) replace ``/etc``'s inside
that namespace. Each host runs its own ``sshd`` (a host key, a config and a port made for the run;
key authentication with a key made for the run, root allowed, no PAM), and an ssh client config
(``ssh -F``) names both hosts. The filesystem is shared, so one ``.venv`` serves both hosts.

The driver — the process that calls ``cl.launch``, standing in for a notebook kernel — runs on
host A (``Rig.launch`` starts ``host_driver.py`` there; ``Driver`` sends it one JSON command a line
and reads one JSON line back, like notebook cells).

Everything is named after the creating process's pid, so parallel runs never collide; a rig whose
creator is gone (a crashed run) is removed by the next ``Rig``. ``Rig.close`` kills every process
in both namespaces (``ip netns pids``) and deletes them.

What a machine needs (``missing()`` says which is absent): root, ``ip`` (iproute2), ``unshare``
(util-linux), ``sshd``/``ssh`` (openssh-server/-client); ``scripts/setup.sh --hosts``
installs them on Debian.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

PREFIX = "clrig"  # namespaces are PREFIX<pid>a / PREFIX<pid>b
NETNS_ETC = Path("/etc/netns")
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SSH_PORT = 2222
DRIVER = Path(__file__).with_name("host_driver.py")


def missing() -> Optional[str]:
    """Why a rig cannot be made on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and sshd)"
    for prog, pkg in (("ip", "iproute2"), ("unshare", "util-linux"), ("ssh", "openssh-client"),
                      ("ssh-keygen", "openssh-client"), (SSHD, "openssh-server")):
        if shutil.which(prog) is None:
            return f"needs {prog} ({pkg}; bash scripts/setup.sh --hosts installs it)"
    probe = f"{PREFIX}probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _sh(*cmd: str, check: bool = True) -> str:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def netns_pids(ns: str) -> List[int]:
    """Every process in namespace ``ns`` (none when it does not exist)."""
    out = _sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in out.split()]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _kill_all(ns: str) -> None:
    for _ in range(50):
        pids = netns_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _remove(ns: str) -> None:
    _kill_all(ns)
    _sh("ip", "netns", "delete", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def clean_stale() -> None:
    """Remove rigs whose creating process no longer exists (a crashed or killed run)."""
    names = set(_sh("ip", "netns", "list", check=False).split()) | (
        {p.name for p in NETNS_ETC.iterdir()} if NETNS_ETC.is_dir() else set())
    for name in names:
        m = re.fullmatch(rf"{PREFIX}(\d+)[ab]", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _remove(name)


class Host:
    """One end of the rig: namespace ``ns``, hostname ``name``, address ``addr``."""

    def __init__(self, ns: str, name: str, addr: str):
        self.ns, self.name, self.addr = ns, name, addr

    def prefix(self) -> List[str]:
        """Command prefix that runs a program on this host (its namespaces, its hostname)."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.name} && exec "$0" "$@"']

    def pids(self) -> List[int]:
        return netns_pids(self.ns)

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.addr}, netns {self.ns})"


class Rig:
    """Hosts ``a`` (the driver's) and ``b`` (the far one), both running sshd; ``ssh_config`` is the
    client config every ssh (the launchers', Open MPI's) is given with ``-F``."""

    def __init__(self):
        clean_stale()
        pid = os.getpid()
        net = f"10.250.{pid % 250}"
        self.a = Host(f"{PREFIX}{pid}a", "hosta", f"{net}.1")
        self.b = Host(f"{PREFIX}{pid}b", "hostb", f"{net}.2")
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-"))
        self.ssh_config = self.dir / "ssh_config"
        self._sshd: Dict[str, subprocess.Popen] = {}
        try:
            self._network()
            self._keys()
            for h in (self.a, self.b):
                self._start_sshd(h)
            for h in (self.a, self.b):
                self._wait_ssh(h)
        except BaseException:
            self.close()
            raise

    @property
    def hosts(self) -> List[Host]:
        return [self.a, self.b]

    # ------------------------------------------------------------------ set-up
    def _network(self) -> None:
        a, b = self.a, self.b
        va, vb = f"{a.ns}v"[-15:], f"{b.ns}v"[-15:]  # interface names: at most 15 characters
        for h in (a, b):
            _sh("ip", "netns", "add", h.ns)
            etc = NETNS_ETC / h.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{a.addr} {a.name}\n{b.addr} {b.name}\n")
        _sh("ip", "link", "add", va, "netns", a.ns, "type", "veth", "peer", "name", vb, "netns", b.ns)
        for h, dev in ((a, va), (b, vb)):
            x = ["ip", "netns", "exec", h.ns]
            _sh(*x, "ip", "link", "set", "lo", "up")
            _sh(*x, "ip", "addr", "add", f"{h.addr}/24", "dev", dev)
            _sh(*x, "ip", "link", "set", dev, "up")

    def _keys(self) -> None:
        d = self.dir
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key"))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "id"))
        shutil.copy(d / "id.pub", d / "authorized_keys")
        (d / "sshd_config").write_text(
            f"Port {SSH_PORT}\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPidFile none\n"
            "MaxStartups 100\nMaxSessions 100\nLogLevel ERROR\nSubsystem sftp internal-sftp\n")
        hosts = "".join(f"Host {h.name} {h.addr}\n  HostName {h.addr}\n" for h in self.hosts)
        self.ssh_config.write_text(
            hosts + f"Host *\n  Port {SSH_PORT}\n  User root\n  IdentityFile {d / 'id'}\n"
            "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n  BatchMode yes\n  ConnectTimeout 10\n")
        os.chmod(d, 0o755)

    def _start_sshd(self, h: Host) -> None:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        log = open(self.dir / f"sshd-{h.name}.log", "w")
        self._sshd[h.name] = subprocess.Popen(
            h.prefix() + [SSHD, "-D", "-e", "-f", str(self.dir / "sshd_config"), "-o", f"ListenAddress {h.addr}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _wait_ssh(self, h: Host, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            r = subprocess.run(self.a.prefix() + ["ssh", "-F", str(self.ssh_config), h.name, "hostname"],
                               capture_output=True, text=True)
            if r.returncode == 0 and r.stdout.strip() == h.name:
                return
            if time.monotonic() > deadline:
                log = (self.dir / f"sshd-{h.name}.log").read_text()
                raise RuntimeError(f"sshd on {h} did not answer: {r.stderr.strip()} {r.stdout.strip()}; "
                                   f"its log: {log}")
            time.sleep(0.2)

    # ------------------------------------------------------------------ use
    def launch(self, launcher: str, hosts: Dict[str, int], **spec) -> "Driver":
        """Start the driver on host A with a cluster of ``hosts`` (host name -> ranks there)."""
        spec = {"launcher": launcher, "hosts": hosts, "ssh_config": str(self.ssh_config),
                "tmp": str(self.dir), **spec}
        return Driver(self.a.prefix() + [sys.executable, str(DRIVER), json.dumps(spec)], self.dir, launcher)

    @contextlib.contextmanager
    def cluster(self, launcher: str, hosts: Dict[str, int]):
        """A driver on host A with its cluster up (``hosts``: host name -> ranks there), stopped
        after. Prints the launch time and launch to stop (the figures docs/multihost.md quotes).
        ``launcher="mpi"`` needs Open MPI (the hostfile and ``plm_rsh_agent`` are in its terms)."""
        import pytest

        from support.mpi import open_mpi

        if launcher == "mpi" and not open_mpi():
            pytest.skip("launcher='mpi' on the rig needs Open MPI's mpiexec (bash scripts/setup.sh --hosts)")
        t = time.monotonic()
        d = self.launch(launcher, hosts)
        try:
            ready = d.line(timeout=300)
            print(f"{launcher} launch: {ready['start_s']:.1f}s")
            yield d
        finally:
            d.close()
            print(f"{launcher} cluster, launch to stop: {time.monotonic() - t:.1f}s")

    def others(self, h: Host) -> List[int]:
        """Processes on host ``h`` other than its sshd listener (what a launch may leave behind)."""
        return [p for p in h.pids() if p != self._sshd[h.name].pid]

    def close(self) -> None:
        for h in (self.a, self.b):
            _remove(h.ns)
        for p in self._sshd.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Rig":
        return self

    def __exit__(self, *exc) -> None:
        self.close()



class Driver:
    """The driver process (``host_driver.py``): one JSON command in, one JSON line out."""

    def __init__(self, argv: List[str], folder: Path, launcher: str = ""):
        self.launcher = launcher
        self.log = folder / f"driver-{time.monotonic_ns()}.err"
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "w"), text=True, cwd=os.getcwd(),
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.pid = self.proc.pid  # ip netns exec, unshare and sh exec into python: the driver itself
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def line(self, timeout: float) -> dict:
        """The driver's next JSON line (an AssertionError with its log when it dies or is silent)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            if self.proc.poll() is None:  # its threads' stacks into its log (faulthandler)
                os.kill(self.proc.pid, signal.SIGUSR1)
                time.sleep(1)
            raise AssertionError(f"the driver said nothing for {timeout}s; its log:\n{self.stderr()}") from None
        if line is None:
            raise AssertionError(f"the driver exited ({self.proc.wait()}); its log:\n{self.stderr()}")
        return json.loads(line)

    def ask(self, cmd: str, timeout: float = 300, **args) -> dict:
        self.send(cmd, **args)
        return self.line(timeout)

    def send(self, cmd: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def result(self, cmd: str, timeout: float = 300, **args):
        out = self.ask(cmd, timeout, **args)
        assert "result" in out, out.get("error", out)
        return out["result"]

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")[-8000:]

    def close(self) -> None:
        """Stop the cluster (a command) and the driver; kill it if it does not go."""
        if self.proc.poll() is None:
            try:
                self.ask("stop", timeout=120)
            except Exception:
                pass
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
