"""``trainer.predict`` run whole on every rank (``lightning/predict.py``). The whole path on 2 ranks against one
process is ``tests/exact``: cases ``predict``, ``predict-hf-padded-moe`` (padded rows, experts) and
``predict-generate`` (refused: a key/value cache)."""

from __future__ import annotations

import pytest
import torch

from lightning_paradyse.lightning.predict import PREFERRED, real_lengths, whole_run_plan
from lightning_paradyse.models import build_model
from lightning_paradyse.runtime.parallel import parallelize
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


def test_real_lengths_of_right_padding_and_a_row_of_padding_alone() -> None:
    assert real_lengths(None) is None
    padding = torch.tensor([[False, False, True], [False, False, False]])
    assert real_lengths(padding) == (2, 3)
    with pytest.raises(ValueError, match="row 1 of the batch is padding alone"):
        real_lengths(torch.tensor([[False, True, True], [True, True, True]]))
