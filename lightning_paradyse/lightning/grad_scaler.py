"""A gradient scaler whose ranks agree on skipping a step (``Trainer(precision="16-mixed")``).

Lightning's ``16-mixed`` scales the loss with a ``torch.amp.GradScaler`` and skips the optimizer step when the
unscaled gradients hold an infinity or a NaN. The scaler looks only at the gradients this rank's optimizer holds: here,
its shards. An overflow in one element of a weight gradient (a feature of large activations in a row-parallel weight's
gradient) lands in one rank's shard, so that rank would skip the step and halve its scale while the others stepped:
the replicated parameters then differ between ranks (the replica check stops the fit, blaming a clip), and the shards
are one update apart, silently, where the check is not due.

:func:`agree_scaler` makes the precision plugin's scaler an :class:`AgreedGradScaler` in place (the same object, a
subclass of the user's own scaler class, its settings and state kept): each rank's flag is agreed in one small
collective before it is used, once per optimizer step, so that every rank skips (and backs off) exactly when one
process training the whole model would, as one process's scaler sees every element of every gradient. DDP agrees for
another reason: its summed gradients are whole on every rank, an infinity on one rank makes every rank's sum infinite.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_paradyse.distributed import comm
from lightning_paradyse.distributed.comm import Group


class AgreedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose found-infinity flag is agreed over :attr:`group` (see the module docstring).

    The flag is agreed where the scaler computes it (``_unscale_grads_``), so both of its paths agree: the explicit
    ``unscale_`` Lightning calls before clipping, and the check ``step`` makes for an optimizer that unscales in its
    own step (a fused one). The agreed flag is ``1.0`` or ``0.0``, as one device's is (a fused optimizer skips its
    update only for ``1.0``, and takes the flag off its step count). It is there even where no rank holds a gradient
    (one process's ``step`` would raise; deciding that here would cost a host synchronisation every step)."""

    group: Group = None
    """The ranks that agree (the strategy's world)."""

    def __init__(self, group: Group, device: str = "cuda", **settings: Any) -> None:
        super().__init__(device, **settings)  # init_scale, growth_factor, backoff_factor, growth_interval, enabled
        self.group = group

    @override
    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        mine = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        device = inv_scale.device  # the scale's
        flag = torch.zeros((), dtype=torch.float32, device=device)  # []: this rank's, every device's
        for found in mine.values():
            flag = flag + found.to(device)
        on = comm.collective_device(self.group)
        every = comm.all_reduce_sum(flag.to(on), self.group).to(device)  # [] -> []: every rank's count
        return {device: (every > 0).to(torch.float32)}  # one entry on every rank, even one that holds no gradient

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["group"] = None  # a process group does not travel; the strategy sets it again at its setup
        return state


_AGREED: dict[type, type] = {torch.amp.GradScaler: AgreedGradScaler}


def _agreed_class(cls: type) -> type:
    """:class:`AgreedGradScaler`'s override on top of ``cls`` (a user's subclass of ``GradScaler`` keeps its own)."""
    if cls not in _AGREED:
        agreed = type(f"Agreed{cls.__name__}", (AgreedGradScaler, cls), {"__module__": __name__})
        globals()[agreed.__name__] = agreed  # found by name: the scaler can be pickled
        _AGREED[cls] = agreed
    return _AGREED[cls]


def agree_scaler(precision_plugin: Any, group: Group) -> None:
    """Make ``precision_plugin``'s gradient scaler (``16-mixed``'s) agree over ``group``, in place (see the module
    docstring); nothing without a scaler (``bf16-mixed``, ``64-true``)."""
    scaler = getattr(precision_plugin, "scaler", None)
    if not isinstance(scaler, torch.amp.GradScaler):
        return
    if not isinstance(scaler, AgreedGradScaler):
        scaler.__class__ = _agreed_class(type(scaler))
    scaler.group = group  # type: ignore[attr-defined]  # this fit's
