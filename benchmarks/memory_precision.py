"""The memory model's predicted peak against the measured one, per mode, in ``32-true`` and in ``bf16-mixed``.

    python benchmarks/memory_precision.py [--modes tp_sp,ulysses,ring,metp]   # about 3 minutes on 2 CPU cores

Two processes train ``llama-tiny`` on one sequence of 128, 256, 512, 768 and 1,024 tokens per step, with
``ParaDySeStrategy(plan="auto", modes=[mode], groups=False)`` on the shipped CPU profile (a budget far above any
step), once per precision. Every step's predicted peak (``plan/predicted_peak_mib``) is printed beside the peak the
:class:`~lightning_paradyse.calibration.tracker.MemoryTracker` measured on rank 0 (``ParaDySeSwitcher(
track_memory=True)``), and their difference. The planner plans per length bucket: at 768 tokens it predicts the
bucket's 1,024 (the bucket's rounding, not the model's error). Memory on the host does not depend on timing: the
numbers are the same in every invocation.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_paradyse import ParaDySeStrategy, ParaDySeSwitcher
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.models import CONFIGS, build_model

ROOT = Path(__file__).resolve().parent.parent
PROFILE = str(ROOT / "configs" / "profiles" / "cpu-2proc-llama-tiny.json")
LENGTHS = (128, 256, 512, 768, 1024)
PRECISIONS = ("32-true", "bf16-mixed")


class Lengths(Dataset[tuple[Tensor, Tensor]]):
    """One sequence per batch, ``LENGTHS[i]`` tokens, targets shifted by one."""

    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        window = torch.randint(0, 128, (1, LENGTHS[i] + 1), generator=torch.Generator().manual_seed(i))
        return window[:, :-1], window[:, 1:]


class LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = build_model(dataclasses.replace(CONFIGS["llama-tiny"], max_seq_len=max(LENGTHS)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        logits = self.model(tokens).float()  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Peaks(pl.Callback):
    """Every step's predicted and measured peak MiB (the switcher's numbers)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float | None, float | None]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        switcher = next(c for c in trainer.callbacks if isinstance(c, ParaDySeSwitcher))  # type: ignore[attr-defined]
        metrics = switcher.metrics
        self.rows.append((metrics.get("plan/predicted_peak_mib"), metrics.get("plan/measured_peak_mib")))


def _fit(mode: str, precision: str, world: int) -> list[tuple[float | None, float | None]]:
    pl.seed_everything(0, verbose=False)
    peaks = Peaks()
    strategy = ParaDySeStrategy(
        plan="auto", modes=[mode], groups=False, memory_budget=2**30, profile=PROFILE, check_step=False, timeout=60
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision=precision,  # type: ignore[arg-type]
        max_steps=len(LENGTHS),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[ParaDySeSwitcher(track_memory=True, log_plan=False, plot=False), peaks],
    )
    trainer.fit(LM(), DataLoader(Lengths(), batch_size=None))
    return peaks.rows


def _worker(rank: int, world: int, port: int, modes: list[str]) -> dict[str, Any]:
    dist.destroy_process_group()  # the harness's group: each Trainer makes its own
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    out = {}
    fits = [(mode, precision) for mode in modes for precision in PRECISIONS]
    for k, (mode, precision) in enumerate(fits):
        os.environ["MASTER_PORT"] = str(port + k)  # a process group per fit
        out[f"{mode} {precision}"] = _fit(mode, precision, world)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="tp_sp,ulysses,ring,metp")
    args = parser.parse_args()
    modes = args.modes.split(",")
    with socket.socket() as sock:  # a free port for the fits' process groups (one per fit from here)
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    ranks = run_distributed(_worker, 2, port, modes, timeout=1200)
    print("predicted / measured peak MiB on rank 0 at " + ", ".join(map(str, LENGTHS)) + " tokens")
    for name, rows in ranks[0].items():
        cells = [f"{p:.2f}/{m:.2f} ({(p - m) / m * 100:+.0f}%)" if p and m else "-" for p, m in rows]
        print(f"{name:<20} " + "  ".join(cells))


if __name__ == "__main__":
    main()
