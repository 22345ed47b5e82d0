"""``trainer.predict`` run whole on every rank (``lightning/predict.py``). The whole path on 2 ranks against one
process is ``tests/exact``: cases ``predict``, ``predict-hf-padded-moe`` (padded rows, experts) and
``predict-generate`` (refused: a key/value cache)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.lightning.predict import PREFERRED, real_lengths, whole_run_plan
from lightning_paradyse.models import build_model
from lightning_paradyse.runtime import parallel
from lightning_paradyse.runtime.parallel import parallelize
from tests.exact.cases import TinyLM, loader, shifted_targets
from tests.support.families import hf_family


def test_every_op_takes_the_first_mode_it_runs_on_one_rank() -> None:
    model = build_model("llama-tiny")
    parallelize(model, None)
    plan = whole_run_plan(model)
    assert {(layer.attention.mode, layer.mlp.mode) for layer in plan.layers} == {("tp_sp", "tp_sp")}


def test_experts_take_a_mode_that_runs_them_whole() -> None:
    pytest.importorskip("transformers")
    model = hf_family("qwen3moe")
    parallelize(model, None)
    plan = whole_run_plan(model)
    assert all(layer.attention.mode == "tp_sp" for layer in plan.layers)
    assert all(layer.mlp.mode in PREFERRED and layer.mlp.mode != "tp_sp" for layer in plan.layers)


def test_real_lengths_of_right_padding() -> None:
    assert real_lengths(None) is None
    padding = torch.tensor([[False, False, True], [False, False, False]])
    assert real_lengths(padding) == (2, 3)
    assert real_lengths(torch.tensor([[False, True, True], [True, True, True]])) == (1, 0)


def test_a_row_of_padding_alone_given_the_mask_is_refused() -> None:
    model = build_model("llama-tiny")
    parallelize(model, None)
    with pytest.raises(ValueError, match="row 1 of the batch is padding alone"):
        parallel._mask_padding_keys(model, (2, 0))


def _trainer(strategy: object) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,  # type: ignore[arg-type]
        precision="64-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def test_one_rank_predicts_and_validates_under_inference_mode() -> None:
    """Lightning evaluates and predicts under ``torch.inference_mode`` on one device (and with NCCL): the batches it
    collates there are inference tensors, which keep no version counter (until 2026-11-30 reading it raised)."""
    data = loader(shifted_targets, (35, 52))
    out = {}
    for name, strategy in (("plain", "auto"), ("ours", ParaDySeStrategy(plan="tp_sp"))):
        pl.seed_everything(0, verbose=False)
        module, trainer = TinyLM(), _trainer(strategy)
        assert trainer.predict_loop.inference_mode
        out[name] = (trainer.validate(module, data, verbose=False), trainer.predict(module, data))
    (plain_val, plain_pred), (val, pred) = out["plain"], out["ours"]
    assert val[0]["val_loss"] == pytest.approx(plain_val[0]["val_loss"], rel=1e-12)
    for mine, one in zip(pred, plain_pred, strict=True):
        torch.testing.assert_close(mine, one, rtol=1e-12, atol=1e-12)
