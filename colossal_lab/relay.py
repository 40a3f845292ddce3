"""The live relay: telemetry from every rank onto the notebook kernel's bus, while cells run.

    relay = colossal_lab.relay.attach(cluster)   # idempotent per cluster
    dash = colossal_lab.widgets.Dashboard()      # subscribed to the kernel's bus: sees all ranks
    cluster.run(train)                           # events stream in while this runs
    relay.detach()                               # (also done by detach_all() at exit)

Built on pyzmq (already under ipyparallel and ipykernel) rather than ipyparallel's own
result/IOPub channels, because those deliver only when a task finishes or through stdout,
not as a stream of small records while the task runs. What is hand-written here is small:

* kernel side: one ``PULL`` socket bound on an OS-picked port (``tcp://HOST:*``, so no
  find-a-free-port race) and a receiver thread that wakes once per ``interval``, takes every
  rank's messages, decodes them and calls ``telemetry.emit`` in the kernel for each event;
  while nobody in the kernel subscribes (no view open) it only counts what arrives and
  decodes nothing;
* rank side (installed with ``cluster.run(_install, address, ...)``): a bus subscriber that
  only appends the event to a bounded ``deque`` (no encoding, no syscall, no thread wake-up on
  the training thread), and a sender thread that every ``interval`` (0.2 s) folds what queued
  to what the widgets draw (:func:`coalesced_rows`: a chunk's moves within a step become its
  latest placement plus a running move count, a tier's memory samples the latest one) and
  ``PUSH``es it as one message with ``NOBLOCK`` and a bounded send high-water mark. When the
  queue is full (a slow or absent notebook) the oldest events are dropped and counted, so
  training never waits on the notebook. A closed browser tab costs nothing at all: the
  widgets' redraw thread is the only consumer of the kernel's bus and it is throttled.

The wire: ``[b"2 <events folded in>", JSON array of rows]``, a row being
``telemetry.to_row(event)`` (the type's index and the fields in order: no key names). Why
batches, coalescing and rows: every message costs both sides a thread wake-up plus JSON work,
and every event costs encoding and decoding, all on CPU the ranks' training would otherwise
use (on a machine whose cores the ranks fill, the kernel's share is taken from them too). So
a rank sends one message per ``interval``, folds the events to what the widgets draw, and
writes rows without key names; the receiver wakes once per interval for all ranks rather
than once per message. ``bench/widgets.py --mode cluster`` measures what this costs (figures,
and what each of these choices saves: ``docs/widgets.md``, "The relay").
``attach(cluster, coalesce=False)`` re-emits every event as the rank emitted it (to record a
complete trace in the kernel); ``interval`` sets the batch period.

Addresses: the PULL socket binds on, and the ranks connect to, ``host``: by default the
cluster's ``master_addr`` (the address ranks already use to reach the rendezvous store that
this kernel hosts: ``127.0.0.1`` for local ranks, this host's address for ``ssh``/``slurm``
launches), else ``127.0.0.1``. Pass ``attach(cluster, host="10.0.0.5")`` to override.
The socket binds that one address, never all interfaces.

Who may send: only the cluster's own ranks. The PULL socket is a ZeroMQ CURVE server with a
keypair made for this relay, and its authenticator admits one client key, made with it and
handed to the ranks with the address (``relay_auth.py``); anything else that reaches the
port cannot finish the handshake, so its rows never arrive. ``attach(cluster, auth=None)``
turns this off (for a libzmq built without CURVE, or to measure what it costs:
``bench/relay_auth.py``).

Memory: attaching also starts a :class:`~colossal_lab.engine.telemetry.memory.MemorySampler`
on every rank (every ``memory_interval`` seconds, 0.5 by default; ``memory_interval=None``
starts none), so ``MemoryGauges`` fill under any plugin with no code in the training cell:
the rank's RSS (and peak RSS), ``torch.cuda`` allocated / reserved / peak bytes on the rank's
device once it uses one, NVML utilisation where ``nvidia-ml-py`` is installed, and the bytes
of the NVMe offload directories registered on that rank (Gemini's store registers its own).
A tier the engine reports itself (Gemini's placement accounting) is left to the engine while
it does (``MemorySamplerConfig.defer``), so a gauge never alternates between two meanings.

Lifetime: ``attach`` is idempotent per cluster and re-installs the rank subscribers and
samplers each time, never starting a second one on a rank; ``cluster.restart()`` re-installs
them on the new ranks (a restart hook); after ``cluster.stop()`` the ranks, and their
samplers, are gone and the receiver notices within a second and closes its socket;
``detach()`` removes both from the ranks and closes the socket explicitly.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import zmq

from colossal_lab.engine import telemetry

from .relay_auth import ClientKeys, RelayAuth, require_curve, secure_client

WIRE_VERSION = 2  # frame 0 of every message: b"<version> <events folded in>"


@dataclass
class RelayConfig:
    host: str = "127.0.0.1"  # address the PULL socket binds on and the ranks connect to
    sndhwm: int = 10_000     # events a rank buffers for the notebook before dropping
    rcvhwm: int = 100_000
    interval: float = 0.2    # seconds between a rank's batches
    coalesce: bool = True    # fold what a batch holds to what the widgets draw
    memory_interval: Optional[float] = 0.5  # seconds between a rank's memory samples; None: no sampler
    auth: Optional[str] = "curve"  # "curve": only this cluster's ranks may send; None: anyone


# ---------------------------------------------------------------- the wire (both sides)
_CHUNK = telemetry.ROW_TYPES.index(telemetry.ChunkEvent)
_MEMORY = telemetry.ROW_TYPES.index(telemetry.MemorySample)
_ChunkEvent, _MemorySample, _to_row = telemetry.ChunkEvent, telemetry.MemorySample, telemetry.to_row


def coalesced_rows(events, last: Dict[tuple, tuple]) -> List[list]:
    """``events`` (as the engine emitted them) as ``telemetry.to_row`` rows, folded to what
    the widgets draw.

    * the ``ChunkEvent``s of one chunk at one step become one row: the latest placement, with
      ``moves`` = the tier changes the chunk made at that step up to it (the change into the
      step's first placement included), a running count kept in ``last`` (per
      ``(rank, chunk_id)``: ``(step, tier, count)`` of the last event handled; updated here,
      so it carries across batches). ``ChunkState`` records the difference to the count it
      holds, so it still sees that, and how often, a chunk moved at a step, and a row with a
      smaller count than the one held (an older one) cannot move a chunk back;
    * the ``MemorySample``s of one ``(rank, tier)`` become the latest by ``time`` (the only
      one ``MemoryState`` keeps);
    * ``StepMetrics`` and ``StageSpan`` pass unchanged (each is a point of a curve or a bar).

    A row keeps the position of the first event it folds; rows of different chunks, steps or
    types need no order between them (each reducer is keyed by them).
    """
    rows: List[list] = []
    at: Dict[tuple, int] = {}
    for e in events:
        cls = type(e)
        if cls is _ChunkEvent:
            ck = (e.rank, e.chunk_id)
            prev = last.get(ck)
            if prev is None:
                count = 0
            elif prev[0] == e.step:
                count = prev[2] + (prev[1] != e.tier)
            else:
                count = int(prev[1] != e.tier)
            last[ck] = (e.step, e.tier, count)
            row = [_CHUNK, e.rank, e.step, e.chunk_id, e.tier, e.state, e.nbytes, e.params, count]
            key = (e.rank, e.chunk_id, e.step)
            i = at.get(key)
            if i is None:
                at[key] = len(rows)
                rows.append(row)
            else:
                rows[i] = row
        elif cls is _MemorySample:
            key = (e.rank, e.tier)
            i = at.get(key)
            if i is None:
                at[key] = len(rows)
                rows.append(_to_row(e))
            elif e.time >= rows[i][2]:
                rows[i] = _to_row(e)
        else:
            rows.append(_to_row(e))
    return rows


def encode(rows: List[list], events_in: int) -> List[bytes]:
    """One message: ``[b"<WIRE_VERSION> <events_in>", JSON array of rows]``."""
    return [b"%d %d" % (WIRE_VERSION, events_in), json.dumps(rows, separators=(",", ":")).encode()]


def decode_header(frames: List[bytes]) -> int:
    """How many rank-side events a message stands for; ``ValueError`` if it is not ours."""
    if len(frames) != 2:
        raise ValueError(f"relay message with {len(frames)} frames; expected 2")
    version, n = frames[0].split()
    if int(version) != WIRE_VERSION:
        raise ValueError(f"relay wire version {int(version)}; this kernel reads {WIRE_VERSION} "
                         "(ranks and notebook run different colossal-lab versions)")
    return int(n)


def decode(frames: List[bytes]) -> list:
    """The events of one message (``telemetry.from_row`` of each row)."""
    decode_header(frames)
    from_row = telemetry.from_row
    return [from_row(r) for r in json.loads(frames[1])]


# ---------------------------------------------------------------- rank side (on engines)
_rank_lock = threading.Lock()
# idents of this process's relay receiver threads (kernel side; empty on a rank): what they
# re-emit must not be queued by a rank sink in the same process (it would loop back). A set
# checked for emptiness first: on a rank the check is one truth test on the training thread
# (cheaper than a ``threading.local`` attribute lookup, which is slow when it misses)
_receiver_threads: set = set()
_rank_sink: Optional["_RankSink"] = None
_rank_sampler = None  # this rank's MemorySampler while a relay is attached (at most one)


class _RankSink:
    """Bus subscriber on a rank: queue each event, send batches from a thread, never block,
    count what was dropped."""

    HWM_BATCH = 256     # events per message assumed when turning ``sndhwm`` into messages
    MAX_EVENTS = 4096   # events folded into one message at most

    def __init__(self, address: str, sndhwm: int, interval: float = 0.2, coalesce: bool = True,
                 keys: Optional[ClientKeys] = None):
        self.address = address
        self.keys = keys
        self.interval = interval
        self.coalesce = coalesce
        self.enqueued = 0
        self.sent = 0      # events carried by messages sent (folded ones included)
        self.rows = 0      # rows those messages held (after coalescing)
        self.messages = 0
        self.cpu_s = 0.0   # CPU seconds of the sender thread (time.thread_time)
        self._last: Dict[tuple, tuple] = {}  # (rank, chunk_id) -> (step, tier, moves)
        self._q: "collections.deque" = collections.deque(maxlen=sndhwm)  # oldest dropped when full
        self._lock = threading.Lock()  # zmq sockets are not thread-safe
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        # the socket's high-water mark counts messages: together with the deque, about
        # ``sndhwm`` events wait for a slow notebook before the oldest are dropped
        self._sock.setsockopt(zmq.SNDHWM, max(2, sndhwm // self.HWM_BATCH))
        self._sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            secure_client(self._sock, keys)
        self._sock.connect(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="colossal-relay-send", daemon=True)
        self._thread.start()
        self._unsubscribe = telemetry.subscribe(self)

    def __call__(self, event) -> None:
        if _receiver_threads and threading.get_ident() in _receiver_threads:
            return  # an event the relay itself re-emitted in this process: never loop it back
        self.enqueued += 1
        self._q.append(event)

    def _loop(self) -> None:
        t = time.thread_time()
        while not self._stop.wait(self.interval):
            self.flush()
            t1 = time.thread_time()
            self.cpu_s += t1 - t
            t = t1

    def flush(self) -> None:
        """Send everything queued now (one message per ``MAX_EVENTS`` events)."""
        with self._lock:
            if self._sock is None:
                return
            q = self._q
            while q:
                batch = []
                try:
                    while len(batch) < self.MAX_EVENTS:
                        batch.append(q.popleft())
                except IndexError:
                    pass
                if self.coalesce:
                    rows = coalesced_rows(batch, self._last)
                else:
                    rows = [_to_row(e) for e in batch]
                try:
                    self._sock.send_multipart(encode(rows, len(batch)), zmq.NOBLOCK)
                    self.sent += len(batch)
                    self.rows += len(rows)
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
        sampler = _rank_sampler
        return {"address": self.address, "sent": self.sent, "rows": self.rows,
                "messages": self.messages, "cpu_s": self.cpu_s, "interval": self.interval,
                "coalesce": self.coalesce,
                "dropped": max(0, self.enqueued - self.sent - len(self._q)),
                "memory_samples": None if sampler is None else sampler.samples,
                "memory_deferred": None if sampler is None else sampler.deferred}


def _ensure_sampler(memory_interval: Optional[float]) -> Optional[int]:
    """(Re)start this rank's memory sampler at ``memory_interval`` (``None``: stop it); at most
    one per process. Returns the samples it has emitted (``None`` without a sampler)."""
    global _rank_sampler
    from colossal_lab.engine.telemetry.memory import MemorySampler, MemorySamplerConfig

    s = _rank_sampler
    if s is not None and (memory_interval is None or s.config.interval != memory_interval
                          or not s.running):
        s.stop()
        s = _rank_sampler = None
    if s is None and memory_interval is not None:
        device = os.environ.get("COLOSSAL_DEVICE", "")  # set by the rank's setup (_rank.setup)
        s = _rank_sampler = MemorySampler(MemorySamplerConfig(
            rank=int(os.environ.get("RANK", "0")), interval=memory_interval,
            device=device if device.startswith("cuda") else None,
            registered_nvme=True, defer=True)).start()
    return None if s is None else s.samples


def _install(address: str, sndhwm: int, interval: float = 0.2, coalesce: bool = True,
             memory_interval: Optional[float] = None, keys: Optional[ClientKeys] = None) -> Dict[str, Any]:
    """Run on each rank: (re)point this process's relay sink at ``address`` (a CURVE client
    with ``keys``, the relay's, unless ``None``) and keep one memory sampler running at
    ``memory_interval`` (``None``: none)."""
    global _rank_sink
    with _rank_lock:
        if _rank_sink is not None and (_rank_sink.address, _rank_sink.interval, _rank_sink.coalesce,
                                       _rank_sink.keys) != (address, interval, coalesce, keys):
            _rank_sink.close()
            _rank_sink = None
        if _rank_sink is None:
            _rank_sink = _RankSink(address, sndhwm, interval, coalesce, keys)
        _ensure_sampler(memory_interval)
        import socket

        return {**_rank_sink.stats(), "host": socket.gethostname(), "session": telemetry.bus.session_group()}


def _uninstall(address: str) -> Optional[Dict[str, Any]]:
    global _rank_sink
    with _rank_lock:
        if _rank_sink is None or _rank_sink.address != address:
            return None
        _ensure_sampler(None)
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
        self.received = 0  # rank-side events the messages carried (folded ones included)
        self.rows = 0      # events re-emitted here (after the ranks' coalescing)
        self.messages = 0
        self.skipped = 0   # messages not decoded because nobody here was subscribed
        self.drains = 0    # wake-ups of the receiver that found messages
        self.bad = 0
        self.cpu_s = 0.0  # CPU seconds of the receiver thread (time.thread_time), for the bench
        self._stop = threading.Event()
        # its own context: the authenticator guards every socket of the context it is given
        self._ctx = zmq.Context()
        try:
            self.auth: Optional[RelayAuth] = RelayAuth(self._ctx) if config.auth == "curve" else None
        except BaseException:
            self._ctx.term()
            raise
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, config.rcvhwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if self.auth is not None:
            self.auth.secure(self._sock)
        try:
            self._sock.bind(f"tcp://{config.host}:*")
        except zmq.ZMQError as exc:
            self._close_socket()
            raise ValueError(f"attach(host={config.host!r}): cannot bind there ({exc}); pass an "
                             "address of this machine that the engines can reach") from None
        self.address: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._thread = threading.Thread(target=self._receive, name="colossal-relay", daemon=True)
        self._session_prev: Optional[int] = None  # this session's autogroup nice before attach
        self._thread.start()
        self.attached = False

    def _receive(self) -> None:
        _receiver_threads.add(threading.get_ident())
        telemetry.bus.background_priority()  # decode in the CPU the ranks leave idle
        try:
            self._receive_loop()
        finally:
            _receiver_threads.discard(threading.get_ident())

    def _receive_loop(self) -> None:
        # wake once per ``interval`` and drain whatever every rank sent meanwhile, rather than
        # once per message: with N ranks that is 1/N of the wake-ups (each costs the kernel
        # process CPU), at the price of up to one more interval of latency
        t_start = time.thread_time()
        last_check = time.monotonic()
        while not self._stop.wait(self.config.interval):
            if time.monotonic() - last_check > 1.0:
                last_check = time.monotonic()
                if getattr(self.cluster, "running", True) is False:
                    self._close_after_stop()  # cluster.stop(): no ranks left to hear from
                    return
            self._drain()
            self.cpu_s = time.thread_time() - t_start

    def _drain(self) -> None:
        n0 = self.messages + self.bad
        try:
            self._drain_all()
        finally:
            self.drains += (self.messages + self.bad) > n0

    def _drain_all(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                self._stop.set()
                return  # socket closed under us at detach
            try:
                n = decode_header(frames)
                if not telemetry.has_subscribers():
                    # nobody in this process listens (no view open): count, do not decode
                    self.received += n
                    self.messages += 1
                    self.skipped += 1
                    continue
                events = decode(frames)
            except (ValueError, TypeError, KeyError, IndexError):
                self.bad += 1  # a malformed message is skipped, not fatal
                continue
            self.received += n
            self.rows += len(events)
            self.messages += 1
            for event in events:
                telemetry.emit(event)

    def _close_after_stop(self) -> None:
        self._step_forward()
        self.attached = False
        self._unhook()
        self._stop.set()
        self._close_socket()
        _relays.pop(id(self.cluster), None)

    def _close_socket(self) -> None:
        self._sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self._ctx.term()

    @property
    def keys(self) -> Optional[ClientKeys]:
        """What the ranks connect with (``None`` without CURVE)."""
        return None if self.auth is None else self.auth.client

    def _install_on_ranks(self) -> List[Dict[str, Any]]:
        out = self.cluster.run(_install, self.address, self.config.sndhwm, self.config.interval,
                               self.config.coalesce, self.config.memory_interval, self.keys)
        self.attached = True
        self._step_back(out)
        return out

    def _step_back(self, installed: List[Dict[str, Any]]) -> None:
        """While attached, this process (it decodes and draws for ranks that train) takes the CPU
        the ranks leave: its threads at ``background_priority``, and, where ranks on this machine
        run in other sessions than this one (``cl.launch``'s engines each have their own), its
        session's scheduling autogroup too (``telemetry.bus.session_background``: Linux shares the
        CPU between sessions before it looks at a thread's nice). Put back at detach."""
        import socket

        if self._session_prev is not None:
            return
        mine, host = telemetry.bus.session_group(), socket.gethostname()
        local = [r for r in installed if isinstance(r, dict) and r.get("host") == host]
        if mine is None or not local or any(r.get("session") == mine for r in local):
            return  # ranks elsewhere, or in this very session: ordering by thread nice suffices
        self._session_prev = telemetry.bus.session_background()

    def _step_forward(self) -> None:
        prev, self._session_prev = self._session_prev, None
        telemetry.bus.session_restore(prev)

    def _on_restart(self, cluster) -> None:
        """Restart hook: the new ranks get the sink and the memory sampler again."""
        if self.active:
            self._install_on_ranks()

    def _hook(self) -> None:
        hooks = getattr(self.cluster, "restart_hooks", None)
        if hooks is not None and self._on_restart not in hooks:
            hooks.append(self._on_restart)

    def _unhook(self) -> None:
        hooks = getattr(self.cluster, "restart_hooks", None)
        if hooks is not None:
            while self._on_restart in hooks:
                hooks.remove(self._on_restart)

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
            self._step_forward()
            self.attached = False
            self._unhook()
            self._stop.set()
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=2)
            self._close_socket()
            _relays.pop(id(self.cluster), None)

    def __repr__(self) -> str:
        state = "attached" if self.active else "detached"
        secured = "curve" if self.auth is not None else "no auth"
        return f"Relay({state}, {self.address}, {secured}, received={self.received})"


_relays: Dict[int, Relay] = {}
_relays_lock = threading.Lock()


def attach(cluster, host: Optional[str] = None, sndhwm: int = 10_000,
           rcvhwm: int = 100_000, interval: float = 0.2, coalesce: bool = True,
           memory_interval: Optional[float] = 0.5, auth: Optional[str] = "curve") -> Relay:
    """Carry telemetry from every rank of ``cluster`` to this process's bus (idempotent).

    ``cluster`` is a :class:`colossal_lab.Cluster` (anything with ``run(fn, *args)`` that runs
    ``fn`` on every rank). Calling again for the same cluster returns the same relay (with
    this call's ``interval``/``coalesce`` installed on the ranks).
    ``sndhwm``/``rcvhwm``: events buffered per rank / in this process before ranks drop.
    ``interval``: seconds between a rank's messages (0.2: as often as a view redraws at its
    fastest; each message costs both sides a thread wake-up). ``coalesce``: fold each
    batch to what the widgets draw (see :func:`coalesced_rows`); ``False`` re-emits every
    event here as the rank emitted it (e.g. to record a complete trace in the kernel).
    ``memory_interval``: seconds between each rank's memory samples (one sampler thread per
    rank, see the module docstring); ``None`` starts none (and stops one a previous attach
    started).
    ``auth``: ``"curve"`` (only this cluster's ranks can send rows, see the module docstring)
    or ``None`` (anyone who reaches the address can). Fixed when the relay is created.
    """
    if cluster is None or not callable(getattr(cluster, "run", None)):
        raise TypeError(f"attach(cluster={cluster!r}): expected a running colossal_lab.Cluster "
                        "(from cl.launch(...)) with a .run(fn, *args) method")
    if not (isinstance(sndhwm, int) and sndhwm > 0):
        raise ValueError(f"attach(sndhwm={sndhwm!r}): must be a positive int (events buffered per rank)")
    if not (isinstance(rcvhwm, int) and rcvhwm > 0):
        raise ValueError(f"attach(rcvhwm={rcvhwm!r}): must be a positive int (events buffered here)")
    if not (isinstance(interval, (int, float)) and 0 < interval <= 60):
        raise ValueError(f"attach(interval={interval!r}): must be seconds in (0, 60] between a "
                         "rank's messages, e.g. 0.2")
    if not isinstance(coalesce, bool):
        raise TypeError(f"attach(coalesce={coalesce!r}): must be True or False")
    if memory_interval is not None and not (isinstance(memory_interval, (int, float))
                                            and not isinstance(memory_interval, bool)
                                            and 0 < memory_interval <= 3600):
        raise ValueError(f"attach(memory_interval={memory_interval!r}): must be seconds in "
                         "(0, 3600] between a rank's memory samples, e.g. 0.5, or None for no sampler")
    if auth not in ("curve", None):
        raise ValueError(f"attach(auth={auth!r}): must be 'curve' (only this cluster's ranks may "
                         "send rows) or None (anyone who reaches the address may)")
    if auth == "curve":
        require_curve("relay.attach(auth='curve')")
    if getattr(cluster, "running", True) is False:
        raise RuntimeError(f"attach(cluster={cluster!r}): the cluster is stopped; launch one with "
                           "cl.launch(n=...)")
    host = (host or getattr(cluster, "relay_host", None) or getattr(cluster, "master_addr", None)
            or "127.0.0.1")
    with _relays_lock:
        relay = _relays.get(id(cluster))
        if relay is None or relay.cluster is not cluster or not relay.active:
            relay = Relay(cluster, RelayConfig(host=host, sndhwm=sndhwm, rcvhwm=rcvhwm,
                                               interval=interval, coalesce=coalesce,
                                               memory_interval=memory_interval, auth=auth))
        relay.config.interval, relay.config.coalesce = interval, coalesce
        relay.config.memory_interval = memory_interval
        try:
            # (re)install every time: cheap and idempotent on a rank, and it covers ranks that
            # were replaced by cluster.restart() since the last attach
            relay._install_on_ranks()
        except BaseException:
            relay.detach()
            raise
        relay._hook()
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
