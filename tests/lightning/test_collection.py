"""The fit's surviving objects frozen out of later garbage collections (lightning/collection.py), and thawed."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from lightning_paradyse.lightning import collection


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_then_thaw(unfrozen: None) -> None:
    assert collection.freeze()
    assert gc.get_freeze_count() > 0
    collection.thaw(True)
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_keeps_them(unfrozen: None) -> None:
    gc.freeze()  # the process's own
    count = gc.get_freeze_count()
    assert not collection.freeze()
    collection.thaw(False)
    assert gc.get_freeze_count() == count
