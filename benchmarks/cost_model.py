"""How accurate the cost model is, and how fast the planner decides: the acceptance numbers of the planner.

    python benchmarks/cost_model.py [--world-size 2] [--config llama-tiny] [--out benchmarks/results]

1. Runs the package's calibration (``python cli.py profile``: machine benchmarks, segments at the
   profiled lengths 128/256/512, whole steps under every uniform plan) on ``--world-size`` gloo processes,
   then predicts whole training steps at held-out lengths: 192 and 384 inside the profiled range, 1024 and
   2048 beyond it (2048 = 4x the longest profiled), every mode with and without recomputation. Reports the
   mean absolute percentage error per mode of step time and peak memory, inside and beyond the range,
   against the targets (time <= 10% / 15%, memory <= 5% / 15%).
2. Times the planner on a 32-layer model (llama-7b, four modes x recompute, 8x A100 cluster file):
   uncached (a new length bucket, the dynamic programme runs) and cached, per batch.

Writes ``cost_model.json`` (every measurement) and ``cost_model.md`` (the tables) under ``--out``.
A timing benchmark: run it on an otherwise idle machine; other load inflates the measured times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.planner_time import _timed  # noqa: E402
from lightning_paradyse.calibration.profile import (  # noqa: E402
    MEMORY_TARGET,
    TIME_TARGET,
    Profile,
    ProfileSettings,
    format_validation,
    mape_table,
    run_profile,
)
from lightning_paradyse.models import CONFIGS  # noqa: E402
from lightning_paradyse.planning.planner import make_planner  # noqa: E402

PLANNER_TARGET_MS = {"uncached": 20.0, "cached": 1.0}
"""Decision time per batch the planner is meant to stay under (32 layers, four modes and recomputation)."""


def planner_times(n: int = 40) -> dict[str, Any]:
    """Median and worst decision time per batch, uncached and cached (see ``benchmarks/planner_time.py``)."""
    config = CONFIGS["llama-7b"]
    cluster = ROOT / "configs" / "clusters" / "a100-80gb-nvlink-8.yaml"
    planner = make_planner(config, 8, 74 * 2**30, cluster, bucket_tokens=512)
    planner.plan(256, 1)  # warm-up (imports, first allocations), a bucket of its own
    lengths = [1024 + 4096 * i for i in range(n)]  # every length in a bucket of its own
    out: dict[str, Any] = {"model": "llama-7b", "layers": config.n_layers, "lengths": n}
    for name in ("uncached", "cached"):
        ms = [t * 1e3 for t in _timed(planner, lengths)]
        p95 = statistics.quantiles(ms, n=20, method="inclusive")[-1]
        out[name] = {
            "median_ms": statistics.median(ms),
            "p95_ms": p95,
            "worst_ms": max(ms),
            "target_ms": PLANNER_TARGET_MS[name],
        }
    return out


def markdown(profile: Profile, planner: dict[str, Any], command: str) -> str:
    """The report: accuracy per mode against the targets, the planner's decision time, the full table."""
    lengths = profile.settings["lengths"]
    heldout = sorted({r["seq_len"] for r in profile.validation})
    lines = [
        "# Cost model accuracy and planner time",
        "",
        f"Command: `{command}` ({profile.meta.get('duration_s', 0):.0f} s of calibration and validation).",
        "",
        f"Machine: {platform.processor() or platform.machine()}, torch {profile.meta.get('torch')}; "
        f"{profile.p} gloo processes, one thread each. Model `{profile.settings['model']}`; profiled lengths "
        f"{lengths}, held-out lengths {heldout} (every mode, with and without recomputation: whole training "
        "steps, forward + backward + gradient reduction).",
        "",
        "| mode | time, inside | time, beyond | memory, inside | memory, beyond |",
        "|---|---|---|---|---|",
    ]
    table = mape_table(profile)
    inside, beyond = table.get("interpolation", {}), table.get("extrapolation", {})

    def cell(part: dict[str, dict[str, float]], mode: str, key: str, target: float) -> str:
        if mode not in part:
            return "—"
        value = part[mode][key]
        return f"{value:.1f}%" + ("" if value <= target else " (over)")

    for mode in dict.fromkeys(r["mode"] for r in profile.validation):
        lines.append(
            f"| {mode} | {cell(inside, mode, 'time', TIME_TARGET['interpolation'])} "
            f"| {cell(beyond, mode, 'time', TIME_TARGET['extrapolation'])} "
            f"| {cell(inside, mode, 'memory', MEMORY_TARGET['interpolation'])} "
            f"| {cell(beyond, mode, 'memory', MEMORY_TARGET['extrapolation'])} |"
        )
    lines += [
        "",
        f"Mean absolute percentage error; inside = held-out lengths <= {max(lengths)} (targets: time "
        f"{TIME_TARGET['interpolation']:.0f}%, memory {MEMORY_TARGET['interpolation']:.0f}%), beyond = longer, up to "
        f"{max(heldout) / max(lengths):.0f}x (targets: time {TIME_TARGET['extrapolation']:.0f}%, memory "
        f"{MEMORY_TARGET['extrapolation']:.0f}%).",
        "",
        f"Planner decision time per batch ({planner['model']}, {planner['layers']} layers x 2 ops, four modes x "
        f"recompute, {planner['lengths']} lengths): uncached median {planner['uncached']['median_ms']:.2f} ms, "
        f"95th percentile {planner['uncached']['p95_ms']:.2f} ms, worst {planner['uncached']['worst_ms']:.2f} ms "
        f"(target {planner['uncached']['target_ms']:.0f} ms); cached median "
        f"{planner['cached']['median_ms'] * 1e3:.1f} µs, 95th percentile {planner['cached']['p95_ms'] * 1e3:.1f} µs, "
        f"worst {planner['cached']['worst_ms'] * 1e3:.1f} µs (target {planner['cached']['target_ms']:.0f} ms). "
        "A worst case far above the median is not the planner: it is Python's garbage collector (a full "
        "collection over every object of the process, about 50 ms here, which lands inside whichever call "
        "allocates at that moment) or another process; the same length planned again takes the median time.",
        "",
        "```",
        format_validation(profile),
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--world-size", "-p", type=int, default=2)
    parser.add_argument("--config", default="llama-tiny", choices=sorted(CONFIGS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true", help="the short calibration (a smoke run, not the numbers)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="times every measurement is taken, the fastest counting (default 4: about 11 minutes; the quick "
        "preset always 1)",
    )
    args = parser.parse_args(argv)
    settings = ProfileSettings.quick(args.config) if args.quick else ProfileSettings(model=args.config)
    if not args.quick:
        settings = dataclasses.replace(settings, rounds=args.rounds)
    if args.no_progress:
        settings = type(settings)(**{**settings.__dict__, "progress": False})
    start = time.monotonic()
    profile = run_profile(settings, args.world_size)
    planner = planner_times(8 if args.quick else 40)
    command = "python benchmarks/cost_model.py" + (f" -p {args.world_size}" if args.world_size != 2 else "")
    command += " --quick" if args.quick else ""
    command += f" --rounds {args.rounds}" if args.rounds != 4 and not args.quick else ""
    report = markdown(profile, planner, command)
    args.out.mkdir(parents=True, exist_ok=True)
    data = {
        "profile": profile.to_json(),
        "mape_percent": mape_table(profile),
        "targets_percent": {"time": TIME_TARGET, "memory": MEMORY_TARGET},
        "planner": planner,
        "seconds": time.monotonic() - start,
    }
    (args.out / "cost_model.json").write_text(json.dumps(data, indent=1))
    (args.out / "cost_model.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
