"""What one collective meeting costs here, for the bytes a data-parallel step of the quick preset moves.

    python benchmarks/meetings.py [--devices 2] [--iters 60] [--compute-ms 4] [--chunks 2]

Every process computes alike for ``--compute-ms`` (matrix products on one thread), then meets the others in one
collective; ``--iters`` times per collective. Prints, per collective, the median wall time of the call on rank 0
after the first tenth of the iterations. The sizes are the quick preset's model
(:meth:`benchmarks.settings.BenchSettings.quick`), ``N`` bytes of float32 weights: DDP's step meets once for an
all-reduce of ``N`` (the gradients) and once for Lightning's broadcast of one flag; ParaDySe's data-parallel step
once for an all-gather of ``N / P`` a rank (the weights, the batch digest with them; on gloo one all-to-all of the
shard repeated ``P`` times, "at once", which the all-gather's ring is timed against) and once for an all-to-all of
``N`` (the gradients back to their owners). Last, the all-gather back to back with no compute between (what timing
collectives in a loop sees). The step's own meetings cost more than these: the ranks reach them apart
(``benchmarks/step_overhead.py`` times the step's parts).

Then what overlapping the gradient return with the backward would buy here: the compute followed by the all-to-all
of ``N``, against the compute cut in ``--chunks`` parts, each followed by an asynchronous all-to-all of its share
of ``N`` (as a backward would issue one per bucket of layers), all waited at the end; both timed whole (compute
included), ranks started together by a barrier.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.settings import BenchSettings


def _meet(name: str, numel: int, world: int) -> Callable[[], None]:
    """One call of the collective ``name`` on ``numel`` float32 elements (per rank for the all-gather)."""
    x = torch.zeros(numel)
    if name == "broadcast":
        return lambda: dist.broadcast(x, 0)
    if name == "all-reduce":
        return lambda: dist.all_reduce(x)
    if name == "all-to-all":
        out = torch.empty(numel)
        return lambda: dist.all_to_all_single(out, x)
    gathered = torch.empty(numel * world)  # all-gather: [numel] a rank -> [world * numel]
    if name == "all-gather at once":  # what the step's weight gather runs on gloo (comm.all_gather_rows(at_once=True))
        return lambda: dist.all_to_all_single(gathered, torch.cat([x] * world))  # [world * numel] both sides
    return lambda: dist.all_gather_single(gathered, x)


def _worker(rank: int, world: int, args: argparse.Namespace, numel: int) -> list[tuple[str, int, float]]:
    a = torch.randn(128, 128)

    def compute(ms: float = args.compute_ms) -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < ms / 1e3:
            a @ a

    cases = [
        ("broadcast", 2, True),  # Lightning's flag (one int64)
        ("all-reduce", numel, True),  # DDP's gradients
        ("all-gather", numel // world, True),  # the weights' shards, in gloo's ring
        ("all-gather at once", numel // world, True),  # the same as one all-to-all: what the step runs on gloo
        ("all-to-all", numel, True),  # the gradients back
        ("all-gather", numel // world, False),  # back to back
    ]
    out = []
    for name, n, computing in cases:
        meet, times = _meet(name, n, world), []
        for _ in range(args.iters):
            if computing:
                compute()
            start = time.perf_counter()
            meet()
            times.append(time.perf_counter() - start)
        label = name if computing else f"{name}, back to back"
        nbytes = 4 * (n * world if name.startswith("all-gather") else n)  # what the call's result holds
        out.append((label, nbytes, statistics.median(times[args.iters // 10 :])))
    return out + _overlap(compute, numel, args)


def _overlap(compute: Callable[..., None], numel: int, args: argparse.Namespace) -> list[tuple[str, int, float]]:
    """The compute then one all-to-all of ``numel``, against the compute in ``args.chunks`` parts each followed by
    an asynchronous all-to-all of its share (waited at the end): median seconds of each, compute included."""
    k = max(1, args.chunks)
    send, out = torch.zeros(numel), torch.empty(numel)
    parts = torch.tensor_split(send, k), torch.tensor_split(out, k)  # [numel] -> k x [numel / k]

    def serial() -> None:
        compute()
        dist.all_to_all_single(out, send)

    def overlapped() -> None:
        works = []
        for mine, theirs in zip(*parts):
            compute(args.compute_ms / k)
            works.append(dist.all_to_all_single(theirs, mine, async_op=True))
        for work in works:
            work.wait()

    rows = []
    for label, run in (("compute, then all-to-all", serial), (f"compute, {k} all-to-alls overlapped", overlapped)):
        times = []
        for _ in range(args.iters):
            dist.barrier()
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        rows.append((label, 4 * numel, statistics.median(times[args.iters // 10 :])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--compute-ms", type=float, default=4.0)
    parser.add_argument("--chunks", type=int, default=2, help="all-to-alls the overlapped return is cut in")
    args = parser.parse_args()
    from lightning_paradyse.distributed.spawn import run_distributed
    from lightning_paradyse.models import build_model

    config = BenchSettings.quick().model.config()
    numel = sum(w.numel() for w in build_model(config).parameters())
    numel -= numel % args.devices  # whole shards
    per_rank = run_distributed(_worker, args.devices, args, numel, timeout=60.0 + 0.1 * args.iters * args.compute_ms)
    print(
        f"{args.devices} processes, {args.compute_ms:g} ms of compute before each of {args.iters} meetings, the quick "
        f"preset's {4 * numel / 1e3:.0f} kB of weights (median ms on rank 0):"
    )
    for label, nbytes, seconds in per_rank[0]:
        print(f"  {label:36s} {nbytes:9,d} bytes {1e3 * seconds:8.3f} ms")


if __name__ == "__main__":
    main()
