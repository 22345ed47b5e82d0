"""``run_distributed``: results in rank order, a failing rank's traceback, and a process group that did not form
started again (never a job whose ``fn`` failed)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_paradyse.distributed import spawn
from lightning_paradyse.distributed.spawn import run_distributed


def _flaky_gloo(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """Gloo, except that rank 1's first set-up in a folder fails the way a dropped connection does."""
    mark = Path(os.environ["SPAWN_TEST_DIR"]) / "set-up failed once"
    if rank == 1 and not mark.exists():
        mark.touch()
        raise RuntimeError("Gloo connectFullMesh failed with ... Connection closed by peer (simulated)")
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if "flaky_gloo" not in dist.Backend.backend_list:
    dist.Backend.register_backend("flaky_gloo", _flaky_gloo, devices=["cpu"])


def _rank_and_world(rank: int, world: int, log: str) -> tuple[int, int]:
    with open(log, "a") as f:
        f.write(f"{rank}\n")
    dist.barrier()
    return rank, world


def _fail_on_rank_one(rank: int, world: int, log: str) -> None:
    with open(log, "a") as f:
        f.write(f"{rank}\n")
    assert rank != 1, "rank one's own failure"
    dist.barrier()


def test_results_come_back_in_rank_order(tmp_path: Path) -> None:
    assert run_distributed(_rank_and_world, 3, str(tmp_path / "log"), timeout=60) == [(0, 3), (1, 3), (2, 3)]


def test_a_failure_inside_fn_names_the_rank_and_is_not_retried(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:.*rank one's own failure"):
        run_distributed(_fail_on_rank_one, 2, str(log), timeout=60)
    assert sorted(log.read_text().split()) == ["0", "1"]  # one start only


def test_a_group_that_did_not_form_is_started_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPAWN_TEST_DIR", str(tmp_path))
    log = tmp_path / "log"
    assert run_distributed(_rank_and_world, 2, str(log), timeout=60, backend="flaky_gloo") == [(0, 2), (1, 2)]
    assert (tmp_path / "set-up failed once").exists()
    assert sorted(log.read_text().split()) == ["0", "1"]  # fn ran once per rank: only on the start that formed


def test_a_group_that_never_forms_fails_after_the_last_try(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=f"did not form in {spawn.INIT_TRIES} tries"):
        run_distributed(_rank_and_world, 2, str(tmp_path / "log"), timeout=60, backend="no_such_backend")
    assert not (tmp_path / "log").exists()


class _ChangingEnviron(Mapping[str, str]):
    """An environment another thread changes while it is copied: the first listing raises as a dict changed during
    iteration does, the next read of a listed variable finds it deleted; then it reads as ``values``."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.faults = ["iteration", "deleted"]

    def __iter__(self) -> Iterator[str]:
        if self.faults and self.faults[0] == "iteration":
            self.faults.pop(0)
            raise RuntimeError("dictionary changed size during iteration")
        return iter(self.values)

    def __getitem__(self, key: str) -> str:
        if self.faults and self.faults[0] == "deleted":
            self.faults.pop(0)
            raise KeyError(key)
        return self.values[key]

    def __len__(self) -> int:
        return len(self.values)


def test_the_environment_is_copied_again_when_another_thread_changes_it() -> None:
    changing = _ChangingEnviron({"A": "1", "B": "2"})
    assert spawn.environ_now(changing) == {"A": "1", "B": "2"} and changing.faults == []
    assert spawn.environ_now() == dict(os.environ)
    broken = _ChangingEnviron({"A": "1"})
    broken.faults = ["iteration"] * spawn.COPY_TRIES  # an error that comes back every time is raised, not looped on
    with pytest.raises(RuntimeError, match="changed size"):
        spawn.environ_now(broken)
