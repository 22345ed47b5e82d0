"""The fit's surviving objects frozen out of later garbage collections (lightning/collection.py), and thawed."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from lightning_paradyse.lightning import collection


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    collection._FROZE_ITSELF.clear()  # this process's first call again
    yield
    gc.unfreeze()
    collection._FROZE_ITSELF.clear()


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


def test_whether_the_process_froze_objects_is_read_once(unfrozen: None) -> None:
    """Read at the process's first call (``gc.get_freeze_count`` walks every frozen object); our own freeze, left in
    place by a fit that never reached its teardown, does not make the next fit leave the process as it is."""
    assert collection.freeze()  # nothing frozen by the process: ours
    assert collection.freeze()  # still ours, though objects are frozen now
    collection.thaw(True)
    assert gc.get_freeze_count() == 0
