"""``StepLogs``: what a step logs reaches Lightning in order, in its hook, with the step's loss as the global loss.

The strategy's end-to-end behaviour (every logged metric equal to one plain process's, in float64) is checked by
``tests/exact`` (its modules log their losses inside their steps); here the holding and replaying alone.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from typing_extensions import override

from lightning_paradyse.lightning.step_logs import StepLogs


class Module(pl.LightningModule):
    """Records what reaches ``log``: name, value, the hook it was logged in, the keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, Any, str | None, dict[str, Any]]] = []

    @override
    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.seen.append((name, value, self._current_fx_name, kwargs))


def test_the_steps_loss_is_logged_as_the_global_loss_others_as_logged() -> None:
    module, logs = Module(), StepLogs()
    loss = torch.tensor(2.5, requires_grad=True) * 1.0  # this rank's loss, as the step returns it
    other = torch.tensor(7.0)
    module._current_fx_name = "training_step"
    with logs.capture(module):
        module.log("train_loss", loss, prog_bar=True)
        module.log("detached", loss.detach())  # a view of the loss: the loss too
        module.log("other", other)
        other.add_(1.0)  # changed after it was logged: the logged value stands
    assert module.seen == [], "one-number tensors are held while the step runs"
    module._current_fx_name = "backward"  # where a deferred loss settles
    logs.replay(loss, torch.tensor(5.0))
    names = [(name, float(value), fx, kwargs) for name, value, fx, kwargs in module.seen]
    assert names == [
        ("train_loss", 5.0, "training_step", {"prog_bar": True}),
        ("detached", 5.0, "training_step", {}),
        ("other", 7.0, "training_step", {}),
    ]
    assert module._current_fx_name == "backward", "the hook name is restored"
    assert not any(value.requires_grad for _, value, _, _ in module.seen)


def test_other_values_go_to_lightning_at_once() -> None:
    module, logs = Module(), StepLogs()
    with logs.capture(module):
        module.log("integer", 3)
        module.log("vector", torch.ones(3))
        module.log("count", torch.tensor(4))  # an integer tensor: Lightning's own warning and conversion
    assert [name for name, *_ in module.seen] == ["integer", "vector", "count"]


def test_a_number_equal_to_the_loss_is_logged_as_the_global_loss() -> None:
    """``self.log("train_loss", loss.item())``: held, and logged as the global loss; other numbers as logged."""
    module, logs = Module(), StepLogs()
    loss = torch.tensor(2.5, dtype=torch.float64)
    with logs.capture(module):
        module.log("item", loss.item(), prog_bar=True)
        module.log("lr", 0.125)
    assert module.seen == []
    logs.replay(loss, torch.tensor(5.0, dtype=torch.float64))
    assert [(name, value, kwargs) for name, value, _, kwargs in module.seen] == [
        ("item", 5.0, {"prog_bar": True}),
        ("lr", 0.125, {}),
    ]


@pytest.mark.parametrize("settled", [True, False])
def test_a_number_keeps_the_dtype_lightning_made_it_into_when_it_was_logged(settled: bool) -> None:
    """Under ``precision="64-true"`` the step runs with float64 as the default dtype (Lightning's precision context)
    and its replay may run outside it (after the backward): a number logged there is float64, as one process logs it
    (it was rounded to float32 until 2026-11-30: 4e-8 off ``loss.item()``, a learning rate 5e-8 off). Without a loss
    (``settled=False``) the numbers are logged as logged, in that dtype too."""
    module, logs = Module(), StepLogs()
    loss = torch.tensor(2.5, dtype=torch.float64) / 3
    total = torch.tensor(5.0, dtype=torch.float64) / 3
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with logs.capture(module):
            module.log("item", loss.item())
            module.log("lr", 0.001)
    finally:
        torch.set_default_dtype(before)
    assert torch.get_default_dtype() == torch.float32
    logs.replay(loss if settled else None, total if settled else None)
    seen = {name: value for name, value, _, _ in module.seen}
    assert all(value.dtype == torch.float64 for value in seen.values()), seen
    assert float(seen["lr"]) == 0.001
    assert float(seen["item"]) == (total.item() if settled else loss.item())


@pytest.mark.parametrize("reduce_fx", ["sum", torch.sum])
def test_the_global_loss_is_not_summed_over_the_ranks(reduce_fx: Any) -> None:
    """Every rank holds the global loss: ``sync_dist=True`` with a sum would count it once per rank (a mean or a max
    over the ranks leaves it as it is, and keeps Lightning's batch-size weighting over the ranks)."""
    module, logs = Module(), StepLogs()
    loss = torch.tensor(2.5)
    with logs.capture(module):
        module.log("summed", loss, True, None, True, True, reduce_fx, False, True)  # positional, as the signature
        module.log("summed_item", loss.item(), sync_dist=True, reduce_fx=reduce_fx)
        module.log("mean", loss, sync_dist=True)
        module.log("other", torch.tensor(1.0), sync_dist=True, reduce_fx=reduce_fx)  # not the loss: summed
    logs.replay(loss, torch.tensor(5.0))
    seen = {name: (float(value), kwargs) for name, value, _, kwargs in module.seen}
    assert seen["summed"][0] == 5.0 and seen["summed"][1]["sync_dist"] is False
    assert seen["summed"][1]["prog_bar"] is True and seen["summed"][1]["reduce_fx"] is reduce_fx
    assert seen["summed_item"] == (5.0, {"sync_dist": False, "reduce_fx": reduce_fx})
    assert seen["mean"] == (5.0, {"sync_dist": True})
    assert seen["other"] == (1.0, {"sync_dist": True, "reduce_fx": reduce_fx})


def test_a_deferred_loss_is_replayed_when_settled_and_log_is_restored() -> None:
    module, logs = Module(), StepLogs()
    loss = torch.tensor(1.25)
    with logs.capture(module):
        assert "log" in vars(module)
        module.log("train_loss", loss)
    assert "log" not in vars(module), "the module's own log again after the step"
    logs.hold(loss)  # settled after the gradient return
    logs.replay(None, torch.tensor(3.0))
    assert [(name, float(value)) for name, value, *_ in module.seen] == [("train_loss", 3.0)]
    logs.replay(None, torch.tensor(9.0))  # nothing held any more
    assert len(module.seen) == 1


def test_log_is_restored_when_the_step_raises_and_stale_calls_are_dropped() -> None:
    module, logs = Module(), StepLogs()
    with pytest.raises(RuntimeError, match="step failed"), logs.capture(module):
        module.log("train_loss", torch.tensor(1.0))
        raise RuntimeError("step failed")
    assert "log" not in vars(module)
    with logs.capture(module):  # the next step: the failed one's calls are gone
        module.log("val_loss", torch.tensor(2.0))
    logs.replay(torch.tensor(0.0), torch.tensor(0.0))
    assert [(name, float(value)) for name, value, *_ in module.seen] == [("val_loss", 2.0)]


def test_a_step_that_returns_no_loss_is_told_once_what_it_logged() -> None:
    """Lightning's own ``validation_step`` examples log the loss and return nothing: the value stays this rank's, and
    the strategy says so once per hook and name, naming the fix."""
    module, logs = Module(), StepLogs()
    module._current_fx_name = "validation_step"
    with logs.capture(module):
        module.log("val_loss", torch.tensor(1.5))
    with pytest.warns(UserWarning, match=r"validation_step logged 'val_loss' and returned no loss.*`return loss`"):
        logs.replay(None, None)
    with logs.capture(module):
        module.log("val_loss", torch.tensor(1.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logs.replay(None, None)  # said once
    assert [(name, float(value)) for name, value, *_ in module.seen] == [("val_loss", 1.5)] * 2


def test_an_output_without_a_loss_but_with_one_number_values_is_told_once() -> None:
    """``validation_step`` returning ``{"val_loss": loss}`` (read in ``on_validation_batch_end``): this rank's."""
    logs = StepLogs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            logs.check_output({"val_loss": torch.tensor(1.0), "count": torch.tensor(3)}, "validation_step")
        logs.check_output({"loss": torch.tensor(1.0), "other": torch.tensor(2.0)}, "test_step")  # the loss: global
        logs.check_output({"preds": torch.ones(4)}, "test_step")  # no one-number value
    told = [str(w.message) for w in caught if "no 'loss'" in str(w.message)]
    assert len(told) == 1 and "validation_step returned ['val_loss']" in told[0]
