"""The step check's parts (its whole run on Hugging Face models and a mixture of experts, and its refusal of
a step that shifts its own targets, are cases of :mod:`tests.exact.cases`)."""

from __future__ import annotations

import math
import os
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
import torchmetrics
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.lightning.language_model import LanguageModel
from lightning_paradyse.lightning.step_check import (
    LossCalls,
    SequenceCuts,
    check_step_losses,
    described_columns,
    differing_logs,
    differing_state,
    gradient_gap,
    kept_attributes,
    pad_ids,
    planted_probe,
    probe_batch,
    probe_columns,
    refuse_differing_state,
    refuse_gradient_gap,
    rows_with_target,
    sequence_index,
    sequence_split,
    step_check_tolerance,
    whole_plan,
)
from lightning_paradyse.modes.plan import parse_plan, uniform_plan
from tests.support.dist import free_port
from tests.support.lightning import quiet_trainer, strategy_environment


def test_the_whole_run_keeps_each_ops_mode_without_recomputation() -> None:
    """On a group of one every mode computes the plain op, so each op keeps the step's own mode (a mixture of experts
    run whole takes ulysses or ring, never tp_sp); recomputation is dropped (the check keeps no gradient)."""
    plan = parse_plan([{"attention": "tp_sp", "mlp": "ulysses", "recompute": True}, "ring"], 2)
    assert whole_plan(plan) == parse_plan([{"attention": "tp_sp", "mlp": "ulysses"}, "ring"], 2)
    assert whole_plan(uniform_plan("metp", 3)) == uniform_plan("metp", 3)


def test_the_probe_is_every_tensors_chosen_positions() -> None:
    batch = {"input_ids": torch.arange(12).view(2, 6), "positions": torch.arange(6), "scale": torch.ones(3)}
    cut = probe_batch(batch, 2, 6, torch.tensor([0, 1, 4]))
    assert cut["input_ids"].tolist() == [[0, 1, 4], [6, 7, 10]]
    assert cut["positions"].tolist() == [0, 1, 4]
    assert cut["scale"] is batch["scale"]  # not per token: untouched
    assert probe_batch((batch["input_ids"],), 2, 6, torch.arange(2))[0].shape == (2, 2)
    assert described_columns(torch.tensor([0, 1, 2, 7, 9, 10])) == "0..2, 7, 9..10"


def test_ids_are_planted_in_the_first_rows_last_real_targets() -> None:
    """The pad ids take the first row's last positions that have a real target, in the tokens and the targets; where
    the data marks targets -100, -100 takes the targets' positions before them; the batch itself is left as it was;
    too few real targets plant nothing."""
    ids, targets = torch.arange(1, 25).view(2, 12), torch.arange(1, 25).view(2, 12)
    targets[0, -1] = -100
    batch = {"input_ids": ids, "targets": targets}
    planted, how = planted_probe(batch, (0, 5), ignore=True)
    assert planted["targets"][0].tolist() == [1, 2, -100, -100, -100, 5, 5, 5, 0, 0, 0, -100]
    assert planted["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 5, 5, 5, 0, 0, 0, 12]  # no -100 among the tokens
    assert planted["targets"][1].tolist() == targets[1].tolist() and ids[0, -1] == 12 and targets[0, 2] == 3
    assert how == "with the ids 0, 5 and -100 targets planted in its first row's last real targets"
    assert planted_probe(batch, (0,), ignore=False)[0]["targets"][0, 8:].tolist() == [0, 0, 0, -100]
    tuple_batch = (ids, targets)
    assert planted_probe(tuple_batch, (0,), ignore=False)[0][1][0, -4:].tolist() == [0, 0, 0, -100]
    assert planted_probe({"input_ids": ids[:, :3], "targets": targets[:, :3]}, (0,), ignore=False)[1] is None
    masked = {**batch, "loss_mask": torch.ones(2, 12), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    planted, how = planted_probe(masked, (0,), ignore=False)  # a mask of the batch's own: 0 before the ids
    assert planted["loss_mask"][0].tolist() == [1.0] * 5 + [0.0] * 3 + [1.0] * 4 and how is not None
    assert "(and 0 in its 'loss_mask')" in how and planted["attention_mask"] is masked["attention_mask"]
    mirror = {**batch, "loss_mask": (targets != -100).double()}  # 0 exactly where the targets are -100
    planted, how = planted_probe(mirror, (0,), ignore=True)  # its 0 where -100 is planted, as the data has it
    assert planted["loss_mask"][0].tolist() == [1.0] * 5 + [0.0] * 3 + [1.0] * 3 + [0.0] and "loss_mask" not in how
    assert planted["targets"][0, 5:8].tolist() == [-100] * 3


def test_the_pad_ids_are_zero_and_a_hugging_face_configs() -> None:
    class Config:
        vocab_size, pad_token_id, eos_token_id = 10, 5, [2, 7, 12]  # 12: beyond the vocabulary

    hf = nn.Module()
    hf.config = Config()  # type: ignore[assignment]
    outer = nn.Module()
    outer.model = hf
    assert pad_ids(outer) == (0, 5, 2, 7)
    assert pad_ids(nn.Linear(2, 2)) == (0,)


def test_the_probe_holds_the_batchs_ends_and_positions_with_and_without_a_target() -> None:
    """Positions at the start, the end and between; between, the first position with a target after a prompt, or
    the first without one where the ends all have one and the batch has such a position."""
    assert described_columns(probe_columns(None, 2, 40, 9)) == "0..2, 19..21, 37..39"  # no targets: the middle
    assert described_columns(probe_columns(None, 2, 8, 9)) == "0..7"  # a short batch: every position
    targets = torch.arange(80).view(2, 40)
    rows = rows_with_target({"input_ids": targets, "targets": targets}, 2, 40)
    assert rows is not None and rows.tolist() == [2] * 40
    assert described_columns(probe_columns(rows, 2, 40, 9)) == "0..2, 19..21, 37..39"  # every position has one
    targets[1, 30:] = -100  # the second row's last ten (padding): the end holds them
    rows = rows_with_target({"targets": targets}, 2, 40)
    assert rows is not None and rows.tolist() == [2] * 30 + [1] * 10
    assert described_columns(probe_columns(rows, 2, 40, 9)) == "0..2, 19..21, 37..39"
    inner = torch.arange(80).view(2, 40)
    inner[0, 12:16] = -100  # positions without a target inside the sequence only: the middle run finds them
    assert (
        described_columns(probe_columns(rows_with_target({"targets": inner}, 2, 40), 2, 40, 9))
        == "0..2, 11..13, 37..39"
    )
    prompt = torch.arange(80).view(2, 40)
    prompt[:, :38] = -100  # a prompt without targets, two targets at the end: the end holds them
    assert (
        described_columns(probe_columns(rows_with_target({"targets": prompt}, 2, 40), 2, 40, 9))
        == "0..2, 19..21, 37..39"
    )
    prompt[:, 38:] = -100
    prompt[0, 25] = 7  # one target, inside: the middle run holds it
    assert (
        described_columns(probe_columns(rows_with_target({"targets": prompt}, 2, 40), 2, 40, 9))
        == "0..2, 24..26, 37..39"
    )
    labels = torch.arange(80).view(2, 40)  # Hugging Face labels: the model shifts them, the last has no target
    rows = rows_with_target({"labels": labels}, 2, 40)
    assert rows is not None and rows.tolist() == [2] * 39 + [0]
    assert rows_with_target({"input_ids": labels}, 2, 40) is None  # no targets
    edge = torch.arange(80).view(2, 40)
    edge[0, 3] = -100  # just after the start run: the middle run starts after it
    assert described_columns(probe_columns(rows_with_target({"targets": edge}, 2, 40), 2, 40, 9)) == "0..5, 37..39"


def test_losses_that_differ_beyond_the_tolerance_name_the_fix() -> None:
    tol = step_check_tolerance(torch.float64, "64-true")
    check_step_losses(2.0, 2.0 * (1 + tol / 2), tol)
    named = r"computes something across the tokens.*loss_reduction='sum'.*check_step=False"
    with pytest.raises(ValueError, match=named):
        check_step_losses(2.0, 2.0 * (1 + 2 * tol), tol)
    with pytest.raises(ValueError, match=r"Common causes: a Hugging Face model's loss given labels= .* shifting"):
        check_step_losses(2.0, 3.0, tol, consumed=True)  # its share of the global mean beside a term of the step's
    with pytest.raises(ValueError, match=r"draws random numbers: .* 3, and 4 when .*on_after_batch_transfer"):
        check_step_losses(2.0, 3.0, tol, redrawn=4.0)  # the whole call seeded afresh moved: the draws named alone
    with pytest.raises(ValueError, match="computes something across the tokens"):
        check_step_losses(2.0, 3.0, tol, redrawn=3.0)  # the same whole loss seeded afresh: not random
    with pytest.raises(ValueError, match=r"nan on .* a mean over no real target.*on_after_batch_transfer"):
        check_step_losses(math.nan, math.nan, tol)  # the step masked every target it was handed
    with pytest.raises(ValueError, match=r"chunks of 16 tokens"):
        check_step_losses(2.0, 3.0, tol, chunk=16)  # a loss averaged per chunk named first
    assert step_check_tolerance(torch.float32, "bf16-mixed") > step_check_tolerance(torch.float32, "32-true")
    # a float64 step whose loss function ran in float32 (Hugging Face's cross-entropy): float32's rounding of a
    # mean over the probe's few tokens (~1e-7; an exact auxiliary term beside it was refused at 4.9e-8 before), still
    # far below a term averaged over the slice's own count (~1e-5, probe 10)
    mixed = step_check_tolerance(torch.float64, "64-true", {torch.float32})
    assert tol < 1e-7 < mixed < 1e-5


def test_the_modules_own_attributes_are_put_back_after_the_check() -> None:
    """What a step commonly does to the module's own attributes leaves no trace of the check's extra calls: a list it
    appends its loss to (Lightning 2's way to an epoch's mean), nested containers, a counter, an accumulator changed
    in place; the containers stay the same objects (references held elsewhere see their content). An attribute the
    step sets once (a hook's handle) stays, and so do containers of other types (a Hugging Face output refuses
    ``update``) and inference tensors (what validation leaves under ``inference_mode``)."""

    class Frozen(dict):  # type: ignore[type-arg]
        def update(self, *args: object, **kwargs: object) -> None:
            raise TypeError("frozen")

    module = nn.Linear(2, 2)
    outs: list[torch.Tensor] = [torch.tensor(1.0)]
    kept = {"train": [1], "seen": {"a"}, "pair": ([2], 3), "last": deque([4], maxlen=2)}
    with torch.inference_mode():
        last_val = torch.tensor(7.0)
    module.outs, module.kept, module.n, module.total, module.handle = outs, kept, 5, torch.zeros(()), None
    module.frozen, module.last_val = Frozen(a=1), last_val
    restore = kept_attributes(module)
    module.outs.append(torch.tensor(2.0))
    module.kept["train"].append(2)
    module.kept["seen"].add("b")
    module.kept["pair"][0].append(9)
    module.kept["last"].append(5)
    module.kept["new"] = []
    module.n += 1
    module.total += 3.0
    module.handle = "registered"
    module.added = "x"
    dict.__setitem__(module.frozen, "b", 2)
    module.last_val = torch.tensor(8.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing it tries to put back fails
        restore()
    assert module.outs is outs and [float(t) for t in outs] == [1.0]
    assert module.kept is kept and kept == {"train": [1], "seen": {"a"}, "pair": ([2], 3), "last": deque([4])}
    assert module.n == 5 and float(module.total) == 0.0
    assert (module.handle, module.added, dict(module.frozen), float(module.last_val)) == (
        "registered",
        "x",
        {"a": 1, "b": 2},
        8.0,
    )


def test_buffers_are_put_back_and_read_for_the_comparison_of_the_calls() -> None:
    """A buffer the step changes in place or rebinds, of the module or of a sub-module, is put back after each of the
    check's calls (it is checkpointed: a step counter counted the check's calls until 2026-12-02, probe 19), and
    :meth:`KeptState.values` reads the counters and small tensors the step keeps, a reference to the returned loss as
    the global loss."""
    module = nn.Sequential(nn.Linear(2, 2))
    module.register_buffer("steps", torch.zeros((), dtype=torch.long))
    module[0].register_buffer("seen", torch.zeros(2))
    module.count, module.took = 3, 0.5
    steps, seen = module.steps, module[0].seen
    kept = kept_attributes(module)
    for _ in range(2):  # put back as often as wanted
        module.steps += 1
        module[0].seen = module[0].seen + 2.0  # rebound
        module.count += 1
        module.took = 0.25
        values = kept.values()
        assert values.keys() == {"steps", "0.seen"} and int(values["steps"]) == 1
        assert torch.equal(values["0.seen"], torch.full((2,), 2.0))
        kept()
        assert module.steps is steps and int(steps) == 0 and module[0].seen is seen and float(seen.sum()) == 0.0
        assert (module.count, module.took) == (3, 0.5)
    module.total, module.aux = torch.zeros(()), torch.zeros(())
    kept = kept_attributes(module)
    module.total += 2.0  # an accumulator, changed in place
    module.aux = torch.ones(())  # rebound: what the step keeps for a hook of the same step
    assert float(kept.values()["total"]) == 2.0 and "aux" not in kept.values()
    local, total = torch.tensor(2.0), torch.tensor(5.0)
    module.register_buffer("last", torch.zeros(()))
    kept = kept_attributes(module)
    module.last = local  # the step keeps the loss it returns in a buffer: the global loss once the step is over
    assert float(kept.values((local, total))["last"]) == 5.0


def test_state_the_step_keeps_from_its_slice_is_refused_by_name() -> None:
    """After the check's call on the slice and its call on every token, a counter or small tensor that differs (on any
    rank: one rank here) is refused naming it; equal ones, and differences within the tolerance, are not."""
    tol = step_check_tolerance(torch.float64, "64-true")
    same = {"steps": torch.tensor(1), "count": 2, "ema": torch.tensor(1.0)}
    assert differing_state(same, same | {"ema": torch.tensor(1.0 + tol / 4)}, tol, None) is None
    found = differing_state(same | {"tokens": torch.tensor(7)}, same | {"tokens": torch.tensor(12)}, tol, None)
    assert found == ["tokens"]
    with pytest.raises(
        ValueError, match=r"training_step keeps self.tokens from the tokens of its slice.*on_train_batch_end"
    ):
        refuse_differing_state(found, "training_step")
    refuse_differing_state(None, "training_step")


def test_a_gradient_by_the_outputs_that_differs_from_one_process_is_refused() -> None:
    """Rank 0 of two (a group of one here: the agreement adds nothing) compares the gradient of its part of the loss
    with one process's at its tokens, relative to one process's largest entry; a loss given ``labels=`` inside the
    model and loose tolerances are not compared, and outputs not per token are left out."""
    layout = SeqLayout.for_sequence(8, 2, causal=False)  # rank 0 holds positions 0..3
    whole = torch.randn(2, 8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # [b, m, V]
    part = layout.shard(whole, 0)  # [b, 4, V]
    assert gradient_gap([part.clone()], [whole], layout, None) == 0.0
    gap = gradient_gap([part * 1.01], [whole], layout, None)
    assert gap is not None and 0.0 < gap <= 0.01 * (1 + 1e-12)  # 0.01 where rank 0 holds the largest entry
    assert gradient_gap([None], [whole], layout, None) == pytest.approx(float(part.abs().max() / whole.abs().max()))
    pooled = torch.randn(2, 5, dtype=torch.float64)  # [b, h]: not one entry per token
    assert gradient_gap([pooled], [pooled], layout, None) is None
    assert gradient_gap(None, [whole], layout, None) is None
    tol = step_check_tolerance(torch.float64, "64-true")
    grads = ([part * 1.01], [whole])
    with pytest.raises(ValueError, match=r"equals one process's on the probe, but its gradient does not.*ce.detach"):
        refuse_gradient_gap(True, grads, layout, None, tol, "training_step", "the probe")
    refuse_gradient_gap(False, grads, layout, None, tol, "training_step", "the probe")  # not taken
    refuse_gradient_gap(True, grads, layout, None, tol, "training_step", "the probe", consumed=True)
    refuse_gradient_gap(True, grads, layout, None, 3e-2, "training_step", "the probe")  # half precision
    refuse_gradient_gap(True, ([part.clone()], [whole]), layout, None, tol, "training_step", "the probe")


def test_inference_tensors_are_put_back_inside_inference_mode() -> None:
    """An evaluation epoch's accumulator made under ``torch.inference_mode`` (Lightning's evaluation on NCCL), changed
    in place or rebound by the evaluation step's check inside that mode, is put back: it counts the real step alone."""
    module = nn.Linear(2, 2)
    with torch.inference_mode():
        module.acc = torch.zeros(())  # an inference tensor
        module.rebound = torch.zeros(())
        acc = module.acc
        restore = kept_attributes(module)
        module.acc += 1.0
        module.rebound = module.rebound + 1.0
        restore()
        assert module.acc is acc and float(acc) == 0.0 and float(module.rebound) == 0.0


def test_logged_values_that_differ_are_named_in_the_sharded_calls_order() -> None:
    tol = step_check_tolerance(torch.float64, "64-true")
    sharded = {("training_step", "ppl"): 3.0, ("training_step", "loss"): 1.0, ("training_step", "nan"): float("nan")}
    whole = {("training_step", "ppl"): 2.5, ("training_step", "loss"): 1.0 + tol / 2, ("training_step", "nan"): 1.0}
    whole |= {("training_step", "only_whole"): 1.0}
    assert [d.name for d in differing_logs(sharded, whole, tol)] == ["ppl", "nan"]
    assert differing_logs({("s", "n"): float("nan")}, {("s", "n"): float("nan")}, tol) == []


class PerplexityLM(LanguageModel):
    """Logs what recipes log in the step: the loss (as the tensor and as a number), a MeanMetric of it and its
    value, a learning rate, values derived from the loss and the slice (these two are this rank's), and a count of
    the slice's targets summed over the ranks (``sync_dist=True, reduce_fx="sum"``: one process's count)."""

    def __init__(self) -> None:
        super().__init__("llama-tiny")
        self.mean_loss = torchmetrics.MeanMetric()

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        loss = self.loss(batch)
        self.log("loss", loss)
        self.log("loss_item", loss.item())
        self.log("mean_loss", self.mean_loss(loss))
        self.log("lr", 1e-3)
        self.log("ppl", torch.exp(loss))
        self.log("tokens", float(batch["input_ids"].numel()))
        self.log("targets", (batch["targets"] != -100).sum())  # an integer tensor
        real = (batch["targets"] != -100).sum().to(loss.dtype)  # the slice's count, summed over the ranks: exact
        self.log("targets_summed", real, sync_dist=True, reduce_fx="sum")
        self.log("rows", loss, batch_size=batch["input_ids"].shape[0])  # the rows: alike on one group
        self.log("real", loss, batch_size=int((batch["targets"] != -100).sum()))  # the slice's targets
        tokens = int(batch["input_ids"].numel())
        return {"loss": loss, "same": loss.detach(), "extra": loss.detach() * 2, "count": tokens}  # read at batch end

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss)
        self.log("val_ppl", torch.exp(loss))
        return loss


def _fit_warned(
    rank: int, world: int, port: int, which: str, plan: str = "tp_sp"
) -> tuple[list[str], dict[str, float]]:
    """Two steps (and a validation batch after each) of :class:`PerplexityLM` (``which="logs"``) or
    :class:`RowMetricsLM` (``"metrics"``: rows of different lengths) under the strategy in float64: the check's
    warnings about them, and what was logged last."""
    strategy_environment(rank, world)
    os.environ["MASTER_PORT"] = str(port)
    pl.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(0)
    rows, length = (2, 33) if which == "logs" else (3, 41)
    batches = []
    for _ in range(2):
        x = torch.randint(0, 128, (rows, length), generator=gen)
        targets = x[:, 1:].clone()
        if which == "metrics":
            targets[0, 25:] = -100  # rows of different lengths
        batches.append({"input_ids": x[:, :-1], "targets": targets})
    strategy = ParaDySeStrategy(timeout=60, plan=plan)
    settings = dict(max_steps=2, precision="64-true", val_check_interval=1, limit_val_batches=1)
    trainer = quiet_trainer(world, strategy, [], num_sanity_val_steps=0, **settings)
    module = PerplexityLM() if which == "logs" else RowMetricsLM()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(batches, batch_size=None), DataLoader(batches[:1], batch_size=None))
    logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
    phrases = ("part of the batch", "slice of the batch") if which == "logs" else ("updates the metrics",)
    return [str(w.message) for w in caught if any(p in str(w.message) for p in phrases)], logged


def test_the_check_names_logged_values_that_are_this_ranks_own() -> None:
    """The loss logged as the tensor or as ``loss.item()``, a MeanMetric's value of it and a constant are what one
    process logs; ``torch.exp(loss)`` and a count of the slice's tokens are this rank's: named once per step hook, on
    rank 0 (the validation step's on its first batch). So are the values the step returns beside its loss (a view of
    the loss, made global, is not named)."""
    told = [warned for warned, _ in run_distributed(_fit_warned, 2, free_port(), "logs", timeout=120)]
    assert told[1] == [], told  # rank_zero_warn
    assert len(told[0]) == 3, told
    returned = next(m for m in told[0] if "returns values" in m)
    training, validation = sorted((m for m in told[0] if m != returned), key=lambda m: "validation_step" in m)
    named = returned.split("(the step check")[0]
    assert "'extra' (" in named and "'count' (18 on rank 0, 34 in one process)" in named, returned
    assert "'same' (" not in named and "'loss' (" not in named, returned  # a view of the loss is made global
    named = training.split("(the step check")[0]
    assert "'ppl' (" in named and "'tokens' (18 on rank 0, 34 in one process)" in named, training
    assert "'targets' (18 on rank 0, 34 in one process)" in named, training
    assert "'real batch_size' (18 on rank 0, 34 in one process)" in named, training
    names = ("loss", "loss_item", "mean_loss", "lr", "rows", "rows batch_size", "real", "targets_summed")
    assert not any(f"'{name}' (" in named for name in names), training
    assert "on_train_batch_end" in training, training
    named = validation.split("(the step check")[0]
    assert "'val_ppl' (" in named and "'val_loss' (" not in named, validation
    assert "on_validation_batch_end" in validation, validation


@pytest.mark.dist
def test_the_check_names_values_of_a_groups_rows() -> None:
    """Where steps may run on groups (``plan="auto"``), the check also runs the step on two parts of its rows: a
    ``batch_size=`` of the step's rows (Lightning weighs an epoch's mean by it) is named too, and what one process
    logs on every row (the loss, made global) is not."""
    told = [warned for warned, _ in run_distributed(_fit_warned, 2, free_port(), "logs", "auto", timeout=120)]
    training = next(m for m in told[0] if m.startswith("[paradyse] training_step logs"))
    named = training.split("(the step check")[0]
    assert "'rows batch_size' (1 on rank 0, 2 in one process)" in named, training
    names = ("loss", "loss_item", "mean_loss", "lr", "targets_summed")  # the count summed over the groups' ranks
    assert not any(f"'{name}' (" in named for name in names), training


class RowMetricsLM(LanguageModel):
    """Keeps what recipes keep in metrics: per-token ones (a mean of each token's loss, alone and twice in a collection
    whose members share their states, a mean of the loss), and ones a rank's slice cannot give: each row's mean loss
    (this rank's part of the row) and a sum of the loss (counted once per rank)."""

    def __init__(self) -> None:
        super().__init__("llama-tiny")
        self.token_loss = torchmetrics.MeanMetric()
        self.mean_loss = torchmetrics.MeanMetric()
        twins = {"loss_a": torchmetrics.MeanMetric(), "loss_b": torchmetrics.MeanMetric()}
        self.scores = torchmetrics.MetricCollection(twins)  # one compute group: b reads a's states
        self.row_loss = torchmetrics.MeanMetric()
        self.loss_sum = torchmetrics.SumMetric()
        self.val_row_loss = torchmetrics.MeanMetric()
        self.val_token_loss = torchmetrics.MeanMetric()

    def _losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.logits(batch)  # [b, s, vocab]
        targets = batch["targets"]  # [b, s]
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # [b, s]
        return logits, ce, targets != -100

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, ce, real = self._losses(batch)
        loss = ce.sum() / real.sum()
        self.token_loss.update(ce, weight=real.double())  # per token: the ranks' states add up
        self.mean_loss(loss)
        self.scores.update(ce, weight=real.double())
        self.row_loss.update(ce.sum(1) / real.sum(1).clamp(min=1))  # [b]: this rank's part of each row
        self.loss_sum.update(loss)  # the global loss on every rank: summed over the ranks, p times
        for name in ("token_loss", "mean_loss", "row_loss", "loss_sum"):
            self.log(name, getattr(self, name), on_step=False, on_epoch=True)
        self.log_dict(self.scores, on_step=False, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, ce, real = self._losses(batch)
        self.val_token_loss.update(ce, weight=real.double())
        self.val_row_loss.update(ce.sum(1) / real.sum(1).clamp(min=1))
        self.log("val_token_loss", self.val_token_loss)
        self.log("val_row_loss", self.val_row_loss)
        return ce.sum() / real.sum()


def test_the_check_names_metrics_whose_value_over_the_ranks_is_not_one_processs() -> None:
    """A metric updated per token (a weighted mean of each token's loss, an accuracy and a precision in a collection
    sharing their states, a mean of the loss) adds up over the ranks to one process's value; a mean of each row's
    loss (each rank's part of the row) and a sum of the loss (every rank holds the global loss) do not: named once
    per step hook, on rank 0, in the training step's and the validation step's first batch. A collection's
    members, which share their states from its first update on (a compute group), log the same value as the metric
    alone: the check's calls, whose first update formed the groups, are undone, groups included."""
    (told, logged), (told_1, _) = run_distributed(_fit_warned, 2, free_port(), "metrics", timeout=120)
    assert told_1 == [], told_1  # rank_zero_warn
    assert len(told) == 2, told
    training, validation = sorted(told, key=lambda m: "validation_step" in m)
    named = training.split(" with values")[0]
    assert "'row_loss'" in named and "'loss_sum'" in named, training
    assert not any(f"'{n}'" in named for n in ("token_loss", "mean_loss", "scores.loss_a", "scores.loss_b")), training
    named = validation.split(" with values")[0]
    assert "validation_step" in named and "'val_row_loss'" in named and "'val_token_loss'" not in named, validation
    assert logged["loss_a"] == logged["loss_b"] == logged["token_loss"], logged  # b reads a's states, updated


def test_cuts_along_the_sequence_are_told_from_cuts_of_rows() -> None:
    x = torch.zeros(3, 10)
    assert sequence_index(x, (slice(None), slice(None, 8))) == "[:, :8]"
    assert sequence_index(x, (Ellipsis, slice(1, None))) == "[:, 1:]"  # the last dimension of [b, s] is the sequence
    assert sequence_index(x, (slice(None), 0)) == "[:, 0]"
    assert sequence_index(x, (slice(None), slice(None), None)) is None  # a new dimension, the sequence whole
    assert sequence_index(x, slice(0, 2)) is None and sequence_index(x, torch.tensor([0, 2])) is None  # rows
    assert sequence_index(x, x > 0) is None  # a mask over every dimension: the real targets, per token
    assert sequence_index(torch.zeros(3, 10, 4), (Ellipsis, slice(1, None))) is None  # a feature dimension


def test_splits_into_chunks_along_the_sequence_are_told_by_their_size() -> None:
    targets, logits, shapes = torch.zeros(3, 10), torch.zeros(3, 10, 5), {(3, 10)}
    assert sequence_split(targets, (4,), {"dim": 1}, shapes) == 4
    assert sequence_split(logits, (4, -2), {}, shapes) == 4  # the logits of the batch's [b, s]
    assert sequence_split(targets, (), {"split_size_or_sections": 4, "dim": -1}, shapes) == 4  # torch.split's name
    assert sequence_split(targets, (1,), {}, shapes) is None  # rows
    assert sequence_split(targets, ([4, 6], 1), {}, shapes) is None  # sections: not one size
    assert sequence_split(torch.zeros(3, 7), (4, 1), {}, shapes) is None  # not the batch's [b, s]


def test_work_on_positions_is_told_from_work_on_rows_and_tokens() -> None:
    targets = torch.arange(30).reshape(3, 10)  # [b, s]: a tensor of the batch
    inside = [False]
    cuts = SequenceCuts({"targets": targets}, lambda: inside[0])
    with cuts:
        kept = targets.clone()
        kept[:, :4] = -100  # a prompt masked up to a position, on a clone
        (targets == 3).cumsum(1)  # a response after a separator
        torch.arange(10)  # positions of the sequence
        targets.narrow(1, 0, 5)
        torch.zeros(3, 10, 7)[:, 1:]  # the logits' shift
        kept[kept == 5] = -100  # a mask over every dimension: per token
        targets.cumsum(0), targets.narrow(0, 0, 2), torch.arange(3)  # rows; an arange of the rows' count
        inside[0] = True
        targets[:, :2]  # inside a call of the model: not the step's
    assert cuts.found == [
        "targets.clone()[:, :4] = ...",  # named after the tensor it copies
        "<a [3, 10] tensor>.cumsum(1)",
        "targets.narrow(1, 0, 5)",
        "<a [3, 10, ...] tensor>[:, 1:]",
    ]
    assert cuts.aranges == ["torch.arange(10)"]  # refused where every rank made one of its own slice's length


def test_a_floating_tensor_of_the_batch_summed_is_named_as_normalising_weights() -> None:
    weights, targets = torch.rand(3, 10, dtype=torch.float64), torch.zeros(3, 10, dtype=torch.long)
    cuts = SequenceCuts({"weights": weights, "targets": targets}, lambda: False)
    with cuts:
        weights.sum(0), (targets != -100).sum(), (weights * 2).sum()  # per position; a count; a product (unnamed)
        weights.flatten().sum()
    assert cuts.sums == ["weights.flatten().sum()"] and cuts.found == []


def _averaged(batch: Any, target: torch.Tensor, inside: bool = False, reduction: str = "mean") -> list[str]:
    """What :class:`LossCalls` given ``batch`` finds in one cross-entropy over ``target`` (a tensor the step holds)."""
    scores = torch.randn(target.numel(), 8, dtype=torch.float64)
    with LossCalls(batch, lambda: inside) as losses:
        torch.nn.functional.cross_entropy(scores, target.reshape(-1).clone(), reduction=reduction)
    return losses.found


def test_a_mean_over_targets_the_strategy_does_not_weigh_by_is_named() -> None:
    """A mean over the batch's ``tgt``, or a tuple's targets that are not its last tensor, is named with the keys the
    strategy reads (probe 16); the targets it weighs by, a sum, a loss inside the model's call (a Hugging Face model
    handed ``labels=``) and the tokens as the targets where the weighed targets hold no -100 are not."""
    ids, targets = torch.randint(0, 8, (2, 5)), torch.randint(0, 8, (2, 5))
    (found,) = _averaged({"input_ids": ids, "tgt": targets}, targets)
    assert (
        "batch's 'tgt'" in found
        and "'targets' (or 'target', 'y', 'labels'" in found
        and "share of the batch's tokens" in found
    )
    batch = (ids, targets, torch.ones_like(ids))
    assert "batch's tensor 1, but" in _averaged(batch, batch[1])[0]
    assert _averaged({"input_ids": ids, "targets": targets}, targets) == []
    assert _averaged({"input_ids": ids, "tgt": targets}, targets, inside=True) == []
    assert _averaged({"input_ids": ids, "tgt": targets}, targets, reduction="sum") == []
    assert _averaged([ids, targets], ids) == []  # a reconstruction of the tokens, every target real on both sides
    padded = targets.clone()
    padded[0, -2:] = -100
    assert "batch's tensor 0" in _averaged([ids, padded], ids)[0]


def _ruled(
    step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], vocab: int | None = None
) -> list[str]:
    """What :class:`LossCalls` finds in ``step(scores, ids, targets)`` (a batch of ids and targets, every id real)."""
    ids, targets = torch.randint(1, 8, (2, 5)), torch.randint(1, 8, (2, 5))
    scores = torch.randn(10, 8, dtype=torch.float64)
    with LossCalls({"input_ids": ids, "targets": targets}, vocab=vocab) as losses:
        step(scores, ids, targets)
    return losses.found


def test_a_mean_over_ids_a_rule_sets_apart_is_named_whatever_the_batch_holds() -> None:
    """A mean that depends on a rule setting real ids apart (a pad id compared with, in the step) is named on a batch
    holding no such id; a rule that sets only -100 apart, a comparison with other values and a rule that the loss does
    not depend on are not, nor weights a rule makes in a mean over every target, nor a rule that sets apart only ids
    past the vocabulary (a loss summed, ``loss_reduction="sum"``, is not refused: :meth:`LossCalls.refuse` runs for a
    mean loss only)."""
    ce = torch.nn.functional.cross_entropy

    def selected(scores: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return ce(scores[keep.flatten()], targets.flatten()[keep.flatten()])

    def masked_mean(scores: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        each = ce(scores, targets.flatten(), reduction="none")  # [b s]
        mask = (targets.flatten() != 0).to(each.dtype)
        return (each * mask).sum() / mask.sum()

    def set_to_ignore(scores: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = targets.clone()
        t[t == 0] = -100
        return ce(scores, t.flatten())

    def accuracy_logged(scores: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _ = (scores.argmax(-1) == targets.flatten()).double().mean(), (targets != 0).sum()  # values logged
        return ce(scores, targets.flatten())

    (found,) = _ruled(lambda sc, i, t: selected(sc, i, t, t != 0))
    assert "cross_entropy(...) averages over targets that depend on the batch's 'targets' != 0" in found
    assert "loss_reduction='sum'" in found and "targets[targets == pad_id] = -100" in found
    assert "the batch's 'targets' > 0" in _ruled(lambda sc, i, t: selected(sc, i, t, t > 0))[0]
    assert "'input_ids' != 3" in _ruled(lambda sc, i, t: selected(sc, i, t, i != 3))[0]  # the tokens' pad id
    assert (
        "torch.isin('targets', [0, 2])"
        in _ruled(lambda sc, i, t: selected(sc, i, t, ~torch.isin(t, torch.tensor([0, 2]))))[0]
    )
    assert "it divides by a count that depends on the batch's 'targets' != 0" in _ruled(masked_mean)[0]
    assert "the batch's 'targets' == 0" in _ruled(set_to_ignore)[0]
    assert _ruled(lambda sc, i, t: selected(sc, i, t, t != -100)) == []
    assert _ruled(lambda sc, i, t: selected(sc, i, t, t >= 0)) == []
    assert _ruled(lambda sc, i, t: selected(sc, i, t, (t > -math.inf) & (t < 1e12) & (t != 0.5))) == []  # no id apart
    assert _ruled(accuracy_logged) == []
    each = lambda sc, t: ce(sc, t.flatten(), reduction="none")  # noqa: E731
    # the targets the model gets wrong: a mean of the loss over them is named (scores that carry a gradient, as the
    # check's calls run the step), an accuracy computed from the same comparison (a metric's correct / total) is not
    wrong = lambda sc, t: sc.detach().argmax(-1) != t.flatten()  # noqa: E731
    graded = lambda sc, t: each(sc.requires_grad_(), t)  # noqa: E731
    with torch.enable_grad():
        mined = _ruled(lambda sc, i, t: graded(sc, t)[wrong(sc, t)].mean())
        counted = _ruled(lambda sc, i, t: (graded(sc, t) * wrong(sc, t)).sum() / wrong(sc, t).sum())
        accuracy = _ruled(lambda sc, i, t: (~wrong(sc, t)).sum() / t.numel())
        weights = _ruled(lambda sc, i, t: (graded(sc, t) * (1.0 + wrong(sc, t))).mean())  # over every target
    assert "compared with a tensor of their shape (a prediction, !=) selects" in mined[0]
    assert "divides by a count that depends on" in counted[0]
    assert accuracy == [] and weights == []
    assert (
        "averages the entries that the batch's 'targets' != 0 selects"
        in _ruled(lambda sc, i, t: each(sc, t)[(t != 0).flatten()].mean())[0]
    )
    assert _ruled(lambda sc, i, t: (each(sc, t) * (1 + (t == 5).flatten())).mean()) == []  # weights over every target
    assert _ruled(lambda sc, i, t: selected(sc, i, t, t < 8), vocab=8) == []  # no id at or past the vocabulary
    assert _ruled(lambda sc, i, t: selected(sc, i, t, t < 8)) != []  # a vocabulary not known: ids 8 on may exist
    ids, targets, mask = torch.randint(1, 8, (2, 5)), torch.randint(1, 8, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    with LossCalls({"input_ids": ids, "targets": targets, "attention_mask": mask}) as losses:  # a mask, not ids
        keep = (mask == 1).flatten()
        ce(torch.randn(10, 8, dtype=torch.float64)[keep], targets.flatten()[keep])
    assert losses.found == []
