"""What one batch ran with: the record the strategy writes per batch and the callback logs.

The strategy decides (validate, plan, verify, activate: :meth:`~lightning_paradyse.lightning.strategy.ParaDySeStrategy.
begin_batch`) and leaves a :class:`StepRecord`; :class:`~lightning_paradyse.lightning.callbacks.ParaDySeSwitcher` only
logs it. Neither imports the other's module: both speak through this one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from lightning_paradyse.modes.plan import OPS, Plan

HISTORY_LIMIT = 100_000
"""Plans the strategy keeps in its ``history`` (the oldest are dropped: a long run's memory stays bounded)."""


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


@dataclass(frozen=True)
class StepRecord:
    """What the strategy decided for one batch: its plan (``None``: skipped), what to log, what to print."""

    stage: str
    seq_len: int
    batch: int
    plan: Plan | None
    """``None`` when no plan fits the memory budget and the batch is skipped."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers to log for this batch (layers per op and mode, predictions, group split)."""
    line: str | None = None
    """A console line when the plan (or the group split) changed, else ``None``."""
    split: tuple[int, ...] = ()
    """The group sizes of a step on groups, largest first (``()``: one group of every rank)."""


def plan_digest(plan: Plan, *extra: int) -> int:
    """A stable signed 64-bit hash of a plan (and extra integers), equal across processes."""
    text = repr((plan.to_list(), extra)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)


def batch_digest(*values: int) -> int:
    """A stable signed 64-bit hash of integers (a batch's shape and checksum), equal across processes."""
    return int.from_bytes(hashlib.sha256(repr(values).encode()).digest()[:8], "little", signed=True)


def describe(plan: Plan) -> str:
    """``"ring+rc,metp+rc x4"`` for a uniform plan, else the per-layer list."""
    first = plan.layers[0]
    if all(layer == first for layer in plan.layers):
        return f"{first} x{len(plan)}"
    return str(plan)


def plan_metrics(plan: Plan, modes: tuple[str, ...], stage: str = "train") -> dict[str, float]:
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


__all__ = ["PlanRecord", "StepRecord", "batch_digest", "describe", "plan_digest", "plan_metrics"]
