"""Plans (no processes): parsing the user forms, round trips, errors, random and uniform plans."""

from __future__ import annotations

import pickle

import pytest

from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan, parse_plan, random_plan, uniform_plan


def test_mode_name_applies_to_every_op() -> None:
    plan = parse_plan("ring", 3)
    assert len(plan) == 3
    for layer in plan.layers:
        assert layer.attention == OpPlan("ring", False)
        assert layer.mlp == OpPlan("ring", False)
    assert plan == uniform_plan("ring", 3)


def test_per_layer_list_with_strings_and_mappings() -> None:
    spec = [
        "tp_sp",
        {"attention": "ring", "mlp": "metp", "recompute": True},
        {"attention": {"mode": "ulysses", "recompute": True}, "mlp": "tp_sp"},
        {"mode": "ring"},
        {"attention": "ulysses", "mlp": {"mode": "ring", "recompute": False}, "recompute": True},
    ]
    plan = parse_plan(spec, 5)
    assert plan.layers[0] == LayerPlan(OpPlan("tp_sp"), OpPlan("tp_sp"))
    assert plan.layers[1] == LayerPlan(OpPlan("ring", True), OpPlan("metp", True))
    assert plan.layers[2] == LayerPlan(OpPlan("ulysses", True), OpPlan("tp_sp", False))
    assert plan.layers[3] == LayerPlan(OpPlan("ring"), OpPlan("ring"))
    # a per-op flag overrides the layer's flag
    assert plan.layers[4] == LayerPlan(OpPlan("ulysses", True), OpPlan("ring", False))
    assert plan.layers[1].op("attention").mode == "ring"
    assert plan.layers[1].op("mlp").mode == "metp"


def test_round_trip_through_to_list() -> None:
    spec = [
        "tp_sp",
        {"attention": "ring", "mlp": "metp", "recompute": True},
        {"attention": {"mode": "ulysses"}, "mlp": "ring"},
    ]
    plan = parse_plan(spec, 3)
    as_list = plan.to_list()
    assert as_list[1] == {"attention": {"mode": "ring", "recompute": True}, "mlp": {"mode": "metp", "recompute": True}}
    again = parse_plan(as_list, 3)
    assert again == plan
    assert hash(again) == hash(plan)
    assert parse_plan(plan, 3) is plan


def test_plan_is_frozen_and_hashable() -> None:
    plan = parse_plan("ulysses", 2)
    assert {plan: 1}[parse_plan("ulysses", 2)] == 1
    assert plan != parse_plan("ring", 2)
    with pytest.raises(AttributeError):
        plan.layers = ()  # type: ignore[misc]


def test_a_plans_kept_hash_does_not_travel() -> None:
    """A plan keeps its hash once asked; a pickled plan (sent to another process, whose string hashes differ) carries
    its fields only and hashes anew there."""
    plan = parse_plan("ulysses", 2)
    hash(plan)
    assert "_hash" in plan.__dict__
    copy = pickle.loads(pickle.dumps(plan))
    assert copy == plan and "_hash" not in copy.__dict__
    assert hash(copy) == hash(plan)  # this process: the same strings, the same hash


def test_unknown_mode_lists_known_modes() -> None:
    for spec in ("warp_drive", ["ring", "warp_drive"], [{"attention": "ring", "mlp": "warp_drive"}, "ring"]):
        with pytest.raises(ValueError) as err:
            parse_plan(spec, len(spec) if isinstance(spec, list) else 2)
        message = str(err.value)
        assert "warp_drive" in message
        for mode in MODES:
            assert mode in message
    with pytest.raises(ValueError, match="known modes"):
        OpPlan("nope")


@pytest.mark.parametrize(("entries", "layers"), [(3, 2), (1, 4), (5, 12)])
def test_wrong_number_of_layers_names_both_numbers(entries: int, layers: int) -> None:
    with pytest.raises(ValueError) as err:
        parse_plan(["ring"] * entries, layers)
    message = str(err.value)
    assert f"{entries} entries" in message and f"{layers} layers" in message
    with pytest.raises(ValueError, match=f"{layers} layers"):
        parse_plan(uniform_plan("ring", entries), layers)


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ({"attn": "ring", "mlp": "ring"}, "attn"),
        ({"attention": "ring", "mlp": "ring", "speed": 3}, "speed"),
        ({"attention": "ring"}, "mlp"),
        ({"mlp": "ring"}, "attention"),
        ({"attention": {"mod": "ring"}, "mlp": "ring"}, "mode"),
        ({"attention": {"mode": "ring", "extra": 1}, "mlp": "ring"}, "extra"),
        (42, "42"),
        ({"attention": 7, "mlp": "ring"}, "7"),
    ],
)
def test_bad_mapping_is_a_clear_error(entry: object, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_plan(["ring", entry], 2)
    message = str(err.value)
    assert needle in message
    assert "plan entry 1" in message  # names the faulty layer


def test_random_plan_is_reproducible() -> None:
    modes = list(MODES)
    a = random_plan(8, modes, seed=3)
    assert a == random_plan(8, modes, seed=3)
    others = {random_plan(8, modes, seed=s) for s in range(4, 10)}
    assert any(other != a for other in others)
    assert len(others | {a}) > 2
    used = {layer.op(op).mode for layer in a.layers for op in ("attention", "mlp")}
    assert used <= set(modes) and len(used) > 1
    assert all(not layer.attention.recompute for layer in random_plan(8, modes, seed=3, recompute=False).layers)
    flags = {
        layer.op(op).recompute
        for s in range(5)
        for layer in random_plan(8, modes, s).layers
        for op in ("attention", "mlp")
    }
    assert flags == {True, False}
    only = random_plan(5, ["ring"], seed=1, recompute=False)
    assert only == uniform_plan("ring", 5)


def test_mode_counts() -> None:
    plan = parse_plan(["ring", {"attention": "ulysses", "mlp": "ring", "recompute": True}, "tp_sp"], 3)
    assert plan.mode_counts() == {
        "attention/ring": 1,
        "mlp/ring": 1,
        "attention/ulysses+rc": 1,
        "mlp/ring+rc": 1,
        "attention/tp_sp": 1,
        "mlp/tp_sp": 1,
    }
    assert uniform_plan("metp", 4, recompute=True).mode_counts() == {"attention/metp+rc": 4, "mlp/metp+rc": 4}
    assert sum(random_plan(6, list(MODES), seed=0).mode_counts().values()) == 12


def test_uniform_plan_and_str() -> None:
    plan = uniform_plan("tp_sp", 2, recompute=True)
    assert all(layer == LayerPlan(OpPlan("tp_sp", True), OpPlan("tp_sp", True)) for layer in plan.layers)
    assert str(plan) == "tp_sp+rc,tp_sp+rc | tp_sp+rc,tp_sp+rc"
    assert isinstance(plan, Plan)
