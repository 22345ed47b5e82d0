"""A machine measured in a second or two at setup: the cost model of ``plan="auto"`` without a profile.

``ParaDySeStrategy(plan="auto")`` plans every batch with the exact planner of
:mod:`lightning_paradyse.cost.planner`. With a ``profile`` (``python cli.py profile``) its cost model is
calibrated per op; without one the strategy calls :func:`quick_machine` during setup, which benchmarks,
on the training device and process group, what the uncalibrated model needs:

* the GEMM, the fused attention kernel (SDPA) and the four ring tile kernels at the model's shapes, at
  :data:`QUICK_LENGTHS` (rates in between are interpolated, beyond them the nearest is used);
* every collective kind at two sizes, fitted to ``alpha + bytes / beta``.

Every rank measures; the ranks then agree on the slowest rank's rates and times (one all-reduce each),
so that every rank builds the same model and the planner chooses the same plan everywhere. Per-op
overheads (Python, kernel launches) and the elementwise work around the GEMMs are not calibrated:
predicted times are lower than measured ones, more so for short sequences and for ``ring``/``metp``,
whose per-op overheads are the largest. The memory model needs no measurement: its formulas come from
the code (see :mod:`lightning_paradyse.cost.memory`). For accurate times, run a profile.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from lightning_paradyse.attention import fused_tiles
from lightning_paradyse.cost.calibrate import fit_machine
from lightning_paradyse.cost.dims import ModelDims
from lightning_paradyse.cost.measure import bench_collectives, bench_kernels
from lightning_paradyse.cost.time import Machine

QUICK_LENGTHS = (256, 1024)
"""Sequence lengths the kernel rates are measured at."""
QUICK_COLLECTIVE_SIZES = (4_096, 262_144)
"""Elements per rank of the benchmarked collectives (16 KiB and 1 MiB in float32)."""
QUICK_OVERLAP = 0.5
"""Overlap efficiency assumed for asynchronous transfers (a profile measures it)."""


def _agree(
    curves: dict[str, list[tuple[float, float]]], op: Any, group: Any, device: torch.device
) -> dict[str, list[tuple[float, float]]]:
    """``{name: [(size, value), ...]}`` with every value reduced over the group by ``op`` (one all-reduce), so
    that every rank holds the same curves."""
    if not curves or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return curves
    names = sorted(curves)
    t = torch.tensor([v for name in names for _, v in curves[name]], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    values = iter(t.tolist())
    return {name: [(size, float(next(values))) for size, _ in curves[name]] for name in names}


def quick_machine(dims: ModelDims, p: int, group: Any, device: torch.device, dtype: torch.dtype) -> Machine:
    """This machine's rates and collectives for ``dims`` on ``p`` ranks (about a second on 2 CPU cores)."""
    settings = SimpleNamespace(
        batch=1,
        dtype=str(dtype).removeprefix("torch."),
        device=device,
        kernel_lengths=QUICK_LENGTHS,
        kernel_seconds=0.0,
    )
    kernels = _agree(bench_kernels(dims, settings, p), dist.ReduceOp.MIN, group, device)  # the slowest rank's
    collectives = bench_collectives(p, 2, group, device, QUICK_COLLECTIVE_SIZES) if p > 1 else {}
    collectives = _agree(collectives, dist.ReduceOp.MAX, group, device)
    raw = {"kernels": kernels, "collectives": collectives, "overlap": QUICK_OVERLAP, "flash_tiles": fused_tiles(device)}
    machine = fit_machine(raw, dims, p)
    return dataclasses.replace(machine, name=f"measured at setup ({p} ranks, {device.type})")


__all__ = ["QUICK_LENGTHS", "quick_machine"]
