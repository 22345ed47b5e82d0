"""Helpers for tests that run Lightning Trainers inside the spawned gloo harness."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist


def strategy_environment(rank: int, world: int) -> None:
    """Leave the harness's process group and describe the job to Lightning, so that the strategy makes its own
    (set ``MASTER_PORT`` once: each Trainer call creates and destroys a group there, meeting on the store the strategy
    keeps for the process, ``distributed/rendezvous.py``)."""
    dist.destroy_process_group()
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")


ACCELERATOR = os.environ.get("PARADYSE_TEST_ACCELERATOR", "cpu")
"""The accelerator of the tests' Trainers: ``cpu`` (the suite), or ``gpu`` (``benchmarks/gpu_check.py``: every
rank of a strategy shares the one GPU over gloo, the plain process runs on it too)."""
SHARE_DEVICE = ACCELERATOR == "gpu" or os.environ.get("PARADYSE_TEST_SHARE_DEVICE") == "1"
"""Ranks of a strategy share one device (``devices=1``, ``ranks_per_device=p``): on a GPU always; on the host when
``PARADYSE_TEST_SHARE_DEVICE=1`` (the same path, checked without a GPU)."""


def quiet_trainer(devices: int, strategy: Any, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    """A Trainer (on :data:`ACCELERATOR`) without logger, progress bar, model summary or checkpoints (unless
    ``kwargs`` ask); with :data:`SHARE_DEVICE`, a ParaDySe strategy's ranks share one device."""
    from lightning_paradyse import ParaDySeStrategy

    if SHARE_DEVICE and devices > 1 and isinstance(strategy, ParaDySeStrategy):
        strategy.ranks_per_device, devices = devices, 1
    settings: dict[str, Any] = dict(
        accelerator=ACCELERATOR,
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )
    return pl.Trainer(**{**settings, **kwargs})
