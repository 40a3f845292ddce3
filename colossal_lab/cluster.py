"""``Cluster``: N ranks with torch.distributed up, driven from a notebook, on ipyparallel.

Built on ipyparallel (controller, engines, launchers for local/MPI/SSH/Slurm, remote
tracebacks, control-channel signals) and torch.distributed (TCPStore rendezvous, process
groups). What we add, and why:

* **Ranks, not engine ids.** Engine ids are assigned by registration order and survive
  restarts as new numbers; we assign ranks ourselves (grouped by host, so LOCAL_RANK and the
  GPU index are right across machines) and keep a rank -> engine map. Everything returns and
  reports by rank.
* **Rendezvous without a port race.** The kernel hosts the TCPStore on port 0 (the OS picks and
  keeps a free port), listening on ``master_addr`` only (``listen.py``); ranks join it as
  clients and namespace their keys by a *generation*, so a process group rebuilt after a
  failure never sees stale keys.
* **Failures never leave ranks hung.** A rank that raises is usually followed by its peers
  blocking in the next collective. A gloo/NCCL collective cannot be interrupted from Python
  (the signal waits until the C++ call returns) and ``abort`` does not unblock gloo, so after a
  failure (or Ctrl-C) we: wait ``failure_grace`` s for the other ranks, send SIGINT to those
  still running, and if any are still running ``interrupt_grace`` s later (blocked in C++),
  first make the other ranks leave the process group, which ends the blocked collective (its
  connections close); only ranks still blocked after that are killed and the engines restarted.
  Ranks that were merely interrupted keep their variables, but their collective counters may
  disagree, so the default process group is rebuilt. The error says which of the two happened.
* **The error first, the restart after.** When a rank died or is stuck, every rank's process is
  killed at once (through its ipyparallel nanny, which signals its engine on any host and tells
  the controller it is gone), the error is raised, and fresh engines start in a background
  thread: over ssh a restart is many round trips, and the user should not wait for it to learn
  what failed. The next call (and ``pids``, ``restart``, ``stop``) waits for that restart.
* **Bounded collectives.** ``timeout`` bounds every collective; a timeout is reported as
  such, with its likely cause, and the broken process group is rebuilt.
* **Functions travel with what they use.** A function defined in the notebook is sent by
  value with the helpers, constants and modules it uses, and every argument is pickled once
  for all ranks before any rank is sent anything (``shipping.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from .batchjobs import forget_ended, place_job_script, remove_job_scripts
from .errors import RankError, RankFailure, clean_traceback, is_collective_timeout
from .listen import store_listener
from .startup import engine_launcher, start_failure, wait_for_engines

_current: Optional["Cluster"] = None
_live: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


def current_cluster() -> "Cluster":
    """The cluster the magics act on: the last one launched (by ``cl.launch`` or ``%colossal``)."""
    if _current is None or not _current.running:
        raise RuntimeError("no colossal-lab cluster is running: start one with cl.launch(n=2) "
                           "or %colossal launch -n 2")
    return _current


def _set_current(c: Optional["Cluster"]) -> None:
    global _current
    _current = c


@dataclass
class LaunchConfig:
    """What ``cl.launch`` was asked for, after validation (see ``launch.py``)."""

    n: int
    backend: str                  # "gloo" or "nccl" (resolved) or "auto" (resolved after probing)
    launcher: str                 # an ipyparallel engine launcher name: local, mpi, ssh, slurm, ...
    timeout: float = 300.0        # seconds: rendezvous and every collective
    start_timeout: float = 120.0  # seconds: the wait for every engine to register
    master_addr: Optional[str] = None
    threads: Optional[int] = None  # OMP/torch threads per rank
    failure_grace: float = 2.0    # after a rank fails, how long the others may still finish
    interrupt_grace: float = 5.0  # after SIGINT, how long before stuck ranks are restarted
    ipp_kw: Dict[str, Any] = field(default_factory=dict)


class Cluster:
    """N ranks (ipyparallel engines) with the default torch.distributed process group up.

    Create with ``cl.launch``; use ``run``/``push``/``pull``/``status``/``restart``/``stop`` or
    ``with cl.launch(...) as cluster:``. A function given to ``run`` that the ranks cannot
    import (one defined in the notebook) is shipped by value with the helpers, constants and
    modules it uses; names the notebook does not define are looked up on the rank. Functions
    the ranks can import are shipped by reference.
    """

    def __init__(self, config: LaunchConfig):
        self.config = config
        self._ipp = None
        self._client = None
        self._store = None
        self._engines: List[int] = []        # rank -> ipyparallel engine id
        self._info: List[Dict[str, Any]] = []  # rank -> probe facts (host, pid, gpus)
        self._local_rank: List[int] = []
        self._generation = 0
        self.backend = config.backend
        self.master_addr = config.master_addr or "127.0.0.1"
        self.master_port: Optional[int] = None
        self._lock = threading.RLock()
        # called with the cluster after every restart (explicit or after a stuck failure), so
        # rank-side state others installed (e.g. the telemetry relay) can be re-installed
        self.restart_hooks: List[Callable[["Cluster"], None]] = []
        self._warden = None  # subprocess.Popen of colossal_lab._warden (launchers other than local)
        self._restarting: Optional[threading.Thread] = None  # the restart after a failure, if under way
        self._restart_error: Optional[BaseException] = None
        self._stopping = threading.Event()  # set by stop(): a restart under way gives up instead of finishing

    # ------------------------------------------------------------------ properties
    @property
    def n(self) -> int:
        return self.config.n

    @property
    def ranks(self) -> List[int]:
        return list(range(self.config.n))

    @property
    def running(self) -> bool:
        return self._client is not None

    @property
    def engine_ids(self) -> List[int]:
        """ipyparallel engine id of each rank (rank order)."""
        self._settle()
        return list(self._engines)

    @property
    def pids(self) -> List[int]:
        self._settle()
        return [i["pid"] for i in self._info]

    @property
    def client(self):
        """The ipyparallel ``Client`` (for anything we do not wrap)."""
        return self._client

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<colossal_lab.Cluster n={self.n} backend={self.backend} launcher={self.config.launcher} {state}>"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Cluster":
        """Start the controller and engines, assign ranks, bring torch.distributed up."""
        import ipyparallel as ipp
        import torch.distributed as dist

        cfg = self.config
        kw = dict(cfg.ipp_kw)
        kw.setdefault("delay", 0)  # engines wait for the controller's connection info anyway
        kw.setdefault("log_level", logging.WARNING)
        self._ipp = ipp.Cluster(n=cfg.n, engines=engine_launcher(cfg.launcher), **kw)
        place_job_script(self._ipp)  # a batch launcher's script: not into the notebook's folder
        _live.add(self)
        try:
            # start_and_connect_sync, minus the progress bar it draws in a notebook
            try:
                self._ipp.start_cluster_sync()
            except Exception as e:
                better = start_failure(self._ipp, e)
                if better is None:
                    raise
                raise better from e
            self._start_warden()
            self._client = self._ipp.connect_client_sync()
            wait_for_engines(self._ipp, self._client, cfg.n, cfg.start_timeout, cfg.launcher)
            self._store = self._host_store(dist, cfg)
            self.master_port = self._store.port
            _register_atexit()  # after ipyparallel's own handler, so ours runs first (LIFO)
            self._assign_ranks(self._client.ids)
            self._init_dist()
        except BaseException:
            self.stop()
            raise
        _set_current(self)
        return self

    def _host_store(self, dist, cfg: LaunchConfig):
        """The rendezvous store, listening on ``master_addr`` only (``TCPStore`` itself would
        bind every interface; ``listen.store_listener`` binds the one the ranks use)."""
        fd, port = store_listener(self.master_addr)
        try:
            return dist.TCPStore(self.master_addr, port, cfg.n + 1, is_master=True,
                                 wait_for_workers=False, timeout=timedelta(seconds=cfg.timeout),
                                 master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            raise

    def _assign_ranks(self, engine_ids: Sequence[int]) -> None:
        """Probe engines and give them ranks: grouped by host, then by engine id."""
        ids = sorted(engine_ids)[: self.n]
        probes = self._client[ids].apply_async(_rank_fn("probe")).get(timeout=self.config.timeout)
        order = sorted(zip(ids, probes), key=lambda t: (t[1]["host"], t[0]))
        self._engines = [eid for eid, _ in order]
        self._info = [p for _, p in order]
        seen: Dict[str, int] = {}
        self._local_rank = []
        for p in self._info:
            self._local_rank.append(seen.get(p["host"], 0))
            seen[p["host"]] = seen.get(p["host"], 0) + 1
        if self.backend == "auto":
            every_rank_has_gpu = all(lr < p["gpus"] for lr, p in zip(self._local_rank, self._info))
            self.backend = "nccl" if every_rank_has_gpu else "gloo"
        elif self.backend == "nccl":
            short = [r for r, (lr, p) in enumerate(zip(self._local_rank, self._info)) if lr >= p["gpus"]]
            if short:
                raise ValueError(f"backend='nccl' needs one GPU per rank, but ranks {short} have none on "
                                 f"their host; launch fewer ranks per host or use backend='gloo'")

    def _start_warden(self) -> None:
        """With ranks possibly on other hosts (any launcher but ``local``), a process beside the
        controller takes it down if this kernel is killed without cleanup (``_warden.py``)."""
        if self.config.launcher == "local":
            return
        import subprocess

        import psutil

        try:
            ctl = self._ipp.controller.process.pid
        except Exception:  # a controller this host does not run (e.g. started over ssh)
            return
        me = psutil.Process()
        self._warden = subprocess.Popen(
            [sys.executable, "-m", "colossal_lab._warden", str(me.pid), repr(me.create_time()), str(ctl)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)

    def _watch_args(self, rank: int):
        """(kernel pid, its start time, pids to take down) for ranks watching this kernel
        (local launcher only): a kernel killed without cleanup still leaves no process."""
        if self.config.launcher != "local":
            return None
        import psutil

        me = psutil.Process()
        ctl = []
        if rank == 0:
            try:
                ctl = [self._ipp.controller.process.pid]
            except Exception:
                pass
        return (me.pid, me.create_time(), ctl)

    def _init_dist(self) -> None:
        """Join every rank to a fresh default process group (a new store generation)."""
        cfg = self.config
        self._generation += 1
        threads = cfg.threads
        if threads is None and cfg.launcher == "local" and "OMP_NUM_THREADS" not in os.environ:
            threads = max(1, (os.cpu_count() or 1) // cfg.n)
        path = [p for p in sys.path if p]
        ars = {r: self._client[eid].apply_async(
                   _rank_fn("setup"), r, cfg.n, self._local_rank[r], self.master_addr, self.master_port,
                   self.backend, cfg.timeout, self._generation, os.getcwd(), path, threads,
                   self._watch_args(r), cfg.launcher != "local")
               for r, eid in enumerate(self._engines)}
        deadline = time.monotonic() + cfg.timeout + 30
        for r, ar in ars.items():
            try:
                ar.get(timeout=max(1.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - reported with rank below
                raise RuntimeError(f"torch.distributed did not come up on rank {r} "
                                   f"(backend={self.backend}, MASTER_ADDR={self.master_addr}, "
                                   f"MASTER_PORT={self.master_port}): {e}") from e

    def stop(self, fast: bool = False) -> None:
        """Stop every rank and the controller; no process is left behind.

        ``fast`` (used at interpreter exit, where Jupyter allows a few seconds before it kills
        the kernel) skips leaving the process group and kills local ranks at once. A restart under
        way in the background (after a failure) is given up, not waited for: the engines it started
        are stopped with the rest."""
        t = self._restarting
        if t is not None and t is not threading.current_thread():
            self._stopping.set()  # restart() leaves its wait for the new engines within 0.1 s
            t.join(5 if fast else 30)
            self._restarting, self._restart_error = None, None
        with self._lock:
            client, ipp_cluster = self._client, self._ipp
            self._client = None
            leftovers = self._local_tree([i["pid"] for i in self._info])  # engines and their nannies
            if fast:
                self._kill(leftovers)
            if client is not None:
                try:
                    if self._engines and not fast:
                        client[self._engines].apply_async(_rank_fn("teardown")).get(timeout=5)
                except Exception:
                    pass
                try:
                    client.close()
                except Exception:
                    pass
            if ipp_cluster is not None:
                _quiet_intended_stop(ipp_cluster)
                try:
                    ipp_cluster.stop_cluster_sync()
                except Exception:
                    pass
                forget_ended(ipp_cluster)
                remove_job_scripts(ipp_cluster)
            self._kill(leftovers)
            if self._warden is not None:
                self._warden.kill()  # it would exit by itself now the controller is gone
                self._warden.wait()
                self._warden = None
            self._ipp = None
            self._store = None
            self._engines = []
            self._info = []
            _live.discard(self)
            if _current is self:
                _set_current(None)

    close = stop

    def restart(self) -> "Cluster":
        """Replace every rank with a fresh process (variables on the ranks are lost)."""
        self._settle()
        with self._lock:
            if not self.running:
                raise RuntimeError("this cluster is stopped; launch a new one with cl.launch(...)")
            old_ids = set(self._client.ids)
            old_pids = [i["pid"] for i in self._info]
            try:
                self._client.abort(targets=self._engines, block=False)
            except Exception:
                pass
            self._kill_local(old_pids)
            self._ipp.stop_engines_sync()
            if self._stopping.is_set():
                raise RuntimeError("restart given up: the cluster is stopping")
            self._ipp.start_engines_sync(self.n)
            deadline = time.monotonic() + max(60.0, self.config.timeout)
            while True:
                new = [e for e in self._client.ids if e not in old_ids]
                if len(new) >= self.n:
                    break
                if self._stopping.is_set():  # stop() ends the engines just started with the rest
                    raise RuntimeError("restart given up: the cluster is stopping")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"restart: only {len(new)} of {self.n} engines came back")
                time.sleep(0.1)
            self._assign_ranks(new)
            self._init_dist()
            _set_current(self)
        for hook in list(self.restart_hooks):
            try:
                hook(self)
            except Exception as e:  # a hook must not make a good restart look failed
                print(f"colossal_lab: restart hook {hook!r} failed: {e}", file=sys.stderr)
        return self

    def rebuild(self, timeout: Optional[float] = None) -> None:
        """Re-create the default process group on every rank, optionally with a new collective
        ``timeout`` (seconds). Variables on the ranks are kept; objects bound to the old group
        (DDP models, device meshes) must be re-created."""
        self._settle()
        if not self.running:
            raise RuntimeError("this cluster is stopped; launch a new one with cl.launch(...)")
        if timeout is not None:
            if not isinstance(timeout, (int, float)) or timeout <= 0:
                raise ValueError(f"timeout={timeout!r}: must be a positive number of seconds")
            self.config.timeout = float(timeout)
        self._init_dist()

    # ------------------------------------------------------------------ restart after a failure
    def _replace(self) -> None:
        """Kill every rank's process now, start fresh ones in a background thread: the caller
        raises its error at once, the next call waits for the new ranks (``_settle``)."""
        self._kill_ranks()
        t = threading.Thread(target=self._restart_in_background, name="colossal-lab-restart", daemon=True)
        self._restarting = t
        t.start()

    def _restart_in_background(self) -> None:
        try:
            self.restart()
        except BaseException as e:  # noqa: BLE001 - handed to the next call by _settle
            self._restart_error = e

    def _settle(self, raise_error: bool = True, timeout: Optional[float] = None) -> None:
        """Wait for a restart under way in the background (``_replace``). If it failed, the
        cluster is stopped (no process left) and the error is raised here, at the call that
        needed the ranks."""
        t = self._restarting
        if t is None or t is threading.current_thread():
            return
        t.join(timeout)
        if t.is_alive():
            return
        self._restarting = None
        err, self._restart_error = self._restart_error, None
        if err is not None:
            self.stop()
            if raise_error:
                raise RuntimeError(f"the ranks could not be restarted after the failure ({err}); the cluster "
                                   f"is stopped: launch a new one with cl.launch(...)") from err

    def _kill_ranks(self) -> None:
        """SIGKILL every rank's process on every host, and wait (bounded) until the controller
        has seen each one go. The signal goes through ipyparallel's nanny, which kills its engine
        (busy in C++ or not) and then unregisters it, so the wait is short; a rank whose nanny is
        gone too is found by the heartbeat (``launch.py`` sets it for launchers past one host)."""
        procs = self._local_tree([i["pid"] for i in self._info])  # local launcher: found while alive
        mine = set(self._engines)
        live = [e for e in self._engines if e in self._client.ids]
        if live:
            try:
                self._client.send_signal(signal.SIGKILL, targets=live, block=False)
            except Exception:
                pass
        deadline = time.monotonic() + 10
        while mine & set(self._client.ids) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._kill(procs)  # whatever a local nanny left

    def _local_tree(self, pids: Iterable[int]) -> list:
        """Engine processes on this host and their descendants (ipyparallel's nannies)."""
        if self.config.launcher != "local":
            return []
        import psutil

        procs = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                procs.extend(p.children(recursive=True))
                procs.append(p)
            except psutil.Error:
                pass
        return procs

    @staticmethod
    def _kill(procs: list) -> None:
        """SIGKILL what is still alive (a rank stuck in C++ never runs its SIGTERM handler)."""
        import psutil

        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)

    def _kill_local(self, pids: Iterable[int]) -> None:
        self._kill(self._local_tree(pids))

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ running code
    def _check(self, ranks: Optional[Iterable[int]]) -> List[int]:
        self._settle()
        if not self.running:
            raise RuntimeError("this cluster is stopped; launch a new one with cl.launch(...)")
        if ranks is None:
            return self.ranks
        ranks = sorted(set(int(r) for r in ranks))
        bad = [r for r in ranks if not 0 <= r < self.n]
        if bad or not ranks:
            raise ValueError(f"ranks {bad or '[]'} do not exist: this cluster has ranks 0..{self.n - 1}")
        return ranks

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> List[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results as a list ordered by rank."""
        return self.run_on(None, fn, *args, **kwargs)

    def run_on(self, ranks: Optional[Iterable[int]], fn: Callable[..., Any], *args, **kwargs) -> List[Any]:
        """Like ``run``, on a subset of ranks (results in rank order)."""
        from .shipping import Call  # imports ipyparallel: on first use, so importing the package needs none

        ranks = self._check(ranks)
        call = Call(fn, args, kwargs)  # pickled here, once: nothing is sent if this raises
        ars = {r: self._client[self._engines[r]].apply_async(call.fn(), *call.args(), **call.kwargs())
               for r in ranks}
        return self._wait(ars)

    def execute(self, code: str, ranks: Optional[Iterable[int]] = None, stream: bool = True) -> None:
        """Run notebook code on ranks, showing each rank's output live under its label."""
        from .output import RankOutput

        ranks = self._check(ranks)
        ars = {r: self._client[self._engines[r]].execute(code, block=False, silent=False) for r in ranks}
        out = RankOutput(ars, stream=stream)
        try:
            self._wait(ars, poll=out.poll)
        finally:
            out.finish()

    def push(self, ns: Dict[str, Any], ranks: Optional[Iterable[int]] = None) -> None:
        """Set variables in the namespace of each rank (``%%colossal`` cells see them)."""
        ranks = self._check(ranks)
        self._wait({r: self._client[self._engines[r]].push(ns, block=False) for r in ranks})

    def pull(self, names, ranks: Optional[Iterable[int]] = None) -> List[Any]:
        """Variables from each rank's namespace, as a list ordered by rank."""
        ranks = self._check(ranks)
        return self._wait({r: self._client[self._engines[r]].pull(names, block=False) for r in ranks})

    def status(self) -> "StatusTable":
        """One row per rank: rank, pid, host, device, memory in use."""
        rows = self.run(_rank_fn("status"))
        for r, row in enumerate(rows):
            row["rank"] = r
            row["engine"] = self._engines[r]
        return StatusTable(rows)

    def interrupt(self, ranks: Optional[Iterable[int]] = None) -> None:
        """Send SIGINT to ranks (over ipyparallel's control channel: works on remote hosts too)."""
        ranks = self._check(ranks)
        fut = self._client.send_signal(signal.SIGINT, targets=[self._engines[r] for r in ranks], block=False)
        try:
            fut.result(timeout=5)  # a dead engine never answers: don't wait for it forever
        except Exception:
            pass

    # ------------------------------------------------------------------ waiting & recovery
    def _wait(self, ars: Dict[int, Any], poll: Optional[Callable[[], None]] = None) -> List[Any]:
        """Wait for every rank; on a failure or Ctrl-C, recover the cluster before raising."""
        try:
            while True:
                if poll:
                    poll()
                pending = [r for r, a in ars.items() if not a.ready()]
                failed = any(not ars[r].successful() for r in ars if r not in pending)
                if failed or not pending:
                    break
                ars[pending[0]].wait(0.05)
        except KeyboardInterrupt:
            note, _ = self._recover(ars, reason="interrupt")
            if poll:
                poll()
            err = KeyboardInterrupt(f"interrupted on ranks {sorted(ars)}. {note}".strip())
            err._render_traceback_ = lambda: [f"KeyboardInterrupt: {err}"]  # IPython: no local frames
            raise err from None
        note, collateral = self._recover(ars, reason="failure") if failed else ("", set())
        return self._collect(ars, note, collateral)

    def _recover(self, ars: Dict[int, Any], reason: str) -> tuple:
        """Bring every rank of this call back to idle; rebuild or restart if needed.

        Returns (note for the error, collateral ranks): ranks we interrupted or lost in a
        restart, so the error names the rank that failed first, not its victims.
        """
        if reason == "failure" and not self._dead(ars):  # a dead rank's peers are killed anyway
            end = time.monotonic() + self.config.failure_grace
            while time.monotonic() < end and any(not a.ready() for a in ars.values()):
                time.sleep(0.05)
        busy = [r for r, a in ars.items() if not a.ready()]
        dead = self._dead(ars)
        if not busy and not dead:
            if reason == "failure" and self._any_timeout(ars):
                self._init_dist()
                return "The process group was rebuilt after the timeout.", set()
            return "", set()
        if busy and not dead:
            try:  # no wait for the reply: a dead engine (not known yet) never sends one
                self._client.send_signal(signal.SIGINT, targets=[self._engines[r] for r in busy], block=False)
            except Exception:
                pass
            end = time.monotonic() + self.config.interrupt_grace
            while time.monotonic() < end and any(not ars[r].ready() for r in busy) and not self._dead(ars):
                time.sleep(0.05)
            # a rank taken for busy may have been dead all along: ipyparallel can report an engine's
            # death later than failure_grace, and rebuilding the group on a dead engine fails
            dead = self._dead(ars)
        stuck = [r for r in busy if not ars[r].ready()]
        freed: List[int] = []
        if stuck and not dead:
            freed = stuck
            stuck = self._free_stuck(ars, stuck)
            freed = [r for r in freed if r not in stuck]
            dead = self._dead(ars)
        # victims: ranks we are about to kill; an interrupted rank that raised is still shown
        collateral = {r for r, a in ars.items() if not a.ready()}
        fresh = ("the cluster was restarted: every rank's process was stopped and fresh ones are starting "
                 "(the next call waits for them), so variables defined on the ranks are gone.")
        if dead:
            note = f"The process of {self._where(dead)} died; {fresh}"
        elif stuck:
            note = (f"R{self._where(stuck)[1:]} did not respond to an interrupt within "
                    f"{self.config.interrupt_grace:g}s (most likely blocked in a collective); {fresh}")
        if dead or stuck:
            self._replace()
            return note, collateral
        self._init_dist()
        how = (f" (ranks {freed} were blocked in a collective: the other ranks left the process group, "
               f"which ended it)") if freed else ""
        return (f"Ranks {busy} were interrupted{how}; the default process group was rebuilt (re-create objects "
                f"bound to the old one, e.g. DDP models or device meshes)."), set(freed)

    def _free_stuck(self, ars: Dict[int, Any], stuck: List[int]) -> List[int]:
        """Free ranks blocked in a collective (a SIGINT waits until the C++ call returns) without
        killing them: the other ranks leave the process group (``_rank.teardown``), which closes
        their connections (once nothing else holds their group), so the blocked collective fails at
        once and the pending SIGINT is taken. Repeated while it frees ranks (one may be blocked on
        another blocked one). Returns the ranks still blocked: those are killed and replaced."""
        left: set = set()
        while stuck:
            idle = [r for r in self.ranks if r not in stuck and r not in left]
            if not idle:
                break
            try:
                self._client[[self._engines[r] for r in idle]].apply_async(_rank_fn("teardown")).get(
                    timeout=self.config.interrupt_grace)
            except Exception:  # a rank that cannot even leave its group: kill and replace
                break
            left.update(idle)
            end = time.monotonic() + self.config.interrupt_grace
            while time.monotonic() < end and any(not ars[r].ready() for r in stuck):
                time.sleep(0.05)
            still = [r for r in stuck if not ars[r].ready()]
            if len(still) == len(stuck):
                break
            stuck = still
        return stuck

    def _host_of(self, rank: int) -> str:
        """The host rank ``rank`` ran on (as its probe saw it), '' when not known."""
        return self._info[rank].get("host", "") if rank < len(self._info) else ""

    def _where(self, ranks: List[int]) -> str:
        """``ranks [1] (on hostb)``: ranks with their hosts, for recovery notes."""
        hosts = sorted({self._host_of(r) for r in ranks} - {""})
        spans = len({self._host_of(r) for r in self.ranks}) > 1
        return f"ranks {ranks}" + (f" (on {', '.join(hosts)})" if hosts and spans else "")

    @staticmethod
    def _dead(ars: Dict[int, Any]) -> List[int]:
        """Ranks whose engine process died during the call (ipyparallel's ``EngineError``)."""
        return [r for r, a in ars.items() if a.ready() and not a.successful()
                and getattr(_exception(a), "ename", "") == "EngineError"]

    def _any_timeout(self, ars: Dict[int, Any]) -> bool:
        for a in ars.values():
            if a.ready() and not a.successful():
                e = _exception(a)
                if is_collective_timeout(getattr(e, "ename", ""), getattr(e, "evalue", "")):
                    return True
        return False

    def _collect(self, ars: Dict[int, Any], note: str, collateral: frozenset = frozenset()) -> List[Any]:
        failures: Dict[int, RankFailure] = {}
        results: List[Any] = []
        for r in sorted(ars):
            a = ars[r]
            if not a.ready():
                failures[r] = RankFailure(r, "Unfinished", "did not finish", "", host=self._host_of(r))
                continue
            if a.successful():
                results.append(a.get())
                continue
            e = _exception(a)
            ename = getattr(e, "ename", type(e).__name__)
            evalue = getattr(e, "evalue", str(e))
            tb = getattr(e, "traceback", None) or ""
            if isinstance(tb, list):
                tb = "\n".join(tb)
            failures[r] = RankFailure(r, ename, evalue, clean_traceback(tb or f"{ename}: {evalue}"),
                                      collective_timeout=is_collective_timeout(ename, evalue),
                                      host=self._host_of(r))
        if failures:
            first = {r: f for r, f in failures.items() if r not in collateral
                     and f.ename not in ("KeyboardInterrupt", "Unfinished")}
            raise RankError(first or failures, note=note, timeout_s=self.config.timeout,
                            name_hosts=len({self._host_of(r) for r in self.ranks}) > 1)
        return results


def _exception(ar) -> BaseException:
    try:
        ar.get(0)
    except BaseException as e:  # noqa: BLE001 - we want the remote error object
        return e
    return RuntimeError("no error")


def _rank_fn(name: str):
    from . import _rank

    return getattr(_rank, name)


class StatusTable(list):
    """``Cluster.status()`` rows (dicts), shown as a table in a notebook."""

    COLUMNS = ("rank", "engine", "pid", "host", "device", "rss_mb", "gpu_mb", "dist")

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in self.COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{row.get(c, '')}</td>" for c in self.COLUMNS) + "</tr>"
                       for row in self)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __str__(self) -> str:
        cells = [list(self.COLUMNS)] + [[str(row.get(c, "")) for c in self.COLUMNS] for row in self]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.COLUMNS))]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))


def _stop_all() -> None:
    """Kernel/interpreter shutdown: stop every cluster still running (no orphans)."""
    for c in list(_live):
        try:
            c.stop(fast=True)
        except Exception:
            pass


def _register_atexit() -> None:
    if not getattr(_register_atexit, "done", False):
        _register_atexit.done = True
        atexit.register(_stop_all)


def _quiet_intended_stop(ipp_cluster) -> None:
    """Silence ipyparallel's stop-time warnings: engines we stop on purpose exit non-zero, and
    ipyparallel then dumps every engine's start-up log into the cell ("Output for 1: ...",
    "engine set stopped ... exit_code 1"), which reads like a failure when nothing failed."""
    loggers = {getattr(ipp_cluster, "log", None)}
    for es in list(getattr(ipp_cluster, "engines", {}).values()) + [getattr(ipp_cluster, "controller", None)]:
        loggers.add(getattr(es, "log", None))
        for launcher in getattr(es, "launchers", {}).values() if hasattr(es, "launchers") else ():
            loggers.add(getattr(launcher, "log", None))
    for log in loggers:
        if log is not None:
            log.setLevel(logging.ERROR)
