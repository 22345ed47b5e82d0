"""The exact planner against brute-force enumeration, and the planner's contract.

* Exactness: on random cost tables for 3 layers x 2 ops x (3 modes x 2 recompute flags) -- 46,656 plans
  each -- with switching costs and per-mode buffers, the dynamic programme's plan is as fast as the
  fastest plan any enumeration finds within the budget, never over the budget, infeasible exactly
  when enumeration finds nothing, and :func:`min_peak` equals the enumerated minimum.
* The infeasibility error names the length, the budget and the least memory any plan needs.
* Determinism (two planners, same plans) and caching by length bucket.
* Speed on a realistic instance (80 layers, 4 modes x 2 flags) and the planner on a real cost model
  (every shipped cluster, Llama-7B): the adaptive planner's largest trainable length is at least every
  single mode's, as exact planning guarantees.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_paradyse.calibration.profile import ONE_RANK_MODES, load_profile
from lightning_paradyse.cost.cluster import load_cluster
from lightning_paradyse.cost.dims import dims_from_config, dims_from_module
from lightning_paradyse.cost.model import CostModel, OpCalibration, calibration_key
from lightning_paradyse.cost.search import Choice, PlanProblem, all_plans, evaluate, exhaustive, min_peak, solve
from lightning_paradyse.models import CONFIGS, build_model
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.plan import Plan, uniform_plan
from lightning_paradyse.planning.planner import (
    CostPlanner,
    PlanInfeasible,
    PlanSkipped,
    forget_solutions,
    group_calibration,
    group_planning,
    make_planner,
    to_plan,
)
from lightning_paradyse.runtime.parallel import parallelize

CLUSTERS = sorted((Path(__file__).resolve().parents[2] / "configs" / "clusters").glob("*.yaml"))


def random_problem(rng: np.random.Generator, layers: int = 3, switch: bool = True, buffers: bool = True) -> PlanProblem:
    """Random integer memory tables, float times; one mode is not allowed for the MLP half the time."""
    choices = tuple(Choice(m, rc) for m in ("a", "b", "c") for rc in (False, True))
    C, K = len(choices), 2 * layers
    mlp_allowed = tuple(c for c in range(C) if rng.random() < 0.5 or choices[c].mode != "c")
    sw = rng.uniform(0, 3, (C, C)) if switch else None
    if sw is not None:
        np.fill_diagonal(sw, 0.0)
    return PlanProblem(
        choices=choices,
        ops=tuple(k % 2 for k in range(K)),
        allowed=(tuple(range(C)), mlp_allowed),
        time=rng.uniform(1, 10, (2, C)),
        saved=rng.integers(0, 100, (2, C)),
        fwd=rng.integers(0, 100, (2, C)),
        bwd=rng.integers(0, 100, (2, C)),
        fwd_offset=np.full(K, int(rng.integers(0, 20))),
        bwd_offset=np.sort(rng.integers(0, 50, K))[::-1].copy(),
        end_need=int(rng.integers(0, 50)),
        fixed_need=int(rng.integers(0, 100)),
        static=int(rng.integers(0, 30)),
        switch=sw,
        buffers={m: int(rng.integers(0, 60)) for m in "abc"} if buffers else {},
        base_time=1.5,
    )


@pytest.mark.parametrize("seed", range(8))
def test_dynamic_programme_is_exact(seed: int) -> None:
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, switch=seed % 2 == 0, buffers=seed % 4 < 2)
    seqs, _times, peaks = all_plans(problem)
    assert len(seqs) == 6**3 * len(problem.allowed[1]) ** 3
    least = min_peak(problem)
    assert least is not None and least.peak == peaks.min()
    for budget in (least.peak - 1, least.peak, *np.quantile(peaks, [0.1, 0.5, 0.9]).astype(int), peaks.max()):
        found, reference = solve(problem, budget), exhaustive(problem, budget)
        if reference is None:
            assert found is None, f"budget {budget}: the programme found a plan enumeration says cannot fit"
            continue
        assert found is not None, f"budget {budget}: a plan fits but the programme found none"
        assert found.time == pytest.approx(reference.time, rel=1e-12)
        assert found.peak <= budget
        assert evaluate(problem, found.seq) == (found.time, found.peak)


def _tiny_planner(budget: int, **kwargs: object) -> CostPlanner:
    config = dataclasses.replace(CONFIGS["llama-tiny"], n_layers=3)
    cluster = load_cluster(CLUSTERS[0])
    model = CostModel(dims_from_config(config, 4), 2, cluster.machine(), optimizer_bytes_per_param=8)
    return CostPlanner(model, budget, **kwargs)  # type: ignore[arg-type]


def test_real_cost_tables_match_enumeration_and_respect_the_budget() -> None:
    planner = _tiny_planner(2**30)
    problem = planner.problem(4096, 1)
    _, _, peaks = all_plans(problem)
    for budget in np.quantile(peaks, [0.0, 0.05, 0.3, 0.7, 1.0]).astype(int):
        found, reference = solve(problem, budget), exhaustive(problem, budget)
        assert (found is None) == (reference is None)
        if found is not None and reference is not None:
            assert found.time == pytest.approx(reference.time, rel=1e-12) and found.peak <= budget
            plan = to_plan(problem, found.seq)
            assert planner.model.plan_cost(plan, 4096, 1) == pytest.approx((found.time, found.peak))


def test_infeasible_budget_names_length_budget_and_minimum() -> None:
    planner = _tiny_planner(2**30)
    least = planner.minimum(50_000, 2)
    assert least is not None
    tight = _tiny_planner(least.peak - 1)
    with pytest.raises(PlanInfeasible) as err:
        tight.plan(50_000, 2)
    message = str(err.value)
    assert "50000 tokens" in message and "2 x" in message
    assert str(least.peak - 1) in message and str(least.peak) in message
    assert err.value.minimum == least.peak and err.value.budget == least.peak - 1
    assert _tiny_planner(least.peak).step(50_000, 2).peak_bytes <= least.peak
    skipping = _tiny_planner(least.peak - 1, on_infeasible="skip")
    with pytest.raises(PlanSkipped):
        skipping.plan(50_000, 2)
    assert skipping.skipped == 1
    assert "allow" not in message, "every memory-saving option was allowed: the fix does not ask for them"
    narrow = _tiny_planner(1, modes=("tp_sp", "ulysses"), recompute=(False,))
    with pytest.raises(PlanInfeasible, match="or allow recompute and metp"):
        narrow.plan(1024, 1)


def test_plans_are_deterministic_and_cached_by_bucket() -> None:
    forget_solutions()
    a = _tiny_planner(40 * 2**20)
    lengths = [700, 1024, 1025, 3000, 513, 2048, 700]
    first = [a.plan(s, 1) for s in lengths]
    forget_solutions()  # b searches every shape itself (as another process would)
    b = _tiny_planner(40 * 2**20)
    assert first == [b.plan(s, 1) for s in lengths]
    assert sorted(a._cache) == [(1024, 1), (1536, 1), (2048, 1), (3072, 1)]
    step = a.step(700, 1)
    assert step.seq_len == 1024 and a.step(513, 1) is step  # one search per bucket, for its upper end
    assert a.step(1025, 1).seq_len == 1536
    assert isinstance(a.plan(700, 1), Plan) and len(a.plan(700, 1)) == 3


def test_a_planner_made_again_alike_finds_its_searches_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fit, validation and test call makes and warms its planners: one made for the same cost model, budget
    and options as an earlier one in the process takes what that one's searches found (the same plans, searched
    once); another budget, another profile or other modes search anew."""
    import lightning_paradyse.planning.planner as planner_module

    forget_solutions()
    searched: list[tuple[int, int]] = []
    real = CostPlanner._search_plan

    def counted(self: CostPlanner, seq_len: int, batch: int) -> object:
        searched.append((seq_len, batch))
        return real(self, seq_len, batch)

    monkeypatch.setattr(CostPlanner, "_search_plan", counted)
    budget = _tiny_planner(2**30).step(100, 40).peak_bytes
    first = _tiny_planner(budget)
    shapes = [(s, b) for s in (7, 100, 129, 700) for b in (1, 3, 40, 65)]
    plans = [first.try_step(s, b) for s, b in shapes]
    assert searched and first.warm(4096) > 0
    done = len(searched)
    again = _tiny_planner(budget)
    assert [again.try_step(s, b) for s, b in shapes] == plans and again.warm(4096) > 0
    assert len(searched) == done  # nothing searched again: every answer, feasible or not, kept
    other = _tiny_planner(budget + 1)
    other.try_step(100, 40)
    assert len(searched) == done + 1  # another budget: another configuration
    modes = _tiny_planner(budget, modes=("tp_sp", "ulysses"))
    modes.try_step(100, 40)
    assert len(searched) == done + 2
    for n in range(planner_module.SOLVED_CONFIGS + 1):  # the least recently made configuration is dropped
        _tiny_planner(budget + 2 + n)
    _tiny_planner(budget).try_step(100, 40)
    assert len(searched) == done + 3


def test_batches_are_planned_per_power_of_two_bucket() -> None:
    """A step of ``b`` sequences is planned for the next power of two (one search per bucket); the group cost
    interpolates the time between the buckets around ``b``, monotone in ``b``."""
    from lightning_paradyse.groups.cost import planner_step_time

    planner = _tiny_planner(2**30)
    step = planner.step(700, 3)
    assert (step.seq_len, step.batch) == (1024, 4) and planner.step(1000, 4) is step
    assert planner.step(700, 5).batch == 8 and planner.step(700, 1).batch == 1
    times = [planner_step_time(planner.model.dims, lambda g: planner)(1024, b, 2) for b in range(1, 17)]
    assert all(t is not None for t in times)
    assert times == sorted(times) and times[3] == planner.step(1024, 4).time_s  # type: ignore[type-var]
    assert times[2] == pytest.approx((planner.step(1024, 2).time_s + planner.step(1024, 4).time_s) / 2)


def test_warming_plans_ahead_what_steps_would_plan_and_stops_at_the_budget() -> None:
    """``warm`` plans the bucket tops short batches fall in, the same plans :meth:`step` makes on first sight; rows
    stop doubling where the budget or the token cap is reached."""
    probe = _tiny_planner(2**30, bucket_tokens=64)
    budget = probe.step(16, 8).peak_bytes  # 16 rows of 16 tokens (or 8 of 32) no longer fit
    warmed, cold = _tiny_planner(budget, bucket_tokens=64), _tiny_planner(budget, bucket_tokens=64)
    planned = warmed.warm(max_tokens=256)
    assert planned == len(warmed._cache) + len(warmed._infeasible)
    assert {s for s, _ in warmed._cache} == {2, 4, 8, 16, 32, 64}  # lengths from p = 2 tokens up to the bucket
    assert all(s * b <= 256 for s, b in [*warmed._cache, *warmed._infeasible])
    assert (16, 8) in warmed._cache and (16, 16) in warmed._infeasible and (16, 32) not in warmed._infeasible
    for s, b in sorted(warmed._cache):
        assert warmed.step(s, b) == cold.step(s, b)
    assert warmed.warm(max_tokens=256) == 0  # nothing left to plan
    before = dict(warmed._cache)
    for s, b in ((3, 3), (9, 3), (17, 2), (30, 2), (64, 1)):
        warmed.plan(s, b)  # decisions on shapes whose bucket fits plan nothing new
    assert warmed._cache == before


def test_probing_a_shape_counts_nothing_and_skips_more_rows_of_a_length_that_did_not_fit() -> None:
    """``try_step`` answers ``None`` for a shape nothing fits without counting a skipped batch, and does not search
    more rows of a length that did not fit; ``step`` searches every batch it is given and counts a skip."""
    planner = _tiny_planner(_tiny_planner(2**30).step(100, 40).peak_bytes, on_infeasible="skip")  # (128, 64) fits
    assert planner.try_step(100, 40) is not None
    assert planner.try_step(128, 4096) is None and planner.skipped == 0  # a probe: nothing counted or logged
    searched = len(planner._cache) + len(planner._infeasible)
    assert planner.try_step(128, 5000) is None  # more rows of a length that did not fit: not searched
    assert len(planner._cache) + len(planner._infeasible) == searched
    with pytest.raises(PlanSkipped):
        planner.step(128, 5000)  # a batch: searched, skipped and counted
    assert planner.skipped == 1 and len(planner._cache) + len(planner._infeasible) > searched


def test_bucket_top_infeasible_falls_back_to_the_length_itself() -> None:
    probe = _tiny_planner(2**30, bucket_tokens=4096)
    budget = probe.minimum(4000, 1).peak  # type: ignore[union-attr]
    planner = _tiny_planner(budget, bucket_tokens=4096)
    assert not planner.fits(4096, 1)
    assert planner.step(4000, 1).seq_len == 4000


def test_shapes_near_the_budget_share_fine_row_buckets_and_fit_exactly_when_their_own_shape_fits() -> None:
    """Where a coarse bucket's upper end does not fit, a shape is planned for its length with its fine bucket's
    rows, or with the most rows of the fine bucket that fit: never fewer than its own, at most one fine step more,
    and it fits exactly when the shape itself fits (what the shape's own search says)."""
    probe = _tiny_planner(2**30)
    budget = probe.step(100, 40).peak_bytes  # (128, 64) fits, (128, 128) or (256, 64) do not
    planner, exact = _tiny_planner(budget), _tiny_planner(budget)
    near = [(s, b) for s in range(90, 141, 7) for b in range(33, 130, 3)]
    for s, b in near:
        found, own = planner.try_step(s, b), exact._solve(s, b)
        assert (found is None) == (own is None), (s, b)
        if found is None or own is None:
            continue
        if (found.seq_len, found.batch) != planner.coarse(s, b):  # the coarse bucket did not fit
            assert exact._solve(*planner.coarse(s, b)) is None, (s, b)
            assert found.seq_len == s and b <= found.batch <= planner.fine_rows(b), (s, b, found)
        assert found.peak_bytes <= budget and found.time_s >= own.time_s * (1 - 1e-12)
    assert [planner.fine_rows(b) for b in (1, 5, 16, 17, 37, 65, 72, 73, 129)] == [1, 5, 16, 18, 40, 72, 72, 80, 144]
    assert len(planner._cache) + len(planner._infeasible) < len(near) / 2  # the shapes share their searches


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny", "bert-tiny"])
def test_a_group_of_one_rules_out_longer_shapes_by_one_that_did_not_fit(name: str) -> None:
    """On one rank nothing is split, so the least memory any plan needs grows with the length as it does with the
    rows: a shape that did not fit rules out every longer one with as many rows. The planner of a group of one then
    answers every shape as the shape's own search does, with fewer searches than one that rules out by the length
    alone (a larger group's, whose uneven splits pay padded buffers)."""
    config = dataclasses.replace(CONFIGS[name], n_layers=3)
    model = CostModel(dims_from_config(config, 4), 1, load_cluster(CLUSTERS[0]).machine(), optimizer_bytes_per_param=8)
    probe = CostPlanner(model, 2**40)
    lengths, rows = range(1, 400, 13), (1, 2, 3, 5, 8, 13, 21, 34)
    least = np.array([[min_peak(probe.problem(s, b)).peak for b in rows] for s in lengths])  # type: ignore[union-attr]
    assert np.diff(least, axis=0).min() >= 0 and np.diff(least, axis=1).min() >= 0
    budget = int(min_peak(probe.problem(200, 12)).peak)  # type: ignore[union-attr]
    planner, exact, by_length = CostPlanner(model, budget), CostPlanner(model, budget), CostPlanner(model, budget)
    by_length._length_grows = False
    shapes = [(s, b) for s in range(150, 260, 9) for b in range(3, 30, 2)]
    answers = [(planner.try_step(s, b) is None, by_length.try_step(s, b) is None) for s, b in shapes]
    own = [exact._solve(s, b) is None for s, b in shapes]
    assert [a for a, _ in answers] == own == [b for _, b in answers]
    assert 0 < sum(own) < len(shapes)  # shapes that fit and shapes that do not

    def searched(p: CostPlanner) -> int:
        return len(p._cache) + len(p._infeasible)

    assert searched(planner) < searched(by_length), (searched(planner), searched(by_length))


def test_speed_on_80_layers() -> None:
    config = CONFIGS["llama-70b"]
    cluster = load_cluster(CLUSTERS[0])
    model = CostModel(dims_from_config(config, 2), 8, cluster.machine(), optimizer_bytes_per_param=0)
    problem = model.problem(65536, 1)
    assert problem.n_positions == 160 and len(problem.choices) == 8
    least = min_peak(problem)
    assert least is not None
    start = time.perf_counter()
    for budget in (least.peak, int(least.peak * 1.2), int(least.peak * 2)):
        assert solve(problem, budget) is not None
    per_solve = (time.perf_counter() - start) / 3
    assert per_solve < 0.5, f"{per_solve * 1e3:.1f} ms per solve"


@pytest.mark.parametrize("cluster_path", CLUSTERS, ids=[p.stem for p in CLUSTERS])
def test_adaptive_trains_at_least_as_long_as_every_mode(cluster_path: Path) -> None:
    cluster = load_cluster(cluster_path)
    model = CostModel(
        dims_from_config(CONFIGS["llama-7b"], 2), cluster.gpus, cluster.machine(), optimizer_bytes_per_param=12
    )
    for recompute in ((False,), (False, True)):
        planner = CostPlanner(model, cluster.budget_bytes(), recompute=recompute)
        adaptive = planner.largest_length()
        single = {m: planner.largest_length(modes=[m]) for m in MODES}
        assert adaptive > 0 and all(adaptive >= n for n in single.values()), (adaptive, single)
        assert planner.fits(adaptive, 1) and not planner.fits(adaptive + 1, 1)
        step = planner.step(adaptive, 1)
        assert step.peak_bytes <= cluster.budget_bytes()


def test_planner_from_a_parallelized_module() -> None:
    torch.manual_seed(0)
    module = build_model(CONFIGS["llama-tiny"])
    parallelize(module, None)
    dims = dims_from_module(module)
    assert dims == dims_from_config(CONFIGS["llama-tiny"], 4)
    planner = make_planner(module, 2, 2**30, CLUSTERS[0])
    plan = planner.plan(600, 1)
    assert len(plan) == CONFIGS["llama-tiny"].n_layers


def test_a_model_mixing_sliding_and_full_layers_is_planned_per_layer() -> None:
    """Llama-7B's widths with a full layer and a sliding one (window 4,096) at 32K tokens on 8 GPUs: the cost tables
    have a row per window, each attention position reads its layer's, the search stays exact (against enumeration),
    and under tight budgets the two layers' attentions get different modes."""
    cluster = load_cluster(CLUSTERS[0])
    dims = dims_from_config(dataclasses.replace(CONFIGS["llama-7b"], n_layers=2), 2)
    model = CostModel(dataclasses.replace(dims, windows=(None, 4096)), 8, cluster.machine())
    s = 32768
    problem = model.problem(s, 1)
    assert problem.ops == (0, 1, 2, 1) and problem.time.shape == (3, len(problem.choices))
    for c, ch in enumerate(problem.choices):
        assert problem.time[0, c] == model.op_cost(ch.mode, "attention", ch.recompute, s, 1).time_s
        assert problem.time[2, c] == model.op_cost(ch.mode, "attention", ch.recompute, s, 1, window=4096).time_s
        assert problem.time[2, c] < problem.time[0, c]
    least = min_peak(problem)
    assert least is not None
    differs = 0
    for budget in np.linspace(least.peak, 2 * least.peak, 12).astype(int):
        best, brute = solve(problem, budget), exhaustive(problem, budget)
        assert best is not None and brute is not None
        assert best.time == pytest.approx(brute.time) and best.peak <= budget
        plan = to_plan(problem, best.seq)
        assert model.plan_cost(plan, s, 1) == pytest.approx((best.time, best.peak))
        differs += plan.layers[0].attention != plan.layers[1].attention
    assert differs > 0
    mirrored = CostModel(dataclasses.replace(dims, windows=(4096, None)), 8, cluster.machine()).problem(s, 1)
    assert mirrored.ops == (0, 1, 2, 1) and np.array_equal(mirrored.time[[2, 1, 0]], problem.time)


def test_a_group_of_one_takes_tp_sp_whenever_it_fits() -> None:
    """The planner of a group of one rank (:func:`group_planning`, on the shipped CPU profile's machine as the runner
    makes it) plans ``tp_sp`` everywhere whenever that fits the budget: on one rank the modes compute the same thing
    and ``tp_sp``'s path is the plain one. Left to its predictions it would give one 512-token row ``metp`` attention,
    which runs slower (``benchmarks/single_rank_modes.py``). Within a budget ``tp_sp`` does not fit it takes a plan
    that does."""
    from lightning_paradyse.groups.cost import machine_for_groups

    profile = Path(__file__).resolve().parents[2] / "configs" / "profiles" / "cpu-2proc-llama-tiny.json"
    world = make_planner(CONFIGS["llama-tiny"], 2, 2**30, str(profile))
    machine = machine_for_groups(world.model.machine, 2)
    modes, prefer = group_planning(1, world.modes)
    assert set(modes) == {"tp_sp", "metp"} == set(ONE_RANK_MODES)  # what a profile measures a group of one in
    simple = uniform_plan("tp_sp", CONFIGS["llama-tiny"].n_layers)
    unpreferred = make_planner(CONFIGS["llama-tiny"], 1, 2**30, machine, modes)
    assert unpreferred.plan(512, 1) != simple  # what the predictions alone choose
    roomy = make_planner(CONFIGS["llama-tiny"], 1, 2**30, machine, modes, prefer_tp_sp=prefer)
    for s, b in [(16, 47), (69, 4), (512, 1), (2048, 2)]:
        assert roomy.plan(s, b) == simple, (s, b)
    need = roomy.model.plan_cost(simple, 2048, 2)[1]
    least = roomy.minimum(2048, 2)
    assert least is not None and least.peak < need
    budget = (least.peak + need) // 2
    tight = make_planner(CONFIGS["llama-tiny"], 1, budget, machine, modes, prefer_tp_sp=prefer)
    step = tight.step(2048, 2)
    assert step.plan != simple and step.peak_bytes <= budget


def test_a_group_of_one_is_priced_on_its_profiled_constants() -> None:
    """A profile that measured a group of one (``calibration_one``) gives that group's planner its constants
    (:func:`group_calibration`, as the runner makes the planner); older profiles price it on the machine's rates,
    larger groups on the world's constants."""
    from lightning_paradyse.groups.cost import machine_for_groups

    shipped = load_profile(Path(__file__).resolve().parents[2] / "configs" / "profiles" / "cpu-2proc-llama-tiny.json")
    assert not shipped.calibration_one  # written before a group of one was measured
    fixed = 0.01  # seconds per segment, far above what the machine's rates give a tiny model
    one = {k: OpCalibration(time_fixed=fixed) for k in ("tp_sp/attention", "tp_sp/mlp", "head")}
    profile = dataclasses.replace(shipped, calibration_one=one)
    world = make_planner(CONFIGS["llama-tiny"], 2, 2**30, profile)
    assert group_calibration(1, world.model) == one
    assert group_calibration(2, world.model).keys() == world.model.calibration.keys()
    assert group_calibration(1, make_planner(CONFIGS["llama-tiny"], 2, 2**30, shipped).model) == {}
    machine = machine_for_groups(world.model.machine, 2)
    modes, prefer = group_planning(1, world.modes)
    priced = make_planner(
        CONFIGS["llama-tiny"],
        1,
        2**30,
        machine,
        modes,
        prefer_tp_sp=prefer,
        calibration=group_calibration(1, world.model),
    )
    raw = make_planner(CONFIGS["llama-tiny"], 1, 2**30, machine, modes, prefer_tp_sp=prefer)
    layers = CONFIGS["llama-tiny"].n_layers
    for s, b in [(16, 47), (512, 1)]:
        extra = (2 * layers + 1) * (fixed - machine.op_overhead_s)  # every segment's fixed seconds, and the head's
        assert priced.step(s, b).time_s == pytest.approx(raw.step(s, b).time_s + extra, rel=1e-9), (s, b)


def test_a_group_between_one_rank_and_the_world_is_priced_on_the_worlds_constants() -> None:
    """A group of 2 of 4 ranks runs the world's modes with their collectives: the world's per-op constants price its
    segments (on the machine's rates alone they had no per-op overhead: such a group looked cheaper than it runs)."""
    from lightning_paradyse.groups.cost import machine_for_groups

    shipped = load_profile(Path(__file__).resolve().parents[2] / "configs" / "profiles" / "cpu-2proc-llama-tiny.json")
    dims = dims_from_config(CONFIGS["llama-tiny"], 4)
    world = CostModel(dims, 4, shipped.machine, calibration=shipped.calibration)
    for g in (2, 4):  # the world's times; its memory factors left at one (what fits a group does not move)
        got = group_calibration(g, world)
        assert got.keys() == shipped.calibration.keys()
        for key, cal in got.items():
            world_cal = shipped.calibration[key]
            assert (cal.time_fixed, cal.time_scale) == (world_cal.time_fixed, world_cal.time_scale)
            assert (cal.saved, cal.fwd, cal.bwd) == (1.0, 1.0, 1.0)
    machine = machine_for_groups(world.machine, 4)
    priced = make_planner(dims, 2, 2**30, machine, calibration=group_calibration(2, world))
    raw = make_planner(dims, 2, 2**30, machine)
    for mode, op in (("tp_sp", "attention"), ("ring", "mlp")):
        key = calibration_key(mode, op, False)
        assert shipped.calibration[key].time_fixed > 0  # milliseconds on two CPU processes
        cal, plain = priced.model.op_cost(mode, op, False, 512, 1), raw.model.op_cost(mode, op, False, 512, 1)
        assert cal.time_s > plain.time_s + shipped.calibration[key].time_fixed / 2, (mode, op)
        assert (cal.saved, cal.fwd, cal.bwd) == (plain.saved, plain.fwd, plain.bwd), (mode, op)
