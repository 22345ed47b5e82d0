"""The switcher logs a training step's numbers once its time can be read: at once on the host, on a GPU when the
step's end mark has passed (usually a step later), and every one left at the end of training."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lightning_paradyse.lightning.callbacks import ParaDySeSwitcher, _Timed
from lightning_paradyse.lightning.records import StepRecord


class Logger:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, metrics))


class PendingSpan:
    """A GPU's span: readable once its end mark has passed (``passed``)."""

    def __init__(self, seconds: float) -> None:
        self.passed, self._seconds, self.waited = False, seconds, False

    def done(self) -> bool:
        return self.passed

    def seconds(self) -> float:
        self.waited = not self.passed
        return self._seconds


def test_a_steps_numbers_wait_for_its_time_and_are_logged_at_its_own_step() -> None:
    switcher = ParaDySeSwitcher()
    logger = Logger()
    trainer: Any = SimpleNamespace(global_rank=0, loggers=[logger], log_every_n_steps=1)
    spans = [PendingSpan(0.5), PendingSpan(0.25)]
    for step, span in enumerate(spans, start=1):
        record = StepRecord("train", 8, 2, None, {"plan/predicted_time_s": 0.4})
        switcher._reported = record
        switcher.metrics = dict(record.metrics)
        switcher._timed.append(_Timed(step, record, dict(record.metrics), span))  # type: ignore[arg-type]
        switcher._settle(trainer, wait=False)
        assert logger.rows == ([] if step == 1 else [(1, {"plan/predicted_time_s": 0.4, "plan/measured_time_s": 0.5})])
        spans[0].passed = True  # the first step's kernels ran while the second was queued
    assert "plan/measured_time_s" not in switcher.metrics  # the last batch's time is not read yet
    switcher._settle(trainer, wait=True)  # the end of training: the last one waited for
    assert spans[1].waited and not spans[0].waited
    assert [step for step, _ in logger.rows] == [1, 2]
    assert logger.rows[1][1]["plan/measured_time_s"] == 0.25 == switcher.metrics["plan/measured_time_s"]
    assert [(p.step, p.measured_s) for p in switcher.points] == [(1, 0.5), (2, 0.25)]
