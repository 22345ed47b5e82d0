"""The spawned-gloo test harness (re-exported from the package, where ``cli.py check`` uses it too), and the ports
its runs rendezvous on."""

import random
import socket
from pathlib import Path

from lightning_paradyse.distributed.spawn import run_distributed

__all__ = ["free_port", "free_ports", "run_distributed"]

LOWEST = 10_000
"""The lowest port handed out."""


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (what a socket bound to port 0, or a connecting one, gets)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # the usual start


def free_ports(n: int) -> tuple[int, ...]:
    """``n`` distinct ports free at the time of asking (held open together, so they cannot repeat), below the
    kernel's ephemeral range: gloo opens many connections, each on a port the kernel picks from that range, so a
    port chosen there for a rendezvous could be taken by then (``EADDRINUSE``) when a later fit binds it."""
    top = _ephemeral_start()
    pick = random.SystemRandom()  # unaffected by the tests' seeds
    sockets: list[socket.socket] = []
    try:
        for _ in range(100 * n):
            if len(sockets) == n or top - LOWEST < 100 * n:
                break
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", pick.randrange(LOWEST, top)))
            except OSError:  # taken: another
                sock.close()
                continue
            sockets.append(sock)
        while len(sockets) < n:  # no room below the ephemeral range: any free port
            sockets.append(socket.socket())
            sockets[-1].bind(("127.0.0.1", 0))
        return tuple(int(sock.getsockname()[1]) for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1)[0]
