"""The grid planner (dimension switching vs sequence modes) is exact: it equals enumerating every plan."""

from __future__ import annotations

import random

import pytest

from lightning_paradyse.planning.grid import GridPlanner, best_grid_modes, brute_force_grid, plan_cost


def test_dynamic_programme_matches_enumeration() -> None:
    rng = random.Random(0)
    for trial in range(300):
        axes = [rng.choice([1, 2]) for _ in range(rng.randint(1, 7))]
        p, kv_ratio = rng.choice([2, 3, 4, 8]), rng.choice([1.0, 0.5, 0.25, 0.125, 0.05])
        chosen, cost = best_grid_modes(axes, p, kv_ratio)
        assert cost == pytest.approx(brute_force_grid(axes, p, kv_ratio), rel=1e-12), f"trial {trial}"
        assert plan_cost(chosen, axes, p, kv_ratio) == pytest.approx(cost, rel=1e-12)


def test_spatial_temporal_model_switches_dimensions() -> None:
    axes = [2, 1, 2, 1]  # spatial, temporal, spatial, temporal; the batch is split along the frames (axis 1)
    chosen, cost = best_grid_modes(axes, 4)
    assert chosen == ("dsp", "dsp", "dsp", "dsp")
    ulysses = plan_cost(["dsp", "ulysses", "dsp", "ulysses"], axes, 4)  # keep the frames sharded: Ulysses
    assert cost <= 0.5 * ulysses  # 4 switches against 2 x (q/k/v + output) all-to-alls, forward and backward
    planner = GridPlanner(axes, 4, 1.0, ("dsp", "ulysses", "ring"))
    assert [layer.attention.mode for layer in planner.plan(64, 1).layers] == list(chosen)
    assert all(layer.mlp.mode == "dsp" for layer in planner.plan(64, 1).layers)
    few_kv = best_grid_modes([1], 2, kv_ratio=0.05)[0]  # one key/value head in 20: passing it round is cheaper
    assert few_kv == ("ring",)
