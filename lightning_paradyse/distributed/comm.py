"""Every collective the parallel modes use, in one module.

Two layers:

* **Primitives** (``all_gather_rows``, ``reduce_scatter_rows``, ``all_to_all_rows``, ``ring_pass``,
  ``broadcast_from``, ``reduce_to``, ``all_reduce_sum``): plain, non-differentiable calls over an
  explicit process group, with uneven sizes handled here. On a group of two or more ranks they write
  into freshly allocated buffers, never into their inputs, so a parameter handed to a collective is
  never written; at group size 1 they return the input itself, so callers never write into a result.
* **Autograd pairs** (``gather_seq``/``scatter_seq``, ``seq_to_heads``/``heads_to_seq``,
  ``gather_weight``, ``ring_shift``, ``broadcast_weight``): each names what it does forward and its
  backward is the conjugate collective.

The process group is always an argument; ``None`` means "no group" (size 1) and every function is
then a no-op. The same code runs on gloo (CPU, or CUDA tensors of ranks sharing a GPU) and NCCL (GPU);
:func:`collective_device` says where the small control tensors of a group's collectives (flags, times, digests)
must live: on the GPU for NCCL, which refuses host tensors.

Torch 2.11 (what GPU images ship) names two collectives differently (``all_gather_into_tensor``,
``reduce_scatter_tensor``): :func:`_all_gather_single` and :func:`_reduce_scatter_single` take whichever
the installed torch has. Point-to-point hops of gloo groups on CUDA tensors (several ranks sharing one GPU,
for tests and checks) are staged through host memory: gloo's send/recv of CUDA tensors crashes.

Small collectives of host tensors on a gloo group (flags, digests, losses, times: at most :data:`PAIRWISE_BYTES` of
buffers of their own) go through one all-to-all (:func:`_pairwise`): gloo's all-gather, reduce-scatter, reduce and
all-reduce are rings of dependent hops, each a wake-up of the next rank's thread, where its all-to-all posts every pair
at once (2-4x faster at 4 ranks on 2 cores; sums are then added in rank order, the same bits on every rank). Larger
ones keep the backend's: the all-to-all needs a ``[p n]`` buffer beside the result, which the memory model does not
count. The one exception is the data-parallel step's weight gather (``all_gather_rows(at_once=True)``), made before
any activation lives: gloo's all-gather allocates a flat ``[p n]`` buffer of its own and copies out of it, so the
all-to-all's send buffer costs no more memory, and its pairs do not wait on each other. It runs so only where the
step's exchanges poll on every rank (:data:`GATHER_AT_ONCE`: every rank has a core). Measured on 2 cores: the gather
alone 2.6-3x faster at 8 ranks and 1.4x at 4 (``benchmarks/meetings.py --compute-ms 0``, the quick preset's weights),
but there ranks outnumber cores, every pair's transfer wants a core at once, and the quick preset at 4 ranks was no
faster (0.75-0.84x DDP against the ring's 0.77-0.99x): off there. At 2 ranks, where it runs, 0.69 ms against the
ring's 0.75 (one hop either way); 8 ranks with a core each are not measured yet.

A data-parallel step's exchanges (the weight gather, the gradient return, the agreement), which every rank reaches
together, wait by polling on the host (:func:`polled`, :data:`HOST_SPIN_S`) where every rank has a core of its own:
blocked, all of a machine's cores fall idle at once, and waking one took a virtual machine up to 4 ms. Every other
collective blocks in the backend's wait.

``CommCounter`` records the bytes each rank sends, counted as the volume of the bandwidth-optimal
algorithm (ring all-gather / reduce-scatter / pipelined broadcast), which is what the communication
formulas of the cost model describe.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_paradyse.distributed.layout import SeqLayout, split_sizes

Group = dist.ProcessGroup | None

# torch >= 2.13 names (the old ones warn there); torch 2.11 and 2.12 have only the old ones
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


GRAD_REDUCE_DTYPE: torch.dtype | None = torch.float32
"""The dtype in which weight gradients narrower than it are summed over ranks (``None``: in their own dtype). One
process computes a bf16 weight gradient in one GEMM that accumulates in float32 and rounds once; summed over ranks
in bf16, each partial sum would round again. ``ParaDySeStrategy(grad_reduce_dtype=...)`` sets it."""


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a gradient of ``dtype`` is summed over ranks in (:data:`GRAD_REDUCE_DTYPE` when wider)."""
    wide = GRAD_REDUCE_DTYPE
    if wide is None or not dtype.is_floating_point or dtype.itemsize >= wide.itemsize:
        return dtype
    return wide


def reduce_itemsize(itemsize: int) -> int:
    """Bytes per element of a weight gradient of ``itemsize`` bytes while it is summed over ranks (the cost
    formulas' view of :func:`reduce_dtype`)."""
    wide = GRAD_REDUCE_DTYPE
    return itemsize if wide is None else max(itemsize, wide.itemsize)


def group_size(group: Group) -> int:
    """Number of ranks in ``group`` (1 for ``None``). Asked several times a step: a group this process belongs to
    answers itself (one call; ``torch.distributed.get_world_size`` walks the default group's bookkeeping first)."""
    if group is None:
        return 1
    return group.size() if isinstance(group, dist.ProcessGroup) else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank inside ``group`` (0 for ``None``; -1 outside it, as ``torch.distributed.get_rank``)."""
    if group is None:
        return 0
    return group.rank() if isinstance(group, dist.ProcessGroup) else dist.get_rank(group)


def collective_device(group: Group) -> torch.device:
    """Where a tensor handed to ``group``'s collectives must live: this process's GPU for NCCL, else the host."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU), so that a wall-clock time covers it; nothing on the host."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


HOST_SPIN_S = 0.0
"""How long a rank polls a collective of host tensors inside :func:`polled` before it blocks in the backend's wait
(``0``: it blocks at once). The strategy sets it for a fit (:func:`host_spin_seconds`) and back to ``0`` at teardown."""

SPIN_LIMIT_S = 0.01
"""The polling :func:`host_spin_seconds` gives where every rank of the host has a core of its own."""

_polling = False


def host_spin_seconds(device: torch.device, local_ranks: int) -> float:
    """:data:`SPIN_LIMIT_S` for ranks on the host (gloo) when each of this host's ``local_ranks`` can have a core of
    its own, else ``0``.

    A rank that blocks in gloo's wait sleeps until gloo's thread wakes it; when every rank of a machine blocks at once
    (a data-parallel step's weight gather and gradient return, which every rank reaches together) its cores fall
    idle, and on a virtual machine waking an idle core took up to 4 ms where the transfer takes 0.3 (2 processes on 2
    cores). A rank that polls, giving its core to any other thread between polls, keeps the core awake. Where ranks
    outnumber the cores a polling rank would take time from one that computes: it blocks at once."""
    if device.type != "cpu" or not hasattr(os, "sched_yield"):
        return 0.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return SPIN_LIMIT_S if local_ranks <= cores else 0.0


GATHER_AT_ONCE = False
"""Whether ``all_gather_rows(at_once=True)`` (the data-parallel step's weight gather) runs as one all-to-all on a
gloo group of host tensors. The strategy sets it at every fit's setup from every rank's :data:`HOST_SPIN_S`
(:func:`gather_at_once`: the same on every rank, as the ranks must call the same collective) and back to ``False`` at
teardown."""


def gather_at_once(group: Group) -> bool:
    """Whether every rank of ``group``, a gloo group, polls on the host (:data:`HOST_SPIN_S` set: each has a core of
    its own): one all-gather of a flag per rank (every rank calls it alike; ``False`` without one on a group of one or
    another backend)."""
    p = group_size(group)
    if p == 1 or dist.get_backend(group) != "gloo":
        return False
    mine = torch.tensor([1 if HOST_SPIN_S > 0 else 0], dtype=torch.int64)
    return bool(all_gather_rows(mine, [1] * p, group).min() > 0)  # [1] -> [p]: every rank's flag


@contextmanager
def polled() -> Iterator[None]:
    """Collectives of host tensors inside wait by polling for at most :data:`HOST_SPIN_S` (the step's exchanges, which
    every rank reaches together); elsewhere (the modes' collectives, where a rank may wait for one still computing
    beside it) they block at once."""
    global _polling
    before, _polling = _polling, True
    try:
        yield
    finally:
        _polling = before


def _settle(work: Any, out: torch.Tensor) -> None:
    """Wait for ``work``, a collective writing ``out``: inside :func:`polled`, polled for at most :data:`HOST_SPIN_S`
    when ``out`` is on the host (the core yielded between polls), then the backend's wait (which raises a collective's
    error or timeout)."""
    limit = HOST_SPIN_S
    if _polling and limit > 0 and out.device.type == "cpu":
        end = time.perf_counter() + limit
        while not work.is_completed() and time.perf_counter() < end:
            os.sched_yield()
    work.wait()


# --------------------------------------------------------------------------------------------------
# Byte accounting
# --------------------------------------------------------------------------------------------------


class CommCounter:
    """Context manager that sums the bytes this rank sends, per collective kind.

    Example::

        with CommCounter() as counter:
            loss.backward()
        counter.total  # bytes sent by this rank
    """

    _active: ClassVar[list[CommCounter]] = []

    def __init__(self) -> None:
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @property
    def total(self) -> float:
        """All bytes sent by this rank while the counter was active."""
        return float(sum(self.bytes.values()))

    def __enter__(self) -> CommCounter:
        CommCounter._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        CommCounter._active.remove(self)


def _record(kind: str, nbytes: float) -> None:
    for counter in CommCounter._active:
        counter.bytes[kind] += nbytes
        counter.calls[kind] += 1


def _row_numel(x: torch.Tensor) -> int:
    return math.prod(x.shape[1:])


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------------------------------
# Primitives (no autograd). Uneven sizes are along dim 0.
# --------------------------------------------------------------------------------------------------


def all_gather_rows(x: torch.Tensor, sizes: Sequence[int], group: Group, at_once: bool = False) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0: ``[sizes[r], ...] -> [sum(sizes), ...]``.

    ``at_once``: where :data:`GATHER_AT_ONCE` is set (the same on every rank), on a gloo group of host tensors (or
    wherever :data:`PAIRWISE` forces the pairwise path; never where it forces it off), one all-to-all whatever the size
    (:func:`_gather_at_once`)."""
    p = group_size(group)
    if p == 1:
        return x
    rank = group_rank(group)
    if x.shape[0] != sizes[rank]:
        raise ValueError(f"rank {rank} holds {x.shape[0]} rows but the layout says {sizes[rank]}")
    if at_once and GATHER_AT_ONCE and _pairwise(x, group, 0):
        return _gather_at_once(x, sizes, group)
    width = max(sizes)
    padded = x if x.shape[0] == width else torch.cat([x, x.new_zeros((width - x.shape[0], *x.shape[1:]))])
    out = x.new_empty((p * width, *x.shape[1:]))  # [p * max_r, ...]
    _gather_into(out, padded.contiguous(), group)
    _record("all_gather", _nbytes(_row_numel(x) * (sum(sizes) - sizes[rank]), x.dtype))
    if all(s == width for s in sizes):
        return out
    return torch.cat([out[r * width : r * width + sizes[r]] for r in range(p)])  # [sum(sizes), ...]


def _gather_at_once(x: torch.Tensor, sizes: Sequence[int], group: Group) -> torch.Tensor:
    """:func:`all_gather_rows` as one all-to-all, every pair at once, uneven sizes unpadded."""
    p, rank = group_size(group), group_rank(group)
    out = x.new_empty((sum(sizes), *x.shape[1:]))  # [sum(sizes), ...]
    repeated = torch.cat([x] * p)  # [n_r, ...] -> [p n_r, ...]: one copy to every rank
    work = dist.all_to_all_single(out, repeated, list(sizes), [x.shape[0]] * p, group=group, async_op=True)
    _settle(work, out)
    _record("all_gather", _nbytes(_row_numel(x) * (sum(sizes) - sizes[rank]), x.dtype))
    return out


def reduce_scatter_rows(x: torch.Tensor, sizes: Sequence[int], group: Group) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's rows: ``[sum(sizes), ...] -> [sizes[r], ...]``."""
    p = group_size(group)
    if p == 1:
        return x
    rank = group_rank(group)
    width = max(sizes)
    if all(s == width for s in sizes):
        padded = x.contiguous()
    else:  # one padded copy (not a padded piece per rank and then their concatenation: half the transient)
        padded = x.new_zeros((p * width, *x.shape[1:]))  # [p * max_r, ...]
        for r, piece in enumerate(torch.split(x, list(sizes))):
            padded[r * width : r * width + sizes[r]].copy_(piece)
    out = x.new_empty((width, *x.shape[1:]))
    _scatter_sum_into(out, padded, group)
    _record("reduce_scatter", _nbytes(_row_numel(x) * (sum(sizes) - sizes[rank]), x.dtype))
    return out[: sizes[rank]]


def all_to_all_rows(x: torch.Tensor, in_sizes: Sequence[int], out_sizes: Sequence[int], group: Group) -> torch.Tensor:
    """Send rows ``in_sizes[j]`` of ``x`` to rank ``j``, receive ``out_sizes[i]`` rows from rank ``i``."""
    p = group_size(group)
    if p == 1:
        return x
    rank = group_rank(group)
    out = x.new_empty((sum(out_sizes), *x.shape[1:]))
    work = dist.all_to_all_single(
        out,
        x.contiguous(),
        output_split_sizes=list(out_sizes),
        input_split_sizes=list(in_sizes),
        group=group,
        async_op=True,
    )
    _settle(work, out)
    _record("all_to_all", _nbytes(_row_numel(x) * (sum(in_sizes) - in_sizes[rank]), x.dtype))
    return out


class PendingRing:
    """A ring transfer in flight: :meth:`wait` returns the received tensor (on ``device``: a hop staged through host
    memory lands there at the wait)."""

    def __init__(self, out: torch.Tensor, works: list[Any], device: torch.device | None = None) -> None:
        self._out, self._works, self._device = out, works, device

    def wait(self) -> torch.Tensor:
        for work in self._works:
            _settle(work, self._out)
        self._works = []
        if self._device is not None and self._out.device != self._device:
            self._out = self._out.to(self._device, non_blocking=False)  # host staging -> the tensor's device
        return self._out


STAGE_P2P: bool | None = None
"""Stage point-to-point hops through host memory: ``None`` (default) where the group's backend is gloo and the
tensor is on a GPU (gloo crashes on send/recv of CUDA tensors); ``True``/``False`` force it (tests)."""


def _staged(x: torch.Tensor, group: dist.ProcessGroup) -> bool:
    if STAGE_P2P is not None:
        return STAGE_P2P
    return x.device.type != "cpu" and dist.get_backend(group) == "gloo"


def ring_pass_start(
    x: torch.Tensor, group: Group, shift: int = 1, recv_shape: Sequence[int] | None = None
) -> PendingRing:
    """Start sending ``x`` to rank ``r + shift`` and receiving from ``r - shift`` (into a fresh tensor).

    Compute can overlap the transfer until :meth:`PendingRing.wait`. ``recv_shape`` is the shape
    the previous rank sends (default: ``x``'s shape).
    """
    shape = tuple(recv_shape) if recv_shape is not None else tuple(x.shape)
    p = group_size(group)
    if p == 1:
        return PendingRing(x if shape == tuple(x.shape) else x.new_empty(shape), [])
    assert group is not None
    rank = group_rank(group)
    dst = dist.get_global_rank(group, (rank + shift) % p)
    src = dist.get_global_rank(group, (rank - shift) % p)
    staged = _staged(x, group)
    send = x.detach().to("cpu").contiguous() if staged else x.contiguous()  # host copy: gloo P2P of CPU tensors
    out = torch.empty(shape, dtype=x.dtype, device=send.device)
    ops = [
        dist.P2POp(dist.isend, send, dst, group),
        dist.P2POp(dist.irecv, out, src, group),
    ]
    works = dist.batch_isend_irecv(ops)
    _record("ring", _nbytes(x.numel(), x.dtype))
    return PendingRing(out, list(works), x.device if staged else None)


def ring_pass(x: torch.Tensor, group: Group, shift: int = 1, recv_shape: Sequence[int] | None = None) -> torch.Tensor:
    """Send ``x`` to rank ``r + shift`` and return what rank ``r - shift`` sent (a fresh tensor)."""
    return ring_pass_start(x, group, shift, recv_shape).wait()


def broadcast_from(x: torch.Tensor, src: int, group: Group, shape: Sequence[int] | None = None) -> torch.Tensor:
    """Rank ``src``'s ``x`` on every rank, in a fresh buffer (``shape`` is needed on the others)."""
    p = group_size(group)
    if p == 1:
        return x
    assert group is not None
    if group_rank(group) == src:
        buf = x.detach().clone().contiguous()
    else:
        buf = x.new_empty(tuple(shape) if shape is not None else x.shape)
    _settle(dist.broadcast(buf, dist.get_global_rank(group, src), group=group, async_op=True), buf)
    _record("broadcast", _nbytes(buf.numel(), buf.dtype) * (p - 1) / p)
    return buf


def reduce_to(x: torch.Tensor, dst: int, group: Group) -> torch.Tensor:
    """Sum of every rank's ``x`` on rank ``dst`` (a fresh tensor; meaningless on the others)."""
    p = group_size(group)
    if p == 1:
        return x
    assert group is not None
    _record("reduce", _nbytes(x.numel(), x.dtype) * (p - 1) / p)
    if _pairwise(x, group, p * x.numel() * x.element_size()):  # every rank's x to dst, summed there in rank order
        n, mine = x.numel(), group_rank(group) == dst
        got = x.new_empty((p * n if mine else 0,))  # [p n] on dst, [0] elsewhere
        sent = [n if j == dst else 0 for j in range(p)]
        work = dist.all_to_all_single(
            got, x.detach().reshape(-1).contiguous(), [n if mine else 0] * p, sent, group=group, async_op=True
        )  # [n] -> [p n] on dst
        _settle(work, got)
        return _sum_in_rank_order(got.view(p, *x.shape)) if mine else x.detach().clone()
    buf = x.detach().clone().contiguous()
    _settle(dist.reduce(buf, dist.get_global_rank(group, dst), group=group, async_op=True), buf)
    return buf


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of every rank's ``x`` (a fresh tensor)."""
    if group_size(group) == 1:
        return x
    p = group_size(group)
    nbytes = x.numel() * x.element_size()
    _record("all_reduce", 2 * nbytes * (p - 1) / p)
    if _pairwise(x, group, p * nbytes):
        every = x.new_empty((p, *x.shape))  # [p, ...]
        _gather_into(every, x.detach().reshape(1, *x.shape).contiguous(), group)  # [1, ...] -> [p, ...]
        return _sum_in_rank_order(every)  # the same additions on every rank: the same bits
    buf = x.detach().clone().contiguous()
    _settle(dist.all_reduce(buf, group=group, async_op=True), buf)
    return buf


PAIRWISE_BYTES = 1 << 12
"""The most bytes of buffers of its own (the ``[p n]`` copies it sends or receives) a collective of host tensors on a
gloo group may take to run as one all-to-all (:func:`_pairwise`); beyond, the backend's own collective."""


PAIRWISE: bool | None = None
"""Small collectives through one all-to-all: ``None`` (default) for host tensors of a gloo group up to
:data:`PAIRWISE_BYTES` (see the module docstring); ``True``/``False`` force it, whatever the size (tests)."""


def _pairwise(x: torch.Tensor, group: Group, buffer_bytes: int) -> bool:
    """Whether a collective of ``x`` on ``group`` whose all-to-all would take ``buffer_bytes`` of buffers of its own
    goes through one all-to-all (:data:`PAIRWISE`, :data:`PAIRWISE_BYTES`)."""
    if PAIRWISE is not None:
        return PAIRWISE
    return buffer_bytes <= PAIRWISE_BYTES and x.device.type == "cpu" and dist.get_backend(group) == "gloo"


def _gather_into(out: torch.Tensor, x: torch.Tensor, group: Group) -> None:
    """Every rank's ``x`` (``[n, ...]``, contiguous) into ``out`` (``[p n, ...]``) in rank order."""
    if not _pairwise(x, group, out.numel() * out.element_size()):
        _settle(_all_gather_single(out, x, group=group, async_op=True), out)
        return
    p = group_size(group)
    repeated = torch.cat([x] * p)  # [n, ...] -> [p n, ...]
    _settle(dist.all_to_all_single(out, repeated, group=group, async_op=True), out)  # to every rank -> [p n, ...]


def _scatter_sum_into(out: torch.Tensor, x: torch.Tensor, group: Group) -> None:
    """The sum over ranks of their rows ``r n : (r + 1) n`` of ``x`` (``[p n, ...]``, contiguous) into ``out``
    (``[n, ...]``) on rank ``r``."""
    if not _pairwise(x, group, x.numel() * x.element_size()):
        _settle(_reduce_scatter_single(out, x, group=group, async_op=True), out)
        return
    p = group_size(group)
    got = torch.empty_like(x)
    # [p n, ...]: rows j n : (j + 1) n to rank j, from rank i at i n
    _settle(dist.all_to_all_single(got, x, group=group, async_op=True), got)
    out.copy_(_sum_in_rank_order(got.view(p, *out.shape)))  # [p, n, ...] -> [n, ...]


def _sum_in_rank_order(every: torch.Tensor) -> torch.Tensor:
    """``every[0] + every[1] + ...`` (``[p, ...] -> [...]``), added in that order (a fresh tensor)."""
    total = every[0].clone()
    for i in range(1, every.shape[0]):
        total += every[i]
    return total


# --------------------------------------------------------------------------------------------------
# Autograd pairs over the sequence layout
# --------------------------------------------------------------------------------------------------


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).contiguous()  # [b, s, ...] -> [s, b, ...]


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layout: SeqLayout, group: Group) -> torch.Tensor:
        ctx.layout, ctx.group = layout, group
        full = all_gather_rows(_seq_first(x), layout.local_lens, group)  # [s_r, b, ..] -> [s, b, ..]
        return full.transpose(0, 1)  # [s, b, ..] -> [b, s, ..] (gathered order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        local = reduce_scatter_rows(_seq_first(grad), ctx.layout.local_lens, ctx.group)  # [s_r, b, ..]
        return local.transpose(0, 1), None, None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layout: SeqLayout, group: Group) -> torch.Tensor:
        ctx.layout, ctx.group = layout, group
        local = reduce_scatter_rows(_seq_first(x), layout.local_lens, group)  # [s, b, ..] -> [s_r, b, ..]
        return local.transpose(0, 1)  # [b, s_r, ..]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        full = all_gather_rows(_seq_first(grad), ctx.layout.local_lens, ctx.group)  # [s, b, ..]
        return full.transpose(0, 1), None, None


def gather_seq(x: torch.Tensor, layout: SeqLayout, group: Group) -> torch.Tensor:
    """Forward all-gather of the sequence, backward reduce-scatter: ``[b, s_r, ..] -> [b, s, ..]``.

    The result is in *gathered* order (rank 0's tokens first); see ``SeqLayout.natural_index``.
    """
    if group_size(group) == 1:
        return x
    return _GatherSeq.apply(x, layout, group)


def scatter_seq(x: torch.Tensor, layout: SeqLayout, group: Group) -> torch.Tensor:
    """Forward reduce-scatter (sum of partials) of the sequence, backward all-gather.

    ``[b, s, ..]`` in gathered order, a partial sum on every rank ``-> [b, s_r, ..]`` summed.
    """
    if group_size(group) == 1:
        return x
    return _ScatterSeq.apply(x, layout, group)


def _seq_to_heads(x: torch.Tensor, layout: SeqLayout, group: Group) -> torch.Tensor:
    p, rank = group_size(group), group_rank(group)
    b, s_r, n, d = x.shape
    m = n // p
    send = x.reshape(b, s_r, p, m, d).permute(2, 1, 0, 3, 4)  # [b, s_r, n, d] -> [p, s_r, b, n/p, d]
    send = send.reshape(p * s_r, b, m, d)
    lens = layout.local_lens
    assert lens[rank] == s_r
    out = all_to_all_rows(send, [s_r] * p, lens, group)  # [p*s_r, b, n/p, d] -> [s, b, n/p, d]
    return out.transpose(0, 1)  # [s, b, n/p, d] -> [b, s, n/p, d] (gathered order)


def _heads_to_seq(x: torch.Tensor, layout: SeqLayout, group: Group) -> torch.Tensor:
    p, rank = group_size(group), group_rank(group)
    b, _, m, d = x.shape
    lens = layout.local_lens
    send = x.transpose(0, 1)  # [b, s, n/p, d] -> [s, b, n/p, d]
    out = all_to_all_rows(send, lens, [lens[rank]] * p, group)  # -> [p*s_r, b, n/p, d]
    s_r = lens[rank]
    out = out.reshape(p, s_r, b, m, d).permute(2, 1, 0, 3, 4)  # -> [b, s_r, p, n/p, d]
    return out.reshape(b, s_r, p * m, d)  # [b, s_r, p, n/p, d] -> [b, s_r, n, d]


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layout: SeqLayout, group: Group) -> torch.Tensor:
        ctx.layout, ctx.group = layout, group
        return _seq_to_heads(x, layout, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _heads_to_seq(grad, ctx.layout, ctx.group), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layout: SeqLayout, group: Group) -> torch.Tensor:
        ctx.layout, ctx.group = layout, group
        return _heads_to_seq(x, layout, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _seq_to_heads(grad, ctx.layout, ctx.group), None, None


def seq_to_heads(x: torch.Tensor, layout: SeqLayout, group: Group) -> torch.Tensor:
    """All-to-all from sequence shards to head shards: ``[b, s_r, n, d] -> [b, s, n/p, d]``.

    Rank ``j`` receives heads ``[j*n/p, (j+1)*n/p)`` of every token, in gathered order. Sequence
    chunks may be uneven; ``n`` must be divisible by ``p`` (for GQA, select the key/value heads each
    rank needs first, see :func:`gqa_kv_index`). Backward is :func:`heads_to_seq`.
    """
    p = group_size(group)
    if p == 1:
        return x
    if x.shape[2] % p:
        raise ValueError(f"seq_to_heads needs the head count ({x.shape[2]}) divisible by the group ({p})")
    return _SeqToHeads.apply(x, layout, group)


def heads_to_seq(x: torch.Tensor, layout: SeqLayout, group: Group) -> torch.Tensor:
    """All-to-all from head shards back to sequence shards: ``[b, s, n/p, d] -> [b, s_r, n, d]``."""
    if group_size(group) == 1:
        return x
    return _HeadsToSeq.apply(x, layout, group)


def _move_shard(x: torch.Tensor, src: int, dst: int, src_sizes: Sequence[int], group: Group) -> torch.Tensor:
    p, rank = group_size(group), group_rank(group)
    dst_sizes = split_sizes(x.shape[dst], p)
    pieces = torch.split(x, dst_sizes, dim=dst)  # rank j's slice of the destination axis
    send = torch.cat([piece.reshape(-1) for piece in pieces])  # [numel], destination-rank order
    shape = list(x.shape)
    out_shapes = []
    for i in range(p):  # what rank i sends here: its source slice, this rank's destination slice
        shape[src], shape[dst] = src_sizes[i], dst_sizes[rank]
        out_shapes.append(tuple(shape))
    recv = all_to_all_rows(
        send, [piece.numel() for piece in pieces], [math.prod(sh) for sh in out_shapes], group
    )  # [numel] -> [numel'] (1-D: every pair may move a different amount)
    parts = torch.split(recv, [math.prod(sh) for sh in out_shapes])
    return torch.cat([part.view(sh) for part, sh in zip(parts, out_shapes)], dim=src)


class _MoveShard(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, src: int, dst: int, src_sizes: tuple[int, ...], group: Group
    ) -> torch.Tensor:
        ctx.src, ctx.dst, ctx.group = src, dst, group
        ctx.dst_sizes = tuple(split_sizes(x.shape[dst], group_size(group)))
        return _move_shard(x, src, dst, src_sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return _move_shard(grad, ctx.dst, ctx.src, ctx.dst_sizes, ctx.group), None, None, None, None


def move_shard(x: torch.Tensor, src: int, dst: int, src_sizes: Sequence[int], group: Group) -> torch.Tensor:
    """One all-to-all that moves the sharded axis: sharded along ``src``, whole along ``dst`` -> the reverse.

    ``[.., n_src/p (this rank's), .., n_dst, ..] -> [.., n_src, .., n_dst/p, ..]`` for dimensions ``src`` and
    ``dst``, contiguous chunks (:func:`~lightning_paradyse.distributed.layout.split_sizes`) on both; ``src_sizes`` are
    every rank's chunk of ``src``. Dimension switching (DSP) between blocks that attend along different axes of a
    multi-dimensional sequence. Backward moves the gradient's shard back the same way.
    """
    if group_size(group) == 1:
        return x
    return _MoveShard.apply(x, src, dst, tuple(src_sizes), group)  # type: ignore[no-any-return]


def gqa_kv_index(n_heads: int, n_kv_heads: int, p: int) -> list[int]:
    """Key/value head ids to send so that rank ``j`` gets the kv heads its query heads use.

    Query head ``i`` reads kv head ``i // (n_heads // n_kv_heads)``. Rank ``j`` holds query heads
    ``[j*n/p, (j+1)*n/p)``. When ``n_kv_heads >= p`` (and divisible) this is just ``range(n_kv)``;
    with fewer kv heads than ranks a kv head is replicated to every rank that needs it. The result
    has ``p * m`` entries, ``m`` kv heads per rank, ready for :func:`seq_to_heads`.
    """
    if n_heads % p or n_heads % n_kv_heads:
        raise ValueError(f"heads {n_heads} / kv heads {n_kv_heads} cannot be split over {p} ranks")
    group = n_heads // n_kv_heads
    per_rank = n_heads // p
    index: list[int] = []
    for j in range(p):
        first, last = (j * per_rank) // group, ((j + 1) * per_rank - 1) // group
        index.extend(range(first, last + 1))
    m = len(index) // p
    if m * p != len(index):
        raise ValueError(f"kv heads {n_kv_heads} cannot be spread evenly for {n_heads} heads on {p} ranks")
    return index


# --------------------------------------------------------------------------------------------------
# Autograd pairs over weights and rings
# --------------------------------------------------------------------------------------------------


class _GatherWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, sizes: tuple[int, ...], group: Group) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        return all_gather_rows(w, sizes, group)  # [n_r, k] -> [n, k]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        wide = grad.to(reduce_dtype(grad.dtype))  # summed in float32 where the gradient is half precision
        return reduce_scatter_rows(wide, ctx.sizes, ctx.group).to(grad.dtype), None, None  # [n, k] -> [n_r, k]


def gather_weight(w: torch.Tensor, sizes: Sequence[int], group: Group) -> torch.Tensor:
    """Forward all-gather of row shards, backward reduce-scatter of the gradient: ``[n_r, k] -> [n, k]``."""
    if group_size(group) == 1:
        return w
    return _GatherWeight.apply(w, tuple(sizes), group)


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, recv_shape: tuple[int, ...] | None) -> torch.Tensor:
        ctx.group, ctx.shape = group, tuple(x.shape)
        return ring_pass(x, group, 1, recv_shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ring_pass(grad, ctx.group, -1, ctx.shape), None, None


def ring_shift(x: torch.Tensor, group: Group, recv_shape: Sequence[int] | None = None) -> torch.Tensor:
    """Forward: send to the next rank, receive from the previous; backward: the reverse."""
    if group_size(group) == 1:
        return x
    return _RingShift.apply(x, group, None if recv_shape is None else tuple(recv_shape))


class _BroadcastWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, src: int, group: Group, shape: tuple[int, ...]) -> torch.Tensor:
        ctx.src, ctx.group, ctx.local_shape = src, group, tuple(w.shape)
        return broadcast_from(w, src, group, shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        total = reduce_to(grad, ctx.src, ctx.group)
        if group_rank(ctx.group) != ctx.src:
            return grad.new_zeros(ctx.local_shape), None, None, None
        return total, None, None, None


def broadcast_weight(w: torch.Tensor, src: int, group: Group, shape: Sequence[int] | None = None) -> torch.Tensor:
    """Forward: rank ``src``'s shard on every rank; backward: the gradient summed onto ``src``."""
    if group_size(group) == 1:
        return w
    return _BroadcastWeight.apply(w, src, group, tuple(shape) if shape is not None else tuple(w.shape))


@contextmanager
def no_counting() -> Iterator[None]:
    """Temporarily hide collectives from every active :class:`CommCounter`."""
    saved = list(CommCounter._active)
    CommCounter._active.clear()
    try:
        yield
    finally:
        CommCounter._active.extend(saved)
