"""The switcher logs a training step's numbers once its time can be read: at once on the host, on a GPU when the
step's end mark has passed (usually a step later), and every one left at the end of training."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger as LightningLogger
from torch.utils.data import DataLoader

from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.lightning.callbacks import ParaDySeSwitcher, _Timed
from lightning_paradyse.lightning.language_model import LanguageModel
from lightning_paradyse.lightning.records import StepRecord
from tests.support.dist import free_port
from tests.support.lightning import quiet_trainer, strategy_environment


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
        # logged at Lightning's step of the batch's own logs, one behind the global step after the optimizer's
        switcher._timed.append(_Timed(step, record, dict(record.metrics), span, step - 1))  # type: ignore[arg-type]
        switcher._settle(trainer, wait=False)
        assert logger.rows == ([] if step == 1 else [(0, {"plan/predicted_time_s": 0.4, "plan/measured_time_s": 0.5})])
        spans[0].passed = True  # the first step's kernels ran while the second was queued
    assert "plan/measured_time_s" not in switcher.metrics  # the last batch's time is not read yet
    switcher._settle(trainer, wait=True)  # the end of training: the last one waited for
    assert spans[1].waited and not spans[0].waited
    assert [step for step, _ in logger.rows] == [0, 1]
    assert logger.rows[1][1]["plan/measured_time_s"] == 0.25 == switcher.metrics["plan/measured_time_s"]
    assert [(p.step, p.measured_s) for p in switcher.points] == [(1, 0.5), (2, 0.25)]


class Recorder(LightningLogger):
    """A logger that keeps the step of every ``log_metrics`` call, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, str]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        kind = "plan" if any(k.startswith(("plan/", "groups/")) for k in metrics) else "module"
        self.steps.append((-1 if step is None else step, kind))


def _fit_logged(rank: int, world: int, port: int) -> list[tuple[int, str]]:
    """Three training steps of the package's language model under the strategy with the switcher, logging every
    step: the steps its loggers saw, in order."""
    strategy_environment(rank, world)
    os.environ["MASTER_PORT"] = str(port)
    pl.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        x = torch.randint(0, 128, (2, 33), generator=gen)
        batches.append({"input_ids": x[:, :-1], "targets": x[:, 1:]})
    recorder = Recorder()
    strategy = ParaDySeStrategy(timeout=60, plan="tp_sp")
    trainer = quiet_trainer(world, strategy, [ParaDySeSwitcher()], max_steps=3, log_every_n_steps=1)
    trainer.loggers = [recorder]
    trainer.fit(LanguageModel("llama-tiny"), DataLoader(batches, batch_size=None))
    return recorder.steps


def test_the_switchers_numbers_reach_the_loggers_at_the_batchs_own_step() -> None:
    """A training batch's plan numbers are logged at the step Lightning logs the batch's own values at (one behind
    the global step after its optimizer step): a logger sees the steps in order (one that rejects a step smaller
    than the last, as some do, drops nothing)."""
    steps = run_distributed(_fit_logged, 2, free_port(), timeout=120)[0]
    plan = [step for step, kind in steps if kind == "plan"]
    module = [step for step, kind in steps if kind == "module"]
    assert plan == [0, 1, 2] and module == [0, 1, 2], steps
    assert [step for step, _ in steps] == sorted(step for step, _ in steps), steps
