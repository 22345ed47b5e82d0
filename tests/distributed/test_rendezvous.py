"""One rendezvous store per process, a prefix per ``Trainer`` call (``distributed/rendezvous.py``). The race it
removes (a rank joining the last call's store as rank 0 closes it) is not deterministic; this checks the store's
contract on one rank."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_paradyse.distributed import rendezvous
from tests.support.dist import free_port


def test_each_call_gets_a_prefix_of_one_store() -> None:
    port = free_port()
    first = rendezvous.call_store("127.0.0.1", port, 0, 1, timedelta(seconds=10))
    second = rendezvous.call_store("127.0.0.1", port, 0, 1, timedelta(seconds=10))
    assert isinstance(first, dist.PrefixStore) and first.underlying_store is second.underlying_store
    first.set("rank0", "a")
    second.set("rank0", "b")  # the calls' keys never meet
    assert first.get("rank0") == b"a" and second.get("rank0") == b"b"
    rendezvous._STORES.pop(("127.0.0.1", port))


def test_torchrun_keeps_its_agent_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert not rendezvous.needs_own_store()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert rendezvous.needs_own_store()
