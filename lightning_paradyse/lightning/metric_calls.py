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

The metrics are found once, when the strategy binds the module (:meth:`MetricCalls.bind`); their ``forward`` is watched
by hooks and their ``update`` wrapped on the instance, both undone at the fit's end (:meth:`MetricCalls.unbind`).
Outside a step they only pass the call on.
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
        self._depth = 0
        """Recorded ``forward`` calls in progress (a metric's own ``update`` inside one is not a call of its own)."""
        self._wrapped: list[tuple[nn.Module, Any, tuple[Any, ...]]] = []
        self.loss_called: set[int] = set()
        """The ids of the metrics the last replayed step called with a one-number floating tensor (a loss,
        perhaps)."""

    def bind(self, module: nn.Module) -> None:
        """Record the calls of every metric of ``module`` (once per fit; a metric of a metric collection included):
        ``forward`` by hooks before and after it, ``update`` by a wrapper on the instance (where torchmetrics keeps its
        own wrapper). A copy of a metric made during the fit (``metric.clone()``, a tracker's) keeps the hooks, plain
        functions, and records itself; its ``update`` is torchmetrics' own again (see :meth:`replay`)."""
        self.unbind()
        self.metrics = [m for m in module.modules() if is_metric(m)]
        for metric in self.metrics:
            own = metric.__dict__.get("update")
            metric.__dict__["update"] = self._wrap_update(metric, metric.update)
            handles = (
                metric.register_forward_pre_hook(lambda m, a, k: self._before_forward(m, a, k), with_kwargs=True),
                metric.register_forward_hook(lambda m, a, o: self._after_forward(), always_call=True),
            )
            self._wrapped.append((metric, own, handles))

    def unbind(self) -> None:
        """The metrics' own ``update`` back, the hooks removed (the fit's end)."""
        for metric, own, handles in self._wrapped:
            if own is None:
                metric.__dict__.pop("update", None)
            else:
                metric.__dict__["update"] = own
            for handle in handles:
                handle.remove()
        self._wrapped, self.metrics = [], []
        self.drop()

    def _record(self, metric: nn.Module, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        before = self._state(metric) if _one_numbers(args, kwargs) else None
        self._records.append(_Record(metric, kind, args, kwargs, before))

    def _before_forward(self, metric: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._active:
            if not self._depth:
                self._record(metric, "forward", args, kwargs)
            self._depth += 1

    def _after_forward(self) -> None:
        self._depth = max(self._depth - 1, 0)

    def _wrap_update(self, metric: nn.Module, update: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self._active and not self._depth:
                self._record(metric, "update", args, kwargs)
            return update(*args, **kwargs)

        return recorded

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the metrics' calls made inside the block (calls left from a step that never settled dropped)."""
        self.drop()
        self._active, self._depth = bool(self.metrics), 0
        try:
            yield
        finally:
            self._active, self._depth = False, 0

    @staticmethod
    def _state(metric: nn.Module) -> dict[str, Any]:
        """The metric's states (a tensor state copied, a list state's list: its tensors are appended, not changed) and
        what else a call changes."""
        defaults: dict[str, Any] = metric._defaults  # type: ignore[assignment]
        state = {name: _copied(getattr(metric, name)) for name in defaults}
        return state | {name: copy.copy(metric.__dict__.get(name)) for name in _KEPT}

    @staticmethod
    def _put(metric: nn.Module, state: dict[str, Any]) -> None:
        for name, value in state.items():
            if name in _KEPT:
                metric.__dict__[name] = value
            else:
                setattr(metric, name, value)

    def replay(self, local: torch.Tensor | None, total: torch.Tensor | None) -> set[int]:
        """Every metric called with the step's returned loss ``local`` (or a view of it): put back as it was before
        that call and called again from there, in order, with the global loss ``total`` in its place. A metric also
        updated since by a call not recorded (a copy's ``update``) is left as the step left it. Returns the ids of the
        metrics made global."""
        records = self._records
        self.drop()
        self.loss_called = {id(r.metric) for r in records if r.before is not None}
        done: set[int] = set()
        if local is None or total is None or local.numel() != 1 or not records:
            return done
        tried: set[int] = set()
        for k, first in enumerate(records):
            metric = first.metric
            if id(metric) in tried or first.before is None:
                continue
            if not any(_aliases(v, local) for v in _one_numbers(first.args, first.kwargs)):
                continue
            tried.add(id(metric))
            now = self._state(metric)
            self._put(metric, first.before)
            with torch.no_grad():
                for again in records[k:]:
                    if again.metric is metric:
                        args = tuple(_global(v, local, total) for v in again.args)
                        kwargs = {key: _global(v, local, total) for key, v in again.kwargs.items()}
                        getattr(metric, again.kind)(*args, **kwargs)
            if metric.__dict__.get("_update_count") == now["_update_count"]:
                done.add(id(metric))
            else:  # updated by a call not recorded here: the step's state back
                self._put(metric, now)
        return done

    def drop(self) -> None:
        """Forget the recorded calls (a step given up, or settled)."""
        self._records = []


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    return list(value) if isinstance(value, list) else copy.deepcopy(value)


def _global(value: Any, local: torch.Tensor, total: torch.Tensor) -> Any:
    """``total`` in ``value``'s shape and dtype where ``value`` is the step's loss ``local`` (or a view of it), else
    ``value``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point() and _aliases(value, local):
        return total.detach().to(device=value.device, dtype=value.dtype).reshape(value.shape)
    return value


__all__ = ["MetricCalls", "is_metric"]
