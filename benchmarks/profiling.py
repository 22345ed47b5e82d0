"""The adaptive run's cost profile: the package's calibration run, on this machine, for the benchmark's model.

ParaDySe's exact planner (``ParaDySeStrategy(plan="auto", profile=...)``) needs a profile of the machine and the
model (``python cli.py profile``). Unless ``--profile`` names one, the benchmark makes it before the runs with
:func:`lightning_paradyse.calibration.profile.profile_worker` and
:func:`~lightning_paradyse.calibration.profile.fit_profile`
on the same number of processes, for the benchmark's own model config. The profiler builds models by config
name, so the config is entered under :data:`MODEL_NAME` in ``lightning_paradyse.models.CONFIGS`` in this
process and in the profiling processes (a runtime entry; no package file changes). The calibration time is
reported apart: it is a one-off cost per (machine, model), not part of any run's training time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.settings import BenchSettings, ModelSettings

MODEL_NAME = "benchmark-llama"
"""The name the benchmark's model config is profiled under."""


@dataclass(frozen=True)
class ProfilePlan:
    """The lengths the calibration measures (the planner extrapolates beyond them)."""

    lengths: tuple[int, ...]
    """Profiled lengths (segments)."""
    heldout: tuple[int, ...]
    """Held-out lengths of the validation steps."""
    reps: int = 2
    """Timed repetitions per measurement."""
    thorough: bool = True
    """The calibration's defences against a noisy machine (repetitions for a fixed time, two rounds); off for
    the quick preset, a smoke run whose numbers are not read."""


QUICK_SETTINGS = {"rounds": 1, "kernel_seconds": 0.0, "segment_seconds": 0.05, "step_seconds": 0.0}
"""The quick preset's calibration: one round, the fewest runs of kernels and steps; each segment repeated for 50 ms
(a few seconds in all: the tiny model's segments take about a millisecond, and with the fewest runs their fitted
constants, a group of one's most, swung by several times between invocations)."""


def profile_plan(settings: BenchSettings) -> ProfilePlan:
    """Lengths spanning the traces: the quick preset profiles short ones, the full one up to 1K (held out 2K)."""
    if settings.preset == "quick":
        return ProfilePlan(lengths=(64, 128, 256), heldout=(512,), reps=1, thorough=False)
    return ProfilePlan(lengths=(256, 512, 1024), heldout=(2048,), reps=2)


def register(model: ModelSettings) -> str:
    """Enter the benchmark's model config into ``CONFIGS`` (this process) and return its name."""
    from lightning_paradyse.models import CONFIGS

    CONFIGS[MODEL_NAME] = model.config()
    return MODEL_NAME


def _worker(rank: int, world: int, profile_settings: Any, model: ModelSettings) -> Any:
    register(model)
    from lightning_paradyse.calibration.profile import profile_worker

    return profile_worker(rank, world, profile_settings)


def make_profile(settings: BenchSettings, path: Path) -> dict[str, Any]:
    """Calibrate the cost model for ``settings.model`` on ``settings.devices`` processes and write it to ``path``.

    Returns what the report records: the path, the seconds taken and the held-out accuracy per mode.
    """
    from lightning_paradyse.calibration.profile import ProfileSettings, fit_profile, mape_per_mode, merge_ranks
    from lightning_paradyse.distributed.spawn import run_distributed

    plan = profile_plan(settings)
    name = register(settings.model)
    profile_settings = ProfileSettings(
        model=name,
        lengths=plan.lengths,
        heldout=plan.heldout,
        reps=plan.reps,
        step_lengths=(max(plan.lengths),),
        step_memory_reps=1,
        **({} if plan.thorough else QUICK_SETTINGS),
    )
    start = time.perf_counter()
    per_rank = run_distributed(_worker, settings.devices, profile_settings, settings.model, timeout=settings.timeout)
    profile = fit_profile(merge_ranks(per_rank), profile_settings, settings.devices)
    seconds = time.perf_counter() - start
    profile.meta = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "duration_s": round(seconds, 1)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=1))
    return {
        "path": path.name,
        "seconds": seconds,
        "lengths": list(plan.lengths),
        "heldout": list(plan.heldout),
        "mape_percent": mape_per_mode(profile.validation),
    }


__all__ = ["MODEL_NAME", "ProfilePlan", "make_profile", "profile_plan", "register"]
