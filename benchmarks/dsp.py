"""Dimension switching (DSP) vs the sequence modes on the spatial-temporal model: bytes sent and step time.

Usage::

    python benchmarks/dsp.py              # p = 2 and 4 gloo processes, about a minute on 2 CPU cores

One training step (forward and backward) of
:class:`~lightning_paradyse.models.spatial_temporal.SpatialTemporalTransformer` (``MODEL``: 8 blocks alternating spatial
and temporal attention) on a ``[1, frames, patches]`` grid split along the frames, under four plans: ``dsp`` on every
block (the shard moves between the axes), ``ulysses`` and ``ring`` on the blocks that attend along the frames (the
spatial blocks are local in every plan), and the grid planner's choice (``auto``). Reported per plan: the bytes each
rank sends, split into activations (all-to-alls and ring passes) and weights (ZeRO-3 gathers, the same in every plan),
the median step time over ``--reps`` steps, and the activation bytes relative to ``ulysses``. Writes
``benchmarks/results/dsp.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_paradyse.distributed.comm import CommCounter
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.graph.dispatch import AttentionDispatch
from lightning_paradyse.models.spatial_temporal import SpatialTemporalTransformer, STConfig
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.planning.grid import GridPlanner
from lightning_paradyse.runtime.parallel import configure, dispatchers, parallelize

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = STConfig(vocab_size=256, n_layers=8, hidden=128, n_heads=8, ffn=512, max_frames=64, max_patches=256)


def plans(model: torch.nn.Module, p: int) -> dict[str, Plan]:
    n = MODEL.n_layers
    out = {m: Plan(tuple(LayerPlan(OpPlan(m), OpPlan("dsp")) for _ in range(n))) for m in ("dsp", "ulysses", "ring")}
    axes = [int(op.attend_axis or 1) for _, op in dispatchers(model) if isinstance(op, AttentionDispatch)]
    out["auto"] = GridPlanner(axes, p, 1.0, ("dsp", "ulysses", "ring", "tp_sp")).plan(1, 1)
    return out


def worker(rank: int, world: int, frames: int, patches: int, reps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    group = dist.group.WORLD
    template = SpatialTemporalTransformer(MODEL)
    parallelize(template, group, axes=2)
    tokens = torch.randint(0, MODEL.vocab_size, (1, frames, patches))
    layout = SeqLayout(frames, world)
    mine, targets = layout.shard(tokens, rank), layout.shard(tokens.roll(1, 2), rank)
    out: dict[str, Any] = {}
    for name, plan in plans(template, world).items():
        model = copy.deepcopy(template)
        configure(model, SeqContext(layout, group), plan)
        times, counted = [], {}
        for rep in range(reps + 1):  # the first is a warm-up
            dist.barrier()
            start = time.perf_counter()
            with CommCounter() as counter:
                logits = model(mine, layout.positions(rank))
                F.cross_entropy(logits.flatten(0, 2), targets.flatten()).backward()
            if rep:
                times.append(time.perf_counter() - start)
            counted = dict(counter.bytes)
            model.zero_grad(set_to_none=True)
        out[name] = {"seconds": statistics.median(times), "bytes": counted, "plan": str(plan)}
    return out


def activation_bytes(counted: dict[str, float]) -> float:
    """Bytes of activations: all-to-alls (Ulysses, dimension switches) and ring passes. The all-gathers and
    reduce-scatters are the ZeRO-3 weight traffic, the same in every plan here."""
    return counted.get("all_to_all", 0.0) + counted.get("ring", 0.0)


def markdown(results: dict[int, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"# Dimension switching vs sequence modes (spatial-temporal model, {args.frames} frames x {args.patches} "
        f"patches, {MODEL.n_layers} blocks, hidden {MODEL.hidden})",
        "",
        f"`python benchmarks/dsp.py --frames {args.frames} --patches {args.patches} --reps {args.reps}`; bytes sent "
        "per rank in one forward and backward; time: median step on this machine.",
        "",
        "| p | plan | activation MB | weight MB | activation vs ulysses | step s | time vs ulysses |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for p, runs in results.items():
        base = runs["ulysses"]
        for name, run in runs.items():
            act = activation_bytes(run["bytes"])
            weights, ratio = sum(run["bytes"].values()) - act, act / activation_bytes(base["bytes"])
            lines.append(
                f"| {p} | {name} | {act / 1e6:.2f} | {weights / 1e6:.2f} | {ratio:.2f} | {run['seconds']:.3f} | "
                f"{run['seconds'] / base['seconds']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", type=int, default=32)
    p.add_argument("--patches", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--devices", type=str, default="2,4")
    p.add_argument("--out", type=Path, default=RESULTS / "dsp.json")
    args = p.parse_args(argv)
    results = {
        int(world): run_distributed(worker, int(world), args.frames, args.patches, args.reps, timeout=900)[0]
        for world in args.devices.split(",")
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": vars(args) | {"out": args.out.name}, "results": results}, indent=2))
    report = markdown(results, args)
    args.out.with_suffix(".md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
