"""What a step logs: ``self.log(...)`` of the step's loss reaches the loggers as the global loss.

Inside ``training_step`` (``validation_step``, ``test_step``) the module runs on this rank's tokens, so the loss it
computes there is this rank's: a mean over its tokens, a Hugging Face model's share of the global mean (it is handed
the global count of labels), or, on an idle group's rank, a placeholder's. The strategy makes the loss the step
*returns* the exact single-process loss; Lightning's ``self.log("train_loss", loss)`` would have taken the rank's
value when it was called (under DDP too, which users accept as an estimate; here it may be half the loss, or a
placeholder's). So while the module's step runs, :class:`StepLogs` holds its ``log`` calls of one-number tensors
(each value copied when logged, in the hook it was logged in), and replays them in order once the step's global loss
is known: a value that is the returned loss (the same tensor, or a view of it such as ``loss.detach()``) is logged as
the global loss, every other one as it was (below: Python numbers and metrics are held too). Any other ``log`` call
(an integer, a tensor of several numbers) goes to Lightning at once.

The global loss is known as soon as the step returns, except on a training step on groups of ranks, whose loss is
this rank's share until the gradient return sums every rank's (no collective of its own): its calls are replayed
then, after the backward and before Lightning reads the step's metrics. Values the step derives from its loss
(``torch.exp(loss)``) or from its logits stay this rank's: log them from ``on_train_batch_end`` with
``outputs["loss"]``, the global loss, or compute them with ``sync_dist=True`` where a mean over ranks is meant (the
step check names those a training step logs: :mod:`~lightning_paradyse.lightning.step_check`). A step
that returns no loss but logged such values (Lightning's own ``validation_step`` examples log the loss and return
nothing) is told once per hook and name that they are this rank's, naming the fix: return the loss.

Two more kinds of calls are held and replayed in order with them:
- a Python number equal to this rank's loss (``self.log("train_loss", loss.item())``) is logged as the global loss;
- a torchmetrics metric (``self.log("train/loss", self.train_loss)``), or the value its call returned, is logged once
  the metrics the step called with its loss hold the global loss
  (:class:`~lightning_paradyse.lightning.metric_calls.MetricCalls`). A metric logged
  per step (``on_step``) that was not called with the loss has a step value of this rank's tokens (as under DDP, of
  its rows): that is told once per hook and name; its epoch value counts every rank's tokens.

A value logged as the global loss with ``sync_dist=True`` and ``reduce_fx="sum"`` is logged without the sum over the
ranks (every rank holds the same global loss: the sum would count it once per rank); a mean, a max or a min over the
ranks leave it as it is.

While calls are held, the trainer's ``callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics`` do not hold
them yet, where one process's already hold a value logged per step (``on_step``): a step or hook that reads one back
(``self.trainer.callback_metrics["train_loss"]`` to step a ``ReduceLROnPlateau`` in a manual step, or in
``on_before_backward`` on a step on groups) would read the previous step's value. Such a read raises, on every rank
alike, naming the fix (:class:`_HeldMetrics`; silent until 2026-12-02, probe 21: a plateau scheduler stepped a step
late, 5.9e-2 off one process after six steps).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.connectors.logger_connector.fx_validator import _FxValidator
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_paradyse.lightning.metric_calls import MetricCalls, aliases, is_metric

_NONE = object()
_LOG = inspect.signature(pl.LightningModule.log)
"""``LightningModule.log``'s parameters: a held call's arguments read by name."""


@dataclass(frozen=True)
class _Call:
    """One held ``log`` call: the hook it was made in, its name, its value (a copy of a one-number tensor, a Python
    number, or a metric), the tensor itself (held, so that its storage cannot be freed and handed to the loss while
    the step runs), the other arguments."""

    fx: str | None
    name: str
    value: Any
    alias: torch.Tensor | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    dtype: torch.dtype = torch.float32
    """What Lightning would have made a Python number into when it was logged: the default dtype then, no lower than
    float32 (float64 inside a ``precision="64-true"`` step; the replay may run outside it)."""
    default: torch.dtype = torch.float32
    """The default dtype when it was logged: the replay logs under it (Lightning moves a logged metric with ``.to``,
    which sets the dtype a torchmetrics metric casts its updates to from the default dtype)."""

    def is_view_of(self, loss: torch.Tensor) -> bool:
        """Whether the logged value is ``loss`` or a view of its storage (both alive: the same storage)."""
        return self.alias is not None and aliases(self.alias, loss)

    def arguments(self) -> dict[str, Any]:
        """The call's other arguments by name (``prog_bar`` .. ``rank_zero_only``), as given."""
        return log_arguments(self.name, self.args, self.kwargs)

    def as_global(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments for the global loss in place of the value: without ``sync_dist`` where the ranks' values
        would be summed (every rank holds the global loss), else as given."""
        if not self.args and not self.kwargs.get("sync_dist"):
            return self.args, self.kwargs
        named = self.arguments()
        fx = named.get("reduce_fx", "mean")
        if named.get("sync_dist") and (fx == "sum" or fx is torch.sum or fx is sum):
            return (), {**named, "sync_dist": False}
        return self.args, self.kwargs


def log_arguments(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A ``log(name, value, *args, **kwargs)`` call's other arguments by name (``prog_bar`` .. ``rank_zero_only``),
    as given."""
    bound = _LOG.bind_partial(None, name, None, *args, **kwargs).arguments
    return {k: v for k, v in bound.items() if k not in ("self", "name", "value")}


@contextlib.contextmanager
def log_replaced(module: pl.LightningModule, log: Callable[..., Any]) -> Iterator[None]:
    """``module.log`` is ``log`` inside the block: set on the instance, found before the class's method (nn.Module's
    ``__setattr__`` not needed), and taken away after, or an instance attribute of the user's put back."""
    own = module.__dict__.get("log", _NONE)
    module.__dict__["log"] = log
    try:
        yield
    finally:
        if own is _NONE:
            module.__dict__.pop("log", None)  # the class's log again
        else:
            module.__dict__["log"] = own


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``dtype`` is torch's default dtype inside the block, the previous one after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def number_dtype() -> torch.dtype:
    """The dtype Lightning makes a logged Python number into now: the default dtype, no lower than float32."""
    dtype = torch.get_default_dtype()
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


_ALL = object()
"""A read of every entry (iteration, ``items()``), not of one name."""

_METRICS = (
    ("_callback_metrics", "callback_metrics"),
    ("_logged_metrics", "logged_metrics"),
    ("_progress_bar_metrics", "progress_bar_metrics"),
)
"""Lightning's logger connector's metric dicts (the attribute, the trainer property that returns it)."""


class _HeldMetrics(dict):  # type: ignore[type-arg]
    """One of the trainer's metric dicts while a step's ``log`` calls are held (module docstring): a read of a name
    held per step raises (:meth:`StepLogs.check_read`); Lightning's own updates (``dict.update``) go through."""

    def __init__(self, items: dict[str, Any], logs: StepLogs, kind: str) -> None:
        super().__init__(items)
        self._logs, self._kind = logs, kind

    def _check(self, key: Any = _ALL) -> None:
        self._logs.check_read(self._kind, key)

    def __getitem__(self, key: Any) -> Any:
        self._check(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._check(key)
        return super().get(key, default)

    def __contains__(self, key: Any) -> bool:
        self._check(key)
        return super().__contains__(key)

    def __iter__(self) -> Iterator[Any]:
        self._check()
        return super().__iter__()

    def keys(self) -> Any:
        self._check()
        return super().keys()

    def values(self) -> Any:
        self._check()
        return super().values()

    def items(self) -> Any:
        self._check()
        return super().items()

    def copy(self) -> dict[str, Any]:
        self._check()
        return dict.copy(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict.copy(self),)


class StepLogs:
    """The ``log`` calls of the module's step in flight (see the module docstring)."""

    def __init__(self) -> None:
        self._calls: list[_Call] = []
        self._log: Any = None
        self._module: pl.LightningModule | None = None
        self._loss: torch.Tensor | None = None
        self._dtype = torch.float32
        """The default dtype inside the step (float64 in a ``precision="64-true"`` step's precision context), seen
        by its last ``log`` call: the metrics' replay runs under it."""
        self._warned: set[tuple[str | None, str]] = set()
        self.metrics = MetricCalls()
        """The calls of the module's metrics in the step (their loss made global with the logged one)."""
        self.filled = False
        """This rank's slice of the step's batch had one target made real (no real target of its own)."""
        self._told_filled = False
        self._guarded: Any = None
        """The trainer's logger connector whose metric dicts are :class:`_HeldMetrics` while calls are held."""

    def bind(self, module: torch.nn.Module) -> None:
        """Record the calls of ``module``'s metrics in its steps (the fit's start)."""
        self.metrics.bind(module)

    @contextlib.contextmanager
    def capture(self, module: pl.LightningModule) -> Iterator[None]:
        """Hold what ``module`` logs inside the block (its ``log`` replaced on the instance, restored after): one-number
        tensors, Python numbers and metrics; record its metrics' calls. Calls left from a step that never settled are
        dropped."""
        self.drop()
        log = module.log
        self._log, self._module, self._dtype = log, module, torch.get_default_dtype()

        def held(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            fx, default = module._current_fx_name, torch.get_default_dtype()
            self._dtype = default
            if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
                alias = value.detach()  # [] or [1]: the loss itself, or a view of it, when the step logs its loss
                self._calls.append(_Call(fx, name, alias.clone(), alias, args, kwargs, default=default))
            elif type(value) is float or is_metric(value):  # loss.item(); a metric called with the loss, perhaps
                self._calls.append(_Call(fx, name, value, None, args, kwargs, number_dtype(), default))
            else:
                return log(name, value, *args, **kwargs)  # type: ignore[no-any-return]
            self._guard(module)
            return None

        with log_replaced(module, held), self.metrics.capture():
            yield

    def hold(self, loss: torch.Tensor | None) -> None:
        """The step's loss is settled later (:meth:`replay` with the global loss then): keep its local tensor."""
        self._loss = loss

    def replay(self, local: torch.Tensor | None, total: torch.Tensor | None) -> None:
        """Log every held call in order, in its own hook: a value whose storage is the step's returned loss
        ``local`` (or the loss kept by :meth:`hold`), or a number equal to it, as ``total``, the global loss; a
        metric, or the value its ``forward`` returned, once the metrics called with ``local`` hold ``total``
        (:meth:`MetricCalls.replay`); the others as logged."""
        with default_dtype(self._dtype):
            self._replay(local, total)

    def _replay(self, local: torch.Tensor | None, total: torch.Tensor | None) -> None:
        calls, log, module = self._calls, self._log, self._module
        local = self._loss if local is None else local
        self._calls, self._loss = [], None
        self._unguard()
        ours = None if local is None or local.numel() != 1 or not local.is_floating_point() else local
        if self.filled and self.metrics.counted_tokens:
            self._warn_filled()
        self.filled = False
        made_global, outputs = self.metrics.replay(ours, total)
        if not calls or log is None or module is None:
            return
        if local is None:  # the step returned no loss: nothing it logged can be made the global loss
            self._warn_unreturned(calls)
        for call in calls:
            value, args, kwargs = call.value, call.args, call.kwargs
            if isinstance(value, torch.Tensor):
                if total is not None and ours is not None and call.is_view_of(ours):
                    value = total
                    args, kwargs = call.as_global()
                elif call.alias is not None and call.alias.data_ptr() in outputs:  # a metric's forward's value
                    value = outputs[call.alias.data_ptr()]
                value = value.detach().reshape(call.value.shape)
            elif isinstance(value, float):
                value, args, kwargs = self._number(call, ours, total, module.device)
            elif is_metric(value):
                if not self.metrics.bound(value):
                    self._warn_unbound(call)
                elif id(value) not in made_global:
                    self._warn_rank_step_value(call)
            previous = module._current_fx_name
            module._current_fx_name = call.fx  # as Lightning sets it around its hooks
            try:
                with default_dtype(call.default):
                    log(call.name, value, *args, **kwargs)
            finally:
                module._current_fx_name = previous

    @staticmethod
    def _number(
        call: _Call, ours: torch.Tensor | None, total: torch.Tensor | None, device: torch.device
    ) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """A logged number: the global loss where it equals this rank's loss (``loss.item()``), chosen on the loss's
        device (nothing read on the host, unless its sum over the ranks must be dropped then), else as logged; in the
        dtype Lightning made it into when it was logged (:attr:`_Call.dtype`)."""
        if ours is None or total is None:
            return torch.tensor(call.value, dtype=call.dtype, device=device), call.args, call.kwargs
        same = ours.detach().reshape(()) == call.value
        number = torch.tensor(call.value, dtype=call.dtype, device=ours.device)  # what Lightning made of it
        global_loss = total.detach().reshape(()).to(device=ours.device, dtype=call.dtype)
        args, kwargs = call.as_global()
        if (args, kwargs) != (call.args, call.kwargs):  # summed over the ranks: decided on the host
            return (global_loss, args, kwargs) if bool(same) else (number, call.args, call.kwargs)
        return torch.where(same, global_loss, number), args, kwargs

    def _warn_unreturned(self, calls: list[_Call]) -> None:
        """Say once per hook and name that a value logged by a step that returned no loss is this rank's (Lightning's
        own ``validation_step`` examples log the loss and return nothing; under DDP that is a rank's mean over its
        whole rows, here over its slice of every row, or a Hugging Face model's share of the global mean)."""
        for call in calls:
            key = (call.fx, call.name)
            if key in self._warned or isinstance(call.value, float):  # a number: a learning rate as likely as a loss
                continue
            if is_metric(call.value) and id(call.value) not in self.metrics.loss_called:
                continue
            self._warned.add(key)
            hook = call.fx or "the step"
            rank_zero_warn(
                f"[paradyse] {hook} logged {call.name!r} and returned no loss: the value logged is this rank's, "
                "computed on its slice of every sequence (where it is a Hugging Face model's loss given labels, "
                "its share of the global mean, a fraction of it), not the value one process logs. If it is the "
                f"step's loss, return it from {hook} (`return loss`): the strategy then logs the global loss under "
                "the same name (and a metric it was given, such as a MeanMetric, holds the global loss). Log other "
                "values from global quantities (docs/training-step.md)."
            )

    def check_output(self, output: Any, fx: str | None) -> None:
        """Say once per hook that a step returned one-number values under other keys than ``loss`` and no loss (an
        evaluation step's ``{"val_loss": loss}``, read in ``on_validation_batch_end``): they are this rank's."""
        if not isinstance(output, Mapping) or "loss" in output or (fx, "<output>") in self._warned:
            return
        keys = [
            k for k, v in output.items() if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point()
        ]
        if not keys:
            return
        self._warned.add((fx, "<output>"))
        hook = fx or "the step"
        rank_zero_warn(
            f"[paradyse] {hook} returned {keys} and no 'loss': these values are this rank's, computed on its slice of "
            "every sequence, not what one process returns. Return the step's loss as its output, or under 'loss': "
            "the strategy then makes it the global loss, wherever it is read (in on_validation_batch_end's outputs "
            "too)."
        )

    def _warn_filled(self) -> None:
        """Say once, on this rank, that a metric counting the targets counted the target made real."""
        if self._told_filled:
            return
        self._told_filled = True
        warnings.warn(
            "[paradyse] this rank's slice of a batch held no real target (e.g. a prompt masked with -100 over its "
            "tokens), so its first target was made real (class 0) for the step: the module's mean loss stays "
            "finite, and the strategy weighs it by 0. A torchmetrics metric the step updated from the targets "
            "counted that token (e.g. an accuracy), which one process does not. To keep such metrics exact, return "
            "a loss summed over the targets with ParaDySeStrategy(loss_reduction='sum') (no target is made real "
            "then).",
            stacklevel=2,
        )

    def _warn_unbound(self, call: _Call) -> None:
        """Say once per name that a metric made after the fit's setup is not watched."""
        key = (call.fx, call.name)
        if key in self._warned:
            return
        self._warned.add(key)
        rank_zero_warn(
            f"[paradyse] {call.fx} logged the metric {call.name!r}, made after the fit was set up: the strategy does "
            "not see its calls, so a loss it was given stays this rank's. Create metrics in the module's __init__ "
            "(or setup/configure_model)."
        )

    def _warn_rank_step_value(self, call: _Call) -> None:
        """Say once per hook and name that a metric logged per step has a step value of this rank's tokens."""
        key = (call.fx, call.name)
        synced = getattr(call.value, "dist_sync_on_step", False)  # its step value is the whole batch's already
        if key in self._warned or synced or call.fx not in _FxValidator.functions:
            return
        on_step, _ = _FxValidator.get_default_logging_levels(call.fx, call.arguments().get("on_step"), None)
        if not on_step:
            return
        self._warned.add(key)
        rank_zero_warn(
            f"[paradyse] {call.fx} logged the metric {call.name!r} per step: its step value is computed on this "
            "rank's tokens of the batch (under DDP, on its rows), not the whole batch's; its epoch value "
            "(on_epoch=True) counts every rank's tokens, as one process's does. Log it with on_step=False, or set "
            "the metric's dist_sync_on_step=True for a step value of the whole batch."
        )

    @contextlib.contextmanager
    def trial(self) -> Iterator[None]:
        """Steps held and replayed inside the block (the step check's) leave what is told once as it was:
        a warning they would give is still given by the fit's own steps."""
        warned, told, filled = set(self._warned), self._told_filled, self.filled
        try:
            yield
        finally:
            self._warned, self._told_filled, self.filled = warned, told, filled

    def drop(self) -> None:
        """Forget the held calls (a step given up)."""
        self._calls, self._loss = [], None
        self._unguard()
        self.metrics.drop()

    def _guard(self, module: pl.LightningModule) -> None:
        """The trainer's metric dicts made :class:`_HeldMetrics` (once a step, at its first held call)."""
        connector = getattr(getattr(module, "_trainer", None), "_logger_connector", None)
        if connector is None or connector is self._guarded:
            return
        self._unguard()
        for attr, kind in _METRICS:
            found = getattr(connector, attr, None)
            if type(found) is dict:
                setattr(connector, attr, _HeldMetrics(found, self, kind))
        self._guarded = connector

    def _unguard(self) -> None:
        """The trainer's metric dicts plain again, with what Lightning put in them meanwhile."""
        connector, self._guarded = self._guarded, None
        for attr, _ in _METRICS if connector is not None else ():
            found = getattr(connector, attr, None)
            if isinstance(found, _HeldMetrics):
                setattr(connector, attr, dict.copy(found))

    def check_read(self, kind: str, key: Any = _ALL) -> None:
        """Raise where a read of the trainer's ``kind`` metrics (of ``key``, or of every entry) would find a value
        one process holds already and this run does not yet: one the step logged per step (``on_step``), held."""
        held = [call.name for call in self._calls if _per_step(call)]
        if not held:
            return
        if key is not _ALL:
            base = str(key).removesuffix("_step").removesuffix("_epoch")
            if key not in held and base not in held:
                return
            name = str(key)
        else:
            name = held[0]
        module = self._module
        where = getattr(module, "_current_fx_name", None) or "the step"
        raise RuntimeError(
            f"{where} read trainer.{kind}[{name!r}] after the step logged it: ParaDySeStrategy holds a step's "
            "self.log calls until its global loss is known (when the step returns; on a step on groups of ranks, "
            "after the gradient return) and logs them then, so this read would find the previous step's value where "
            "one process finds this step's. Use the value itself where the step computes it (e.g. pass the loss to "
            "scheduler.step(), or keep it in an attribute), or read the trainer's metrics in on_train_batch_end"
        )

    def reset(self) -> None:
        """Forget the held calls and the module (the end of a fit); the metrics' own calls back."""
        self.drop()
        self.metrics.unbind()
        self._log, self._module = None, None


def _per_step(call: _Call) -> bool:
    """Whether Lightning logs ``call`` per step (``on_step``, its hook's default where not given): one process's
    metric dicts then hold its value at once."""
    named = call.arguments()
    if call.fx not in _FxValidator.functions:
        return named.get("on_step") is not False
    resolved, _ = _FxValidator.get_default_logging_levels(call.fx, named.get("on_step"), named.get("on_epoch"))
    return bool(resolved)


__all__ = ["StepLogs", "number_dtype"]
