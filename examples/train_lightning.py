"""Train an ordinary LightningModule with ``Trainer(strategy=ParaDySeStrategy(...))`` on 2 CPU processes.

The module below knows nothing about parallelism: it computes the mean token cross-entropy of the
reference Llama on whatever tokens it is given. The strategy gives each process its slice of every
sequence (no padding: lengths need not divide by the number of processes), chooses a plan per batch
from the batch's length, and turns the returned loss into the exact global loss.

    python examples/train_lightning.py --steps 20
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.data.datamodule import TextDataModule
from lightning_paradyse.models import build_model


class CausalLM(pl.LightningModule):
    """A plain language-model LightningModule (nothing ParaDySe-specific)."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.model = build_model("llama-tiny")
        self.lr = lr

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    @override
    def on_train_batch_end(self, outputs: dict[str, Tensor], batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("loss", outputs["loss"], prog_bar=True, batch_size=batch["input_ids"].shape[0])

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--plan", default="auto", help="auto, a mode name (tp_sp, ulysses, ring, metp)")
    parser.add_argument("--budget", default="8MiB", help="per-process memory budget of the planner (plan auto)")
    args = parser.parse_args()
    pl.seed_everything(0)
    strategy = ParaDySeStrategy(plan=args.plan, memory_budget=args.budget, max_seq_len=1024, timeout=300)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(CausalLM(), TextDataModule(batch_size=2, min_len=64, max_len=768, val_batches=0))
    print(f"final loss {float(trainer.callback_metrics['loss']):.4f} after {args.steps} steps")


if __name__ == "__main__":
    main()
