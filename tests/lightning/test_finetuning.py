"""Lightning's ``BaseFinetuning`` through checkpoints: its param groups saved by plain names, resumed both ways.

A module's embedding is frozen before training and unfrozen into a new param group at epoch 1 (the callback's own
idiom). Trained 2 epochs under the strategy and in one plain process, each checkpoint resumed by the other for a third
epoch: the callback's saved groups name the plain parameters, and both resumes equal one plain process resuming its
own checkpoint, in float64 (weights and optimizer state). (Not one trained 3 epochs straight: a resumed
``BaseFinetuning`` puts its groups back but freezes the embedding again before training, and this callback unfreezes
it at epoch 1 only; so does plain Lightning.) Until 2026-11-30 our checkpoint named the rewritten
parameters (a plain resume raised a ``KeyError``) and our resume refused the optimizer state (the callback's groups
were put back after it).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BaseFinetuning
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.models import build_model
from tests.exact.harness import TOL, rel
from tests.support.dist import free_ports
from tests.support.lightning import quiet_trainer, strategy_environment

LENGTHS = (40, 57, 33)
"""One epoch's batches (odd lengths split unevenly over the ranks)."""


class FrozenEmbeddingLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        # float64 from the start: plain Lightning loads a resumed checkpoint before its 64-true conversion, into the
        # module as built (a float32 module would round the checkpoint's weights; ours loads after the conversion)
        self.model = build_model("llama-tiny").double()

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3)


class UnfreezeAtEpochOne(BaseFinetuning):
    @override
    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.model.tok_emb)

    @override
    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.tok_emb, optimizer, lr=1e-3)


class SaveAtEnd(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)  # every rank: the strategy's consolidation is a collective


def batches() -> DataLoader[Any]:
    gen = torch.Generator().manual_seed(0)
    items = []
    for n in LENGTHS:
        x = torch.randint(0, 128, (2, n + 1), generator=gen)
        items.append({"input_ids": x[:, :-1], "targets": x[:, 1:]})
    return DataLoader(items, batch_size=None)


def fit(devices: int, strategy: Any, epochs: int, save: str, resume: str | None = None) -> None:
    pl.seed_everything(0, verbose=False)
    callbacks = [UnfreezeAtEpochOne(), SaveAtEnd(save)]
    trainer = quiet_trainer(devices, strategy, callbacks, max_epochs=epochs, precision="64-true")  # type: ignore[arg-type]
    trainer.fit(FrozenEmbeddingLM(), batches(), ckpt_path=resume)


def ours(rank: int, world: int, ports: tuple[int, ...], folder: str) -> None:
    strategy_environment(rank, world)
    os.environ["MASTER_PORT"] = str(ports[0])
    fit(world, ParaDySeStrategy(plan="ulysses", timeout=60), 2, os.path.join(folder, "ours-2.ckpt"))
    os.environ["MASTER_PORT"] = str(ports[1])
    resume = os.path.join(folder, "plain-2.ckpt")
    fit(world, ParaDySeStrategy(plan="ulysses", timeout=60), 3, os.path.join(folder, "ours-from-plain.ckpt"), resume)


def test_finetuning_groups_resume_both_ways_as_one_process_trains() -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = lambda name: os.path.join(folder, f"{name}.ckpt")  # noqa: E731
        fit(1, "auto", 2, path("plain-2"))
        fit(1, "auto", 3, path("plain-from-plain"), resume=path("plain-2"))
        run_distributed(ours, 2, free_ports(2), folder, timeout=240)
        fit(1, "auto", 3, path("plain-from-ours"), resume=path("ours-2"))
        load = lambda name: torch.load(path(name), weights_only=False)  # noqa: E731
        saved, plain = load("ours-2")["callbacks"], load("plain-2")["callbacks"]
        assert saved == plain, (saved, plain)  # the groups by the plain model's names
        reference = load("plain-from-plain")
        for name in ("ours-from-plain", "plain-from-ours"):
            resumed = load(name)
            for key, value in reference["state_dict"].items():
                assert rel(resumed["state_dict"][key], value) < TOL, (name, key)
            groups = [len(g["params"]) for g in resumed["optimizer_states"][0]["param_groups"]]
            assert groups == [len(g["params"]) for g in reference["optimizer_states"][0]["param_groups"]], name
            for index, state in reference["optimizer_states"][0]["state"].items():
                for key, value in state.items():
                    assert rel(resumed["optimizer_states"][0]["state"][index][key], value) < TOL, (name, index, key)
