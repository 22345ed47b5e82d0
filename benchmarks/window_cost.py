"""Predicted against measured time of a windowed attention layer, on the shipped calibration.

    python benchmarks/window_cost.py [--lengths 1024,2048] [--windows 128,512] [--reps 3]
        [--profile configs/profiles/cpu-2proc-llama-tiny.json] [--out benchmarks/results]

The profile was fitted on full (unwindowed) layers only. On its group size (2 gloo processes) this script gives
layer 0 of its model a causal sliding window (the dispatch module's ``AttnSpec.window``, what every mode reads),
measures the attention segment (norm + attention, forward and backward, as the profile's segments are measured)
in every mode without recomputation, with and without the window, and compares with the cost model's prediction
for that window: the profile's fitted per-op constants on kernel rates benchmarked in the same run (the slowest
rank's), as a profile or :func:`~lightning_paradyse.calibration.quick.quick_machine` measures them for a model with
these windows, so that the kernels only windows call are measured too (ring tiles a window masks, run by the
explicit kernel; the SDPA path's query chunks against a band mask), and so that a machine whose speed drifted since
the profile (a shared host) moves measurement and prediction alike.

Writes ``window_cost.json`` and ``window_cost.md`` under ``--out``. A timing benchmark: run it on an otherwise
idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from lightning_paradyse.calibration.profile import Profile, load_profile  # noqa: E402
from lightning_paradyse.distributed.spawn import run_distributed  # noqa: E402

MODES = ("tp_sp", "ulysses", "ring", "metp")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures."""

    profile: str
    """The calibration (its model, group size and machine)."""
    lengths: tuple[int, ...] = (1024, 2048)
    """Sequence lengths."""
    windows: tuple[int, ...] = (128, 512)
    """Sliding windows given to layer 0 (each measured against the same layer without one)."""
    reps: int = 3
    """Timed repetitions per segment (more for short ones, see ``segment_seconds``)."""
    segment_seconds: float = 0.5
    """Short segments are repeated until about this many seconds."""
    kernel_seconds: float = 0.15
    """Kernel benchmarks are repeated until about this many seconds."""


def _worker(rank: int, world: int, settings: Settings) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lightning_paradyse.calibration.measure import bench_kernels, measure_segment
    from lightning_paradyse.calibration.profile import _build
    from lightning_paradyse.distributed.layout import SeqLayout
    from lightning_paradyse.graph.dispatch import AttentionDispatch
    from lightning_paradyse.modes.specs import SeqContext
    from lightning_paradyse.runtime.parallel import dispatchers

    profile = load_profile(settings.profile)
    prof_settings = dataclasses.replace(_settings_of(profile), kernel_seconds=settings.kernel_seconds)
    torch.manual_seed(0)
    model, _ = _build(prof_settings)
    windows = tuple(settings.windows)  # kernel benchmarks only: a model with one layer per window
    kernels = bench_kernels(
        dataclasses.replace(profile.dims, n_layers=len(windows), windows=windows), prof_settings, world
    )
    attn = next(m for _, m in dispatchers(model) if isinstance(m, AttentionDispatch) and m.layer == 0)
    base = attn.spec
    rows = []
    for s in settings.lengths:
        ctx = SeqContext(SeqLayout.for_sequence(s, world, True), dist.group.WORLD)
        for window in (None, *settings.windows):
            attn.spec = dataclasses.replace(base, window=window)
            for mode in MODES:
                row = measure_segment(model, "attention", mode, False, ctx, 1, settings.reps, settings.segment_seconds)
                rows.append({"mode": mode, "seq_len": s, "window": window, "time_s": row["time_s"]})
    attn.spec = base
    return {"curves": kernels, "rows": rows}


def _settings_of(profile: Profile) -> Any:
    from lightning_paradyse.calibration.profile import ProfileSettings

    fields = {f.name for f in dataclasses.fields(ProfileSettings)}
    stored = {k: tuple(v) if isinstance(v, list) else v for k, v in profile.settings.items() if k in fields}
    return ProfileSettings(**{**stored, "progress": False})


def run(settings: Settings) -> dict[str, Any]:
    """Measure on the profile's group size and predict every row."""
    profile = load_profile(settings.profile)
    per_rank = run_distributed(_worker, profile.p, settings, timeout=1800)
    curves = {}
    for name, points in per_rank[0]["curves"].items():  # the slowest rank's rate at every size
        rates = [min(r["curves"][name][i][1] for r in per_rank) for i in range(len(points))]
        curves[name] = tuple((float(x), rate) for (x, _), rate in zip(points, rates))
    machine = dataclasses.replace(profile.machine, curves=curves)
    rows = []
    for i, row in enumerate(per_rank[0]["rows"]):
        measured = max(r["rows"][i]["time_s"] for r in per_rank)  # the slower rank's median
        windows = (row["window"],) + (None,) * (profile.dims.n_layers - 1)
        dims = dataclasses.replace(profile.dims, windows=windows)
        model = dataclasses.replace(profile.cost_model(dims), machine=machine)
        predicted = model.op_cost(row["mode"], "attention", False, row["seq_len"], 1, row["window"]).time_s
        rows.append({**row, "time_s": measured, "pred_time_s": predicted})
    return {"settings": dataclasses.asdict(settings), "p": profile.p, "curves": curves, "rows": rows}


def table(result: dict[str, Any]) -> str:
    """Markdown: per mode and length, measured and predicted ms without and with each window, and the error."""
    windows = result["settings"]["windows"]
    head = "| mode | length | " + " | ".join(["full"] + [f"window {w}" for w in windows]) + " |"
    lines = [head, "|---|---|" + "---|" * (1 + len(windows))]
    by_key = {(r["mode"], r["seq_len"], r["window"]): r for r in result["rows"]}
    errors = []
    for mode in MODES:
        for s in result["settings"]["lengths"]:
            cells = []
            for w in (None, *windows):
                r = by_key[(mode, s, w)]
                err = (r["pred_time_s"] - r["time_s"]) / r["time_s"] * 100
                errors.append((w is not None, abs(err)))
                cells.append(f"{r['time_s'] * 1e3:.1f} / {r['pred_time_s'] * 1e3:.1f} ms ({err:+.0f}%)")
            lines.append(f"| {mode} | {s} | " + " | ".join(cells) + " |")
    windowed = [e for w, e in errors if w]
    full = [e for w, e in errors if not w]
    lines.append("")
    lines.append(
        f"Measured / predicted attention segment (forward + backward), {result['p']} processes. Mean absolute error: "
        f"full layers {sum(full) / len(full):.1f}%, windowed layers {sum(windowed) / len(windowed):.1f}%."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=str(ROOT / "configs" / "profiles" / "cpu-2proc-llama-tiny.json"))
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--windows", default="128,512")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    settings = Settings(
        profile=args.profile,
        lengths=tuple(int(x) for x in args.lengths.split(",")),
        windows=tuple(int(x) for x in args.windows.split(",")),
        reps=args.reps,
    )
    result = run(settings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "window_cost.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    (out / "window_cost.md").write_text(f"`python benchmarks/window_cost.py`\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
