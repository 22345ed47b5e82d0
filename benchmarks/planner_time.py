"""How long the exact planner takes per batch: uncached (a new length bucket) and cached.

    python benchmarks/planner_time.py [--config llama-7b] [--cluster configs/clusters/a100-80gb-nvlink-8.yaml]

Plans a 32-layer model with the four modes and recomputation (8 choices per op) for many lengths,
each in a bucket of its own (uncached: the dynamic programme runs), then the same lengths again
(cached: a dictionary look-up), and prints the median and the worst time of each.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from lightning_paradyse.models import CONFIGS
from lightning_paradyse.planning.planner import PlanInfeasible, make_planner


def _timed(planner: object, lengths: list[int]) -> list[float]:
    times = []
    for length in lengths:
        start = time.perf_counter()
        with contextlib.suppress(PlanInfeasible):
            planner.plan(length, 1)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama-7b", choices=sorted(CONFIGS))
    parser.add_argument("--cluster", default="configs/clusters/a100-80gb-nvlink-8.yaml")
    parser.add_argument("--budget-gib", type=float, default=74.0)
    parser.add_argument("--n", type=int, default=40, help="lengths to plan")
    args = parser.parse_args()
    config = CONFIGS[args.config]
    planner = make_planner(config, 8, int(args.budget_gib * 2**30), args.cluster, bucket_tokens=512)
    lengths = [1024 + 4096 * i for i in range(args.n)]  # every length in a bucket of its own
    uncached = _timed(planner, lengths)
    cached = _timed(planner, lengths)
    print(f"{args.config}: {config.n_layers} layers x 2 ops, 4 modes x recompute, {args.n} lengths, {args.cluster}")
    for name, values in (("uncached", uncached), ("cached", cached)):
        ms = [v * 1e3 for v in values]
        print(f"{name:>9}: median {statistics.median(ms):8.3f} ms   worst {max(ms):8.3f} ms")


if __name__ == "__main__":
    main()
