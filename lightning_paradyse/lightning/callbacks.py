"""ParaDySeSwitcher: logs what the strategy decided for every batch, and measures the step.

The strategy decides per batch (validate, plan, verify that every rank holds the same plan and batch, configure:
:meth:`~lightning_paradyse.lightning.strategy.ParaDySeStrategy.begin_batch`) and leaves a
:class:`~lightning_paradyse.lightning.records.StepRecord`. This callback only reports it:

* the record's numbers (layers per op and mode, the cost model's predicted step time and peak memory, the
  group split) through the Trainer's loggers (every ``log_every_n_steps`` steps, on rank 0, straight to
  ``logger.log_metrics`` as Lightning's ``LearningRateMonitor`` does: ``LightningModule.log`` costs about half
  a millisecond a value, a fifth of a short step for twenty numbers), with the measured step time (on a GPU read
  without a synchronisation once the step's kernels ran, usually a step later: :mod:`.step_timer`) and, on CUDA
  (or on CPU with ``track_memory``), the measured peak memory; the last batch's numbers in :attr:`metrics`;
* each plan change on a console line of its own (through the progress bar when one is shown);
* the plans executed, in :attr:`history`;
* at the end of a fit, a picture of every training step (:mod:`lightning_paradyse.lightning.plot`: the plan per layer,
  the group split, predicted against measured time) and the same numbers as CSV, in the run's log folder.

The strategy adds a switcher when the user did not (the only import between the two modules: this one imports
nothing of the strategy; both share :mod:`lightning_paradyse.lightning.records`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_paradyse.calibration.tracker import MemoryTracker, state_tensors
from lightning_paradyse.groups.runner import imbalance
from lightning_paradyse.lightning.plot import StepPoint, steps_svg
from lightning_paradyse.lightning.records import PlanRecord, StepRecord, plan_digest
from lightning_paradyse.lightning.step_timer import Span, mark


def announce(trainer: pl.Trainer, line: str) -> None:
    """Print ``line`` on rank 0 on a console line of its own: through the progress bar when one is shown (so it
    is not glued onto the bar's line), else through Lightning's logging."""
    if trainer.global_rank != 0:
        return
    bar = trainer.progress_bar_callback
    if bar is not None and getattr(bar, "is_enabled", False):
        bar.print(line)
    else:
        rank_zero_info(line)


@dataclass(frozen=True)
class _Timed:
    """A training step whose numbers wait for its time (:mod:`~lightning_paradyse.lightning.step_timer`)."""

    step: int
    record: StepRecord
    metrics: dict[str, float]
    span: Span
    logged_at: int
    """The step the loggers get the batch's numbers at: Lightning's own for the batch's logs (its count of batches
    that stepped, one behind ``global_step`` at the batch's end), so a logger sees the steps in order."""


def loggers_step(trainer: Any) -> int:
    """The step Lightning logs the current training batch's values at (``self.log`` in its step, the
    ``LearningRateMonitor``'s): its count of batches that stepped, which it raises after the batch's end."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return int(getattr(loop, "_batches_that_stepped", trainer.global_step))


def logs_step(trainer: Any, step: int) -> bool:
    """Whether the switcher logs global step ``step`` (every ``log_every_n_steps`` steps; 0: never): the steps the
    strategy also measures (:meth:`~lightning_paradyse.lightning.cycle.StepCycle.after_backward`)."""
    every = int(getattr(trainer, "log_every_n_steps", 1))  # set by the Trainer's logger connector
    return every > 0 and step % every == 0


class ParaDySeSwitcher(pl.Callback):
    """Logs the plan of every batch, its predicted and measured cost, and prints each plan change.

    Args:
        log_plan: Log the record's numbers and the measurements through the Trainer's loggers (every
            ``Trainer(log_every_n_steps=...)`` steps; :attr:`metrics` holds every batch's).
        track_memory: Also measure every training step's peak memory on CPU (live tensor storage, through a
            dispatch mode: slower steps) and log it as ``plan/measured_peak_mib``; CUDA always logs the
            allocator's peak.
        plot: At the end of a fit, write ``paradyse_steps.svg`` and ``paradyse_steps.csv`` into the trainer's log
            folder (``trainer.log_dir``; nothing without a logger), on rank 0.

    Raises:
        TypeError: When the Trainer's strategy does not decide plans per batch (not a ``ParaDySeStrategy``).

    Example::

        trainer = Trainer(strategy=ParaDySeStrategy(plan="auto"), callbacks=[ParaDySeSwitcher(track_memory=True)])
    """

    def __init__(self, log_plan: bool = True, track_memory: bool = False, plot: bool = True) -> None:
        self.log_plan = log_plan
        self.track_memory = track_memory
        self.plot = plot
        self.points: list[StepPoint] = []
        """Every training step of the current fit as the picture shows it."""
        self.plot_path: Path | None = None
        """Where the last fit's picture was written (rank 0), or ``None``."""
        self.metrics: dict[str, float] = {}
        """The last batch's numbers (``plan/...`` and ``groups/...``: what the strategy decided and predicted,
        and for a training batch what was measured), on every rank."""
        self._tracker: Any = None
        self._strategy: Any = None
        self._started: float | torch.cuda.Event | None = None
        self._reported: StepRecord | None = None
        self._timed: deque[_Timed] = deque()
        """Training steps logged once their time can be read (:meth:`_settle`)."""
        self._logged_step: int | None = None

    @property
    def history(self) -> list[PlanRecord]:
        """The plans executed so far (training, validation and test), in order (the last 100,000; a copy)."""
        return list(getattr(self._strategy, "history", []))

    @property
    def plans_executed(self) -> int:
        """How many plans were executed so far (every batch that ran)."""
        return int(getattr(self._strategy, "plans_executed", 0))

    @property
    def last_plan(self) -> PlanRecord | None:
        """The plan of the last batch that ran, or ``None``."""
        history = getattr(self._strategy, "history", None)
        return history[-1] if history else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not callable(getattr(trainer.strategy, "begin_batch", None)):
            raise TypeError(
                f"ParaDySeSwitcher needs Trainer(strategy=ParaDySeStrategy(...)), got {type(trainer.strategy)}"
            )
        self._strategy = trainer.strategy

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        elif self.track_memory:
            self._tracker = MemoryTracker(resident=state_tensors(pl_module, trainer.optimizers))
            self._tracker.__enter__()
        self._started = mark(trainer.strategy.root_device)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the batch's record with the measured step time and peak memory next to the predictions (on a GPU
        once the step's time can be read without waiting: usually at the next step's end, :mod:`.step_timer`)."""
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
        started, self._started = self._started, None
        record = self._report(trainer, pl_module)
        if started is None or record is None:
            return
        span = Span(started, mark(trainer.strategy.root_device))
        measured = {"plan/skipped_batches": float(getattr(trainer.strategy, "skipped_batches", 0))}
        times = getattr(trainer.strategy, "group_times", ())
        if times:
            measured["groups/measured_imbalance"] = imbalance(times)
        device = trainer.strategy.root_device
        if device.type == "cuda":
            measured["plan/measured_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        elif tracker is not None:
            measured["plan/measured_peak_mib"] = tracker.peak / 2**20
        self.metrics.update(measured)
        self._timed.append(_Timed(trainer.global_step, record, dict(self.metrics), span, loggers_step(trainer)))
        self._settle(trainer, wait=False)

    def _settle(self, trainer: pl.Trainer, wait: bool) -> None:
        """The training steps whose time can be read (every one with ``wait``), in order: their time into their
        numbers (and into :attr:`metrics` for the last batch), their point of the picture, their numbers logged."""
        while self._timed and (wait or self._timed[0].span.done()):
            timed = self._timed.popleft()
            elapsed = timed.span.seconds()
            record = timed.record
            predicted = record.metrics.get("groups/predicted_time_s", record.metrics.get("plan/predicted_time_s"))
            self.points.append(StepPoint(timed.step, record.plan, record.split, predicted, elapsed))
            timed.metrics["plan/measured_time_s"] = elapsed
            if record is self._reported:  # :attr:`metrics` still holds this batch's numbers
                self.metrics["plan/measured_time_s"] = elapsed
            self._log(trainer, timed.metrics, timed.step, timed.logged_at)

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float], step: int, logged_at: int) -> None:
        """``metrics`` of global step ``step`` to every logger of the Trainer, at their step ``logged_at``, every
        ``log_every_n_steps`` steps."""
        if not self.log_plan or trainer.global_rank != 0 or not trainer.loggers:
            return
        if not logs_step(trainer, step) or step == self._logged_step:
            return  # once per optimizer step (micro-batches of gradient accumulation share one global step)
        self._logged_step = step
        for logger in trainer.loggers:
            logger.log_metrics(dict(metrics), step=logged_at)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.points, self._logged_step = [], None
        self._timed.clear()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle(trainer, wait=True)  # the training steps' numbers before the validation's, at their step

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle(trainer, wait=True)  # the last steps' times (one wait, after the last step)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Rank 0 writes the picture of the fit's training steps and their numbers into the log folder."""
        if not self.plot or trainer.global_rank != 0 or not self.points or not trainer.loggers or not trainer.log_dir:
            return
        folder = Path(trainer.log_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / "paradyse_steps.svg"
            path.write_text(steps_svg(self.points, trainer.world_size))
            rows = ["step,plan,groups,predicted_s,measured_s"]
            rows += [
                f'{p.step},"{"" if p.plan is None else p.plan}",{"+".join(map(str, p.split))},'
                f"{'' if p.predicted_s is None else p.predicted_s},{'' if p.measured_s is None else p.measured_s}"
                for p in self.points
            ]
            (folder / "paradyse_steps.csv").write_text("\n".join(rows) + "\n")
        except OSError as err:
            rank_zero_info(f"[paradyse] could not write the picture of the fit into {folder}: {err}")
            return
        self.plot_path = path
        announce(trainer, f"[paradyse] plan per layer, group split and step times of this fit: {path}")

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, *a: Any
    ) -> None:
        self._report(trainer, pl_module)

    @override
    def on_test_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, *a: Any
    ) -> None:
        self._report(trainer, pl_module)

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> StepRecord | None:
        self._strategy = trainer.strategy  # (a switcher the strategy added missed the callbacks' setup hook)
        record: StepRecord | None = getattr(trainer.strategy, "step_record", None)
        if record is None:
            return None
        self.metrics = {k: float(v) for k, v in record.metrics.items()}
        self._reported = record
        if record.stage != "train":  # a training batch's numbers go out with its measurements
            self._log(trainer, self.metrics, trainer.global_step, loggers_step(trainer))
        if record.line is not None:
            announce(trainer, record.line)
        return record


__all__ = ["ParaDySeSwitcher", "announce", "loggers_step", "logs_step", "plan_digest"]
