"""Who may send rows to the relay: only the ranks of its own cluster, by ZeroMQ CURVE.

Built on what pyzmq ships: ``zmq.curve_keypair`` for the keys, the sockets' CURVE options
(``curve_server`` / ``curve_secretkey`` / ``curve_publickey`` / ``curve_serverkey``) for the
handshake and the encryption, and ``zmq.auth.thread.ThreadAuthenticator`` (ZeroMQ's ZAP
handler) to decide which client keys may finish the handshake. What is ours is small:

* every relay makes two keypairs when it is created, in memory: the server's (its PULL
  socket) and one client keypair that all the ranks of its cluster share;
* the authenticator admits that one client public key and nothing else
  (``configure_curve_callback``, so no key file is ever written: ``configure_curve`` would
  read the allowed keys from a directory of certificate files);
* the ranks get the server's public key and the client keypair in the same call that gives
  them the relay's address (``relay._install`` through ``cluster.run``), i.e. over
  ipyparallel's channel, whose messages the controller signs with the cluster's key.

A peer without the client secret key cannot complete the handshake: a plain socket (no
CURVE) fails on the mechanism, one with any other keypair is refused by the authenticator
(counted in ``RelayAuth.refused``), so its messages never reach the relay's queue. A
refused peer costs the relay no decoding at all.

Each relay has its own ``zmq.Context``: a ZAP handler applies to every socket of its context,
so the authenticator must not sit on the process-wide one that ipyparallel's client uses.
"""

from __future__ import annotations

import hmac
import logging
import threading
from dataclasses import dataclass, field

import zmq
import zmq.auth.thread  # a subpackage: `import zmq` alone does not load it

CURVE_MISSING = (
    "the libzmq under this pyzmq ({zmq}) was built without CURVE, which the relay uses so "
    "that only this cluster's ranks can send it rows. Install pyzmq's own wheel (it bundles a "
    "libzmq with CURVE): `pip install --force-reinstall pyzmq`; or pass "
    "relay.attach(cluster, auth=None) to accept rows from anyone who can reach the relay's "
    "address (only sound on loopback of a single-user machine)")


def require_curve(where: str = "this process") -> None:
    """Raise ``RuntimeError`` naming the fix when libzmq lacks CURVE (``zmq.has("curve")``)."""
    if not zmq.has("curve"):
        raise RuntimeError(f"{where}: " + CURVE_MISSING.format(zmq=zmq.zmq_version()))


@dataclass(frozen=True)
class ClientKeys:
    """What a rank needs to reach its relay: the server's public key and the cluster's
    client keypair (z85 bytes, as ``zmq.curve_keypair`` gives them)."""

    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)  # never shown in a repr, a log line or a traceback


def secure_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make ``sock`` (before ``connect``) a CURVE client of the relay that made ``keys``."""
    import socket

    require_curve(f"rank on {socket.gethostname()}")
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


class RelayAuth:
    """A relay's keypairs and the authenticator that admits only its ranks' client key."""

    DOMAIN = "colossal-relay"

    def __init__(self, context: zmq.Context):
        require_curve()
        self.server_public, self._server_secret = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        self.client = ClientKeys(self.server_public, public, secret)
        self.refused = 0  # handshakes the authenticator refused (a CURVE peer with another key)
        self._lock = threading.Lock()
        self._auth = zmq.auth.thread.ThreadAuthenticator(
            context, log=logging.getLogger("colossal_lab.relay.auth"))
        self._auth.start()
        self._auth.configure_curve_callback(self.DOMAIN, self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: is ``client_key`` (z85) this cluster's? (called on the authenticator's thread)"""
        ok = hmac.compare_digest(client_key, self.client.public)
        if not ok:
            with self._lock:
                self.refused += 1
        return ok

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before ``bind``) the CURVE server this authenticator guards."""
        sock.zap_domain = self.DOMAIN.encode()
        sock.curve_secretkey = self._server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()

