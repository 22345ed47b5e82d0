"""The calibration run: measure this machine and this model, fit a few constants, check on held-out lengths.

``python cli.py profile --config llama-tiny`` spawns ``p`` gloo ranks
(:func:`~lightning_paradyse.distributed.spawn.run_distributed`) that, in one run:

1. **benchmark the machine** at the model's shapes: the GEMM rate, the fused attention kernel (SDPA)
   and the ring attention tile kernel, forward and backward; every collective kind at a few sizes
   (fitted to ``alpha + bytes/beta``, bytes counted as :class:`~lightning_paradyse.distributed.comm.CommCounter`
   counts them); and the overlap efficiency of a ring transfer with a GEMM;
2. **measure every segment** (norm + op) in every mode and recompute flag at the profiled lengths:
   time of forward + backward, and with :class:`~lightning_paradyse.calibration.tracker.MemoryTracker` the
   saved bytes and both transient peaks (the LM head and loss likewise);
3. **measure whole steps** of the full model under every uniform plan, at the profiled lengths and at
   held-out lengths, including lengths 4x longer than any profiled one: time and peak memory.

The parent fits, per (mode, op, recompute), the two time constants and three memory factors of
:class:`~lightning_paradyse.cost.model.OpCalibration` by relative least squares (few constants, not a
black box), and one step factor (key ``step``: what a whole model costs beyond its segments measured
alone) on the steps at profiled lengths; it then predicts the held-out steps with the calibrated model
and reports predicted against measured with the mean absolute percentage error per mode. Everything
goes into a JSON profile that :func:`load_profile` reads back for the planner.

Timings are the slowest rank's median repetition (short measurements are repeated more often), the
median of ``rounds`` whole rounds of measurement; memory is the fullest rank's: saved bytes the minimum
over repetitions (gloo may release a communication buffer late, which only adds), peaks the median.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_paradyse.calibration.calibrate import fit_machine, fit_op, fit_step_scale, memory_factors
from lightning_paradyse.calibration.measure import (
    bench_collectives,
    bench_kernels,
    bench_overlap,
    collective_sizes,
    measure_head,
    measure_segment,
    measure_step,
    whole_on_each_rank,
)
from lightning_paradyse.cost.dims import ModelDims, dims_from_config, dtype_size
from lightning_paradyse.cost.model import CostModel, OpCalibration, calibration_key
from lightning_paradyse.cost.time import Machine
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.models import build_model, resolve_config
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.attention import fused_tiles
from lightning_paradyse.modes.plan import OPS, uniform_plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime.parallel import is_causal, parallelize

PROFILE_VERSION = 1


@dataclass(frozen=True)
class ProfileSettings:
    """What a calibration run measures."""

    model: str = "llama-tiny"
    """Model config: a name in ``lightning_paradyse.models.CONFIGS`` or a YAML/JSON config file
    (:func:`~lightning_paradyse.models.resolve_config`)."""
    lengths: tuple[int, ...] = (128, 256, 512)
    """Sequence lengths the constants are fitted on."""
    heldout: tuple[int, ...] = (192, 384, 1024, 2048)
    """Lengths of the validation steps (never used for fitting); include one >= 4x the longest profiled."""
    batch: int = 1
    """Sequences per batch."""
    dtype: str = "float32"
    """Dtype of weights and activations."""
    modes: tuple[str, ...] = tuple(MODES)
    """Modes to profile and validate."""
    reps: int = 3
    """Timed repetitions per measurement (after one warm-up)."""
    seed: int = 0
    """Seed of weights and inputs."""
    progress: bool = True
    """Show a progress bar (rank 0, on stderr)."""
    step_lengths: tuple[int, ...] | None = None
    """Profiled lengths of the whole steps that fit the step factor (default: all profiled lengths)."""
    step_memory_reps: int = 2
    """Tracked (slower) repetitions of a whole step for its peak memory."""
    kernel_seconds: float = 0.15
    """Kernel benchmarks are repeated until their repetitions take about this long (at most 40)."""
    segment_seconds: float = 0.5
    """Short segments are timed with more repetitions, about this many seconds of them (at most 40)."""
    step_seconds: float = 2.0
    """Short whole steps likewise: their median over many runs is steadier."""
    device: str = "cpu"
    """``"cpu"`` or ``"cuda"``: where the ranks measure (on GPUs each rank takes GPU ``rank`` over NCCL when there are
    enough, else they share GPU 0 over gloo, whose collectives then are gloo's; kernels are timed after a
    synchronisation, collectives up to 256 MiB, kernel lengths up to 16x the longest profiled one, within the
    model's ``max_seq_len``: the ring's float32 score tiles grow with the square of the length)."""
    rounds: int = 2
    """Every measurement is taken this many times, a whole calibration apart, and the median counts: a machine
    slowed for a while by other load (a shared host) then rarely slows the same measurement in most rounds."""

    @property
    def kernel_lengths(self) -> tuple[int, ...]:
        """Lengths the kernel rates are benchmarked at: the profiled ones, and 2x and 4x the longest; on GPUs also
        every power of two up to the model's ``max_seq_len`` (a GPU's rates keep growing with the length)."""
        longest = max(self.lengths)
        lengths = {*self.lengths, 2 * longest, 4 * longest}
        if self.device == "cuda":  # up to the model's maximum, at most 16x the longest profiled length
            top, n = min(resolve_config(self.model).max_seq_len, 16 * longest), 8 * longest
            while n <= top:
                lengths.add(n)
                n *= 2
        return tuple(sorted(lengths))

    def __post_init__(self) -> None:
        if not self.lengths or not self.heldout:
            raise ValueError("give at least one profiled and one held-out length")
        resolve_config(self.model)  # a known name or a readable config file, else a clear error
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no GPU is visible here; profile with --device cpu")
        if self.reps < 1 or self.batch < 1 or self.rounds < 1:
            raise ValueError(f"reps, batch and rounds must be positive, got {self.reps}, {self.batch}, {self.rounds}")

    @classmethod
    def quick(cls, model: str = "llama-tiny", **overrides: Any) -> ProfileSettings:
        """A run of well under a minute on 2 CPU cores (for tests and smoke checks)."""
        base: dict[str, Any] = dict(
            model=model,
            lengths=(64, 128, 256),
            heldout=(192, 1024),
            reps=2,
            step_lengths=(256,),
            step_memory_reps=1,
            kernel_seconds=0.0,
            segment_seconds=0.0,
            step_seconds=0.0,
            rounds=1,
        )
        return cls(**{**base, **overrides})


@dataclass
class Profile:
    """A calibrated cost model of one (machine, model, group size), as stored in a JSON profile."""

    dims: ModelDims
    """The model's dimensions (the profiled model config)."""
    p: int
    """Ranks the profile was measured on."""
    machine: Machine
    """Measured rates and collectives."""
    calibration: dict[str, OpCalibration]
    """Fitted constants by ``mode/op[/rc]`` and ``head``."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The :class:`ProfileSettings` of the run."""
    measurements: dict[str, Any] = field(default_factory=dict)
    """Raw segment and head measurements."""
    validation: list[dict[str, Any]] = field(default_factory=list)
    """Held-out steps: mode, recompute, length, measured and predicted time and peak."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Host, torch version, date, duration."""
    calibration_one: dict[str, OpCalibration] = field(default_factory=dict)
    """Fitted constants of a group of one rank (:func:`_segments_one`), keyed like :attr:`calibration`; empty in a
    profile of one rank or one written before they were measured."""

    def cost_model(self, dims: ModelDims | None = None, **kwargs: Any) -> CostModel:
        """A :class:`CostModel` with this profile's machine and constants (for ``dims``, default the profiled model),
        carrying the constants of a group of one (:attr:`CostModel.one_rank`)."""
        kwargs.setdefault("one_rank", dict(self.calibration_one))
        return CostModel(dims or self.dims, self.p, self.machine, dict(self.calibration), **kwargs)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "meta": self.meta,
            "p": self.p,
            "dims": dataclasses.asdict(self.dims),
            "machine": self.machine.to_dict(),
            "calibration": {k: c.to_dict() for k, c in self.calibration.items()},
            "calibration_one": {k: c.to_dict() for k, c in self.calibration_one.items()},
            "settings": self.settings,
            "measurements": self.measurements,
            "validation": self.validation,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        """The profile of a JSON document, its memory factors fitted again (:func:`refit_memory`)."""
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r} is not {PROFILE_VERSION}; run the profile again")
        return refit_memory(
            cls(
                dims=ModelDims(**data["dims"]),
                p=int(data["p"]),
                machine=Machine.from_dict(data["machine"]),
                calibration={k: OpCalibration.from_dict(v) for k, v in data["calibration"].items()},
                settings=data.get("settings", {}),
                measurements=data.get("measurements", {}),
                validation=data.get("validation", []),
                meta=data.get("meta", {}),
                calibration_one={k: OpCalibration.from_dict(v) for k, v in data.get("calibration_one", {}).items()},
            )
        )


def refit_memory(profile: Profile) -> Profile:
    """``profile`` with its memory factors fitted again on its stored segment measurements, on this version's memory
    formulas, and its validation's predicted peaks recomputed with them (its time constants unchanged).

    A memory factor is the measured over the modelled length-dependent bytes of one segment: it corrects what the
    formulas leave out, so it belongs to the formulas it was fitted on. Memory is measured exactly (the same on
    every run on a CPU), so fitting again on the stored measurements gives what profiling again would: a saved
    profile stays consistent when a version corrects a formula. A profile without stored segments is unchanged."""
    segments = profile.measurements.get("segments")
    if not segments:
        return profile
    batch = int(profile.settings.get("batch", 1))
    calibration = _refit(profile, segments, dict(profile.calibration), profile.p, batch)
    one = profile.measurements.get("segments_one")
    calibration_one = _refit(profile, one, dict(profile.calibration_one), 1, batch) if one else profile.calibration_one
    refitted = dataclasses.replace(profile, calibration=calibration, calibration_one=calibration_one)
    model = CostModel(profile.dims, profile.p, profile.machine, calibration, include_static=False, grads_resident=False)
    validation = []
    for row in profile.validation:
        plan = uniform_plan(row["mode"], profile.dims.n_layers, row["rc"])
        validation.append({**row, "pred_peak": model.plan_cost(plan, row["seq_len"], batch)[1]})
    return dataclasses.replace(refitted, validation=validation)


def _refit(
    profile: Profile, segments: list[dict[str, Any]], calibration: dict[str, OpCalibration], p: int, batch: int
) -> dict[str, OpCalibration]:
    """``calibration`` with the memory factors of every (mode, op, recompute) in ``segments`` (measured on ``p``
    ranks) fitted again."""
    seg_dims = dataclasses.replace(profile.dims, n_layers=1)
    for mode, op, rc in sorted({(r["mode"], r["op"], bool(r["rc"])) for r in segments}):
        rows = [r for r in segments if (r["mode"], r["op"], bool(r["rc"])) == (mode, op, rc)]
        key = "head" if mode == "head" else calibration_key(mode, op, rc)
        factors = memory_factors(mode, op, rc, rows, seg_dims, p, profile.machine.flash_tiles, batch)
        calibration[key] = dataclasses.replace(calibration.get(key, OpCalibration()), **factors)
    return calibration


def load_profile(path: str | Path) -> Profile:
    """Read a JSON profile written by :func:`run_profile`."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read the profile {path}: {err}") from None
    return Profile.from_json(data)


# --------------------------------------------------------------------------------------------------
# The spawned ranks
# --------------------------------------------------------------------------------------------------


class _Progress:
    """A progress bar on rank 0 (tqdm on stderr), silent elsewhere."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, desc="profile", unit="step", dynamic_ncols=True)

    def step(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _build(settings: ProfileSettings) -> tuple[torch.nn.Module, Any]:
    longest = max((*settings.lengths, *settings.heldout))
    config = resolve_config(settings.model)
    config = dataclasses.replace(config, max_seq_len=max(config.max_seq_len, longest))
    torch.manual_seed(settings.seed)
    model = build_model(config).to(getattr(torch, settings.dtype))
    parallelize(model, dist.group.WORLD if dist.is_initialized() else None)  # on the host; the shards move next
    return model.to(_rank_device(settings)), config


def _backend(settings: ProfileSettings, world: int) -> str:
    """NCCL where every rank has a GPU of its own (what training runs), else gloo (the host, or ranks sharing GPUs:
    their collectives are then gloo's, not what an NCCL run would see)."""
    return "nccl" if settings.device == "cuda" and world <= torch.cuda.device_count() else "gloo"


def _rank_device(settings: ProfileSettings) -> torch.device:
    """This rank's device: the host, its own GPU where there are enough, else GPU 0 (ranks sharing it over gloo)."""
    if settings.device == "cpu":
        return torch.device("cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cuda", rank if rank < torch.cuda.device_count() else 0)
    torch.cuda.set_device(device)
    return device


def _segments(
    model: torch.nn.Module,
    settings: ProfileSettings,
    p: int,
    bar: _Progress,
    modes: Sequence[str] | None = None,
    label: str = "",
) -> list[dict[str, Any]]:
    """Every segment of ``modes`` (default the settings') with and without recomputation, and the head, at every
    length, on ``p`` ranks (one: no group); ``label`` prefixes the progress bar's steps."""
    group = dist.group.WORLD if p > 1 else None
    out = []
    for s in settings.lengths:
        ctx = SeqContext(SeqLayout.for_sequence(s, p, is_causal(model)), group)
        for mode in settings.modes if modes is None else modes:
            for op in OPS:
                for rc in (False, True):
                    row = measure_segment(
                        model, op, mode, rc, ctx, settings.batch, settings.reps, settings.segment_seconds
                    )
                    out.append({"mode": mode, "op": op, "rc": rc, "seq_len": s, **row})
                    bar.step(f"{label}{calibration_key(mode, op, rc)} s={s}")
        out.append({"mode": "head", "op": "head", "rc": False, "seq_len": s, **measure_head(model, ctx, settings)})
        bar.step(f"{label}head s={s}")
    return out


ONE_RANK_MODES = ("tp_sp", "metp")
"""The modes a group of one plans (:func:`~lightning_paradyse.planning.planner.single_rank_modes` of
every mode; a test keeps them alike), which :func:`_segments_one` measures."""


def _one_rank_modes(settings: ProfileSettings) -> list[str]:
    return [m for m in ONE_RANK_MODES if m in settings.modes]


def _segments_one(
    model: torch.nn.Module, settings: ProfileSettings, world: int, bar: _Progress
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The segments and whole steps of a group of one rank (data parallelism), on every rank alone: the modes such
    a group plans (:data:`ONE_RANK_MODES`) with and without recomputation, and the head, at every length; the steps
    under their uniform plans at the step lengths (they fit the group's whole-step factor, as the world's steps fit
    the world's). On the whole weights, gathered from the shards and read by the dispatch modules as a step on groups
    of one reads them. None on one rank: the world is such a group."""
    if world == 1:
        return [], []
    with whole_on_each_rank(model, dist.group.WORLD):
        modes = _one_rank_modes(settings)
        segments = _segments(model, settings, 1, bar, modes, "one rank ")
        steps = _steps(model, settings, settings.step_lengths or settings.lengths, 1, bar, modes, "one rank ")
    return segments, steps


def _steps(
    model: torch.nn.Module,
    settings: ProfileSettings,
    lengths: Sequence[int],
    p: int,
    bar: _Progress,
    modes: Sequence[str] | None = None,
    label: str = "",
) -> list[dict[str, Any]]:
    """Whole steps under every uniform plan (each of ``modes``, default the settings', with and without
    recomputation) at ``lengths`` on ``p`` ranks; ``label`` prefixes the progress bar's steps."""
    n_layers = resolve_config(settings.model).n_layers
    out = []
    for s in lengths:
        for mode in settings.modes if modes is None else modes:
            for rc in (False, True):
                row = measure_step(model, uniform_plan(mode, n_layers, rc), s, settings, p)
                out.append({"mode": mode, "rc": rc, "seq_len": s, **row})
                bar.step(f"{label}step {mode}{'+rc' if rc else ''} s={s}")
    return out


def _measure_once(
    model: torch.nn.Module, settings: ProfileSettings, dims: ModelDims, world: int, bar: _Progress
) -> dict[str, Any]:
    step_lengths = settings.step_lengths or settings.lengths
    device = _rank_device(settings)
    raw: dict[str, Any] = {"kernels": bench_kernels(dims, settings, world), "flash_tiles": fused_tiles(device)}
    bar.step("kernels")
    raw["collectives"] = bench_collectives(world, settings.reps, device=device, sizes=collective_sizes(device))
    bar.step("collectives")
    raw["overlap"] = bench_overlap(dims, world, device)
    bar.step("overlap")
    raw["segments"] = _segments(model, settings, world, bar)
    raw["segments_one"], raw["steps_one"] = _segments_one(model, settings, world, bar)
    raw["fit_steps"] = _steps(model, settings, step_lengths, world, bar)
    raw["steps"] = _steps(model, settings, settings.heldout, world, bar)
    return raw


def _median_rows(rounds: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Row-wise over rounds: the median time; memory as the first round measured it (it does not vary)."""
    return [{**parts[0], "time_s": statistics.median(r["time_s"] for r in parts)} for parts in zip(*rounds)]


def combine_curves(
    sets: Sequence[Mapping[str, Sequence[tuple[float, float]]]], pick: Callable[[Iterable[float]], float]
) -> dict[str, list[tuple[float, float]]]:
    """``{name: [(size, value), ...]}`` curves measured several times (same names and sizes) combined pointwise
    by ``pick`` (``min``, ``max`` or ``statistics.median``)."""
    return {
        name: [(points[0][0], pick(pt[1] for pt in points)) for points in zip(*(c[name] for c in sets))]
        for name in sets[0]
    }


def merge_rounds(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One measurement set from several rounds: the median over rounds of every rate and time."""
    first = rounds[0]
    merged = dict(first)
    merged["kernels"] = combine_curves([r["kernels"] for r in rounds], statistics.median)
    merged["collectives"] = combine_curves([r["collectives"] for r in rounds], statistics.median)
    merged["overlap"] = statistics.median(r["overlap"] for r in rounds)
    for key in ("segments", "fit_steps", "steps"):
        merged[key] = _median_rows([r[key] for r in rounds])
    for key in ("segments_one", "steps_one"):  # a group of one's: none on one rank
        merged[key] = _median_rows([r.get(key, []) for r in rounds])
    return merged


def profile_worker(rank: int, world: int, settings: ProfileSettings) -> dict[str, Any]:
    """Everything a rank measures (see the module docstring), ``settings.rounds`` times; all ranks run the same
    collectives."""
    _rank_device(settings)  # this rank's GPU current before anything runs
    model, config = _build(settings)
    step_lengths = settings.step_lengths or settings.lengths
    n_steps = (len(step_lengths) + len(settings.heldout)) * len(settings.modes) * 2
    n_meas = len(settings.lengths) * (len(settings.modes) * 4 + 1) + n_steps
    if world > 1:  # a group of one's segments and steps (_segments_one)
        n_meas += len(settings.lengths) * (len(_one_rank_modes(settings)) * 4 + 1)
        n_meas += len(step_lengths) * len(_one_rank_modes(settings)) * 2
    bar = _Progress((n_meas + 3) * settings.rounds, settings.progress and rank == 0)
    dims = dims_from_config(config, dtype_size(settings.dtype))
    rounds = [_measure_once(model, settings, dims, world, bar) for _ in range(settings.rounds)]
    bar.close()
    return merge_rounds(rounds)


# --------------------------------------------------------------------------------------------------
# The parent: merge ranks, fit, validate
# --------------------------------------------------------------------------------------------------


def _merge_rows(per_rank: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Row-wise over ranks: the slowest time, the fullest memory."""
    rows = []
    for parts in zip(*per_rank):
        row = dict(parts[0])
        for key in ("time_s", "saved", "fwd", "bwd", "peak"):
            if key in row:
                row[key] = max(part[key] for part in parts)
        rows.append(row)
    return rows


def merge_ranks(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One measurement set from every rank's (max over ranks of times and bytes)."""
    first = per_rank[0]
    merged: dict[str, Any] = {k: first[k] for k in ("collectives", "overlap", "flash_tiles") if k in first}
    merged["kernels"] = combine_curves([r["kernels"] for r in per_rank], min)  # the slowest rank's rate
    merged["segments"] = _merge_rows([r["segments"] for r in per_rank])
    merged["segments_one"] = _merge_rows([r.get("segments_one", []) for r in per_rank])
    merged["steps_one"] = _merge_rows([r.get("steps_one", []) for r in per_rank])
    merged["steps"] = _merge_rows([r["steps"] for r in per_rank])
    merged["fit_steps"] = _merge_rows([r["fit_steps"] for r in per_rank])
    return merged


def _validate(model: CostModel, steps: list[dict[str, Any]], n_layers: int, batch: int) -> list[dict[str, Any]]:
    rows = []
    for row in steps:
        plan = uniform_plan(row["mode"], n_layers, row["rc"])
        t, peak = model.plan_cost(plan, row["seq_len"], batch)
        rows.append({**row, "pred_time_s": t, "pred_peak": peak})
    return rows


def fit_profile(raw: dict[str, Any], settings: ProfileSettings, p: int) -> Profile:
    """Fit the machine and the per-op constants, and predict the held-out steps."""
    config = resolve_config(settings.model)
    dims = dims_from_config(config, dtype_size(settings.dtype))
    machine = fit_machine(raw, dims, p)
    seg_dims = dataclasses.replace(dims, n_layers=1)
    calibration: dict[str, OpCalibration] = {}
    keys = {(r["mode"], r["op"], r["rc"]) for r in raw["segments"]}
    for mode, op, rc in sorted(keys):
        rows = [r for r in raw["segments"] if (r["mode"], r["op"], r["rc"]) == (mode, op, rc)]
        key = "head" if mode == "head" else calibration_key(mode, op, rc)
        calibration[key] = fit_op(mode, op, rc, rows, seg_dims, p, machine, settings.batch)
    calibration_one: dict[str, OpCalibration] = {}
    one = raw.get("segments_one") or []
    for mode, op, rc in sorted({(r["mode"], r["op"], r["rc"]) for r in one}):
        rows = [r for r in one if (r["mode"], r["op"], r["rc"]) == (mode, op, rc)]
        key = "head" if mode == "head" else calibration_key(mode, op, rc)
        calibration_one[key] = fit_op(mode, op, rc, rows, seg_dims, 1, machine, settings.batch)
    steps_one: list[dict[str, Any]] = []
    if calibration_one:  # the whole-step factor of a group of one, fitted as the world's is
        model_one = CostModel(dims, 1, machine, calibration_one, include_static=False, grads_resident=False)
        steps_one = _validate(model_one, raw.get("steps_one") or [], config.n_layers, settings.batch)
        calibration_one["step"] = OpCalibration(time_scale=fit_step_scale(steps_one))
    model = CostModel(dims, p, machine, calibration, include_static=False, grads_resident=False)
    fitted = _validate(model, raw["fit_steps"], config.n_layers, settings.batch)
    calibration["step"] = OpCalibration(time_scale=fit_step_scale(fitted))
    model = CostModel(dims, p, machine, calibration, include_static=False, grads_resident=False)
    validation = _validate(model, raw["steps"], config.n_layers, settings.batch)
    measurements = {"segments": raw["segments"], "steps": fitted}
    if one:
        measurements["segments_one"], measurements["steps_one"] = one, steps_one
    measurements["benchmarks"] = {k: raw[k] for k in ("kernels", "overlap")}
    settings_dict = dataclasses.asdict(settings)
    return Profile(
        dims, p, machine, calibration, settings_dict, measurements, validation, calibration_one=calibration_one
    )


def run_profile(settings: ProfileSettings, world_size: int, timeout: float = 900.0) -> Profile:
    """Spawn the ranks, measure, fit; the returned :class:`Profile` carries its validation table."""
    start = time.monotonic()
    if world_size == 1:
        per_rank = [profile_worker(0, 1, settings)]
    else:
        backend = _backend(settings, world_size)
        per_rank = run_distributed(profile_worker, world_size, settings, timeout=timeout, backend=backend)
    profile = fit_profile(merge_ranks(per_rank), settings, world_size)
    profile.meta = {
        "host": platform.node(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "device": settings.device,
        "device_name": torch.cuda.get_device_name(0) if settings.device == "cuda" else platform.processor(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "duration_s": round(time.monotonic() - start, 1),
    }
    return profile


# --------------------------------------------------------------------------------------------------
# The accuracy table
# --------------------------------------------------------------------------------------------------


def _ape(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas * 100 if meas > 0 else math.nan


TIME_TARGET = {"interpolation": 10.0, "extrapolation": 15.0}
"""Mean absolute percentage error the time model is meant to stay within (held-out lengths inside the
profiled range, and beyond it up to 4x)."""
MEMORY_TARGET = {"interpolation": 5.0, "extrapolation": 15.0}
"""Likewise for peak memory."""


def mape_per_mode(validation: list[dict[str, Any]], longest: int | None = None) -> dict[str, dict[str, float]]:
    """``{mode: {"time": MAPE %, "memory": MAPE %}}`` over the held-out steps (both recompute flags).

    With ``longest`` (the longest profiled length), only the steps of at most that length
    (``longest > 0``) or longer than ``-longest`` (``longest < 0``) count; see :func:`mape_table`.
    """
    if longest is not None:
        validation = [r for r in validation if (r["seq_len"] <= longest if longest > 0 else r["seq_len"] > -longest)]
    out: dict[str, dict[str, float]] = {}
    for mode in dict.fromkeys(r["mode"] for r in validation):
        rows = [r for r in validation if r["mode"] == mode]
        out[mode] = {
            "time": statistics.fmean(_ape(r["pred_time_s"], r["time_s"]) for r in rows),
            "memory": statistics.fmean(_ape(r["pred_peak"], r["peak"]) for r in rows),
        }
    return out


def mape_table(profile: Profile) -> dict[str, dict[str, dict[str, float]]]:
    """MAPE per mode, apart for held-out lengths within the profiled range (``interpolation``) and beyond it
    (``extrapolation``), and over all (``all``); a part without held-out lengths is left out."""
    longest = max(profile.settings.get("lengths", [0]))
    parts = {
        "interpolation": mape_per_mode(profile.validation, longest),
        "extrapolation": mape_per_mode(profile.validation, -longest),
        "all": mape_per_mode(profile.validation),
    }
    return {name: table for name, table in parts.items() if table}


def format_validation(profile: Profile) -> str:
    """The predicted-against-measured table of the held-out steps and the MAPE per mode."""
    longest = max(profile.settings.get("lengths", [0]))
    ratio = max(r["seq_len"] for r in profile.validation) / max(longest, 1)
    lines = [
        f"held-out steps (profiled lengths {list(profile.settings.get('lengths', []))}; "
        f"longest held-out = {ratio:.1f}x the longest profiled)",
        f"{'plan':<12} {'length':>7} {'time meas':>10} {'time pred':>10} {'err':>7}   "
        f"{'peak meas':>11} {'peak pred':>11} {'err':>7}",
    ]
    for r in profile.validation:
        label = r["mode"] + ("+rc" if r["rc"] else "")
        te, me = _ape(r["pred_time_s"], r["time_s"]), _ape(r["pred_peak"], r["peak"])
        lines.append(
            f"{label:<12} {r['seq_len']:>7} {r['time_s'] * 1e3:>8.1f}ms {r['pred_time_s'] * 1e3:>8.1f}ms {te:>6.1f}%   "
            f"{r['peak'] / 2**20:>9.2f}MiB {r['pred_peak'] / 2**20:>9.2f}MiB {me:>6.1f}%"
        )
    titles = {
        "interpolation": f"held-out lengths <= {longest} (within the profiled range)",
        "extrapolation": f"held-out lengths > {longest} (beyond the profiled range)",
        "all": "all held-out lengths",
    }
    for part, table in mape_table(profile).items():
        target = ""
        if part in TIME_TARGET:
            target = f" (targets: time <= {TIME_TARGET[part]:.0f}%, memory <= {MEMORY_TARGET[part]:.0f}%)"
        lines.append(f"MAPE per mode, {titles[part]}, with and without recomputation{target}:")
        for mode, errs in table.items():
            lines.append(f"  {mode:<10} time {errs['time']:6.1f}%   memory {errs['memory']:6.1f}%")
    return "\n".join(lines)


def is_profile_file(path: str) -> bool:
    """A cost profile (JSON with a calibration), not a cluster file."""
    return path.endswith(".json") and '"calibration"' in Path(path).read_text()


__all__ = [
    "MEMORY_TARGET",
    "TIME_TARGET",
    "Profile",
    "ProfileSettings",
    "combine_curves",
    "fit_profile",
    "format_validation",
    "is_profile_file",
    "load_profile",
    "mape_per_mode",
    "mape_table",
    "merge_ranks",
    "merge_rounds",
    "profile_worker",
    "run_profile",
]
