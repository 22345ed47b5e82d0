"""One rendezvous store per process, kept across the process groups of its ``Trainer`` calls.

A script launched once per rank (``start_method="popen"``, or ranks started by hand) may call ``fit``, ``validate``
and ``test`` one after the other; each call makes a process group, and the strategy destroys it at the call's end (see
``ParaDySeStrategy._destroy_group``). Made by ``init_process_group`` from ``MASTER_ADDR``/``MASTER_PORT``, each group
would bring a store of its own, served by rank 0 on the same port every time: a rank that finished a call first
reached the next call's rendezvous while rank 0 still served the last call's store, joined that one, and lost it as
rank 0 closed it ("recvValue failed ... Did the remote server shutdown"; about one call in sixty on a 2-core
machine). :func:`call_store` makes the store once per process (rank 0 serves it, the others connect) and hands each
call a prefix of its own: the ranks count their calls alike (the same script), so they meet under the same prefix,
and no rank ever connects to a store that is closing. The store is dropped at the process's exit, while Python still
runs.

Ranks started by ``torchrun`` rendezvous through its agent's store instead, which lives as long as the job: nothing
to do there (:func:`needs_own_store`).
"""

from __future__ import annotations

import atexit
import itertools
import os
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

_STORES: dict[tuple[str, int], tuple[dist.Store, Iterator[int]]] = {}
"""``(address, port)`` -> this process's store there and the count of the calls made on it."""


def needs_own_store() -> bool:
    """Whether this process's groups should rendezvous on :func:`call_store` (not under ``torchrun``, whose agent
    keeps one store for the job)."""
    return "TORCHELASTIC_RUN_ID" not in os.environ


def call_store(address: str, port: int, rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The next call's store: a prefix of this process's store at ``address:port`` (made on the first call: served
    by ``rank`` 0, the others connecting within ``timeout``)."""
    if (address, port) not in _STORES:
        served = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout)
        _STORES[(address, port)] = (served, itertools.count(1))
    store, calls = _STORES[(address, port)]
    return dist.PrefixStore(f"paradyse/call-{next(calls)}", store)


def close_stores() -> None:
    """Close this process's stores (rank 0 stops serving its own): the next call on a port makes a new one there and
    counts its calls from 1. Every rank of a job must close together, between calls."""
    _STORES.clear()


atexit.register(close_stores)  # the stores closed while Python still runs, not during its finalisation

__all__ = ["call_store", "close_stores", "needs_own_store"]
