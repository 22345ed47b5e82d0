"""The group cost's step times (:mod:`lightning_paradyse.groups.cost`): moved from a length bucket's planned end to the
batch's own length without losing what does not grow with the tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lightning_paradyse.cost.cluster import load_cluster
from lightning_paradyse.cost.dims import dims_from_config
from lightning_paradyse.cost.model import CostModel
from lightning_paradyse.groups.cost import flop_weights, length_time, planner_step_time
from lightning_paradyse.models import CONFIGS
from lightning_paradyse.planning.planner import CostPlanner

CLUSTER = Path(__file__).resolve().parents[2] / "configs" / "clusters" / "h100-80gb-nvlink-8.yaml"


def _planner(latency_us: float) -> CostPlanner:
    """Two ranks of a cluster whose collectives cost ``latency_us`` each: short steps of many collectives."""
    cluster = dataclasses.replace(load_cluster(CLUSTER), latency_us=latency_us)
    dims = dims_from_config(dataclasses.replace(CONFIGS["llama-tiny"], n_layers=2), 4)
    return CostPlanner(CostModel(dims, 2, cluster.machine(), optimizer_bytes_per_param=8), 2**30, bucket_tokens=64)


def test_bucket_start_is_the_bucket_below_s_upper_end() -> None:
    planner = _planner(10.0)
    assert [planner.bucket_start(s) for s in (1, 2, 3, 33, 64, 65, 128, 129)] == [0, 1, 2, 32, 32, 64, 64, 128]
    assert all(planner.bucket_start(s) < s <= planner.bucket(s) for s in range(1, 300))


@pytest.mark.parametrize("latency_us", [10.0, 2_000.0])
def test_step_times_are_monotone_in_the_length_and_exact_at_bucket_ends(latency_us: float) -> None:
    """A step planned for 64 tokens, priced at 34: its latencies are not halved with its FLOPs (which priced a group
    of two ranks below the same group at 32 tokens and sent batches just above a bucket end to it)."""
    planner = _planner(latency_us)
    step_time = planner_step_time(planner.model.dims, lambda g: planner)
    for rows in (1, 4, 6):
        times = [step_time(s, rows, 2) for s in range(2, 200)]
        assert all(t is not None for t in times)
        assert times == sorted(times)  # type: ignore[type-var]
    for s in (32, 64, 128, 192):
        assert step_time(s, 4, 2) == planner.step(s, 4).time_s
    low, high = planner.step(32, 4), planner.step(64, 4)
    a, c = flop_weights(planner.model.dims)
    share = (a * 34 + c * 34**2 - a * 32 - c * 32**2) / (a * 64 + c * 64**2 - a * 32 - c * 32**2)
    assert length_time(planner, high, 34, (a, c)) == pytest.approx(low.time_s + (high.time_s - low.time_s) * share)
