"""Groups of different sizes in one step (FlexSP-style): run a step on several sequence-parallel groups.

The world of ``P`` ranks that holds the weight shards is cut into aligned power-of-two blocks, largest
first (``8 = 4 + 2 + 1 + 1``: ranks 0-3, 4-5, 6, 7). Each block is a group that trains its own share of
the step's sequences (packed into one sequence) under its own plan; :mod:`lightning_paradyse.cost.groups`
chooses the sizes and the assignment.

Parameters keep the ``1/P`` row shards of the unified layout: no weight is stored twice at rest. A group
of ``g`` ranks runs its modes on ``1/g`` shards (the layout a group of ``g`` would hold). In one documented
order per step:

1. :func:`enter_group`: every rank obtains the ``1/g`` shards of its group: the rows it lacks lie on the
   other ranks, so each op's shards are gathered once over the world (one coalesced all-gather per op, in
   model order on every rank, outside autograd) and this rank's ``1/g`` rows kept as leaf tensors the
   dispatch modules read instead of their ``1/P`` parameters. A group of ``P`` uses the parameters
   themselves; a group of 1 holds the whole weights.
2. Forward and backward of the group's packed sequence, with :func:`~lightning_paradyse.parallel.configure`
   given the group's process group and layout. Only the group's own collectives run, so groups of
   different sizes and plans never wait on each other. The loss is normalised by the step's global
   number of real tokens.
3. :func:`exit_group`: the gradients of the ``1/g`` shards are reduce-scattered over the world back onto
   the ``1/P`` shards (one coalesced call per op, in model order; the sum over ranks is the sum over
   groups, which is exactly the gradient of the whole step), replicated gradients are summed over the
   world, and the ``1/g`` shards are dropped.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_paradyse.comm import Group, all_gather_rows, all_reduce_sum, group_rank, group_size, reduce_scatter_rows
from lightning_paradyse.cost.dims import ModelDims
from lightning_paradyse.cost.groups import Assignment, GroupCost
from lightning_paradyse.cost.time import Machine
from lightning_paradyse.dispatch import OpDispatch
from lightning_paradyse.parallel import dispatchers, replicated_parameters
from lightning_paradyse.spec import row_sizes


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


def _flat_sizes(pieces: list[tuple[str, torch.Tensor, int]], p: int) -> list[int]:
    """Elements every rank holds of these pieces (1/p row shards)."""
    per_row = [math.prod(w.shape[1:]) for _, w, _ in pieces]
    return [sum(row_sizes(rows, p)[r] * k for (_, _, rows), k in zip(pieces, per_row)) for r in range(p)]


def enter_group(module: nn.Module, world: Group, group: Group) -> None:
    """Step 1 of the module docstring: give every dispatch module this rank's ``1/g`` shards of ``group``."""
    p, g, i = group_size(world), group_size(group), group_rank(group)
    for _, op in dispatchers(module):
        if op.group_shards is not None:
            raise RuntimeError("enter_group called twice without exit_group")
        if g == p:
            op.group_shards = {}
            continue
        pieces = _op_pieces(op)
        sizes = _flat_sizes(pieces, p)
        with torch.no_grad():
            mine = torch.cat([w.detach().reshape(-1) for _, w, _ in pieces])  # [sizes[rank]]
            every = torch.split(all_gather_rows(mine, sizes, world), sizes)  # -> one flat piece per rank
            chunks = [
                torch.split(flat, [row_sizes(rows, p)[r] * math.prod(w.shape[1:]) for _, w, rows in pieces])
                for r, flat in enumerate(every)
            ]
        shards: dict[str, torch.Tensor] = {}
        for j, (name, w, rows) in enumerate(pieces):
            k = w.shape[1:]
            full = torch.cat([chunks[r][j].view(-1, *k) for r in range(p)])  # [rows/p, k] x p -> [rows, k]
            start, n = sum(row_sizes(rows, g)[:i]), row_sizes(rows, g)[i]
            shards[name] = full[start : start + n].clone().requires_grad_(w.requires_grad)  # -> [rows/g, k]
        op.group_shards = shards


def exit_group(module: nn.Module, world: Group, group: Group, replicated: bool = True) -> None:
    """Step 3 of the module docstring: the ``1/g`` gradients onto the ``1/P`` shards, replicated ones summed.

    Shard gradients are added to what the parameters hold (gradient accumulation works). With
    ``replicated=False`` the replicated gradients are left for one :func:`reduce_replicated` call before
    the optimizer step (needed when several micro-batches accumulate).
    """
    p, g, i = group_size(world), group_size(group), group_rank(group)
    for _, op in dispatchers(module):
        shards = op.group_shards
        if shards is None:
            raise RuntimeError("exit_group called without enter_group")
        op.group_shards = None
        if g == p:
            continue
        pieces = _op_pieces(op)
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(p)]
        with torch.no_grad():
            for name, w, rows in pieces:
                full = w.new_zeros((rows, *w.shape[1:]))  # [rows, k], zero outside this rank's 1/g rows
                grad = shards[name].grad
                if grad is not None:
                    start, n = sum(row_sizes(rows, g)[:i]), row_sizes(rows, g)[i]
                    full[start : start + n] = grad
                for r, part in enumerate(torch.split(full, row_sizes(rows, p))):
                    per_rank[r].append(part.reshape(-1))
            flat = torch.cat([torch.cat(parts) for parts in per_rank])  # destination-rank order
            sizes = _flat_sizes(pieces, p)
            mine = reduce_scatter_rows(flat, sizes, world)  # summed over the world: [sizes[rank]]
            at = 0
            for _, w, _ in pieces:
                n = w.numel()
                piece = mine[at : at + n].view_as(w)
                at += n
                if not w.requires_grad:
                    continue
                if w.grad is None:
                    w.grad = piece.clone()
                else:
                    w.grad.add_(piece)
    if replicated:
        reduce_replicated(module, world)


def reduce_replicated(module: nn.Module, world: Group) -> None:
    """Sum replicated gradients over the world in one all-reduce, also where a rank has none (an idle group).

    A gradient missing on a rank counts as zero; one missing on every rank stays ``None``.
    """
    params = [w for w in replicated_parameters(module) if w.requires_grad]
    if group_size(world) == 1 or not params:
        return
    with torch.no_grad():
        present = torch.tensor([w.grad is not None for w in params], dtype=params[0].dtype)
        grads = [w.grad.reshape(-1) if w.grad is not None else w.new_zeros(w.numel()) for w in params]
        total = all_reduce_sum(torch.cat([*grads, present]), world)  # one call: gradients, then presence flags
    at = 0
    for w, seen in zip(params, total[-len(params) :].tolist()):
        n = w.numel()
        if seen:
            w.grad = total[at : at + n].view_as(w).clone()
        at += n


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


def planner_cost(dims: ModelDims, world: int, planner_for: Callable[[int], Any]) -> GroupCost:
    """The strategy's group cost: :func:`packed_cost` on the planner of each group size plus
    :func:`regroup_seconds`; the FLOP cost when the planners have no cost model (fixed plans)."""
    from lightning_paradyse.cost.planner import CostPlanner, PlanInfeasible

    if not isinstance(planner_for(world), CostPlanner):
        return packed_cost(dims)

    def step_time(s: int, g: int) -> float | None:
        try:
            return float(planner_for(g).step(s, 1).time_s)
        except PlanInfeasible:
            return None

    def regroup(g: int) -> float:
        model = planner_for(g).model
        return regroup_seconds(model.dims, model.machine, world, g)

    return packed_cost(dims, step_time, regroup)


def regroup_seconds(dims: ModelDims, machine: Machine, world: int, g: int) -> float:
    """Predicted seconds of :func:`enter_group` and :func:`exit_group` for a group of ``g`` out of ``world`` ranks.

    One all-gather and one reduce-scatter over the world per op of the blocks' weights (each rank sends its
    ``(world - 1) / world`` share of the ring volume); nothing when the group is the world.
    """
    if g >= world:
        return 0.0
    weights = dims.n_layers * (dims.attn_params() + dims.mlp_params()) * dims.dtype_bytes
    volume, calls = weights * (world - 1) / world, 2 * dims.n_layers
    gather, scatter = machine.collective("all_gather", world), machine.collective("reduce_scatter", world)
    return gather.time(calls, volume) + scatter.time(calls, volume)


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
    spans: tuple[tuple[int, int], ...] = field(default=())
    """The documents of the whole batch."""

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
