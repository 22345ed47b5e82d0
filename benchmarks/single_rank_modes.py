"""What each mode costs on a group of one rank: one segment (norm and op) forward and backward, per mode.

    python benchmarks/single_rank_modes.py [--model llama-tiny] [--shapes 4x128 1x512] [--reps 9]

On one rank every mode computes the same local attention and MLP and no collective moves anything; the modes
differ only in their code's overhead. The planner of a group of one (data parallelism) therefore plans ``tp_sp``
alone (:func:`~lightning_paradyse.planning.planner.single_rank_modes`); this prints what that rests on: the median
time of layer 0's attention and MLP segment in every mode (without recomputation), measured as the calibration
measures segments (:func:`~lightning_paradyse.calibration.measure.measure_segment`), one process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from lightning_paradyse.modes import MODES

OPS = ("attention", "mlp")


def _shape(text: str) -> tuple[int, int]:
    """``"4x128"`` -> ``(rows, tokens)``."""
    rows, tokens = text.lower().split("x")
    return int(rows), int(tokens)


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict[tuple[int, int, str, str], float]:
    from lightning_paradyse.calibration.measure import measure_segment
    from lightning_paradyse.distributed.layout import SeqLayout
    from lightning_paradyse.models import build_model
    from lightning_paradyse.modes.specs import SeqContext
    from lightning_paradyse.runtime.parallel import parallelize

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build_model(args.model)
    group: Any = torch.distributed.group.WORLD
    parallelize(model, group)
    out = {}
    for rows, tokens in map(_shape, args.shapes):
        ctx = SeqContext(SeqLayout.for_sequence(tokens, world, True), group)
        for op in OPS:
            for mode in MODES:
                out[(rows, tokens, op, mode)] = measure_segment(model, op, mode, False, ctx, rows, args.reps, 0.2)[
                    "time_s"
                ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--shapes", nargs="+", default=["4x128", "1x512"], help="rows x tokens")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    from lightning_paradyse.distributed.spawn import run_distributed

    (times,) = run_distributed(_worker, 1, args, timeout=600.0)
    print(f"{args.model}, one rank, one segment forward + backward (median ms):")
    print("  shape      op         " + "  ".join(f"{m:>8s}" for m in MODES))
    for rows, tokens in map(_shape, args.shapes):
        for op in OPS:
            cells = "  ".join(f"{1e3 * times[(rows, tokens, op, m)]:8.2f}" for m in MODES)
            print(f"  {rows:>3d} x {tokens:<5d} {op:10s} {cells}")


if __name__ == "__main__":
    main()
