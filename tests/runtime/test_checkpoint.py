"""Checkpoints both ways between ParaDySeStrategy and plain single-process Lightning, in float64.

Our checkpoints must hold exactly what the plain model would have saved (the state dict with every key in its
order, tied names included; the optimizer state in ``Optimizer.state_dict()`` format, numbered in the plain
model's parameter order, full tensors), and we must resume from plain ones. Compared, with relative errors
(largest difference over the tensor's largest entry) at most ``TOL``:

* without processes: the consolidated optimizer state of a parallelised Llama (gated MLP, two param groups) after
  AdamW steps against the plain optimizer's ``state_dict()`` given the same gradients (bit for bit: p = 1 runs the
  same arithmetic), loading it back (plain, ours and the legacy format), and a tied Hugging Face model's state dict;
* on 2 gloo processes (one spawn, several Trainers) against a plain ``devices=1`` run with checkpoints after 3
  and 6 steps: (a) a plain run resumed from our step-3 checkpoint, (b) our strategy resumed from the plain step-3
  checkpoint, our strategy resumed from its own checkpoint with another plan, and our own step-3 and step-6
  checkpoints, all against the plain run's step-6 (step-3) checkpoint, weights and optimizer state; (c) a tied-
  embedding Hugging Face Llama, whose checkpoint loads with ``strict=True`` into the plain model.

Float64 with AdamW: the parallel runs sum in another order, a rounding difference of ~1e-16 that AdamW's division
by ``sqrt(v)`` amplifies for entries with tiny gradients, still far below ``TOL``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from lightning_paradyse import ParaDySeStrategy, gather_like_params, shard_like_params
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.graph.dispatch import cut_piece
from lightning_paradyse.models import build_model
from lightning_paradyse.runtime import parallel
from lightning_paradyse.runtime.checkpoint import (
    LEGACY_FORMAT,
    PlainModel,
    consolidate_optimizer_state,
    load_optimizer_state,
    plain_targets,
)
from tests.support.dist import free_port
from tests.support.families import hf_family
from tests.support.lightning import quiet_trainer, strategy_environment

TOL = 1e-9
LENGTHS = (40, 72, 56)
"""One epoch: three batches; checkpoints after 3 steps (the end of epoch 0) and 6."""
PLAN = ["tp_sp", {"attention": "ring", "mlp": "metp"}]
OTHER_PLAN = [{"attention": "ulysses", "mlp": "ring"}, "metp"]


def tied_llama() -> nn.Module:
    """A tiny Hugging Face Llama whose LM head is the token embedding (``tie_word_embeddings``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def param_groups(module: nn.Module) -> list[dict[str, Any]]:
    """Weight decay for matrices, none for norms: two groups, each in the module's parameter order."""
    params = list(module.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


class LM(pl.LightningModule):
    """An ordinary LightningModule: the reference Llama (gated MLP) with targets, or a tied HF Llama with labels. It
    keeps a moving average of its weights, saved whole in its checkpoints (``gather_like_params``) and read back
    (``shard_like_params``)."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.hf = model == "hf-tied"
        self.model = tied_llama() if self.hf else build_model("llama-tiny")
        self.ema: dict[str, Tensor] | None = None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:  # (a checkpoint saved at a batch's end then
        with torch.no_grad():  # holds what a resumed run continues from: Lightning calls the callbacks' hook first)
            if self.ema is None:
                self.ema = {n: w.detach().clone() for n, w in self.named_parameters()}
            for n, w in self.named_parameters():
                self.ema[n].mul_(0.75).add_(w.detach(), alpha=0.25)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.ema is not None:
            checkpoint["ema"] = gather_like_params(self, self.ema)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.ema = shard_like_params(self, checkpoint["ema"]) if "ema" in checkpoint else None

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.hf:
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss  # type: ignore[no-any-return]
        tokens, targets = batch
        logits = self.model(tokens)  # [b, s_r, vocab]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(param_groups(self), lr=3e-3)


class Batches(Dataset[Any]):
    """Item ``i``: a whole batch of 2 sequences of ``LENGTHS[i]`` tokens (targets shifted, or HF labels)."""

    def __init__(self, hf: bool) -> None:
        self.hf = hf

    def __len__(self) -> int:
        return len(LENGTHS)

    @override
    def __getitem__(self, i: int) -> Any:
        gen = torch.Generator().manual_seed(i)
        window = torch.randint(0, 128, (2, LENGTHS[i] + 1), generator=gen)
        if self.hf:
            return {"input_ids": window[:, :-1], "labels": window[:, :-1].clone()}
        return window[:, :-1], window[:, 1:]


def fit(model: str, ckpt_dir: str, devices: int, plan: Any = None, resume: str | None = None) -> None:
    """6 steps (3 when resuming after step 3) with checkpoints ``step=3.ckpt`` and ``step=6.ckpt`` in ``ckpt_dir``.

    ``plan`` ``None``: the plain model on one process; otherwise ParaDySeStrategy with that fixed plan.
    """
    pl.seed_everything(0, verbose=False)
    module = LM(model).double()  # float64 before a plain run restores its weights (before precision's conversion)
    data = Batches(hf=module.hf)
    loader = DataLoader(data, batch_size=None, sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=False))
    save = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", save_top_k=-1, every_n_train_steps=3)
    strategy: Any = "auto" if plan is None else ParaDySeStrategy(plan=plan, timeout=60)
    trainer = quiet_trainer(devices, strategy, [save], enable_checkpointing=True, max_steps=6, precision="64-true")
    trainer.fit(module, loader, ckpt_path=resume)


def strategy_worker(rank: int, world: int, root: str, port: int) -> bytes:
    """Our runs, one Trainer after the other (each makes and destroys its own process group, all on ``port``, where
    the strategy keeps one store for the process: ``distributed/rendezvous.py``)."""
    strategy_environment(rank, world)
    os.environ["MASTER_PORT"] = str(port)
    runs = [
        ("llama", "ours", PLAN, None),
        ("llama", "from-plain", OTHER_PLAN, "plain/step=3.ckpt"),
        ("llama", "ours-other-plan", OTHER_PLAN, "ours/step=3.ckpt"),
        ("hf-tied", "tied", PLAN, None),
    ]
    for model, out, plan, resume in runs:
        fit(model, f"{root}/{out}", world, plan, f"{root}/{resume}" if resume else None)
    return b""


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)  # type: ignore[no-any-return]


def rel_err(got: Tensor, ref: Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def assert_same_state(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    """Same state dict (keys in order) and optimizer state (same groups, indices, keys), tensors within TOL."""
    assert list(got["state_dict"]) == list(ref["state_dict"]), f"{what}: state dict keys differ"
    for key, value in ref["state_dict"].items():
        err = rel_err(got["state_dict"][key], value)
        assert err <= TOL, f"{what}: weight {key} relative error {err:.1e}"
    for opt, ref_opt in zip(got["optimizer_states"], ref["optimizer_states"], strict=True):
        assert_same_optimizer_state(opt, ref_opt, what)
    assert list(got.get("ema", {})) == list(ref.get("ema", {})), f"{what}: the kept average's keys differ"
    for key, value in ref.get("ema", {}).items():
        err = rel_err(got["ema"][key], value)
        assert err <= TOL, f"{what}: the kept average of {key}: relative error {err:.1e}"


def assert_same_optimizer_state(opt: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    assert opt["param_groups"] == ref["param_groups"], f"{what}: optimizer param groups differ"
    assert list(opt["state"]) == sorted(ref["state"]), f"{what}: optimizer state indices differ"
    for i, entry in ref["state"].items():
        assert set(opt["state"][i]) == set(entry), f"{what}: optimizer state keys of parameter {i}"
        for key, value in entry.items():
            err = rel_err(opt["state"][i][key], value)
            assert err <= TOL, f"{what}: optimizer {key} of parameter {i}: relative error {err:.1e}"


# ---------------------------------------------------------------------------------------------- without processes


def _parallel_twin(plain: nn.Module) -> tuple[nn.Module, PlainModel]:
    """A copy of ``plain`` parallelised on one process (no group), and the record of ``plain``."""
    twin = copy.deepcopy(plain)
    record = PlainModel.record(twin)
    parallel.parallelize(twin, None)
    return twin, record


def _same_grads(plain: nn.Module, twin: nn.Module, record: PlainModel, seed: int) -> None:
    """Random gradients on ``plain``, and the same (its shards, p = 1) on ``twin``."""
    gen = torch.Generator().manual_seed(seed)
    grads = {n: torch.randn(w.shape, generator=gen, dtype=w.dtype) for n, w in plain.named_parameters()}
    for n, w in plain.named_parameters():
        w.grad = grads[n]
    params = dict(twin.named_parameters())
    for name, (target, ref) in plain_targets(twin, record).items():
        g = grads[target]
        if ref is not None:
            g = cut_piece(g, ref.source)
        params[name].grad = g.contiguous()


REORDERED = {
    "llama-tiny": lambda: build_model("llama-tiny"),  # the rewritten MLP lists its up projection before its gate
    "qwen3": lambda: hf_family("qwen3"),  # the attention adopts q_norm and k_norm, and lists k_norm first
    "olmo2": lambda: hf_family("olmo2"),
    "gemma3": lambda: hf_family("gemma3"),
    "phi": lambda: hf_family("phi"),  # q_layernorm and k_layernorm
    "stablelm": lambda: hf_family("stablelm"),  # a LayerNorm per head of q and of k
}
"""Models whose parallelised form lists its parameters in another order than the plain model."""


@pytest.mark.parametrize("model", list(REORDERED))
def test_optimizer_state_is_the_plain_optimizers(model: str) -> None:
    if model != "llama-tiny":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = REORDERED[model]().double()
    twin, record = _parallel_twin(plain)
    targets = plain_targets(twin, record)
    listed = list(dict.fromkeys(targets[n][0] for n, _ in twin.named_parameters()))
    assert listed != [n for n, _ in plain.named_parameters()], "the case this test is about"
    opt, twin_opt = torch.optim.AdamW(param_groups(plain), lr=1e-2), torch.optim.AdamW(param_groups(twin), lr=1e-2)
    for seed in range(2):
        _same_grads(plain, twin, record, seed)
        opt.step()
        twin_opt.step()
    ours, ref = consolidate_optimizer_state(twin_opt, twin, record, None), opt.state_dict()
    assert_same_optimizer_state(ours, ref, "consolidated AdamW state")
    assert all(torch.equal(ours["state"][i][k], v) for i, e in ref["state"].items() for k, v in e.items())

    by_index = {i: n for i, n in enumerate(n for g in opt.param_groups for n in _names(plain, g["params"]))}
    legacy = {
        "format": LEGACY_FORMAT,
        "state": {by_index[i]: e for i, e in ref["state"].items()},
        "param_groups": [{**g, "params": [by_index[i] for i in g["params"]][::-1]} for g in ref["param_groups"]],
    }
    for saved in (ref, ours, legacy):  # a plain run's, ours, and the format of earlier versions
        fresh = torch.optim.AdamW(param_groups(twin), lr=1e-2)
        load_optimizer_state(fresh, twin, record, saved, None)
        again = consolidate_optimizer_state(fresh, twin, record, None)
        assert all(torch.equal(again["state"][i][k], v) for i, e in ref["state"].items() for k, v in e.items())
        assert again["param_groups"] == ref["param_groups"]


RESUMED = {
    "llama-tiny": lambda: build_model("llama-tiny"),
    "gpt2": lambda: hf_family("gpt2"),  # q, k and v of one fused c_attn: three shards of one plain weight
    "neox": lambda: hf_family("neox"),
    "phi3": lambda: hf_family("phi3"),  # fused qkv_proj and gate_up_proj
    "qwen3": lambda: hf_family("qwen3"),
}


@pytest.mark.parametrize("model", list(RESUMED))
def test_a_resumed_optimizer_steps_as_the_plain_one(model: str) -> None:
    """A plain optimizer's state loaded into the shards, then more steps on both: the same state (Adam's ``step``
    counts each step once per shard, however many pieces of one plain weight share its saved value)."""
    if model != "llama-tiny":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = RESUMED[model]().double()
    twin, record = _parallel_twin(plain)
    opt = torch.optim.AdamW(param_groups(plain), lr=1e-2)
    for seed in range(2):
        _same_grads(plain, twin, record, seed)
        opt.step()
    parallel.load_consolidated(twin, plain.state_dict(), None)
    resumed = torch.optim.AdamW(param_groups(twin), lr=1e-2)
    load_optimizer_state(resumed, twin, record, copy.deepcopy(opt.state_dict()), None)  # as torch.load gives it
    for seed in range(2, 4):
        _same_grads(plain, twin, record, seed)
        opt.step()
        resumed.step()
    assert_same_optimizer_state(consolidate_optimizer_state(resumed, twin, record, None), opt.state_dict(), model)
    got = parallel.consolidated(twin, None)
    assert all(torch.equal(got[k], v) for k, v in plain.state_dict().items()), f"{model}: weights after resuming"


def _names(module: nn.Module, params: list[Tensor]) -> list[str]:
    by_id = {id(p): n for n, p in module.named_parameters()}
    return [by_id[id(p)] for p in params]


def test_tied_state_dict_has_every_plain_key_in_order() -> None:
    torch.manual_seed(0)
    plain = tied_llama()
    twin, record = _parallel_twin(plain)
    state = record.state_dict(parallel.consolidated(twin, None))
    assert list(state) == list(plain.state_dict()) and "lm_head.weight" in state
    fresh = tied_llama()
    fresh.load_state_dict(state, strict=True)
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    parallel.load_consolidated(twin, plain.state_dict(), None, strict=True)  # the plain checkpoint, both names


# ---------------------------------------------------------------------------------------------- on 2 processes


@pytest.mark.dist
def test_checkpoints_both_ways_on_two_processes(tmp_path: Path) -> None:
    root = str(tmp_path)
    fit("llama", f"{root}/plain", devices=1)
    fit("hf-tied", f"{root}/plain-tied", devices=1)
    run_distributed(strategy_worker, 2, root, free_port(), timeout=300)
    fit("llama", f"{root}/plain-from-ours", devices=1, resume=f"{root}/ours/step=3.ckpt")
    fit("llama", f"{root}/plain-from-plain", devices=1, resume=f"{root}/plain/step=3.ckpt")

    plain3, plain6 = load(tmp_path / "plain/step=3.ckpt"), load(tmp_path / "plain/step=6.ckpt")
    assert_same_state(load(tmp_path / "ours/step=3.ckpt"), plain3, "our step-3 checkpoint")
    assert_same_state(load(tmp_path / "ours/step=6.ckpt"), plain6, "our step-6 checkpoint")
    plain_resumed = load(tmp_path / "plain-from-plain/step=6.ckpt")
    assert_same_state(load(tmp_path / "plain-from-ours/step=6.ckpt"), plain_resumed, "(a) plain resumed from ours")
    assert_same_state(plain_resumed, plain6, "plain resumed from plain")
    assert_same_state(load(tmp_path / "from-plain/step=6.ckpt"), plain6, "(b) ours resumed from plain")
    assert_same_state(load(tmp_path / "ours-other-plan/step=6.ckpt"), plain6, "ours resumed with another plan")

    tied, plain_tied = load(tmp_path / "tied/step=6.ckpt"), load(tmp_path / "plain-tied/step=6.ckpt")
    assert "model.lm_head.weight" in tied["state_dict"]
    LM("hf-tied").load_state_dict(tied["state_dict"], strict=True)
    assert_same_state(tied, plain_tied, "(c) tied embeddings")


def _fused_round_trip(rank: int, world: int) -> list[str]:
    """Consolidate and load the plain state of models with fused and Conv1D projections, on ``world`` ranks."""
    import torch.distributed as dist

    from tests.support.families import hf_family

    bad = []
    for family in ("gpt2", "neox", "phi3"):
        torch.manual_seed(0)
        plain = hf_family(family, n_kv_heads=4).double()
        model = copy.deepcopy(plain)
        parallel.parallelize(model, dist.group.WORLD)
        expected = plain.state_dict()
        got = parallel.consolidated(model, dist.group.WORLD)
        bad += [f"{family}: {k}" for k in expected if not torch.equal(got[k], expected[k])]
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # in place: tied parameters (GPT-2's head and embedding) stay one
            for w in plain.parameters():
                w.add_(torch.randn(w.shape, generator=gen, dtype=w.dtype))
        changed = plain.state_dict()
        parallel.load_consolidated(model, changed, dist.group.WORLD)
        again = parallel.consolidated(model, dist.group.WORLD)
        bad += [f"{family} (loaded): {k}" for k in changed if not torch.equal(again[k], changed[k])]
    return bad


def test_fused_and_conv1d_projections_round_trip_exactly() -> None:
    """GPT-2's Conv1D ``c_attn`` (stored ``[in, out]``, cut by ``split``), GPT-NeoX's ``query_key_value`` (q, k, v
    interleaved head by head) and Phi-3's ``qkv_proj`` / ``gate_up_proj``: each rank holds its heads' rows of every
    part; the consolidated state is the plain one bit for bit, and loading a plain state gives it back."""
    pytest.importorskip("transformers")
    bad = run_distributed(_fused_round_trip, 2, timeout=120)[0]
    assert not bad, bad


def _kept_round_trip(rank: int, world: int) -> list[str]:
    """Tensors the module keeps per parameter (twice each weight, keyed by its named_parameters names in the fit):
    gathered, the plain model's under its names; sharded again, this rank's as they were."""
    import torch.distributed as dist

    from tests.support.families import hf_family

    bad = []
    for family in ("mistral", "gpt2"):
        torch.manual_seed(0)
        plain = hf_family(family, n_kv_heads=4).double()
        model = copy.deepcopy(plain)
        parallel.parallelize(model, dist.group.WORLD)
        kept = {n: 2 * w.detach() for n, w in model.named_parameters()}
        whole = parallel.consolidated_like(model, kept, dist.group.WORLD)
        expected = {n: 2 * w.detach() for n, w in plain.named_parameters()}
        if set(whole) != set(expected):
            bad.append(f"{family}: keys {sorted(set(whole) ^ set(expected))[:4]}")
        bad += [f"{family}: {k}" for k, v in expected.items() if k in whole and not torch.equal(whole[k], v)]
        again = parallel.sharded_like(model, whole, dist.group.WORLD)
        bad += [f"{family} (sharded): {k}" for k, v in kept.items() if not torch.equal(again.get(k, v + 1), v)]
    try:
        parallel.consolidated_like(model, {"not.a.parameter": torch.zeros(1)}, dist.group.WORLD)
        bad.append("an unknown name was not refused")
    except KeyError as err:
        if "name no parameter of the module" not in str(err):
            bad.append(str(err))
    return bad


@pytest.mark.dist
def test_tensors_kept_per_parameter_round_trip_exactly() -> None:
    """What ``gather_like_params`` / ``shard_like_params`` rest on (a running average of the weights saved whole)."""
    pytest.importorskip("transformers")
    bad = run_distributed(_kept_round_trip, 2, timeout=120)[0]
    assert not bad, bad


def _state_on_one_rank(rank: int, world: int) -> str:
    """Optimizer state for a shard on rank 0 only: the consolidation's error on every rank, before any gather."""
    import torch.distributed as dist

    torch.manual_seed(0)
    plain = build_model("llama-tiny").double()
    record = PlainModel.record(plain)
    parallel.parallelize(plain, dist.group.WORLD)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    shard = next(w for n, w in plain.named_parameters() if n in parallel.shard_sources(plain))
    if rank == 0:  # as an optimizer that skipped the shard on the other rank would leave it
        shard.grad = torch.ones_like(shard)
        optimizer.step()
    try:
        consolidate_optimizer_state(optimizer, plain, record, dist.group.WORLD)
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.dist
def test_state_held_by_some_ranks_only_is_refused_on_every_rank() -> None:
    errors = run_distributed(_state_on_one_rank, 2, timeout=120)
    assert all("holds state for the shard of" in e and "on ranks [0] only" in e for e in errors), errors


def test_an_optimizer_of_named_parameters_saves_the_plain_names() -> None:
    """``AdamW(self.named_parameters())`` keeps ``param_names`` in its state dict: ours are the plain model's, in its
    order (the rewrite's own names, ``attn.q``, ``mlp.up``, never reach a checkpoint)."""
    plain = build_model("llama-tiny").double()
    twin, record = _parallel_twin(plain)
    optimizer = torch.optim.AdamW(twin.named_parameters())
    for w in twin.parameters():
        w.grad = torch.ones_like(w)
    optimizer.step()
    saved = consolidate_optimizer_state(optimizer, twin, record, None)
    assert saved["param_groups"][0]["param_names"] == [n for n, _ in plain.named_parameters()]
    load_optimizer_state(optimizer, twin, record, saved, None)  # the plain names do not replace this optimizer's
    assert optimizer.param_groups[0]["param_names"] == [n for n, _ in twin.named_parameters()]
