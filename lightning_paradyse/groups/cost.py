"""What a group costs: the seconds a group of ``g`` ranks needs for its share of a step's sequences.

The solver (:mod:`~lightning_paradyse.groups.solver`) minimises the slowest group's cost. A step holds *units*,
the things dealt to groups:

* the rows of an ordinary batch ``[b, s]`` (padded on the right or not): a group trains its rows as a batch
  ``[b_g, s_g]``, cut to its longest row (right padding past it is never computed, which is exact for a causal
  model: no real token attends to a later one);
* the documents of a packed batch (``doc_ids``): a group trains its documents packed into one sequence, and
  attention is counted per document (Hydraulis-style: documents never attend to each other, so short documents
  packed together cost their tokens, not the square of their total).

With a cost model, a group's time is the planner's predicted step time for the group's shape (planned once per
length bucket) moved from the bucket's ends to the real lengths in the FLOP count (:func:`length_time`,
:func:`flop_weights`), times the correction ``scales[g]`` of its group size when given, plus the weight exchange
(:func:`exchange_seconds`); without one (a fixed plan or thresholds) it is the FLOPs per rank. The costs are
monotone, adding a unit never makes a group faster, as the solver's bound needs, wherever the planner's own times
are: a step planned at a bucket's lower end can be slower than at its upper end where the plan changes (a group of
one takes ``tp_sp`` whenever it fits, however fast the others are predicted).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_paradyse.cost.dims import ModelDims
from lightning_paradyse.cost.time import Machine
from lightning_paradyse.groups.solver import GroupCost, ShapeCost
from lightning_paradyse.planning.planner import CostPlanner

SHAPE_CACHE = 2**16
"""Shapes ``(s, b, g)`` whose predicted time :func:`planner_step_time` keeps."""

StepTime = Callable[[int, int, int], "float | None"]
"""``step_time(s, b, g)``: predicted seconds of ``b`` sequences of ``s`` tokens on ``g`` ranks; ``None``: no plan
fits the memory budget."""


def flop_weights(dims: ModelDims) -> tuple[float, float]:
    """``(per token, per attended pair)`` training FLOPs of the blocks: the linear and the quadratic term."""
    q, kv, f = dims.n_heads * dims.head_dim, dims.n_kv_heads * dims.head_dim, dims.ffn
    linear = 2 * dims.hidden * (2 * q + 2 * kv + (3 if dims.gated else 2) * f)  # q, o, k, v, MLP projections
    pair = 4 * dims.n_heads * dims.head_dim * (0.5 if dims.causal else 1.0)  # scores and weighted values
    return 3 * dims.n_layers * linear, 3 * dims.n_layers * pair  # forward + backward = 3x forward


def attention_crossover(dims: ModelDims) -> int:
    """The sequence length at which attention costs as many FLOPs as the rest of the blocks (for
    :attr:`~lightning_paradyse.data.batching.BatchingConfig.attention_len`)."""
    per_token, per_pair = flop_weights(dims)
    return max(1, round(per_token / per_pair))


def packed_cost(
    dims: ModelDims,
    step_time: StepTime | None = None,
    fixed: Callable[[int], float] | None = None,
) -> GroupCost:
    """The cost of a group training documents packed into one sequence of ``L = sum(l_i)`` tokens.

    With ``step_time`` the packed step costs ``step_time(L, 1, g)`` with its attention share rescaled from ``L^2``
    to ``sum(l_i^2)``; memory is that of one sequence of ``L`` tokens (an upper bound). Without it the cost is
    the FLOPs per rank, ``(a L + c sum(l_i^2)) / g``. ``fixed(g)`` adds seconds per step that do not depend on the
    documents (e.g. the weight exchange). A group needs at least ``g`` tokens.
    """
    a, c = flop_weights(dims)

    def cost(lengths: tuple[int, ...], g: int) -> float | None:
        total, squares = sum(lengths), sum(n * n for n in lengths)
        if total < g:
            return None
        if step_time is None:
            return (a * total + c * squares) / g
        whole = step_time(total, 1, g)
        if whole is None:
            return None
        extra = fixed(g) if fixed is not None else 0.0
        return whole * (a * total + c * squares) / (a * total + c * total * total) + extra

    return cost


def rows_shape_cost(
    dims: ModelDims,
    step_time: StepTime | None = None,
    fixed: Callable[[int], float] | None = None,
) -> ShapeCost:
    """The cost of a group training ``b`` rows as one batch ``[b, s]`` (``s``: its longest real row).

    With ``step_time`` it is ``step_time(s, b, g)``; without it the FLOPs per rank, ``b (a s + c s^2) / g``.
    ``fixed(g)`` as in :func:`packed_cost`. A group needs ``s >= g``.
    """
    a, c = flop_weights(dims)

    def cost(s: int, b: int, g: int) -> float | None:
        if s < g:
            return None
        if step_time is None:
            return b * (a * s + c * s * s) / g
        t = step_time(s, b, g)
        if t is None:
            return None
        return t + (fixed(g) if fixed is not None else 0.0)

    return cost


def rows_cost(
    dims: ModelDims,
    step_time: StepTime | None = None,
    fixed: Callable[[int], float] | None = None,
) -> GroupCost:
    """:func:`rows_shape_cost` of rows given by their real lengths ``l_i``: ``s = max(l_i)``, ``b`` their number."""
    shape = rows_shape_cost(dims, step_time, fixed)

    def cost(lengths: tuple[int, ...], g: int) -> float | None:
        return shape(max(lengths), len(lengths), g)

    return cost


def planner_step_time(
    dims: ModelDims, planner_for: Callable[[int], Any], scales: Mapping[int, float] | None = None
) -> StepTime:
    """:data:`StepTime` from the cost planner of each group size: the step planned at the shape's buckets
    (:meth:`~lightning_paradyse.planning.planner.CostPlanner.step`), its time moved from the bucket's length to the
    real one (:func:`length_time`) and, for a coarse bucket, interpolated linearly in the batch between its ends
    (``b`` rows between ``B/2`` and ``B``: the steps planned for both, ``B`` rows never priced below ``B/2``; near the
    budget, where a fine bucket's step is taken, its time as it is: at most one fine step more rows), times
    ``scales[g]``. Both are monotone where the planner's own times are (see the module docstring), so the cost is;
    results are cached per shape (:data:`SHAPE_CACHE` of them)."""

    a, c = flop_weights(dims)
    scales = scales or {}

    @functools.lru_cache(maxsize=SHAPE_CACHE)
    def step_time(s: int, b: int, g: int) -> float | None:
        planner = planner_for(g)
        high = planner.try_step(s, b)  # a shape that does not fit is no batch to skip or explain
        if high is None:
            return None
        time_s = length_time(planner, high, s, (a, c))
        if (high.seq_len, high.batch) == planner.coarse(s, b) and high.batch > b:  # interpolate from B/2 rows
            low = planner.step(s, high.batch // 2)  # fits: fewer rows of a length that fits
            below = length_time(planner, low, s, (a, c))
            time_s = max(time_s, below)  # B rows priced by the FLOPs (their lower end did not fit), B/2 by its ends
            time_s = below + (time_s - below) * (b - low.batch) / (high.batch - low.batch)
        return time_s * scales.get(g, 1.0)

    return step_time


def length_time(planner: Any, planned: Any, s: int, weights: tuple[float, float]) -> float:
    """The time of ``planned`` (a step planned for ``planned.seq_len >= s`` tokens: the upper end of ``s``'s length
    bucket) at ``s`` tokens: interpolated, in the FLOP count ``a s + c s^2`` (``weights``), between the step planned
    for the bucket's lower end (:meth:`~lightning_paradyse.planning.planner.CostPlanner.bucket_start`, as many rows)
    and ``planned``. Exact at both ends, monotone in ``s`` across buckets (where the lower end's step is not the
    slower: then flat, at ``planned``'s time, inside the bucket), and what does not grow with the tokens
    (a collective's latency, a kernel's launch) is kept whole: a step of many collectives planned for 64 tokens is
    not priced at 34 as if its latencies halved with the FLOPs. Where the lower end does not fit with as many rows
    (or is shorter than the group), the whole time is scaled by the FLOP count."""
    top = planned.seq_len
    if s >= top:
        return float(planned.time_s)
    a, c = weights

    def flops(n: int) -> float:
        return a * n + c * n * n

    start = planner.bucket_start(s)  # planned.seq_len is s's bucket top here (a step planned for s itself returned)
    below = planner.try_step(start, planned.batch) if start >= planner.model.p else None
    if below is None or (below.seq_len, below.batch) != (start, planned.batch):  # near the budget: fewer rows fit
        return float(planned.time_s) * flops(s) / flops(top)
    low = min(float(below.time_s), float(planned.time_s))
    return low + (float(planned.time_s) - low) * (flops(s) - flops(start)) / (flops(top) - flops(start))


def group_cost(
    dims: ModelDims,
    world: int,
    planner_for: Callable[[int], Any],
    packed: bool,
    exchange_scale: float = 1.0,
    step_scale: Mapping[int, float] | None = None,
    exchange: bool = True,
) -> GroupCost:
    """The strategy's group cost: :func:`packed_cost` or :func:`rows_cost` on the planner of each group size,
    times the correction ``step_scale[g]`` (none by default: decisions depend on the measured machine alone, so
    a rerun decides alike), plus :func:`exchange_seconds` times
    ``exchange_scale`` (measured over predicted; left out with ``exchange=False``); the FLOP cost when the
    planners have no cost model (a fixed plan or thresholds)."""
    if not packed:
        shape = group_shape_cost(dims, world, planner_for, exchange_scale, step_scale, exchange)

        def cost(lengths: tuple[int, ...], g: int) -> float | None:
            return shape(max(lengths), len(lengths), g)

        return cost
    if not _modelled(planner_for(world)):
        return packed_cost(dims)
    step_time = planner_step_time(dims, planner_for, step_scale)
    return packed_cost(dims, step_time, _exchange_time(world, planner_for, exchange_scale) if exchange else None)


def group_shape_cost(
    dims: ModelDims,
    world: int,
    planner_for: Callable[[int], Any],
    exchange_scale: float = 1.0,
    step_scale: Mapping[int, float] | None = None,
    exchange: bool = True,
) -> ShapeCost:
    """:func:`group_cost` of the rows of an ordinary batch as a :data:`ShapeCost` (for
    :func:`~lightning_paradyse.groups.solver.assign_rows`)."""
    if not _modelled(planner_for(world)):
        return rows_shape_cost(dims)
    step_time = planner_step_time(dims, planner_for, step_scale)
    return rows_shape_cost(dims, step_time, _exchange_time(world, planner_for, exchange_scale) if exchange else None)


def _modelled(planner: Any) -> bool:

    return isinstance(planner, CostPlanner)


def _exchange_time(world: int, planner_for: Callable[[int], Any], scale: float) -> Callable[[int], float]:
    @functools.lru_cache(maxsize=64)
    def exchange_time(g: int) -> float:
        model = planner_for(g).model
        return scale * exchange_seconds(model.dims, model.machine, world, g)

    return exchange_time


def exchange_seconds(dims: ModelDims, machine: Machine, world: int, g: int) -> float:
    """Predicted seconds of the weight exchange (:func:`~lightning_paradyse.groups.exchange.enter_group` and
    :func:`~lightning_paradyse.groups.exchange.exit_group`) for a rank in a group of ``g`` of ``world``.

    One all-to-all each way for the whole model, each rank receiving (and, on the way back, sending) the
    ``1/g - 1/world`` of the weights it reads but does not own; nothing when the group is the world. The
    all-to-all is over every rank, so a step waits for its smallest group's exchange (the solver charges each
    group its own, a slight under-estimate for the larger groups of a mixed split).
    """
    if g >= world:
        return 0.0
    weights = dims.n_layers * (dims.attn_params() + dims.mlp_params()) * dims.dtype_bytes
    volume = weights * (1 / g - 1 / world)
    return 2 * machine.collective("all_to_all", world).time(1, volume)


def placeholder_cost(shape: Callable[[int, int, int], float | None], lengths: Sequence[int]) -> Callable[[int], float]:
    """The price of an idle group of ``g`` ranks (the solver's ``idle``): its step on the placeholder the runner gives
    it, a token a rank of the shortest row (``shape(min(g, shortest), 1, g)``; 0 where that does not fit), once per
    group size."""
    shortest = min(lengths)
    held: dict[int, float] = {}

    def idle(g: int) -> float:
        if g not in held:
            held[g] = shape(min(g, shortest), 1, g) or 0.0
        return held[g]

    return idle


def machine_for_groups(machine: Machine, world: int) -> Machine:
    """``machine`` with a collective model for every power-of-two group size up to ``world``, and for ``world``.

    Sizes that were not measured take the nearest measured size's alpha-beta (an approximation: on one
    host or one fast network the per-byte cost changes little with the group size); a described network
    (:attr:`Machine.links`) needs nothing.
    """
    if machine.links is not None:
        return machine
    sizes = sorted({world, *(1 << k for k in range(world.bit_length()) if 1 << k <= world)})  # the world: exchanges
    table: dict[str, dict[int, Any]] = {}
    for kind, measured in machine.collectives.items():
        if not measured:
            continue
        table[kind] = {g: measured.get(g) or measured[min(measured, key=lambda q: (abs(q - g), q))] for g in sizes}
    return dataclasses.replace(machine, collectives=table)


__all__ = [
    "StepTime",
    "attention_crossover",
    "exchange_seconds",
    "flop_weights",
    "group_cost",
    "group_shape_cost",
    "length_time",
    "machine_for_groups",
    "packed_cost",
    "placeholder_cost",
    "planner_step_time",
    "rows_cost",
    "rows_shape_cost",
]
