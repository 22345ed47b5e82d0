"""The step's loss in a torchmetrics metric: ``self.train_loss(loss)`` reaches the metric as the global loss.

A common recipe keeps its loss in a metric (``self.train_loss = MeanMetric()``, then ``self.train_loss(loss)`` in the
step and ``self.log("train/loss", self.train_loss)``). Inside the step the loss is this rank's (a mean over its tokens,
a Hugging Face model's share of the global mean); the metric would average the ranks' values, which is not the loss of
the whole batch. So while the module's step runs, :class:`MetricCalls` records the calls of the module's metrics
(``forward`` and ``update``); before a call whose arguments hold a one-number floating tensor it keeps the metric's
state. Once the step's global loss is known (where :class:`~lightning_paradyse.lightning.step_logs.StepLogs` replays
the step's ``log`` calls), a metric called with the returned loss (the same tensor, or a view of it such as
``loss.detach()``) is put back as it was before that call and the calls are made again, in order, with the global loss
in its place: its state, its step value and its epoch value are then one process's (every rank holds the same global
loss, so the ranks' average is that loss). Calls with other values (logits, targets) run once, as made: each rank
counts its own tokens, and the metric's sum over the ranks is the whole batch's.

The metrics are found once, when the strategy binds the module (:meth:`MetricCalls.bind`); their ``forward`` and
``update`` are wrapped on the instance and unwrapped at the fit's end (:meth:`MetricCalls.unbind`). Outside a step the
wrappers only pass the call on.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

_KEPT = ("_update_count", "_forward_cache", "_computed", "_cache", "_is_synced")
"""What a metric keeps besides its states that a call changes (torchmetrics ``Metric.reset`` resets these)."""


def is_metric(module: nn.Module) -> bool:
    """A torchmetrics ``Metric`` (without importing torchmetrics: its state defaults and update count)."""
    return hasattr(module, "_defaults") and hasattr(module, "_update_count")


def _one_numbers(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The one-number floating tensors among a call's arguments (a loss, where the call is given one)."""
    values = (*args, *kwargs.values())
    return [v for v in values if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point()]


def _aliases(value: torch.Tensor, loss: torch.Tensor) -> bool:
    """Whether ``value`` is ``loss`` or a view of its storage (both alive: the same storage)."""
    return value.device == loss.device and value.data_ptr() == loss.data_ptr()


@dataclass
class _Record:
    """One call of a metric during the step: the metric, ``forward`` or ``update``, the arguments (held: their
    storage cannot be handed to another tensor while the step runs), the metric's state before the call (kept only
    where an argument is a one-number floating tensor)."""

    metric: nn.Module
    kind: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    before: dict[str, Any] | None


class MetricCalls:
    """The calls of the module's metrics in the step in flight (see the module docstring)."""

    def __init__(self) -> None:
        self.metrics: list[nn.Module] = []
        self._records: list[_Record] = []
        self._active = False
        self._inside = False
        self._wrapped: list[tuple[nn.Module, dict[str, Any]]] = []
        self.loss_called: set[int] = set()
        """The ids of the metrics the last replayed step called with a one-number floating tensor (a loss,
        perhaps)."""

    def bind(self, module: nn.Module) -> None:
        """Wrap the ``forward`` and ``update`` of every metric of ``module`` (once per fit; a metric of a metric
        collection included)."""
        self.unbind()
        self.metrics = [m for m in module.modules() if is_metric(m)]
        for metric in self.metrics:
            own: dict[str, Any] = {n: metric.__dict__[n] for n in ("forward", "update") if n in metric.__dict__}
            for name in ("forward", "update"):
                metric.__dict__[name] = self._wrap(metric, name, getattr(metric, name))
            self._wrapped.append((metric, own))

    def unbind(self) -> None:
        """The metrics' own ``forward`` and ``update`` back (the fit's end)."""
        for metric, own in self._wrapped:
            for name in ("forward", "update"):
                if name in own:
                    metric.__dict__[name] = own[name]
                else:
                    metric.__dict__.pop(name, None)
        self._wrapped, self.metrics = [], []
        self.drop()

    def _wrap(self, metric: nn.Module, kind: str, call: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if not self._active or self._inside:  # outside a step, or ``update`` inside a recorded ``forward``
                return call(*args, **kwargs)
            before = self._state(metric) if _one_numbers(args, kwargs) else None
            self._records.append(_Record(metric, kind, args, kwargs, before))
            self._inside = True
            try:
                return call(*args, **kwargs)
            finally:
                self._inside = False

        return recorded

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the metrics' calls made inside the block (calls left from a step that never settled dropped)."""
        self.drop()
        self._active = bool(self.metrics)
        try:
            yield
        finally:
            self._active = False

    @staticmethod
    def _state(metric: nn.Module) -> dict[str, Any]:
        defaults: dict[str, Any] = metric._defaults  # type: ignore[assignment]
        state = {name: copy.deepcopy(getattr(metric, name)) for name in defaults}
        return state | {name: copy.copy(metric.__dict__.get(name)) for name in _KEPT}

    def replay(self, local: torch.Tensor | None, total: torch.Tensor | None) -> set[int]:
        """Every metric called with the step's returned loss ``local`` (or a view of it): put back as it was before
        that call and called again from there, in order, with the global loss ``total`` in its place. Returns the
        ids of those metrics."""
        records = self._records
        self.drop()
        self.loss_called = {id(r.metric) for r in records if r.before is not None}
        done: set[int] = set()
        if local is None or total is None or local.numel() != 1 or not records:
            return done
        for k, first in enumerate(records):
            if id(first.metric) in done or first.before is None:
                continue
            if not any(_aliases(v, local) for v in _one_numbers(first.args, first.kwargs)):
                continue
            done.add(id(first.metric))
            metric = first.metric
            for name, value in first.before.items():
                if name in _KEPT:
                    metric.__dict__[name] = value
                else:
                    setattr(metric, name, value)
            with torch.no_grad():
                for again in records[k:]:
                    if again.metric is metric:
                        args = tuple(_global(v, local, total) for v in again.args)
                        kwargs = {key: _global(v, local, total) for key, v in again.kwargs.items()}
                        getattr(metric, again.kind)(*args, **kwargs)
        return done

    def drop(self) -> None:
        """Forget the recorded calls (a step given up, or settled)."""
        self._records = []


def _global(value: Any, local: torch.Tensor, total: torch.Tensor) -> Any:
    """``total`` in ``value``'s shape and dtype where ``value`` is the step's loss ``local`` (or a view of it), else
    ``value``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point() and _aliases(value, local):
        return total.detach().to(device=value.device, dtype=value.dtype).reshape(value.shape)
    return value


__all__ = ["MetricCalls", "is_metric"]
