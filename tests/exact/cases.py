"""The user paths the differential layer walks: ordinary LightningModules, as users write them.

Nothing here knows about parallelism. Each module is what a user would bring: the package's own
:class:`~lightning_paradyse.lightning.language_model.LanguageModel` (it calls its model with a positional
``positions=None``), Hugging Face models called the ways their documentation shows, Lightning's own features switched
on by Trainer flags, and the optimizers and hooks of common recipes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import (
    EarlyStopping,
    EMAWeightAveraging,
    LearningRateFinder,
    ModelPruning,
    StochasticWeightAveraging,
)
from lightning.pytorch.utilities import CombinedLoader, grad_norm
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_paradyse import gather_like_params, shard_like_params
from lightning_paradyse.data.batching import pack_documents
from lightning_paradyse.lightning.language_model import LanguageModel
from lightning_paradyse.models import build_model, resolve_config
from lightning_paradyse.models.llama import Llama, resolve_positions
from lightning_paradyse.runtime import parallel
from tests.exact.harness import Case
from tests.support.families import (
    HF_FAMILIES,
    MORE_FAMILIES,
    EncoderLM,
    ListMoELM,
    hf_family,
    hf_llama,
    hf_llama_classifier,
    hf_llama_token_classifier,
)
from tests.support.lightning import ACCELERATOR

LENGTHS = (40, 57, 33, 64, 45, 50)
"""Batch lengths: odd ones split unevenly over 2 and 3 ranks."""
ACROSS = "computes something across the tokens"
"""The step check's refusal."""
MIXED = ["tp_sp", {"attention": "ring", "mlp": "metp", "recompute": True}]
"""A mixed plan for two layers (every rank count that divides the heads)."""
MIXED_BIDIRECTIONAL = ["tp_sp", {"attention": "ring", "mlp": "ulysses", "recompute": True}]
"""A mixed plan for BERT (its MLP is inline: no METP)."""
EVERY_MODE = [{"attention": "ulysses", "mlp": "tp_sp"}, {"attention": "ring", "mlp": "metp", "recompute": True}]
"""Every mode of a two-layer model, one op each."""
MIXED_3 = [{"attention": "ring", "mlp": "metp"}, {"attention": "ring", "mlp": "tp_sp", "recompute": True}]
"""Modes that run 2 or 4 kv heads on 3 ranks."""


class Batches(Dataset[Any]):
    """Item ``i`` is a whole batch of ``rows`` sequences of ``lengths[i]`` tokens, built by ``make``."""

    def __init__(self, make: Callable[[Tensor], dict[str, Tensor]], lengths: tuple[int, ...] = LENGTHS, rows: int = 2):
        self.make, self.lengths, self.rows = make, lengths, rows

    @override
    def __len__(self) -> int:
        return len(self.lengths)

    @override
    def __getitem__(self, i: int) -> dict[str, Tensor]:
        gen = torch.Generator().manual_seed(1000 + i)
        return self.make(torch.randint(0, 128, (self.rows, self.lengths[i] + 1), generator=gen))


def loader(
    make: Callable[[Tensor], dict[str, Tensor]], lengths: tuple[int, ...] = LENGTHS, rows: int = 2
) -> DataLoader[Any]:
    return DataLoader(Batches(make, lengths, rows), batch_size=None)


class PackedBatches(Dataset[Any]):
    """Packed batches as the package's data makes them (``data.pack=true``: documents in one sequence, positions
    restarting, ``doc_ids``; :func:`~lightning_paradyse.data.batching.pack_documents`), seeded per index."""

    def __init__(self, documents: tuple[tuple[int, ...], ...]) -> None:
        self.documents = documents

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        gen = torch.Generator().manual_seed(100 + i)
        return pack_documents([torch.randint(0, 128, (n,), generator=gen) for n in self.documents[i]])


PACKED = ((20, 13, 9), (31, 17), (12, 25, 8, 11), (44,))
"""Documents per packed batch (uneven over 2 and 3 ranks and over the groups)."""


class FlattenedBatches(Dataset[Any]):
    """Packed rows as Hugging Face's ``DataCollatorWithFlattening`` makes them (``input_ids``, ``labels`` with -100 at
    each document's first token, ``position_ids`` restarting at 0 in each document; no ``attention_mask``), seeded
    per index; ``rows``: that many rows of such documents stacked (a batch HF keeps apart per row)."""

    def __init__(self, documents: tuple[tuple[int, ...], ...], rows: int = 1) -> None:
        from transformers import DataCollatorWithFlattening

        self.documents, self.rows, self.collate = documents, rows, DataCollatorWithFlattening()

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        gen = torch.Generator().manual_seed(300 + i)
        rows = [
            self.collate(
                [{"input_ids": torch.randint(3, 128, (n,), generator=gen).tolist()} for n in self.documents[i]]
            )
            for _ in range(self.rows)
        ]
        return {k: torch.cat([row[k] for row in rows]) for k in rows[0]}  # [rows, s] each


def shifted_targets(window: Tensor) -> dict[str, Tensor]:
    """Targets shifted in the data (the package's convention), a few without a target."""
    targets = window[:, 1:].clone()
    targets[0, -3:] = -100
    return {"input_ids": window[:, :-1], "targets": targets}


def hf_labels(window: Tensor) -> dict[str, Tensor]:
    """Hugging Face convention: labels are the tokens (the model shifts them), some ignored."""
    labels = window[:, :-1].clone()
    labels[1, :4] = -100
    return {"input_ids": window[:, :-1], "labels": labels}


def hf_labels_tuple(window: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`hf_labels` as a tuple ``(input_ids, labels)``, as a ``TensorDataset``'s loader yields."""
    batch = hf_labels(window)
    return batch["input_ids"], batch["labels"]


def ragged_tuple(window: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`ragged` Hugging Face rows as a tuple ``(input_ids, labels, attention_mask)``."""
    batch = ragged("labels")(window)
    return batch["input_ids"], batch["labels"], batch["attention_mask"]


def two_lengths(window: Tensor) -> dict[str, Tensor]:
    """:func:`hf_labels` with a second set of sequences 5 tokens shorter (``other_ids``), as preference data holds."""
    return hf_labels(window) | {"other_ids": window[:, :-6].clone()}


def tokens_tensor(window: Tensor) -> Tensor:
    """The tokens alone, the batch itself a tensor (a Hugging Face model handed them as its labels too)."""
    return window[:, :-1]


def all_targets(window: Tensor) -> dict[str, Tensor]:
    """Targets shifted in the data, every position with one."""
    return {"input_ids": window[:, :-1], "targets": window[:, 1:]}


def last_untargeted(window: Tensor) -> dict[str, Tensor]:
    """Targets shifted in the data, every position with one but the last (a row's end, as a collator pads the
    shift)."""
    targets = window[:, 1:].clone()
    targets[:, -1] = -100
    return {"input_ids": window[:, :-1], "targets": targets}


def targets_after_first(window: Tensor) -> dict[str, Tensor]:
    """Every position has a target in the first batch (of ``LENGTHS[0]`` tokens); a few have none in the others."""
    batch = all_targets(window)
    if window.shape[1] - 1 != LENGTHS[0]:
        batch["targets"] = batch["targets"].clone()
        batch["targets"][1, -5:] = -100
    return batch


def weighted_later(window: Tensor) -> dict[str, Tensor]:
    """Ragged rows whose targets weigh 1 on their first 20 positions and 2 after (0 where there is none)."""
    batch = ragged("targets")(window)
    weights = torch.ones(batch["targets"].shape, dtype=torch.float64)
    weights[:, 20:] = 2.0
    weights[batch["targets"] == -100] = 0.0
    return batch | {"weights": weights}


def ragged_counted(window: Tensor) -> dict[str, Tensor]:
    """Ragged rows (Hugging Face labels) with a count of items in the batch, as a data loader gives one for
    transformers' loss over accumulated batches (here a constant: what it divides by is the point)."""
    return ragged("labels")(window) | {"n_items": torch.tensor(150)}


def pad_targets_zero(window: Tensor) -> dict[str, Tensor]:
    """The second row padded with the pad id 0 over its last third, its targets there 0 too (no attention mask)."""
    ids, targets = window[:, :-1].clone(), window[:, 1:].clone()
    s = ids.shape[1]
    ids[1, s - s // 3 :] = 0
    targets[1, s - s // 3 - 1 :] = 0
    return {"input_ids": ids, "targets": targets}


def tgt_targets(window: Tensor) -> dict[str, Tensor]:
    """:func:`all_targets` under the key ``tgt`` (one the strategy does not read as the targets)."""
    return {"input_ids": window[:, :-1], "tgt": window[:, 1:]}


def pad_zero_after_first(window: Tensor) -> dict[str, Tensor]:
    """Targets shifted in the data, no id 0 in the first batch (of ``LENGTHS[0]`` tokens); in the others the second row
    padded with the pad id 0 over its last third, its targets there 0 too (no -100, no attention mask)."""
    ids, targets = window[:, :-1].clone(), window[:, 1:].clone()
    ids[ids == 0], targets[targets == 0] = 1, 1
    if ids.shape[1] != LENGTHS[0]:
        s = ids.shape[1]
        ids[1, s - s // 3 :] = 0
        targets[1, s - s // 3 - 1 :] = 0
    return {"input_ids": ids, "targets": targets}


def even_then_ragged(window: Tensor) -> dict[str, Tensor]:
    """Every row's last target -100 in the first batch (of ``LENGTHS[0]`` tokens: rows of equal counts of targets),
    ragged rows in the others."""
    return last_untargeted(window) if window.shape[1] - 1 == LENGTHS[0] else ragged("targets")(window)


def loss_mask_after_first(window: Tensor) -> dict[str, Tensor]:
    """Targets shifted in the data, every one real, and a ``loss_mask`` of ones in the first batch (of ``LENGTHS[0]``
    tokens) and zeros over the second row's first third in the others (a prompt the loss leaves out, marked only
    there)."""
    batch = all_targets(window)
    mask = torch.ones(batch["targets"].shape, dtype=torch.float64)
    if window.shape[1] - 1 != LENGTHS[0]:
        mask[1, : mask.shape[1] // 3] = 0.0
    return batch | {"loss_mask": mask}


def targets_mid_tuple(window: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`all_targets` as a tuple ``(input_ids, targets, attention_mask)``: the targets not last."""
    return window[:, :-1], window[:, 1:], torch.ones_like(window[:, :-1])


def tokens_only(window: Tensor) -> dict[str, Tensor]:
    return {"input_ids": window[:, :-1]}


def hf_shift_labels(window: Tensor) -> dict[str, Tensor]:
    """Labels already shifted over the whole sequence, in the batch (``shift_labels``)."""
    shift = window[:, 1:].clone()
    shift[:, -1] = -100
    return {"input_ids": window[:, :-1], "shift_labels": shift}


def prompt_masked(window: Tensor) -> dict[str, Tensor]:
    """Instruction tuning: the first three quarters are prompt (no target), so with 2 ranks and the causal
    layout (rank 1 holds the 2nd and 3rd quarters) rank 1 holds no target at all."""
    batch = shifted_targets(window)
    s = batch["targets"].shape[1]
    batch["targets"][:, : 3 * s // 4 + 1] = -100
    return batch


def padded(side: str) -> Callable[[Tensor], dict[str, Tensor]]:
    """Two rows, the second padded (left or right) with an ``attention_mask``; labels of padding are -100."""

    def make(window: Tensor) -> dict[str, Tensor]:
        ids = window[:, :-1].clone()
        s = ids.shape[1]
        mask = torch.ones_like(ids)
        pad = slice(s - s // 3, s) if side == "right" else slice(0, s // 3)
        mask[1, pad] = 0
        ids[1, pad] = 0
        labels = ids.clone()
        labels[mask == 0] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return make


def ragged(labels: str) -> Callable[[Tensor], dict[str, Tensor]]:
    """Rows of different real lengths, right-padded with an ``attention_mask`` (a data collator's batch): row ``r``
    keeps ``s - r s / (2 b)`` tokens; targets of padding are -100. ``labels``: ``"labels"`` (Hugging Face, the model
    shifts them) or ``"targets"`` (shifted in the data)."""

    def make(window: Tensor) -> dict[str, Tensor]:
        ids = window[:, :-1].clone()
        b, s = ids.shape
        mask = torch.ones_like(ids)
        for r in range(b):
            mask[r, s - (r * s) // (2 * b) :] = 0
        ids[mask == 0] = 0
        if labels == "labels":
            target = ids.clone()
        else:
            target = window[:, 1:].clone()
            target[:, :-1][mask[:, 1:] == 0] = -100  # the last real token predicts nothing (no next token)
        target[mask == 0] = -100
        return {"input_ids": ids, "attention_mask": mask, labels: target}

    return make


class TinyLM(pl.LightningModule):
    """The reference Llama, mean token cross-entropy, the optimizer and hooks a recipe picks; it logs its losses with
    ``self.log`` inside its steps, as users do (the training loss also per epoch, the validation loss as a detached
    view with ``sync_dist``)."""

    def __init__(
        self,
        optimizer: str = "adamw",
        clip_in_hook: float | None = None,
        scheduler: bool = False,
        clip_by_total: bool = False,
        built: bool = True,
    ):
        super().__init__()
        self.model: Any = build_model("llama-tiny") if built else None  # else in configure_model
        self.optimizer, self.clip_in_hook, self.scheduler = optimizer, clip_in_hook, scheduler
        self.clip_by_total = clip_by_total

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss.detach(), sync_dist=True)
        return loss

    @override
    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("test_loss", loss)
        return loss

    @override
    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(batch["input_ids"]).log_softmax(-1)  # [b, s, vocab]

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.clip_in_hook is None:
            return
        if self.clip_by_total:  # the two-part form: the norm of the gradients, then a scaling by it
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None])
            torch.nn.utils.clip_grads_with_norm_(self.parameters(), self.clip_in_hook, norm)
        else:  # a recipe's own clipping, as plain PyTorch code
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.clip_in_hook)

    @override
    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.optimizer, self.parameters())
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ConfiguredLM(TinyLM):
    """A :class:`TinyLM` whose model is built in ``configure_model``, as Lightning recommends for large models (the
    strategy parallelises what the hook built)."""

    def __init__(self) -> None:
        super().__init__(built=False)

    @override
    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_model("llama-tiny")


class KeptLossesLM(TinyLM):
    """Lightning 2's way to an epoch's mean: every step's returned loss kept in a list (the tensor itself, or a detached
    view of it), averaged and logged at the epoch's end; the strategy writes the global loss into the tensor the step
    returned."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[str, list[Tensor]] = {"train": [], "val": []}

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.kept["train"].append(loss.detach())
        return loss

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.kept["val"].append(loss)
        return loss

    @override
    def on_train_epoch_end(self) -> None:
        self.log("train_epoch_mean", torch.stack(self.kept["train"]).mean())
        self.kept["train"].clear()

    @override
    def on_validation_epoch_end(self) -> None:
        self.log("val_epoch_mean", torch.stack(self.kept["val"]).mean())
        self.kept["val"].clear()


class GradNormLM(TinyLM):
    """Lightning's documented gradient-norm logging: ``self.log_dict(grad_norm(self, norm_type=2))`` in
    ``on_before_optimizer_step`` (``grad_norm`` imported at the top of the user's file). ``part``: the attribute path of
    the sub-module whose norms are logged (``""``: the whole module)."""

    def __init__(self, norm_type: float | str = 2, part: str = "") -> None:
        super().__init__()
        self.norm_type, self.part = norm_type, part

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        module = self.get_submodule(self.part) if self.part else self
        self.log_dict(grad_norm(module, norm_type=self.norm_type))


class EncoderTinyLM(TinyLM):
    """A :class:`TinyLM` over ``nn.TransformerEncoderLayer`` blocks, which compute their MLP inline (its two linears
    are rewritten one by one)."""

    def __init__(self) -> None:
        super().__init__(built=False)
        self.model = EncoderLM(causal=True)


class DrawsFirstLM(ConfiguredLM):
    """A :class:`ConfiguredLM` that draws random numbers in ``__init__`` first (a buffer of its own): the hook's
    weights are what one process draws next only if no rank is re-seeded between the two (Lightning's DDP re-seeds
    at setup)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("noise", torch.randn(5))


def shuffled(make: Callable[[Tensor], dict[str, Tensor]], rows: int = 2) -> DataLoader[Any]:
    """:func:`loader` with ``shuffle=True``: every epoch's order drawn from torch's global stream when the epoch
    starts, as one process draws it only if the strategy's set-up draws nothing from it (and no rank is re-seeded)."""
    return DataLoader(Batches(make, LENGTHS[:4], rows), batch_size=None, shuffle=True)


def masked_at_random(item: dict[str, Tensor]) -> dict[str, Tensor]:
    """A loader's collate that hides a random fifth of the targets (drawn where the loader runs, in its workers;
    float32 draws whatever the default dtype)."""
    targets = item["targets"].clone()
    targets[torch.rand(targets.shape, dtype=torch.float32) < 0.2] = -100
    return {"input_ids": item["input_ids"], "targets": targets}


def seeded_workers() -> DataLoader[Any]:
    """Two loader workers masking at random, seeded by ``seed_everything(workers=True)`` as Lightning documents it
    (each worker's seed then depends on the rank: the strategy gives every rank one process's, rank 0's). Forked:
    the spawn launcher's workers would spawn theirs (its start method), each importing this module anew, 11 of the
    case's 18 s; a worker draws from the seeds the loader hands it either way."""
    pl.seed_everything(0, workers=True, verbose=False)
    batches = Batches(shifted_targets, LENGTHS[:4])
    return DataLoader(
        batches,
        batch_size=None,
        shuffle=True,
        num_workers=2,
        collate_fn=masked_at_random,
        multiprocessing_context="fork",
    )


class NudgedLM(TinyLM):
    """Weights scaled in place between two micro-batches of one optimizer step (an EMA-like hook a recipe may
    have): shards kept from the first micro-batch are stale for the second."""

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx % 2 == 1:
            with torch.no_grad():
                for param in self.parameters():
                    param.mul_(0.99)


class _Manual(TinyLM):
    """A :class:`TinyLM` with manual optimization (its subclasses' steps back, clip and step themselves)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False


class ManualLM(_Manual):
    """Manual optimization, as Lightning documents it: the step zeroes, backs its loss with ``manual_backward``,
    clips, steps the optimizer and the scheduler, logs and returns its loss."""

    def __init__(self) -> None:
        super().__init__(scheduler=True)

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()  # type: ignore[union-attr]
        loss = self.loss(batch)
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.05)  # type: ignore[arg-type]
        optimizer.step()  # type: ignore[union-attr]
        self.lr_schedulers().step()  # type: ignore[union-attr]
        self.log("train_loss", loss, prog_bar=True)
        return loss


class ManualAccumulateLM(_Manual):
    """Manual optimization accumulating two batches per optimizer step, as Lightning documents it: the loss divided
    by 2 and backed every batch, the optimizer stepped and zeroed every second one."""

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        loss = self.loss(batch)
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            optimizer.step()  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]
        return loss


class ManualTwiceLM(_Manual):
    """Manual optimization with two forwards and two backwards in one step (half the loss each), then the step."""

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        first = self.loss(batch)
        self.manual_backward(first / 2)
        second = self.loss(batch)
        self.manual_backward(second / 2)
        optimizer.step()  # type: ignore[union-attr]
        optimizer.zero_grad()  # type: ignore[union-attr]
        return first


class ManualRetainLM(_Manual):
    """Manual optimization backing one forward's loss in two parts (``retain_graph=True``), then the step."""

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        loss = self.loss(batch)
        self.manual_backward(0.3 * loss, retain_graph=True)
        self.manual_backward(0.7 * loss)
        optimizer.step()  # type: ignore[union-attr]
        optimizer.zero_grad()  # type: ignore[union-attr]
        return loss


class ManualTwiceHookLM(ManualTwiceLM):
    """:class:`ManualTwiceLM` whose ``on_after_backward`` logs the whole model's gradient norm after each backward:
    after the second, the sum of both backwards' gradients, as one process's (until 2026-11-30 the replicated
    parameters held the second backward's alone there)."""

    backwards = 0

    @override
    def on_after_backward(self) -> None:
        self.backwards += 1
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.log(f"grad_norm_{self.backwards % 2}", torch.nn.utils.get_total_norm(grads))


class RowsDividedLM(TinyLM):
    """A summed cross-entropy divided by the batch's number of rows (each sequence weighed alike), with
    ``ParaDySeStrategy(loss_reduction="sum")``: exact where every rank holds a slice of every row, but on a step on
    groups each group divides by its own rows (twice one process's loss on 2 groups, silently, until 2026-11-30)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        summed = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="sum")
        return summed / batch["targets"].shape[0]


class RowWeightsLM(TinyLM):
    """Each row's token losses weighed by a per-row weight a collator puts in the batch as a Python list (``[1.0,
    1.5, 2.0]``), over the real targets: on a step on groups the list is cut to the group's rows with its tensors
    (until 2026-11-30 it kept every row, and the step crashed)."""

    @override
    def loss(self, batch: dict[str, Any]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        targets = batch["targets"]
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)  # [b, s]
        weights = torch.tensor(batch["row_weights"], dtype=ce.dtype)[:, None]  # [b] -> [b, 1]
        real = (targets != -100).to(ce.dtype)
        return (ce * weights * real).sum() / real.sum()


def row_weights(window: Tensor) -> dict[str, Any]:
    """:func:`ragged` targets with a per-row weight as a Python list."""
    batch: dict[str, Any] = ragged("targets")(window)
    return batch | {"row_weights": [1.0 + 0.5 * r for r in range(window.shape[0])]}


class RandomMaskLM(TinyLM):
    """A masking drawn in the step (15% of the input tokens replaced by token 0, ``torch.rand(ids.shape)``): each
    rank draws on its slice from its own stream, so no rank draws one process's masks; refused by the step check,
    naming the draws (until 2026-11-30 its reason listed other causes)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        ids = batch["input_ids"]
        masked = ids.masked_fill(torch.rand(ids.shape) < 0.15, 0)  # [b, s]
        logits = self.model(masked)  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


class TransferMaskLM(TinyLM):
    """:class:`RandomMaskLM`'s masking drawn where its refusal says: in ``on_after_batch_transfer``, on the whole batch,
    before the strategy slices it (every rank draws what one process draws): exact (probe of 2026-12-01)."""

    @override
    def on_after_batch_transfer(self, batch: dict[str, Tensor], dataloader_idx: int) -> dict[str, Tensor]:
        if not self.trainer.training:
            return batch
        ids = batch["input_ids"]
        return dict(batch, input_ids=ids.masked_fill(torch.rand(ids.shape) < 0.15, 0))  # [b, s]


class CheckpointedLlama(Llama):
    """The reference Llama whose own forward calls every block through ``torch.utils.checkpoint``."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__(resolve_config("llama-tiny"))
        self.reentrant = reentrant

    @override
    def forward(self, idx: Tensor, positions: Tensor | None = None) -> Tensor:
        positions = resolve_positions(positions, idx.shape[1], self.config.max_seq_len, idx.device)  # [s]
        x = self.tok_emb(idx)  # [b, s] -> [b, s, h]
        for block in self.layers:
            x = checkpoint(block, x, positions, use_reentrant=self.reentrant)
        return self.lm_head(self.norm(x))  # [b, s, h] -> [b, s, vocab]


class CheckpointedBlocksLM(TinyLM):
    """A model that recomputes its blocks itself (:class:`CheckpointedLlama`, a recomputation the strategy does not
    know of: each rewritten block, collectives included, runs again in the backward): exact, reentrant or not (probe
    of 2026-12-01: on groups, on one group in ``ring``, and a mixed plan with recomputation)."""

    def __init__(self, reentrant: bool = True) -> None:
        super().__init__(built=False)
        self.model = CheckpointedLlama(reentrant)


class RandomBranchLM(TinyLM):
    """A step that draws a number and branches on it (a task sampled per step: on about half the steps a second call
    of the model), and weighs its loss by a drawn factor: every rank draws what one process draws (until 2026-11-30
    each rank drew its own: a collective mismatch where one rank called the model again, silently inexact on groups)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        loss = super().loss(batch)
        if float(torch.rand(())) < 0.5:  # a branch of the step's own
            loss = loss + 0.5 * super().loss(batch)
        return loss * (1.0 + 0.1 * torch.rand((), dtype=loss.dtype))


class LaterPerRowLM(TinyLM):
    """A loss that changes after the first batches (a warm-up on the token mean, then a mean of each row's mean, which
    a rank computes from its slice of the row): the step check, run again at the 10th batch, refuses it there (until
    2026-11-30 it ran on the first batch alone, and the later loss trained silently)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        if self.global_step < 3:
            return super().loss(batch)
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        targets = batch["targets"]
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)  # [b, s]
        real = (targets != -100).to(ce.dtype)
        return ((ce * real).sum(1) / real.sum(1)).mean()  # [b, s] -> [b] -> []


class TruncatingLM(TinyLM):
    """Truncates its batch to 48 tokens in the step (``batch["input_ids"][:, :48]``), a common ``max_len`` idiom: each
    rank would cut its slice, shorter than 48, so nothing (until 2026-11-30 it trained on the whole rows where one
    process trains on 48 tokens, silently): refused by the step check, naming the cut."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        short = {k: v[:, :48] for k, v in batch.items()}  # [b, s] -> [b, min(s, 48)]
        return super().loss(short)


class PositionsInStepLM(TinyLM):
    """Works on positions of the sequence in the step, beyond the step check's first tokens (position 20; until
    2026-11-30, eighteenth session, each rank applied it to its slice's positions, silently, or crashed): a prompt
    masked up to a position on a clone of the targets (``t[:, :20] = -100``), a response found after a separator
    (``(ids == 3).cumsum(1) > 0``), weights by position (``torch.arange(s) < 20``), a truncation with ``narrow``
    (``narrow(1, 0, 20)``: crashed inside the check). Refused naming what it did."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        ids, targets = batch["input_ids"], batch["targets"]
        if self.kind == "narrow":
            return super().loss({"input_ids": ids.narrow(1, 0, 20), "targets": targets.narrow(1, 0, 20)})
        logits = self.model(ids)  # [b, s, vocab]
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)  # [b, s]
        real = (targets != -100).to(ce.dtype)
        if self.kind == "mask-prefix":
            kept = targets.clone()
            kept[:, :20] = -100
            real = (kept != -100).to(ce.dtype)
        elif self.kind == "after-separator":
            real = real * ((ids == 3).cumsum(1) > 0).to(ce.dtype)
        elif self.kind == "weights-by-position":
            real = real * torch.where(torch.arange(ids.shape[1]) < 20, 1.0, 0.5)[None, :]  # [s] -> [1, s]
        return (ce * real).sum() / real.sum().clamp(min=1)


class HookedWeightLM(TinyLM):
    """A gradient hook on a projection weight, registered in ``__init__`` (a partial-freezing trick): the strategy
    replaces the weight by its shard, which would train unchanged (silently until 2026-11-30): refused."""

    def __init__(self) -> None:
        super().__init__()
        self.model.layers[0].attn.q.weight.register_hook(lambda grad: grad * 0)


class NormLoggingLM(TinyLM):
    """Logs the whole model's gradient norm before each optimizer step, as recipes watch it
    (``torch.nn.utils.get_total_norm`` of every gradient: the norm over the ranks' shards, as one process's)."""

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.log("grad_norm", torch.nn.utils.get_total_norm(grads))


class AfterBackwardLM(TinyLM):
    """Reads and changes the gradients in ``on_after_backward``, as recipes do: logs the whole model's gradient norm,
    clips it, zeroes the first block's gradients by name. The hook reads what one process holds (the gradients summed
    over the ranks and groups: until 2026-11-30 it ran before the sum and changed this rank's partial gradients)."""

    @override
    def on_after_backward(self) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.log("grad_norm", torch.nn.utils.get_total_norm(grads))
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)
        for name, p in self.named_parameters():
            if name.startswith("model.layers.0.") and p.grad is not None:
                p.grad.zero_()


class SkippedZeroGradLM(TinyLM):
    """Clears the gradients only before every ``every``-th batch (a hand-made accumulation over steps; Lightning asks
    at the first micro-batch of each window): the other steps add to the gradients the step before applied, as one
    process's do (until 2026-11-30 those, summed over the ranks already, were summed again: each replicated
    parameter's counted once per rank)."""

    def __init__(self, every: int = 2) -> None:
        super().__init__()
        self.every = every

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        if batch_idx % self.every == 0:
            optimizer.zero_grad(set_to_none=(batch_idx // self.every) % 2 == 0)  # None, or zeros: both


class StepsScheduledLM(TinyLM):
    """``OneCycleLR`` over ``self.trainer.estimated_stepping_batches``, as recipes schedule: it sets the training loader
    up inside ``configure_optimizers``, which the strategy calls once more before the rewrite (until the review of
    2026-11-30 that call came before the strategy kept the loaders' samplers, and Lightning put a distributed sampler
    in: another order than one process's, silently)."""

    @override
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class HandDecayLM(TinyLM):
    """Weight decay added to every gradient by hand before the optimizer step, under ``torch.no_grad()`` (exact); in
    grad mode (``grad_mode=True``, as hooks run) PyTorch refuses to change a gradient that is a view of a shared
    buffer that way (ours are, as DDP's with ``gradient_as_bucket_view`` and FSDP2's): refused on every rank, naming
    the fix (PyTorch's own message until 2026-11-30)."""

    def __init__(self, grad_mode: bool = False) -> None:
        super().__init__()
        self.grad_mode = grad_mode

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        with contextlib.nullcontext() if self.grad_mode else torch.no_grad():
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.add_(p, alpha=0.01)


class ReducedLossLM(TinyLM):
    """Reduces its loss over the ranks with the strategy's ``reduce``, as DDP scripts do: the loss it returns stays its
    own (Lightning's DDP reduces in place, which made it the mean of the ranks' own losses until 2026-11-30)."""

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        return loss


class GatheredTokensLM(TinyLM):
    """Keeps every validation token's target and all-gathers them at the epoch's end (to compute a metric over the
    epoch, as DDP scripts do): each rank holds its slice of the sequence, so the ranks' tensors differ in length, which
    aborted the processes inside gloo until 2026-11-30; refused on every rank, naming the fix."""

    @override
    def on_validation_epoch_start(self) -> None:
        self.kept: list[Tensor] = []

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.kept.append(batch["targets"].flatten())
        return super().validation_step(batch, batch_idx)

    @override
    def on_validation_epoch_end(self) -> None:
        self.all_gather(torch.cat(self.kept))


class AccuracyLM(TinyLM):
    """Token accuracy in ``torchmetrics`` metrics, updated from each step's logits and logged as metric objects (their
    counts summed over the ranks when computed: each token is on one rank, so the sums are one process's)."""

    def __init__(self) -> None:
        super().__init__()
        accuracy = lambda: torchmetrics.classification.MulticlassAccuracy(128, average="micro", ignore_index=-100)  # noqa: E731
        self.train_acc, self.val_acc = accuracy(), accuracy()

    def _step(self, batch: dict[str, Tensor], metric: torchmetrics.Metric, name: str) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        metric.update(logits.argmax(-1), batch["targets"])
        self.log(name, metric, on_step=False, on_epoch=True)
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, self.train_acc, "train_acc")

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, self.val_acc, "val_acc")


class RecipeMetricsLM(TinyLM):
    """A common recipe's logging: the step's loss kept in a ``MeanMetric`` (called with the loss, logged as the metric
    per step and per epoch), a token accuracy per epoch, ``loss.item()`` logged, the loss summed over the ranks with
    ``sync_dist`` (one process: no sum) and over the epoch's steps; the validation loss in a ``MeanMetric`` too."""

    def __init__(self) -> None:
        super().__init__()
        self.train_loss, self.val_loss = torchmetrics.MeanMetric(), torchmetrics.MeanMetric()
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(128, average="micro", ignore_index=-100)

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
        self.train_loss(loss)
        self.train_acc(logits.argmax(-1), batch["targets"])
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        self.log("train/loss_item", loss.item())
        self.log("train/loss_sum", loss, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
        return loss

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.val_loss(loss)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True)
        return loss


class ChunkedLossLM(TinyLM):
    """The cross-entropy computed chunk by chunk along the sequence, as memory-saving recipes do: summed over the
    chunks and divided by the count of real targets (exact: a sum over the tokens), or ``mean_per_chunk``, each
    chunk's mean averaged (not one process's under any split of the rows' tokens: refused)."""

    def __init__(self, mean_per_chunk: bool = False, chunk: int = 16) -> None:
        super().__init__()
        self.mean_per_chunk, self.chunk = mean_per_chunk, chunk

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits, targets = self.model(batch["input_ids"]), batch["targets"]  # [b, s, vocab], [b, s]
        pieces = zip(logits.split(self.chunk, dim=1), targets.split(self.chunk, dim=1))  # [b, c, vocab], [b, c]
        if self.mean_per_chunk:
            means = [F.cross_entropy(lg.flatten(0, 1), lb.flatten()) for lg, lb in pieces if bool((lb != -100).any())]
            return torch.stack(means).mean()
        total = sum(F.cross_entropy(lg.flatten(0, 1), lb.flatten(), reduction="sum") for lg, lb in pieces)
        return total / (targets != -100).sum()


class Float64MetricsLM(RecipeMetricsLM):
    """The recipe's metrics set to float64 (``set_dtype``): Lightning moves a logged metric with ``.to`` inside the
    step, under ``precision="64-true"``'s default dtype, and from then on the metric casts its updates to float64;
    the strategy logs after the step, so it logs under the step's default dtype as well."""

    def __init__(self) -> None:
        super().__init__()
        self.train_loss.set_dtype(torch.float64)
        self.val_loss.set_dtype(torch.float64)


class AveragedLM(TinyLM):
    """An exponential moving average of the weights kept in the module (the strategy refuses Lightning's
    ``EMAWeightAveraging``: it copies the module before the shards exist), saved whole in the checkpoint with
    ``gather_like_params`` and read back with ``shard_like_params``."""

    def __init__(self) -> None:
        super().__init__()
        self.ema: dict[str, Tensor] | None = None

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            if self.ema is None:
                self.ema = {n: w.detach().clone() for n, w in self.named_parameters()}
            else:
                for n, w in self.named_parameters():
                    self.ema[n].mul_(0.9).add_(w.detach(), alpha=0.1)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["ema"] = gather_like_params(self, self.ema or {})

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.ema = shard_like_params(self, checkpoint["ema"])


class TwoValLM(TinyLM):
    """Two validation (and test) loaders (``dataloader_idx``), each loss logged per loader, an early stop watching
    the first."""

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss)
        return loss

    @override
    def test_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        loss = self.loss(batch)
        self.log("test_loss", loss)
        return loss


def _two_val_data() -> tuple[DataLoader[Any], list[DataLoader[Any]]]:
    return loader(shifted_targets), [loader(shifted_targets, (35, 52)), loader(shifted_targets, (44, 30))]


class SelfShift(TinyLM):
    """A step that shifts targets itself, as litgpt-style code does: wrong on a slice of the sequence."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        ids = batch["input_ids"]
        logits = self.model(ids)  # [b, s, vocab]
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class EveryPositionLM(TinyLM):
    """A loss averaged over every position, those without a target included (``reduction="none"`` then
    ``.mean()``): one process's mean counts the ignored positions, a slice's counts its own."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none").mean()


class ManualEveryPositionLM(ManualLM):
    """:class:`ManualLM` backing a loss averaged over every position (:class:`EveryPositionLM`'s)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        return EveryPositionLM.loss(self, batch)  # type: ignore[arg-type]


class ManualRowMeansLM(ManualLM):
    """:class:`ManualLM` backing the mean of each row's mean (:class:`RowMeansLM`'s)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        return RowMeansLM.loss(self, batch)  # type: ignore[arg-type]


class ZLossLM(TinyLM):
    """The mean cross-entropy over the real targets plus a z-loss of the logits over every position (PaLM's
    ``1e-4 * logsumexp**2``), ignored positions included."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        z = logits.logsumexp(-1).pow(2).mean()  # [b, s] -> []
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten()) + 1e-4 * z


class TrainingZLossLM(ZLossLM):
    """:class:`ZLossLM`'s z-loss added in training only (``if self.training:``, a step helper shared with validation):
    the step check ran the step in eval mode, where the term was not there (silent until 2026-12-02, probe 19)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        return super().loss(batch) if self.training else TinyLM.loss(self, batch)


class BackwardHookLM(TinyLM):
    """Lightning's ``backward`` hook overridden: backing the loss scaled (exact) or with a term the step kept added
    (``aux``: this rank's own mean, refused; silent until 2026-12-02, probe 19)."""

    def __init__(self, aux: bool = False) -> None:
        super().__init__()
        self.aux_term = aux

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        self.aux = logits.logsumexp(-1).pow(2).mean()  # [b, s] -> []
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    @override
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        (loss + 1e-4 * self.aux if self.aux_term else loss * 4.0).backward()


class SelfNormalisedLM(TinyLM):
    """The loss divided by its own value taken without a gradient (multi-task magnitude normalisation,
    ``ce / ce.detach()``): one on every rank and in one process, but each rank's gradient is scaled by its own slice's
    loss (silent until 2026-12-02: the step check compared values only; it now compares their gradients by the
    model's outputs too)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        ce = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
        return ce / ce.detach()


class BeforeBackwardLoggedLM(TinyLM):
    """The loss Lightning hands ``on_before_backward`` (a recipe's way to see the loss backed) logged, a value derived
    from it logged, and its ``.item()`` kept and logged in ``on_train_batch_end``: on a step on groups the hook was
    handed this rank's share of the loss (silently, until 2026-12-02, probes 19 and 20); now a tensor of the global
    loss's value."""

    def __init__(self) -> None:
        super().__init__()
        self.backed: list[float] = []

    @override
    def on_before_backward(self, loss: Tensor) -> None:
        self.log("backed_loss", loss)
        self.log("backed_loss_exp", torch.exp(loss.detach()))
        self.backed.append(loss.item())

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log("last_backed", self.backed[-1])


class SpikeWatcher(pl.Callback):
    """A callback that counts loss spikes in ``on_before_backward`` (the backed loss above a threshold) and logs the
    count and a running maximum (on a step on groups it read this rank's share until 2026-12-02, probe 20)."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self.seen.append(float(loss))
        pl_module.log("spikes", float(sum(value > 4.8 for value in self.seen)))
        pl_module.log("running_max", max(self.seen))


class ManualBeforeBackwardLoggedLM(ManualLM):
    """:class:`ManualLM` logging the loss Lightning hands ``on_before_backward`` (what ``manual_backward`` backs) and
    its ``.item()``: the hook was handed this rank's weighed share of the loss (silently, until 2026-12-02, probe 20);
    now a tensor of the global loss's value."""

    @override
    def on_before_backward(self, loss: Tensor) -> None:
        self.log("backed_loss", loss)
        self.log("backed_loss_item", loss.item())


class MetricsReadBackLM(_Manual):
    """A manual step that logs its loss and steps a ``ReduceLROnPlateau`` on the value read back from
    ``trainer.callback_metrics`` (a recipe's way to feed the scheduler what it logged): the strategy logs a step's
    values once its global loss is known, so the read found the previous step's value (silently, 5.9e-2 off one
    process after six steps, until 2026-12-02, probe 21); now refused by name."""

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()  # type: ignore[union-attr]
        loss = self.loss(batch)
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        self.log("train_loss", loss)
        self.lr_schedulers().step(self.trainer.callback_metrics.get("train_loss", torch.tensor(10.0)))  # type: ignore
        return loss

    @override
    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.optimizer, self.parameters())
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.0)
        return {"optimizer": optimizer, "lr_scheduler": plateau}


class MetricsReadInHooksLM(TinyLM):
    """``trainer.callback_metrics`` read where one process holds what it reads: the validation loss inside the
    validation step that logged it (logged per epoch: the previous epoch's, both ways) and the training loss at the
    batch's end; with ``before_backward`` also in ``on_before_backward``, which on a step on groups comes before the
    strategy logs the step's values (silently the previous step's until 2026-12-02, probe 21; now refused)."""

    def __init__(self, before_backward: bool = False) -> None:
        super().__init__()
        self.before_backward = before_backward
        self.seen: list[float] = []

    def _read(self, name: str) -> None:
        value = self.trainer.callback_metrics.get(name)
        self.seen.append(-1.0 if value is None else float(value))
        self.log(f"seen_{name}", self.seen[-1])

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = super().validation_step(batch, batch_idx)
        self._read("val_loss")
        return loss

    @override
    def on_before_backward(self, loss: Tensor) -> None:
        if self.before_backward:
            self._read("train_loss_step")

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._read("train_loss_step")


class LogitsGradientHookLM(TinyLM):
    """A hook on the logits' gradient (``logits.register_hook``): clamping each entry is exact; scaling by a statistic
    of the slice's logits (``scaled``) is refused by the step check's gradient comparison. Until 2026-12-02 the check
    ran the step without gradients and both raised "cannot register a hook on a tensor that doesn't require gradient"
    (probe 20)."""

    def __init__(self, scaled: bool = False) -> None:
        super().__init__()
        self.scaled = scaled

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        if self.scaled:
            scale = float(logits.detach().abs().mean())  # this rank's slice's
            logits.register_hook(lambda g: g * scale)
        else:
            logits.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


class HardTargetsLM(TinyLM):
    """Hard-example mining: the mean cross-entropy over the real targets the model gets wrong (``argmax(logits) !=
    targets``). Each rank divides by its own count of them, where the strategy weighs its mean by its real targets:
    silent until 2026-12-02 (probe 20: the first batches' model gets every target wrong); refused by the rule it
    averages over, whatever the batch. An accuracy logged from the same comparison is not refused."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits, targets = self.model(batch["input_ids"]), batch["targets"]  # [b, s, vocab], [b, s]
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)  # [b, s]
        wrong = (logits.detach().argmax(-1) != targets) & (targets != -100)  # [b, s]
        return ce[wrong].mean()


class FocalLM(TinyLM):
    """A focal loss: each real target's cross-entropy weighed by ``(1 - p)^2`` of its probability taken without a
    gradient, averaged over the real targets. Per-token weights taken without a gradient are exact (the gradient
    comparison must not refuse them)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        targets = batch["targets"].flatten()  # [b s]
        ce = F.cross_entropy(logits.flatten(0, 1), targets, reduction="none")  # [b s], 0 at -100
        weight = (1 - torch.exp(-ce)).detach() ** 2  # [b s]
        return (weight * ce)[targets != -100].mean()


class BatchNormHeadLM(TinyLM):
    """A ``BatchNorm1d`` over the logits' vocabulary channels: in training its statistics are over the tokens it is
    handed, this rank's slice (silent until 2026-12-02: the step check ran sub-modules in eval mode, probe 19)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(self.model.lm_head.out_features)

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        logits = self.norm(logits.flatten(0, 1))  # [b s, vocab]: statistics over the tokens
        return F.cross_entropy(logits, batch["targets"].flatten())


class StepCounterLM(TinyLM):
    """A buffer counting the training steps (checkpointed), read by the loss's weight: the same on every rank, so one
    process's. Refused until 2026-12-02 (probe 19: the check's second call saw the counter its first had advanced),
    and the checkpoint counted the check's calls (10 after 4 steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps_done", torch.zeros((), dtype=torch.long))

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.steps_done += 1
        loss = self.loss(batch) * (1.0 + 0.5 * self.steps_done)
        self.log("train_loss", loss)
        return loss


class TokensSeenLM(TinyLM):
    """A buffer counting the real targets trained on, from the tokens the step is handed: this rank's slice's
    (silent until 2026-12-02, probe 19)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.tokens_seen += (batch["targets"] != -100).sum()
        return super().training_step(batch, batch_idx)


class LossEmaLM(TinyLM):
    """The loss divided by a running mean of the steps' losses kept in a buffer, updated in the step with the step's
    own loss (this rank's, not the global one): the loss is one process's, the buffer is not."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("loss_ema", torch.ones((), dtype=torch.float64))

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        loss = super().loss(batch)
        scaled = loss / self.loss_ema.clone()  # by the mean of the steps before
        with torch.no_grad():
            self.loss_ema.mul_(0.5).add_(0.5 * loss.detach())
        return scaled


class WeightedLM(TinyLM):
    """Per-token weights from the batch, the loss normalised by their sum on what the step is handed."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        ce = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none")  # [b s]
        weights = batch["weights"].flatten()  # [b, s] -> [b s]
        return (ce * weights).sum() / weights.sum()


class WeightedByTotalLM(TinyLM):
    """Per-token weights from the batch, the loss normalised by the whole batch's sum of them, a 0-dim tensor the
    loader puts in the batch (every rank and group is handed it whole): a sum over the tokens, exact with
    ``ParaDySeStrategy(loss_reduction="sum")`` (the fix the step check names for :class:`WeightedLM`)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        ce = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none")  # [b s]
        return (ce * batch["weights"].flatten()).sum() / batch["weights_total"]


def weighted_later_total(window: Tensor) -> dict[str, Tensor]:
    """:func:`weighted_later` with the batch's sum of the weights (0-dim)."""
    batch = weighted_later(window)
    return batch | {"weights_total": batch["weights"].sum()}


class PadIgnoredLM(TinyLM):
    """A loss that ignores the pad id (0) rather than -100."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=0)


class OtherTargetsLM(TinyLM):
    """A mean cross-entropy over targets shifted in the data that the strategy does not find as the targets: under the
    key ``tgt``, or second in a tuple ``(input_ids, targets, attention_mask)``. Exact while every position had a target,
    silently off one process from the first batch with padding until 2026-12-02 (probe 16): refused since."""

    @override
    def loss(self, batch: Any) -> Tensor:
        ids, targets = (batch[0], batch[1]) if isinstance(batch, (tuple, list)) else (batch["input_ids"], batch["tgt"])
        logits = self.model(ids)  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class PadSelectedLM(TinyLM):
    """A mean cross-entropy over the positions whose target is not the pad id 0, selected in the step
    (``keep = targets != pad``; ``ignore``: over those whose target is not -100, which the strategy weighs by)."""

    def __init__(self, ignore: int = 0) -> None:
        super().__init__()
        self.ignore = ignore

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits, targets = self.model(batch["input_ids"]).flatten(0, 1), batch["targets"].flatten()  # [b s, vocab]
        keep = targets != self.ignore  # [b s]
        return F.cross_entropy(logits[keep], targets[keep])


class PadMaskedMeanLM(TinyLM):
    """``reduction="none"`` and a mean over a mask of the targets that are not the pad id 0."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits, targets = self.model(batch["input_ids"]), batch["targets"]  # [b, s, vocab], [b, s]
        each = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")  # [b s]
        mask = (targets != 0).flatten().to(each.dtype)  # [b s]
        return (each * mask).sum() / mask.sum()


class PadToIgnoreLM(TinyLM):
    """The pad id 0 turned into -100 in the step (not in the data), then a mean cross-entropy."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits, targets = self.model(batch["input_ids"]), batch["targets"].clone()  # [b, s, vocab], [b, s]
        targets[targets == 0] = -100
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class PackedOwnLM(TinyLM):
    """A module of its own over packed batches (``doc_ids``, positions): the model over the whole row, as one process
    runs it (documents attend to each other), or, with ``apart``, each document on its own when the model is not
    parallelized, as ``LanguageModel.logits`` does, saying so (``keeps_documents_apart``)."""

    def __init__(self, apart: bool = False) -> None:
        super().__init__()
        self.keeps_documents_apart = apart

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        ids, positions = batch["input_ids"], batch["positions"]
        if self.keeps_documents_apart:
            logits = parallel.run_documents(self.model, ids, positions, batch["doc_ids"])  # [1, s, vocab]
        else:
            logits = self.model(ids, positions)  # [1, s, vocab]: one call over the row
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


class PadBoolMaskedLM(TinyLM):
    """A mean over the targets that are not the pad id 0, the mask written without a comparison (``targets.bool()``)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits, targets = self.model(batch["input_ids"]), batch["targets"]  # [b, s, vocab], [b, s]
        each = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")  # [b s]
        mask = targets.bool().flatten().to(each.dtype)  # [b s]
        return (each * mask).sum() / mask.sum()


class RowMeansLM(TinyLM):
    """The mean of each row's mean over its real targets (a common fine-tuning form)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        targets = batch["targets"]  # [b, s]
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        each = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)  # [b, s]
        real = (targets != -100).to(each.dtype)  # [b, s]
        return ((each * real).sum(1) / real.sum(1).clamp(min=1)).mean()


class LossMaskedMeanLM(TinyLM):
    """A mean over the batch's ``loss_mask`` (``(ce * m).sum() / m.sum()``)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits, targets = self.model(batch["input_ids"]), batch["targets"]  # [b, s, vocab], [b, s]
        each = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")  # [b s]
        mask = batch["loss_mask"].flatten()  # [b s]
        return (each * mask).sum() / mask.sum()


class ClassWeightedLM(TinyLM):
    """A mean cross-entropy with class weights (normalised by the sum of the targets' weights)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        weight = torch.linspace(0.5, 1.5, logits.shape[-1], dtype=logits.dtype, device=logits.device)
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), weight=weight)


class DropoutLM(TinyLM):
    """Dropout on the hidden states before the head (a random op: the step check must not mistake it)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.1)

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.drop(self.model(batch["input_ids"]))  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


class Lamb(torch.optim.Optimizer):
    """A LAMB-style optimizer: each update is scaled by the trust ratio ||w|| / ||update|| of the whole tensor."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = p.norm() / (p.grad.norm() + 1e-12)
                    p.add_(p.grad, alpha=-group["lr"] * float(ratio))
        return loss


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9, nesterov=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=3e-3)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3, momentum=0.5)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    if name == "muon":
        return torch.optim.Muon([p for p in params if p.dim() == 2], lr=1e-2)
    if name == "lamb":
        return Lamb(params)
    if name == "recipe-adamw":
        return RecipeAdamW(params)
    raise ValueError(name)


class RecipeAdamW(torch.optim.AdamW):
    """A recipe's AdamW of other defaults, a subclass that changes nothing else: exact (refused as an unknown optimizer
    until 2026-12-02, probe 19)."""

    def __init__(self, params: Any, lr: float = 3e-3) -> None:
        super().__init__(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def causal_lm_loss(
    logits: Tensor,
    labels: Tensor,
    vocab_size: int,
    num_items_in_batch: Tensor | None = None,
    ignore_index: int = -100,
    shift_labels: Tensor | None = None,
    **kwargs: Any,
) -> Tensor:
    """Hugging Face's causal-LM loss (``transformers.loss.loss_utils.ForCausalLMLoss``: shift unless
    ``shift_labels`` are given; a sum over ``num_items_in_batch`` when given, else a mean) in the logits' dtype:
    HF upcasts to float32, whose rounding (1e-7) would hide a real error in a float64 comparison."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat, target = logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return F.cross_entropy(flat, target, ignore_index=ignore_index)
    return F.cross_entropy(flat, target, ignore_index=ignore_index, reduction="sum") / num_items_in_batch


class HFModule(pl.LightningModule):
    """A Hugging Face causal LM, called the ways its documentation shows.

    ``call``: ``labels-key`` (``labels=batch["labels"]``), ``labels-ids`` (``labels=input_ids``, no labels in the
    batch), ``shift-labels`` (``shift_labels=batch["shift_labels"]``), ``masked`` (``attention_mask`` too),
    ``tuple-labels`` (a batch ``(input_ids, labels)``), ``tensor-labels`` (the batch the tokens, ``labels=batch``),
    ``tuple-mask`` (a batch ``(input_ids, labels, attention_mask)``), ``other-length`` (a second call on ``other_ids``,
    shorter than the tokens).
    Its steps log their loss with ``self.log``, as users do.
    ``checkpointing``: the keyword arguments of ``model.gradient_checkpointing_enable(...)``, called here as users
    do (``None``: not called). ``family``: a family of :data:`~tests.support.families.HF_FAMILIES` instead of Llama
    (Qwen3-MoE: a top-k router over experts run whole on each rank's tokens; Qwen3: per-head ``q_norm``, ``k_norm``).
    """

    def __init__(
        self,
        call: str,
        tied: bool = False,
        n_kv_heads: int = 4,
        checkpointing: dict[str, Any] | None = None,
        family: str | None = None,
    ) -> None:
        super().__init__()
        self.model = hf_llama(n_kv_heads=n_kv_heads) if family is None else hf_family(family)
        if tied:
            self.model.config.tie_word_embeddings = True
            self.model.lm_head.weight = self.model.model.embed_tokens.weight
        self.call = call
        self.model.loss_function = causal_lm_loss  # HF's own, without its float32 upcast: compared in float64
        if checkpointing is not None:
            with warnings.catch_warnings():  # transformers 5 renamed it activation_checkpointing_enable
                warnings.simplefilter("ignore", FutureWarning)
                self.model.gradient_checkpointing_enable(**checkpointing)

    def batch_forms(self, batch: Any) -> Tensor | None:
        """The calls on batches other than one dict of ``[b, s]`` tensors (``None``: another call)."""
        if self.call == "tuple-labels":  # a tuple batch (input_ids, labels)
            return self.model(input_ids=batch[0], labels=batch[1]).loss
        if self.call == "tensor-labels":  # the batch is the tokens
            return self.model(input_ids=batch, labels=batch).loss
        if self.call == "other-length":  # a second set of sequences of another length (a rejected answer)
            return (
                self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                + self.model(input_ids=batch["other_ids"], labels=batch["other_ids"]).loss
            )
        if self.call == "tuple-mask":  # a tuple batch (input_ids, labels, attention_mask)
            return self.model(input_ids=batch[0], labels=batch[1], attention_mask=batch[2]).loss
        return None

    def loss(self, batch: Any) -> Tensor:
        other = self.batch_forms(batch)
        if other is not None:
            return other
        ids = batch["input_ids"]
        if self.call == "labels-key":
            return self.model(input_ids=ids, labels=batch["labels"]).loss
        if self.call == "labels-ids":
            return self.model(input_ids=ids, labels=ids).loss
        if self.call == "shift-labels":
            return self.model(input_ids=ids, labels=ids, shift_labels=batch["shift_labels"]).loss
        if self.call == "masked":
            return self.model(input_ids=ids, attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
        if self.call == "flattened":  # DataCollatorWithFlattening's batch, no cache: the documents kept apart
            return self.model(**batch, use_cache=False).loss
        if self.call == "flattened-cache":  # the same batch with the config's cache: the masks attend across them
            return self.model(**batch).loss
        masked = dict(input_ids=ids, attention_mask=batch["attention_mask"], labels=batch["labels"])
        if self.call == "ignore-zero":  # the pad id ignored by the loss, as a keyword of the call
            return self.model(**masked, ignore_index=0).loss
        if self.call == "items-batch":  # transformers' loss over a count the data loader gives (accumulation)
            return self.model(**masked, num_items_in_batch=batch["n_items"]).loss
        if self.call == "items-step":  # the count of the labels the step is handed, made in the step
            return self.model(**masked, num_items_in_batch=(batch["labels"] != -100).sum()).loss
        if self.call == "items-number":  # a constant count, a Python number
            return self.model(**masked, num_items_in_batch=100).loss
        raise ValueError(self.call)

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)  # under the strategy: this rank's share of the global mean (the model is handed the
        self.log("train_loss", loss, prog_bar=True)  # global count of labels); logged as the global loss
        return loss

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss)
        return loss

    @override
    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


class GeneratingLM(HFModule):
    """Generates a few tokens after each validation batch's tokens with ``model.generate`` (``at_epoch_end``: from
    the last batch's, in ``on_validation_epoch_end``), as recipes log samples; ``forward_only``: calls the model on
    them there instead (no cache)."""

    def __init__(self, at_epoch_end: bool = False, forward_only: bool = False) -> None:
        super().__init__("labels-key")
        self.at_epoch_end, self.forward_only = at_epoch_end, forward_only
        self.prompt: Tensor | None = None

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.prompt = batch["input_ids"]  # the step's tokens (a cut of them along the sequence is refused first)
        if not self.at_epoch_end:
            self._sample()
        return super().validation_step(batch, batch_idx)

    @override
    def on_validation_epoch_end(self) -> None:
        if self.at_epoch_end:
            self._sample()

    @override
    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model.generate(batch["input_ids"][:, :4], max_new_tokens=2, do_sample=False)  # a key/value cache

    def _sample(self) -> None:
        assert self.prompt is not None
        if self.forward_only:
            self.log("sample_logits", self.model(self.prompt).logits.sum())
            return
        tokens = self.model.generate(self.prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
        self.log("sample_sum", tokens.double().sum())


class EncoderDecoderLM(pl.LightningModule):
    """A Hugging Face encoder-decoder (BART or T5, tiny, dropout off) trained as its documentation shows
    (``input_ids`` and ``labels=``, the loss the model returns); its predictions are the decoder's logits. Refused for
    a fit, whichever blocks are named; predicted whole."""

    def __init__(self, kind: str = "bart", frozen: bool = False) -> None:
        super().__init__()
        import transformers

        if kind == "bart":
            config = transformers.BartConfig(
                vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256,
                dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, decoder_start_token_id=2,
            )  # fmt: skip
            self.model = transformers.BartForConditionalGeneration(config)
        else:
            config = transformers.T5Config(
                vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
            )  # fmt: skip
            self.model = transformers.T5ForConditionalGeneration(config)
        self.model.requires_grad_(not frozen)

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss  # type: ignore[no-any-return]

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.training_step(batch, batch_idx)

    @override
    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).logits  # type: ignore[no-any-return]

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class SequenceClassifierLM(pl.LightningModule):
    """A Hugging Face sequence classifier, as its documentation trains it (``labels=`` one class per row, the loss the
    model returns); its predictions are the rows' logits. Its head reads each row's last real token: the strategy
    refuses it for a fit and predicts with it whole."""

    def __init__(self) -> None:
        super().__init__()
        self.model = hf_llama_classifier()

    def _call(self, batch: dict[str, Tensor], labels: bool = True) -> Any:
        rows = (batch["input_ids"][:, 0] % 3) if labels else None  # a class per row
        return self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=rows)

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._call(batch).loss
        self.log("train_loss", loss)
        return loss  # type: ignore[no-any-return]

    @override
    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._call(batch, labels=False).logits  # type: ignore[no-any-return]

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def token_classification_loss(logits: Tensor, labels: Tensor, config: Any, **kwargs: Any) -> Tensor:
    """Hugging Face's token-classification loss (a mean over the labels that are not -100) in the logits' dtype:
    transformers' own upcasts to float32, whose rounding (1e-8 in the gradients, which AdamW makes 1e-6) would hide a
    real error in a float64 comparison."""
    return F.cross_entropy(logits.reshape(-1, config.num_labels), labels.reshape(-1).to(logits.device))


class TokenClassifierLM(pl.LightningModule):
    """A Hugging Face token classifier trained as its documentation shows (``labels=`` one class per token, -100 on
    padding, the loss the model returns)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = hf_llama_token_classifier()
        self.model.loss_function = token_classification_loss

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        return out.loss  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def token_classes(window: Tensor) -> dict[str, Tensor]:
    """:func:`ragged` rows whose labels are a class per token (five classes), -100 on padding."""
    batch = ragged("labels")(window)
    labels = batch["labels"]
    batch["labels"] = torch.where(labels != -100, labels % 5, labels)
    return batch


class NEFTuneLM(HFModule):
    """NEFTune switched on as ``transformers`` does for ``neftune_noise_alpha``: noise on the embeddings scaled by the
    length of the sequence the embedding sees (a rank's slice under the strategy): refused at the fit's setup."""

    def __init__(self) -> None:
        super().__init__("masked")
        from transformers.integrations.neftune import activate_neftune

        activate_neftune(self.model, 5.0)


class DistilledLM(HFModule):
    """Knowledge distillation as recipes write it: a frozen teacher (another Hugging Face Llama) in the module, the
    student's cross-entropy and a per-token KL to the teacher's distribution, each a mean over the real targets
    (shifted in the data); ``blocks=`` names the student's blocks (two lists are ambiguous). The teacher's blocks stay
    whole: called with the batch's tensors, the teacher runs on the whole sequences on every rank and its logits are
    cut to the rank's tokens. ``embeds``: the teacher called with embeddings made in the step (not tensors of the
    batch), refused by name (its blocks would see a slice). ``hf_loss``: the student's loss its own, given
    ``labels=`` (a share of the whole batch's mean) beside the KL's mean over the rank's tokens: refused by the step
    check, naming that cause."""

    def __init__(
        self, embeds: bool = False, hf_loss: bool = False, teacher_loss: bool = False, trainable: bool = False
    ) -> None:
        super().__init__("masked")
        self.teacher = hf_llama().requires_grad_(trainable)
        self.embeds, self.hf_loss, self.teacher_loss, self.trainable = embeds, hf_loss, teacher_loss, trainable

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        given = dict(input_ids=batch["input_ids"])
        if self.embeds:
            given = dict(inputs_embeds=self.teacher.get_input_embeddings()(batch["input_ids"]))
        if self.teacher_loss:  # its own loss, logged: the whole batch's on a sliced step, a rank's rows' on groups
            given["labels"] = batch["input_ids"]
        with torch.set_grad_enabled(self.trainable):  # trained together (mutual learning): refused
            teacher = self.teacher(**given, attention_mask=batch["attention_mask"]).logits
        targets = batch["labels" if self.hf_loss else "targets"]
        real = targets != -100
        student = F.log_softmax(logits, -1)
        kl = F.kl_div(student, F.log_softmax(teacher, -1), log_target=True, reduction="none").sum(-1)
        if self.hf_loss:
            given = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=targets)
            return self.model(**given).loss + (kl * real).sum() / real.sum()
        return F.nll_loss(student.flatten(0, 1), targets.flatten()) + (kl * real).sum() / real.sum()


class HFGradNormLM(HFModule):
    """A Hugging Face model (tied embeddings) whose gradient norms are logged as Lightning's documentation shows."""

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


class ForwardAfterStepLM(HFModule):
    """Calls the model on each training batch's tokens in ``on_train_batch_end`` (after the step, as a recipe's
    sample logging may): refused under the strategy, naming why."""

    def __init__(self) -> None:
        super().__init__("labels-key")
        self.prompt: Tensor | None = None

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.prompt = batch["input_ids"]  # the step's tokens (a cut of them along the sequence is refused first)
        return super().training_step(batch, batch_idx)

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self.prompt is not None
        self.log("sample_logits", self.model(self.prompt).logits.sum())


class OnesMaskLM(HFModule):
    """Predicts a padded batch handing the model a mask of ones (no padding masked), as one process then attends it."""

    def __init__(self) -> None:
        super().__init__("labels-key")

    @override
    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        ids = batch["input_ids"]
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


class AveragedModelLM(TinyLM):
    """An exponential moving average kept as ``torch.optim.swa_utils.AveragedModel`` made in ``__init__`` and updated
    after every batch, as PyTorch's docs show: a whole copy of the model the shards cannot be paired with (refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.ema = torch.optim.swa_utils.AveragedModel(
            self.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
        )

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ema.update_parameters(self.model)


class SharedAcrossBlocksLM(TinyLM):
    """Blocks sharing weights (ALBERT's cross-layer sharing): the second block's MLP up projection is the first's."""

    def __init__(self, what: str = "weight") -> None:
        super().__init__()
        first, second = self.model.layers[0], self.model.layers[1]
        if what == "weight":
            second.mlp.up.weight = first.mlp.up.weight
        else:
            second.mlp = first.mlp


class TypeRuleLM(TinyLM):
    """minGPT's weight-decay rule: the weights of ``nn.Linear`` modules decayed, every other parameter not. The
    rewritten projections are no ``nn.Linear``: refused (one process decays them)."""

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        decayed = {id(m.weight) for m in self.modules() if isinstance(m, torch.nn.Linear)}
        params = list(self.parameters())
        groups = [
            {"params": [p for p in params if id(p) in decayed], "weight_decay": 0.1},
            {"params": [p for p in params if id(p) not in decayed], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=3e-3)


class NamedGroupsLM(HFModule):
    """Parameter groups by name, as common recipes make them (no weight decay for biases and norms).

    ``recipe``: ``names`` (substrings of ``named_parameters()`` names, as Hugging Face's examples do), ``hf-trainer``
    (Hugging Face Trainer's own ``get_parameter_names``, which walks ``named_children`` and each module's
    ``_parameters``) or ``named-optimizer`` (``AdamW(self.named_parameters())``, whose state dict keeps the names).
    """

    def __init__(self, family: str, recipe: str = "names") -> None:
        super().__init__("labels-key", family=family)
        self.recipe = recipe

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        named = list(self.named_parameters())
        if self.recipe == "named-optimizer":
            return torch.optim.AdamW(named, lr=3e-3, weight_decay=0.1)
        if self.recipe == "hf-trainer":
            from transformers.trainer_pt_utils import get_parameter_names

            patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
            decayed = set(get_parameter_names(self, [torch.nn.LayerNorm], patterns))
        else:
            decayed = {n for n, _ in named if not any(k in n for k in ("bias", "ln_", "norm"))}
        decay = [p for n, p in named if n in decayed]
        rest = [p for n, p in named if n not in decayed]
        groups = [{"params": decay, "weight_decay": 0.5}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=3e-3)


class FrozenLM(HFModule):
    """Fine-tuning: the embeddings and the first layer's attention frozen (``requires_grad_(False)``), the optimizer
    over the trainable rest."""

    def __init__(self, family: str) -> None:
        super().__init__("labels-key", family=family)
        for name, param in self.model.named_parameters():
            if any(k in name for k in ("embed", "wte", "layers.0.self_attn", "h.0.attn")):
                param.requires_grad_(False)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1)


FLOAT32_FAMILIES = ("gemma", "gemma2", "gemma3")
"""Families whose own code computes in float32 whatever the model's dtype (Gemma's norms, Gemma 2's softmax): their
rounding (1e-7) is not compared at 1e-9 (their modes are, in ``tests/graph/test_families.py``)."""


def family_cases() -> dict[str, Case]:
    """Every family through Lightning on groups (data parallel, then one group of 2), ulysses (every family runs it),
    AdamW: the checkpoint's weights and optimizer state, in the plain order."""
    return {
        f"family-{family}": Case(
            lambda family=family: HFModule("labels-key", family=family),
            lambda: loader(hf_labels, rows=3),
            strategy=dict(plan="ulysses", groups=True, check_step=False),
            splits=SPLITS_2,
        )
        for family in (*HF_FAMILIES, *MORE_FAMILIES)
        if family not in FLOAT32_FAMILIES and family != "gpt2-eager"
    }


class ListMoEAccumulateLM(ManualAccumulateLM):
    """A user's own mixture of experts (:class:`~tests.support.families.ListMoELM`: sixteen experts in a
    ``ModuleList``, top-1, only the visited ones run) with manual optimization accumulating two batches per optimizer
    step, as Lightning documents it: an expert the first batch's tokens visit and the second's do not keeps the
    first's gradient, as in one process. Plain SGD: the key bias's true gradient is zero, its rounding noise (see
    :class:`MaskedLM`)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = ListMoELM()

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def mlm_labels(window: Tensor) -> dict[str, Tensor]:
    """Masked-LM labels, not shifted: a fixed third of the tokens are targets, the rest -100 (uneven per rank)."""
    ids = window[:, :-1]
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    return {"input_ids": ids, "labels": labels}


def esm_masked(window: Tensor) -> dict[str, Tensor]:
    """:func:`mlm_labels` with the targets of each row's first half replaced by ESM's mask token (4): a row's share
    of mask tokens differs from each of its slices' shares."""
    item = mlm_labels(window)
    ids = item["input_ids"].clone()
    ids[:, : ids.shape[1] // 2 : 3] = 4  # [b, s]: masked targets in the first half only
    return {"input_ids": ids, "labels": item["labels"], "attention_mask": torch.ones_like(ids)}


class MaskedLM(pl.LightningModule):
    """A Hugging Face ``BertForMaskedLM`` called as its documentation shows (``labels=`` unshifted, a mean over the
    targets): no label shift, no ``num_items_in_batch``. ``roberta``: a ``RobertaForMaskedLM``, which numbers its
    tokens itself from their ids (``padding_idx + 1`` onwards; the data's tokens equal to its padding id 1 at
    ``padding_idx``): the strategy gave it positions ``0, 1, ...`` until 2026-12-01, silently. ``positions``: called
    with the batch's ``position_ids`` and ``use_cache=False``. ``esm``: an ``EsmForMaskedLM`` with these config
    fields, its token dropout on (ESM-2's), whose attention normalises its input itself. ``mask``: called with the
    batch's ``attention_mask`` in the model's dtype."""

    def __init__(
        self, roberta: bool = False, positions: bool = False, esm: dict[str, Any] | None = None, mask: bool = False
    ) -> None:
        super().__init__()
        self.positions, self.mask = positions, mask
        import transformers

        fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        fields |= dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        family = "Esm" if esm is not None else "Roberta" if roberta else "Bert"
        if roberta or esm is not None:
            fields |= dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, max_position_embeddings=256)
        if esm is not None:  # the data's tokens equal to 4 are its mask token (uneven shares over a row's slices)
            fields |= dict(mask_token_id=4, token_dropout=True) | esm
        config = getattr(transformers, f"{family}Config")(**fields)
        self.model = getattr(transformers, f"{family}ForMaskedLM")(config)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # BERT starts its biases at 0: the key bias (zero gradient) would stay at rounding noise
            for name, param in self.model.named_parameters():
                if name.endswith("bias"):
                    param.copy_(0.02 * torch.randn(param.shape, generator=gen))

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if self.positions:  # a packed row's restarting positions, no cache (as a decoder's packing is called)
            call = dict(position_ids=batch["position_ids"], use_cache=False)
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"], **call).loss  # type: ignore[no-any-return]
        if self.mask:  # the batch's mask in the model's float dtype: its sum's dtype sets ESM's share of masks
            mask = batch["attention_mask"].to(self.dtype)
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"], attention_mask=mask).loss  # type: ignore[no-any-return]
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss  # type: ignore[no-any-return]

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        # plain SGD: the key bias's true gradient is zero (softmax ignores a constant per query), so its gradient is
        # rounding noise (1e-17) that Adam would normalise into full-size steps and momentum would keep as state,
        # different for any two summation orders; SGD moves that weight by 1e-17 only
        return torch.optim.SGD(self.parameters(), lr=0.5)


def lm_main() -> pl.LightningModule:
    return LanguageModel("llama-tiny", lr=3e-3, weight_decay=0.1)


def lm_granite() -> pl.LightningModule:
    """The package's module around a Hugging Face Granite built from config fields (as ``hf_config`` in YAML)."""
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    fields |= dict(num_key_value_heads=2, attention_multiplier=0.07, residual_multiplier=0.5, logits_scaling=1.5)
    return LanguageModel(lr=3e-3, hf_config={"class": "GraniteConfig", **fields})


class CombinedLM(TinyLM):
    """Two datasets' batches in one step, as Lightning's ``CombinedLoader`` yields them (a dict of batches): refused
    by name, before any collective."""

    @override
    def training_step(self, batch: dict[str, dict[str, Tensor]], batch_idx: int) -> Tensor:
        return self.loss(batch["code"]) + self.loss(batch["text"])


def _combined_data() -> CombinedLoader:
    return CombinedLoader(
        {"code": loader(shifted_targets), "text": loader(shifted_targets, (35, 52))}, "max_size_cycle"
    )


class Windows(Dataset[Any]):
    """Item ``i`` is a tensor batch of ``rows`` windows of ``lengths[i]`` tokens (no dict, no tuple)."""

    def __init__(self, lengths: tuple[int, ...], rows: int = 2):
        self.lengths, self.rows = lengths, rows

    @override
    def __len__(self) -> int:
        return len(self.lengths)

    @override
    def __getitem__(self, i: int) -> Tensor:
        return torch.randint(0, 128, (self.rows, self.lengths[i]), generator=torch.Generator().manual_seed(2000 + i))


class CombinedTensorsLM(TinyLM):
    """Two loaders' tensor batches in one step, a list of two tensors as ``CombinedLoader`` yields them: the first is
    taken as the tokens and sliced, the second, of another length, reaches every rank whole. Refused where the model
    is called on it; before 2026-12-01 a second length equal to a slice's ran that tensor as each rank's slice,
    silently, where the step check was off."""

    def reconstruction(self, window: Tensor) -> Tensor:
        logits = self.model(window)  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), window.flatten())

    @override
    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.reconstruction(batch[0]) + self.reconstruction(batch[1])


def _combined_tensors(second: tuple[int, ...]) -> Callable[[], CombinedLoader]:
    return lambda: CombinedLoader(
        [DataLoader(Windows((48, 48, 48, 48)), batch_size=None), DataLoader(Windows(second), batch_size=None)],
        "max_size_cycle",
    )


def pairs_padded_apart(window: Tensor) -> dict[str, Tensor]:
    """A preference pair per row, both answers ``[b, s]`` and right-padded, each its own way: the chosen one about
    half real (its ``attention_mask``), the rejected one nearly whole; targets -100 at each one's padding; the batch's
    count of real targets of both (0-dim)."""
    ids = window[:, :-1].clone()
    b, s = ids.shape
    chosen, rejected = torch.ones_like(ids), torch.ones_like(ids)
    for r in range(b):
        chosen[r, s // 2 + r :] = 0
        rejected[r, s - 2 - r :] = 0
    ids[chosen == 0] = 0
    other = window[:, 1:].flip(1).clone()
    other[rejected == 0] = 0

    def targets(tokens: Tensor, real: Tensor) -> Tensor:
        t = tokens.roll(-1, 1)  # [b, s]: the next token, shifted in the data
        t[:, :-1][real[:, 1:] == 0] = -100  # the last real token predicts nothing
        t[real == 0], t[:, -1] = -100, -100
        return t

    t, rt = targets(ids, chosen), targets(other, rejected)
    count = (t != -100).sum() + (rt != -100).sum()
    return dict(input_ids=ids, attention_mask=chosen, targets=t, rejected_ids=other, rejected_targets=rt, count=count)


class PairsLM(TinyLM):
    """Both answers of a preference pair through the model, their token losses summed over the batch's count: a
    second sequence of the tokens' shape, padded otherwise. On steps on groups each group's rows were cut to the
    chosen answers' longest real row, dropping the rejected ones' tail, silently (until 2026-12-01)."""

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        chosen = self.model(batch["input_ids"])  # [b, s, vocab]
        rejected = self.model(batch["rejected_ids"])  # [b, s, vocab]
        total = F.cross_entropy(chosen.flatten(0, 1), batch["targets"].flatten(), reduction="sum")
        total = total + F.cross_entropy(rejected.flatten(0, 1), batch["rejected_targets"].flatten(), reduction="sum")
        return total / batch["count"]


def _lm_data() -> tuple[DataLoader[Any], DataLoader[Any]]:
    return loader(shifted_targets), loader(shifted_targets, (35, 52))


FOREIGN = "cpu" if ACCELERATOR == "gpu" else "cuda"
"""A device type the tests do not run on."""


def foreign_profile() -> str:
    """The shipped profile marked as measured on :data:`FOREIGN` (a file in the temporary folder): the run must
    refuse it on every rank before any collective."""
    shipped = Path(__file__).resolve().parents[2] / "configs/profiles/cpu-2proc-llama-tiny.json"
    data = json.loads(shipped.read_text())
    data["meta"] = {**data.get("meta", {}), "device": FOREIGN}
    path = Path(tempfile.gettempdir()) / f"paradyse-profile-of-{FOREIGN}.json"
    path.write_text(json.dumps(data))
    return str(path)


class LoraLM(HFModule):
    """LoRA fine-tuning as PEFT's docs show it: ``get_peft_model`` of the Hugging Face model, the base frozen, the
    adapters (random ``B``: the branch is live from the first step) trained by AdamW. ``family``: a family of
    :data:`~tests.support.families.HF_FAMILIES` (GPT-2: ``Conv1D`` projections, one fused ``c_attn`` whose parts
    share the adapter's ``A``). ``reference``: the loss adds a per-token KL to the base model's distribution, its
    logits computed with the adapters off (``with model.disable_adapter():``, as KL-regularised recipes do), the
    targets shifted in the data. ``settings``: more ``LoraConfig`` fields."""

    def __init__(
        self, family: str | None = None, reference: bool = False, n_kv_heads: int = 4, **settings: Any
    ) -> None:
        super().__init__("masked", family=family, n_kv_heads=n_kv_heads)
        import peft

        targets = ["c_attn", "c_proj", "c_fc"] if family == "gpt2" else "all-linear"
        config = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
        self.model = peft.get_peft_model(self.model, peft.LoraConfig(**(config | settings)))
        self.reference = reference

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        if not self.reference:
            return super().loss(batch)
        given = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = self.model(**given).logits
        with torch.no_grad(), self.model.disable_adapter():
            base = self.model(**given).logits
        targets = batch["targets"]
        real = targets != -100
        own = F.log_softmax(logits, -1)
        kl = F.kl_div(own, F.log_softmax(base, -1), log_target=True, reduction="none").sum(-1)
        return F.nll_loss(own.flatten(0, 1), targets.flatten()) + 0.5 * (kl * real).sum() / real.sum()


class HiddenStatesLM(HFModule):
    """A Hugging Face model's hidden states in the loss (``output_hidden_states=True``, as auxiliary-loss recipes read
    them): the model's loss plus a per-token penalty on a middle layer's hidden states, a sum over the real targets
    divided by the whole batch's count (a tensor of the batch: a share of one process's mean, as the model's loss
    is). ``attentions``: the call asks for the attention weights too, refused (no rank holds a row's scores).
    Under the launcher's ``spawn`` the hidden states were ``None`` in the workers until 2026-11-30 (transformers
    registers a model's recorded outputs in ``__init__``, which unpickling skips)."""

    def __init__(self, attentions: bool = False) -> None:
        super().__init__("masked")
        self.attentions = attentions

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        given = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out = self.model(**given, output_hidden_states=True, output_attentions=self.attentions)
        real = (batch["labels"] != -100).unsqueeze(-1)
        return out.loss + 0.1 * (out.hidden_states[1].pow(2) * real).sum() / batch["n_real"]


class LogitsToKeepLM(HFModule):
    """The logits of each row's last positions only (``logits_to_keep=``, as GRPO trainers score completions):
    refused in a step on a slice of every sequence (the model keeps the last positions of this rank's slice; one rank
    crashed in the loss, the other in gloo, until 2026-11-30)."""

    def __init__(self) -> None:
        super().__init__("masked")

    @override
    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=9)
        return F.cross_entropy(logits.logits[:, :-1].flatten(0, 1), batch["input_ids"][:, -8:].flatten())


def targets_beside_labels(window: Tensor) -> dict[str, Tensor]:
    """:func:`ragged` targets shifted in the data, and a collator's (unshifted) ``labels`` the step never reads."""
    batch = ragged("targets")(window)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch | {"labels": labels}


def counted_labels(window: Tensor) -> dict[str, Tensor]:
    """:func:`ragged` Hugging Face labels with the whole batch's count of real labels (the data loader's)."""
    batch = ragged("labels")(window)
    return batch | {"n_real": (batch["labels"] != -100).sum().to(torch.float64)}


class LoraGradNormLM(LoraLM):
    """LoRA adapters whose gradient norms are logged as Lightning's documentation shows (only the adapters train)."""

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


def lora_cases() -> dict[str, Case]:
    """LoRA adapters in every mode that adds their branch (``metp`` does not, and says so), where peft is installed
    (the test extra has it)."""
    if importlib.util.find_spec("peft") is None:
        return {}
    both = lambda: (loader(ragged("labels")), loader(ragged("labels"), (35, 52)))  # noqa: E731
    return {
        "lora": Case(LoraLM, both, trainer=dict(val_check_interval=2, limit_val_batches=2)),
        "lora-ring": Case(LoraLM, lambda: loader(ragged("labels")), strategy=dict(plan="ring")),
        "lora-ulysses": Case(LoraLM, lambda: loader(ragged("labels")), strategy=dict(plan="ulysses")),
        "lora-tp-sp": Case(LoraLM, lambda: loader(ragged("labels")), strategy=dict(plan="tp_sp")),
        "lora-grad-norm": Case(LoraGradNormLM, lambda: loader(ragged("labels")), strategy=dict(plan="ring")),
        "lora-gpt2-fused": Case(lambda: LoraLM("gpt2"), lambda: loader(ragged("labels"))),
        "lora-reference-off": Case(lambda: LoraLM(reference=True), lambda: loader(ragged("targets"))),
        "lora-metp": Case(LoraLM, lambda: loader(ragged("labels")), strategy=dict(plan="metp"), refused="metp does"),
        "lora-dropout": Case(
            lambda: LoraLM(lora_dropout=0.1), lambda: loader(ragged("labels")), refused="lora_dropout=0.0"
        ),
    }


def cases_p2() -> dict[str, Case]:
    """Every user path on 2 ranks."""
    tiny = lambda **kw: lambda: TinyLM(**kw)  # noqa: E731
    hf = lambda call, **kw: lambda: HFModule(call, **kw)  # noqa: E731
    val = dict(val_check_interval=2, limit_val_batches=2)
    return (
        {
            "lm-main-auto": Case(lm_main, _lm_data, trainer=val, test=True, strategy=dict(thresholds=(40, 56))),
            "lm-main-mixed": Case(lm_main, _lm_data, trainer=val, strategy=dict(plan=MIXED)),
            "lm-packed": Case(  # the documents of a packed batch attend within themselves, with or without the strategy
                lm_main, lambda: DataLoader(PackedBatches(PACKED), batch_size=None), strategy=dict(plan=MIXED)
            ),
            "lm-packed-groups": Case(lm_main, lambda: DataLoader(PackedBatches(PACKED), batch_size=None)),
            # a module of its own over packed batches: its documents attend to each other in one process, where the
            # strategy kept them apart (silent until 2026-12-02, probe 17: 2e-1); exact where it says it keeps them
            # apart and does
            "packed-own-module": Case(
                PackedOwnLM,
                lambda: DataLoader(PackedBatches(PACKED), batch_size=None),
                strategy=dict(plan="ring"),
                refused="set `keeps_documents_apart = True`",
            ),
            "packed-own-module-apart": Case(
                functools.partial(PackedOwnLM, True),
                lambda: DataLoader(PackedBatches(PACKED), batch_size=None),
                strategy=dict(plan="ring"),
            ),
            "lm-hf-granite": Case(lm_granite, _lm_data, trainer=val, strategy=dict(plan=MIXED)),
            "hf-labels-key": Case(hf("labels-key"), lambda: loader(hf_labels), strategy=dict(plan="ulysses")),
            "hf-labels-ids": Case(hf("labels-ids"), lambda: loader(tokens_only), strategy=dict(plan=MIXED)),
            # batches other than a dict, on groups: the labels counted over the whole batch (a tuple's and a tensor
            # batch's were counted over the group's rows until 2026-11-30: twice the loss, silently)
            "hf-labels-tuple-groups": Case(hf("tuple-labels"), lambda: loader(hf_labels_tuple, rows=3)),
            "hf-labels-tensor-groups": Case(hf("tensor-labels"), lambda: loader(tokens_tensor, rows=3)),
            "hf-labels-two-lengths": Case(  # refused, naming the lengths and how to batch them
                hf("other-length"), lambda: loader(two_lengths), strategy=dict(plan="ring"), refused="two lengths"
            ),
            "hf-mask-in-tuple": Case(  # a padding mask is known by its name: the refusal says to yield a dict
                hf("tuple-mask"), lambda: loader(ragged_tuple), strategy=dict(plan="ring"), refused="tuple or list"
            ),
            "hf-shift-labels": Case(hf("shift-labels"), lambda: loader(hf_shift_labels), strategy=dict(plan="ring")),
            "hf-tied": Case(hf("labels-key", tied=True), lambda: loader(hf_labels), strategy=dict(plan="metp")),
            "hf-pad-right": Case(hf("masked"), lambda: loader(padded("right")), strategy=dict(plan=MIXED)),
            "hf-pad-left": Case(hf("masked"), lambda: loader(padded("left")), refused="left padding"),
            "combined-loader": Case(
                CombinedLM, _combined_data, refused="holds batches or samples (several loaders' batches"
            ),
            "combined-loader-tensors": Case(
                CombinedTensorsLM, _combined_tensors((35, 52, 35, 52)), refused="that the strategy did not slice"
            ),
            "combined-loader-tensors-slice-long": Case(  # the second tensor as long as a slice: silent until 2026-12-01
                CombinedTensorsLM,
                _combined_tensors((24, 24, 24, 24)),
                strategy=dict(plan="ring", check_step=False),
                refused="that the strategy did not slice",
            ),
            "combined-loader-tensors-one-length": Case(CombinedTensorsLM, _combined_tensors((48, 48, 48, 48))),
            "pairs-padded-apart": Case(  # a preference pair's two answers padded apart, on groups
                PairsLM,
                lambda: loader(pairs_padded_apart, rows=3),
                strategy=dict(loss_reduction="sum"),
                splits=SPLITS_2,
            ),
            "pairs-padded-apart-auto": Case(
                PairsLM, lambda: loader(pairs_padded_apart, rows=3), strategy=dict(loss_reduction="sum")
            ),
            "generate-in-step": Case(
                GeneratingLM, lambda: (loader(hf_labels), loader(hf_labels, (35,))), trainer=val, refused="generate()"
            ),
            "generate-after-validation": Case(
                lambda: GeneratingLM(at_epoch_end=True),
                lambda: (loader(hf_labels), loader(hf_labels, (35,))),
                trainer=val,
                refused="generate()",
            ),
            "forward-after-training-step": Case(
                ForwardAfterStepLM, lambda: loader(hf_labels), strategy=dict(plan=MIXED), refused="outside a step"
            ),
            "forward-after-validation": Case(  # not on the last validation batch's layout: refused, naming why
                lambda: GeneratingLM(at_epoch_end=True, forward_only=True),
                lambda: (loader(hf_labels), loader(hf_labels, (35,))),
                trainer=val,
                refused="ran outside a step the strategy configured",
            ),
            "hf-bert-mlm": Case(MaskedLM, lambda: loader(mlm_labels), strategy=dict(plan=MIXED_BIDIRECTIONAL)),
            "hf-roberta-mlm": Case(
                lambda: MaskedLM(roberta=True), lambda: loader(mlm_labels), strategy=dict(plan=MIXED_BIDIRECTIONAL)
            ),
            "hf-roberta-mlm-groups": Case(lambda: MaskedLM(roberta=True), lambda: loader(mlm_labels)),
            # ESM-2 (rotary) and ESM-1b (learned positions, a norm of the embeddings): their attention normalises its
            # input itself (refused until 2026-12-01) and their token dropout scales a row by its share of masks
            "hf-esm-mlm": Case(
                lambda: MaskedLM(esm={}), lambda: loader(esm_masked), strategy=dict(plan=MIXED_BIDIRECTIONAL)
            ),
            "hf-esm-mlm-groups": Case(lambda: MaskedLM(esm={}), lambda: loader(esm_masked)),
            "hf-esm-float-mask": Case(  # its share of masks in float64, as one process counts it over a float64 mask
                lambda: MaskedLM(esm={}, mask=True), lambda: loader(esm_masked), strategy=dict(plan="ring")
            ),
            "hf-esm-absolute": Case(
                lambda: MaskedLM(esm=dict(position_embedding_type="absolute", emb_layer_norm_before=True)),
                lambda: loader(esm_masked),
                strategy=dict(plan=MIXED_BIDIRECTIONAL),
            ),
            # Hugging Face's packed rows (DataCollatorWithFlattening): their documents attended to each other under
            # the strategy until 2026-12-01, silently, where one process keeps them apart (called without a cache)
            "hf-flattened": Case(
                hf("flattened"),
                lambda: DataLoader(FlattenedBatches(PACKED), batch_size=None),
                strategy=dict(plan=MIXED),
            ),
            "hf-flattened-groups": Case(hf("flattened"), lambda: DataLoader(FlattenedBatches(PACKED), batch_size=None)),
            "hf-flattened-cache": Case(
                hf("flattened-cache"), lambda: DataLoader(FlattenedBatches(PACKED), batch_size=None)
            ),
            "hf-flattened-checkpointing": Case(  # transformers 5 turns the cache off: the documents kept apart
                hf("flattened-cache", checkpointing={}),
                lambda: DataLoader(FlattenedBatches(PACKED), batch_size=None),
            ),
            "hf-roberta-restarting-positions": Case(  # a bidirectional model's masks never read the positions: no
                lambda: MaskedLM(roberta=True, positions=True),  # documents, with or without the strategy
                lambda: DataLoader(FlattenedBatches(PACKED), batch_size=None),
            ),
            "hf-flattened-rows": Case(
                hf("flattened"),
                lambda: DataLoader(FlattenedBatches(PACKED, rows=2), batch_size=None),
                refused="pack the documents of a batch into one row",
            ),
            "hf-moe": Case(  # the step check and the checkpoint's optimizer state of experts and per-head norms
                lambda: HFModule("labels-key", family="qwen3moe"),
                lambda: loader(hf_labels),
                strategy=dict(plan=["ulysses", {"attention": "tp_sp", "mlp": "ring"}]),
            ),
            "moe-manual-accumulate": Case(
                ListMoEAccumulateLM, lambda: loader(shifted_targets, (12, 10, 12, 10)), strategy=dict(plan="ulysses")
            ),
            "grad-norm-logged": Case(NormLoggingLM, lambda: loader(ragged("targets"), rows=3)),
            "grad-hook-on-projection": Case(HookedWeightLM, lambda: loader(shifted_targets), refused="gradient hook"),
            "row-weights-list-groups": Case(RowWeightsLM, lambda: loader(row_weights, rows=3)),
            "random-branch-in-step": Case(RandomBranchLM, lambda: loader(ragged("targets"), rows=3)),
            "random-branch-in-step-sliced": Case(
                RandomBranchLM, lambda: loader(ragged("targets"), rows=3), strategy=dict(plan="ring")
            ),
            "loss-changes-later": Case(
                LaterPerRowLM,
                lambda: loader(ragged("targets"), rows=3),
                strategy=dict(plan="ring"),
                trainer=dict(max_steps=12),
                refused="computes something across the tokens",
            ),
            **{
                f"positions-in-step-{kind}": Case(
                    functools.partial(PositionsInStepLM, kind),
                    lambda: loader(shifted_targets),
                    strategy=dict(plan="ring"),
                    refused=f"works on positions of the sequence itself ({shown}",
                )
                for kind, shown in (
                    ("mask-prefix", "targets.clone()[:, :20] = ..."),  # named after the tensor it copies
                    ("after-separator", "<a [2, 9] tensor>.cumsum(1)"),
                    ("weights-by-position", "torch.arange(9)"),
                    ("narrow", "input_ids.narrow(1, 0, 20)"),
                )
            },
            "truncate-in-step": Case(
                TruncatingLM, lambda: loader(shifted_targets), strategy=dict(plan="ring"), refused="input_ids[:, :48]"
            ),
            "random-masking-in-step": Case(
                RandomMaskLM, lambda: loader(shifted_targets), refused="draws random numbers"
            ),
            "random-masking-after-transfer": Case(TransferMaskLM, lambda: loader(ragged("targets"), rows=3)),
            "sum-over-rows-on-groups": Case(  # refused by the step check's rows runs, naming the cause
                RowsDividedLM, lambda: loader(shifted_targets), strategy=dict(loss_reduction="sum"), refused="the rows"
            ),
            "sum-over-rows-sliced": Case(  # every rank a slice of every row: exact
                RowsDividedLM, lambda: loader(shifted_targets), strategy=dict(loss_reduction="sum", groups=False)
            ),
            # the step's own loss over targets, a collator's labels unused beside them: weighed by the targets
            "targets-beside-labels": Case(TinyLM, lambda: loader(targets_beside_labels, rows=3)),
            "targets-beside-labels-sliced": Case(
                TinyLM, lambda: loader(targets_beside_labels, rows=3), strategy=dict(plan="tp_sp", check_step=False)
            ),
            "grads-after-backward-groups": Case(AfterBackwardLM, lambda: loader(ragged("targets"), rows=3)),
            "grads-after-backward-one-group": Case(
                AfterBackwardLM, lambda: loader(ragged("targets"), rows=3), strategy=dict(plan="ring")
            ),
            "zero-grad-skipped-groups": Case(
                SkippedZeroGradLM, lambda: loader(ragged("targets"), rows=3), trainer=dict(max_steps=6)
            ),
            "zero-grad-skipped-accumulated": Case(  # the gradients left over wait through a window of micro-batches
                lambda: SkippedZeroGradLM(every=4),
                lambda: loader(ragged("targets"), rows=3),
                trainer=dict(max_steps=3, accumulate_grad_batches=2),
                strategy=dict(plan="ring"),
            ),
            "grad-changed-in-hook-groups": Case(HandDecayLM, lambda: loader(ragged("targets"), rows=3)),
            "grad-changed-in-hook-one-group": Case(
                HandDecayLM, lambda: loader(ragged("targets"), rows=3), strategy=dict(plan="ulysses")
            ),
            "grad-changed-in-grad-mode-groups": Case(
                lambda: HandDecayLM(grad_mode=True),
                lambda: loader(ragged("targets"), rows=3),
                refused="torch.no_grad()",
            ),
            "grad-changed-in-grad-mode-one-group": Case(
                lambda: HandDecayLM(grad_mode=True),
                lambda: loader(ragged("targets"), rows=3),
                strategy=dict(plan="ulysses"),
                refused="torch.no_grad()",
            ),
            "all-gather-uneven": Case(
                GatheredTokensLM,
                lambda: (loader(shifted_targets), loader(shifted_targets, (35,))),
                trainer=dict(val_check_interval=2),
                strategy=dict(plan="ulysses"),
                refused="shapes differ between the ranks",
            ),
            "reduce-in-step-groups": Case(ReducedLossLM, lambda: loader(ragged("targets"), rows=3)),
            "reduce-in-step-one-group": Case(
                ReducedLossLM, lambda: loader(ragged("targets"), rows=3), strategy=dict(plan="tp_sp")
            ),
            "torchmetrics-accuracy": Case(  # on groups (training) and one group (validation)
                AccuracyLM,
                lambda: (loader(ragged("targets"), rows=3), loader(ragged("targets"), (35, 52), rows=3)),
                trainer=dict(val_check_interval=2, limit_val_batches=2, max_steps=-1, max_epochs=1),
            ),
            "metric-of-the-loss-groups": Case(  # training on groups: the loss settles after the gradient return
                RecipeMetricsLM,
                lambda: (loader(ragged("targets"), rows=3), loader(ragged("targets"), (35, 52), rows=3)),
                trainer=dict(val_check_interval=2, limit_val_batches=2, max_steps=-1, max_epochs=1),
            ),
            "metric-of-the-loss-one-group": Case(
                RecipeMetricsLM,
                lambda: (loader(shifted_targets), loader(shifted_targets, (35, 52))),
                trainer=dict(val_check_interval=2, limit_val_batches=2, max_steps=-1, max_epochs=1),
                strategy=dict(plan=MIXED),
            ),
            "chunked-loss": Case(ChunkedLossLM, lambda: loader(ragged("targets"), rows=3)),  # groups and one group
            "chunked-loss-one-group": Case(ChunkedLossLM, lambda: loader(shifted_targets), strategy=dict(plan="ring")),
            "chunked-mean-loss": Case(  # chunks of 16: the check's 17 tokens hold one per row; it runs on more
                lambda: ChunkedLossLM(mean_per_chunk=True),
                lambda: loader(last_untargeted),  # the 17 tokens' one chunk with targets agrees: silent before
                strategy=dict(plan="ring"),
                refused="a loss averaged per chunk of the sequence (the step splits it into chunks of 16 tokens",
            ),
            "metric-float64-groups": Case(
                Float64MetricsLM,
                lambda: (loader(ragged("targets"), rows=3), loader(ragged("targets"), (35, 52), rows=3)),
                trainer=dict(val_check_interval=2, limit_val_batches=2, max_steps=-1, max_epochs=1),
            ),
            "metric-float64-one-group": Case(
                Float64MetricsLM,
                lambda: (loader(shifted_targets), loader(shifted_targets, (35, 52))),
                trainer=dict(val_check_interval=2, limit_val_batches=2, max_steps=-1, max_epochs=1),
                strategy=dict(plan=MIXED),
            ),
            "averaged-weights-in-checkpoint": Case(  # on groups and on one group
                AveragedLM, lambda: loader(ragged("targets"), rows=3), splits=SPLITS_2
            ),
            "frozen-groups": Case(  # frozen shards of a fused projection, on groups
                lambda: FrozenLM("gpt2"),
                lambda: loader(hf_labels, rows=3),
                strategy=dict(plan="ulysses", groups=True, check_step=False),
                splits=SPLITS_2,
            ),
            "groups-by-module-type": Case(
                TypeRuleLM, lambda: loader(shifted_targets), refused="isinstance(m, nn.Linear)"
            ),
            "groups-by-module-type-validated": Case(  # the module rewritten by the validation: the fit still compares
                TypeRuleLM,
                lambda: (loader(shifted_targets), loader(shifted_targets, (35, 52))),
                validate=True,
                refused="isinstance(m, nn.Linear)",
            ),
            "named-groups": Case(  # by name: the shards of GPT-2's fused c_attn bias are biases too
                lambda: NamedGroupsLM("gpt2"), lambda: loader(hf_labels), strategy=dict(plan="ulysses")
            ),
            "named-groups-validated": Case(
                lambda: NamedGroupsLM("gpt2"),
                lambda: (loader(hf_labels), loader(hf_labels, (35, 52))),
                validate=True,
                strategy=dict(plan="ulysses"),
            ),
            "named-groups-hf-trainer": Case(
                lambda: NamedGroupsLM("qwen2", "hf-trainer"), lambda: loader(hf_labels), strategy=dict(plan="ulysses")
            ),
            "named-optimizer": Case(
                lambda: NamedGroupsLM("gpt2", "named-optimizer"),
                lambda: loader(hf_labels),
                strategy=dict(plan="ulysses"),
            ),
            "hf-grad-ckpt": Case(
                hf("labels-key", checkpointing={}),
                lambda: loader(hf_labels),
                strategy=dict(plan=MIXED),
                plans=("tp_sp+rc,tp_sp+rc | ring+rc,metp+rc",) * 4,
            ),
            "hf-grad-ckpt-every-2": Case(
                hf("labels-key", checkpointing=GRAD_CKPT_EVERY_2),
                lambda: loader(hf_labels),
                strategy=dict(thresholds=(40, 56)),
                plans=("tp_sp+rc,tp_sp+rc | tp_sp,tp_sp", "ring+rc,metp+rc | ring+rc,metp+rc")
                * 2,  # lengths 40, 57, ...
            ),
            "user-checkpointed-blocks": Case(
                CheckpointedBlocksLM, lambda: loader(ragged("targets"), rows=3), strategy=dict(plan=MIXED, groups=True)
            ),
            "hf-grad-ckpt-offload": Case(
                hf("labels-key", checkpointing={"offload": True}), lambda: loader(hf_labels), refused="offload=True"
            ),
            "accumulate": Case(tiny(), lambda: loader(shifted_targets), trainer=dict(accumulate_grad_batches=2)),
            "predict": Case(tiny(), lambda: loader(shifted_targets), predict=lambda: loader(shifted_targets, (35, 52))),
            "predict-padded-no-mask": Case(  # a model not given the mask: padding attends padding, as in one process
                tiny(), lambda: loader(shifted_targets), predict=lambda: loader(padded("right"), (35, 52))
            ),
            "predict-hf-padded-moe": Case(  # every op's mode on one rank; the padding's mask honoured
                lambda: HFModule("masked", family="qwen3moe"),
                lambda: loader(padded("right")),
                strategy=dict(plan="ulysses"),
                predict=lambda: loader(padded("right"), (35, 52)),
            ),
            "predict-padded-ones-mask": Case(
                OnesMaskLM, lambda: loader(hf_labels), predict=lambda: loader(padded("right"), (35, 52))
            ),
            "predict-generate": Case(
                GeneratingLM,
                lambda: loader(hf_labels),
                predict=lambda: loader(hf_labels, (35,)),
                refused="key/value cache",
            ),
            "clip-norm": Case(tiny(), lambda: loader(shifted_targets), trainer=dict(gradient_clip_val=0.05)),
            "clip-value": Case(
                tiny(optimizer="sgd"),
                lambda: loader(shifted_targets),
                trainer=dict(gradient_clip_val=0.002, gradient_clip_algorithm="value"),
            ),
            "lightning-grad-norm-auto": Case(GradNormLM, lambda: loader(shifted_targets)),
            "lightning-grad-norm-layer-inf": Case(
                lambda: GradNormLM("inf", part="model.layers.1"),
                lambda: loader(shifted_targets),
                strategy=dict(plan=MIXED),
            ),
            "lightning-grad-norm-hf-tied": Case(
                lambda: HFGradNormLM("labels-key", tied=True), lambda: loader(hf_labels), strategy=dict(plan="ulysses")
            ),
            "clip-in-hook": Case(tiny(clip_in_hook=0.05), lambda: loader(shifted_targets), strategy=dict(plan="metp")),
            "clip-total-norm": Case(
                tiny(clip_in_hook=0.05, clip_by_total=True), lambda: loader(shifted_targets), strategy=dict(plan=MIXED)
            ),
            "manual-optimization": Case(ManualLM, lambda: loader(shifted_targets), strategy=dict(plan=MIXED)),
            "manual-loss-logged-before-backward": Case(
                ManualBeforeBackwardLoggedLM, lambda: loader(ragged("targets"), rows=3)
            ),
            "configure-model": Case(ConfiguredLM, lambda: loader(shifted_targets, rows=3), strategy=dict(plan=MIXED)),
            "configure-model-after-draws": Case(
                DrawsFirstLM, lambda: loader(shifted_targets, rows=3), strategy=dict(plan=MIXED)
            ),
            "scheduled-over-estimated-steps": Case(
                StepsScheduledLM, lambda: shuffled(shifted_targets), trainer=dict(max_steps=-1, max_epochs=2)
            ),
            "shuffle": Case(  # on groups (rows), two epochs: the order of each
                tiny(), lambda: shuffled(ragged("targets"), rows=3), trainer=dict(max_steps=-1, max_epochs=2)
            ),
            "two-val-loaders": Case(
                TwoValLM,
                _two_val_data,
                trainer=val | dict(callbacks=[EarlyStopping("val_loss/dataloader_idx_0", patience=0, min_delta=10.0)]),
                test=True,
                strategy=dict(plan=MIXED),
            ),
            "manual-accumulate": Case(ManualAccumulateLM, lambda: loader(shifted_targets), strategy=dict(plan=MIXED)),
            # losses the step check refuses, backed by a manual step: the check skipped those until 2026-12-02
            # (probe 17: 8e-2 and 7e-2 off one process, silently); it compares what manual_backward backs
            "manual-every-position-mean": Case(
                ManualEveryPositionLM, lambda: loader(shifted_targets), strategy=dict(plan=MIXED), refused=ACROSS
            ),
            "manual-row-means": Case(
                ManualRowMeansLM, lambda: loader(even_then_ragged, rows=3), refused="and -100 targets planted"
            ),
            "manual-twice": Case(ManualTwiceLM, lambda: loader(shifted_targets), strategy=dict(plan=MIXED)),
            "manual-twice-hook": Case(ManualTwiceHookLM, lambda: loader(shifted_targets), strategy=dict(plan=MIXED)),
            "sgd": Case(tiny(optimizer="sgd"), lambda: loader(shifted_targets), strategy=dict(plan="tp_sp")),
            "adam": Case(tiny(optimizer="adam"), lambda: loader(shifted_targets), strategy=dict(plan="ring")),
            "rmsprop": Case(tiny(optimizer="rmsprop"), lambda: loader(shifted_targets), strategy=dict(plan="ulysses")),
            "scheduler": Case(tiny(scheduler=True), lambda: loader(shifted_targets), strategy=dict(plan=MIXED)),
            "prompt-masked": Case(tiny(), lambda: loader(prompt_masked), strategy=dict(plan=MIXED)),
            "adafactor": Case(tiny(optimizer="adafactor"), lambda: loader(shifted_targets), refused="Adafactor"),
            "muon": Case(tiny(optimizer="muon"), lambda: loader(shifted_targets), refused="Muon"),
            "profile-of-another-device": Case(
                lm_main,
                _lm_data,
                strategy=dict(profile=foreign_profile()),
                refused=f"measured on '{FOREIGN}' but this run",
            ),
            "lamb": Case(tiny(optimizer="lamb"), lambda: loader(shifted_targets), refused="Lamb"),
            "adamw-subclass": Case(tiny(optimizer="recipe-adamw"), lambda: loader(shifted_targets)),
            "swa": Case(  # Lightning's weight averaging copies the module before it is sharded
                tiny(),
                lambda: loader(shifted_targets),
                trainer=dict(callbacks=[StochasticWeightAveraging(swa_lrs=1e-3)]),
                refused="StochasticWeightAveraging averages a copy of the whole module",
            ),
            "backward-hook-scaled": Case(BackwardHookLM, lambda: loader(ragged("targets"), rows=3)),
            "self-normalised-loss": Case(
                SelfNormalisedLM, lambda: loader(shifted_targets), refused="but its gradient does not"
            ),
            "focal-loss": Case(FocalLM, lambda: loader(ragged("targets"), rows=3)),
            "mean-over-mispredicted-targets": Case(
                HardTargetsLM, lambda: loader(shifted_targets), refused="compared with a tensor of their shape"
            ),
            "logits-gradient-hook": Case(LogitsGradientHookLM, lambda: loader(ragged("targets"), rows=3)),
            "logits-gradient-hook-scaled-by-slice": Case(
                lambda: LogitsGradientHookLM(scaled=True),
                lambda: loader(shifted_targets),
                strategy=dict(plan="ring"),
                refused="but its gradient does not",
            ),
            "loss-logged-before-backward": Case(BeforeBackwardLoggedLM, lambda: loader(ragged("targets"), rows=3)),
            "metrics-read-back-in-the-step": Case(
                MetricsReadBackLM, lambda: loader(ragged("targets"), rows=3), refused="after the step logged it"
            ),
            "metrics-read-in-hooks": Case(
                MetricsReadInHooksLM, lambda: (loader(ragged("targets"), rows=3), loader(shifted_targets)), trainer=val
            ),
            "metrics-read-before-backward-on-groups": Case(
                lambda: MetricsReadInHooksLM(before_backward=True),
                lambda: loader(ragged("targets"), rows=3),
                refused="after the step logged it",
            ),
            "loss-spikes-in-a-callback": Case(
                TinyLM, lambda: loader(ragged("targets"), rows=3), trainer=dict(callbacks=[SpikeWatcher()])
            ),
            "backward-hook-adds-a-term": Case(
                lambda: BackwardHookLM(aux=True),
                lambda: loader(all_targets),
                refused="backward hook backs another tensor than the loss",
            ),
            "model-pruning": Case(  # it would prune the embeddings and the head, not the blocks' rewritten projections
                TinyLM,
                lambda: loader(shifted_targets),
                trainer=dict(callbacks=[ModelPruning("l1_unstructured", amount=0.3)]),
                refused="ModelPruning prunes the module's nn.Linear",
            ),
            "lr-finder": Case(  # Tuner.lr_find's callback ends the fit from inside
                tiny(),
                lambda: loader(shifted_targets),
                trainer=dict(callbacks=[LearningRateFinder(num_training_steps=2)]),
                refused="LearningRateFinder (Tuner.lr_find) is not supported",
            ),
            "ema": Case(
                tiny(),
                lambda: loader(shifted_targets),
                trainer=dict(callbacks=[EMAWeightAveraging()]),
                refused="EMAWeight",
            ),
            "shared-across-blocks-weight": Case(
                SharedAcrossBlocksLM, lambda: loader(shifted_targets), refused="blocks that share weights"
            ),
            "shared-across-blocks-module": Case(
                lambda: SharedAcrossBlocksLM("module"), lambda: loader(shifted_targets), refused="share weights"
            ),
            "averaged-model-in-init": Case(  # torch's AveragedModel built with the module: a whole copy
                AveragedModelLM,
                lambda: loader(shifted_targets),
                strategy=dict(blocks="model.layers"),
                refused="AveragedModel made before ParaDySeStrategy shards",
            ),
            "kept-losses-groups": Case(  # training steps on groups: the loss settles after the gradient return
                KeptLossesLM,
                lambda: (loader(ragged("targets"), rows=3), loader(ragged("targets"), (35, 52), rows=3)),
                trainer=dict(val_check_interval=2, limit_val_batches=2, max_steps=-1, max_epochs=1),
            ),
            "kept-losses-one-group": Case(  # written after the backward of Lightning's closure
                KeptLossesLM,
                lambda: (loader(shifted_targets), loader(shifted_targets, (35, 52))),
                trainer=dict(val_check_interval=2, limit_val_batches=2, max_steps=-1, max_epochs=1),
                strategy=dict(plan=MIXED),
            ),
            "encoder-layers-default": Case(  # the strategy's defaults: the cost planner, groups of both kinds
                EncoderTinyLM, lambda: loader(ragged("targets"), rows=3), splits=SPLITS_2
            ),
            "dropout": Case(DropoutLM, lambda: loader(shifted_targets), strategy=dict(plan=MIXED), compare=False),
            "self-shift": Case(  # the step's own shift of the batch's tokens: named as a cut along the sequence
                SelfShift,
                lambda: loader(tokens_only),
                refused="works on positions of the sequence itself (<a [2, 9, ...] tensor>[:, :-1], input_ids[:, 1:])",
            ),
            # a mean over every position: one process's where every position has a target, refused where one has
            # none (silent until 2026-11-30, thirteenth session: the check's first tokens all had targets)
            "every-position-mean": Case(EveryPositionLM, lambda: loader(shifted_targets), refused=ACROSS),
            "every-position-mean-prompt": Case(EveryPositionLM, lambda: loader(prompt_masked), refused=ACROSS),
            "every-position-mean-later": Case(EveryPositionLM, lambda: loader(targets_after_first), refused=ACROSS),
            "every-position-mean-all-targeted": Case(EveryPositionLM, lambda: loader(all_targets)),
            "every-position-z-loss": Case(ZLossLM, lambda: loader(shifted_targets), refused=ACROSS),
            "batch-norm-over-tokens": Case(BatchNormHeadLM, lambda: loader(shifted_targets), refused=ACROSS),
            "every-position-z-loss-in-training": Case(TrainingZLossLM, lambda: loader(shifted_targets), refused=ACROSS),
            # state the step keeps across steps (probe 19): a step counter is one process's, a count of the slice's
            # tokens and a running mean of the rank's own loss are refused
            "step-counter-buffer": Case(
                StepCounterLM, lambda: loader(ragged("targets"), rows=3), strategy=dict(plan="ring")
            ),
            "tokens-seen-buffer": Case(
                TokensSeenLM, lambda: loader(ragged("targets"), rows=3), refused="keeps self.tokens_seen from"
            ),
            "loss-ema-buffer": Case(
                LossEmaLM, lambda: loader(ragged("targets"), rows=3), refused="keeps self.loss_ema from"
            ),
            "weights-later": Case(
                WeightedLM,
                lambda: loader(weighted_later, rows=3),
                refused="causes: per-token weights normalised by their sum on the slice (weights.flatten().sum():",
            ),
            "weights-by-batch-total": Case(  # on groups and one group
                WeightedByTotalLM, lambda: loader(weighted_later_total, rows=3), strategy=dict(loss_reduction="sum")
            ),
            # losses the step check names (silent or crashing until 2026-11-30, thirteenth session)
            # a mean over targets the strategy does not weigh by (probe 16, 2026-12-02), in training and validation
            "targets-under-another-key": Case(OtherTargetsLM, lambda: loader(tgt_targets), refused="batch's 'tgt'"),
            "targets-not-last-in-tuple": Case(
                OtherTargetsLM, lambda: loader(targets_mid_tuple), refused="batch's tensor 1, but"
            ),
            "targets-under-another-key-validated": Case(
                OtherTargetsLM,
                lambda: (loader(tgt_targets), loader(tgt_targets, (35, 52))),
                validate=True,
                refused="averages over the targets in the batch's 'tgt'",
            ),
            # a mean over targets the step sets apart by the pad id, the first batch without one (silent until
            # 2026-12-02, twenty-ninth session: the check's first batch set nothing apart)
            "targets-selected-by-pad-id": Case(
                PadSelectedLM, lambda: loader(pad_zero_after_first), refused="depend on the batch's 'targets' != 0"
            ),
            "targets-masked-mean-by-pad-id": Case(
                PadMaskedMeanLM, lambda: loader(pad_zero_after_first), refused="it divides by a count that depends on"
            ),
            "targets-pad-id-to-ignore-in-step": Case(
                PadToIgnoreLM, lambda: loader(pad_zero_after_first), refused="depend on the batch's 'targets' == 0"
            ),
            # the same written without a comparison, and a mean of each row's mean over a first batch of rows with
            # equal counts of targets (silent until 2026-12-02, probe 17): seen on ids planted in the check's tokens
            "targets-masked-by-bool": Case(
                PadBoolMaskedLM, lambda: loader(pad_zero_after_first), refused="with the ids 0 planted"
            ),
            "loss-mask-mean-ones-first": Case(
                LossMaskedMeanLM, lambda: loader(loss_mask_after_first), refused="(and 0 in its 'loss_mask')"
            ),
            "row-means-even-first-batch": Case(
                RowMeansLM, lambda: loader(even_then_ragged, rows=3), refused="and -100 targets planted"
            ),
            "targets-selected-by-ignore-index": Case(
                functools.partial(PadSelectedLM, -100), lambda: loader(shifted_targets)
            ),
            "ignore-index-pad": Case(PadIgnoredLM, lambda: loader(pad_targets_zero), refused="ignore_index=0"),
            "class-weights": Case(ClassWeightedLM, lambda: loader(shifted_targets), refused="weight=..."),
            "hf-ignore-index": Case(hf("ignore-zero"), lambda: loader(ragged("labels")), refused="ignore_index=0"),
            # refused at the setup (the classifier silent in an evaluation until 2026-11-30; NEFTune's noise sqrt(p)
            # times one process's), the classifier's predictions exact
            "hf-sequence-classifier": Case(
                SequenceClassifierLM,
                lambda: loader(ragged("labels")),
                refused="its head reads one position of each row",
            ),
            "hf-sequence-classifier-predict": Case(
                SequenceClassifierLM,
                lambda: loader(ragged("labels")),
                predict=lambda: loader(ragged("labels"), (35, 52)),
                fit=False,
            ),
            "neftune": Case(NEFTuneLM, lambda: loader(ragged("labels")), refused="NEFTune"),
            # encoder-decoders refused at the setup, whichever blocks are named, trained or frozen; predicted whole
            "hf-bart": Case(EncoderDecoderLM, lambda: loader(hf_labels), refused="is an encoder-decoder"),
            "hf-t5": Case(lambda: EncoderDecoderLM("t5"), lambda: loader(hf_labels), refused="is an encoder-decoder"),
            "hf-bart-decoder-blocks": Case(
                EncoderDecoderLM,
                lambda: loader(hf_labels),
                strategy=dict(blocks="model.model.decoder.layers"),
                refused="is an encoder-decoder",
            ),
            "hf-bart-frozen-validate": Case(  # frozen: the encoder would run whole, the decoder on a slice of it
                lambda: EncoderDecoderLM(frozen=True),
                lambda: (loader(hf_labels), loader(hf_labels, (35, 52))),
                validate=True,
                fit=False,
                strategy=dict(blocks="model.model.decoder.layers"),
                refused="is an encoder-decoder",
            ),
            "hf-bart-predict": Case(
                EncoderDecoderLM,
                lambda: loader(hf_labels),
                predict=lambda: loader(hf_labels, (35, 52)),
                fit=False,
                strategy=dict(blocks="model.model.decoder.layers"),
            ),
            # the model's hidden states in the loss; the attention weights asked for: refused
            "hf-hidden-states": Case(HiddenStatesLM, lambda: loader(counted_labels)),
            "hf-logits-to-keep": Case(LogitsToKeepLM, lambda: loader(ragged("labels")), refused="logits_to_keep=9"),
            "hf-attention-weights": Case(
                lambda: HiddenStatesLM(attentions=True),
                lambda: loader(counted_labels),
                refused="output_attentions=True",
            ),
            # a frozen teacher's blocks left whole by blocks=: run on the whole sequences, its logits cut per rank
            "distillation-teacher": Case(
                DistilledLM,
                lambda: (loader(ragged("targets")), loader(ragged("targets"), (35, 52))),
                strategy=dict(blocks="model.model.layers"),
            ),
            "distillation-teacher-ring": Case(  # the balanced order: a rank's tokens are two chunks of each row
                DistilledLM,
                lambda: loader(ragged("targets")),
                strategy=dict(blocks="model.model.layers", plan="ring"),
            ),
            "distillation-teacher-labels": Case(
                lambda: DistilledLM(teacher_loss=True),
                lambda: loader(ragged("targets")),
                strategy=dict(blocks="model.model.layers"),
                refused="was called with labels=: its own loss would be the whole batch's on some steps",
            ),
            "distillation-teacher-trained": Case(
                lambda: DistilledLM(trainable=True),
                lambda: loader(ragged("targets")),
                strategy=dict(blocks="model.model.layers"),
                refused="has trainable weights in a step under gradient",
            ),
            "distillation-hf-loss-plus-kl": Case(
                lambda: DistilledLM(hf_loss=True),
                lambda: loader(ragged("labels")),
                strategy=dict(blocks="model.model.layers"),
                refused="Common causes: a Hugging Face model's loss given labels=",
            ),
            "distillation-teacher-embeds": Case(
                lambda: DistilledLM(embeds=True),
                lambda: loader(ragged("targets")),
                strategy=dict(blocks="model.model.layers"),
                refused="teacher.model.layers holds transformer blocks ParaDySeStrategy leaves whole",
            ),
            # labels one per token, as given (not shifted): each rank's mean weighed by its share of the labels
            "hf-token-classifier": Case(
                TokenClassifierLM,
                lambda: (loader(token_classes, rows=3), loader(token_classes, (35, 52), rows=3)),
                trainer=dict(val_check_interval=2, limit_val_batches=1, max_steps=4, max_epochs=-1),
            ),
            "hf-items-batch": Case(
                hf("items-batch"), lambda: loader(ragged_counted, rows=3), trainer=dict(accumulate_grad_batches=2)
            ),
            "hf-items-step": Case(hf("items-step"), lambda: loader(ragged("labels"))),
            "hf-items-number": Case(
                hf("items-number"), lambda: loader(ragged("labels")), refused="num_items_in_batch= made in the step"
            ),
        }
        | group_cases(2)
        | family_cases()
        | lora_cases()
    )


DP = ((1, 1),)
"""Every grouped step data parallel (2 ranks)."""
SPLITS_2 = ((1, 1), (2,))
"""Data parallel and sequence parallel in turn (2 ranks)."""
SPLITS_4 = ((1, 1, 1, 1), (2, 1, 1), (2, 2), (4,))
"""Every kind of split of 4 ranks in turn."""


def group_cases(p: int) -> dict[str, Case]:
    """Ordinary batches of several sequences (rows, ragged and right-padded or not) on groups of different sizes:
    every mode in every group, mixed plans with recomputation, accumulation, Hugging Face labels."""
    tiny = lambda: TinyLM()  # noqa: E731
    hf = lambda call: lambda: HFModule(call)  # noqa: E731
    rows = 2 * p - 1  # uneven over the groups
    splits = SPLITS_2 if p == 2 else SPLITS_4
    grouped = dict(groups=True, check_step=False)
    cases = {
        f"groups-{mode}": Case(
            tiny, lambda: loader(ragged("targets"), rows=rows), strategy=grouped | dict(plan=mode), splits=splits
        )
        for mode in ("tp_sp", "ulysses", "ring", "metp")
    }
    cases |= {
        "groups-dp": Case(
            tiny, lambda: loader(shifted_targets, rows=rows), strategy=grouped | dict(plan="tp_sp"), splits=(splits[0],)
        ),
        "groups-dp-accumulate": Case(  # consecutive micro-batches on one split: the kept shards, no exchange
            tiny,
            lambda: loader(ragged("targets"), rows=rows),
            trainer=dict(accumulate_grad_batches=2),
            strategy=grouped | dict(plan=MIXED),
            splits=(splits[0],),
        ),
        "groups-dp-accumulate-stale": Case(  # weights changed between micro-batches; validation between them
            NudgedLM,
            lambda: (loader(ragged("targets"), rows=rows), loader(ragged("targets"), (35, 52), rows=rows)),
            trainer=dict(accumulate_grad_batches=2, val_check_interval=3, limit_val_batches=1),
            strategy=grouped | dict(plan=MIXED),
            splits=(splits[0],),
        ),
        "groups-mixed-accumulate": Case(
            tiny,
            lambda: loader(ragged("targets"), rows=rows),
            trainer=dict(accumulate_grad_batches=2),
            strategy=grouped | dict(plan=MIXED),
            splits=splits[::-1],
        ),
        "groups-hf-ragged": Case(
            hf("masked"),
            lambda: loader(ragged("labels"), rows=rows),
            strategy=grouped | dict(plan=MIXED),
            splits=splits,
        ),
        "groups-hf-labels": Case(
            hf("labels-key"), lambda: loader(hf_labels, rows=rows), strategy=dict(plan="auto"), splits=splits[:2]
        ),
        "groups-idle": Case(  # fewer rows than groups: a group left without one runs a placeholder weighed by 0
            tiny,
            lambda: loader(ragged("targets"), rows=len(splits[0]) - 1),
            strategy=grouped | dict(plan="tp_sp"),
            splits=splits[:2],
        ),
        "groups-idle-hf": Case(
            hf("masked"),
            lambda: loader(ragged("labels"), rows=1),
            strategy=grouped | dict(plan=MIXED),
            splits=splits[:2],
        ),
        "groups-manual": Case(  # manual optimization on groups: every backward returns its gradients
            ManualLM,
            lambda: loader(ragged("targets"), rows=rows),
            strategy=grouped | dict(plan=MIXED),
            splits=splits,
        ),
        "groups-manual-accumulate": Case(  # the second backward adds to returned shard and replicated gradients
            ManualAccumulateLM,
            lambda: loader(ragged("targets"), rows=rows),
            strategy=grouped | dict(plan=MIXED),
            splits=splits,
        ),
        "groups-manual-twice": Case(  # a forward after the step's gradient return: refused, naming groups=False
            ManualTwiceLM,
            lambda: loader(ragged("targets"), rows=rows),
            strategy=grouped | dict(plan=MIXED),
            splits=splits,
            refused="use ParaDySeStrategy(groups=False) for such steps",
        ),
        "groups-manual-retain": Case(  # two backwards of one forward: the second's would be lost (probe 7)
            ManualRetainLM,
            lambda: loader(ragged("targets"), rows=rows),
            strategy=grouped | dict(plan=MIXED),
            splits=splits,
            refused="a second manual_backward in one training step on groups",
        ),
        "groups-manual-retain-off": Case(
            ManualRetainLM, lambda: loader(ragged("targets"), rows=rows), strategy=dict(groups=False)
        ),
        "groups-manual-twice-off": Case(  # the fix the refusal names
            ManualTwiceLM, lambda: loader(ragged("targets"), rows=rows), strategy=dict(groups=False)
        ),
        "groups-auto": Case(lm_main, lambda: loader(ragged("targets"), rows=2 * p)),
        "groups-auto-one-row": Case(lm_main, lambda: loader(ragged("targets"), rows=1)),  # on every rank, or fewer
        "groups-auto-again": Case(lm_main, lambda: loader(ragged("targets"), rows=2 * p)),
    }
    if p == 2:  # a count the data loader gives, on groups (one process count is enough: the same path)
        cases["groups-hf-items-batch"] = Case(
            hf("items-batch"),
            lambda: loader(ragged_counted, rows=rows),
            strategy=grouped | dict(plan=MIXED),
            splits=splits,
        )
        cases["groups-hf-token-classifier"] = Case(  # each group's mean weighed by the whole batch's count
            TokenClassifierLM,
            lambda: loader(token_classes, rows=rows),
            strategy=grouped | dict(plan=MIXED),
            splits=splits,
        )
    return cases


def cases_p2_part(part: int, parts: int) -> dict[str, Case]:
    """Every ``parts``-th case of :func:`cases_p2` from its ``part``-th, the cases that are another's second run (named
    ``<case>-again``) with their first, which must run in the same job (it reads the machine the first measured): the
    2-rank cases cut into jobs that run side by side (:func:`tests.exact.test_exact.jobs`)."""
    every = cases_p2()
    firsts = list(dict.fromkeys(name.removesuffix("-again") for name in every))
    mine = set(firsts[part::parts])
    return {name: case for name, case in every.items() if name.removesuffix("-again") in mine}


def cases_p4() -> dict[str, Case]:
    """Groups of different sizes on 4 ranks; a mixture of experts with fewer experts than ranks; LoRA adapters on groups
    and in ``tp_sp`` with fewer key/value heads than ranks (their ``B`` rows gathered and picked per head)."""
    lora = {}
    if importlib.util.find_spec("peft") is not None:
        lora = {
            "lora-groups-p4": Case(
                LoraLM,
                lambda: loader(ragged("labels"), rows=3),
                strategy=dict(plan="ulysses", groups=True, check_step=False),
                splits=((2, 2), (1, 1, 1, 1), (4,)),
            ),
            "lora-tp-sp-few-kv-heads": Case(
                lambda: LoraLM(n_kv_heads=2), lambda: loader(ragged("labels")), strategy=dict(plan="tp_sp")
            ),
        }
    return (
        group_cases(4)
        | lora
        | {
            # 3 experts over 4 ranks: one rank holds none (an empty shard gets an empty gradient)
            "moe-empty-shards": Case(
                lambda: HFModule("labels-key", family="qwen3moe"),
                lambda: loader(hf_labels, rows=3),
                strategy=dict(plan="ulysses", groups=True, check_step=False),
                splits=((2, 2), (1, 1, 1, 1)),
            )
        }
    )


GRAD_CKPT_EVERY_2 = {"every_n_layers": 2, "gradient_checkpointing_kwargs": {"use_reentrant": True}}
"""Hugging Face checkpointing of layer 0 only (the reentrant form): the plan recomputes that layer alone."""


def cases_launched() -> dict[str, Case]:
    """Paths through the strategy's own launcher (its default start method pickles the module into the workers):
    Hugging Face gradient checkpointing enabled in the module's ``__init__``, as users do; shuffling loaders, one
    with workers that draw at random."""
    hf = lambda **kw: lambda: HFModule("labels-key", **kw)  # noqa: E731
    data = lambda: loader(hf_labels, LENGTHS[:3])  # noqa: E731
    return {
        "hf-grad-ckpt": Case(
            hf(checkpointing={}),
            data,
            trainer=dict(max_steps=3),
            strategy=dict(plan="ring"),
            plans=("ring+rc,ring+rc | ring+rc,ring+rc",) * 3,
        ),
        "hf-grad-ckpt-offload": Case(hf(checkpointing={"offload": True}), data, refused="offload=True"),
        "hf-hidden-states-launched": Case(HiddenStatesLM, lambda: loader(counted_labels), trainer=dict(max_steps=2)),
        "loader-workers-seeded": Case(TinyLM, seeded_workers, strategy=dict(plan=MIXED)),
        "shuffle-launched": Case(  # the launching process's streams carried into the workers
            TinyLM,
            lambda: shuffled(shifted_targets),
            trainer=dict(max_steps=-1, max_epochs=2),
            strategy=dict(plan=MIXED),
        ),
    }


def cases_shared_device() -> dict[str, Case]:
    """``Trainer(devices=1, strategy=ParaDySeStrategy(ranks_per_device=2))``: two ranks on one device over gloo (on a
    GPU, how every mode is checked with one GPU), launched by the strategy; every mode per op, mixed plans."""
    return {
        "shared-mixed": Case(
            lm_main, _lm_data, trainer=dict(max_steps=3), strategy=dict(plan=EVERY_MODE, ranks_per_device=2)
        ),
    }


def cases_p3() -> dict[str, Case]:
    """Paths where 3 ranks differ: uneven chunks, heads not divisible by 3."""
    return {
        "hf-flattened": Case(  # documents and slices cut unevenly over 3 ranks
            lambda: HFModule("flattened"),
            lambda: DataLoader(FlattenedBatches(PACKED), batch_size=None),
            strategy=dict(plan="ring"),
        ),
        "hf-flattened-groups": Case(
            lambda: HFModule("flattened"), lambda: DataLoader(FlattenedBatches(PACKED), batch_size=None)
        ),
        "hf-roberta-mlm": Case(lambda: MaskedLM(roberta=True), lambda: loader(mlm_labels), strategy=dict(plan="ring")),
        "hf-esm-mlm": Case(lambda: MaskedLM(esm={}), lambda: loader(esm_masked), strategy=dict(plan="ring")),
        "lm-main": Case(  # and the command line's predictions (uneven shards of the whole weights)
            lm_main,
            _lm_data,
            trainer=dict(val_check_interval=2, limit_val_batches=2),
            strategy=dict(plan=MIXED_3),
            predict=lambda: _lm_data()[1],
        ),
        "hf-labels-ids": Case(lambda: HFModule("labels-ids"), lambda: loader(tokens_only), strategy=dict(plan="ring")),
        "lm-packed": Case(
            lm_main, lambda: DataLoader(PackedBatches(PACKED), batch_size=None), strategy=dict(plan=MIXED_3)
        ),
        "manual-optimization": Case(ManualLM, lambda: loader(shifted_targets), strategy=dict(plan=MIXED_3)),
        "clip-norm": Case(
            lambda: TinyLM(),
            lambda: loader(shifted_targets),
            trainer=dict(gradient_clip_val=0.05),
            strategy=dict(plan=MIXED_3),
        ),
    }
