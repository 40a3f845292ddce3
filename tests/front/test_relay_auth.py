"""Who can talk to what, on a real 2-rank cluster: the relay takes rows from its cluster's ranks
only (ZeroMQ CURVE), and a local cluster's listeners are bound to loopback only."""

import pytest

pytest.importorskip("zmq")
pytest.importorskip("ipyparallel")

import shutil
import threading
import time

import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from colossal_lab import relay as relay_mod
from colossal_lab.engine import telemetry as T

QUIET = {"memory_interval": None}  # count only what the test emits
FORGED_STEP = 424242                # a row no rank ever emits

HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH}


def _forged_message():
    row = T.to_row(T.StepMetrics(rank=0, step=FORGED_STEP, loss=0.0, tokens=1, seconds=1.0))
    return relay_mod.encode([row], 1)


class _Forger:
    """A PUSH socket outside the cluster that sends forged rows to ``address``; its monitor
    records how far each connection got (TCP connected, handshake refused or done)."""

    def __init__(self, ctx, address, keys=None):
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.linger = 0
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = keys
        self.monitor = self.sock.get_monitor_socket()
        self.events = set()
        self.sock.connect(address)
        self.queued = 0  # messages waiting for a handshake (after a refusal there is no peer)
        for _ in range(20):
            try:
                self.sock.send_multipart(_forged_message(), zmq.NOBLOCK)
            except zmq.Again:
                break  # refused already: the socket has no connection left to queue for
            self.queued += 1

    def wait_refused(self, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (self.events & HANDSHAKE_FAILED):
            if self.monitor.poll(100):
                self.events.add(recv_monitor_message(self.monitor)["event"])
        return self.events

    def close(self):
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def _emit(n):
    import torch.distributed as dist

    from colossal_lab.engine import telemetry as T

    r = dist.get_rank()
    for i in range(n):
        T.emit(T.StepMetrics(rank=r, step=i, loss=float(i), tokens=1, seconds=0.01))
    return r


def _subscribe():
    got, lock = [], threading.Lock()

    def sink(e):
        with lock:
            got.append(e)

    return got, T.subscribe(sink)


def test_forged_rows_are_refused_and_the_ranks_rows_still_arrive(cluster):
    got, unsub = _subscribe()
    relay = relay_mod.attach(cluster, **QUIET)
    ctx = zmq.Context()
    try:
        assert relay.keys is not None and relay.address.startswith("tcp://127.0.0.1:")
        keys = relay.keys
        stranger = zmq.curve_keypair()
        forgers = {
            "plain": _Forger(ctx, relay.address),  # no CURVE at all
            # a keypair of its own, and the relay's public key (public keys may leak)
            "wrong key": _Forger(ctx, relay.address, (*stranger, keys.server_public)),
            # the cluster's public key without its secret
            "stolen public key": _Forger(ctx, relay.address, (keys.public, stranger[1], keys.server_public)),
        }
        for name, f in forgers.items():
            events = f.wait_refused()
            assert zmq.EVENT_CONNECTED in events, (name, events)  # it did reach the port ...
            assert events & HANDSHAKE_FAILED, (name, events)      # ... and was refused there
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events, (name, events)
        assert relay.auth.refused >= 1  # the authenticator itself turned the wrong key away

        # the real ranks, meanwhile (forgers still retrying): every row they send arrives
        assert sorted(cluster.run(_emit, 30)) == [0, 1]
        sent = sum(s["sent"] for s in relay.rank_stats())  # flushes what the ranks hold
        assert sent == 60
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and relay.received < sent:
            time.sleep(0.05)
        assert relay.received == sent and relay.bad == 0, (relay.received, sent, relay.bad)
        steps = [e for e in list(got) if isinstance(e, T.StepMetrics)]
        assert sorted((e.rank, e.step) for e in steps) == sorted((r, i) for r in (0, 1) for i in range(30))
        assert all(e.step != FORGED_STEP for e in steps)
        for f in forgers.values():
            f.close()
    finally:
        ctx.destroy(linger=0)
        unsub()
        relay.detach()


class _Idle:
    """A cluster with no ranks (the relay only needs ``running``): the forger is the only sender."""

    running = True

    def run(self, fn, *args):
        return []


def test_without_curve_the_same_forgery_gets_through():
    """The control: the check above fails where the relay does not authenticate."""
    got, unsub = _subscribe()
    relay = relay_mod.Relay(_Idle(), relay_mod.RelayConfig(interval=0.05, auth=None))
    ctx = zmq.Context()
    try:
        forger = _Forger(ctx, relay.address)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and relay.received < forger.queued:
            time.sleep(0.05)
        assert relay.received == forger.queued == 20
        assert any(getattr(e, "step", None) == FORGED_STEP for e in list(got))
        forger.close()
    finally:
        ctx.destroy(linger=0)
        unsub()
        relay.detach()


def test_attach_rejects_a_bad_auth_and_names_the_fix_without_curve(cluster, monkeypatch):
    with pytest.raises(ValueError, match=r"attach\(auth='plain'\)"):
        relay_mod.attach(cluster, auth="plain", **QUIET)
    monkeypatch.setattr(zmq, "has", lambda what: what != "curve")
    with pytest.raises(RuntimeError, match=r"without CURVE.*auth=None"):
        relay_mod.attach(cluster, **QUIET)


def _listening(pids):
    out = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs = [proc] + proc.children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            try:
                out[p.pid] = {c.laddr.ip for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
            except psutil.Error:
                pass
    return out


def test_a_local_clusters_listeners_are_bound_to_loopback_only(cluster):
    relay = relay_mod.attach(cluster, **QUIET)
    try:
        assert relay.address.startswith("tcp://127.0.0.1:")
        port = cluster.master_port
        here = {c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert ("127.0.0.1", port) in here                                     # the rendezvous store
        assert ("127.0.0.1", int(relay.address.rsplit(":", 1)[1])) in here      # the relay
        controller = cluster._ipp.controller.process.pid
        listening = _listening([psutil.Process().pid, controller, *cluster.pids])
        assert listening.get(controller), listening  # the controller does listen ...
        assert all(ip == "127.0.0.1" for ips in listening.values() for ip in ips), listening  # ... on loopback
    finally:
        relay.detach()


def test_the_controller_binds_the_ranks_address_and_master_addr_must_be_this_machines():
    from traitlets.config import Config

    from colossal_lab.launch import make_config
    from colossal_lab.startup import route_address

    assert make_config(2, "gloo").ipp_kw["controller_ip"] == "127.0.0.1"
    with pytest.raises(ValueError, match=r"master_addr='192\.0\.2\.1' is not an address of this machine"):
        make_config(2, "gloo", master_addr="192.0.2.1")  # TEST-NET-1: never this machine's
    here = route_address("192.0.2.7")
    if here is None or shutil.which("ssh") is None:
        pytest.skip("no route off this machine, or no ssh client (checked first) for a far-host launch")
    c = Config()
    c.SSHEngineSetLauncher.engines = {"192.0.2.7": 2}
    kw = make_config(2, "gloo", "ssh", config=c).ipp_kw
    assert (kw["controller_ip"], kw["controller_location"]) == (here, here)  # that interface, not "*"
