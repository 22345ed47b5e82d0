"""The per-batch record shared by the strategy (which writes it) and the switcher (which logs it)."""

from __future__ import annotations

from lightning_paradyse.lightning.records import describe, plan_digest, plan_metrics
from lightning_paradyse.modes.plan import parse_plan, uniform_plan


def test_digest_is_stable_and_tells_plans_and_batches_apart() -> None:
    a, b = uniform_plan("ring", 2), parse_plan(["ring", {"attention": "ring", "mlp": "metp"}], 2)
    assert plan_digest(a, 10, 2) == plan_digest(uniform_plan("ring", 2), 10, 2)
    assert len({plan_digest(a, 10, 2), plan_digest(b, 10, 2), plan_digest(a, 11, 2), plan_digest(a, 10, 3)}) == 4


def test_description_and_metrics_count_layers_per_op_and_mode() -> None:
    plan = parse_plan(["tp_sp", {"attention": "ring", "mlp": "metp", "recompute": True}], 2)
    assert describe(uniform_plan("metp", 4, recompute=True)) == "metp+rc,metp+rc x4"
    assert "ring" in describe(plan) and "x" not in describe(plan).split()[-1]
    metrics = plan_metrics(plan, ("tp_sp", "ring", "metp"), "validate")
    assert metrics["plan_validate/attention_tp_sp"] == 1 and metrics["plan_validate/attention_ring"] == 1
    assert metrics["plan_validate/mlp_metp"] == 1 and metrics["plan_validate/recompute"] == 2
    assert all(key.startswith("plan_validate/") for key in metrics)
