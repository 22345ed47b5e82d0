"""A machine measured in a few seconds at setup: the cost model of ``plan="auto"`` without a profile.

``ParaDySeStrategy(plan="auto")`` plans every batch with the exact planner of
:mod:`lightning_paradyse.planning.planner`. With a ``profile`` (``python cli.py profile``) its cost model is
calibrated per op; without one the strategy calls :func:`quick_machine` during setup, which benchmarks,
on the training device and process group, what the uncalibrated model needs:

* the GEMM, the fused attention kernel (SDPA) and the four ring tile kernels at the model's shapes, at
  :data:`QUICK_LENGTHS` (rates in between are interpolated, beyond them the nearest is used);
* every collective kind at two sizes, fitted to ``alpha + bytes / beta``;
* every mode's per-op overhead (:func:`quick_overheads`): what an op and its norm take, forward and backward, beyond
  what those rates price, on a short sequence of a one-block model of the same heads (their width and the MLP's
  capped), on every rank and, on more than one rank, on a rank alone as a group of one (data parallelism) runs it.

Every rank measures, :data:`QUICK_ROUNDS` times (the median of each kernel point, the least of each collective
point, smooth noisy measurements); the ranks
then agree on the slowest rank's rates and times (one all-reduce each), so that every rank builds the same model
and the planner chooses the same plan everywhere. :func:`cached_quick_machine` measures once per machine, model
shape, world size and dtype and keeps the result in a file (:func:`cache_dir`): later runs of the same job read
it, so they plan alike (rank 0 reads, every rank receives its copy).

The per-op overheads decide where a batch of short rows runs. Without them (until 2026-12-02) a step on one group of
every rank was priced at its FLOPs and collectives' latencies alone, while the data-parallel groups' weight exchange
was measured whole: on two CPU processes a batch of 8 rows of 48 tokens was predicted 5.2 ms on one group of both
ranks and ran in 31 ms, against 8.5 ms data parallel, which then took it (``benchmarks/step_overhead.py``). The
elementwise work around the GEMMs is still not calibrated (a profile fits it): predicted times of long sequences are
lower than measured ones. The memory model needs no measurement: its formulas come from the code (see
:mod:`lightning_paradyse.cost.memory`). For accurate times, run a profile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from lightning_paradyse.calibration.calibrate import fit_machine
from lightning_paradyse.calibration.measure import bench_collectives, bench_kernels, segment_seconds, whole_on_each_rank
from lightning_paradyse.calibration.profile import ONE_RANK_MODES, combine_curves
from lightning_paradyse.cost.dims import ModelDims, dims_from_config, dtype_size
from lightning_paradyse.cost.model import CostModel, OpCalibration, calibration_key
from lightning_paradyse.cost.time import Machine
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.models import GPTConfig, LlamaConfig, build_model
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.attention import fused_tiles
from lightning_paradyse.modes.plan import OPS
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime.exactness import kept_rng
from lightning_paradyse.runtime.parallel import feasible_modes, is_causal, parallelize

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
QUICK_VERSION = 3
"""Bumped when what is measured changes (old cache files are then ignored; 3: the per-op overheads)."""
QUICK_OVERLAP = 0.5
"""Overlap efficiency assumed for asynchronous transfers (a profile measures it)."""
OVERHEAD_HEAD_DIM = 32
"""Widest head of the one-block model the per-op overheads are measured on (its MLP at most 4x its width): an
overhead does not grow with the width, and a large model's block would cost a GPU its memory for a measurement."""
OVERHEAD_TOKENS = 16
"""Tokens per rank of the sequence the per-op overheads are measured on (few: the FLOPs are a small part)."""
RECOMPUTE_OVERHEAD = 1.5
"""An op's overhead with recomputation, over its overhead without: the forward runs twice, and it is about half of
the forward and backward's. Priced, not measured (measuring it doubled the measurement: 7 s at 4 processes on 2 CPU
cores); measured on 2 processes there, 0.9-5x, within the spread of one op measured twice."""


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
    """This machine's rates and collectives for ``dims`` on ``p`` ranks (about a second on 2 CPU cores; its per-op
    overheads, :func:`quick_overheads`, half a second more on 2 processes, 2.5 s on 4)."""
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


@dataclass(frozen=True)
class Overheads:
    """Seconds per step an op and its norm take beyond what the machine's rates price (forward and backward), by
    :func:`~lightning_paradyse.cost.model.calibration_key`: on every rank (``world``) and on one rank alone, a group
    of one (``one_rank``). :meth:`calibration` turns them into the cost model's per-op constants."""

    world: Mapping[str, float]
    one_rank: Mapping[str, float]

    @staticmethod
    def calibration(seconds: Mapping[str, float]) -> dict[str, OpCalibration]:
        """The cost model's constants of ``seconds`` (:class:`~lightning_paradyse.cost.model.CostModel`'s
        ``calibration`` or ``one_rank``): the overhead as ``time_fixed``, every factor at one."""
        return {key: OpCalibration(time_fixed=t) for key, t in seconds.items()}

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {"world": dict(self.world), "one_rank": dict(self.one_rank)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, float]]) -> Overheads:
        return cls(dict(data["world"]), dict(data["one_rank"]))


def overhead_config(dims: ModelDims, p: int) -> LlamaConfig | GPTConfig:
    """The one-block model :func:`quick_overheads` measures on: ``dims``' heads (and key/value heads) and family (a
    gated MLP: the package's Llama; else its GPT), each head at most :data:`OVERHEAD_HEAD_DIM` wide, the MLP at most
    4x the width, a sequence of :data:`OVERHEAD_TOKENS` a rank."""
    head_dim = max(2, min(dims.head_dim, OVERHEAD_HEAD_DIM) // 2 * 2)  # even: rotary embeddings
    hidden = dims.n_heads * head_dim
    ffn, seq = min(dims.ffn, 4 * hidden), OVERHEAD_TOKENS * p
    if dims.gated:
        return LlamaConfig(64, 1, hidden, dims.n_heads, dims.n_kv_heads, ffn, max_seq_len=seq)
    return GPTConfig(64, 1, hidden, dims.n_heads, ffn, max_seq_len=seq, causal=dims.causal)


def quick_overheads(
    dims: ModelDims, machine: Machine, p: int, group: Any, device: torch.device, dtype: torch.dtype
) -> Overheads:
    """Every mode's per-op overhead on this machine (collective: every rank measures, the slowest counts).

    Each op (with its norm) of :func:`overhead_config`'s model, in every mode it can run on ``p`` ranks, is timed
    forward and backward (:func:`~.measure.segment_seconds`, the median of a few runs) on its short sequence, less
    what ``machine`` predicts for it there; likewise the modes a group of one plans (:data:`~.profile.ONE_RANK_MODES`)
    on a rank alone, on the whole weights. What is measured is the per-op code, not the model: the Python of the mode
    and its collectives' calls, kernel launches, the ranks meeting. With recomputation an op's overhead is priced at
    :data:`RECOMPUTE_OVERHEAD` times its own. Nothing on one rank. Random numbers drawn here leave the process's
    streams as they were."""
    if p == 1:
        return Overheads({}, {})
    config = overhead_config(dims, p)
    s = config.max_seq_len
    with kept_rng(device):
        torch.manual_seed(0)
        model = build_model(config).to(dtype)
        parallelize(model, group)
        model = model.to(device)
        small = dims_from_config(config, dtype_size(dtype))
        causal = is_causal(model)
        world: dict[str, float] = {}
        priced = CostModel(small, p, machine)
        ctx = SeqContext(SeqLayout.for_sequence(s, p, causal), group)
        for op, allowed in zip(OPS, feasible_modes(model, p, list(MODES))[0]):
            for mode in allowed:
                measured = segment_seconds(model, op, mode, False, ctx, batch=1)
                world[calibration_key(mode, op, False)] = measured - priced.op_cost(mode, op, False, s, 1).time_s
        one_rank: dict[str, float] = {}
        alone = CostModel(small, 1, machine)
        ctx = SeqContext(SeqLayout.for_sequence(s, 1, causal), None)
        with whole_on_each_rank(model, group):
            for op in OPS:
                for mode in ONE_RANK_MODES:
                    measured = segment_seconds(model, op, mode, False, ctx, batch=1)
                    one_rank[calibration_key(mode, op, False)] = measured - alone.op_cost(mode, op, False, s, 1).time_s
    return Overheads(_recomputed(_slowest(world, group, device)), _recomputed(_slowest(one_rank, group, device)))


def _recomputed(seconds: dict[str, float]) -> dict[str, float]:
    """``seconds`` with every op's recomputed variant at :data:`RECOMPUTE_OVERHEAD` times its overhead."""
    return {**seconds, **{f"{key}/rc": RECOMPUTE_OVERHEAD * t for key, t in seconds.items()}}


def _slowest(seconds: dict[str, float], group: Any, device: torch.device) -> dict[str, float]:
    """``seconds`` with every value the largest any rank of ``group`` measured (:func:`_agree`), at least 0."""
    agreed = _agree({k: [(0.0, t)] for k, t in seconds.items()}, dist.ReduceOp.MAX, group, device)
    return {k: max(0.0, points[0][1]) for k, points in agreed.items()}


@dataclass(frozen=True)
class QuickMeasurement:
    """What :func:`cached_quick_machine` returns: the machine, its per-op overheads, the caller's extra measurements
    and whether they were read from the cache."""

    machine: Machine
    overheads: Overheads
    extras: dict[str, Any]
    cached: bool


def cached_quick_machine(
    dims: ModelDims,
    p: int,
    group: Any,
    device: torch.device,
    dtype: torch.dtype,
    extra: Callable[[Machine], dict[str, Any]] | None = None,
) -> QuickMeasurement:
    """:func:`quick_machine` and :func:`quick_overheads`, measured once per machine and kept in :func:`cache_dir`.

    Rank 0 of ``group`` reads the file and every rank receives its content (one broadcast), so every rank plans
    with the same model. Without a file every rank measures, ``extra(machine)`` (collective, optional) adds
    measurements kept alongside (a dict of numbers), and rank 0 writes the file.
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
        machine = dataclasses.replace(machine, name=f"{machine.name}, read from {path.name}")
        return QuickMeasurement(machine, Overheads.from_dict(box[0]["overheads"]), box[0]["extras"], True)
    machine = quick_machine(dims, p, group, device, dtype)
    overheads = quick_overheads(dims, machine, p, group, device, dtype)
    extras = extra(machine) if extra is not None else {}
    if rank0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(
                json.dumps({"machine": machine.to_dict(), "overheads": overheads.to_dict(), "extras": extras})
            )
            tmp.replace(path)
        except OSError:
            pass  # a read-only home: measured again next time
    return QuickMeasurement(machine, overheads, extras, False)


__all__ = [
    "QUICK_LENGTHS",
    "Overheads",
    "QuickMeasurement",
    "cache_dir",
    "cached_quick_machine",
    "machine_key",
    "overhead_config",
    "quick_machine",
    "quick_overheads",
]
