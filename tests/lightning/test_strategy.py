"""ParaDySeStrategy against single-process Lightning training, on 2 and 3 CPU processes (gloo).

An ordinary LightningModule (no knowledge of parallelism) wrapping the reference Llama or GPT trains
for several steps on batches of varying length, under fixed mixed plans and under per-batch plan
switching. Its per-step losses and final weights are compared with a single-process ``Trainer`` run
(``devices=1``, the plain model, the same data and seed), both in float64 (``precision="64-true"``): losses within
1e-9 relative, weights within 1e-9 relative to each tensor's largest entry (the parallel run sums in another order:
float64 rounds at 1e-16; float32's rounding, which AdamW scales up near zero gradient entries, would need a loose
tolerance that flakes). Hugging Face models train in float32 with SGD here (their loss upcasts to float32); they are
compared in float64 in tests/exact.

Multi-process runs come in two kinds:

* the strategy's own spawn launcher (``Trainer(devices=2)`` from the test), asserting inside the
  workers and checking only ``trainer.state.finished`` (and the weights handed back) in the parent;
* a spawned harness whose processes run several Trainers one after the other (the strategy then
  launches nothing, as under torchrun), so one spawn covers many scenarios: fixed and switching plans,
  checkpoint save and resume with another plan and mode set, and the error cases, which must be
  raised identically on every rank before any collective.
"""

from __future__ import annotations

import gc
import io
import os
import re
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

import lightning_paradyse.lightning.strategy as strategy_module
from lightning_paradyse import ParaDySeStrategy, ParaDySeSwitcher
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.lightning.callbacks import plan_digest
from lightning_paradyse.lightning.strategy import compile_blocks
from lightning_paradyse.models import build_model
from lightning_paradyse.modes.plan import uniform_plan
from lightning_paradyse.planning.fixed import ThresholdPolicy, parse_memory_budget
from lightning_paradyse.runtime.slicing import BatchInfo, find_targets, find_tokens, shard_batch
from tests.support.dist import free_port
from tests.support.families import EncoderLM, hf_llama
from tests.support.lightning import quiet_trainer, strategy_environment

ROOT = Path(__file__).resolve().parents[2]
THRESHOLDS = (64, 160)
"""Short <= 64 < middle <= 160 < long: the lengths below cross both."""
LENGTHS = (40, 150, 300, 90, 200, 60)
"""One epoch of six batches of these lengths; (3 + 3) when a checkpoint is taken after the first epoch."""
LOSS_TOL, WEIGHT_TOL = 1e-9, 1e-9
"""float64 runs: loss relative error, weights relative to each tensor's largest entry."""
FLOAT32_TOL = (1e-5, 1e-3)
"""float32 runs (Hugging Face, SGD): loss, weights (SGD does not scale the rounding of near-zero gradients up)."""
MIXED_2 = ["tp_sp", {"attention": "ring", "mlp": "metp", "recompute": True}]
MIXED_3 = ["ulysses", {"attention": {"mode": "metp", "recompute": True}, "mlp": "tp_sp"}]
MIXED_TEL = [{"attention": "metp", "mlp": "ring"}, {"attention": "ulysses", "mlp": "tp_sp", "recompute": True}]
"""nn.TransformerEncoderLayer computes its MLP inline: tp_sp, ulysses or ring for it (metp runs its attention)."""
MIXED_HF3 = [{"attention": "ring", "mlp": "metp"}, {"attention": "ring", "mlp": "tp_sp", "recompute": True}]
"""Hugging Face Llama with 4 kv heads on 3 ranks: only ring runs its attention."""


# ---------------------------------------------------------------------------------------------- test module, data


class TinyLM(pl.LightningModule):
    """An ordinary LightningModule: mean token cross-entropy of a reference model, no parallel code."""

    def __init__(self, model: str = "llama-tiny", optimizer: str = "adamw", reduction: str = "mean") -> None:
        super().__init__()
        self.model = EncoderLM(causal=True) if model == "tel" else build_model(model)
        self.optimizer, self.reduction = optimizer, reduction

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, targets = (batch["input_ids"], batch["targets"]) if isinstance(batch, dict) else batch
        logits = self.model(tokens)  # [b, s_r, vocab] on this rank's tokens
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=self.reduction)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.training_step(batch, batch_idx)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":  # key biases (GPT, TEL): Adam would amplify the rounding noise of their zero grads
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class HFLM(pl.LightningModule):
    """An ordinary LightningModule around Hugging Face ``LlamaForCausalLM``, trained with ``labels`` it shifts."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.model = hf_llama(n_kv_heads=4)
        self.optimizer = optimizer

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss  # type: ignore[no-any-return]

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class LengthData(Dataset[Any]):
    """Item ``i`` is a whole batch of 2 sequences of ``lengths[i]`` tokens (targets shifted by one).

    ``drop``: items left out (the others keep their contents), for a reference that never saw them.
    """

    def __init__(
        self,
        lengths: tuple[int, ...],
        as_dict: bool = False,
        seed: int = 0,
        hf: bool = False,
        drop: tuple[int, ...] = (),
    ) -> None:
        self.lengths, self.as_dict, self.seed, self.hf = lengths, as_dict, seed, hf
        self.items = [i for i in range(len(lengths)) if i not in drop]

    @override
    def __len__(self) -> int:
        return len(self.items)

    @override
    def __getitem__(self, index: int) -> Any:
        i = self.items[index]
        gen = torch.Generator().manual_seed(self.seed * 1000 + i)
        window = torch.randint(0, 128, (2, self.lengths[i] + 1), generator=gen)
        tokens, targets = window[:, :-1], window[:, 1:].clone()
        targets[0, -3:] = -100  # a few tokens without a target: the global count is not b * s
        if self.hf:  # Hugging Face convention: labels are the tokens, the model shifts them
            labels = tokens.clone()
            labels[1, :4] = -100
            return {"input_ids": tokens, "labels": labels}
        return {"input_ids": tokens, "targets": targets} if self.as_dict else (tokens, targets)


def loader(
    lengths: tuple[int, ...] = LENGTHS,
    as_dict: bool = False,
    sampler: str = "fixed",
    hf: bool = False,
    drop: tuple[int, ...] = (),
) -> DataLoader[Any]:
    """A loader of whole batches.

    ``fixed``: an explicit ``DistributedSampler(num_replicas=1, rank=0, shuffle=False)``: every epoch in the same
    order, so resuming from a checkpoint continues exactly. ``plain``: a plain loader; the strategy injects no
    sampler, so every rank (and a single-process run) iterates it in the same order.
    """
    data = LengthData(lengths, as_dict, hf=hf, drop=drop)
    if sampler == "plain":
        return DataLoader(data, batch_size=None)
    sampler_ = DistributedSampler(data, num_replicas=1, rank=0, shuffle=False, seed=0)
    return DataLoader(data, batch_size=None, sampler=sampler_)


class Recorder(pl.Callback):
    """Per-step global losses, the final consolidated weights, and (checked across ranks) the plans."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.plans: list[str] = []
        self.state: dict[str, Tensor] = {}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, ParaDySeStrategy):
            self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            return
        self.state = {k: v.detach().clone() for k, v in strategy.lightning_module_state_dict().items()}
        switcher = next(cb for cb in trainer.callbacks if isinstance(cb, ParaDySeSwitcher))  # type: ignore[attr-defined]
        records = [r for r in switcher.history if r.stage == "train"]
        self.plans = [str(r.plan) for r in records]
        mine = torch.tensor([plan_digest(r.plan, r.seq_len) for r in records])
        every = strategy.all_gather(mine)  # [world, steps]
        assert (every == mine).all(), f"ranks executed different plans: {every.tolist()}"


class SaveOnRankZero(Recorder):
    """A :class:`Recorder` that writes its results to a file from rank 0 (for the spawn launcher)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.is_global_zero:
            torch.save({"losses": self.losses, "state": self.state, "plans": self.plans}, self.path)


# ---------------------------------------------------------------------------------------------- running scenarios


@dataclass(frozen=True)
class Scenario:
    """One Trainer run: a model, a strategy configuration, data; optionally a checkpoint or an expected error."""

    name: str
    model: str = "llama-tiny"
    optimizer: str = "adamw"
    lengths: tuple[int, ...] = LENGTHS
    plan: Any = "auto"
    modes: tuple[str, ...] | None = None
    max_seq_len: int | None = None
    ckpt_dir: str | None = None
    resume: str | None = None
    expect_error: str | None = None
    reduction: str = "mean"
    precision: str = "64-true"
    """The Trainer's precision (both runs of a comparison alike)."""
    drop: tuple[int, ...] = ()
    """Items of ``lengths`` the run never sees (a reference for a run that skips them)."""
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)


def run_scenario(sc: Scenario, devices: int, parallel: bool = True) -> dict[str, Any]:
    """Fit ``sc`` on ``devices`` processes (this process is one of them); the plain model when not ``parallel``."""
    pl.seed_everything(0, verbose=False)
    module = HFLM(sc.optimizer) if sc.model == "hf-llama" else TinyLM(sc.model, sc.optimizer, sc.reduction)
    recorder = Recorder()
    callbacks: list[pl.Callback] = [recorder]
    if sc.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=sc.ckpt_dir, filename="{step}", save_top_k=-1, every_n_train_steps=3))
    strategy: Any = "auto"
    if parallel:
        thresholds = THRESHOLDS if sc.plan == "auto" else None  # a fixed plan's run would warn them unused
        kwargs = {"plan": sc.plan, "modes": sc.modes, "thresholds": thresholds, "max_seq_len": sc.max_seq_len}
        kwargs.update(sc.strategy_kwargs)
        strategy = ParaDySeStrategy(**kwargs, timeout=60, loss_reduction=sc.reduction)
    trainer = quiet_trainer(
        devices,
        strategy,
        callbacks,
        enable_checkpointing=bool(sc.ckpt_dir),
        **{"max_steps": 6, "precision": sc.precision, **sc.trainer_kwargs},
    )
    try:
        data = loader(sc.lengths, hf=sc.model == "hf-llama", drop=sc.drop)
        trainer.fit(module, train_dataloaders=data, ckpt_path=sc.resume)
    except Exception as err:
        if sc.expect_error is not None and sc.expect_error in str(err):
            return {"error": str(err)}
        raise
    assert sc.expect_error is None, f"{sc.name}: expected an error containing {sc.expect_error!r}"
    skipped = trainer.strategy.skipped_batches if isinstance(trainer.strategy, ParaDySeStrategy) else 0
    planner = type(getattr(trainer.strategy, "planner", None)).__name__
    out = {"losses": recorder.losses, "state": recorder.state, "plans": recorder.plans, "skipped": skipped}
    return {**out, "planner": planner}


def scenario_worker(rank: int, world: int, scenarios: list[Scenario], base_port: int) -> bytes:
    """Run every scenario in turn on this rank; each Trainer creates (and destroys) its own process group, all on
    ``base_port``, where the strategy keeps one store for the process (``distributed/rendezvous.py``).

    Returns the results serialised (tensors in a queue would be shared memory the exiting worker takes along).
    """
    strategy_environment(rank, world)
    os.environ["MASTER_PORT"] = str(base_port)
    out = {}
    for sc in scenarios:
        result = run_scenario(sc, world)
        if rank != 0:
            result.pop("state", None)  # the same consolidated weights on every rank
        out[sc.name] = result
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def run_scenarios(world: int, scenarios: list[Scenario]) -> list[dict[str, Any]]:
    """Every rank's results of :func:`scenario_worker` on ``world`` spawned processes."""
    raw = run_distributed(scenario_worker, world, scenarios, free_port(), timeout=240)
    return [torch.load(io.BytesIO(r), weights_only=False) for r in raw]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def assert_same_training(
    got: dict[str, Any],
    ref: dict[str, Any],
    name: str,
    steps: slice = slice(None),
    tolerances: tuple[float, float] = (LOSS_TOL, WEIGHT_TOL),
) -> None:
    """Per-step losses and every final weight within ``tolerances`` (loss, weight; float64's by default) of the
    reference."""
    losses, ref_losses = got["losses"], ref["losses"][steps]
    assert len(losses) == len(ref_losses), f"{name}: {len(losses)} steps, reference {len(ref_losses)}"
    errs = [rel(a, b) for a, b in zip(losses, ref_losses)]
    assert max(errs) <= tolerances[0], f"{name}: loss relative errors {errs} (losses {losses} vs {ref_losses})"
    assert_same_weights(got["state"], ref["state"], name, tolerances[1])


def assert_same_weights(state: dict[str, Tensor], ref: dict[str, Tensor], name: str, tol: float = WEIGHT_TOL) -> None:
    assert set(state) == set(ref), f"{name}: state keys differ: {sorted(set(state) ^ set(ref))}"
    for key, value in ref.items():
        err = float((state[key].double() - value.double()).abs().max() / value.double().abs().max().clamp_min(1e-6))
        assert err <= tol, f"{name}: {key} differs from the single-process run (relative error {err:.2e})"


SUM_ACCUMULATE = Scenario(
    "llama-sum-accumulate", reduction="sum", trainer_kwargs={"accumulate_grad_batches": 2, "max_steps": 3}
)
"""A summed loss (``loss_reduction="sum"``) and gradient accumulation over 2 batches (3 optimizer steps)."""
HF = Scenario(
    "hf-llama",
    model="hf-llama",
    optimizer="sgd",
    lengths=LENGTHS[:4],
    precision="32-true",
    trainer_kwargs={"max_steps": 4},
)
"""SGD: in float32, AdamW scales HF's rounding noise (its loss upcasts to float32) past the weight tolerance; AdamW
on HF models is compared in float64, to 1e-9, in tests/exact."""
HF_SGD = Scenario(
    "hf-mixed",
    model="hf-llama",
    optimizer="sgd",
    lengths=LENGTHS[:4],
    plan=MIXED_HF3,
    precision="32-true",
    trainer_kwargs={"max_steps": 4},
)
"""Hugging Face Llama with ``labels``: the model gets the globally shifted labels, its loss is not rescaled."""
PROFILE = str(Path(__file__).resolve().parents[2] / "configs" / "profiles" / "cpu-2proc-llama-tiny.json")
SKIP_LENGTHS = (40, 300, 150, 90)
SKIP = Scenario(
    "llama-skip",
    lengths=SKIP_LENGTHS,
    strategy_kwargs={"profile": PROFILE, "memory_budget": 7_200_000, "on_infeasible": "skip"},
    trainer_kwargs={"max_steps": 4},
)
"""The cost planner with a budget (twice float32's 3.6 MB: every byte doubles in float64) that no plan for 2 x 300
tokens fits and one for 2 x 150 does: that batch is skipped on every rank, the others train as if it never
existed."""
SKIP_REF = Scenario("ref-skip", lengths=SKIP_LENGTHS, drop=(1,), trainer_kwargs={"max_steps": 3})


@pytest.fixture(autouse=True)
def _no_inherited_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The spawn launcher exports MASTER_PORT in the parent; every test picks a fresh one."""
    for var in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    yield


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Single-process runs (devices=1, plain model, default strategy) of Llama (AdamW) and GPT (SGD)."""
    ckpt = str(tmp_path_factory.mktemp("ref_ckpt"))
    llama = run_scenario(Scenario("ref-llama", lengths=LENGTHS[:3], ckpt_dir=ckpt), devices=1, parallel=False)
    llama["step3"] = torch.load(Path(ckpt) / "step=3.ckpt", weights_only=False)["state_dict"]
    gpt = run_scenario(Scenario("ref-gpt", model="gpt-tiny", optimizer="sgd"), devices=1, parallel=False)
    llama6 = run_scenario(Scenario("ref-llama6"), devices=1, parallel=False)
    summed = run_scenario(SUM_ACCUMULATE, devices=1, parallel=False)
    hf = run_scenario(HF, devices=1, parallel=False)
    tel = run_scenario(Scenario("ref-tel", model="tel", optimizer="sgd"), devices=1, parallel=False)
    hf_sgd = run_scenario(HF_SGD, devices=1, parallel=False)
    skip = run_scenario(SKIP_REF, devices=1, parallel=False)
    return {
        **{"llama3x2": llama, "gpt": gpt, "llama": llama6, "sum": summed, "hf": hf, "tel": tel, "hf-sgd": hf_sgd},
        "skip": skip,
    }


@pytest.fixture(scope="module")
def plain_reference() -> dict[str, Any]:
    """Single-process Llama run on a plain loader (the order every rank of the strategy sees too)."""
    pl.seed_everything(0, verbose=False)
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        precision="64-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[recorder],
    )
    trainer.fit(TinyLM(), loader(as_dict=True, sampler="plain"))
    return {"losses": recorder.losses, "state": recorder.state}


# ---------------------------------------------------------------------------------------------- in-process tests


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"plan": "zigzag"}, "plan='zigzag': unknown parallel mode 'zigzag'"),
        ({"plan": ["ring", {"attention": "ring", "mlp": "fast"}]}, "unknown parallel mode 'fast'"),
        ({"plan": "ring", "modes": ["tp_sp"]}, "uses the mode(s) ['ring'] which are not in modes"),
        ({"modes": ["ring", "warp"]}, "unknown mode(s) ['warp']"),
        ({"modes": []}, "empty"),
        ({"memory_budget": "4 parsecs"}, "memory_budget='4 parsecs' is not a size"),
        ({"memory_budget": 0}, "memory_budget=0 must be at least one byte"),
        ({"profile": "/no/such/profile.json"}, "(profile='/no/such/profile.json'): no such file"),
        ({"compile": "yes"}, "(compile='yes'): expected true or false"),
        ({"max_seq_len": 0}, "(max_seq_len=0): expected a positive integer"),
        ({"start_method": "thread"}, "(start_method='thread'): choose one of"),
        ({"timeout": -1}, "(timeout=-1): expected a positive number"),
        ({"loss_reduction": "max"}, "(loss_reduction='max'): choose one of"),
        ({"thresholds": (300, 100)}, "(thresholds=(300, 100)): expected two lengths"),
        ({"blocks": "model..layers"}, "(blocks='model..layers'): expected a dotted path"),
    ],
)
def test_options_are_validated(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        ParaDySeStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"plan": "tp_sp"}, "the plan is fixed"),
        ({"profile": "profile.json"}, "a profile is given"),
        ({"axes": 2}, "axes=2 plans on the grid"),
    ],
)
def test_unused_thresholds_warn(kwargs: dict[str, Any], reason: str, tmp_path: Path) -> None:
    if "profile" in kwargs:
        kwargs["profile"] = str(tmp_path / kwargs["profile"])
        Path(kwargs["profile"]).write_text("{}")
    with pytest.warns(UserWarning, match=re.escape(f"(thresholds=...) is unused: {reason}")):
        ParaDySeStrategy(thresholds=(64, 160), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ParaDySeStrategy(thresholds=(64, 160))  # plan="auto", no profile: they choose the plan


def test_options_are_stored_and_registered(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    strategy = ParaDySeStrategy(memory_budget="1.5GiB", profile=str(profile), plan=MIXED_2, start_method="popen")
    assert strategy.memory_budget == int(1.5 * 2**30) and strategy.profile == str(profile)
    assert parse_memory_budget("512MB") == 512 * 10**6 and parse_memory_budget(4096) == 4096
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="paradyse", logger=False)
    assert isinstance(trainer.strategy, ParaDySeStrategy)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_threshold_policy_is_deterministic_and_feasible() -> None:
    policy = ThresholdPolicy(2, thresholds=(64, 160))
    short, middle, long = policy.plan(10, 1), policy.plan(100, 1), policy.plan(1000, 1)
    assert short == uniform_plan("tp_sp", 2) and middle == uniform_plan("ulysses", 2)
    assert str(long.layers[0]) == "ring+rc,metp+rc" and policy.plan(1000, 4) is long

    def no_head_sharding(plan: Any) -> None:
        if any(layer.attention.mode != "ring" for layer in plan.layers):
            raise ValueError("heads not divisible")

    policy = ThresholdPolicy(2, modes=["tp_sp", "ring"], thresholds=(64, 160), check=no_head_sharding)
    assert str(policy.plan(10, 1).layers[0]) == "ring,tp_sp"  # tp_sp attention infeasible -> ring
    assert str(policy.plan(100, 1).layers[0]) == "ring,tp_sp"  # ulysses not allowed
    with pytest.raises(ValueError, match="no allowed mode is feasible"):
        ThresholdPolicy(1, modes=["tp_sp"], check=no_head_sharding).plan(10, 1)


def test_batches_are_sliced_along_the_sequence_without_padding() -> None:
    tokens, targets = torch.arange(2 * 11).view(2, 11), torch.arange(2 * 11).view(2, 11) + 100
    mask, other = torch.ones(2, 11, 4), torch.zeros(2, 5)
    batch = {"input_ids": tokens, "labels": targets, "mask": mask, "other": other, "meta": "x"}
    assert find_tokens(batch) is tokens and find_targets(batch) == ("labels", targets)
    assert find_targets((tokens, mask, targets))[1] is targets and find_targets(tokens) == (None, None)
    layout = SeqLayout.for_sequence(11, 3, causal=True)  # 11 tokens, 6 chunks (2,2,2,2,2,1): rank r holds r and 5-r
    info = BatchInfo(2, 11, layout, 0, 0, 0)
    sliced = [shard_batch(batch, info, r) for r in range(3)]
    pieces = [piece for piece, _ in sliced]
    for piece, sources in sliced:  # every sliced tensor with its global original, targets first
        assert [src.key for src in sources] == ["labels", "input_ids", "mask"]
        assert all(src.local is piece[src.key] and src.whole is batch[src.key] for src in sources)
    assert [p["input_ids"].shape[1] for p in pieces] == [3, 4, 4]
    for r, piece in enumerate(pieces):
        assert torch.equal(piece["input_ids"], layout.shard(tokens, r)) and piece["mask"].shape == (
            2,
            layout.local_len(r),
            4,
        )
        assert piece["other"] is other and piece["meta"] == "x"
    assert torch.equal(layout.unshard([p["labels"] for p in pieces]), targets)
    with pytest.raises(TypeError, match="cannot find the token tensor"):
        find_tokens({"x": 3})
    combined = {"code": {"input_ids": tokens}, "text": (tokens, targets)}  # Lightning's CombinedLoader yields these
    for nested in (combined, [combined["code"], combined["text"]]):
        with pytest.raises(TypeError, match=r"holds batches or samples .*CombinedLoader.*ConcatDataset"):
            find_tokens(nested)


def test_compile_wraps_each_rewritten_block() -> None:
    model = build_model("llama-tiny")
    compile_blocks(model, ["layers.0", "layers.1"])
    assert all(block._compiled_call_impl is not None for block in model.layers)
    assert "layers.0.attn.q.weight" in dict(model.named_parameters())  # names are unchanged


def test_single_process_errors_name_the_problem() -> None:
    """Wrong plan length (at setup) and an over-long batch (at batch start), with one process."""
    result = run_scenario(
        Scenario("layers", plan=["ring"] * 3, expect_error="the plan has 3 entries but the model has 2 layers"), 1
    )
    assert "ParaDySeStrategy(plan=['ring', 'ring', 'ring'])" in result["error"]
    result = run_scenario(
        Scenario("long", max_seq_len=100, expect_error="exceeds ParaDySeStrategy(max_seq_len=100)"), 1
    )
    assert result["error"].startswith("a batch of length ")


def test_setup_ends_with_a_full_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The setup's objects meet one full garbage collection at its end, before the first batch, on every rank at once
    (left to Python it came in one rank's first steps, 200 ms, while the others waited for that rank)."""
    seen: list[str] = []
    phase = ["setup"]

    def collect(*args: Any) -> int:
        seen.append(phase[0])
        return gc.collect(*args)

    class Phase(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            phase[0] = "steps"

    monkeypatch.setattr(strategy_module, "gc", types.SimpleNamespace(collect=collect))
    pl.seed_everything(0, verbose=False)
    trainer = quiet_trainer(1, ParaDySeStrategy(plan="tp_sp", timeout=60), [Phase()], max_steps=2)
    trainer.fit(TinyLM("llama-tiny", "adamw", "mean"), train_dataloaders=loader())
    assert seen[:1] == ["setup"] and "steps" not in seen[:-1], seen  # the teardown's own collection comes last


def test_a_fit_freezes_its_survivors_and_thaws_them() -> None:
    """After the setup's collection the objects alive are frozen for the fit (later collections skip them), and
    thawed by the teardown (lightning/collection.py)."""
    counts: list[int] = []

    class Count(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            counts.append(gc.get_freeze_count())

    gc.unfreeze()
    pl.seed_everything(0, verbose=False)
    trainer = quiet_trainer(1, ParaDySeStrategy(plan="tp_sp", timeout=60), [Count()], max_steps=2)
    trainer.fit(TinyLM("llama-tiny", "adamw", "mean"), train_dataloaders=loader())
    assert len(counts) == 2 and all(n > 0 for n in counts), counts
    assert gc.get_freeze_count() == 0


# ---------------------------------------------------------------------------------------------- multi-process tests


class GroupsReady(pl.Callback):
    """Whether the group runner was set up, seen at every training and validation batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool, bool]] = []

    def _see(self, trainer: pl.Trainer, stage: str) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ParaDySeStrategy)
        self.seen.append((stage, strategy.cycle.runner.ready, strategy_module.comm.GATHER_AT_ONCE))

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._see(trainer, "train")

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._see(trainer, "validate")


def fit_then_validate_worker(rank: int, world: int, base_port: int) -> list[tuple[str, bool, bool]]:
    """A fit on groups, then ``trainer.validate`` with the same Trainer (each its own process group, on the one store
    the strategy keeps for the process)."""
    strategy_environment(rank, world)
    os.environ["MASTER_PORT"] = str(base_port)
    pl.seed_everything(0, verbose=False)
    seen = GroupsReady()
    strategy = ParaDySeStrategy(plan="auto", groups=True, thresholds=THRESHOLDS, timeout=60)
    trainer = quiet_trainer(world, strategy, [seen], max_steps=2, num_sanity_val_steps=0, limit_val_batches=0)
    module = TinyLM()
    trainer.fit(module, train_dataloaders=loader((40, 60)))
    trainer.limit_val_batches = 1.0
    trainer.validate(module, loader((40,)), verbose=False)
    return seen.seen


@pytest.mark.dist
def test_validate_alone_sets_up_no_groups() -> None:
    """Only training batches run on groups: ``trainer.validate`` (and ``test``) sets up no group runner (its
    process groups and plans made ahead, and its exchange measured where the machine's measurement did not keep
    one) and does not agree on the training steps' weight gather (one collective)."""
    seen = run_distributed(fit_then_validate_worker, 2, free_port(), timeout=120)
    for rank_seen in seen:
        assert [stage for stage, _, _ in rank_seen] == ["train", "train", "validate"], rank_seen
        assert all(ready for stage, ready, _ in rank_seen if stage == "train"), rank_seen
        assert rank_seen[-1][1:] == (False, False), rank_seen


@pytest.mark.dist
def test_spawn_launcher_matches_single_process(tmp_path: Path, plain_reference: dict[str, Any]) -> None:
    """``Trainer(devices=2, strategy=ParaDySeStrategy(plan="auto"))`` from a notebook or a test: spawn launcher."""
    out = str(tmp_path / "rank0.pt")
    pl.seed_everything(0, verbose=False)
    module = TinyLM()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ParaDySeStrategy(plan="auto", thresholds=THRESHOLDS, timeout=60),
        max_steps=6,
        precision="64-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=1,
        limit_val_batches=2,
        val_check_interval=3,
        callbacks=[SaveOnRankZero(out)],
    )
    trainer.fit(module, loader(as_dict=True, sampler="plain"), loader(LENGTHS[:2], as_dict=True))
    assert trainer.state.finished
    result = torch.load(out, weights_only=False)
    assert_same_training(result, plain_reference, "spawn p=2 auto")
    assert len(set(result["plans"])) == 3, result["plans"]  # short, middle and long plans were used
    handed = dict(module.state_dict())  # rank 0's weights, in this process's module converted as one process's is
    assert {v.dtype for v in handed.values()} == {torch.float64}  # float32, rounded, until 2026-11-30
    assert_same_weights(handed, plain_reference["state"], "weights handed back")
    with pytest.warns(UserWarning, match="no optimizer state and step counters at 0"):  # the workers held them
        trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert_same_weights(torch.load(tmp_path / "after.ckpt", weights_only=False)["state_dict"], handed, "saved after")


@pytest.mark.dist
def test_two_processes(tmp_path: Path, references: dict[str, dict[str, Any]]) -> None:
    """p=2: Llama with a fixed mixed plan (checkpoint after step 3 = epoch 0), resumed with another plan and mode set;
    GPT with per-batch switching; a summed loss with gradient accumulation; Hugging Face Llama with labels."""
    ckpt = str(tmp_path / "ckpt")
    first = Scenario("llama-mixed", lengths=LENGTHS[:3], plan=MIXED_2, ckpt_dir=ckpt)
    resumed = Scenario("llama-resumed", lengths=LENGTHS[:3], modes=("ulysses", "ring"), resume=f"{ckpt}/step=3.ckpt")
    gpt = Scenario("gpt-auto", model="gpt-tiny", optimizer="sgd")
    tel = Scenario("tel-mixed", model="tel", optimizer="sgd", plan=MIXED_TEL)
    measured = Scenario("llama-measured", strategy_kwargs={"thresholds": None, "memory_budget": "9MB"})  # float64
    per_rank = run_scenarios(2, [first, resumed, gpt, SUM_ACCUMULATE, HF, tel, SKIP, measured])
    out = per_rank[0]
    ref = references["llama3x2"]
    assert_same_training(out["llama-mixed"], ref, "llama p=2 mixed plan")
    assert set(out["llama-mixed"]["plans"]) == {"tp_sp,tp_sp | ring+rc,metp+rc"}
    assert_same_training(out["llama-resumed"], ref, "llama p=2 resumed with plan auto", steps=slice(3, 6))
    assert {p.split(",")[0] for p in out["llama-resumed"]["plans"]} == {"ulysses", "ring+rc"}
    saved = torch.load(f"{ckpt}/step=3.ckpt", weights_only=False)["state_dict"]
    plain = TinyLM()
    plain.load_state_dict(saved)  # the checkpoint loads into the unparallelised module
    assert_same_weights(saved, ref["step3"], "checkpoint after 3 steps")
    assert_same_training(out["gpt-auto"], references["gpt"], "gpt p=2 auto")
    assert len(set(out["gpt-auto"]["plans"])) == 3
    assert_same_training(out["llama-sum-accumulate"], references["sum"], "llama p=2 summed loss, accumulation")
    assert_same_training(out["hf-llama"], references["hf"], "HF Llama p=2 with labels", tolerances=FLOAT32_TOL)
    assert len(set(out["hf-llama"]["plans"])) == 3
    assert_same_training(out["tel-mixed"], references["tel"], "TransformerEncoderLayer model p=2 mixed plan")
    assert out["llama-measured"]["planner"] == "CostPlanner", "plan='auto' without a profile: the exact planner"
    assert_same_training(out["llama-measured"], references["llama"], "llama p=2 planner on rates measured at setup")
    skip, ref_skip = out["llama-skip"], references["skip"]
    assert [r["llama-skip"]["skipped"] for r in per_rank] == [1, 1], "the 2 x 300 batch is skipped on every rank"
    assert skip["losses"][1] == 0.0 and len(skip["plans"]) == 3
    assert_same_training({**skip, "losses": skip["losses"][:1] + skip["losses"][2:]}, ref_skip, "llama p=2 skip")


@pytest.mark.dist
def test_three_processes(references: dict[str, dict[str, Any]]) -> None:
    """p=3 (uneven chunks): Llama switching, GPT with a fixed mixed plan, and the errors raised on every rank."""
    scenarios = [
        Scenario("llama-auto"),
        Scenario("gpt-mixed", model="gpt-tiny", optimizer="sgd", plan=MIXED_3),
        Scenario("tel-auto", model="tel", optimizer="sgd"),
        HF_SGD,
        Scenario("infeasible", plan="tp_sp", expect_error="cannot run on 3 processes: layer 0: tp_sp needs"),
        Scenario("layers", plan=["ring"] * 3, expect_error="the plan has 3 entries but the model has 2 layers"),
        Scenario(
            "long", max_seq_len=200, expect_error="a batch of length 300 exceeds ParaDySeStrategy(max_seq_len=200)"
        ),
    ]
    per_rank = run_scenarios(3, scenarios)
    out = per_rank[0]
    assert_same_training(out["llama-auto"], references["llama"], "llama p=3 auto")
    # llama-tiny has 2 kv heads: on 3 ranks only ring can run its attention; the MLP still switches
    assert {p.split(" | ")[0] for p in out["llama-auto"]["plans"]} == {"ring,tp_sp", "ring,ulysses", "ring+rc,metp+rc"}
    assert_same_training(out["gpt-mixed"], references["gpt"], "gpt p=3 mixed plan")
    assert_same_training(out["tel-auto"], references["tel"], "TransformerEncoderLayer model p=3 auto")
    assert len(set(out["tel-auto"]["plans"])) == 3
    assert_same_training(
        out["hf-mixed"], references["hf-sgd"], "HF Llama p=3 mixed plan with labels", tolerances=FLOAT32_TOL
    )
    for name in ("infeasible", "layers", "long"):
        messages = {rank_out[name]["error"] for rank_out in per_rank}
        assert len(messages) == 1, f"{name}: the ranks raised different errors: {messages}"
