"""A training run under a memory budget: the adaptive plan stays within it on every step, static ``tp_sp`` does not.

Two Trainers on 2 processes train the same model on sequences of growing length (128 to 1024 tokens) with
``memory_budget=6 MB`` per process: ``plan="auto"`` with the shipped cost profile, and ``plan="tp_sp"``.
Every step's peak is measured as the benchmarks measure it: the largest sum of live tensor storage during the
step (:class:`~lightning_paradyse.calibration.tracker.MemoryTracker`: forward, backward, optimizer step), counting what
is alive when the step starts (parameters, buffers, gradients, optimizer state) until it is freed (the previous
step's gradients, after the forward). Memory on CPU does not depend on timing: the measurement is deterministic.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_paradyse import ParaDySeStrategy, ParaDySeSwitcher
from lightning_paradyse.calibration.tracker import MemoryTracker, state_tensors
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.models import CONFIGS, build_model
from tests.support.dist import free_ports

PROFILE = str(Path(__file__).resolve().parents[2] / "configs" / "profiles" / "cpu-2proc-llama-tiny.json")
BUDGET = 6_000_000
"""Bytes per process: static tp_sp needs about 3.96 MB at 256 tokens and 6.30 MB at 512 (the cost model's
figures); the leanest plan at 1024 tokens about 5.74 MB."""
LENGTHS = (128, 256, 512, 768, 1024)


class GrowingLengths(Dataset[tuple[Tensor, Tensor]]):
    """One sequence per batch, ``LENGTHS[i]`` tokens, targets shifted by one."""

    @override
    def __len__(self) -> int:
        return len(LENGTHS)

    @override
    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        window = torch.randint(0, 128, (1, LENGTHS[i] + 1), generator=torch.Generator().manual_seed(i))
        return window[:, :-1], window[:, 1:]


class LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = build_model(dataclasses.replace(CONFIGS["llama-tiny"], max_seq_len=max(LENGTHS)))

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        return F.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class PeakPerStep(pl.Callback):
    """Each training step's peak bytes on this process."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._tracker: MemoryTracker | None = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._tracker = MemoryTracker(resident=state_tensors(pl_module, trainer.optimizers))
        self._tracker.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        assert self._tracker is not None
        self._tracker.__exit__(None, None, None)
        self.peaks.append(int(self._tracker.peak))


def _fit(plan: str, port: int, world: int) -> dict[str, Any]:
    os.environ["MASTER_PORT"] = str(port)
    pl.seed_everything(0, verbose=False)
    peaks = PeakPerStep()
    strategy = ParaDySeStrategy(plan=plan, memory_budget=BUDGET, profile=PROFILE, timeout=60)
    switcher = ParaDySeSwitcher(track_memory=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=len(LENGTHS),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[peaks, switcher],
    )
    trainer.fit(LM(), DataLoader(GrowingLengths(), batch_size=None))
    logged = {k: v for k, v in switcher.metrics.items() if k.startswith("plan/")}
    return {"peaks": peaks.peaks, "skipped": strategy.skipped_batches, "logged": logged}


def _worker(rank: int, world: int, ports: tuple[int, ...]) -> dict[str, Any]:
    dist.destroy_process_group()  # the harness's group: each Trainer makes its own
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    return {plan: _fit(plan, port, world) for port, plan in zip(ports, ("auto", "tp_sp"))}


@pytest.mark.dist
def test_adaptive_run_stays_within_the_budget_where_static_tp_sp_exceeds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    per_rank = run_distributed(_worker, 2, free_ports(2), timeout=240)  # one port per Trainer
    for rank, out in enumerate(per_rank):
        adaptive, static = out["auto"]["peaks"], out["tp_sp"]["peaks"]
        print(f"rank {rank}: adaptive peaks {adaptive}, static tp_sp peaks {static} (budget {BUDGET})")
        assert len(adaptive) == len(static) == len(LENGTHS) and out["auto"]["skipped"] == 0
        assert max(adaptive) <= BUDGET, f"rank {rank}: the adaptive run exceeded the budget: {adaptive}"
        over = [s for s, peak in zip(LENGTHS, static) if peak > BUDGET]
        assert over and over == list(LENGTHS[LENGTHS.index(over[0]) :]), f"rank {rank}: static tp_sp peaks {static}"
        assert over[0] <= 512, f"static tp_sp should exceed the budget from 512 tokens on, exceeded at {over}"
        for plan, result in out.items():  # the switcher's log of the last step (1024 tokens)
            logged = result["logged"]
            assert logged["plan/measured_peak_mib"] * 2**20 == pytest.approx(result["peaks"][-1], rel=0.01), plan
            assert logged["plan/measured_time_s"] > 0
        predicted = out["auto"]["logged"]["plan/predicted_peak_mib"] * 2**20
        assert predicted <= BUDGET and predicted == pytest.approx(out["auto"]["peaks"][-1], rel=0.03)
