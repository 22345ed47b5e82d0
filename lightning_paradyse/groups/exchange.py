"""The weight exchange of a step on groups: every rank's ``1/g`` shards in, their gradients back out.

The world of ``P`` ranks holds the ``1/P`` row shards of the unified layout: no weight is stored twice at rest.
A step split into groups (aligned power-of-two blocks of ranks, largest first: ``8 = 4 + 2 + 1 + 1`` is ranks
0-3, 4-5, 6, 7) runs each group's modes on the ``1/g`` shards a group of ``g`` would hold. In one documented
order per step:

1. :func:`enter_group`: every rank obtains the ``1/g`` shards of its group. The rows of a ``1/g`` shard are owned
   by ``P/g`` ranks (in this rank's group or in others); ONE all-to-all over the world for the whole model
   (every op's pieces in one buffer, in model order on every rank, outside autograd) moves exactly the rows this
   rank lacks; they are kept as leaf tensors the dispatch modules read instead of their ``1/P`` parameters. A
   split into one group of ``P`` uses the parameters themselves; a group of 1 holds the whole weights.
2. Forward and backward of the group's sequences (only the group's own collectives run).
3. :func:`exit_group`: the reverse all-to-all (again one for the model) returns the gradients of the ``1/g``
   shards to the owners of the rows, which add one contribution per group; replicated gradients are summed over
   the world; the ``1/g`` shards are dropped.

A data-parallel step (``P`` groups of one) therefore moves what DDP moves: one weight gather
(``(1 - 1/P)`` of the weights per rank) and one gradient reduce-scatter, the two halves of DDP's all-reduce;
with gradient accumulation the runner keeps the ``1/g`` shards between micro-batches split alike
(:class:`~lightning_paradyse.groups.runner.GroupRunner`), so that holds per optimizer step. After a
data-parallel step the next training batch's weights ride with its agreement instead (:func:`gather_whole`: one
all-gather of every rank's digest and ``1/P`` shards, whose sizes the layout fixes whatever the step decided), and
step 1 cuts the ``1/g`` shards out of them: no collective of its own.
Every world collective happens outside autograd at fixed points, so groups whose plans differ cannot interleave
them differently. An idle group still takes part in both exchanges and contributes zero gradients.
"""

from __future__ import annotations

import functools
import math
import operator
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_paradyse.distributed.comm import (
    Group,
    all_gather_rows,
    all_to_all_rows,
    collective_device,
    group_rank,
    group_size,
    polled,
    reduce_dtype,
    synchronize,
)
from lightning_paradyse.distributed.devices import gpu_free_bytes, to_device
from lightning_paradyse.distributed.layout import split_offsets
from lightning_paradyse.graph.dispatch import OpDispatch
from lightning_paradyse.groups.solver import MAX_GROUPS, splits
from lightning_paradyse.runtime.parallel import (
    ReplicatedGrads,
    dispatchers,
    reduce_replicated_grads,
    replicated_parameters,
    settle_opaque_grads,
    shard_sources,
)


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
    """The process groups of every block of ranks a split of the world can have (:func:`~.solver.splits`: every
    aligned power-of-two block up to 32 ranks), created once.

    ``torch.distributed.new_group`` is collective over the whole job, so every rank creates every block,
    in the same order (here: at construction, by size, then start). Groups of one rank are ``None`` (no collective).
    """

    world: Group
    """The ranks that hold the weight shards (the group the model was parallelized with)."""
    _groups: dict[tuple[int, int], Group] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p = group_size(self.world)
        ranks = list(range(p)) if self.world is None else dist.get_process_group_ranks(self.world)
        used = {(b.start, len(b)) for sizes in splits(p) for b in blocks(sizes) if len(b) > 1}
        for start, g in sorted(used, key=lambda block: (block[1], block[0])):
            self._groups[(start, g)] = self.world if g == p else dist.new_group(ranks[start : start + g])

    @property
    def p(self) -> int:
        return group_size(self.world)

    @property
    def rank(self) -> int:
        return group_rank(self.world)

    def mine(self, sizes: Sequence[int]) -> tuple[int, Group]:
        """``(index of this rank's group, its process group)`` for the split ``sizes``, one of :func:`~.solver.splits`
        (every split up to 32 ranks)."""
        check_sizes(sizes, self.p)
        if self.p > MAX_GROUPS and tuple(sizes) not in splits(self.p):
            raise ValueError(f"group sizes {tuple(sizes)}: not a split of {self.p} ranks the solvers choose (splits)")
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
        rows = tuple(n for _, _, n in pieces)
        widths = tuple(math.prod(w.shape[1:]) for _, w, _ in pieces)
        return cls._planned(rows, widths, p, tuple(sizes), rank)

    @classmethod
    @functools.lru_cache(maxsize=4096)
    def _planned(
        cls, rows_per_piece: tuple[int, ...], widths: tuple[int, ...], p: int, sizes: tuple[int, ...], rank: int
    ) -> _Exchange:
        """The exchange of pieces of these shapes (integers only: cached across steps; the parameters are looked
        up anew every step)."""
        sends, recvs = [], []
        for rows in rows_per_piece:
            owned = split_offsets(rows, p)
            mine, want = (owned[rank], owned[rank + 1]), _wanted(rows, sizes, rank)
            spans = [_overlap(mine, _wanted(rows, sizes, j)) for j in range(p)]
            sends.append(tuple((lo - mine[0], hi - mine[0]) for lo, hi in spans))
            recvs.append(tuple(hi - lo for lo, hi in (_overlap((owned[i], owned[i + 1]), want) for i in range(p))))
        return cls(tuple(sends), tuple(recvs), widths)

    def sent(self, j: int) -> list[int]:
        """Elements of each piece this rank's shard sends to rank ``j``."""
        return [(s[j][1] - s[j][0]) * k for s, k in zip(self.sends, self.widths)]

    def received(self, i: int) -> list[int]:
        """Elements of each piece this rank's ``1/g`` shard gets from rank ``i``."""
        return [r[i] * k for r, k in zip(self.recvs, self.widths)]


@dataclass(frozen=True)
class _Route:
    """One op's pieces and what of them moves for a split (the unit of the flat exchange)."""

    op: OpDispatch
    pieces: list[tuple[str, torch.Tensor, int]]
    ex: _Exchange

    def sent(self, j: int) -> int:
        return sum(self.ex.sent(j))

    def received(self, i: int) -> int:
        return sum(self.ex.received(i))


@dataclass(frozen=True)
class _Bucket:
    """One dtype's routes for a split, with what every step reads of them, listed once when they are made (piece by
    piece in model order: a step then walks no route, and hands torch whole lists)."""

    routes: list[_Route]
    params: tuple[torch.Tensor, ...]
    """Every piece's ``1/P`` shard parameter."""
    ops: tuple[OpDispatch, ...]
    """Every piece's dispatch module."""
    keys: tuple[tuple[int, str], ...]
    """Every piece's ``(id of its dispatch module, name)``."""
    wanted: tuple[tuple[int, int], ...]
    """Every piece's rows this rank reads in the split: ``[start, stop)``."""
    received: tuple[int, ...]
    """Per rank ``i``: elements of this rank's ``1/g`` shards that come from ``i``."""
    sent: tuple[int, ...]
    """Per rank ``j``: elements of this rank's ``1/P`` shards that ``j`` reads."""
    per_rank: tuple[int, ...]
    """Every piece's elements from rank 0 (from every rank alike where :attr:`even`)."""
    row_shapes: tuple[tuple[int, ...], ...]
    """Every piece's shape with its rows left free: ``(-1, *shape[1:])``."""
    even: bool
    """Every rank owns as many rows of every piece (the rows of each divisible by ``P``)."""
    reads_whole: bool
    """Every rank reads the same rows of this rank's ``1/P`` shard of every piece, hence all of them (a
    data-parallel split), and no parameter backs two pieces."""

    @classmethod
    def of(cls, routes: list[_Route], p: int, sizes: Sequence[int], rank: int) -> _Bucket:
        pieces = [(route, name, w, rows) for route in routes for name, w, rows in route.pieces]
        params = tuple(w for _, _, w, _ in pieces)
        spans = [spans for route in routes for spans in route.ex.sends]
        return cls(
            routes,
            params,
            tuple(route.op for route, _, _, _ in pieces),
            tuple((id(route.op), name) for route, name, _, _ in pieces),
            tuple(_wanted(rows, sizes, rank) for _, _, _, rows in pieces),
            tuple(sum(route.received(i) for route in routes) for i in range(p)),
            tuple(sum(route.sent(j) for route in routes) for j in range(p)),
            tuple(k for route in routes for k in route.ex.received(0)),
            tuple((-1, *w.shape[1:]) for w in params),
            all(len(set(recvs)) == 1 for route in routes for recvs in route.ex.recvs),
            len({id(w) for w in params}) == len(params) and all(len(set(s)) == 1 for s in spans),
        )

    @property
    def device(self) -> torch.device:
        return self.params[0].device


_ROUTES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], tuple[list[Any], list[Any], Any]]] = (
    weakref.WeakKeyDictionary()
)
"""Per module and split, the shard parameters and their dtypes the routes last made were made of, and the routes."""


def _routes(module: nn.Module, p: int, sizes: Sequence[int], rank: int) -> dict[torch.dtype, _Bucket]:
    """Every op's route for the split ``sizes``, in model order, bucketed by the pieces' dtype (one exchange per
    dtype; a model has one). Made again whenever a shard parameter was replaced or changed dtype since the last call
    for this split (a data-parallel step reads them three times; a parameter's shape is its layout's, which only a
    new parameter changes)."""
    params = [w for _, op in dispatchers(module) for w in map(op._parameters.get, op.sources)]
    dtypes = [None if w is None else w.dtype for w in params]
    key = (p, tuple(sizes), rank)
    cached = _ROUTES.setdefault(module, {}).get(key)
    if (
        cached is not None
        and len(cached[0]) == len(params)
        and all(map(operator.is_, cached[0], params))
        and dtypes == cached[1]
    ):
        return cached[2]  # type: ignore[no-any-return]
    routes = _made_routes(module, p, sizes, rank)
    _ROUTES[module][key] = (params, dtypes, routes)
    return routes


def _made_routes(module: nn.Module, p: int, sizes: Sequence[int], rank: int) -> dict[torch.dtype, _Bucket]:
    out: dict[torch.dtype, list[_Route]] = {}
    for _, op in dispatchers(module):
        pieces = _op_pieces(op)
        if not pieces:
            continue
        dtypes = {w.dtype for _, w, _ in pieces}
        if len(dtypes) != 1:
            raise TypeError(f"the shard parameters of one op have several dtypes {sorted(map(str, dtypes))}")
        out.setdefault(pieces[0][1].dtype, []).append(_Route(op, pieces, _Exchange.of(pieces, p, sizes, rank)))
    return {dtype: _Bucket.of(routes, p, sizes, rank) for dtype, routes in out.items()}


WholeWeights = dict[int, dict[str, torch.Tensor]]
"""Every op's whole weights (``id`` of its dispatch module -> piece name -> ``[rows, ...]``), gathered by
:func:`gather_whole`."""


def whole_dtype(module: nn.Module, world: Group) -> torch.dtype | None:
    """The one dtype of the model's shard parameters when :func:`gather_whole` can gather them (``None``: no
    shard, or several dtypes); the same on every rank."""
    p, rank = group_size(world), group_rank(world)
    dtypes = list(_routes(module, p, (1,) * p, rank))
    return dtypes[0] if len(dtypes) == 1 else None


def gather_whole(module: nn.Module, world: Group, header: torch.Tensor) -> tuple[torch.Tensor, WholeWeights]:
    """Every rank's ``header`` and the whole weights of every op, in ONE all-gather over the world: every rank sends
    its header and its ``1/P`` shards, whose sizes the layout fixes whatever the step (a rank that decided another
    step sends and receives the same sizes: nothing hangs before the headers are compared).

    ``header``: ``[k]`` int64 (e.g. the step's digest), its bits packed into the weights' dtype. Returns every
    rank's, ``[P, k]`` int64 on the host, and the whole weights (:func:`enter_group` cuts any split's ``1/g``
    shards out of them without a collective). Needs :func:`whole_dtype`.

    Where ``comm.GATHER_AT_ONCE`` is set (agreed at the strategy's setup: every rank polls, a core each), on a gloo
    group of host tensors, the all-gather is one all-to-all (``all_gather_rows(at_once=True)``): every pair at once
    where gloo's ring takes ``P - 1`` dependent hops. Its ``[P n]`` send buffer is as large as the flat buffer gloo's
    own all-gather allocates and copies out of, so the memory is the same either way.
    """
    p, rank = group_size(world), group_rank(world)
    routes = _routes(module, p, (1,) * p, rank)
    if len(routes) != 1:
        raise ValueError("gather_whole needs the shard parameters in one dtype (see whole_dtype)")
    ((dtype, bucket),) = routes.items()
    packed = to_device(header.reshape(-1).to(torch.int64), bucket.device)  # [k] int64 on the shards' device
    packed = packed.view(torch.uint8).view(dtype)  # [k] -> [8 k / itemsize]
    t = packed.numel()
    with torch.no_grad():
        message = torch._utils._flatten_dense_tensors([packed, *bucket.params])  # [t + numel/P]: model order
        sizes = [t + n for n in bucket.received]  # rank i's header and shards
        with polled():  # every rank reaches it together
            got = all_gather_rows(message, sizes, world, at_once=True)  # [t + numel/P] -> [P t + numel]
        if len(set(sizes)) == 1:  # every rank's shards alike (rows divisible by P): one copy per piece
            rows = got.view(p, sizes[0])  # [P t + numel] -> [P, t + numel/P]
            headers = rows[:, :t].contiguous().view(torch.uint8).view(torch.int64)  # [P, k]
            whole = _assembled_even(bucket, rows[:, t:])
        else:
            chunks = torch.split(got, sizes)
            headers = torch.stack([c[:t] for c in chunks]).contiguous().view(torch.uint8).view(torch.int64)  # [P, k]
            whole = _assembled(bucket.routes, [c[t:] for c in chunks])  # [rows, ...] per op and piece
    return headers.cpu(), whole


def enter_group(module: nn.Module, world: Group, sizes: Sequence[int], whole: WholeWeights | None = None) -> None:
    """Step 1 of the module docstring: give every dispatch module this rank's ``1/g`` shards for the split
    ``sizes`` (every rank's group is known from it).

    One all-to-all over the world (per parameter dtype) moves exactly the rows each rank reads and lacks: rank
    ``j`` receives from every owner the part of its ``1/P`` shard that lies in ``j``'s ``1/g`` rows (``(1/g -
    1/P)`` of the weights per rank; nothing when the split is the world). With ``whole`` (the weights
    :func:`gather_whole` brought with the step's agreement) the shards are cut out of them: no collective.
    """
    p, rank = group_size(world), group_rank(world)
    check_sizes(sizes, p)
    for _, op in dispatchers(module):
        if op.group_shards is not None:
            raise RuntimeError("enter_group called twice without exit_group")
        op.set_group_shards({})
    if len(sizes) == 1:
        return
    for bucket in _routes(module, p, sizes, rank).values():
        routes = bucket.routes
        if whole is None:
            with torch.no_grad():
                send = [
                    w.detach()[spans[j][0] : spans[j][1]].reshape(-1)
                    for j in range(p)
                    for route in routes
                    for (_, w, _), spans in zip(route.pieces, route.ex.sends)
                ]  # destination rank, then model order, then the op's pieces
                with polled():
                    recv = all_to_all_rows(torch.cat(send), bucket.sent, bucket.received, world)  # [numel] -> [numel']
                moved = _assembled(routes, torch.split(recv, list(bucket.received)))  # [rows/g, ...] per op, piece
        source = moved if whole is None else whole
        for op, (key, name), w, (lo, hi) in zip(bucket.ops, bucket.keys, bucket.params, bucket.wanted):
            shard = source[key][name]  # moved: [rows/g, ...]; whole: [rows, ...]
            if whole is not None and (lo, hi) != (0, shard.shape[0]):
                shard = shard[lo:hi].clone()  # [rows, ...] -> [rows/g, ...]: the rest freed
            op.group_shards[name] = shard.requires_grad_(w.requires_grad)  # type: ignore[index]


def _assembled(routes: list[_Route], chunks: Sequence[torch.Tensor]) -> WholeWeights:
    """Per op and piece, the rows every rank sent (``chunks[i]``: rank ``i``'s, its ops in model order, each op's
    pieces in order) joined in rank order, which is row order: ``[rows, ...]``."""
    parts = [  # per source rank, per route, per piece
        [torch.split(x, r.ex.received(i)) for r, x in zip(routes, torch.split(chunk, [q.received(i) for q in routes]))]
        for i, chunk in enumerate(chunks)
    ]
    return {
        id(route.op): {
            name: torch.cat([rank_parts[k][n].view(-1, *w.shape[1:]) for rank_parts in parts])
            for n, (name, w, _) in enumerate(route.pieces)
        }
        for k, route in enumerate(routes)
    }


def _assembled_even(bucket: _Bucket, rows: torch.Tensor) -> WholeWeights:
    """:func:`_assembled` where every rank sent as many elements of every piece: ``rows`` is ``[P, n]``, rank ``i``'s
    pieces in row ``i``; a piece's columns, read down the ranks, are its rows in order (one copy per piece)."""
    out: WholeWeights = {id(route.op): {} for route in bucket.routes}
    columns = torch.split(rows, list(bucket.per_rank), dim=1)  # [P, n] -> [P, k] per piece
    for (key, name), part, shape in zip(bucket.keys, columns, bucket.row_shapes):
        out[key][name] = part.reshape(shape)  # [P, k] -> [rows, ...]
    return out


FOLD_BYTES = 1 << 20
"""The replicated gradients ride on the gradient return (every rank sends its whole message to every rank, which
sums the ``P`` of them in rank order) while that moves at most this many bytes per rank more than their own
all-reduce would; beyond, they keep the all-reduce. At ``P = 2`` both move the same bytes: they always ride."""


def exit_group(
    module: nn.Module,
    world: Group,
    sizes: Sequence[int],
    replicated: bool = True,
    extra: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Step 3 of the module docstring: the ``1/g`` gradients onto the ``1/P`` shards, replicated ones summed.

    The reverse of :func:`enter_group` (one all-to-all per dtype): every rank returns to each owner the gradient of
    the rows it read, and the owner adds what every group sent (one contribution per group that read the row).
    Shard gradients are added to what the parameters hold (gradient accumulation works). With ``replicated`` the
    replicated gradients are summed over the world too: in the same all-to-all when that is cheap
    (:data:`FOLD_BYTES`), else by :func:`~lightning_paradyse.runtime.parallel.reduce_replicated_grads`; with
    ``replicated=False`` they are left for one such call before the optimizer step (several micro-batches
    accumulating).

    ``extra``: ``[k]`` float64 numbers (e.g. this rank's measured seconds and its share of the loss) sent to every
    rank in the same all-to-all, their bits packed into the gradients' dtype (:func:`pack_float64`: they arrive
    exactly, whatever that dtype); returns every rank's, ``[P, k]`` float64 where the collective ran (a GPU's:
    nothing here waits for the return; reading them on the host does), or ``None`` when the split is one group or
    the model has no shard (nothing moves). The replicated gradients' presence flags are read on the host only by
    a rank that lacks one of them (:meth:`~lightning_paradyse.runtime.parallel.ReplicatedGrads.apply`).
    """
    p, rank = group_size(world), group_rank(world)
    shards: dict[int, dict[str, torch.Tensor]] = {}
    for _, op in dispatchers(module):
        if op.group_shards is None:
            raise RuntimeError("exit_group called without enter_group")
        shards[id(op)] = op.group_shards
        op.set_group_shards(None)
    received = None
    if len(sizes) > 1:
        routes = _routes(module, p, sizes, rank)
        folded = _foldable(module, world, next(iter(routes)), p) if replicated and routes else None
        for n, (dtype, bucket) in enumerate(routes.items()):
            device = bucket.device
            packed = None if n or extra is None else pack_float64(to_device(extra, device), dtype)  # [k * 8 / itemsize]
            message = None if n or folded is None else to_device(folded.message, device).to(dtype)  # [m]
            tails = [t for t in (message, packed) if t is not None]
            tail = torch.cat([t.reshape(-1) for t in tails]) if tails else None  # [m + k']
            got = _return_grads(bucket, shards, p, world, tail)  # [P, m + k'] from every rank
            if n > 0 or got is None:
                continue
            m = 0 if folded is None else folded.message.numel()
            received = None if packed is None else unpack_float64(got[:, m:])  # [P, k] float64, on the device
            if folded is None:
                continue
            wide = folded.message.dtype
            total = got[0, :m].to(wide)
            for i in range(1, p):  # in rank order on every rank: the replicas stay equal
                total = total + got[i, :m].to(wide)
            settle_opaque_grads(module, world)  # after the return: an expert no rank used is left without a gradient
            folded.apply(total)
        if folded is not None:
            return received
    if replicated:
        reduce_replicated_grads(module, world)
    return received


def pack_float64(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[k]`` numbers as float64 bits in elements of ``dtype``, ``[k * 8 / itemsize]``: a collective that only moves
    them (an all-to-all) delivers them exactly, whatever ``dtype`` (bf16 would keep three digits of a value)."""
    bits = values.reshape(-1).to(torch.float64).view(torch.uint8)  # [k] -> [8 k]
    return bits.view(dtype)  # [8 k] -> [8 k / itemsize]


def unpack_float64(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_float64` per row: ``[r, k * 8 / itemsize]`` -> ``[r, k]`` float64."""
    rows = packed.shape[0]
    return packed.contiguous().view(torch.uint8).view(torch.float64).view(rows, -1)  # [r, 8k] bytes -> [r, k]


def _foldable(module: nn.Module, world: Group, dtype: torch.dtype, p: int) -> ReplicatedGrads | None:
    """This rank's replicated gradients when they can ride on the return in ``dtype`` (their own dtype, so the values
    travel exactly) at no more than :data:`FOLD_BYTES` extra per rank; else ``None``."""
    params = tuple(w for w in replicated_parameters(module) if w.requires_grad)
    if not params or any(w.dtype != dtype for w in params):
        return None
    numel = sum(w.numel() for w in params) + len(params)
    extra_bytes = ((p - 1) - 2 * (p - 1) / p) * numel * dtype.itemsize  # all-to-all of copies against a ring all-reduce
    if extra_bytes > FOLD_BYTES:
        return None
    return ReplicatedGrads.of(module, params)  # the replicated ones only: the shards settle after the return


def drop_group(module: nn.Module) -> None:
    """Drop the ``1/g`` shards without returning their gradients (no collective): a step given up or checked
    only, a fit stopped between micro-batches."""
    for _, op in dispatchers(module):
        op.set_group_shards(None)


def _return_grads(
    bucket: _Bucket,
    shards: dict[int, dict[str, torch.Tensor]],
    p: int,
    world: Group,
    tail: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The gradients of the rows this rank read back to their owners, summed there; ``tail`` (``[t]``) sent to every
    rank after them. Returns every rank's tail, ``[P, t]`` (``None`` without one)."""
    t = 0 if tail is None else tail.numel()
    routes = bucket.routes
    with torch.no_grad():
        read_whole = _read_whole(bucket)
        if read_whole and bucket.even:  # a data-parallel split of even shards: one copy out
            return _return_even(bucket, shards, p, world, tail)
        grads = [  # per piece (model order): the gradient rows of each owner
            torch.split(_grad_or_zeros(shards[id(route.op)][name]), list(recvs))
            for route in routes
            for (name, _, _), recvs in zip(route.pieces, route.ex.recvs)
        ]
        send = []  # owner rank, then model order, then the op's pieces; then the tail
        for i in range(p):
            send += [piece[i].reshape(-1) for piece in grads]
            if tail is not None:
                send.append(tail)
        in_sizes = [n + t for n in bucket.received]
        out_sizes = [n + t for n in bucket.sent]
        with polled():
            recv = all_to_all_rows(torch.cat(send), in_sizes, out_sizes, world)  # [numel' + p t] -> [numel + p t]
        if read_whole:
            return _sum_whole(bucket, recv.view(p, -1), t)  # [numel + p t] -> [p, numel/p + t]
        sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # shard -> its gradient, summed in reduce_dtype
        tails = []
        for j, chunk in enumerate(torch.split(recv, out_sizes)):  # rank j's gradient of the rows it read here
            body, end = chunk[: out_sizes[j] - t], chunk[out_sizes[j] - t :]
            tails.append(end)
            for route, part in zip(routes, torch.split(body, [r.sent(j) for r in routes])):
                for (_, w, _), spans, piece in zip(route.pieces, route.ex.sends, torch.split(part, route.ex.sent(j))):
                    lo, hi = spans[j]
                    if hi == lo or not w.requires_grad:
                        continue
                    if id(w) not in sums:  # half precision: the groups' parts summed in float32, rounded once
                        base = w.grad if w.grad is not None else torch.zeros_like(w)
                        sums[id(w)] = (w, base.to(reduce_dtype(w.dtype)))
                    sums[id(w)][1][lo:hi] += piece.view(hi - lo, *w.shape[1:])
        for w, total in sums.values():
            w.grad = total.to(w.dtype)
        _empty_grads(bucket)
    return None if tail is None else torch.stack(tails)  # [P, t]


def _empty_grads(bucket: _Bucket) -> None:
    """An empty shard (a rank holding none of a piece's rows: 3 experts over 4 ranks) gets an empty gradient, as
    its piece's other shards get theirs: an optimizer then keeps state for it on every rank alike, which a
    checkpoint's consolidation, a collective per parameter with state, relies on."""
    for w in bucket.params:
        if w.requires_grad and w.numel() == 0 and w.grad is None:
            w.grad = torch.zeros_like(w)


def _return_even(
    bucket: _Bucket,
    shards: dict[int, dict[str, torch.Tensor]],
    p: int,
    world: Group,
    tail: torch.Tensor | None,
) -> torch.Tensor | None:
    """:func:`_return_grads` where every rank read every row and owns as many rows of every piece: every piece's
    gradient cut in ``P`` equal row blocks, one per owner, in one copy (the general path's message, element for
    element), then the flat sum."""
    t = 0 if tail is None else tail.numel()
    parts = [  # per piece: [rows, ...] -> [P, k], row i the gradient of the rows rank i owns
        _grad_or_zeros(shards[key][name]).reshape(p, -1) for key, name in bucket.keys
    ]
    if tail is not None:
        parts.append(tail.reshape(1, -1).expand(p, t))  # [t] -> [P, t]: the tail to every rank
    send = torch.cat(parts, dim=1)  # [P, numel/P + t]: owner rank, then model order, then the tail
    width = send.shape[1]
    with polled():
        recv = all_to_all_rows(send.view(-1), [width] * p, [width] * p, world)  # [P width] -> [P width]
    return _sum_whole(bucket, recv.view(p, width), t)  # [P width] -> [P, width]


def _grad_or_zeros(shard: torch.Tensor) -> torch.Tensor:
    """A ``1/g`` shard's gradient, zeros where it got none (a rank whose tokens did not use it)."""
    return shard.grad if shard.grad is not None else torch.zeros_like(shard)


def _read_whole(bucket: _Bucket) -> bool:
    """Whether the flat sum (:func:`_sum_whole`) applies: every rank read the same rows of this rank's ``1/P`` shard
    of every piece, hence all of them (every row is read by some group; a data-parallel split), so each rank
    receives from every rank the gradient of its whole shard in model order; no parameter backs two pieces
    (:attr:`_Bucket.reads_whole`); and no shard holds a gradient yet (the general path adds into one in place)."""
    return bucket.reads_whole and all(w.grad is None for w in bucket.params)


def _sum_whole(bucket: _Bucket, got: torch.Tensor, t: int) -> torch.Tensor | None:
    """:func:`_return_grads`' sums where :func:`_read_whole` holds: ``got`` is ``[P, n + t]``, rank ``j``'s gradient
    of this rank's ``n`` shard elements (model order) and its tail. Every shard's gradient is zero plus every
    rank's part in rank order, in the summing dtype, as the general path adds them; the shards' gradients are views
    of the one sum (or, for half precision, its rounding)."""
    n = got.shape[1] - t
    total = got.new_zeros(n, dtype=reduce_dtype(got.dtype))  # [n]
    for j in range(got.shape[0]):  # in rank order, on every rank alike
        total += got[j, :n]
    summed = total.to(got.dtype)  # half precision: rounded once (else the sum itself)
    for w, grad in zip(bucket.params, torch._utils._unflatten_dense_tensors(summed, bucket.params)):
        if w.requires_grad:  # an empty shard too (:func:`_empty_grads`)
            w.grad = grad  # [n] -> the shard's shape: a view of the sum
    return None if t == 0 else got[:, n:]  # [P, t]


def measure_regroup(module: nn.Module, world: Group, reps: int = 5) -> float | None:
    """Seconds of :func:`enter_group` + :func:`exit_group` into groups of one rank (the largest exchange),
    the least of ``reps`` after one untimed on every rank and the slowest rank's (collective; gradients are left
    as they were). The least, as the quick machine keeps the least of its collectives' rounds: a few runs while
    the machine is busy elsewhere measured 6.7 ms where the exchange takes 1.7 (two CPU processes), and a batch
    of short rows then ran on one group of both ranks at a quarter of data parallelism's speed.

    ``None`` (on every rank alike, agreed before any exchange) when a GPU could not hold the whole weights and
    their gradients beside what it holds: the caller then prices the exchange on the cost model alone."""
    p = group_size(world)
    if p == 1:
        return 0.0
    sharded = set(shard_sources(module))
    shards = [w for name, w in module.named_parameters() if name in sharded]
    device = collective_device(world)
    fits = torch.tensor([1.0 if _whole_fits(shards, p) else 0.0], dtype=torch.float64, device=device)
    if float(all_gather_rows(fits, [1] * p, world).min()) == 0.0:  # [1] -> [p]: every rank takes the same branch
        return None
    before = [w.grad for w in shards]
    times = []
    for rep in range(reps + 1):  # the first one untimed: a process group's first all-to-all sets up its links
        synchronize(shards[0].device if shards else device)
        start = time.perf_counter()
        enter_group(module, world, (1,) * p)
        exit_group(module, world, (1,) * p, replicated=False)
        synchronize(shards[0].device if shards else device)  # the exchange's kernels, not only their launches
        if rep:
            times.append(time.perf_counter() - start)
    for w, grad in zip(shards, before):
        w.grad = grad
    mine = torch.tensor([min(times)], dtype=torch.float64, device=device)
    return float(all_gather_rows(mine, [1] * p, world).max())  # [1] -> [p]


def _whole_fits(shards: list[nn.Parameter], p: int) -> bool:
    """Whether this rank's GPU has room for the whole weights of ``shards`` and as much again for their gradients
    and transients (about ``3 p`` times the shards), for every rank that shares the GPU; always on the host."""
    if not shards or shards[0].device.type != "cuda":
        return True
    share = max(1, -(-p // torch.cuda.device_count()))  # ranks on one GPU (sharing it over gloo), all exchanging
    return 3 * p * share * sum(w.numel() * w.element_size() for w in shards) <= gpu_free_bytes(shards[0].device)


__all__ = [
    "GroupSet",
    "blocks",
    "check_sizes",
    "drop_group",
    "enter_group",
    "exit_group",
    "gather_whole",
    "measure_regroup",
    "pack_float64",
    "unpack_float64",
    "whole_dtype",
]
