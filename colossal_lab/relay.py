"""The live relay: telemetry from every rank onto the notebook kernel's bus, while cells run.

    relay = colossal_lab.relay.attach(cluster)   # idempotent per cluster
    dash = colossal_lab.widgets.Dashboard()      # subscribed to the kernel's bus: sees all ranks
    cluster.run(train)                           # events stream in while this runs
    relay.detach()                               # (also done by detach_all() at exit)

Built on pyzmq (already under ipyparallel and ipykernel) rather than ipyparallel's own
result/IOPub channels, because those deliver only when a task finishes or through stdout,
not as a stream of small records while the task runs. What is hand-written here is small:

* kernel side: one ``PULL`` socket bound on an OS-picked port (``tcp://HOST:*``, so no
  find-a-free-port race) and a receiver thread that decodes each JSON record
  (``telemetry.to_dict``) and calls ``telemetry.emit`` in the kernel;
* rank side (installed with ``cluster.run(_install, address)``): a bus subscriber that only
  appends the event to a bounded ``deque`` (no encoding, no syscall, no thread wake-up on the
  training thread), and a sender thread that every ``interval`` (50 ms) encodes what queued
  as one JSON array and ``PUSH``es it with ``NOBLOCK`` and a bounded send high-water mark.
  Sending each event as its own message cost the ranks ~18% of step time in the 2-rank
  benchmark (``bench/widgets.py --mode cluster``); batches cost one send per 50 ms. When the
  queue is full (a slow or absent notebook) the oldest events are dropped and counted, so
  training never waits on the notebook. A closed browser tab costs nothing at all: the
  widgets' redraw thread is the only consumer of the kernel's bus and it is throttled.

Addresses: the PULL socket binds on, and the ranks connect to, ``host``: by default the
cluster's ``master_addr`` (the address ranks already use to reach the rendezvous store that
this kernel hosts: ``127.0.0.1`` for local ranks, this host's address for ``ssh``/``slurm``
launches), else ``127.0.0.1``. Pass ``attach(cluster, host="10.0.0.5")`` to override.

Lifetime: ``attach`` is idempotent per cluster and re-installs the rank subscribers each time
(ranks replaced by ``cluster.restart()`` get one again); after ``cluster.stop()`` the
receiver notices within a second and closes its socket; ``detach()`` does both explicitly.
"""

from __future__ import annotations

import atexit
import collections
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import zmq

from colossal_lab.engine import telemetry


@dataclass
class RelayConfig:
    host: str = "127.0.0.1"  # address the PULL socket binds on and the ranks connect to
    sndhwm: int = 10_000     # events a rank buffers for the notebook before dropping
    rcvhwm: int = 100_000


# ---------------------------------------------------------------- rank side (on engines)
_rank_lock = threading.Lock()
_relayed = threading.local()  # set on the receiver thread while it re-emits
_rank_sink: Optional["_RankSink"] = None


class _RankSink:
    """Bus subscriber on a rank: queue each event, send batches from a thread, never block,
    count what was dropped."""

    BATCH = 256  # events per message at most

    def __init__(self, address: str, sndhwm: int, interval: float = 0.05):
        self.address = address
        self.interval = interval
        self.enqueued = 0
        self.sent = 0
        self.messages = 0
        self._q: "collections.deque" = collections.deque(maxlen=sndhwm)  # oldest dropped when full
        self._lock = threading.Lock()  # zmq sockets are not thread-safe
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        # the socket's high-water mark counts messages: together with the deque, about
        # ``sndhwm`` events wait for a slow notebook before the oldest are dropped
        self._sock.setsockopt(zmq.SNDHWM, max(2, sndhwm // self.BATCH))
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="colossal-relay-send", daemon=True)
        self._thread.start()
        self._unsubscribe = telemetry.subscribe(self)

    def __call__(self, event) -> None:
        if getattr(_relayed, "active", False):
            return  # an event the relay itself re-emitted in this process: never loop it back
        self.enqueued += 1
        self._q.append(event)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def flush(self) -> None:
        """Send everything queued now (batches of up to ``BATCH`` events)."""
        with self._lock:
            if self._sock is None:
                return
            q = self._q
            while q:
                batch = []
                try:
                    while len(batch) < self.BATCH:
                        batch.append(q.popleft())
                except IndexError:
                    pass
                data = json.dumps([telemetry.to_dict(e) for e in batch], separators=(",", ":")).encode()
                try:
                    self._sock.send(data, zmq.NOBLOCK)
                    self.sent += len(batch)
                    self.messages += 1
                except zmq.Again:
                    pass  # the notebook is not reading: these count as dropped

    def close(self) -> Dict[str, Any]:
        self._unsubscribe()
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)
        stats = self.stats()
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
        return stats

    def stats(self) -> Dict[str, Any]:
        self.flush()
        return {"address": self.address, "sent": self.sent, "messages": self.messages,
                "dropped": max(0, self.enqueued - self.sent - len(self._q))}


def _install(address: str, sndhwm: int) -> Dict[str, Any]:
    """Run on each rank: (re)point this process's relay sink at ``address``."""
    global _rank_sink
    with _rank_lock:
        if _rank_sink is not None:
            if _rank_sink.address == address:
                return _rank_sink.stats()
            _rank_sink.close()
        _rank_sink = _RankSink(address, sndhwm)
        return _rank_sink.stats()


def _uninstall(address: str) -> Optional[Dict[str, Any]]:
    global _rank_sink
    with _rank_lock:
        if _rank_sink is None or _rank_sink.address != address:
            return None
        stats, _rank_sink = _rank_sink.close(), None
        return stats


def _stats(address: str) -> Optional[Dict[str, Any]]:
    with _rank_lock:
        s = _rank_sink
        return s.stats() if s is not None and s.address == address else None


# ---------------------------------------------------------------- kernel side
class Relay:
    """Receives every rank's events and re-emits them on this process's telemetry bus."""

    def __init__(self, cluster, config: RelayConfig):
        self.cluster = cluster
        self.config = config
        self.received = 0
        self.bad = 0
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, config.rcvhwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(f"tcp://{config.host}:*")
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise ValueError(f"attach(host={config.host!r}): cannot bind there ({exc}); pass an "
                             "address of this machine that the engines can reach") from None
        self.address: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._thread = threading.Thread(target=self._receive, name="colossal-relay", daemon=True)
        self._thread.start()
        self.attached = False

    def _receive(self) -> None:
        _relayed.active = True
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        last_check = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - last_check > 1.0:
                last_check = time.monotonic()
                if getattr(self.cluster, "running", True) is False:
                    self._close_after_stop()  # cluster.stop(): no ranks left to hear from
                    return
            if not poller.poll(100):
                continue
            while True:
                try:
                    data = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    return  # socket closed under us at detach
                try:
                    records = json.loads(data)
                    if isinstance(records, dict):
                        records = [records]
                    events = [telemetry.from_dict(r) for r in records]
                except (ValueError, TypeError, KeyError):
                    self.bad += 1  # a malformed message is skipped, not fatal
                    continue
                self.received += len(events)
                for event in events:
                    telemetry.emit(event)

    def _close_after_stop(self) -> None:
        self.attached = False
        self._stop.set()
        self._sock.close(linger=0)
        _relays.pop(id(self.cluster), None)

    def _install_on_ranks(self) -> List[Dict[str, Any]]:
        out = self.cluster.run(_install, self.address, self.config.sndhwm)
        self.attached = True
        return out

    def rank_stats(self) -> List[Optional[Dict[str, Any]]]:
        """Per rank: events sent to the notebook and events dropped because it lagged."""
        return self.cluster.run(_stats, self.address)

    @property
    def active(self) -> bool:
        return not self._stop.is_set()

    def detach(self) -> None:
        """Remove the rank subscribers (if the cluster still runs) and close the socket."""
        if self._stop.is_set():
            return
        try:
            if self.attached:
                self.cluster.run(_uninstall, self.address)
        except Exception:
            pass  # a stopped cluster has no subscribers left to remove
        finally:
            self.attached = False
            self._stop.set()
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=2)
            self._sock.close(linger=0)
            _relays.pop(id(self.cluster), None)

    def __repr__(self) -> str:
        state = "attached" if self.active else "detached"
        return f"Relay({state}, {self.address}, received={self.received})"


_relays: Dict[int, Relay] = {}
_relays_lock = threading.Lock()


def attach(cluster, host: Optional[str] = None, sndhwm: int = 10_000,
           rcvhwm: int = 100_000) -> Relay:
    """Carry telemetry from every rank of ``cluster`` to this process's bus (idempotent).

    ``cluster`` is a :class:`colossal_lab.Cluster` (anything with ``run(fn, *args)`` that runs
    ``fn`` on every rank). Calling again for the same cluster returns the same relay.
    ``sndhwm``/``rcvhwm``: events buffered per rank / in this process before ranks drop.
    """
    if cluster is None or not callable(getattr(cluster, "run", None)):
        raise TypeError(f"attach(cluster={cluster!r}): expected a running colossal_lab.Cluster "
                        "(from cl.launch(...)) with a .run(fn, *args) method")
    if not (isinstance(sndhwm, int) and sndhwm > 0):
        raise ValueError(f"attach(sndhwm={sndhwm!r}): must be a positive int (events buffered per rank)")
    if not (isinstance(rcvhwm, int) and rcvhwm > 0):
        raise ValueError(f"attach(rcvhwm={rcvhwm!r}): must be a positive int (events buffered here)")
    if getattr(cluster, "running", True) is False:
        raise RuntimeError(f"attach(cluster={cluster!r}): the cluster is stopped; launch one with "
                           "cl.launch(n=...)")
    host = (host or getattr(cluster, "relay_host", None) or getattr(cluster, "master_addr", None)
            or "127.0.0.1")
    with _relays_lock:
        relay = _relays.get(id(cluster))
        if relay is None or relay.cluster is not cluster or not relay.active:
            relay = Relay(cluster, RelayConfig(host=host, sndhwm=sndhwm, rcvhwm=rcvhwm))
        try:
            # (re)install every time: cheap and idempotent on a rank, and it covers ranks that
            # were replaced by cluster.restart() since the last attach
            relay._install_on_ranks()
        except BaseException:
            relay.detach()
            raise
        _relays[id(cluster)] = relay
        return relay


def detach(cluster) -> None:
    """Detach the relay of ``cluster`` if there is one."""
    relay = _relays.get(id(cluster))
    if relay is not None:
        relay.detach()


def detach_all() -> None:
    for relay in list(_relays.values()):
        relay.detach()


atexit.register(detach_all)
