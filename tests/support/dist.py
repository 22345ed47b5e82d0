"""The spawned-gloo test harness (re-exported from the package, where ``cli.py check`` uses it too), and the ports
its runs rendezvous on."""

from __future__ import annotations

import random
import socket
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from lightning_paradyse.distributed.spawn import run_distributed

__all__ = ["Together", "free_port", "free_ports", "module_items", "run_distributed"]

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


def module_items(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """The collected (not deselected) tests of the requesting fixture's module: which jobs a module fixture starts."""
    return [item for item in request.session.items if getattr(item, "module", None) is request.module]


class Together:
    """Spawned jobs (thunks, e.g. ``functools.partial`` of ``run_distributed``) run side by side, each from a thread
    of this process, for the tests that each wait for one of them.

    One job leaves part of the cores idle (its ranks wait for each other in their collectives); jobs started together
    fill those gaps. A module fixture's context: :meth:`of` starts the jobs of a parametrized function's collected
    parameters at once; :meth:`result` starts a job not started yet, then waits for it."""

    def __init__(self, calls: Mapping[Hashable, Callable[[], Any]]) -> None:
        self.calls = calls
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(calls)))
        self.futures: dict[Hashable, Future[Any]] = {}

    @classmethod
    def of(
        cls, request: pytest.FixtureRequest, test: str, calls: Mapping[Hashable, Callable[[], Any]], param: str = "p"
    ) -> Together:
        """The jobs of ``calls`` (keyed by the value of ``param``) that the collected tests ``test`` of the requesting
        module ask for, started."""
        together = cls(calls)
        for item in module_items(request):
            spec = getattr(item, "callspec", None)
            if getattr(item, "originalname", None) == test and spec is not None and param in spec.params:
                together.start(spec.params[param])
        return together

    def start(self, key: Hashable) -> None:
        if key not in self.futures:
            self.futures[key] = self.pool.submit(self.calls[key])

    def result(self, key: Hashable) -> Any:
        """The job's result (started now if it was not); its error raised here."""
        self.start(key)
        return self.futures[key].result()

    def __enter__(self) -> Together:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.pool.shutdown(wait=True)
