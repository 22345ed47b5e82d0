"""The run's planner chosen from the strategy's options (``planning/choose.py``)."""

from __future__ import annotations

import pytest
import torch

from lightning_paradyse.lightning.options import StrategyOptions
from lightning_paradyse.planning import choose
from lightning_paradyse.planning.fixed import ThresholdPolicy
from lightning_paradyse.planning.planner import CostPlanner
from lightning_paradyse.runtime.parallel import parallelize
from tests.support.families import EncoderLM

CPU = torch.device("cpu")


def _chosen(model: torch.nn.Module, **options: object) -> object:
    return choose.choose_planner(model, StrategyOptions.of(**options), None, CPU, [CPU], (), lambda plan: None).planner


def test_blocks_that_compute_their_mlp_inline_get_the_cost_planner() -> None:
    """``plan="auto"`` alone (the strategy's defaults) on ``nn.TransformerEncoderLayer`` blocks, whose MLP is inline."""
    model = EncoderLM(causal=True)
    parallelize(model, None)
    assert isinstance(_chosen(model), CostPlanner)
    assert isinstance(_chosen(model, thresholds=(64, 160)), ThresholdPolicy)


def test_a_model_the_cost_model_cannot_describe_is_refused_naming_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable(module: torch.nn.Module) -> None:
        raise ValueError("no MLP")

    model = EncoderLM(causal=True)
    parallelize(model, None)
    monkeypatch.setattr(choose, "dims_from_module", unreadable)
    named = r"cannot describe this model \(no MLP\); give a fixed plan .* or thresholds=.* and no profile"
    with pytest.raises(ValueError, match=named):
        _chosen(model)
