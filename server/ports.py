"""Listening ports: why one cannot be used, and ports held for a process about to listen.

A port chosen by ``bind(("127.0.0.1", 0))`` and closed again is free only for
that instant: any other process's ``connect()`` or ``bind(0)`` may take it
before the child meant to listen on it starts. :func:`reserve_ports` keeps
each chosen port bound (``SO_REUSEADDR``, never listening) until released:

- the kernel's ephemeral allocation (``bind(0)``, the implicit bind of
  ``connect()``) skips a port that has an explicitly bound socket;
- a plain ``bind`` by anyone else fails with ``EADDRINUSE``;
- a server that binds with ``SO_REUSEADDR`` and listens (asyncio's and
  uvloop's ``create_server`` and Go's ``net.Listen``, i.e. every process we
  start, etcd included) takes the port over, because Linux lets sockets that
  all set ``SO_REUSEADDR`` share a port while at most one of them listens.

So a reserved port stays ours from the choice to the child's ``listen()``,
whatever else runs on the machine. The kernel picks the first port; when
200 of its picks give no run of consecutive free ports (every odd port of
its range held, say), every unprivileged port is tried by binding, outside
its range too.
"""

from __future__ import annotations

import errno
import itertools
import random
import socket
from collections.abc import Iterator

#: why a listening socket cannot bind, by errno (the rest keep their own message)
_LISTEN_ERRORS = {
    errno.EADDRINUSE: "the port is already in use",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
    errno.EADDRNOTAVAIL: "the address is not one of this machine's",
}

#: reservation sockets by port, held until released (or the process exits)
_held: dict[tuple[str, int], socket.socket] = {}


def listen_problem(exc: OSError) -> str | None:
    """What a failed bind means to a user, or None when it is no port/address problem."""
    return _LISTEN_ERRORS.get(exc.errno or 0)


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on right now (a trial bind), or None.

    Checked before a slow start (loading a model, spawning children) so a busy
    port is one line at once; the real bind still reports a port taken meanwhile.
    The trial binds as our servers do (``SO_REUSEADDR``), so a port we reserved
    reads as free and one in TIME_WAIT is no obstacle.
    """
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"the host does not resolve ({exc.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as trial:
        trial.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            trial.bind(address)
        except OSError as exc:
            return listen_problem(exc) or str(exc)
    return None


def _hold(host: str, port: int) -> socket.socket | None:
    """A socket bound to ``host:port`` (0: the kernel's pick), or None when it cannot be bound.

    A named port is bound without ``SO_REUSEADDR`` first, so that it is never shared with another
    process's reservation (sockets that all set it may share a port); set after the bind, the
    option still lets the child's listener take the port over, as with the kernel's picks.
    """
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    if port == 0:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except (OSError, OverflowError):
        s.close()
        return None
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return s


#: how many times the kernel is asked for a first port before every port is scanned
KERNEL_PICKS = 200
#: the lowest port the scan tries (below it, ports need privileges)
FIRST_UNPRIVILEGED = 1024


def _first_ports(host: str) -> Iterator[socket.socket]:
    """Held first ports to build a reservation from: the kernel's picks, then a scan of every
    unprivileged port by binding (from a random one, wrapping), outside the ephemeral range too.
    The kernel alone may never offer a run (every odd port of its range held, say)."""
    for _ in range(KERNEL_PICKS):
        first = _hold(host, 0)
        if first is None:
            raise OSError(f"cannot bind any port on {host}")
        yield first
    start = random.randrange(FIRST_UNPRIVILEGED, 65536)
    for port in itertools.chain(range(start, 65536), range(FIRST_UNPRIVILEGED, start)):
        first = _hold(host, port)
        if first is not None:
            yield first


def reserve_ports(
    n: int,
    host: str = "127.0.0.1",
    *,
    consecutive: bool = False,
    avoid: frozenset[int] | set[int] = frozenset(),
) -> list[int]:
    """``n`` ports on ``host`` held for processes about to listen on them (see the module doc).

    ``consecutive``: ``base, base+1, ...`` (``fastcore-serve up --worker-base-port`` numbers its
    workers so). ``avoid``: ports not to return. Raises OSError when none can be found.
    """
    for first in _first_ports(host):
        base = int(first.getsockname()[1])
        held = [first]
        if base in avoid:
            first.close()
            continue
        for i in range(1, n):
            port = base + i if consecutive else 0
            if consecutive and (port > 65535 or port in avoid):
                break
            s = _hold(host, port)
            if s is None:
                break
            if not consecutive and int(s.getsockname()[1]) in avoid:
                s.close()
                break
            held.append(s)
        if len(held) == n:
            ports = [int(s.getsockname()[1]) for s in held]
            for port, s in zip(ports, held):
                _held[(host, port)] = s
            return ports
        for s in held:
            s.close()
    raise OSError(f"no {'run of ' if consecutive else ''}{n} free ports on {host}")


def release_ports(ports: list[int] | tuple[int, ...], host: str = "127.0.0.1") -> None:
    """Drop the reservations of ``ports`` (a child listens on them now, or never will)."""
    for port in ports:
        s = _held.pop((host, port), None)
        if s is not None:
            s.close()
