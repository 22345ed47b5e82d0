"""CorpusDataModule inside a Trainer: a run resumed from a checkpoint sees exactly the batches it would have seen.

The data module saves the token-budget sampler's position (batches trained, not fetched ahead) in the
checkpoint; a run resumed after 3 steps must receive the same batches 4-6 as the uninterrupted run.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from typing_extensions import override

from lightning_paradyse.data.datamodule import CorpusDataModule


class Recorder(pl.LightningModule):
    """Records a fingerprint of every training batch; a one-parameter model so that steps happen."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.seen: list[tuple[int, int]] = []

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        tokens = batch["input_ids"]
        self.seen.append((tuple(tokens.shape)[1], int(tokens.sum())))
        return (self.weight - tokens.float().mean()) ** 2

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _corpus(root: Path) -> Path:
    rng = random.Random(0)
    folder = root / "docs"
    folder.mkdir()
    for i in range(60):
        text = "".join(rng.choice("abcdefgh \n") for _ in range(rng.randint(20, 400)))
        (folder / f"doc{i:02d}.txt").write_text(text)
    return folder


def _fit(root: Path, folder: Path, max_steps: int, **fit: Any) -> list[tuple[int, int]]:
    data = CorpusDataModule(
        source="folder",
        path=str(folder),
        corpus_bytes=None,
        max_tokens=512,
        max_len=128,
        pack=False,
        order="shuffled",
        val_fraction=0.1,
        seed=3,
        cache_dir=str(root / "cache"),
    )
    module = Recorder()
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", filename="{step}", save_top_k=-1, every_n_train_steps=3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints],
    )
    trainer.fit(module, datamodule=data, **fit)
    return module.seen


def test_resumed_run_sees_the_same_batches(tmp_path: Path) -> None:
    folder = _corpus(tmp_path)
    full = _fit(tmp_path, folder, 6)
    assert len(full) == 6 and len(set(full)) > 1
    resumed = _fit(tmp_path, folder, 6, ckpt_path=str(tmp_path / "ckpt" / "step=3.ckpt"))
    assert resumed == full[3:], (resumed, full)
