"""Fitting the profile's measurements: alpha-beta collectives and a few constants per op.

All fits minimise *relative* squared errors (a 1 ms and a 1 s measurement weigh the same), have
closed forms or a one-dimensional search, and yield physically meaningful constants:

* collectives: ``t = alpha + bytes / beta`` per kind (``alpha >= 0``, ``beta > 0``);
* op time: ``t = fixed + T(scale)`` where ``T(scale)`` is the modelled time with the GEMM seconds scaled
  by ``scale`` (overlap applied afterwards, so it is not linear in ``scale``): ``fixed`` in closed form for
  each ``scale``, ``scale`` by a log-spaced search within :data:`SCALE_RANGE` refined by golden sections.
  ``scale`` carries the elementwise work around the projections (norms, rotary, activations, copies and
  reorders), which grows with the tokens like the GEMMs and, on a small model, costs several times the
  GEMMs themselves. No prior pulls it towards 1: an earlier weak prior held that slope back, so the fit
  put the work into ``fixed`` and under-predicted held-out steps 2-4x longer than profiled by 10-20%;
* whole steps: one factor on the predicted step time (the model around its segments: embedding, loss,
  caches shared by all layers), ``sum(pred/meas) / sum((pred/meas)^2)``;
* memory: ``bytes = fixed + factor * var`` per quantity (saved, forward and backward transients), the
  length-independent part ``fixed`` exact from the shapes, ``factor`` in closed form.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lightning_paradyse.cost.dims import ModelDims
from lightning_paradyse.cost.memory import Mem, SegmentMemory, head_memory, segment_memory
from lightning_paradyse.cost.model import OpCalibration
from lightning_paradyse.cost.time import AlphaBeta, Machine, head_time, op_time

SCALE_RANGE = (0.1, 10.0)
"""Search range of the compute scale."""
FACTOR_RANGE = (0.25, 4.0)
"""Clip range of the memory factors (a formula off by more is a bug, not a calibration)."""


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> AlphaBeta:
    """``alpha + bytes / beta`` through ``(bytes, seconds)`` points, relative least squares."""
    x = np.array([b for b, _ in points], dtype=float)
    y = np.array([t for _, t in points], dtype=float)
    w = 1.0 / y**2
    A = np.stack([np.ones_like(x), x], axis=1)
    coef = np.linalg.lstsq(A * np.sqrt(w)[:, None], y * np.sqrt(w), rcond=None)[0]
    alpha, slope = float(coef[0]), float(coef[1])
    if alpha < 0:  # refit through the origin
        alpha, slope = 0.0, float(np.sum(w * x * y) / np.sum(w * x * x))
    if slope <= 0:  # latency-bound over the measured sizes: keep the latency, a very fast link
        alpha, slope = float(np.sum(w * y) / np.sum(w)), 1e-15
    return AlphaBeta(alpha, 1.0 / slope)


def fit_machine(raw: dict[str, Any], dims: ModelDims, p: int) -> Machine:
    """The :class:`Machine` of the benchmarks in a merged measurement set (scalar rates: the largest size)."""
    curves = {k: tuple((float(x), float(r)) for x, r in sorted(v)) for k, v in raw["kernels"].items()}
    collectives = {kind: {p: fit_alpha_beta(points)} for kind, points in raw["collectives"].items()}
    return Machine(
        name=f"measured ({p} ranks)",
        gemm_flops=curves["gemm"][-1][1],
        sdpa_fwd_flops=curves["sdpa_fwd"][-1][1],
        sdpa_bwd_flops=curves["sdpa_bwd"][-1][1],
        tile_fwd_flops=curves["tile_fwd"][-1][1],
        tile_bwd_flops=curves["tile_bwd"][-1][1],
        overlap=float(raw["overlap"]),
        flash_tiles=bool(raw.get("flash_tiles", False)),
        collectives=collectives,
        curves=curves,
    )


def fit_fixed_and_scale(measured: Sequence[float], model: Callable[[float], Sequence[float]]) -> tuple[float, float]:
    """``(fixed >= 0, scale)`` minimising the relative error of ``fixed + model(scale)[i]`` to ``measured[i]``."""
    m = np.asarray(measured, dtype=float)
    w = 1.0 / m**2

    def best_fixed(scale: float) -> tuple[float, float]:
        pred = np.asarray(model(scale), dtype=float)
        fixed = max(float(np.sum(w * (m - pred)) / np.sum(w)), 0.0)
        return fixed, float(np.sum(w * (fixed + pred - m) ** 2))

    grid = np.geomspace(*SCALE_RANGE, 49)
    errs = [best_fixed(s)[1] for s in grid]
    i = int(np.argmin(errs))
    lo, hi = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)])
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(40):  # golden-section refinement in log(scale)
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if best_fixed(math.exp(a))[1] <= best_fixed(math.exp(b))[1]:
            hi = b
        else:
            lo = a
    scale = math.exp((lo + hi) / 2)
    return best_fixed(scale)[0], scale


def fit_factor(measured: Sequence[float], parts: Sequence[Mem]) -> float:
    """``factor`` minimising the relative error of ``fixed + factor * var`` (clipped to :data:`FACTOR_RANGE`)."""
    m = np.asarray(measured, dtype=float)
    fixed = np.array([p.fixed for p in parts])
    var = np.array([p.var for p in parts])
    ok = m > 0
    if not ok.any() or not np.any(var[ok] > 0):
        return 1.0
    w = 1.0 / m[ok] ** 2
    factor = float(np.sum(w * var[ok] * (m[ok] - fixed[ok])) / np.sum(w * var[ok] ** 2))
    return min(max(factor, FACTOR_RANGE[0]), FACTOR_RANGE[1])


def _memory_factors(rows: Sequence[dict[str, Any]], formulas: Sequence[SegmentMemory]) -> dict[str, float]:
    return {
        name: fit_factor([r[name] for r in rows], [getattr(f, name) for f in formulas])
        for name in ("saved", "fwd", "bwd")
    }


def memory_factors(
    mode: str, op: str, rc: bool, rows: Sequence[dict[str, Any]], dims: ModelDims, p: int, flash: bool, batch: int
) -> dict[str, float]:
    """The memory factors (``saved``, ``fwd``, ``bwd``) of one (mode, op, recompute), or of the head (``mode ==
    "head"``), from its measured rows on this version's memory formulas."""
    lengths = [int(r["seq_len"]) for r in rows]
    if mode == "head":
        formulas = [head_memory(s, batch, p, dims) for s in lengths]
    else:
        formulas = [segment_memory(mode, op, rc, s, batch, p, dims, flash) for s in lengths]
    return _memory_factors(rows, formulas)


def fit_op(
    mode: str, op: str, rc: bool, rows: Sequence[dict[str, Any]], dims: ModelDims, p: int, machine: Machine, batch: int
) -> OpCalibration:
    """The constants of one (mode, op, recompute), or of the head (``mode == "head"``), from its rows."""
    lengths = [int(r["seq_len"]) for r in rows]
    times = [float(r["time_s"]) for r in rows]
    if mode == "head":
        work = [head_time(s, batch, p, dims, machine) for s in lengths]
        fixed, scale = fit_fixed_and_scale(times, lambda k: [k * w for w in work])
    else:
        timings = [op_time(mode, op, rc, s, batch, p, dims, machine) for s in lengths]
        fixed, scale = fit_fixed_and_scale(times, lambda k: [t.total(k) for t in timings])
    factors = memory_factors(mode, op, rc, rows, dims, p, machine.flash_tiles, batch)
    return OpCalibration(time_fixed=fixed, time_scale=scale, **factors)


def fit_step_scale(rows: Sequence[dict[str, Any]]) -> float:
    """Factor ``k`` minimising the relative error of ``k * pred_time_s`` to ``time_s`` over whole steps."""
    ratios = np.array([r["pred_time_s"] / r["time_s"] for r in rows if r["time_s"] > 0])
    if len(ratios) == 0:
        return 1.0
    return float(min(max(np.sum(ratios) / np.sum(ratios**2), SCALE_RANGE[0]), SCALE_RANGE[1]))
