"""``ParaDySeStrategy(groups=True)``: packed batches trained on groups of different sizes equal one process.

Four processes train an unmodified LightningModule on packed batches (documents of 6-150 tokens, positions
restarting per document). Each step splits the ranks into groups (sizes 1, 2 and 4 at once) and the
documents among them. One run forces a different split every step (the splits are dealt by the test: the
equivalence must hold whatever the solver picks); one run lets the solver choose on the measured cost model.
Both must match a single-process run of the same strategy (document-aware attention, no groups) step by
step in loss and in every final weight, with AdamW and gradient accumulation, in float64 to the exact harness's
1e-9 (in float32, AdamW's division by ``sqrt(v)`` scaled the rounding noise of gradient entries near zero up to a
tenth of a step: a split that sums in another order landed on either side of any loose tolerance).
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_paradyse import ParaDySeStrategy, ParaDySeSwitcher
from lightning_paradyse.data.batching import pack_documents
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.groups.solver import Assignment
from lightning_paradyse.models import build_model
from lightning_paradyse.runtime import parallel
from tests.exact.harness import TOL
from tests.lightning.test_strategy import assert_same_training
from tests.support.dist import free_ports
from tests.support.lightning import quiet_trainer, strategy_environment

SPLITS = [(2, 1, 1), (4,), (1, 1, 1, 1), (2, 2), (2, 1, 1), (2, 2)]
"""The forced split of each step (largest group first)."""


class PackedLM(pl.LightningModule):
    """An ordinary LightningModule for packed batches: positions from the batch, mean token cross-entropy, each
    document on its own where the model is not parallelized (one process keeps the documents apart too:
    ``keeps_documents_apart``)."""

    keeps_documents_apart = True

    def __init__(self) -> None:
        super().__init__()
        self.model = build_model("llama-tiny")

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = parallel.run_documents(self.model, batch["input_ids"], batch["positions"], batch["doc_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())  # logits [1, s_r, vocab]

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def packed_batches(steps: int = 6) -> list[dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        n = int(torch.randint(4, 8, (1,), generator=gen))
        lengths = [int(x) for x in torch.randint(6, 150, (n,), generator=gen)]
        out.append(pack_documents([torch.randint(0, 128, (k,), generator=gen) for k in lengths]))
    return out


class Record(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.splits: list[tuple[int, ...]] = []
        self.imbalance: list[tuple[float, float]] = []
        self.state: dict[str, Tensor] = {}
        self.exchanges = 0
        self.warmed = 0
        self.modes: dict[int, tuple[str, ...]] = {}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        switcher = next(cb for cb in trainer.callbacks if isinstance(cb, ParaDySeSwitcher))  # type: ignore[attr-defined]
        metrics = switcher.metrics
        if "groups/count" in metrics:
            self.splits.append((int(metrics["groups/count"]), int(metrics["groups/own_size"])))
        if "groups/measured_imbalance" in metrics:  # measured where the gradients return: micro-batches that step
            self.imbalance.append(
                (float(metrics["groups/predicted_imbalance"]), float(metrics["groups/measured_imbalance"]))
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        self.state = {k: v.detach().clone() for k, v in strategy.lightning_module_state_dict().items()}
        self.exchanges = strategy.cycle.runner.exchanges  # type: ignore[attr-defined]
        self.warmed = strategy.cycle.runner.warmed[0]  # type: ignore[attr-defined]
        runner = strategy.cycle.runner  # type: ignore[attr-defined]
        if runner.ready:  # steps on groups: every group size has a planner
            self.modes = {g: tuple(runner.planner_for(g).modes) for g in (1, 2, trainer.world_size)}


def dealt(lengths: Any, world: int, cost: Any, **kwargs: Any) -> Assignment:
    """The test's split for the next step: ``SPLITS`` in turn, documents dealt round robin."""
    splits = dealt.splits  # type: ignore[attr-defined]
    sizes = splits[dealt.calls % len(splits)]  # type: ignore[attr-defined]
    dealt.calls += 1  # type: ignore[attr-defined]
    members: list[list[int]] = [[] for _ in sizes]
    for i in range(len(lengths)):
        members[i % len(sizes)].append(i)
    times = tuple(float(cost(tuple(lengths[i] for i in m), g)) for m, g in zip(members, sizes))
    return Assignment(sizes, tuple(tuple(m) for m in members), times)


dealt.calls = 0  # type: ignore[attr-defined]
dealt.splits = SPLITS  # type: ignore[attr-defined]


def fit(devices: int, groups: bool, accumulate: int = 1) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    record = Record()
    strategy = ParaDySeStrategy(groups=groups, timeout=60)
    with tempfile.TemporaryDirectory() as logs:
        trainer = quiet_trainer(
            devices,
            strategy,
            [record],
            max_steps=6 // accumulate,
            accumulate_grad_batches=accumulate,
            logger=CSVLogger(logs),
            log_every_n_steps=2,
            precision="64-true",
        )
        trainer.fit(PackedLM(), train_dataloaders=DataLoader(packed_batches(), batch_size=None))
        pictures = sorted(p.name for p in Path(logs).rglob("paradyse_steps.*"))
        logged = [p.read_text().splitlines() for p in Path(logs).rglob("metrics.csv")]
    out = {"losses": record.losses, "state": record.state, "imbalance": record.imbalance, "splits": record.splits}
    out["exchanges"], out["warmed"], out["modes"] = record.exchanges, record.warmed, record.modes
    return out | {"pictures": pictures, "logged": logged}


def worker(rank: int, world: int, ports: tuple[int, ...]) -> bytes:
    import lightning_paradyse.groups.solver as solver

    strategy_environment(rank, world)
    out = {}
    os.environ["MASTER_PORT"] = str(ports[0])  # one free port per Trainer (each creates and destroys a group)
    out["solver"] = fit(world, True)
    from lightning_paradyse.groups import runner as runner_module

    real, kept = solver.assign, runner_module.DECISIONS_KEPT
    solver.assign, runner_module.DECISIONS_KEPT = dealt, 0  # type: ignore[assignment]  # every step dealt anew
    try:
        os.environ["MASTER_PORT"] = str(ports[1])
        out["dealt"] = fit(world, True)
        os.environ["MASTER_PORT"] = str(ports[2])
        out["dealt-accumulate"] = fit(world, True, accumulate=2)
        dealt.splits = [(1,) * world]  # type: ignore[attr-defined]  # every micro-batch data parallel
        os.environ["MASTER_PORT"] = str(ports[3])
        out["kept-accumulate"] = fit(world, True, accumulate=2)
    finally:
        solver.assign, runner_module.DECISIONS_KEPT = real, kept
        dealt.splits = SPLITS  # type: ignore[attr-defined]
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, Any]]:
    return {"plain": fit(1, False), "accumulate": fit(1, False, accumulate=2)}


def grouped_steps(lines: list[str]) -> list[int]:
    """The global steps of a ``metrics.csv`` (its lines) whose row has the groups' numbers."""
    header = lines[0].split(",")
    column, step = header.index("groups/count"), header.index("step")
    return [int(row.split(",")[step]) for row in lines[1:] if row.split(",")[column]]


def test_groups_of_different_sizes_train_like_one_process(reference: dict[str, dict[str, Any]]) -> None:
    raw = run_distributed(worker, 4, free_ports(4), timeout=420)
    runs = [torch.load(io.BytesIO(r), weights_only=False) for r in raw]
    for name, run in runs[0].items():
        ref = reference["accumulate" if "accumulate" in name else "plain"]
        assert_same_training(run, ref, f"groups/{name}", tolerances=(TOL, TOL))
        assert all(other[name]["losses"] == run["losses"] for other in runs), f"{name}: ranks report other losses"
    print("solver's splits (groups, rank 0's group size):", runs[0]["solver"]["splits"])
    assert runs[0]["solver"]["warmed"] > 0  # the cost planners of every group size planned short shapes at setup
    modes = runs[0]["solver"]["modes"]  # a group of one plans tp_sp and metp (single_rank_modes), larger ones all
    assert set(modes[1]) == {"tp_sp", "metp"} and len(modes[2]) == 4 and modes[4] == modes[2], modes
    dealt_run = runs[0]["dealt"]
    assert [count for count, _ in dealt_run["splits"]] == [len(s) for s in SPLITS]
    # measured (predicted and measured) on the fit's first steps until the fixed part's estimate settles (optimizer
    # steps 2 and 3: step 1 runs the step check) and on the steps the logger logs (every 2: 2, 4, 6)
    assert len(dealt_run["imbalance"]) == 4, dealt_run["imbalance"]
    assert all(pred >= 1.0 and meas >= 1.0 for pred, meas in dealt_run["imbalance"])
    assert dealt_run["pictures"] == ["paradyse_steps.csv", "paradyse_steps.svg"]  # rank 0, in the logger's folder
    (lines,) = dealt_run["logged"]  # the logger's metrics, every log_every_n_steps=2 steps
    header = lines[0].split(",")
    assert {
        "step",
        "plan/measured_time_s",
        "plan/predicted_fixed_s",
        "plan/predicted_scale",
        "groups/count",
        "groups/measured_imbalance",
        "groups/predicted_time_s",  # seconds: the planners have a cost model (else groups/predicted_flops)
    } <= set(header), header
    fixed = [float(row.split(",")[header.index("plan/predicted_fixed_s")] or 0) for row in lines[1:]]
    assert fixed and fixed[-1] > 0, fixed  # the step's unpriced part, measured on the steps before
    scales = [float(row.split(",")[header.index("plan/predicted_scale")] or 0) for row in lines[1:]]
    assert all(s > 0 for s in scales), scales  # measured over predicted priced part of such steps (1 at first)
    steps = grouped_steps(lines)
    assert steps == [1, 3, 5], steps  # optimizer steps 2, 4, 6: at Lightning's step of the batch's own logs
    assert len(runs[0]["dealt-accumulate"]["imbalance"]) == 2  # the micro-batches that step, optimizer steps 2 and 3
    assert runs[0]["kept-accumulate"]["exchanges"] == 3  # 6 micro-batches, 3 optimizer steps: one gather each
    assert runs[0]["dealt-accumulate"]["exchanges"] == 6  # every micro-batch split differently
    (lines,) = runs[0]["dealt-accumulate"]["logged"]  # micro-batches share a global step: written once
    steps = grouped_steps(lines)
    assert steps == sorted(set(steps)) and 1 in steps, steps  # optimizer step 2 at Lightning's step 1


def test_a_batch_seen_before_takes_its_kept_split() -> None:
    """The solver runs once per distinct batch (its units' lengths, packed or not); the run keeps the last
    :data:`DECISIONS_KEPT` and searches the older ones again."""
    from lightning_paradyse.groups import runner as runner_module
    from lightning_paradyse.groups.runner import GroupRunner
    from lightning_paradyse.groups.units import Units

    runner = GroupRunner(plan_bucket=512, on_infeasible="raise")
    solved: list[tuple[bool, tuple[int, ...]]] = []

    def units(lengths: tuple[int, ...], packed: bool = False) -> Units:
        return Units(packed, lengths, tuple((0, n) for n in lengths), len(lengths), max(lengths))

    def solver_for(u: Units) -> Any:
        def solve() -> Assignment:
            solved.append((u.packed, u.lengths))
            return Assignment((1, 1), ((0,), tuple(range(1, len(u.lengths)))), (1.0, 1.0))

        return solve

    first = units((5, 3, 3))
    found = runner._assign(first, solver_for(first))
    assert runner._assign(units((5, 3, 3)), solver_for(first)) is found  # seen before: kept
    runner._assign(units((5, 3, 3), packed=True), solver_for(units((5, 3, 3), packed=True)))
    runner._assign(units((3, 5, 3)), solver_for(units((3, 5, 3))))  # another order: other indices
    assert solved == [(False, (5, 3, 3)), (True, (5, 3, 3)), (False, (3, 5, 3))]
    for n in range(runner_module.DECISIONS_KEPT):  # the first batch falls out of the kept ones
        runner._assign(units((n + 10,)), solver_for(units((n + 10,))))
    solved.clear()
    runner._assign(first, solver_for(first))
    assert solved == [(False, (5, 3, 3))]
    runner.teardown()
    assert not runner._found
