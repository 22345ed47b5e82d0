"""The cost model: time and memory of every (mode, op, recompute) and of whole plans.

:class:`CostModel` joins the model's dimensions (:mod:`~lightning_paradyse.cost.dims`), a machine
(:class:`~lightning_paradyse.cost.time.Machine`: measured rates and collectives, or a cluster
description) and, when a profile was run, a few calibrated constants per (mode, op, recompute):

* time: ``fixed + scale * GEMM + attention + communication`` (overlap applied after scaling); ``fixed``
  absorbs per-op overheads (Python, kernel launches), ``scale`` the elementwise work around the
  projections that a bare GEMM benchmark does not see; attention runs the benchmarked kernels and is
  not scaled (see :class:`~lightning_paradyse.cost.time.OpTime`);
* memory: one factor per quantity (saved, forward transient, backward transient) on its
  length-dependent part; the length-independent part (weights in flight) is exact from the shapes;
* and one factor on whole steps (key ``step``) for what a model costs beyond its segments measured
  alone; it scales every op alike, so it changes predicted totals, never the choice of plan.

It turns one batch shape into a :class:`~lightning_paradyse.cost.search.PlanProblem` whose peak is
the real timeline of a step (:mod:`~lightning_paradyse.cost.search` states it): during the forward,
every segment's saved bytes stay alive, so position ``k`` sees the saved prefix, the live residual
stream and its own forward transient; during the backward, it sees the saved prefix up to and
including itself, the stream's gradient, the weight gradients of the layers after it, and its
backward transient; the LM head and loss come after the last block; after the backward, all
gradients and the replicated-gradient all-reduce. Parameters and optimizer state are static; under
Lightning the previous step's gradients are alive through the forward (``grads_resident``).

A model whose layers differ in their attention's sliding window (Gemma 3's sliding and full layers, Qwen2's
``max_window_layers``: :attr:`~lightning_paradyse.cost.dims.ModelDims.windows`) gets one cost table row per
distinct window, and every attention position reads the row of its layer's window: the planner prices and
places each layer type by its own work.

Switching between modes is free in this design (one layout, no data movement, no buffer pools), so
``switch_s`` and ``buffers`` default to zero; they exist so that a deployment with mode-specific
persistent buffers or switch overheads is planned exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from lightning_paradyse.cost.dims import ModelDims
from lightning_paradyse.cost.memory import (
    Mem,
    head_memory,
    op_grad_bytes,
    outer_grad_bytes,
    param_bytes,
    segment_memories,
    stream_bytes,
)
from lightning_paradyse.cost.search import Choice, PlanProblem, evaluate
from lightning_paradyse.cost.time import Machine, head_time, op_times
from lightning_paradyse.modes import MODES, get_mode
from lightning_paradyse.modes.plan import OPS, Plan

OP_TYPES = {"attention": 0, "mlp": 1}


def calibration_key(mode: str, op: str, recompute: bool) -> str:
    """Key of a (mode, op, recompute) in a profile: ``ring/attention`` or ``ring/attention/rc``."""
    return f"{mode}/{op}" + ("/rc" if recompute else "")


@dataclass(frozen=True)
class OpCalibration:
    """The calibrated constants of one (mode, op, recompute), or of the LM head (key ``head``)."""

    time_fixed: float = 0.0
    """Seconds added per op and step (overheads the FLOP and alpha-beta terms do not see)."""
    time_scale: float = 1.0
    """Factor on the GEMM seconds (the op's elementwise work around its projections, relative to a bare GEMM)."""
    saved: float = 1.0
    """Factor on the length-dependent saved bytes."""
    fwd: float = 1.0
    """Factor on the length-dependent forward transient."""
    bwd: float = 1.0
    """Factor on the length-dependent backward transient."""

    def to_dict(self) -> dict[str, float]:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OpCalibration:
        return cls(**{k: float(v) for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class OpCost:
    """Predicted cost of one segment (norm + op) for one step, per rank."""

    time_s: float
    """Seconds (forward + backward [+ recomputation])."""
    saved: int
    """Bytes kept from forward to backward."""
    fwd: int
    """Forward transient bytes above the memory alive before it."""
    bwd: int
    """Backward transient bytes above the memory alive when it starts."""


def _bytes(mem: Mem, factor: float) -> int:
    return math.ceil(mem.fixed + factor * mem.var)


@dataclass
class CostModel:
    """Predicted time and memory of ops and plans for one model on ``p`` ranks of one machine."""

    dims: ModelDims
    """The model's dimensions."""
    p: int
    """Ranks sharing a sequence."""
    machine: Machine
    """Rates and collectives."""
    calibration: Mapping[str, OpCalibration] = field(default_factory=dict)
    """Calibrated constants by :func:`calibration_key` (and ``head``); missing keys use defaults."""
    optimizer_bytes_per_param: float = 8.0
    """Optimizer state per parameter element (Adam: 8 for two float32 moments, 12 with a float32 master)."""
    include_static: bool = True
    """Count parameters and optimizer state (off when measuring a step with parameters already allocated)."""
    grads_resident: bool = True
    """The previous step's gradients are alive during the forward (and the head's forward): Lightning zeroes
    them in the step's closure after the forward, before the backward, and gradient accumulation keeps
    them on purpose. Off for a step that starts without gradients (the profile's measured steps)."""
    switch_s: float = 0.0
    """Seconds paid when consecutive ops run in different modes (zero in this design)."""
    buffers: Mapping[str, int] = field(default_factory=dict)
    """Persistent buffer bytes per mode, paid once by a plan that uses the mode (none in this design)."""
    one_rank: Mapping[str, OpCalibration] = field(default_factory=dict)
    """The calibration of a group of one rank cut from this model's ranks (a profile's single-rank segments, keyed
    like :attr:`calibration`); empty: such a group is priced on the machine's rates alone."""

    def _cal(self, key: str) -> OpCalibration:
        if key in self.calibration:
            return self.calibration[key]
        return OpCalibration(time_fixed=self.machine.op_overhead_s)

    def op_cost(
        self, mode: str, op: str, recompute: bool, seq_len: int, batch: int, window: int | None = None
    ) -> OpCost:
        """Time and memory of one segment (the op and the norm before it); ``window``: the causal sliding window
        of the layer's attention (``None``: the whole sequence)."""
        return self.op_costs(mode, op, seq_len, batch, window, (recompute,))[0]

    def op_costs(
        self,
        mode: str,
        op: str,
        seq_len: int,
        batch: int,
        window: int | None = None,
        recompute: tuple[bool, ...] = (False, True),
    ) -> tuple[OpCost, ...]:
        """:meth:`op_cost` for every flag of ``recompute``, in order (what the variants share worked out once:
        :func:`~.memory.segment_memories`, :func:`~.time.op_times`)."""
        window = window if op == "attention" else None
        flash = self.machine.flash_tiles
        inline = op == "mlp" and self.dims.inline_mlp and True in recompute
        flags = (*recompute, False) if inline and False not in recompute else recompute
        mems = segment_memories(mode, op, seq_len, batch, self.p, self.dims, flash, window, flags)
        timings = op_times(mode, op, seq_len, batch, self.p, self.dims, self.machine, window, flags)
        out = []
        for rc, mem, timing in zip(flags, mems, timings):
            cal = self._cal(calibration_key(mode, op, rc))
            time_s = cal.time_fixed + timing.total(cal.time_scale)
            out.append(OpCost(time_s, _bytes(mem.saved, cal.saved), _bytes(mem.fwd, cal.fwd), _bytes(mem.bwd, cal.bwd)))
        if inline:  # the block's activation between the recomputed linears keeps its tensors: no memory saved
            kept = out[flags.index(False)]
            out = [
                replace(c, saved=max(c.saved, kept.saved), fwd=max(c.fwd, kept.fwd), bwd=max(c.bwd, kept.bwd))
                if rc
                else c
                for rc, c in zip(flags, out)
            ]
        return tuple(out[: len(recompute)])

    def head_cost(self, seq_len: int, batch: int) -> OpCost:
        """The final norm, LM head and loss, like a segment."""
        cal = self._cal("head")
        mem = head_memory(seq_len, batch, self.p, self.dims)
        time_s = cal.time_fixed + cal.time_scale * head_time(seq_len, batch, self.p, self.dims, self.machine)
        return OpCost(time_s, _bytes(mem.saved, cal.saved), _bytes(mem.fwd, cal.fwd), _bytes(mem.bwd, cal.bwd))

    def step_scale(self) -> float:
        """The whole-step time factor of the profile (key ``step``), 1 without one."""
        step = self.calibration.get("step")
        return step.time_scale if step is not None else 1.0

    def static_bytes(self) -> int:
        """Parameters and optimizer state per rank (0 when ``include_static`` is off)."""
        if not self.include_static:
            return 0
        params = param_bytes(self.p, self.dims)
        return math.ceil(params * (1 + self.optimizer_bytes_per_param / self.dims.dtype_bytes))

    def replicated_bytes(self) -> float:
        """Gradient bytes of the replicated parameters (summed over the group after backward)."""
        per_layer = 2 * self.dims.op_replicated() * self.dims.dtype_bytes
        return self.dims.n_layers * per_layer + outer_grad_bytes(self.dims)

    def reduce_time(self) -> float:
        """The all-reduce of the replicated gradients (one call, algorithmic volume ``2*N*(p-1)/p``)."""
        if self.p == 1:
            return 0.0
        nbytes = 2 * self.replicated_bytes() * (self.p - 1) / self.p
        return self.machine.collective("all_reduce", self.p).time(1, nbytes)

    def allowed_modes(self, modes: Sequence[str] = tuple(MODES)) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The modes among ``modes`` that can run the attention and the MLP on ``p`` ranks."""
        attn = tuple(m for m in modes if get_mode(m).attention_infeasible(self.dims.attn_spec(), self.p) is None)
        mlp = tuple(m for m in modes if get_mode(m).mlp_infeasible(self.dims.mlp_spec(), self.p) is None)
        return attn, mlp

    def problem(
        self,
        seq_len: int,
        batch: int,
        modes: Sequence[str] = tuple(MODES),
        recompute: Sequence[bool] = (False, True),
        allowed: tuple[Sequence[str], Sequence[str]] | None = None,
    ) -> PlanProblem:
        """The planner's cost tables for one batch shape (see the module docstring).

        Rows: 0 the attention of the first layer's window, 1 the MLP, then one per further distinct window
        (:meth:`op_rows`).
        """
        choices = tuple(Choice(m, rc) for m in modes for rc in recompute)
        allowed = allowed if allowed is not None else self.allowed_modes(modes)
        rows = self.op_rows()
        C, R = len(choices), len(rows)
        tables = {name: np.zeros((R, C), dtype=np.int64) for name in ("saved", "fwd", "bwd")}
        times = np.zeros((R, C))
        flags = tuple(recompute)
        for o, (op, window) in enumerate(rows):
            for mode in dict.fromkeys(modes):  # a mode's variants priced together (what they share once)
                if mode not in allowed[OP_TYPES[op]]:
                    continue
                costs = dict(zip(flags, self.op_costs(mode, op, seq_len, batch, window, flags)))
                for c, ch in enumerate(choices):
                    if ch.mode != mode:
                        continue
                    cost = costs[ch.recompute]
                    times[o, c] = cost.time_s * self.step_scale()
                    tables["saved"][o, c], tables["fwd"][o, c], tables["bwd"][o, c] = cost.saved, cost.fwd, cost.bwd
        allowed_idx = tuple(
            tuple(c for c, ch in enumerate(choices) if ch.mode in allowed[OP_TYPES[op]]) for op, _ in rows
        )
        return self._assemble(seq_len, batch, choices, allowed_idx, times, tables)

    def op_rows(self) -> list[tuple[str, int | None]]:
        """``(op, window)`` of every row of the cost tables: the first layer's attention, the MLP, then the
        attention of every further distinct window in layer order (two rows for a model without windows)."""
        windows = [self.dims.window(layer) for layer in range(self.dims.n_layers)]
        rows: list[tuple[str, int | None]] = [("attention", windows[0]), ("mlp", None)]
        rows += [("attention", w) for i, w in enumerate(windows) if i and w not in windows[:i]]
        return rows

    def positions(self) -> tuple[int, ...]:
        """The cost table row of every op position (attention, MLP per layer, in model order)."""
        rows = self.op_rows()
        attn = {w: o for o, (op, w) in enumerate(rows) if op == "attention"}
        return tuple(
            row for layer in range(self.dims.n_layers) for row in (attn[self.dims.window(layer)], OP_TYPES["mlp"])
        )

    def _assemble(
        self,
        seq_len: int,
        batch: int,
        choices: tuple[Choice, ...],
        allowed: tuple[tuple[int, ...], ...],
        times: np.ndarray,
        tables: dict[str, np.ndarray],
    ) -> PlanProblem:
        K = 2 * self.dims.n_layers
        ops = self.positions()
        stream = math.ceil(stream_bytes(seq_len, batch, self.p, self.dims))
        head = self.head_cost(seq_len, batch)
        grads = [math.ceil(op_grad_bytes(OPS[k % 2], self.p, self.dims)) for k in range(K)]
        outer = math.ceil(outer_grad_bytes(self.dims))
        head_grads = math.ceil(self.dims.vocab * self.dims.hidden * self.dims.dtype_bytes)
        after = np.cumsum(grads[::-1])[::-1]  # grads of positions >= k
        bwd_offset = np.array([stream + head_grads + int(after[k]) - grads[k] for k in range(K)], dtype=np.int64)
        resident = int(sum(grads)) + outer if self.grads_resident else 0  # every gradient, through the forward
        switch = None
        if self.switch_s:
            modes = np.array([ch.mode for ch in choices])
            switch = np.where(modes[:, None] != modes[None, :], self.switch_s, 0.0)
        return PlanProblem(
            choices=choices,
            ops=ops,
            allowed=allowed,
            time=times,
            saved=tables["saved"],
            fwd=tables["fwd"],
            bwd=tables["bwd"],
            fwd_offset=np.full(K, stream + resident, dtype=np.int64),
            bwd_offset=bwd_offset,
            end_need=max(stream + resident + head.fwd, head.saved + head.bwd),
            fixed_need=int(sum(grads)) + outer + math.ceil(2 * self.replicated_bytes()),
            static=self.static_bytes(),
            switch=switch,
            buffers=dict(self.buffers),
            base_time=(head.time_s + self.reduce_time()) * self.step_scale(),
        )

    def plan_cost(self, plan: Plan, seq_len: int, batch: int) -> tuple[float, int]:
        """``(seconds, peak bytes)`` of one step under ``plan`` (the same accounting the planner optimises)."""
        used = sorted({op.mode for layer in plan.layers for op in (layer.attention, layer.mlp)})
        attention = tuple(sorted({layer.attention.mode for layer in plan.layers}))
        mlp = tuple(sorted({layer.mlp.mode for layer in plan.layers}))
        problem = self.problem(seq_len, batch, used, allowed=(attention, mlp))  # a mode only where the plan runs it
        index = {(ch.mode, ch.recompute): c for c, ch in enumerate(problem.choices)}
        seq = [index[(layer.op(op).mode, layer.op(op).recompute)] for layer in plan.layers for op in OPS]
        return evaluate(problem, seq)
