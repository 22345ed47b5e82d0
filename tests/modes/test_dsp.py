"""Dimension switching (DSP) on the spatial-temporal reference model equals one process, and moves less.

The model (``lightning_paradyse.models.spatial_temporal``) alternates spatial and temporal attention blocks over a
grid of frames x patches; it is parallelized unmodified with ``axes=2``. The batch is split along the frames. Plans:
every block ``dsp`` (the shard moves between the axes with one all-to-all), the sequence modes on the blocks
that attend along the sharded axis (``ulysses``, ``ring``, ``tp_sp``: spatial blocks run locally), and mixed
plans with recomputation. Loss and every gradient must match a single process at p = 2, 3 (uneven chunks)
and 4. The communication test counts the all-to-all bytes of ``dsp`` against ``ulysses`` on the same step.
"""

from __future__ import annotations

import copy
import io
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.distributed.comm import CommCounter, all_reduce_sum, move_shard
from lightning_paradyse.distributed.layout import SeqLayout, split_sizes
from lightning_paradyse.models.spatial_temporal import SpatialTemporalTransformer, STConfig
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime.parallel import (
    configure,
    consolidated,
    dispatchers,
    parallelize,
    reduce_replicated_grads,
)
from lightning_paradyse.tools.mode_check import grad_errors, tolerance_failures
from tests.lightning.test_strategy import assert_same_training, free_port
from tests.support.dist import run_distributed
from tests.support.lightning import quiet_trainer, strategy_environment

CONFIG = STConfig(vocab_size=64, n_layers=4, hidden=48, n_heads=12, ffn=96, max_frames=32, max_patches=32)


def _plan(*ops: tuple[str, str, bool]) -> Plan:
    return Plan(tuple(LayerPlan(OpPlan(a, rc), OpPlan(m, rc)) for a, m, rc in ops))


PLANS = {
    "dsp": _plan(*[("dsp", "dsp", False)] * 4),
    "dsp+rc": _plan(*[("dsp", "dsp", True)] * 4),
    "ulysses": _plan(*[("ulysses", "ulysses", False)] * 4),
    "ring": _plan(*[("ring", "ring", False)] * 4),
    "tp_sp-attention": _plan(*[("tp_sp", "dsp", False)] * 4),
    "mixed": _plan(("dsp", "ulysses", False), ("ring", "dsp", True), ("dsp", "ring", False), ("dsp", "dsp", True)),
    "mixed-2": _plan(
        ("ulysses", "dsp", False), ("dsp", "ring", False), ("ring", "dsp", True), ("ulysses", "dsp", False)
    ),
}


def _loss(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    logits = model(tokens, positions)  # [b, t, s, vocab]
    return F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="sum")


def _worker(rank: int, world: int, frames: int, patches: int) -> dict[str, Any]:
    group = dist.group.WORLD
    torch.manual_seed(0)
    plain = SpatialTemporalTransformer(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, frames, patches))
    targets = torch.randint(0, CONFIG.vocab_size, (2, frames, patches))
    count = targets.numel()
    reference = copy.deepcopy(plain)
    ref_loss = _loss(reference, tokens, targets, torch.arange(frames)) / count
    ref_loss.backward()
    ref_grads = {n: w.grad for n, w in reference.named_parameters() if w.grad is not None}
    template = copy.deepcopy(plain)
    parallelize(template, group, axes=2)
    axes = [op.attend_axis for _, op in dispatchers(template) if hasattr(op, "attend_axis")]
    assert axes == [2, 1, 2, 1], axes  # spatial, temporal, spatial, temporal: read off the blocks
    layout = SeqLayout.for_sequence(frames, world, causal=False)
    results: list[tuple[str, Any]] = []
    traffic: dict[str, dict[str, float]] = {}
    for name, plan in PLANS.items():
        model = copy.deepcopy(template)
        configure(model, SeqContext(layout, group), plan)
        with CommCounter() as counter:
            local = _loss(model, layout.shard(tokens, rank), layout.shard(targets, rank), layout.positions(rank))
            loss = local / count
            loss.backward()
        reduce_replicated_grads(model, group)
        total = all_reduce_sum(loss.detach(), group)
        errors = grad_errors(consolidated(model, group, grads=True), ref_grads)
        results.append((f"p={world} {frames}x{patches} {name}", (float(abs(total - ref_loss) / ref_loss), errors)))
        traffic[name] = dict(counter.bytes)
    return {"results": results, "traffic": traffic}


def _move_shard_roundtrip(rank: int, world: int) -> bool:
    """``move_shard`` there and back is the identity; its gradient is the reverse move (uneven chunks)."""
    group = dist.group.WORLD
    torch.manual_seed(1)
    whole = torch.randn(2, 7, 5, 3, dtype=torch.float64)  # [b, T, S, h]
    t_sizes, s_sizes = split_sizes(7, world), split_sizes(5, world)
    mine = whole.narrow(1, sum(t_sizes[:rank]), t_sizes[rank]).clone().requires_grad_()
    moved = move_shard(mine, 1, 2, t_sizes, group)  # [2, 7/p, 5, 3] -> [2, 7, 5/p, 3]
    assert torch.equal(moved, whole.narrow(2, sum(s_sizes[:rank]), s_sizes[rank]))
    back = move_shard(moved, 2, 1, s_sizes, group)
    assert torch.equal(back, mine)
    weight = torch.arange(moved.numel(), dtype=torch.float64).view_as(moved)
    (moved * weight).sum().backward()
    expected = move_shard(weight, 2, 1, s_sizes, group)
    assert mine.grad is not None and torch.equal(mine.grad, expected)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_move_shard_roundtrip(world: int) -> None:
    assert all(run_distributed(_move_shard_roundtrip, world, timeout=60))


@pytest.mark.parametrize(("world", "frames", "patches"), [(2, 8, 6), (3, 7, 5), (4, 8, 12)])
def test_dimension_switching_matches_single_process(world: int, frames: int, patches: int) -> None:
    out = run_distributed(_worker, world, frames, patches, timeout=240)[0]
    assert len(out["results"]) == len(PLANS)
    bad = tolerance_failures(out["results"], torch.float32)
    assert not bad, "\n".join(bad)
    if world == 4:  # DSP moves at most half the activation bytes of Ulysses (same weights traffic)
        dsp, uly = out["traffic"]["dsp"], out["traffic"]["ulysses"]
        assert 0 < dsp["all_to_all"] <= 0.5 * uly["all_to_all"], (dsp, uly)
        assert dsp.get("all_gather", 0) == uly.get("all_gather", 0)


# ---------------------------------------------------------------------------------------------- through Lightning


class GridLM(pl.LightningModule):
    """An ordinary LightningModule around the spatial-temporal model: mean cross-entropy per grid token."""

    def __init__(self) -> None:
        super().__init__()
        self.model = SpatialTemporalTransformer(CONFIG)

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self.model(batch["tokens"])  # [b, T/p, S, vocab] on this rank's frames
        return F.cross_entropy(logits.flatten(0, 2), batch["targets"].flatten())

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)  # key biases: Adam would amplify noise


def grid_batches() -> list[dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(5)
    shapes = [(2, 6, 6), (1, 10, 6), (2, 8, 6), (1, 7, 6)]  # frames vary; 7 frames split unevenly
    return [
        {"tokens": torch.randint(0, 64, s, generator=gen), "targets": torch.randint(0, 64, s, generator=gen)}
        for s in shapes
    ]


def fit_grid(devices: int, strategy: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    out: dict[str, Any] = {"losses": [], "plans": []}

    class Record(pl.Callback):
        @override
        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *a: Any) -> None:
            out["losses"].append(float(outputs["loss"]))

        @override
        def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            state = trainer.strategy.lightning_module_state_dict()
            out["state"] = {k: v.detach().clone() for k, v in state.items()}
            switcher = [cb for cb in trainer.callbacks if hasattr(cb, "history")]  # type: ignore[attr-defined]
            out["plans"] = [str(r.plan) for r in switcher[0].history] if switcher else []

    trainer = quiet_trainer(devices, strategy, [Record()], max_steps=4, precision="64-true")  # compared to 1e-9
    trainer.fit(GridLM(), train_dataloaders=DataLoader(grid_batches(), batch_size=None))
    return out


def grid_worker(rank: int, world: int, port: int) -> bytes:
    strategy_environment(rank, world)
    out = {}
    for k, plan in enumerate(["auto", "ulysses"]):
        os.environ["MASTER_PORT"] = str(port + k)
        out[plan] = fit_grid(world, ParaDySeStrategy(axes=2, plan=plan, timeout=60))
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def test_strategy_trains_the_grid_model_like_one_process() -> None:
    reference = fit_grid(1, "auto")
    raw = run_distributed(grid_worker, 2, free_port(), timeout=240)
    runs = torch.load(io.BytesIO(raw[0]), weights_only=False)
    for name, run in runs.items():
        assert_same_training(run, reference, f"axes=2 plan={name}")
    assert "dsp" in runs["auto"]["plans"][0]  # the planner switches dimensions on this model
    with pytest.raises(ValueError, match="axes=3"):
        ParaDySeStrategy(axes=3)
