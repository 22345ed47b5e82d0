"""The fit's surviving objects frozen out of later garbage collections (lightning/collection.py), and thawed."""

from __future__ import annotations

import gc
import weakref
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


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only a collection frees it, and none does while it is frozen


def test_a_process_that_froze_objects_keeps_them(unfrozen: None) -> None:
    """Nothing frozen and nothing thawed. (Not by the freeze count: another thread of the test process may free a few
    frozen objects meanwhile, which a count of 616,060 lost 2 of once.)"""
    gc.freeze()  # the process's own
    cycle = _Cycle()  # made after it
    made = weakref.ref(cycle)
    assert not collection.freeze()
    collection.thaw(False)
    assert gc.get_freeze_count() > 0  # the process's frozen objects stay frozen
    del cycle
    gc.collect()
    assert made() is None  # and what it made after its freeze was not frozen: still collected
