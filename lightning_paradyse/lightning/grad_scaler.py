"""A gradient scaler whose ranks agree on skipping a step (``Trainer(precision="16-mixed")``).

Lightning's ``16-mixed`` scales the loss with a ``torch.amp.GradScaler`` and skips the optimizer step when the
unscaled gradients hold an infinity or a NaN. The scaler looks only at the gradients this rank's optimizer holds: here,
its shards. An overflow in one element of a weight gradient (a feature of large activations in a row-parallel weight's
gradient) lands in one rank's shard, so that rank would skip the step and halve its scale while the others stepped:
the replicated parameters then differ between ranks (the replica check stops the fit, blaming a clip), and the shards
are one update apart, silently, where the check is not due.

:class:`AgreedGradScaler` sums the ranks' found-infinity flags in one small collective before they are used, once per
optimizer step: every rank skips (and backs off) exactly when one process training the whole model would, as one
process's scaler sees every element of every gradient. DDP agrees for another reason: its summed gradients are
whole on every rank, an infinity on one rank makes every rank's sum infinite.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_paradyse.distributed import comm
from lightning_paradyse.distributed.comm import Group


class AgreedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose found-infinity flags are summed over ``group`` (see the module docstring).

    The flags are agreed where the scaler computes them (``_unscale_grads_``), so both of its paths agree: the
    explicit ``unscale_`` Lightning calls before clipping, and the check ``step`` makes for an optimizer that unscales
    in its own step (a fused one)."""

    def __init__(self, group: Group, device: str = "cuda", **settings: Any) -> None:
        super().__init__(device, **settings)  # init_scale, growth_factor, backoff_factor, growth_interval, enabled
        self.group = group

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, group: Group) -> AgreedGradScaler:
        """A scaler with ``scaler``'s settings and state (scale, growth and back-off factors, interval, tracker)."""
        agreed = cls(group, device=scaler._device, enabled=scaler.is_enabled())
        if scaler.is_enabled():
            agreed.load_state_dict(scaler.state_dict())
        return agreed

    @override
    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        mine = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        device = inv_scale.device  # the scale's
        flag = torch.zeros((), dtype=torch.float32, device=device)  # []: this rank's infinities, every device's
        for found in mine.values():
            flag = flag + found.to(device)
        on = comm.collective_device(self.group)
        agreed = comm.all_reduce_sum(flag.to(on), self.group).to(device)  # [] -> []: every rank's count
        return {device: agreed}  # one entry on every rank, even one that holds no gradient


def agree_scaler(precision_plugin: Any, group: Group) -> None:
    """Replace ``precision_plugin``'s gradient scaler (``16-mixed``'s) with an :class:`AgreedGradScaler` over
    ``group`` that keeps its settings and state; nothing without a scaler (``bf16-mixed``, ``64-true``)."""
    scaler = getattr(precision_plugin, "scaler", None)
    if isinstance(scaler, AgreedGradScaler):
        scaler.group = group  # a later fit's group
    elif isinstance(scaler, torch.amp.GradScaler):
        precision_plugin.scaler = AgreedGradScaler.like(scaler, group)
