"""``MetricCalls``: a torchmetrics metric the step calls with its loss ends the step holding the global loss.

End to end (a recipe's ``MeanMetric`` of the loss, logged per step and per epoch, equal to one plain process's in
float64) in ``tests/exact`` (case ``metric-of-the-loss``); here the recording and the replay alone.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torchmetrics
from typing_extensions import override

from lightning_paradyse.lightning.metric_calls import MetricCalls
from lightning_paradyse.lightning.step_logs import StepLogs


class Module(pl.LightningModule):
    """A recipe's metrics: the mean of the step's loss, a token accuracy; records what reaches ``log``."""

    def __init__(self) -> None:
        super().__init__()
        self.train_loss = torchmetrics.MeanMetric()
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(4, average="micro")
        self.seen: list[tuple[str, Any]] = []

    @override
    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        value = value._forward_cache if isinstance(value, torchmetrics.Metric) else value
        self.seen.append((name, float(value)))


def test_a_metric_called_with_the_loss_holds_the_global_loss() -> None:
    module, calls = Module(), MetricCalls()
    calls.bind(module)
    assert {id(m) for m in calls.metrics} == {id(module.train_loss), id(module.train_acc)}
    module.train_loss(torch.tensor(1.0))  # outside a step: passed on, not recorded
    loss = torch.tensor(3.0, requires_grad=True) * 1.0  # this rank's loss
    with calls.capture():
        step_value = module.train_loss(loss)  # forward: this rank's value for now
        module.train_loss.update(loss.detach())  # a view of the loss: the loss too
        module.train_acc(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
    assert float(step_value.detach()) == 3.0
    made_global, outputs = calls.replay(loss, torch.tensor(5.0))
    assert made_global == {id(module.train_loss)}
    assert [float(v) for v in outputs.values()] == [5.0], "the value its forward returned, made again"
    assert float(module.train_loss._forward_cache) == 5.0, "the step value is the global loss"
    assert module.train_loss.compute() == torch.tensor(11.0) / 3, "the calls made again, in order"
    assert module.train_loss._update_count == 3
    assert module.train_acc.compute() == torch.tensor(2.0) / 3, "a call without the loss runs once"
    assert module.train_acc._update_count == 1


def test_a_metric_called_with_another_number_is_left_as_called() -> None:
    module, calls = Module(), MetricCalls()
    calls.bind(module)
    with calls.capture():
        module.train_loss(torch.tensor(2.0))  # not the step's loss
    assert calls.replay(torch.tensor(3.0), torch.tensor(5.0))[0] == set()
    assert float(module.train_loss.compute()) == 2.0
    assert calls.loss_called == {id(module.train_loss)}


def test_unbind_gives_the_metrics_their_own_calls_back() -> None:
    module, calls = Module(), MetricCalls()
    own_update = module.train_loss.__dict__["update"]  # torchmetrics wraps update on the instance
    calls.bind(module)
    assert module.train_loss.__dict__["update"] is not own_update
    calls.unbind()
    assert module.train_loss.__dict__["update"] is own_update
    assert "forward" not in module.train_loss.__dict__
    assert calls.metrics == []


def test_step_logs_log_a_metric_after_its_loss_is_made_global_and_warn_of_a_ranks_step_value() -> None:
    """The metric logged in the step reaches Lightning once it holds the global loss; an accuracy logged per step is
    this rank's tokens' (told once)."""
    module, logs = Module(), StepLogs()
    logs.bind(module)
    module._current_fx_name = "training_step"
    loss = torch.tensor(3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            with logs.capture(module):
                module.log("train/loss_value", module.train_loss(loss))  # the value forward returns
                module.log("train/loss", module.train_loss, on_step=True, on_epoch=True)
                module.train_acc(torch.tensor([0, 1]), torch.tensor([0, 1]))
                module.log("train/acc", module.train_acc)  # on_step by default in training_step
                module.log("train/acc_epoch", module.train_acc, on_step=False, on_epoch=True)
            assert len(module.seen) == 4 * step, "held while the step runs"
            logs.replay(loss, torch.tensor(5.0))
    expected = [("train/loss_value", 5.0), ("train/loss", 5.0), ("train/acc", 1.0), ("train/acc_epoch", 1.0)]
    assert module.seen[:4] == expected
    told = [str(w.message) for w in caught if "per step" in str(w.message)]
    assert len(told) == 1 and "'train/acc'" in told[0] and "dist_sync_on_step=True" in told[0]
    logs.reset()
    assert "forward" not in module.train_loss.__dict__


def test_a_copy_made_during_the_fit_is_called_as_itself() -> None:
    """A copy of a watched metric (``metric.clone()``, as a metric tracker makes one per epoch) is watched as itself:
    its calls change it, not the original; one its ``update`` also changed (torchmetrics' own again on a copy, not
    recorded) is left as the step left it."""
    module, calls = Module(), MetricCalls()
    calls.bind(module)
    copied = module.train_loss.clone()
    loss = torch.tensor(3.0)
    with calls.capture():
        copied(loss)
        copied(loss)
    assert calls.replay(loss, torch.tensor(5.0))[0] == {id(copied)}
    assert float(copied.compute()) == 5.0 and copied._update_count == 2
    assert module.train_loss._update_count == 0
    with calls.capture():
        copied(loss)
        copied.update(loss)  # not recorded
    assert calls.replay(loss, torch.tensor(5.0))[0] == set()
    assert copied.compute() == torch.tensor(16.0) / 4 and copied._update_count == 4


def test_a_number_equal_to_the_loss_a_wrapper_and_a_compute_group_are_made_global() -> None:
    """``metric(loss.item())``; a wrapper whose own state and inner metric both change (``MinMaxMetric``); metrics of
    a collection sharing their states in a compute group (what ``log_dict(collection)`` reads): each ends as the same
    metric given the global losses."""
    from torchmetrics.wrappers import MinMaxMetric

    def metrics() -> pl.LightningModule:
        module = pl.LightningModule()
        module.item_mean = torchmetrics.MeanMetric()
        module.minmax = MinMaxMetric(torchmetrics.SumMetric())
        module.group = torchmetrics.MetricCollection({"a": torchmetrics.MeanMetric(), "b": torchmetrics.MeanMetric()})
        return module

    def step(module: pl.LightningModule, loss: torch.Tensor) -> None:
        module.item_mean(loss.item())
        module.minmax(loss)
        module.group.update(loss)
        module.group.items(copy_state=True)  # as log_dict does

    ours, plain, calls = metrics(), metrics(), MetricCalls()
    calls.bind(ours)
    for local, total in ((0.5, 10.0), (1.5, 11.0)):
        loss, whole = torch.tensor(local, dtype=torch.float64), torch.tensor(total, dtype=torch.float64)
        with calls.capture():
            step(ours, loss)
        assert calls.replay(loss, whole)[0] >= {id(ours.item_mean), id(ours.minmax), id(ours.group["a"])}
        step(plain, whole)
    assert float(ours.item_mean.compute()) == float(plain.item_mean.compute()) == 10.5
    assert {k: float(v) for k, v in ours.minmax.compute().items()} == {
        k: float(v) for k, v in plain.minmax.compute().items()
    }
    assert float(ours.group["b"].compute()) == float(plain.group["b"].compute()) == 10.5
