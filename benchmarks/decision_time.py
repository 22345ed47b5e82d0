"""How long the group decision takes per step: the split of the ranks, the rows of each group and their plans.

    python benchmarks/decision_time.py [--world 2 4 8] [--rows 8 32 173]
    python benchmarks/decision_time.py --traces [--world 8]   # every step of the full benchmark's traces

For the benchmark's model (:class:`benchmarks.settings.ModelSettings`) on a cluster file's cost model, with a 64 MiB
per-rank budget, it times :func:`lightning_paradyse.groups.solver.assign` on the rows of one ordinary batch (random
lengths under a 4,096-token budget, as the benchmark's global batches hold them), the way
:class:`~lightning_paradyse.groups.GroupRunner` calls it: *cold* (fresh planners: every bucket the decision touches
is searched once), *after the setup's warm-up* (fresh planners that planned ahead the short batches' buckets, as the
strategy's setup does: what the first steps of a fit pay), and *warm* (the same decision again: what a new batch of
shapes seen before pays; a batch seen before keeps its split in a fit, without a search:
:meth:`~lightning_paradyse.groups.GroupRunner._assign`), with the warm-up's own time (paid once, at setup). Prints
one line per world size and row count. ``--traces`` replays the full benchmark's traces instead, batch by batch as
one fit decides them, and prints each trace's mean, median and largest decision time a step, and how much of all of
it Python's garbage collector took (a full collection walks every object of the process: 50-200 ms on this
repository's CPU machine). The setup's objects meet one full collection before the first decision, as the strategy's
setup ends.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.settings import BenchSettings, ModelSettings
from benchmarks.workload import Trace, build_trace
from lightning_paradyse.groups import solver
from lightning_paradyse.groups.cost import group_cost, group_shape_cost, placeholder_cost
from lightning_paradyse.groups.runner import WARM_BUCKETS, group_sizes
from lightning_paradyse.models import ModelConfig
from lightning_paradyse.modes import MODES
from lightning_paradyse.planning.planner import CostPlanner, forget_solutions, group_planning, make_planner

ROOT = Path(__file__).resolve().parent.parent


def planners(config: ModelConfig, cluster: str, budget: int) -> Callable[[int], CostPlanner]:
    """Fresh planners, one per group size, made on first use (as :class:`~lightning_paradyse.groups.GroupRunner`
    makes them), as a process's first fit makes them: no search of an earlier set of planners is kept for them
    (:func:`~lightning_paradyse.planning.planner.forget_solutions`; a later fit of one process finds its first
    fit's searches done)."""
    forget_solutions()
    made: dict[int, CostPlanner] = {}

    def planner_for(g: int) -> CostPlanner:
        if g not in made:
            modes, prefer = group_planning(g, MODES)  # as the runner plans a group of g
            made[g] = make_planner(config, g, budget, cluster, modes, bucket_tokens=512, prefer_tp_sp=prefer)
        return made[g]

    return planner_for


def warm(world: int, planner_for: Callable[[int], CostPlanner]) -> float:
    """The setup's planning ahead (:meth:`~lightning_paradyse.groups.GroupRunner.warm`); returns its seconds."""
    start = time.perf_counter()
    for g in group_sizes(world):
        planner = planner_for(g)
        planner.warm(WARM_BUCKETS * planner.bucket_tokens)
    return time.perf_counter() - start


def decider(world: int, planner_for: Callable[[int], CostPlanner]) -> Callable[[list[int]], float]:
    """A fit's decisions: the group cost made once (its shapes cached for the fit, as the runner keeps it); each
    call decides the rows of one batch and plans every group, returning its seconds."""
    dims = planner_for(world).model.dims
    shape = group_shape_cost(dims, world, planner_for)
    cost = group_cost(dims, world, planner_for, packed=False)

    def decide(lengths: list[int]) -> float:
        start = time.perf_counter()
        idle = placeholder_cost(shape, lengths)  # rows: a group may idle, priced as the runner prices it
        found = solver.assign(lengths, world, cost, shape=shape, idle=idle)
        for g, members in zip(found.sizes, found.groups) if found else ():
            if members:  # an idle group runs a placeholder of g tokens
                planner_for(g).plan(max(lengths[i] for i in members), len(members))
            else:
                planner_for(g).plan(g, 1)
        return time.perf_counter() - start

    return decide


def decision_seconds(world: int, rows: int, cluster: str, budget: int, seed: int = 0) -> dict[str, float]:
    """Seconds of one decision on ``rows`` rows over ``world`` ranks: ``cold`` (fresh planners), ``set_up`` (fresh
    planners warmed as the strategy's setup warms them, :meth:`~lightning_paradyse.groups.GroupRunner.warm`),
    ``warm`` (the same decision again), and ``warm_up``: the setup's planning ahead, for all group sizes."""
    config = ModelSettings().config()
    rng = random.Random(seed)
    lengths = [rng.randint(8, max(8, 4096 // rows)) for _ in range(rows)]
    fresh = planners(config, cluster, budget)
    out = {"cold": decider(world, fresh)(lengths)}
    out["warm"] = decider(world, fresh)(lengths)  # the costs are made anew; the planners' buckets known
    set_up = planners(config, cluster, budget)
    out["warm_up"] = warm(world, set_up)
    out["set_up"] = decider(world, set_up)(lengths)
    return out


class CollectorClock:
    """Seconds Python's cyclic garbage collector ran inside the ``with`` block (``gc.callbacks``): a full collection
    walks every object of the process, and one that lands in a decision is counted in its time."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> CollectorClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def trace_seconds(world: int, trace: Trace, cluster: str, budget: int) -> tuple[list[float], float]:
    """Seconds of every step's decision over a trace's global batches, as one fit makes them on a rank: planners
    warmed at setup, then each batch in training order (first sights and shapes seen before, as they come); and the
    seconds of them the garbage collector took (:class:`CollectorClock`)."""
    planner_for = planners(ModelSettings().config(), cluster, budget)
    warm(world, planner_for)
    gc.collect()  # as the strategy's setup ends (its objects met by one full collection before the first step)
    decide = decider(world, planner_for)
    with CollectorClock() as collector:
        times = [decide(trace.batch_lengths(step)) for step in range(len(trace.batches))]
    return times, collector.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64, 173])
    parser.add_argument("--cluster", default=str(ROOT / "configs" / "clusters" / "h100-80gb-nvlink-8.yaml"))
    parser.add_argument("--budget-mib", type=int, default=64)
    parser.add_argument(
        "--traces", action="store_true", help="replay the full benchmark's traces, one fit each, instead of --rows"
    )
    args = parser.parse_args()
    if args.traces:
        full = BenchSettings.full()
        for world in args.world:
            for settings in full.traces:
                trace = build_trace(settings, world, full.batch_tokens)
                seconds, collected = trace_seconds(world, trace, args.cluster, args.budget_mib * 2**20)
                times, collected = [1e3 * t for t in seconds], 1e3 * collected
                rows = [len(b) for b in trace.batches]
                print(
                    f"{world} ranks, {trace.name:7s} ({len(times)} steps of {min(rows)}-{max(rows)} rows): mean "
                    f"{statistics.fmean(times):6.1f} ms, median {statistics.median(times):6.1f} ms, max "
                    f"{max(times):6.1f} ms a step; of all, {collected:5.1f} ms in the garbage collector"
                )
        return
    for world in args.world:
        for rows in args.rows:
            t = {k: 1e3 * v for k, v in decision_seconds(world, rows, args.cluster, args.budget_mib * 2**20).items()}
            print(
                f"{world} ranks, {rows:4d} rows: cold {t['cold']:7.1f} ms, after the setup's warm-up "
                f"{t['set_up']:6.1f} ms, warm {t['warm']:6.1f} ms (warm-up at setup {t['warm_up']:6.0f} ms)"
            )


if __name__ == "__main__":
    main()
