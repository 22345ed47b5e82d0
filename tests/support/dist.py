"""The spawned-gloo test harness (re-exported from the package, where ``cli.py check`` uses it too)."""

import socket

from lightning_paradyse.distributed.spawn import run_distributed

__all__ = ["free_ports", "run_distributed"]


def free_ports(n: int) -> tuple[int, ...]:
    """``n`` distinct ports free at the time of asking (held open together, so they cannot repeat)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return tuple(int(sock.getsockname()[1]) for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()
