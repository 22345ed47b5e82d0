"""Groups of different sizes in one step (FlexSP-style): run a step on several sequence-parallel groups.

The world of ``P`` ranks that holds the weight shards is cut into aligned power-of-two blocks, largest
first (``8 = 4 + 2 + 1 + 1``: ranks 0-3, 4-5, 6, 7). Each block is a group that trains its own share of
the step's sequences (packed into one sequence) under its own plan; :mod:`lightning_paradyse.cost.groups`
chooses the sizes and the assignment.

Parameters keep the ``1/P`` row shards of the unified layout: no weight is stored twice at rest. A group
of ``g`` ranks runs its modes on ``1/g`` shards (the layout a group of ``g`` would hold). In one documented
order per step:

1. :func:`enter_group`: every rank obtains the ``1/g`` shards of its group. The rows of a ``1/g`` shard are
   owned by ``P/g`` ranks (in this rank's group or in others); one all-to-all per op over the world, in
   model order on every rank and outside autograd, moves exactly the rows this rank lacks, and this
   rank's ``1/g`` rows are kept as leaf tensors the dispatch modules read instead of their ``1/P``
   parameters. A split into one group of ``P`` uses the parameters themselves; a group of 1 holds the
   whole weights for the step.
2. Forward and backward of the group's packed sequence, with :func:`~lightning_paradyse.parallel.configure`
   given the group's process group and layout. Only the group's own collectives run, so groups of
   different sizes and plans never wait on each other. The loss is normalised by the step's global
   number of real tokens.
3. :func:`exit_group`: the reverse all-to-all returns the gradients of the ``1/g`` shards to the owners of
   the rows, which add one contribution per group (the sum over groups is exactly the gradient of the
   whole step); replicated gradients are summed over the world, and the ``1/g`` shards are dropped.

Every world collective happens outside autograd at fixed points, so groups whose plans differ (modes,
recomputation) cannot interleave them differently. An idle group (no sequence) still takes part in
both steps and contributes zero gradients.

For the strategy (``ParaDySeStrategy(groups=True)``): :func:`select_documents` cuts a group's documents out of
a packed batch, :func:`planner_cost` is the group cost the solver minimises (:func:`packed_cost`: attention
per document, Hydraulis-style, plus :func:`regroup_seconds`), :class:`GroupStep` is one rank's share of a
step and :func:`imbalance` the slowest group over the mean.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_paradyse.comm import Group, all_gather_rows, all_to_all_rows, group_rank, group_size
from lightning_paradyse.cost.dims import ModelDims
from lightning_paradyse.cost.groups import Assignment, GroupCost
from lightning_paradyse.cost.time import Machine
from lightning_paradyse.graph.dispatch import OpDispatch
from lightning_paradyse.layout import split_offsets
from lightning_paradyse.parallel import dispatchers, reduce_replicated_grads, shard_sources


def check_sizes(sizes: Sequence[int], world: int) -> None:
    """Raise a ``ValueError`` unless ``sizes`` are powers of two, largest first, summing to ``world``."""
    if not sizes or any(g < 1 or g & (g - 1) for g in sizes):
        raise ValueError(f"group sizes {tuple(sizes)} must be powers of two (1, 2, 4, ...)")
    if sum(sizes) != world:
        raise ValueError(f"group sizes {tuple(sizes)} sum to {sum(sizes)}, not to the world size {world}")
    if list(sizes) != sorted(sizes, reverse=True):
        raise ValueError(f"group sizes {tuple(sizes)} must be given largest first (aligned blocks of ranks)")


def blocks(sizes: Sequence[int]) -> list[range]:
    """The ranks of each group: consecutive aligned blocks, ``(2, 1, 1) -> [0:2], [2:3], [3:4]``."""
    out, start = [], 0
    for g in sizes:
        out.append(range(start, start + g))
        start += g
    return out


@dataclass
class GroupSet:
    """The process groups of every aligned power-of-two block of the world, created once.

    ``torch.distributed.new_group`` is collective over the whole job, so every rank creates every block,
    in the same order (here: at construction). Groups of one rank are ``None`` (no collective).
    """

    world: Group
    """The ranks that hold the weight shards (the group the model was parallelized with)."""
    _groups: dict[tuple[int, int], Group] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p = group_size(self.world)
        ranks = list(range(p)) if self.world is None else dist.get_process_group_ranks(self.world)
        g = 2
        while g <= p:
            for start in range(0, p - g + 1, g):
                members = ranks[start : start + g]
                self._groups[(start, g)] = self.world if g == p else dist.new_group(members)
            g *= 2

    @property
    def p(self) -> int:
        return group_size(self.world)

    @property
    def rank(self) -> int:
        return group_rank(self.world)

    def mine(self, sizes: Sequence[int]) -> tuple[int, Group]:
        """``(index of this rank's group, its process group)`` for the split ``sizes``."""
        check_sizes(sizes, self.p)
        for index, members in enumerate(blocks(sizes)):
            if self.rank in members:
                g = len(members)
                return index, None if g == 1 else self._groups[(members.start, g)]
        raise AssertionError("unreachable: the blocks cover every rank")


def _op_pieces(op: OpDispatch) -> list[tuple[str, torch.Tensor, int]]:
    """``(name, parameter, rows)`` of an op's shard parameters, in registration order."""
    return [(name, op.get_parameter(name), src.rows) for name, src in op.sources.items()]


def _wanted(rows: int, sizes: Sequence[int], rank: int) -> tuple[int, int]:
    """``[start, stop)``: the rows of a weight with ``rows`` rows that ``rank`` reads in the split ``sizes``."""
    for members in blocks(sizes):
        if rank in members:
            offsets = split_offsets(rows, len(members))
            local = rank - members.start
            return offsets[local], offsets[local + 1]
    raise AssertionError("unreachable: the blocks cover every rank")


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, max(lo, hi))


@dataclass(frozen=True)
class _Exchange:
    """Which rows of an op's pieces (weights of ``rows_n`` rows) move between which ranks for one split."""

    sends: tuple[tuple[tuple[int, int], ...], ...]
    """Per piece, per rank ``j``: the local rows ``[lo, hi)`` of this rank's ``1/P`` shard that ``j`` reads."""
    recvs: tuple[tuple[int, ...], ...]
    """Per piece, per rank ``i``: rows of this rank's ``1/g`` shard that come from ``i`` (in row order)."""
    widths: tuple[int, ...]
    """Elements per row of each piece."""

    @classmethod
    def of(cls, pieces: list[tuple[str, torch.Tensor, int]], p: int, sizes: Sequence[int], rank: int) -> _Exchange:
        sends, recvs = [], []
        for _, _, rows in pieces:
            owned = split_offsets(rows, p)
            mine, want = (owned[rank], owned[rank + 1]), _wanted(rows, sizes, rank)
            spans = [_overlap(mine, _wanted(rows, sizes, j)) for j in range(p)]
            sends.append(tuple((lo - mine[0], hi - mine[0]) for lo, hi in spans))
            recvs.append(tuple(hi - lo for lo, hi in (_overlap((owned[i], owned[i + 1]), want) for i in range(p))))
        widths = tuple(math.prod(w.shape[1:]) for _, w, _ in pieces)
        return cls(tuple(sends), tuple(recvs), widths)

    def sent(self, j: int) -> list[int]:
        """Elements of each piece this rank's shard sends to rank ``j``."""
        return [(s[j][1] - s[j][0]) * k for s, k in zip(self.sends, self.widths)]

    def received(self, i: int) -> list[int]:
        """Elements of each piece this rank's ``1/g`` shard gets from rank ``i``."""
        return [r[i] * k for r, k in zip(self.recvs, self.widths)]


def enter_group(module: nn.Module, world: Group, sizes: Sequence[int]) -> None:
    """Step 1 of the module docstring: give every dispatch module this rank's ``1/g`` shards for the split
    ``sizes`` (every rank's group is known from it).

    One all-to-all per op over the world moves exactly the rows each rank reads and lacks: rank ``j`` receives
    from every owner the part of its ``1/P`` shard that lies in ``j``'s ``1/g`` rows (``(1/g - 1/P)`` of the
    weights per rank; nothing when the split is the world).
    """
    p, rank = group_size(world), group_rank(world)
    check_sizes(sizes, p)
    for _, op in dispatchers(module):
        if op.group_shards is not None:
            raise RuntimeError("enter_group called twice without exit_group")
        op.group_shards = {}
        if len(sizes) == 1:
            continue
        pieces = _op_pieces(op)
        ex = _Exchange.of(pieces, p, sizes, rank)
        with torch.no_grad():
            send = [
                w.detach()[spans[j][0] : spans[j][1]].reshape(-1)
                for j in range(p)
                for (_, w, _), spans in zip(pieces, ex.sends)
            ]  # destination-rank order, then the op's pieces
            in_sizes, out_sizes = [sum(ex.sent(j)) for j in range(p)], [sum(ex.received(i)) for i in range(p)]
            recv = all_to_all_rows(torch.cat(send), in_sizes, out_sizes, world)  # [numel] -> [numel']
            parts = [torch.split(chunk, ex.received(i)) for i, chunk in enumerate(torch.split(recv, out_sizes))]
        for n, (name, w, _) in enumerate(pieces):
            shard = torch.cat([parts[i][n].view(-1, *w.shape[1:]) for i in range(p)])  # [rows/g, k], row order
            op.group_shards[name] = shard.requires_grad_(w.requires_grad)


def exit_group(module: nn.Module, world: Group, sizes: Sequence[int], replicated: bool = True) -> None:
    """Step 3 of the module docstring: the ``1/g`` gradients onto the ``1/P`` shards, replicated ones summed.

    The reverse all-to-all of :func:`enter_group`: every rank returns to each owner the gradient of the rows it
    read, and the owner adds what every group sent (one contribution per group that read the row). Shard
    gradients are added to what the parameters hold (gradient accumulation works). With ``replicated=False``
    the replicated gradients are left for one :func:`~lightning_paradyse.parallel.reduce_replicated_grads`
    call before the optimizer step (needed when several micro-batches accumulate).
    """
    p, rank = group_size(world), group_rank(world)
    for _, op in dispatchers(module):
        shards = op.group_shards
        if shards is None:
            raise RuntimeError("exit_group called without enter_group")
        op.group_shards = None
        if len(sizes) == 1:
            continue
        pieces = _op_pieces(op)
        ex = _Exchange.of(pieces, p, sizes, rank)
        with torch.no_grad():
            grads = []  # per piece: the gradient rows that came from each owner
            for (name, _, _), recvs in zip(pieces, ex.recvs):
                grad = shards[name].grad
                grads.append(torch.split(grad if grad is not None else torch.zeros_like(shards[name]), list(recvs)))
            send = [grads[n][i].reshape(-1) for i in range(p) for n in range(len(pieces))]  # owner order
            in_sizes, out_sizes = [sum(ex.received(i)) for i in range(p)], [sum(ex.sent(j)) for j in range(p)]
            recv = all_to_all_rows(torch.cat(send), in_sizes, out_sizes, world)  # [numel'] -> [numel]
            for j, chunk in enumerate(torch.split(recv, out_sizes)):  # rank j's gradient of the rows it read here
                for (_, w, _), spans, piece in zip(pieces, ex.sends, torch.split(chunk, ex.sent(j))):
                    lo, hi = spans[j]
                    if hi == lo or not w.requires_grad:
                        continue
                    if w.grad is None:
                        w.grad = torch.zeros_like(w)
                    w.grad[lo:hi] += piece.view(hi - lo, *w.shape[1:])
    if replicated:
        reduce_replicated_grads(module, world)


def measure_regroup(module: nn.Module, world: Group, reps: int = 3) -> float:
    """Seconds of :func:`enter_group` + :func:`exit_group` into groups of one rank (the largest exchange),
    the median of ``reps`` on every rank and the slowest rank's (collective; gradients are left as they were)."""
    p = group_size(world)
    if p == 1:
        return 0.0
    sharded = set(shard_sources(module))
    shards = [w for name, w in module.named_parameters() if name in sharded]
    before = [w.grad for w in shards]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        enter_group(module, world, (1,) * p)
        exit_group(module, world, (1,) * p, replicated=False)
        times.append(time.perf_counter() - start)
    for w, grad in zip(shards, before):
        w.grad = grad
    mine = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
    return float(all_gather_rows(mine, [1] * p, world).max())  # [1] -> [p]


# --------------------------------------------------------------------------------------------------
# A packed batch split among the groups (what the strategy does with ``groups=True``)
# --------------------------------------------------------------------------------------------------


def select_documents(batch: Mapping[str, Any], spans: Sequence[tuple[int, int]], docs: Sequence[int]) -> dict[str, Any]:
    """The packed batch of the documents ``docs`` (in that order): every ``[1, s, ...]`` and ``[s]`` tensor cut.

    ``spans`` are the ``(start, stop)`` of every document of the packed ``batch`` (documents contiguous).
    """
    s = spans[-1][1]
    index = torch.cat([torch.arange(*spans[d]) for d in docs])  # [s_group] token indices of the documents

    def cut(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.dim() >= 2 and tuple(value.shape[:2]) == (1, s):
            return value.index_select(1, index.to(value.device))  # [1, s, ...] -> [1, s_group, ...]
        if tuple(value.shape) == (s,):
            return value.index_select(0, index.to(value.device))  # [s] -> [s_group]
        return value

    return {key: cut(value) for key, value in batch.items()}


def flop_weights(dims: ModelDims) -> tuple[float, float]:
    """``(per token, per attended pair)`` training FLOPs of the blocks: the linear and the quadratic term."""
    q, kv, f = dims.n_heads * dims.head_dim, dims.n_kv_heads * dims.head_dim, dims.ffn
    linear = 2 * dims.hidden * (2 * q + 2 * kv + (3 if dims.gated else 2) * f)  # q, o, k, v, MLP projections
    pair = 4 * dims.n_heads * dims.head_dim * (0.5 if dims.causal else 1.0)  # scores and weighted values
    return 3 * dims.n_layers * linear, 3 * dims.n_layers * pair  # forward + backward = 3x forward


def attention_crossover(dims: ModelDims) -> int:
    """The sequence length at which attention costs as many FLOPs as the rest of the blocks (for
    :attr:`~lightning_paradyse.batching.BatchingConfig.attention_len`)."""
    per_token, per_pair = flop_weights(dims)
    return max(1, round(per_token / per_pair))


def packed_cost(
    dims: ModelDims,
    step_time: Callable[[int, int], float | None] | None = None,
    fixed: Callable[[int], float] | None = None,
) -> GroupCost:
    """The cost of a group training documents packed into one sequence (Hydraulis-style: tokens and attention).

    With ``step_time(s, g)`` (a planner's predicted seconds for one sequence of ``s`` tokens on ``g`` ranks,
    ``None`` if no plan fits) the packed step costs ``step_time(L, g)`` with its attention share rescaled
    from ``L^2`` to ``sum(l_i^2)``: documents never attend to each other, so short documents packed together
    cost their tokens, not the square of their total. Memory is that of one sequence of ``L`` tokens (an upper
    bound). Without it the cost is the FLOPs per rank, ``(a L + c sum(l_i^2)) / g``. Both are monotone.
    ``fixed(g)`` adds seconds per step that do not depend on the documents (e.g. :func:`regroup_seconds`).
    """
    a, c = flop_weights(dims)

    def cost(lengths: tuple[int, ...], g: int) -> float | None:
        total, squares = sum(lengths), sum(n * n for n in lengths)
        if step_time is None:
            return (a * total + c * squares) / g
        whole = step_time(total, g)
        if whole is None:
            return None
        extra = fixed(g) if fixed is not None else 0.0
        return whole * (a * total + c * squares) / (a * total + c * total * total) + extra

    return cost


def planner_cost(
    dims: ModelDims,
    world: int,
    planner_for: Callable[[int], Any],
    regroup_scale: float = 1.0,
    step_scale: Mapping[int, float] | None = None,
    regroup: bool = True,
) -> GroupCost:
    """The strategy's group cost: :func:`packed_cost` on the planner of each group size, times the measured
    correction ``step_scale[g]`` (:class:`StepScales`), plus :func:`regroup_seconds` times ``regroup_scale``
    (measured over predicted, :func:`measure_regroup`; left out with ``regroup=False``); the FLOP cost when the
    planners have no cost model (fixed plans)."""
    from lightning_paradyse.cost.planner import CostPlanner, PlanInfeasible

    if not isinstance(planner_for(world), CostPlanner):
        return packed_cost(dims)
    scales = step_scale or {}

    def step_time(s: int, g: int) -> float | None:
        try:
            return float(planner_for(g).step(s, 1).time_s) * scales.get(g, 1.0)
        except PlanInfeasible:
            return None

    def regroup_time(g: int) -> float:
        model = planner_for(g).model
        return regroup_scale * regroup_seconds(model.dims, model.machine, world, g)

    return packed_cost(dims, step_time, regroup_time if regroup else None)


@dataclass
class StepScales:
    """Measured over predicted step time per group size, learned from the steps run (online calibration).

    After every grouped step each rank knows every group's measured forward and backward (all-gathered) and
    its prediction, so every rank updates the same factors: an exponential average of ``measured /
    predicted`` over the groups of each size, clamped to ``[0.1, 10]``. Group sizes never run keep 1.0.
    """

    weight: float = 0.3
    """Weight of the newest step in the average."""
    scales: dict[int, float] = field(default_factory=dict)

    def update(self, sizes: Sequence[int], predicted: Sequence[float], measured: Sequence[float]) -> None:
        ratios: dict[int, list[float]] = {}
        for g, pred, meas in zip(sizes, predicted, measured):
            if pred > 0 and meas > 0:
                ratios.setdefault(g, []).append(min(10.0, max(0.1, meas / pred)))
        for g, values in sorted(ratios.items()):
            ratio = sum(values) / len(values)
            old = self.scales.get(g)
            self.scales[g] = ratio if old is None else (1 - self.weight) * old + self.weight * ratio


def regroup_seconds(dims: ModelDims, machine: Machine, world: int, g: int) -> float:
    """Predicted seconds of :func:`enter_group` and :func:`exit_group` for a rank in a group of ``g`` of ``world``.

    Per op of the blocks one all-to-all forward and one backward, each rank receiving (and, on the way back,
    sending) the ``1/g - 1/world`` of the weights it reads but does not own; nothing when the group is the world.
    The all-to-all is over every rank, so a step waits for its smallest group's exchange (the solver charges
    each group its own, a slight under-estimate for the larger groups of a mixed split).
    """
    if g >= world:
        return 0.0
    weights = dims.n_layers * (dims.attn_params() + dims.mlp_params()) * dims.dtype_bytes
    volume, calls = weights * (1 / g - 1 / world), 2 * dims.n_layers
    return 2 * machine.collective("all_to_all", world).time(calls, volume)


def machine_for_groups(machine: Machine, world: int) -> Machine:
    """``machine`` with a collective model for every power-of-two group size up to ``world``.

    Sizes that were not measured take the nearest measured size's alpha-beta (an approximation: on one
    host or one fast network the per-byte cost changes little with the group size); a described network
    (:attr:`Machine.links`) needs nothing.
    """
    if machine.links is not None:
        return machine
    sizes = [1 << k for k in range(world.bit_length()) if 1 << k <= world]
    table: dict[str, dict[int, Any]] = {}
    for kind, measured in machine.collectives.items():
        if not measured:
            continue
        table[kind] = {g: measured.get(g) or measured[min(measured, key=lambda q: (abs(q - g), q))] for g in sizes}
    return dataclasses.replace(machine, collectives=table)


@dataclass(frozen=True)
class GroupStep:
    """One training step of this rank on its group: what the strategy configures and runs."""

    assignment: Assignment
    """Group sizes and the documents of each group (the same on every rank)."""
    index: int
    """This rank's group."""
    group: Group
    """Its process group (``None`` for a group of one)."""
    rank: int
    """This rank's rank inside the group."""
    batch: dict[str, Any]
    """The group's packed batch (its documents)."""
    predicted: tuple[float, ...] = ()
    """Every group's predicted forward and backward (without the regroup or the learned correction)."""

    @property
    def size(self) -> int:
        return self.assignment.sizes[self.index]

    def digest(self, checksum: int) -> int:
        """A signed 64-bit hash of the assignment and the batch, equal across ranks that agree."""
        text = repr((self.assignment.sizes, self.assignment.groups, checksum)).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)


def imbalance(times: Sequence[float]) -> float:
    """Slowest over mean of the groups' times (1.0: perfectly balanced)."""
    busy = [t for t in times if t > 0]
    return max(busy) / (sum(busy) / len(busy)) if busy else 1.0
