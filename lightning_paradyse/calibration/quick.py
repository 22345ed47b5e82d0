"""A machine measured in a second or two at setup: the cost model of ``plan="auto"`` without a profile.

``ParaDySeStrategy(plan="auto")`` plans every batch with the exact planner of
:mod:`lightning_paradyse.planning.planner`. With a ``profile`` (``python cli.py profile``) its cost model is
calibrated per op; without one the strategy calls :func:`quick_machine` during setup, which benchmarks,
on the training device and process group, what the uncalibrated model needs:

* the GEMM, the fused attention kernel (SDPA) and the four ring tile kernels at the model's shapes, at
  :data:`QUICK_LENGTHS` (rates in between are interpolated, beyond them the nearest is used);
* every collective kind at two sizes, fitted to ``alpha + bytes / beta``.

Every rank measures, :data:`QUICK_ROUNDS` times (the median of each kernel point, the least of each collective
point, smooth noisy measurements); the ranks
then agree on the slowest rank's rates and times (one all-reduce each), so that every rank builds the same model
and the planner chooses the same plan everywhere. :func:`cached_quick_machine` measures once per machine, model
shape, world size and dtype and keeps the result in a file (:func:`cache_dir`): later runs of the same job read
it, so they plan alike (rank 0 reads, every rank receives its copy). Per-op
overheads (Python, kernel launches) and the elementwise work around the GEMMs are not calibrated:
predicted times are lower than measured ones, more so for short sequences and for ``ring``/``metp``,
whose per-op overheads are the largest. The memory model needs no measurement: its formulas come from
the code (see :mod:`lightning_paradyse.cost.memory`). For accurate times, run a profile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from lightning_paradyse.calibration.calibrate import fit_machine
from lightning_paradyse.calibration.measure import bench_collectives, bench_kernels
from lightning_paradyse.calibration.profile import combine_curves
from lightning_paradyse.cost.dims import ModelDims
from lightning_paradyse.cost.time import Machine
from lightning_paradyse.modes.attention import fused_tiles

QUICK_LENGTHS = (256, 1024)
"""Sequence lengths the kernel rates are measured at (on the host)."""
GPU_QUICK_LENGTHS = (1024, 8192)
"""On a GPU (whose rates keep growing long after 1K tokens: 256 tokens would price long batches far too slow)."""
QUICK_COLLECTIVE_SIZES = (4_096, 262_144)
"""Elements per rank of the benchmarked collectives (16 KiB and 1 MiB in float32), on the host."""
GPU_QUICK_COLLECTIVE_SIZES = (262_144, 16_777_216)
"""On a GPU: 1 MiB and 64 MiB (NVLink reaches its bandwidth only on large messages)."""
QUICK_ROUNDS = 3
"""Measurements of every point; the median is kept."""
QUICK_VERSION = 2
"""Bumped when what is measured changes (old cache files are then ignored)."""
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
        kernel_lengths=GPU_QUICK_LENGTHS if device.type == "cuda" else QUICK_LENGTHS,
        kernel_seconds=0.0,
    )

    rounds = [bench_kernels(dims, settings, p) for _ in range(QUICK_ROUNDS)]
    kernels = _agree(combine_curves(rounds, statistics.median), dist.ReduceOp.MIN, group, device)  # slowest rank's
    collectives: dict[str, list[tuple[float, float]]] = {}
    if p > 1:
        sizes = GPU_QUICK_COLLECTIVE_SIZES if device.type == "cuda" else QUICK_COLLECTIVE_SIZES
        measured = [bench_collectives(p, 2, group, device, sizes) for _ in range(QUICK_ROUNDS)]
        # the least of the rounds' medians: a round where a rank was descheduled (2 ranks on 2 busy cores) can
        # measure a small collective 10x slower than it runs in training, which would then price it absurdly
        collectives = _agree(combine_curves(measured, min), dist.ReduceOp.MAX, group, device)
    raw = {"kernels": kernels, "collectives": collectives, "overlap": QUICK_OVERLAP, "flash_tiles": fused_tiles(device)}
    machine = fit_machine(raw, dims, p)
    return dataclasses.replace(machine, name=f"measured at setup ({p} ranks, {device.type})")


def cache_dir() -> Path:
    """Where measured machines are kept: ``$PARADYSE_CACHE_DIR``, else ``~/.cache/lightning_paradyse``."""
    return Path(os.environ.get("PARADYSE_CACHE_DIR") or Path.home() / ".cache" / "lightning_paradyse")


def machine_key(dims: ModelDims, p: int, device: torch.device, dtype: torch.dtype) -> str:
    """A digest of what a quick measurement depends on: the host and its device, the model's shape, the world size,
    the dtype and the versions of torch and of the measurement."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor()}x{os.cpu_count()}"
    text = repr((platform.node(), where, p, str(dtype), dataclasses.astuple(dims), torch.__version__, QUICK_VERSION))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_quick_machine(
    dims: ModelDims, p: int, group: Any, device: torch.device, dtype: torch.dtype, extra: Any = None
) -> tuple[Machine, dict[str, Any], bool]:
    """:func:`quick_machine`, measured once per machine and kept in :func:`cache_dir`: ``(machine, extras, cached)``.

    Rank 0 of ``group`` reads the file and every rank receives its content (one broadcast), so every rank plans
    with the same model. Without a file every rank measures, ``extra(machine)`` (collective, optional) adds
    measurements kept alongside (a dict of numbers), and rank 0 writes the file. ``cached`` says whether it was read.
    """
    path = cache_dir() / f"machine-{machine_key(dims, p, device, dtype)}.json"
    rank0 = not dist.is_initialized() or dist.get_rank(group) == 0
    box: list[Any] = [None]
    if rank0 and path.exists():
        try:
            box[0] = json.loads(path.read_text())
        except (OSError, ValueError):
            box[0] = None  # a damaged file: measure again
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group, device=device)
    if box[0] is not None:
        machine = Machine.from_dict(box[0]["machine"])
        return dataclasses.replace(machine, name=f"{machine.name}, read from {path.name}"), box[0]["extras"], True
    machine = quick_machine(dims, p, group, device, dtype)
    extras = extra(machine) if extra is not None else {}
    if rank0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"machine": machine.to_dict(), "extras": extras}))
            tmp.replace(path)
        except OSError:
            pass  # a read-only home: measured again next time
    return machine, extras, False


__all__ = ["QUICK_LENGTHS", "cache_dir", "cached_quick_machine", "machine_key", "quick_machine"]
