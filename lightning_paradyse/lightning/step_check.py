"""The one-time step check: does the module's step compute across the tokens of its slice?

On the first training batch whose first tokens have a real target (``ParaDySeStrategy(check_step=True)``), the
module's step runs twice on the batch's first ``8p`` tokens, with no gradient and no trace left
(:func:`~lightning_paradyse.runtime.guards.side_effects_undone`): sharded over the ranks as every step runs, and whole
on every rank (a group of one holding every weight). The two losses must agree to the precision's tolerance;
otherwise the step computes across its slice (e.g. shifts the targets itself) and the run stops on every rank
with the fix (:func:`~lightning_paradyse.runtime.guards.check_step_losses`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_paradyse.distributed.comm import Group, all_reduce_sum, collective_device, group_size
from lightning_paradyse.distributed.devices import gpu_free_bytes
from lightning_paradyse.groups.exchange import drop_group, enter_group
from lightning_paradyse.lightning.cycle import StepCycle
from lightning_paradyse.lightning.summary import whole_sizes
from lightning_paradyse.modes.plan import uniform_plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime import guards, parallel
from lightning_paradyse.runtime.slicing import describe_batch, shard_batch

ATTEMPTS = 8
"""Batches on which the check may still run (it waits for a batch whose first tokens have a real target)."""


class StepCheck:
    """The check's state (batches left) and its run. ``enabled``: ``ParaDySeStrategy(check_step=...)``."""

    def __init__(self, enabled: bool) -> None:
        self.left = ATTEMPTS if enabled else 0

    def due(self, cycle: StepCycle, module: pl.LightningModule, world: int, axes: int) -> bool:
        """Whether the batch begun is checked: a plain batch (no documents, one group, not skipped) of a module
        with automatic optimization, on several ranks, while attempts are left."""
        pending, step = cycle.pending, cycle.runner.step
        if self.left <= 0 or world == 1 or pending is None or step is None or not step.whole:
            return False
        return pending.doc_ids is None and axes == 1 and not pending.skip and module.automatic_optimization

    def run(
        self,
        cycle: StepCycle,
        trainer: pl.Trainer,
        group: Group,
        device: torch.device,
        step_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """The check itself (see the module docstring); ``step_fn`` is the module's training step."""
        module = cycle.module
        info, step = cycle.pending, cycle.runner.step
        assert info is not None and step is not None
        plan, rank = step.plan, step.rank
        self.left -= 1
        batch = args[0] if args else kwargs.get("batch")
        p = group_size(group)
        prefix = guards.prefix_batch(batch, info.batch, info.seq_len, min(info.seq_len, 8 * p))
        rest = (args[1:], {k: v for k, v in kwargs.items() if k != "batch"})
        try:
            sharded_info = cycle.inspect(prefix)
            causal = parallel.is_causal(module)
            whole_info = describe_batch(prefix, 1, 0, causal=causal, mean_loss=cycle.options.mean_loss)
        except ValueError:  # e.g. no real target among the first tokens: try the next batch
            if self.left == 0:
                rank_zero_warn("[paradyse] check_step: no batch had a real target among its first tokens; not checked")
            return
        if not _whole_weights_fit(module, group, device, trainer.world_size):
            self.left = 0
            return
        with torch.no_grad(), guards.side_effects_undone(trainer, module, device):
            cycle.runner.enter(cycle.runner.whole(sharded_info, plan, rank))
            a, k = cycle.shard(sharded_info, (prefix, *rest[0]), rest[1])
            local = guards.step_loss(step_fn(*a, **k))
            sharded = None if local is None else float(cycle.global_loss(local, sharded_info))
            enter_group(module, group, [1] * p)  # every weight on every rank: the whole step, p times
            try:
                parallel.configure(module, SeqContext(whole_info.layout, None), uniform_plan("tp_sp", len(plan)))
                piece, sources = shard_batch(prefix, whole_info, 0)  # the whole prefix, as one process holds it
                parallel.set_step_sources(module, sources, whole_info.padding)
                whole = guards.step_loss(step_fn(piece, *rest[0], **rest[1]))
            finally:
                drop_group(module)
        cycle.runner.enter(step)  # the batch's own step again
        cycle.pending = info
        self.left = 0
        if sharded is not None and whole is not None:
            guards.check_step_losses(sharded, float(whole), guards.step_check_tolerance(whole.dtype, trainer.precision))


def _whole_weights_fit(module: torch.nn.Module, group: Group, device: torch.device, world: int) -> bool:
    """Whether every rank can hold every weight for the check (CUDA: twice the whole weights free on every
    rank, agreed by one all-reduce; CPU: yes). Warns and says no otherwise."""
    if device.type != "cuda":
        return True
    item = next(module.parameters()).element_size()
    need = 2 * item * sum(whole_sizes(module).values())
    free = torch.tensor([float(gpu_free_bytes(device) >= need)], device=collective_device(group))
    fits = float(all_reduce_sum(free, group)) == float(world)  # [1] summed over the group
    if not fits:
        rank_zero_warn("[paradyse] check_step: the whole weights do not fit on every rank; the step is not checked")
    return fits


__all__ = ["ATTEMPTS", "StepCheck"]
