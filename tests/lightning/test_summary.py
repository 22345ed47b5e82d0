"""The model summary counts the whole model, not this rank's shards (2 processes)."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.lightning.summary import summarize_whole_model
from tests.exact.cases import TinyLM, loader, shifted_targets
from tests.exact.harness import free_port
from tests.support.lightning import quiet_trainer, strategy_environment


class _Totals(pl.Callback):
    def __init__(self) -> None:
        self.totals: list[tuple[int, int]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, ModelSummary):
                summary = cb._summary(trainer, pl_module)
                self.totals.append((summary.total_parameters, sum(summary.param_nums)))


def _worker(rank: int, world: int, port: int) -> dict[str, Any]:
    strategy_environment(rank, world)
    os.environ["MASTER_PORT"] = str(port)
    module = TinyLM()
    whole = sum(p.numel() for p in module.parameters())
    totals = _Totals()
    callbacks = [ModelSummary(max_depth=1), totals]  # depth 1: the rows add up to the total
    trainer = quiet_trainer(world, ParaDySeStrategy(plan="tp_sp"), callbacks, max_steps=1, enable_model_summary=True)
    trainer.fit(module, loader(shifted_targets))
    local = sum(p.numel() for p in module.parameters())
    return {"whole": whole, "local": local, "totals": totals.totals}


@pytest.mark.dist
def test_summary_counts_the_whole_model_on_two_processes() -> None:
    out = run_distributed(_worker, 2, free_port(), timeout=240)[0]
    assert out["local"] < out["whole"], "each rank holds shards"
    assert out["totals"] == [(out["whole"], out["whole"])]


def test_summary_callbacks_are_swapped_keeping_their_kind_and_settings() -> None:
    callbacks: list[pl.Callback] = [ModelSummary(max_depth=3), RichModelSummary(max_depth=2)]
    summarize_whole_model(callbacks)
    assert isinstance(callbacks[0], ModelSummary) and callbacks[0]._max_depth == 3
    assert isinstance(callbacks[1], RichModelSummary) and callbacks[1]._max_depth == 2
    summarize_whole_model(callbacks)  # idempotent
    assert type(callbacks[0]).__name__ == "WholeModelSummary" and torch.is_tensor(torch.zeros(1))
