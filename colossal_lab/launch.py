"""``cl.launch``: check the request, then start a ``Cluster``.

Every argument is checked here, in the notebook process, *before* any process starts, so a
typo costs a one-sentence error instead of a half-started cluster to clean up.
"""

from __future__ import annotations

import socket
from typing import Any, Optional

from .cluster import Cluster, LaunchConfig
from .listen import bind_ip
from .startup import check_launcher, check_reachable, route_address

BACKENDS = ("auto", "gloo", "nccl")
START_TIMEOUT = 120.0  # seconds for every engine to start and register (a batch queue may need more)


def engine_launchers() -> list:
    """Names of ipyparallel's engine launchers (``local``, ``mpi``, ``ssh``, ``slurm``, ...)."""
    from importlib.metadata import entry_points

    return sorted({ep.name.lower() for ep in entry_points(group="ipyparallel.engine_launchers")})


def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


# ipyparallel's heartbeats, for engines the notebook cannot watch as local processes: the controller
# pings every second and takes an engine that misses 5 pings for dead (its pending calls fail with
# EngineError: a rank killed on another host is reported in seconds, not ipyparallel's 30 s); an idle
# engine whose controller is gone for 10 checks (1.5 s each) exits. A setting of the caller's wins.
HEARTBEAT_CONTROLLER_ARGS = ["--HeartMonitor.period=1000", "--HeartMonitor.max_heartmonitor_misses=5"]
HEARTBEAT_ENGINE_ARGS = ["--IPEngine.max_heartbeat_misses=10"]
# ipyparallel hands its MPI engines where the controller is through the environment (IPP_*); Open
# MPI's mpiexec passes its environment only to the ranks on its own host, unless told which
# variables to forward (mca_base_env_list, read from mpiexec's environment; other MPIs forward all)
IPP_ENV = ("IPP_CONNECTION_INFO", "IPP_CLUSTER_ID", "IPP_PROFILE_DIR")


def _far_engine_config(launcher: str, ipp_kw: dict, start_timeout: float) -> None:
    """ipyparallel settings for engines that may run on other hosts (the caller's own win): the
    heartbeats above, for ``mpi`` Open MPI forwarding ipyparallel's variables to every host, and for
    ``ssh`` the first ssh to each host allowed ``start_timeout`` (``ssh_launcher.py``)."""
    import copy

    from traitlets.config import Config

    ipp_kw["controller_args"] = HEARTBEAT_CONTROLLER_ARGS + list(ipp_kw.get("controller_args") or [])
    cfg = Config(copy.deepcopy(ipp_kw.get("config") or Config()))
    if "engine_args" not in cfg.EngineLauncher:
        cfg.EngineLauncher.engine_args = list(HEARTBEAT_ENGINE_ARGS)
    if launcher == "mpi":
        env = dict(cfg.MPIEngineSetLauncher.get("environment") or {})
        listed = [v for v in env.get("OMPI_MCA_mca_base_env_list", "").split(";") if v]
        env["OMPI_MCA_mca_base_env_list"] = ";".join(listed + [v for v in IPP_ENV if v not in listed])
        cfg.MPIEngineSetLauncher.environment = env
    if launcher == "ssh" and "probe_timeout" not in cfg.PatientSSHEngineSetLauncher:
        cfg.PatientSSHEngineSetLauncher.probe_timeout = float(start_timeout)
    ipp_kw["config"] = cfg


def make_config(n: Any, backend: str = "auto", launcher: str = "local", *, timeout: float = 300.0,
                start_timeout: float = START_TIMEOUT, master_addr: Optional[str] = None,
                threads: Optional[int] = None, failure_grace: float = 2.0, interrupt_grace: float = 5.0,
                **ipp_kw) -> LaunchConfig:
    """Validate ``launch``'s arguments into a ``LaunchConfig`` (raises ``ValueError``).

    A launcher other than ``local`` is also checked for what it needs on this host (``mpiexec``
    and mpi4py, ``ssh`` and a host list, ``sbatch``/``scancel``): ``LauncherSetupError``, a
    ``ValueError``, names the missing piece and the fix."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"n={n!r}: the number of ranks must be a whole number >= 1, e.g. launch(n=2)")
    if n < 1:
        raise ValueError(f"n={n}: the number of ranks must be at least 1, e.g. launch(n=2)")
    b = str(backend).lower()
    if b not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known: use one of {', '.join(BACKENDS)} "
                         f"('auto' picks nccl when every rank has a GPU, else gloo)")
    lname = str(launcher).lower()
    known = engine_launchers()
    if lname not in known:
        raise ValueError(f"launcher={launcher!r} is not an ipyparallel engine launcher: use one of "
                         f"{', '.join(known)}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r}: the collective timeout must be a positive number of seconds")
    if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) or not start_timeout > 0:
        raise ValueError(f"start_timeout={start_timeout!r}: the wait for engines to start must be a positive "
                         f"number of seconds (default {START_TIMEOUT:g})")
    if "engine_timeout" in ipp_kw:
        raise ValueError(f"engine_timeout={ipp_kw['engine_timeout']!r} is ipyparallel's wait, which cl.launch "
                         f"does not use: pass start_timeout= (seconds to wait for the engines to start)")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads={threads!r}: threads per rank must be a whole number >= 1 (or None)")
    if lname == "local":
        gpus = _local_gpus()
        if b == "nccl" and n > gpus:
            raise ValueError(f"backend='nccl' with n={n} needs {n} GPUs but this machine has {gpus}: "
                             f"use n<={gpus}" + (" or backend='gloo'" if gpus else "; use backend='gloo' on CPU"))
        if b == "auto":
            b = "nccl" if 0 < n <= gpus else "gloo"
        master_addr = master_addr or "127.0.0.1"
    else:
        far = check_launcher(lname, n, ipp_kw)
        # Engines on other hosts must reach the controller and the store this notebook hosts: by
        # default this machine's address on the route to the first of them (where the launcher names
        # them), else its hostname's; pass master_addr= when that is not the interface they reach.
        if master_addr is None:
            master_addr = (route_address(far[0]) if far else None) or socket.gethostbyname(socket.gethostname())
        check_reachable(lname, master_addr, far)
        ipp_kw.setdefault("controller_location", master_addr)
        _far_engine_config(lname, ipp_kw, start_timeout)
    # the controller, the rendezvous store and the relay listen on master_addr's address only,
    # never on every interface (listen.py); the controller of a local launch on loopback
    ip = bind_ip(master_addr)
    ipp_kw.setdefault("controller_ip", "127.0.0.1" if lname == "local" else ip)
    return LaunchConfig(n=n, backend=b, launcher=lname, timeout=float(timeout),
                        start_timeout=float(start_timeout), master_addr=master_addr,
                        threads=threads, failure_grace=float(failure_grace),
                        interrupt_grace=float(interrupt_grace), ipp_kw=ipp_kw)


def launch(n: int, backend: str = "auto", launcher: str = "local", **kw) -> Cluster:
    """Start ``n`` ranks with torch.distributed initialised on each; returns the ``Cluster``.

    Args:
      n: number of ranks (ipyparallel engines).
      backend: ``"auto"`` (nccl when every rank sees a GPU, else gloo), ``"gloo"`` or ``"nccl"``.
      launcher: an ipyparallel engine launcher: ``"local"`` (this machine), ``"mpi"``,
        ``"ssh"``, ``"slurm"``, ... — configure it with ipyparallel's own keyword arguments,
        which pass through (e.g. ``engine_launcher_class``'s options via ``config=``).
      timeout: seconds allowed for rendezvous and for every collective (default 300).
      start_timeout: seconds allowed for every engine to start and register with the controller
        (default 120); an engine that exits first is reported at once, with its log.
      master_addr: address ranks use to reach the rendezvous store hosted by this notebook
        (default 127.0.0.1 for ``local``; otherwise this host's address on the route to the first
        SSH host, or its hostname's address; a loopback address with engines on other hosts is
        refused). The notebook's controller, rendezvous store and relay listen on this address
        only (loopback for ``local``); it must be one of this machine's.
      threads: OMP/torch threads per rank (default: cores / n for ``local``, unless
        ``OMP_NUM_THREADS`` is set).
      failure_grace / interrupt_grace: seconds to let other ranks finish after one fails, and
        to let interrupted ranks stop before they are restarted.
      **kw: passed to ``ipyparallel.Cluster`` (``profile``, ``config``, ...).

    Raises ``ValueError`` for a bad argument and ``LauncherSetupError`` (a ``ValueError``) when
    the launcher lacks something on this host, both before any process starts;
    ``EngineStartError`` when an engine exits during start-up; ``TimeoutError`` after
    ``start_timeout``.
    """
    cfg = make_config(n, backend, launcher, **kw)
    return Cluster(cfg).start()
