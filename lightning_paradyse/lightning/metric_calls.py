"""The step's loss in a torchmetrics metric: ``self.train_loss(loss)`` reaches the metric as the global loss.

A common recipe keeps its loss in a metric (``self.train_loss = MeanMetric()``, then ``self.train_loss(loss)`` in the
step and ``self.log("train/loss", self.train_loss)``). Inside the step the loss is this rank's (a mean over its tokens,
a Hugging Face model's share of the global mean); the metric would average the ranks' values, which is not the loss of
the whole batch. So while the module's step runs, :class:`MetricCalls` records the calls of the module's metrics
(``forward`` and ``update``); before a call given a one-number floating value (a tensor, or a Python number such as
``loss.item()``) it keeps the metric's state (and its inner metrics', for a wrapper). Once the step's global loss is
known (where :class:`~lightning_paradyse.lightning.step_logs.StepLogs` replays the step's ``log`` calls), a metric
called with the returned loss (the same tensor, a view of it such as ``loss.detach()``, or a number equal to it) is put
back as it was before that call and the calls are made again, in order, with the global loss in its place: its state,
its step value (also the value its ``forward`` returned, where the step logged that) and its epoch value are then one
process's (every rank holds the same global loss, so the ranks' average is that loss). Calls with other values
(logits, targets) run once, as made: each rank counts its own tokens, and the metric's sum over the ranks is the whole
batch's. A metric also changed since by a call not recorded here (a copy's ``update``) is left as the step left it.

The metrics are found once, when the strategy binds the module (:meth:`MetricCalls.bind`); their ``forward`` is watched
by hooks and their ``update`` wrapped on the instance, both undone at the fit's end (:meth:`MetricCalls.unbind`).
Outside a step they only pass the call on. A call's arguments are kept (alive until the replay, after the backward on
groups) only from the metric's first call given a one-number value on: the logits an accuracy reads are not.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

_KEPT = ("_update_count", "_forward_cache", "_computed", "_cache", "_is_synced")
"""What a metric keeps besides its states that a call changes (torchmetrics ``Metric.reset`` resets these)."""


def is_metric(module: Any) -> bool:
    """A torchmetrics ``Metric`` (without importing torchmetrics: its state defaults and update count)."""
    return isinstance(module, nn.Module) and hasattr(module, "_defaults") and hasattr(module, "_update_count")


def is_collection(module: Any) -> bool:
    """A torchmetrics ``MetricCollection`` (its members may share their states: compute groups)."""
    return isinstance(module, nn.Module) and hasattr(module, "_compute_groups_create_state_ref")


def compute_groups(collection: nn.Module) -> dict[str, Any]:
    """What a metric collection knows of its compute groups (formed at its first update): kept before calls that
    must leave no trace, put back by :func:`put_compute_groups`."""
    return {name: copy.deepcopy(collection.__dict__.get(name)) for name in _GROUPS}


def put_compute_groups(collection: nn.Module, kept: dict[str, Any]) -> None:
    """Put back what :func:`compute_groups` kept, after every member's own state was put back
    (:func:`put_metric_state`, a copy per member): where the groups were formed, the members of a group share the
    first member's states again (else the collection's next update, made on the first member alone, would leave the
    others as they were)."""
    collection.__dict__.update(kept)
    if kept.get("_groups_checked") and getattr(collection, "_enable_compute_groups", False):
        collection.__dict__["_state_is_copy"] = False
        relink: Any = collection._compute_groups_create_state_ref
        relink()


_GROUPS = ("_groups", "_groups_checked", "_state_is_copy")
"""A metric collection's compute groups (torchmetrics ``MetricCollection``)."""


def _one_number(value: Any) -> bool:
    """A one-number floating value: a loss, perhaps."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return type(value) is float


def aliases(value: torch.Tensor, loss: torch.Tensor) -> bool:
    """Whether ``value`` is ``loss`` or a view of its storage (both alive: the same storage)."""
    return value.device == loss.device and value.data_ptr() == loss.data_ptr()


@dataclass
class _Record:
    """One call of a metric during the step: the metric, ``forward`` or ``update``, the arguments (held: their
    storage cannot be handed to another tensor while the step runs), the state of the metric and of its inner metrics
    before the call (kept where an argument is a one-number floating value), the output of a ``forward``."""

    metric: nn.Module
    kind: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    before: list[tuple[nn.Module, dict[str, Any]]] | None
    output: Any = field(default=None)


class _Hook:
    """A metric's forward hook: calls ``fn`` while the fit runs. A copy of the metric (``metric.clone()``) keeps this
    very hook and records itself; a pickled metric gets a hook that does nothing."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_Hook, (_nothing,))


def _nothing(*args: Any) -> None:
    return None


class MetricCalls:
    """The calls of the module's metrics in the step in flight (see the module docstring)."""

    def __init__(self) -> None:
        self.metrics: list[nn.Module] = []
        self._bound: set[int] = set()
        self._collections: list[nn.Module] = []
        self._records: list[_Record] = []
        self._watched: set[int] = set()
        """Metrics given a one-number value in this step: their later calls' arguments are kept."""
        self._active = False
        self._depth = 0
        """Recorded ``forward`` calls in progress (a metric's own ``update`` inside one is not a call of its own)."""
        self._wrapped: list[tuple[nn.Module, Any, tuple[Any, ...]]] = []
        self.loss_called: set[int] = set()
        """The ids of the metrics the last replayed step called with a one-number floating value."""
        self.counted_tokens = False
        """Whether a metric was called in the step with a value of several numbers (logits, targets)."""

    def bind(self, module: nn.Module) -> None:
        """Record the calls of every metric of ``module`` (once per fit; a metric of a metric collection included):
        ``forward`` by hooks before and after it, ``update`` by a wrapper on the instance (where torchmetrics keeps its
        own wrapper). A copy of a metric made during the fit (``metric.clone()``, a tracker's) keeps the hooks and
        records itself; its ``update`` is torchmetrics' own again (see :meth:`replay`)."""
        self.unbind()
        found = list(module.modules())
        self.metrics = [m for m in found if is_metric(m)]
        self._bound = {id(m) for m in self.metrics}
        self._collections = [m for m in found if is_collection(m)]
        for metric in self.metrics:
            own = metric.__dict__.get("update")
            metric.__dict__["update"] = self._wrap_update(metric, metric.update)
            handles = (
                metric.register_forward_pre_hook(_Hook(self._before_forward), with_kwargs=True),
                metric.register_forward_hook(_Hook(self._after_forward), always_call=True),
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
        self._wrapped, self.metrics, self._bound, self._collections = [], [], set(), []
        self.drop()

    def bound(self, metric: Any) -> bool:
        """Whether ``metric``'s calls are recorded (it existed when the fit was set up)."""
        return id(metric) in self._bound

    def _record(self, metric: nn.Module, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        values = (*args, *kwargs.values())
        loss_like = any(_one_number(v) for v in values)
        if any(isinstance(v, torch.Tensor) and v.numel() > 1 for v in values):
            self.counted_tokens = True
        if loss_like:
            self._watched.add(id(metric))
        if id(metric) in self._watched:  # the calls a replay may make again (from the first given a loss on)
            before = metric_state(metric) if loss_like else None
            self._records.append(_Record(metric, kind, args, kwargs, before))

    def _before_forward(self, metric: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._active:
            if not self._depth:
                self._record(metric, "forward", args, kwargs)
            self._depth += 1

    def _after_forward(self, metric: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._active or not self._depth:
            return
        self._depth -= 1
        last = self._records[-1] if self._records else None
        if not self._depth and last is not None and last.metric is metric and last.kind == "forward":
            last.output = output  # the value the step may log: made the global loss's at the replay

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

    def replay(self, local: torch.Tensor | None, total: torch.Tensor | None) -> tuple[set[int], dict[int, Any]]:
        """Every metric called with the step's returned loss ``local`` (or a view of it, or a number equal to it):
        put back as it was before that call and called again from there, in order, with the global loss ``total`` in
        its place. Returns the ids of the metrics made global, and their ``forward`` outputs made again by the address
        of the output each returned in the step (what the step may have logged)."""
        records = self._records
        self.drop()
        self.loss_called = {id(r.metric) for r in records if r.before is not None}
        done: set[int] = set()
        outputs: dict[int, Any] = {}
        if local is None or total is None or local.numel() != 1 or not records:
            return done, outputs
        number: list[float] = []  # this rank's loss as a number, read once where a number was given

        def is_loss(value: Any) -> bool:
            if isinstance(value, torch.Tensor):
                return _one_number(value) and aliases(value, local)
            if type(value) is float:
                number.extend([] if number else [float(local)])
                return value == number[0]
            return False

        tried: set[int] = set()
        for k, first in enumerate(records):
            metric = first.metric
            if id(metric) in tried or first.before is None:
                continue
            if not any(is_loss(v) for v in (*first.args, *first.kwargs.values())):
                continue
            tried.add(id(metric))
            now = metric_state(metric)
            put_metric_state(first.before)
            again = [r for r in records[k:] if r.metric is metric]
            made = []
            with torch.no_grad():
                for call in again:
                    args = tuple(_global(v, is_loss, total) for v in call.args)
                    kwargs = {key: _global(v, is_loss, total) for key, v in call.kwargs.items()}
                    made.append(getattr(metric, call.kind)(*args, **kwargs))
            if not _same_counts(now, metric_state(metric, counts_only=True)):  # changed by a call not recorded here
                put_metric_state(now)
                continue
            done.add(id(metric))
            outputs.update(
                {c.output.data_ptr(): out for c, out in zip(again, made) if isinstance(c.output, torch.Tensor)}
            )
        if done:
            for collection in self._collections:  # the members of a compute group given the first one's states
                copied = bool(getattr(collection, "_state_is_copy", False))  # (anew: copies too, as they were)
                collection.__dict__["_state_is_copy"] = False
                relink: Any = collection._compute_groups_create_state_ref
                relink(copied)
        return done, outputs

    def drop(self) -> None:
        """Forget the recorded calls (a step given up, or settled)."""
        self._records, self._watched, self.counted_tokens = [], set(), False


def metric_state(metric: nn.Module, counts_only: bool = False) -> list[tuple[nn.Module, dict[str, Any]]]:
    """The state of ``metric`` and of every metric inside it (a wrapper's): their states (a tensor copied, a list's
    list: its tensors are appended, not changed), the tensors they keep as plain attributes (a running min or max),
    what else a call changes. ``counts_only``: their update counts alone."""
    out = []
    for m in metric.modules():
        if not is_metric(m):
            continue
        if counts_only:
            out.append((m, {"_update_count": m.__dict__.get("_update_count")}))
            continue
        defaults: dict[str, Any] = m._defaults  # type: ignore[assignment]
        state = {name: _copied(getattr(m, name)) for name in defaults}
        plain = {k: v.clone() for k, v in m.__dict__.items() if isinstance(v, torch.Tensor) and k not in defaults}
        out.append((m, state | plain | {name: copy.copy(m.__dict__.get(name)) for name in _KEPT}))
    return out


def _same_counts(a: list[tuple[nn.Module, dict[str, Any]]], b: list[tuple[nn.Module, dict[str, Any]]]) -> bool:
    return [(id(m), s["_update_count"]) for m, s in a] == [(id(m), s["_update_count"]) for m, s in b]


def put_metric_state(saved: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Put back what :func:`metric_state` kept."""
    for metric, state in saved:
        defaults: dict[str, Any] = metric._defaults  # type: ignore[assignment]
        for name, value in state.items():
            if name in defaults:
                setattr(metric, name, value)
            else:
                metric.__dict__[name] = value


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    return list(value) if isinstance(value, list) else copy.deepcopy(value)


def _global(value: Any, is_loss: Any, total: torch.Tensor) -> Any:
    """``total`` in ``value``'s kind where ``value`` is the step's loss (or a view of it, or a number equal to it),
    else ``value``."""
    if not is_loss(value):
        return value
    if isinstance(value, torch.Tensor):
        return total.detach().to(device=value.device, dtype=value.dtype).reshape(value.shape)
    return float(total)


__all__ = [
    "MetricCalls",
    "aliases",
    "compute_groups",
    "is_collection",
    "is_metric",
    "metric_state",
    "put_compute_groups",
    "put_metric_state",
]
