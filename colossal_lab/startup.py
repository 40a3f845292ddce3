"""Start-up for ``cl.launch`` past one machine: what each launcher needs, checked before any
process starts, and a wait for engines that reports a dead engine at once, with its own log.

ipyparallel hands a launcher's failures to the engines' log files: an MPI engine that cannot
import mpi4py, an ``mpiexec`` that refuses to run, an engine command that does not exist all end
as "N engines not ready" after ipyparallel's own wait. Here each launcher's prerequisites are
checked in the notebook process (a missing program or package fails in well under a second with
the fix), and while waiting for engines every local process the launcher started is watched: the
first one that exits ends the wait with the tail of its log. ``start_timeout`` is the one wait.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from . import batchjobs
from .errors import EngineStartError, LauncherSetupError

MPI_FIX = 'pip install "colossal-lab[mpi]"'
MPIEXEC_FIX = "apt-get install openmpi-bin"
_TAIL_LINES = 25


# ---------------------------------------------------------------------- prerequisites
def check_launcher(launcher: str, n: int, ipp_kw: Dict[str, Any]) -> List[str]:
    """Raise ``LauncherSetupError`` when ``launcher`` cannot start ``n`` engines from here; else
    return the hosts other than this one that it will start engines on, where it names them (ssh).

    The launcher is configured exactly as ``Cluster.start`` will configure it (``ipp_kw``,
    including ``config=`` and the profile's own config), but nothing is started."""
    from ipyparallel.cluster import launcher as L

    es = _engine_set(launcher, n, ipp_kw)
    if isinstance(es, L.MPILauncher):
        _check_mpi(launcher, es)
    if isinstance(es, L.SSHLauncher):
        _check_ssh(launcher, es, n)
        return far_hosts(getattr(es, "engines", None) or {})
    if isinstance(es, L.BatchSystemLauncher):
        _check_batch(launcher, es)
    return []


def far_hosts(hosts) -> List[str]:
    """The hosts (``user@`` dropped) of an SSH engines setting that are not this machine."""
    here = {"localhost", socket.gethostname(), socket.getfqdn()}
    out = []
    for entry in hosts:
        host = str(entry).rpartition("@")[2]
        if host not in here and not _is_loopback(host) and host not in out:
            out.append(host)
    return out


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def route_address(host: str) -> Optional[str]:
    """This machine's address on the route to ``host`` (what the kernel would send from; a UDP
    socket's ``connect`` picks it and sends nothing), or None when ``host`` does not resolve."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if _is_loopback(addr) else addr


def check_reachable(launcher: str, master_addr: str, far: List[str]) -> None:
    """Engines on other hosts connect back to ``master_addr`` (the controller and the rendezvous
    store): a loopback address there is this host only, on theirs."""
    if far and _is_loopback(master_addr):
        raise LauncherSetupError(
            launcher, "an address the other hosts can reach",
            "pass master_addr= with this machine's address on the network the hosts share (one of "
            "`hostname -I`)",
            detail=f"master_addr={master_addr!r} is a loopback address, which the engines on "
                   f"{', '.join(far)} would take for their own host")


def engine_launcher(launcher: str):
    """What ``ipyparallel.Cluster(engines=...)`` is given: the launcher's name, except for ``ssh``, whose own
    subclass waits ``start_timeout`` for its first ssh to each host rather than a fixed 10 s (ssh_launcher.py)."""
    if launcher == "ssh":
        from .ssh_launcher import PatientSSHEngineSetLauncher

        return PatientSSHEngineSetLauncher
    return launcher


def _engine_set(launcher: str, n: int, ipp_kw: Dict[str, Any]):
    """An unstarted engine-set launcher, configured as ``ipyparallel.Cluster`` would."""
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=n, engines=launcher, **ipp_kw)
    return cluster.engine_launcher_class(work_dir=".", parent=cluster, log=cluster.log,
                                         profile_dir=cluster.profile_dir, cluster_id=cluster.cluster_id,
                                         engine_set_id="check")


def _config_name(es) -> str:
    return f"c.{type(es).__name__}"


def _check_mpi(launcher: str, es) -> None:
    mpiexec = (list(es.mpi_cmd) or ["mpiexec"])[0]
    if shutil.which(mpiexec) is None:
        raise LauncherSetupError(
            launcher, repr(mpiexec),
            f"install an MPI ({MPIEXEC_FIX} on Debian/Ubuntu, or load your site's MPI module) or set "
            f"{_config_name(es)}.mpi_cmd to your MPI's launcher (config=)",
            detail=f"'{mpiexec}' is not on the PATH")
    python = (list(es.engine_cmd) or [sys.executable])[0]
    has = python_has_module(python, "mpi4py")
    if has is False:
        raise LauncherSetupError(
            launcher, "mpi4py",
            f'{MPI_FIX} (or: {python} -m pip install mpi4py)',
            detail=f"ipyparallel's MPI engines import mpi4py, and the Python they run ({python}) cannot "
                   f"import it")


def python_has_module(python: str, module: str) -> Optional[bool]:
    """Whether the interpreter ``python`` can import ``module``: in this process when it is this
    interpreter, else by asking it (``None`` when that cannot be told: not a Python, or no answer
    within a few seconds)."""
    path = shutil.which(python)
    if path is None:
        return None
    if os.path.abspath(path) == os.path.abspath(sys.executable):
        return importlib.util.find_spec(module) is not None
    if not os.path.basename(path).startswith("python"):
        return None
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 3)"
    try:
        rc = subprocess.run([path, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, timeout=4).returncode
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: True, 3: False}.get(rc)


def _check_ssh(launcher: str, es, n: int) -> None:
    hosts = getattr(es, "engines", None)  # None: a launcher for one host (sshproxy), set by its location
    if hosts is not None:
        example = '{"node1": 2, "node2": 2}'
        if not hosts:
            raise LauncherSetupError(
                launcher, "the hosts to start engines on",
                f"pass config= with {_config_name(es)}.engines = {example} (host -> number of engines; "
                f"config is a traitlets.config.Config)",
                detail="no hosts were given")
        slots = sum(int(v.get("n", 1)) if isinstance(v, dict) else int(v) for v in hosts.values())
        if slots < n:
            raise LauncherSetupError(
                launcher, f"{n} engine slots",
                f"give {_config_name(es)}.engines at least n={n} engines in all, or launch fewer ranks",
                detail=f"the hosts in {_config_name(es)}.engines have {slots} in all ({dict(hosts)})")
    ssh = (list(es.ssh_cmd) or ["ssh"])[0]
    if shutil.which(ssh) is None:
        raise LauncherSetupError(
            launcher, repr(ssh),
            f"install an SSH client (apt-get install openssh-client) or set {_config_name(es)}.ssh_cmd",
            detail=f"'{ssh}' is not on the PATH")


def _check_batch(launcher: str, es) -> None:
    """The scheduler's submit and delete commands (``sbatch``/``scancel`` for Slurm): ipyparallel
    submits the engines as one job and cancels it to stop them."""
    from ipyparallel.cluster import launcher as L

    client = "apt-get install slurm-client, or load your site's Slurm module" if isinstance(
        es, L.SlurmLauncher) else "load your site's scheduler module"
    for trait, purpose in (("submit_command", "submit the engines' job"), ("delete_command", "stop it")):
        cmd = (list(getattr(es, trait, []) or []) or [""])[0]
        if cmd and shutil.which(cmd) is None:
            raise LauncherSetupError(
                launcher, repr(cmd),
                f"run the notebook on a host where the scheduler's commands work (e.g. a login node; "
                f"{client}), or set {_config_name(es)}.{trait} (config=)",
                detail=f"'{cmd}' (to {purpose}) is not on the PATH")
    options = getattr(es, "options", "")
    template = getattr(es, "batch_template", "") or getattr(es, "default_template", "")
    if options and "{options}" not in template:
        raise LauncherSetupError(
            launcher, "its Slurm options in the job script",
            f"put them on the submit command instead: {_config_name(es)}.submit_command = "
            f"['sbatch', {', '.join(repr(o) for o in str(options).split())}] (or write them into "
            f"{_config_name(es)}.batch_template as #SBATCH lines)",
            detail=f"ipyparallel's Slurm job script has no place for {_config_name(es)}.options = {options!r}: "
                   f"it would be dropped without a word")


# ---------------------------------------------------------------------- waiting for engines
def wait_for_engines(ipp_cluster, client, n: int, start_timeout: float, launcher: str = "") -> None:
    """Wait until ``n`` engines have registered with ``client``.

    Raises ``EngineStartError`` as soon as a local process the launcher started (an engine, an
    ``mpiexec``, the controller) has exited, with the end of its log; ``TimeoutError`` naming
    ``start_timeout`` when the engines are not all there in time."""
    deadline = time.monotonic() + start_timeout
    next_job_look = 0.0  # a batch job is asked about once a second (a scheduler query, not a poll)
    while True:
        ready = len(client.ids)
        if ready >= n:
            return
        dead = exited_processes(ipp_cluster)
        if dead:
            label, tail = dead[0]
            raise EngineStartError(
                f"{label} exited during start-up, before all engines were ready ({ready} of {n} "
                f"registered, launcher={launcher!r}); the end of its log:\n{_indent(tail)}",
                log_tail=tail)
        if time.monotonic() >= next_job_look:
            next_job_look = time.monotonic() + 1.0
            _raise_if_job_ended(ipp_cluster, client, n, launcher)
        if time.monotonic() > deadline:
            logs = _log_tails(ipp_cluster)
            raise TimeoutError(
                f"{n - ready} of {n} engines were not ready within start_timeout={start_timeout:g}s "
                f"({ready} ready, launcher={launcher!r}{batchjobs.waiting_note(ipp_cluster)}): pass a larger "
                f"start_timeout= if they are slow to start (e.g. a batch queue)"
                + (", else see the engines' logs below" if logs else "")
                + " (timeout= is the collective timeout, not this wait)" + (f"\n{logs}" if logs else ""))
        time.sleep(0.1)


def _raise_if_job_ended(ipp_cluster, client, n: int, launcher: str) -> None:
    """``EngineStartError`` when the engines' batch job will start no engine any more: it has ended
    (its engines exited, or the scheduler ended it; with the job's own output) or it waits in the
    queue for a reason that will not change (with Slurm's reason and what to change)."""
    stuck = batchjobs.stuck_job(ipp_cluster)
    if stuck is None or len(client.ids) >= n:  # none, or the last engine registered meanwhile
        return
    st, output = stuck
    ready = f"{len(client.ids)} of {n} registered, launcher={launcher!r}"
    if st.hopeless:
        raise EngineStartError(
            f"{st}: Slurm will not run the engines' job as submitted ({ready}); ask for what the partition "
            f"offers (fewer ranks, a shorter time limit) or another partition "
            f"(SlurmEngineSetLauncher.queue, through config=); `scontrol show partition` says what it offers")
    try:
        with open(output, errors="replace") as f:
            tail = _last_lines(f.read()) or "(the output is empty)"
    except OSError:
        tail = "(no output file)"
    raise EngineStartError(
        f"Slurm job {st.job_id} ended ({st.state}{', ' + st.reason if st.reason not in ('', 'None') else ''}) "
        f"before all engines were ready ({ready}); the end of its output [{output}]:\n{_indent(tail)}",
        log_tail=tail)


def start_failure(ipp_cluster, exc: BaseException) -> Optional[EngineStartError]:
    """The error to raise instead of ``exc`` when starting the controller or engines failed in a way
    a user can act on (a batch job the scheduler refused, with its reason); None otherwise."""
    why = batchjobs.refused_submission(ipp_cluster, exc)
    return EngineStartError(why, log_tail=why) if why else None


def _process_launchers(ipp_cluster) -> List[Tuple[str, Any]]:
    """(label, launcher) for every launcher whose process runs on this host and *is* the engine
    (or mpiexec, or the controller): ssh and batch launchers' local processes exit by design."""
    from ipyparallel.cluster import launcher as L

    def local(lnc) -> bool:
        return isinstance(lnc, L.LocalProcessLauncher) and not isinstance(lnc, L.SSHLauncher)

    out = []
    ctl = getattr(ipp_cluster, "controller", None)
    if ctl is not None and local(ctl):
        out.append(("the ipyparallel controller", ctl))
    for es in list(getattr(ipp_cluster, "engines", {}).values()):
        subs = getattr(es, "launchers", None)
        if isinstance(subs, dict):
            out.extend((f"engine process {ident}", lnc) for ident, lnc in list(subs.items()) if local(lnc))
        elif local(es):
            name = os.path.basename((list(getattr(es, "args", []) or ["engines"]))[0])
            out.append((f"the engine launcher {name}", es))
    return out


def exited_processes(ipp_cluster) -> List[Tuple[str, str]]:
    """(label, log tail) of each launched local process that has exited; [] while all run."""
    import psutil

    dead = []
    for es in list(getattr(ipp_cluster, "engines", {}).values()):
        # an engine set that already noticed a stop moved the engine out of ``launchers``
        stopped = getattr(es, "stop_data", None)
        if isinstance(stopped, dict) and isinstance(getattr(es, "launchers", None), dict):
            for ident, data in dict(stopped.get("engines", {})).items():
                dead.append((f"engine process {ident} (exit code {data.get('exit_code')})",
                             _last_lines(getattr(es, "outputs", {}).get(ident, ""))))
    for label, lnc in _process_launchers(ipp_cluster):
        proc = getattr(lnc, "process", None)
        if proc is None and getattr(lnc, "state", "") != "after":
            continue
        try:
            gone = lnc.state == "after" or not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            gone = True
        if gone:
            pid = getattr(lnc, "pid", -1)
            dead.append((f"{label} (pid {pid})" if pid > 0 else label, _tail(lnc)))
    return dead


def _tail(lnc) -> str:
    """The end of a launcher's output file (or what ipyparallel kept after removing the file)."""
    path = getattr(lnc, "output_file", "") or ""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        try:
            text = lnc.get_output() or ""
        except Exception:
            text = ""
    where = f"[{path}]\n" if path and os.path.exists(path) else ""
    return where + (_last_lines(text) or "(the log is empty)")


def _log_tails(ipp_cluster, limit: int = 4) -> str:
    ctl = getattr(ipp_cluster, "controller", None)
    engines = [(label, lnc) for label, lnc in _process_launchers(ipp_cluster) if lnc is not ctl]
    return "\n".join(f"{label}:\n{_indent(_tail(lnc))}" for label, lnc in engines[:limit])


def _last_lines(text: str, lines: int = _TAIL_LINES) -> str:
    return "".join((text or "").splitlines(True)[-lines:]).rstrip()


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
