"""Heterogeneous group sizes per step (FlexSP-style): the solver against brute force, and on the cost model."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_paradyse.groups.runner import group_sizes
from lightning_paradyse.groups.solver import (
    MAX_GROUPS,
    Assignment,
    assign,
    assign_exact,
    assign_greedy,
    assign_rows,
    brute_force,
    layouts,
    sequential_cost,
    smallest_group,
    splits,
)
from lightning_paradyse.models import CONFIGS
from lightning_paradyse.planning.planner import PlanInfeasible, group_planning, make_planner

CLUSTER = Path(__file__).resolve().parents[2] / "configs" / "clusters" / "a100-80gb-nvlink-8.yaml"


def packed_cost(a: float, b: float, comm: float, latency: float, cap: int) -> Callable[..., float | None]:
    """A monotone packed-group cost: quadratic attention and linear work split over ``g`` ranks, communication
    growing with ``g``, memory ``sum(s)/g <= cap``."""

    def cost(lengths: tuple[int, ...], g: int) -> float | None:
        tokens = sum(lengths)
        if tokens / g > cap:
            return None
        work = (a * sum(s * s for s in lengths) + b * tokens) / g
        return work + comm * tokens * (g - 1) / g + latency * (g > 1)

    return cost


def check(found: Assignment | None, lengths: list[int], world: int) -> None:
    assert found is not None
    assert sum(found.sizes) == world and all(g & (g - 1) == 0 for g in found.sizes)
    assert sorted(i for group in found.groups for i in group) == list(range(len(lengths)))


def test_layouts_are_every_split_into_powers_of_two() -> None:
    assert layouts(1) == ((1,),)
    assert layouts(2) == ((2,), (1, 1))
    assert layouts(4) == ((4,), (2, 2), (2, 1, 1), (1, 1, 1, 1))
    assert len(layouts(8)) == 10 and len(set(layouts(8))) == 10
    assert all(sum(s) == 8 and list(s) == sorted(s, reverse=True) for s in layouts(8))
    assert len(layouts(3)) == 2  # 2 + 1, 1 + 1 + 1: any world size works
    with pytest.raises(ValueError, match="world must be positive"):
        layouts(0)


def test_beyond_thirty_two_ranks_the_smallest_group_grows() -> None:
    """The solvers split the world into at most :data:`MAX_GROUPS` groups of the smallest size: every layout up to 32
    ranks, groups of at least 2 ranks up to 64, of 4 up to 128; what does not divide into them (33 ranks: one) adds
    smaller groups last. Made without the layouts of the whole world (billions at 1,024 ranks)."""
    assert [smallest_group(w) for w in (1, 8, 32, 33, 48, 64, 65, 128, 1024)] == [1, 1, 1, 2, 2, 2, 4, 4, 32]
    for world in (4, 8, 16, 32):
        assert splits(world) == layouts(world)
    for world in (48, 64, 128):
        assert set(splits(world)) == {s for s in layouts(world) if s[-1] >= smallest_group(world)}
    for world in (33, 48, 63, 64, 100, 264, 1000, 1024):
        least = smallest_group(world)
        for sizes in splits(world):
            assert sum(sizes) == world and list(sizes) == sorted(sizes, reverse=True)
            assert all(g & (g - 1) == 0 for g in sizes), sizes
            assert sum(g >= least for g in sizes) <= MAX_GROUPS and sum(g < least for g in sizes) < least.bit_length()
    assert splits(33)[-1] == (2,) * 16 + (1,)
    assert group_sizes(64) == [2, 4, 8, 16, 32, 64] and group_sizes(8) == [1, 2, 4, 8]
    assert group_sizes(33) == [1, 2, 4, 8, 16, 32, 33]


def test_the_groups_left_over_past_thirty_two_ranks_take_the_last_runs() -> None:
    """1,023 ranks: 31 groups of 32 and 16 + 8 + 4 + 2 + 1 left over. Those take the last runs, largest first (each of
    them choosing its run would double the programme's multisets: 28 s a decision); the decision stays as cheap as
    at 1,024 ranks."""
    rng = random.Random(5)
    lengths = [rng.randint(4, 35) for _ in range(117)]
    calls = {1023: 0, 1024: 0}
    for world in calls:
        shape = rows_shape(1e-3, 1e-5, 0.5, 400.0, world)

        def counted(
            s: int, b: int, g: int, shape: Callable[..., float | None] = shape, world: int = world
        ) -> float | None:
            calls[world] += 1
            return shape(s, b, g)

        found = assign_rows(lengths, world, counted)
        check(found, lengths, world)
    assert calls[1023] < 2 * calls[1024], calls


def test_exact_solver_matches_brute_force_on_random_instances() -> None:
    rng = random.Random(0)
    gaps = []
    for trial in range(300):
        world = rng.choice([2, 4, 8])
        n = rng.randint(1, 6 if world < 8 else 4)
        lengths = [rng.choice([rng.randint(16, 256), rng.randint(256, 4096)]) for _ in range(n)]
        cost = packed_cost(
            a=rng.uniform(0.1, 2.0) * 1e-6,
            b=rng.uniform(0.5, 2.0) * 1e-4,
            comm=rng.uniform(0, 2) * 1e-4,
            latency=rng.uniform(0, 0.05),
            cap=rng.choice([512, 2048, 10**9]),
        )
        reference = brute_force(lengths, world, cost)
        exact = assign_exact(lengths, world, cost)
        greedy = assign_greedy(lengths, world, cost)
        if reference is None:
            assert exact is None and greedy is None, f"trial {trial}: no assignment fits, but one was returned"
            continue
        check(exact, lengths, world)
        check(greedy, lengths, world)
        assert exact is not None and greedy is not None
        assert exact.time == pytest.approx(reference.time, rel=1e-12), f"trial {trial}: {exact} vs {reference}"
        for members, g, t in zip(exact.groups, exact.sizes, exact.times):  # the reported times are the cost's
            assert t == (cost(tuple(lengths[i] for i in members), g) if members else 0.0)
        assert greedy.time >= exact.time * (1 - 1e-12)
        gaps.append(greedy.time / exact.time - 1)
        idle = {g: 0.5 * rng.random() * (g > 1) * (cost((min(lengths),), g) or 0.0) for g in (1, 2, 4, 8)}  # <= one
        idle_reference = brute_force(lengths, world, cost, idle=idle.__getitem__)
        idle_exact = assign_exact(lengths, world, cost, idle=idle.__getitem__)
        assert (idle_exact is None) == (idle_reference is None), f"trial {trial}"
        if idle_reference is not None and idle_exact is not None:
            assert idle_exact.time == pytest.approx(idle_reference.time, rel=1e-12), f"trial {trial}"
        busy_reference = brute_force(lengths, world, cost, all_busy=True)  # no idle group (the strategy's setting)
        busy, busy_greedy = assign_exact(lengths, world, cost, all_busy=True), assign_greedy(lengths, world, cost, True)
        if busy_reference is None:
            assert busy is None, f"trial {trial}: no busy assignment fits, but one was returned"
            continue
        assert busy is not None and all(busy.groups), f"trial {trial}: {busy}"
        assert busy.time == pytest.approx(busy_reference.time, rel=1e-12), f"trial {trial}: {busy} vs {busy_reference}"
        assert busy_greedy is None or (all(busy_greedy.groups) and busy_greedy.time >= busy.time * (1 - 1e-12))
    assert len(gaps) > 200
    print(f"greedy vs exact: mean gap {sum(gaps) / len(gaps):.2%}, worst {max(gaps):.2%}")


def rows_shape(a: float, c: float, fixed: float, cap: float | None, world: int) -> Callable[..., float | None]:
    """A monotone cost of ``b`` padded rows of ``s`` tokens on ``g`` ranks: work split over ``g``, a fixed cost
    for groups smaller than the world (the weight exchange), a per-row overhead, memory ``b s / g <= cap``."""

    def shape(s: int, b: int, g: int) -> float | None:
        if s < g or (cap is not None and b * s / g > cap):
            return None
        return b * (a * s + c * s * s) / g + fixed * (g < world) + 0.3 * b**0.5

    return shape


def rows_cost(shape: Callable[..., float | None]) -> Callable[[tuple[int, ...], int], float | None]:
    """The group cost of a rows cost: the rows padded to the group's longest."""

    def cost(lengths: tuple[int, ...], g: int) -> float | None:
        return shape(max(lengths), len(lengths), g)

    return cost


def test_rows_solver_matches_brute_force_on_random_instances() -> None:
    """:func:`assign_rows` (consecutive runs of rows by length, dynamic programme) is exact for rows costs."""
    rng = random.Random(7)
    for trial in range(400):
        world = rng.choice([1, 2, 3, 4])
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
        shape = rows_shape(rng.random(), rng.random() * 0.05, rng.random() * 3, rng.choice([None, 60.0, 200.0]), world)

        cost = rows_cost(shape)
        fixed = rng.random() * 3

        def idle(
            g: int,
            fixed: float = fixed,
            world: int = world,
            shape: Callable[..., float | None] = shape,
            s0: int = min(lengths),
        ) -> float:
            alone = shape(s0, 1, g)  # no dearer than the shortest row alone (the rule assign_rows holds it to)
            raw = fixed * (g < world) * rng.random() + 0.3 * g / world
            return raw if alone is None else min(raw, alone)

        for busy, idle_cost in ((False, None), (True, None), (False, idle)):
            idles = {g: idle_cost(g) for g in range(1, world + 1)} if idle_cost else {}
            priced = idles.__getitem__ if idle_cost else None
            found = assign_rows(lengths, world, shape, busy, priced)
            reference = brute_force(lengths, world, cost, busy, priced)
            assert (found is None) == (reference is None), f"trial {trial}: {found} vs {reference}"
            if found is None or reference is None:
                continue
            check(found, lengths, world)
            assert found.time == pytest.approx(reference.time, rel=1e-12), f"trial {trial}: {found} vs {reference}"
            assert not busy or all(found.groups), found
            for members, g, t in zip(found.groups, found.sizes, found.times):
                assert t == (cost(tuple(lengths[i] for i in members), g) if members else idles.get(g, 0.0))
            assert assign(lengths, world, cost, all_busy=busy, shape=shape, idle=priced) == found


def test_rows_solver_matches_brute_force_at_eight_ranks() -> None:
    """At 8 ranks (ten layouts, up to 15 orders each) on a few rows, with idle groups priced."""
    rng = random.Random(11)
    for trial in range(40):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))]
        shape = rows_shape(rng.random(), rng.random() * 0.05, rng.random() * 3, rng.choice([None, 60.0]), 8)

        cost = rows_cost(shape)
        alone = {g: shape(min(lengths), 1, g) for g in (1, 2, 4, 8)}
        idles = {g: min(0.3 * g / 8, alone[g] if alone[g] is not None else math.inf) for g in (1, 2, 4, 8)}
        for priced in (None, idles.__getitem__):
            found = assign_rows(lengths, 8, shape, idle=priced)
            reference = brute_force(lengths, 8, cost, idle=priced)
            assert (found is None) == (reference is None), f"trial {trial}: {found} vs {reference}"
            if found is not None and reference is not None:
                check(found, lengths, 8)
                assert found.time == pytest.approx(reference.time, rel=1e-12), f"trial {trial}"


def test_an_idle_group_is_priced_at_its_placeholder_step() -> None:
    """One row on 4 ranks, cheapest on one rank: for free, the layout ``2+1+1`` (first in :func:`layouts` order)
    ties with ``1+1+1+1`` and wins, leaving a group of 2 to run its placeholder step with its collectives; priced at
    that step (dearer the larger the group), ``1+1+1+1`` wins."""

    def shape(s: int, b: int, g: int) -> float:
        return 1.0 + 0.5 * (g - 1)  # the fixed part of a step, collectives for g > 1

    def cost(lengths: tuple[int, ...], g: int) -> float:
        return shape(max(lengths), len(lengths), g)

    def idle(g: int) -> float:
        return shape(g, 1, g)

    assert assign_rows([100], 4, shape).sizes == (2, 1, 1)
    found = assign_rows([100], 4, shape, idle=idle)
    assert found is not None and found.sizes == (1, 1, 1, 1) and found.time == 1.0
    assert brute_force([100], 4, cost, idle=idle).time == 1.0  # type: ignore[union-attr]
    assert assign_exact([100], 4, cost, idle=idle).sizes == (1, 1, 1, 1)  # type: ignore[union-attr]
    assert assign_greedy([100], 4, cost, idle=idle).sizes == (1, 1, 1, 1)  # type: ignore[union-attr]


def test_rows_solver_needs_few_cost_evaluations_on_many_rows() -> None:
    """173 rows on 4 ranks (the benchmark's shortest global batch): ``O(k n)`` lookups per layout and order,
    not the greedy search's ``O(n^2)`` per move (850 distinct evaluations)."""
    rng = random.Random(3)
    lengths = [rng.randint(8, 23) for _ in range(173)]
    shape = rows_shape(1e-3, 1e-5, 0.5, 2000.0, 4)
    calls = [0]

    def counted(s: int, b: int, g: int) -> float | None:
        calls[0] += 1
        return shape(s, b, g)

    found = assign_rows(lengths, 4, counted, all_busy=True)
    check(found, lengths, 4)
    assert calls[0] < 2_000, calls[0]
    assert found == assign_rows(lengths, 4, shape, all_busy=True)  # deterministic


def test_rows_solver_matches_brute_force_at_sixteen_ranks() -> None:
    """At 16 ranks (36 layouts, up to 16 groups each) on three rows: the programme over the multisets of sizes left
    takes every order of a layout's sizes into account, as enumerating them did."""
    rng = random.Random(13)
    for trial in range(12):
        lengths = [rng.randint(16, 200) for _ in range(rng.randint(1, 3))]
        shape = rows_shape(rng.random(), rng.random() * 0.05, rng.random() * 3, rng.choice([None, 150.0]), 16)

        cost = rows_cost(shape)
        found = assign_rows(lengths, 16, shape)
        reference = brute_force(lengths, 16, cost)
        assert (found is None) == (reference is None), f"trial {trial}: {found} vs {reference}"
        if found is not None and reference is not None:
            check(found, lengths, 16)
            assert found.time == pytest.approx(reference.time, rel=1e-12), f"trial {trial}"


def test_rows_solver_scales_to_thirty_two_ranks() -> None:
    """117 rows on 32 ranks (202 layouts, 47 million orders of their sizes, 3.5 million for one, which the solver
    once enumerated): the programme keeps one row per multiset of sizes left, and looks up each cost once."""
    rng = random.Random(5)
    lengths = [rng.randint(4, 35) for _ in range(117)]
    shape = rows_shape(1e-3, 1e-5, 0.5, 400.0, 32)
    calls: list[tuple[int, int, int]] = []

    def counted(s: int, b: int, g: int) -> float | None:
        calls.append((s, b, g))
        return shape(s, b, g)

    found = assign_rows(lengths, 32, counted)
    check(found, lengths, 32)
    assert found is not None and len(calls) < 20_000, len(calls)
    assert len(calls) - len(set(calls)) <= 6, "a shape priced again (an idle group's one-row price aside)"
    for g in (1, 2, 4, 8, 16, 32):  # no worse than any one group size alone, rows dealt longest first
        k = 32 // g
        even = assign_rows(lengths, k, lambda s, b, _g, g=g: shape(s, b, g), all_busy=len(lengths) >= k)
        if even is not None and even.sizes == (1,) * k:
            assert found.time <= even.time * (1 + 1e-12)


def test_assign_is_deterministic_and_switches_to_the_approximation() -> None:
    cost = packed_cost(1e-6, 1e-4, 1e-4, 0.01, 10**9)
    lengths = [100, 3000, 50, 800, 800, 20]
    assert assign(lengths, 4, cost) == assign(lengths, 4, cost) == assign_exact(lengths, 4, cost)
    many = [random.Random(1).randint(16, 4096) for _ in range(14)]
    assert assign(many, 8, cost, exact_up_to=10) == assign_greedy(many, 8, cost)


def test_on_the_cost_model_short_sequences_get_groups_of_their_own() -> None:
    """llama-7b on 8x A100 (cluster file): a step of one very long sequence, and a step of shorter ones."""
    config = CONFIGS["llama-7b"]
    planners = {g: make_planner(config, g, 74 * 2**30, CLUSTER) for g in (1, 2, 4, 8)}

    def seq_cost(s: int, g: int) -> float | None:
        try:
            return planners[g].step(s, 1).time_s
        except PlanInfeasible:
            return None

    cost = sequential_cost(seq_cost)
    long = [65536, 2048, 4096, 1024]  # 64K tokens fit only the memory of all 8 GPUs: one group, everything in it
    found = assign(long, 8, cost)
    check(found, long, 8)
    assert found is not None and found.sizes == (8,)
    mixed = [4096, 4096, 1024, 1024, 1024, 1024, 1024, 1024]  # shorter: groups side by side beat one 8-way split
    found = assign(mixed, 8, cost)
    check(found, mixed, 8)
    one_group = cost(tuple(mixed), 8)
    assert found is not None and one_group is not None and found.time < 0.8 * one_group, (found, one_group)
    assert len(found.sizes) > 1 and max(found.sizes) < 8, found
    print(found, f"one group of 8: {one_group:.3f} s")


def test_at_eight_ranks_many_short_rows_go_data_parallel_on_the_strategys_own_cost() -> None:
    """The strategy's cost of a group's rows (:func:`~lightning_paradyse.groups.cost.group_shape_cost`: the planner
    of each group size on the machine of every size, plus the weight exchange) at p = 8 on an 8x H100 node: a batch
    of many short rows (16-510 tokens, the quick benchmark's kind) is split into groups of one when that is what the
    cost predicts fastest, and a long sequence stays on one group of 8."""
    from lightning_paradyse.cost.dims import dims_from_config
    from lightning_paradyse.groups.cost import group_shape_cost, machine_for_groups

    cluster = CLUSTER.with_name("h100-80gb-nvlink-8.yaml")
    world = 8
    top = make_planner(CONFIGS["llama-tiny"], world, 70 * 2**30, cluster)
    machine = machine_for_groups(top.model.machine, world)
    planners = {  # as the strategy's runner makes them (a group of one: tp_sp, metp where tp_sp does not fit)
        g: make_planner(CONFIGS["llama-tiny"], g, 70 * 2**30, machine, modes, prefer_tp_sp=prefer)
        for g in (1, 2, 4)
        for modes, prefer in [group_planning(g, top.modes)]
    } | {world: top}
    dims = dims_from_config(CONFIGS["llama-tiny"], top.model.dims.dtype_bytes)
    shape = group_shape_cost(dims, world, planners.__getitem__)

    def cost(lengths: tuple[int, ...], g: int) -> float | None:
        return shape(max(lengths), len(lengths), g)

    rows = [random.Random(8).randint(16, 510) for _ in range(64)]
    found = assign(rows, world, cost, all_busy=True, shape=shape)
    check(found, rows, world)
    assert found is not None
    one_group = cost(tuple(rows), world)
    data_parallel = assign_rows(rows, world, lambda s, b, g: shape(s, b, g) if g == 1 else None, all_busy=True)
    assert one_group is not None and data_parallel is not None
    assert data_parallel.time < one_group  # its numbers: a group of 8 pays its collectives on little work
    assert found.sizes == (1,) * world and found.time == data_parallel.time, (found, one_group)
    print(f"p=8, 64 rows: split {found.sizes}, {found.time * 1e3:.3f} ms; one group {one_group * 1e3:.3f} ms")
    long = [8192]
    found = assign(long, world, cost, all_busy=True, shape=shape)
    assert found is not None and found.sizes == (world,)
