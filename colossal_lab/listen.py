"""Where the notebook's listeners bind: the one address the ranks reach it on, never all.

The notebook process hosts three kinds of listener: the ipyparallel controller (started by
``ipyparallel.Cluster``, bound where its ``controller_ip`` says), the torch rendezvous store
(``dist.TCPStore``) and the telemetry relay (``relay.py``). Every one binds ``master_addr``'s
address: ``127.0.0.1`` for a local launch, the route address toward the far hosts otherwise
(``launch.make_config`` picks it), so a local cluster is reachable from this machine only and
a far one from that network only. ``docs/launch.md`` ("Who can talk to what") lists each
listener with what authenticates its peers.

``TCPStore``'s own server binds every interface (``::``) whatever ``host_name`` it is given;
its ``master_listen_fd`` argument takes a socket we bound ourselves instead, which is what
:func:`store_listener` makes (on port 0, so there is no find-a-free-port race either).
"""

from __future__ import annotations

import socket
from typing import Tuple


def bind_ip(addr: str, arg: str = "master_addr") -> str:
    """The IP address ``addr`` (an address or host name) stands for, checked to be one this
    machine can listen on; ``ValueError`` naming ``arg`` and the fix otherwise."""
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"{arg}={addr!r} does not resolve ({exc}): pass an IP address of this "
                         "machine that the ranks reach") from None
    errors = []
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
            return sockaddr[0]
        except OSError as exc:
            errors.append(f"{sockaddr[0]}: {exc.strerror or exc}")
    raise ValueError(f"{arg}={addr!r} is not an address of this machine ({'; '.join(errors)}): the "
                     "notebook's controller, rendezvous store and relay listen there, so pass one of "
                     "this machine's addresses on the network the ranks share")


def store_listener(addr: str) -> Tuple[int, int]:
    """A listening TCP socket bound to ``addr`` only, on a port the OS picks: ``(fd, port)``.

    The fd is handed over (``dist.TCPStore(..., master_listen_fd=fd)`` closes it with the
    store); close it yourself if the store is never made."""
    ip = bind_ip(addr)
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((ip, 0))
        s.listen(1024)
        port = s.getsockname()[1]
    except BaseException:
        s.close()
        raise
    return s.detach(), port
