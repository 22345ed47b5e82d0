"""``python cli.py profile`` and ``python cli.py plan``: calibrate the cost model, and plan with it.

    python cli.py profile --config llama-tiny --world-size 2 --out profile.json
    python cli.py plan --config llama-7b --cluster configs/clusters/a100-80gb-nvlink-8.yaml --lengths 4k,32k,128k
    python cli.py plan --config llama-tiny --profile profile.json --budget 64MiB --lengths 512,2048 --json

``profile`` runs :func:`lightning_paradyse.calibration.profile.run_profile` (a few minutes on 2 CPU cores,
``--quick`` well under one), writes the JSON profile and prints the predicted-against-measured table on
held-out lengths with the MAPE per mode. ``plan`` prints, for each length, the fastest plan within the
budget per layer and op with its predicted time and peak memory, then the largest trainable length per
mode (without and with recomputation) and for the adaptive planner; ``--json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_paradyse.calibration.profile import ProfileSettings, format_validation, load_profile, run_profile
from lightning_paradyse.cost.cluster import load_cluster
from lightning_paradyse.cost.dims import dims_from_config, dtype_size
from lightning_paradyse.cost.model import CostModel
from lightning_paradyse.groups.cost import exchange_seconds, packed_cost
from lightning_paradyse.groups.solver import assign, splits
from lightning_paradyse.models import CONFIGS, resolve_config
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.plan import Plan
from lightning_paradyse.planning.fixed import parse_memory_budget
from lightning_paradyse.planning.planner import CostPlanner, PlanInfeasible, format_bytes

_SUFFIX = {"k": 2**10, "m": 2**20}


_CONFIG_HELP = (
    f"model: one of {', '.join(sorted(CONFIGS))}, or a YAML/JSON file with 'family: llama' or 'family: gpt' "
    "and the config's fields (vocab_size, n_layers, hidden, n_heads, ...)"
)


def parse_lengths(text: str) -> tuple[int, ...]:
    """``"4096,32k,1M"`` -> ``(4096, 32768, 1048576)`` (k = 1024 tokens)."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        scale = _SUFFIX.get(item[-1], 1)
        number = item[:-1] if item[-1] in _SUFFIX else item
        try:
            value = int(float(number) * scale)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a length (e.g. 4096, 32k, 1M)") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"lengths must be positive, got {item!r}")
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError("give at least one length")
    return tuple(out)


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes must be drawn from {list(MODES)}, got {text!r}")
    return modes


# --------------------------------------------------------------------------------------------------
# profile
# --------------------------------------------------------------------------------------------------


def profile_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cli.py profile", description="Calibrate the cost model on this machine.")
    parser.add_argument("--config", "--model", dest="model", default="llama-tiny", help=_CONFIG_HELP)
    parser.add_argument("--world-size", "-p", type=int, default=2, help="local gloo processes (default 2)")
    parser.add_argument("--lengths", type=parse_lengths, default=None, help="profiled lengths (default 128,256,512)")
    parser.add_argument(
        "--heldout", type=parse_lengths, default=None, help="held-out lengths (default 192,384,1024,2048)"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to measure (default: cuda when a GPU is visible); a run refuses a profile of another device type",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--modes", type=_modes, default=tuple(MODES), help="comma-separated modes")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    parser.add_argument("--quick", action="store_true", help="short lengths, fewer repetitions (< 1 min)")
    parser.add_argument("--out", default="profile.json", help="where to write the JSON profile")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a hung run is killed")
    return parser


def _settings(args: argparse.Namespace) -> ProfileSettings:
    base = ProfileSettings.quick(args.model) if args.quick else ProfileSettings(model=args.model)
    overrides: dict[str, Any] = {"batch": args.batch, "dtype": args.dtype, "modes": args.modes, "device": args.device}
    overrides["progress"] = not args.no_progress
    for name in ("lengths", "heldout", "reps"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.lengths is not None:  # whole steps for the step factor: at the longest profiled length when quick
        overrides["step_lengths"] = (max(args.lengths),) if args.quick else None
    settings = ProfileSettings(**{**vars(base), **overrides})
    if max(settings.heldout) < 4 * max(settings.lengths):
        print(f"note: no held-out length is 4x the longest profiled one ({max(settings.lengths)})", file=sys.stderr)
    return settings


def profile_main(argv: Sequence[str]) -> int:
    """``cli.py profile``: measure, fit, write the JSON profile, print the accuracy table."""
    args = profile_parser().parse_args(list(argv))
    try:
        if args.world_size < 1:
            raise ValueError(f"--world-size must be at least 1, got {args.world_size}")
        settings = _settings(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    profile = run_profile(settings, args.world_size, timeout=args.timeout)
    Path(args.out).write_text(json.dumps(profile.to_json(), indent=1))
    m = profile.machine
    print(
        f"profile of {settings.model} on {args.world_size} ranks written to {args.out} ({profile.meta['duration_s']} s)"
    )
    sdpa = f"{m.sdpa_fwd_flops / 1e9:.1f}/{m.sdpa_bwd_flops / 1e9:.1f}"
    tile = f"{m.tile_fwd_flops / 1e9:.1f}/{m.tile_bwd_flops / 1e9:.1f}"
    print(
        f"machine: GEMM {m.gemm_flops / 1e9:.1f} GFLOP/s, SDPA {sdpa}, ring tile {tile} GFLOP/s (fwd/bwd), "
        f"overlap {m.overlap:.2f}"
    )
    print(format_validation(profile))
    return 0


# --------------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------------


def plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cli.py plan", description="Plan per layer and op with the cost model.")
    parser.add_argument("--config", "--model", dest="model", required=True, help=_CONFIG_HELP)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--cluster", help="cluster description file (YAML/JSON), e.g. configs/clusters/*.yaml")
    source.add_argument(
        "--profile",
        help="JSON profile written by 'cli.py profile' (its machine rates and per-op constants; planning another "
        "model than the profiled one reuses them)",
    )
    parser.add_argument("--lengths", type=parse_lengths, required=True, help="e.g. 4096,32k,128k")
    parser.add_argument("--budget", default=None, help="per-rank memory budget, e.g. 74GiB (default: the cluster's)")
    parser.add_argument("--p", type=int, default=None, help="ranks per sequence (default: cluster GPUs / profile's)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--modes", type=_modes, default=tuple(MODES), help="comma-separated modes")
    parser.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    parser.add_argument("--dtype", default=None, help="training dtype (default: the cluster's / the profile's)")
    parser.add_argument("--optimizer-bytes", type=float, default=None, help="optimizer bytes per parameter element")
    parser.add_argument(
        "--groups",
        action="store_true",
        help="treat --lengths as the sequences of one step and split the ranks into groups of power-of-two sizes "
        "running side by side (which group trains which sequence); needs --cluster",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _cost_model(args: argparse.Namespace) -> tuple[CostModel, int, str]:
    """The cost model, the budget and a description of the machine."""
    config = resolve_config(args.model)
    if args.cluster:
        cluster = load_cluster(args.cluster)
        dims = dims_from_config(config, dtype_size(args.dtype or cluster.dtype))
        opt = cluster.optimizer_bytes_per_param if args.optimizer_bytes is None else args.optimizer_bytes
        model = CostModel(dims, args.p or cluster.gpus, cluster.machine(), optimizer_bytes_per_param=opt)
        budget = parse_memory_budget(args.budget) or cluster.budget_bytes()
        return model, budget, cluster.name
    profile = load_profile(args.profile)
    if args.p not in (None, profile.p):
        raise ValueError(f"the profile was measured on {profile.p} ranks, not --p {args.p}; profile again")
    dims = dims_from_config(config, dtype_size(args.dtype) if args.dtype else profile.dims.dtype_bytes)
    opt = 8.0 if args.optimizer_bytes is None else args.optimizer_bytes
    model = profile.cost_model(dims, optimizer_bytes_per_param=opt)
    if args.budget is None:
        raise ValueError("--budget is required with --profile (e.g. --budget 2GiB)")
    return model, int(parse_memory_budget(args.budget) or 0), f"{profile.machine.name}, {args.profile}"


def plan_rows(plan: Plan) -> list[tuple[int, int, str, str]]:
    """Runs of identical layers: ``(first, last, attention, mlp)``."""
    rows: list[tuple[int, int, str, str]] = []
    for i, layer in enumerate(plan.layers):
        attn, mlp = str(layer.attention), str(layer.mlp)
        if rows and rows[-1][2:] == (attn, mlp) and rows[-1][1] == i - 1:
            rows[-1] = (rows[-1][0], i, attn, mlp)
        else:
            rows.append((i, i, attn, mlp))
    return rows


def _length_entry(planner: CostPlanner, s: int, batch: int) -> dict[str, Any]:
    try:
        step = planner.step(s, batch)
    except PlanInfeasible as err:
        return {"seq_len": s, "batch": batch, "feasible": False, "error": str(err), "min_peak_bytes": err.minimum}
    return {
        "seq_len": s,
        "batch": batch,
        "feasible": True,
        "planned_for": step.seq_len,
        "plan": step.plan.to_list(),
        "time_s": step.time_s,
        "peak_bytes": step.peak_bytes,
        "_plan": step.plan,
    }


def max_lengths(planner: CostPlanner, batch: int) -> dict[str, dict[str, int]]:
    """Largest trainable length per mode and adaptive, without (``no_recompute``) and with recomputation."""
    out: dict[str, dict[str, int]] = {"recompute": {}, "no_recompute": {}}
    no_rc = CostPlanner(planner.model, planner.budget, planner.modes, (False,), planner.allowed)
    for key, pl in (("recompute", planner), ("no_recompute", no_rc)):
        for mode in (*planner.modes, "adaptive"):
            modes = None if mode == "adaptive" else [mode]
            usable = mode == "adaptive" or (mode in pl.allowed[0] and mode in pl.allowed[1])
            out[key][mode] = pl.largest_length(batch, modes) if usable else 0
    return out


def _print_text(header: dict[str, Any], entries: list[dict[str, Any]], longest: dict[str, dict[str, int]]) -> None:
    budget, static = format_bytes(header["budget_bytes"]), format_bytes(header["static_bytes"])
    print(
        f"model {header['model']} on p={header['p']} ({header['machine']}), budget {budget} per rank, "
        f"static {static} (parameters + optimizer state)"
    )
    for e in entries:
        if not e["feasible"]:
            print(f"\nlength {e['seq_len']}: infeasible: {e['error']}")
            continue
        print(
            f"\nlength {e['seq_len']} (planned for {e['planned_for']}): predicted {e['time_s']:.4g} s per step, "
            f"peak {format_bytes(e['peak_bytes'])} per rank"
        )
        for first, last, attn, mlp in plan_rows(e["_plan"]):
            layers = f"layer {first}" if first == last else f"layers {first}-{last}"
            print(f"  {layers:<14} attention {attn:<12} mlp {mlp}")
    print("\nlargest trainable length (tokens)")
    print(f"  {'mode':<10} {'no recompute':>14} {'with recompute':>16}")
    for mode in longest["recompute"]:
        print(f"  {mode:<10} {longest['no_recompute'][mode]:>14} {longest['recompute'][mode]:>16}")


def group_step(model: CostModel, budget: int, args: argparse.Namespace) -> dict[str, Any]:
    """The group sizes and the sequences of each group for one packed step of ``args.lengths``.

    As ``ParaDySeStrategy(groups=True)`` runs a packed batch (see ``lightning_paradyse/groups/``): each group packs its
    sequences into one, attention counted per sequence, plus the weight gather and gradient scatter over the
    world that a group smaller than the world pays; every group gets at least one sequence.
    """

    rc = (False,) if args.no_recompute else (False, True)
    world = model.p
    sizes = sorted({g for layout in splits(world) for g in layout})
    planners = {g: CostPlanner(dataclasses.replace(model, p=g), budget, args.modes, rc) for g in sizes}

    def step_time(s: int, b: int, g: int) -> float | None:
        try:
            return planners[g].step(s, b).time_s
        except PlanInfeasible:
            return None

    cost = packed_cost(model.dims, step_time, lambda g: exchange_seconds(model.dims, model.machine, world, g))
    found = assign(args.lengths, world, cost, all_busy=True)
    one = cost(tuple(args.lengths), world)
    out: dict[str, Any] = {"world": world, "lengths": list(args.lengths), "one_group_time_s": one}
    if found is None:
        out.update(feasible=False, error="no split of the ranks fits the packed step in the budget")
        return out
    groups = [
        {"size": g, "lengths": [args.lengths[i] for i in members], "time_s": t}
        for g, members, t in zip(found.sizes, found.groups, found.times)
    ]
    out.update(feasible=True, time_s=found.time, groups=groups)
    return out


def _print_groups(result: dict[str, Any], machine: str) -> None:
    print(f"one step of {len(result['lengths'])} sequences on {result['world']} ranks ({machine})")
    one = result["one_group_time_s"]
    one_text = "does not fit" if one is None else f"{one:.4g} s"
    if not result["feasible"]:
        print(f"  {result['error']} (one group of {result['world']}: {one_text})")
        return
    print(f"  predicted {result['time_s']:.4g} s (one group of {result['world']}: {one_text})")
    for group in result["groups"]:
        lengths = ", ".join(str(s) for s in group["lengths"]) or "idle"
        print(f"  group of {group['size']:>3}: {group['time_s']:.4g} s   sequences {lengths}")


def plan_main(argv: Sequence[str]) -> int:
    """``cli.py plan``: plans, predicted time and memory, and the largest trainable lengths."""
    args = plan_parser().parse_args(list(argv))
    if args.groups and not args.cluster:
        print("error: --groups needs --cluster (a profile holds one group size only)", file=sys.stderr)
        return 2
    try:
        model, budget, machine = _cost_model(args)
        rc = (False,) if args.no_recompute else (False, True)
        planner = CostPlanner(model, budget, args.modes, rc)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.groups:
        result = group_step(model, budget, args)
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            _print_groups(result, machine)
        return 0
    entries = [_length_entry(planner, s, args.batch) for s in args.lengths]
    longest = max_lengths(planner, args.batch)
    header = {"model": args.model, "p": model.p, "machine": machine, "budget_bytes": budget}
    header["static_bytes"] = model.static_bytes()
    if args.json:
        clean = [{k: v for k, v in e.items() if not k.startswith("_")} for e in entries]
        print(
            json.dumps(
                {
                    **header,
                    "lengths": clean,
                    "max_length": longest["recompute"],
                    "max_length_no_recompute": longest["no_recompute"],
                },
                indent=1,
            )
        )
    else:
        _print_text(header, entries, longest)
    return 0
