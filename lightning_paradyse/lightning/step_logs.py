"""What a step logs: ``self.log(...)`` of the step's loss reaches the loggers as the global loss.

Inside ``training_step`` (``validation_step``, ``test_step``) the module runs on this rank's tokens, so the loss it
computes there is this rank's: a mean over its tokens, a Hugging Face model's share of the global mean (it is handed
the global count of labels), or, on an idle group's rank, a placeholder's. The strategy makes the loss the step
*returns* the exact single-process loss; Lightning's ``self.log("train_loss", loss)`` would have taken the rank's
value when it was called (under DDP too, which users accept as an estimate; here it may be half the loss, or a
placeholder's). So while the module's step runs, :class:`StepLogs` holds its ``log`` calls of one-number tensors
(each value copied when logged, in the hook it was logged in), and replays them in order once the step's global loss
is known: a value that is the returned loss (the same tensor, or a view of it such as ``loss.detach()``) is logged as
the global loss, every other one as it was. Any other ``log`` call (a torchmetrics metric, a Python number, a tensor
of several numbers) goes to Lightning at once.

The global loss is known as soon as the step returns, except on a training step on groups of ranks, whose loss is
this rank's share until the gradient return sums every rank's (no collective of its own): its calls are replayed
then, after the backward and before Lightning reads the step's metrics. Values the step derives from its loss
(``torch.exp(loss)``) or from its logits stay this rank's: log them from ``on_train_batch_end`` with
``outputs["loss"]``, the global loss, or compute them with ``sync_dist=True`` where a mean over ranks is meant. A step
that returns no loss but logged such values (Lightning's own ``validation_step`` examples log the loss and return
nothing) is told once per hook and name that they are this rank's, naming the fix: return the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

_NONE = object()


@dataclass(frozen=True)
class _Call:
    """One held ``log`` call: the hook it was made in, its name, a copy of its value, the value itself (held, so
    that its storage cannot be freed and handed to the loss while the step runs), the other arguments."""

    fx: str | None
    name: str
    value: torch.Tensor
    alias: torch.Tensor
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def is_view_of(self, loss: torch.Tensor) -> bool:
        """Whether the logged value is ``loss`` or a view of its storage (both alive: the same storage)."""
        return self.alias.device == loss.device and self.alias.data_ptr() == loss.data_ptr()


class StepLogs:
    """The ``log`` calls of the module's step in flight (see the module docstring)."""

    def __init__(self) -> None:
        self._calls: list[_Call] = []
        self._log: Any = None
        self._module: pl.LightningModule | None = None
        self._loss: torch.Tensor | None = None
        self._warned: set[tuple[str | None, str]] = set()

    @contextlib.contextmanager
    def capture(self, module: pl.LightningModule) -> Iterator[None]:
        """Hold the one-number tensor values ``module`` logs inside the block (its ``log`` replaced on the instance,
        restored after); calls left from a step that never settled are dropped."""
        self.drop()
        log = module.log
        self._log, self._module = log, module

        def held(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()):
                return log(name, value, *args, **kwargs)  # type: ignore[no-any-return]
            fx = module._current_fx_name
            alias = value.detach()  # [] or [1]: the loss itself, or a view of it, when the step logs its loss
            self._calls.append(_Call(fx, name, alias.clone(), alias, args, kwargs))
            return None

        own = module.__dict__.get("log", _NONE)  # an instance attribute of the user's, kept
        module.__dict__["log"] = held  # found before the class's method (nn.Module's __setattr__ not needed)
        try:
            yield
        finally:
            if own is _NONE:
                module.__dict__.pop("log", None)  # the class's log again
            else:
                module.__dict__["log"] = own

    def hold(self, loss: torch.Tensor | None) -> None:
        """The step's loss is settled later (:meth:`replay` with the global loss then): keep its local tensor."""
        self._loss = loss

    def replay(self, local: torch.Tensor | None, total: torch.Tensor | None) -> None:
        """Log every held call in order, in its own hook: a value whose storage is the step's returned loss
        ``local`` (or the loss kept by :meth:`hold`) as ``total``, the global loss; the others as logged."""
        calls, log, module = self._calls, self._log, self._module
        local = self._loss if local is None else local
        self.drop()
        if not calls or log is None or module is None:
            return
        if local is None:  # the step returned no loss: nothing it logged can be made the global loss
            self._warn_unreturned(calls)
        ours = None if local is None or local.numel() != 1 else local
        for call in calls:
            value = total if total is not None and ours is not None and call.is_view_of(ours) else call.value
            previous = module._current_fx_name
            module._current_fx_name = call.fx  # as Lightning sets it around its hooks
            try:
                log(call.name, value.detach().reshape(call.value.shape), *call.args, **call.kwargs)
            finally:
                module._current_fx_name = previous

    def _warn_unreturned(self, calls: list[_Call]) -> None:
        """Say once per hook and name that a value logged by a step that returned no loss is this rank's (Lightning's
        own ``validation_step`` examples log the loss and return nothing; under DDP that is a rank's mean over its
        whole rows, here over its slice of every row, or a Hugging Face model's share of the global mean)."""
        for call in calls:
            key = (call.fx, call.name)
            if key in self._warned:
                continue
            self._warned.add(key)
            hook = call.fx or "the step"
            rank_zero_warn(
                f"[paradyse] {hook} logged {call.name!r} and returned no loss: the value logged is this rank's, "
                "computed on its slice of every sequence (where it is a Hugging Face model's loss given labels, "
                "its share of the global mean, a fraction of it), not the value one process logs. If it is the "
                f"step's loss, return it from {hook} (`return loss`): the strategy then logs the global loss under "
                "the same name. Log other values from global quantities (README: The contract with your "
                "training_step)."
            )

    def drop(self) -> None:
        """Forget the held calls (a step given up)."""
        self._calls, self._loss = [], None

    def reset(self) -> None:
        """Forget the held calls and the module (the end of a fit)."""
        self.drop()
        self._log, self._module = None, None


__all__ = ["StepLogs"]
