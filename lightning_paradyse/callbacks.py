"""ParaDySeSwitcher: chooses, checks, applies and logs the plan of every batch.

Before each training, validation and test batch the switcher

1. lets the strategy validate the global batch (length limit, targets) — errors are raised here, on
   every rank alike, before any collective;
2. asks the planner for the plan of the batch's global length (the strategy's planner unless one is
   given here) and checks it against the model;
3. verifies that every rank holds the same plan *and* the same batch: an all-gather of a hash of the
   plan, the batch shape and a digest of every tensor of the batch; a mismatch raises instead of hanging in a
   collective;
4. configures the model (layout, plan: a table look-up), records the plan in :attr:`history`, logs
   the number of layers per op and mode through the Trainer's logger and, on rank 0, prints each
   plan change.

The strategy adds a switcher when the user did not.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_paradyse.cost.planner import PlanSkipped
from lightning_paradyse.plan import OPS, Plan
from lightning_paradyse.policy import Planner


@dataclass(frozen=True)
class PlanRecord:
    """One executed plan."""

    stage: str
    """``train``, ``validate`` or ``test``."""
    seq_len: int
    """Global length of the batch."""
    batch: int
    """Sequences in the batch."""
    plan: Plan
    """The plan the batch ran with."""


def plan_digest(plan: Plan, *extra: int) -> int:
    """A stable signed 64-bit hash of a plan (and extra integers), equal across processes."""
    text = repr((plan.to_list(), extra)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)


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


def describe(plan: Plan) -> str:
    """``"ring+rc,metp+rc x4"`` for a uniform plan, else the per-layer list."""
    first = plan.layers[0]
    if all(layer == first for layer in plan.layers):
        return f"{first} x{len(plan)}"
    return str(plan)


class ParaDySeSwitcher(pl.Callback):
    """Applies a plan before every batch; all ranks are checked to hold the same one.

    Args:
        planner: Where plans come from; ``None`` uses the strategy's (its fixed plan, or for ``plan="auto"``
            the cost-model planner, or the threshold policy when ``thresholds`` were given).
        log_plan: Log the plan's mode counts per step through ``pl_module.log_dict``.
        verify: All-gather a hash of plan and batch every batch and raise if the ranks differ.
        track_memory: Also measure every training step's peak memory on CPU (live tensor storage, through a
            dispatch mode: slower steps) and log it as ``plan/measured_peak_mib``; CUDA always logs the
            allocator's peak.

    Raises:
        TypeError: When the Trainer's strategy is not a ``ParaDySeStrategy``.
        RuntimeError: When ranks hold different plans or batches.

    Example::

        trainer = Trainer(strategy=ParaDySeStrategy(plan="auto"), callbacks=[ParaDySeSwitcher()])
    """

    def __init__(
        self, planner: Planner | None = None, log_plan: bool = True, verify: bool = True, track_memory: bool = False
    ) -> None:
        self.planner = planner
        self.log_plan = log_plan
        self.verify = verify
        self.track_memory = track_memory
        self._tracker: Any = None
        self.history: list[PlanRecord] = []
        self._last: Plan | None = None
        self._last_groups: Any = None
        self._started: float | None = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.switch(trainer, pl_module, batch, "train")
        if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        elif self.track_memory:
            from lightning_paradyse.cost.tracker import MemoryTracker, state_tensors

            self._tracker = MemoryTracker(resident=state_tensors(pl_module, trainer.optimizers))
            self._tracker.__enter__()
        self._started = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the measured step time and peak memory (CUDA; CPU with ``track_memory``) next to the predictions."""
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
        strategy = trainer.strategy
        grouped = getattr(strategy, "_group_step", None) is not None
        if grouped:  # no backward ran (the module returned no loss): hand the shards back on every rank
            strategy.finish_group_step()  # type: ignore[attr-defined]
        if self._started is None or not self.log_plan:
            return
        measured = {
            "plan/measured_time_s": time.perf_counter() - self._started,
            "plan/skipped_batches": float(getattr(strategy, "skipped_batches", 0)),
        }
        times = getattr(strategy, "group_times", ())
        if times:
            from lightning_paradyse.groups import imbalance

            measured["groups/measured_imbalance"] = imbalance(times)
            strategy.group_times = ()  # type: ignore[attr-defined]
        device = trainer.strategy.root_device
        if device.type == "cuda":
            measured["plan/measured_peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        elif tracker is not None:
            measured["plan/measured_peak_mib"] = tracker.peak / 2**20
        pl_module.log_dict(measured, on_step=True, on_epoch=False, batch_size=1)
        self._started = None

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.switch(trainer, pl_module, batch, "validate")

    @override
    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.switch(trainer, pl_module, batch, "test")

    def switch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, stage: str) -> Plan | None:
        """Validate the batch, choose and check its plan, verify agreement, configure; return the plan
        (``None`` when the batch is skipped because no plan fits the memory budget)."""
        from lightning_paradyse.strategy import ParaDySeStrategy

        strategy = trainer.strategy
        if not isinstance(strategy, ParaDySeStrategy):
            raise TypeError(f"ParaDySeSwitcher needs Trainer(strategy=ParaDySeStrategy(...)), got {type(strategy)}")
        info = strategy.inspect_batch(batch)
        if strategy.uses_groups(info, stage):
            return self._switch_groups(trainer, strategy, pl_module, batch, info, stage)
        planner = self.planner or strategy.planner
        assert planner is not None, "the strategy creates its planner in setup"
        try:
            plan = planner.plan(info.seq_len, info.batch)
        except PlanSkipped as skipped:  # decided alike on every rank: no collective needed
            strategy.skip(info, str(skipped))
            return None
        strategy.check_plan(plan)
        if self.verify:
            self._verify(strategy, plan_digest(plan, info.seq_len, info.batch, info.checksum))
        strategy.activate(info, plan)
        self.history.append(PlanRecord(stage, info.seq_len, info.batch, plan))
        if self.log_plan:
            metrics = self.metrics(plan, strategy.modes, stage) | self.predictions(planner, info.seq_len, info.batch)
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=info.batch)
        if plan != self._last:
            announce(trainer, f"[paradyse] {stage} length {info.seq_len}: plan {describe(plan)}")
            self._last = plan
        return plan

    def _switch_groups(
        self, trainer: pl.Trainer, strategy: Any, pl_module: pl.LightningModule, batch: Any, info: Any, stage: str
    ) -> Plan | None:
        """A packed training batch on groups of different sizes (``ParaDySeStrategy(groups=True)``)."""
        started = time.perf_counter()
        split = strategy.group_step(batch, info)
        solve_s = time.perf_counter() - started
        if split is None:  # decided alike on every rank: no collective needed
            strategy.skip(info, "no split of the ranks into groups fits the memory budget")
            return None
        step, mine, plan = split
        if self.verify:
            self._verify(strategy, step.digest(info.checksum))
        strategy.activate_group(step, mine, plan)
        self.history.append(PlanRecord(stage, mine.seq_len, mine.batch, plan))
        found = step.assignment
        if self.log_plan:
            from lightning_paradyse.groups import imbalance

            metrics = self.metrics(plan, strategy.modes, stage) | {
                "groups/count": float(len(found.sizes)),
                "groups/own_size": float(step.size),
                "groups/predicted_time_s": float(found.time),
                "groups/predicted_imbalance": imbalance(found.times),
                "groups/solve_s": solve_s,
            }
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        key = (found.sizes, plan)
        if key != self._last_groups:
            sizes = "+".join(map(str, found.sizes))
            line = f"[paradyse] {stage} length {info.seq_len}: groups {sizes}, rank 0's plan {describe(plan)}"
            announce(trainer, line)
            self._last_groups = key
        return plan

    @staticmethod
    def _verify(strategy: Any, digest: int) -> None:
        if strategy.world_size == 1:
            return
        mine = torch.tensor([digest], dtype=torch.int64, device=strategy.root_device)
        every = strategy.all_gather(mine).reshape(-1).tolist()
        if len(set(every)) != 1:
            raise RuntimeError(
                f"the ranks disagree on the plan or the batch (digest per rank: {every}); every rank must see the "
                f"same batches (same data and seed, no per-rank sampler) and the planner must be deterministic"
            )

    @staticmethod
    def predictions(planner: Any, seq_len: int, batch: int) -> dict[str, float]:
        """The cost model's predicted step time and peak memory of the plan, when the planner has them."""
        step = getattr(planner, "step", None)
        if step is None:
            return {}
        planned = step(seq_len, batch)  # cached: the plan just chosen
        return {"plan/predicted_time_s": float(planned.time_s), "plan/predicted_peak_mib": planned.peak_bytes / 2**20}

    @staticmethod
    def metrics(plan: Plan, modes: tuple[str, ...], stage: str = "train") -> dict[str, float]:
        """Layers per op and mode, ops recomputed (a fixed set of keys, numbers only)."""
        prefix = "plan" if stage == "train" else f"plan_{stage}"
        out = {f"{prefix}/{op}_{mode}": 0.0 for op in OPS for mode in modes}
        recompute = 0
        for layer in plan.layers:
            for op in OPS:
                op_plan = layer.op(op)
                key = f"{prefix}/{op}_{op_plan.mode}"
                out[key] = out.get(key, 0.0) + 1.0
                recompute += op_plan.recompute
        out[f"{prefix}/recompute"] = float(recompute)
        return out


__all__ = ["ParaDySeSwitcher", "PlanRecord", "announce", "describe", "plan_digest"]
