"""Helpers for tests that run Lightning Trainers inside the spawned gloo harness."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist


def strategy_environment(rank: int, world: int) -> None:
    """Leave the harness's process group and describe the job to Lightning, so that the strategy makes its own
    (set ``MASTER_PORT`` per Trainer: each creates and destroys a group)."""
    dist.destroy_process_group()
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")


def quiet_trainer(devices: int, strategy: Any, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    """A CPU Trainer without logger, progress bar, model summary or checkpoints (unless ``kwargs`` ask)."""
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )
    return pl.Trainer(**{**settings, **kwargs})
