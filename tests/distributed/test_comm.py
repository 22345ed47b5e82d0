"""Every collective of :mod:`lightning_paradyse.distributed.comm` against its single-process definition.

Forward and backward of each autograd pair (``torch.autograd.grad`` with a random upstream gradient,
compared with the analytic adjoint), the primitives, ``gqa_kv_index``, the size-1 no-ops, and the
pitfalls of the reference system (section 9): a parameter's storage is never written by a collective
(ring aliasing, p = 3), sharded weights get non-zero gradients (ring slot overwrite), ring attention
survives logits of ~1e4 (LSE merge) and keeps the input dtype.

One gloo spawn per world size runs every check of that size. A check records failures instead of
raising, so every rank always runs the same collectives; each pytest test then reads the failures
of its own check (the spawn runs once per world size and is cached).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_paradyse.distributed import comm
from lightning_paradyse.distributed.comm import (
    all_gather_rows,
    all_reduce_sum,
    all_to_all_rows,
    broadcast_from,
    broadcast_weight,
    gather_seq,
    gather_weight,
    gqa_kv_index,
    heads_to_seq,
    reduce_scatter_rows,
    reduce_to,
    ring_pass,
    ring_pass_start,
    ring_shift,
    scatter_seq,
    seq_to_heads,
)
from lightning_paradyse.distributed.layout import SeqLayout, split_sizes
from lightning_paradyse.graph.dispatch import AttentionDispatch
from lightning_paradyse.models import build_model
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.attention import Scores, in_window
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan
from lightning_paradyse.modes.ring import ring_attention
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime.parallel import configure, dispatchers, is_causal, parallelize, shard_sources
from tests.support.dist import run_distributed

F64 = torch.float64
SHARDED_WEIGHTS = ("q", "k", "v", "o_t", "up", "gate", "down_t")


# --------------------------------------------------------------------------------------------------
# Soft checks: record failures, never skip a collective
# --------------------------------------------------------------------------------------------------


class Checks:
    """Failures per check name; assertions never raise inside the spawned ranks."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: dict[str, list[str]] = defaultdict(list)
        self.ran: set[str] = set()
        self.notes: dict[str, list[str]] = defaultdict(list)
        self.name = ""

    def run(self, name: str, fn: Callable[..., None], *args: Any) -> None:
        self.name = name
        self.ran.add(name)
        fn(self, *args)

    def true(self, cond: bool, what: str) -> None:
        if not cond:
            self.failures[self.name].append(f"rank {self.rank}: {what}")

    def equal(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        ok = got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
        self.true(
            ok,
            f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
            + ("" if got.shape != want.shape else f", max diff {_maxdiff(got, want):.3e}"),
        )

    def close(
        self, got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-12, floor: float = 1e-30
    ) -> None:
        """``max|got - want| <= rtol * max(max|want|, floor)``, shapes equal, ``got`` finite."""
        if got.shape != want.shape:
            self.true(False, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        scale = max(float(want.double().abs().max()) if want.numel() else 0.0, floor)
        err = _maxdiff(got, want) / scale
        self.true(bool(torch.isfinite(got).all()) and err <= rtol, f"{what}: relative error {err:.3e} > {rtol:g}")

    def result(self) -> dict[str, Any]:
        return {"failures": dict(self.failures), "ran": sorted(self.ran), "notes": dict(self.notes)}


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def _rand(seed: int, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    """The same tensor on every rank for the same seed (so each rank knows every rank's data)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def _offsets(lens: tuple[int, ...]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _layouts(p: int) -> list[SeqLayout]:
    return [SeqLayout(13, p), SeqLayout(13, p, balanced=True), SeqLayout(16, p), SeqLayout(p, p)]


# --------------------------------------------------------------------------------------------------
# Checks of the autograd pairs
# --------------------------------------------------------------------------------------------------


def _check_gather_scatter_seq(chk: Checks, rank: int, p: int, group: Any) -> None:
    for li, layout in enumerate(_layouts(p)):
        s, lens = layout.seq_len, layout.local_lens
        off = _offsets(lens)
        tail = (3,) if li % 2 == 0 else (2, 3)  # [b, s, h] and [b, s, n, d]
        tag = f"s={s} balanced={layout.balanced}"
        # gather_seq: forward all-gather (gathered order), backward sum of every rank's upstream slice
        full = _rand(10 + li, 2, s, *tail)
        x = layout.shard(full, rank).requires_grad_()
        y = gather_seq(x, layout, group)
        chk.equal(y.detach(), full[:, layout.gathered_positions()], f"gather_seq forward {tag}")
        chk.equal(y.detach().index_select(1, layout.natural_index()), full, f"gather_seq natural order {tag}")
        ups = [_rand(100 + 10 * li + q, 2, s, *tail) for q in range(p)]
        (gx,) = torch.autograd.grad(y, x, ups[rank])
        want = sum(u[:, off[rank] : off[rank + 1]] for u in ups)
        chk.close(gx, want, f"gather_seq backward {tag}")
        # scatter_seq: forward sum of every rank's partial, this rank's slice; backward all-gather
        partials = [_rand(200 + 10 * li + q, 2, s, *tail) for q in range(p)]
        z_in = partials[rank].clone().requires_grad_()
        z = scatter_seq(z_in, layout, group)
        want = sum(t[:, off[rank] : off[rank + 1]] for t in partials)
        chk.close(z.detach(), want, f"scatter_seq forward {tag}")
        chk.equal(partials[rank], z_in.detach(), f"scatter_seq input untouched {tag}")
        ups = [_rand(300 + 10 * li + q, 2, lens[q], *tail) for q in range(p)]
        (gz,) = torch.autograd.grad(z, z_in, ups[rank])
        chk.equal(gz, torch.cat(ups, dim=1), f"scatter_seq backward {tag}")


def _check_seq_heads(chk: Checks, rank: int, p: int, group: Any) -> None:
    n, d = 12, 3
    m = n // p
    for li, layout in enumerate(_layouts(p)[:3]):
        s, lens = layout.seq_len, layout.local_lens
        off = _offsets(lens)
        gathered = layout.gathered_positions()
        tag = f"s={s} balanced={layout.balanced}"
        # tokens and heads encoded in the values: x[b, t, h, e] = 10000 b + 100 t + h + e / 10
        b_ = torch.arange(2, dtype=F64).view(2, 1, 1, 1)
        t_ = torch.arange(s, dtype=F64).view(1, s, 1, 1)
        h_ = torch.arange(n, dtype=F64).view(1, 1, n, 1)
        e_ = torch.arange(d, dtype=F64).view(1, 1, 1, d)
        full = 10000 * b_ + 100 * t_ + h_ + e_ / 10
        x = layout.shard(full, rank).requires_grad_()
        y = seq_to_heads(x, layout, group)  # [b, s, m, d]: heads [rank*m, (rank+1)*m) of every token
        chk.equal(y.detach(), full[:, gathered, rank * m : (rank + 1) * m], f"seq_to_heads forward {tag}")
        token = y.detach()[0, :, 0, 0] // 100
        chk.equal(token, gathered.to(F64), f"seq_to_heads token order {tag}")
        head = y.detach()[0, 0, :, 0] % 100
        chk.equal(head, torch.arange(rank * m, (rank + 1) * m, dtype=F64), f"seq_to_heads head ids {tag}")
        ups = [_rand(400 + 10 * li + j, 2, s, m, d) for j in range(p)]
        (gx,) = torch.autograd.grad(y, x, ups[rank])
        want = torch.cat([u[:, off[rank] : off[rank + 1]] for u in ups], dim=2)  # [b, s_r, n, d]
        chk.equal(gx, want, f"seq_to_heads backward {tag}")
        # heads_to_seq: forward gives this rank's tokens with every rank's heads
        parts = [_rand(500 + 10 * li + j, 2, s, m, d) for j in range(p)]
        hin = parts[rank].clone().requires_grad_()
        out = heads_to_seq(hin, layout, group)
        want = torch.cat([t[:, off[rank] : off[rank + 1]] for t in parts], dim=2)
        chk.equal(out.detach(), want, f"heads_to_seq forward {tag}")
        ups = [_rand(600 + 10 * li + r, 2, lens[r], n, d) for r in range(p)]
        (gh,) = torch.autograd.grad(out, hin, ups[rank])
        want = torch.cat([u[:, :, rank * m : (rank + 1) * m] for u in ups], dim=1)
        chk.equal(gh, want, f"heads_to_seq backward {tag}")
        # inverses of each other
        chk.equal(heads_to_seq(seq_to_heads(x, layout, group), layout, group).detach(), x.detach(), f"round trip {tag}")
        chk.equal(seq_to_heads(heads_to_seq(hin, layout, group), layout, group).detach(), parts[rank], f"inverse {tag}")
    # a head count the group cannot split is refused on every rank, before the all-to-all
    layout = SeqLayout(13, p)
    bad = torch.zeros(1, layout.local_len(rank), p + 1, 2)
    try:
        seq_to_heads(bad, layout, group)
        chk.true(False, "seq_to_heads accepted heads not divisible by p")
    except ValueError as err:
        chk.true(str(p + 1) in str(err) and str(p) in str(err), f"unclear error: {err}")


def _check_gather_weight(chk: Checks, rank: int, p: int, group: Any) -> None:
    for shape in ((7, 5), (7,), (2 * p + 1, 3)):
        rows = shape[0]
        sizes = split_sizes(rows, p)
        off = _offsets(tuple(sizes))
        full = _rand(700 + rows, *shape)
        w = full[off[rank] : off[rank + 1]].clone().requires_grad_()
        before = w.detach().clone()
        y = gather_weight(w, sizes, group)
        chk.equal(y.detach(), full, f"gather_weight forward {shape}")
        ups = [_rand(800 + rows + 31 * q, *shape) for q in range(p)]
        (gw,) = torch.autograd.grad(y, w, ups[rank])
        chk.close(gw, sum(u[off[rank] : off[rank + 1]] for u in ups), f"gather_weight backward {shape}")
        chk.equal(w.detach(), before, f"gather_weight shard untouched {shape}")


def _check_ring_shift(chk: Checks, rank: int, p: int, group: Any) -> None:
    prev, nxt = (rank - 1) % p, (rank + 1) % p
    # uneven shapes: rank r holds [r + 1, 3]
    xs = [_rand(900 + r, r + 1, 3) for r in range(p)]
    x = xs[rank].clone().requires_grad_()
    y = ring_shift(x, group, recv_shape=xs[prev].shape)
    chk.equal(y.detach(), xs[prev], "ring_shift forward receives from r-1")
    ups = [_rand(950 + r, *xs[(r - 1) % p].shape) for r in range(p)]
    (gx,) = torch.autograd.grad(y, x, ups[rank])
    chk.equal(gx, ups[nxt], "ring_shift backward receives from r+1 (sends to r-1)")
    chk.equal(x.detach(), xs[rank], "ring_shift input untouched")
    # same shape, default recv_shape
    same = [_rand(970 + r, 2, 4) for r in range(p)]
    x2 = same[rank].clone().requires_grad_()
    y2 = ring_shift(x2, group)
    chk.equal(y2.detach(), same[prev], "ring_shift forward, same shapes")
    (g2,) = torch.autograd.grad(y2, x2, same[rank] * 2)
    chk.equal(g2, same[nxt] * 2, "ring_shift backward, same shapes")


def _check_broadcast_weight(chk: Checks, rank: int, p: int, group: Any) -> None:
    for src in sorted({0, p - 1}):
        shape = (4, 3)
        local = [_rand(1000 + 10 * src + r, *(shape if r == src else (r + 1, 3))) for r in range(p)]
        w = local[rank].clone().requires_grad_()
        y = broadcast_weight(w, src, group, shape)
        chk.equal(y.detach(), local[src], f"broadcast_weight forward src={src}")
        chk.true(y.untyped_storage().data_ptr() != w.untyped_storage().data_ptr(), "broadcast aliases the shard")
        ups = [_rand(1100 + 10 * src + q, *shape) for q in range(p)]
        (gw,) = torch.autograd.grad(y, w, ups[rank])
        if rank == src:
            chk.close(gw, sum(ups), f"broadcast_weight backward src={src}: summed on src")
        else:
            chk.equal(gw, torch.zeros_like(local[rank]), f"broadcast_weight backward src={src}: zeros elsewhere")
        chk.equal(w.detach(), local[rank], f"broadcast_weight shard untouched src={src}")


# --------------------------------------------------------------------------------------------------
# Checks of the primitives
# --------------------------------------------------------------------------------------------------


def _check_all_to_all(chk: Checks, rank: int, p: int, group: Any) -> None:
    for variant, count in (("uneven", lambda i, j: (i + 2 * j) % 3 + 1), ("with empty", lambda i, j: (i + j) % 2)):
        blocks = [[_rand(1200 + 10 * i + j, count(i, j), 2) for j in range(p)] for i in range(p)]
        x = torch.cat(blocks[rank])
        before = x.clone()
        out = all_to_all_rows(x, [count(rank, j) for j in range(p)], [count(i, rank) for i in range(p)], group)
        chk.equal(out, torch.cat([blocks[i][rank] for i in range(p)]), f"all_to_all_rows {variant}")
        chk.equal(x, before, f"all_to_all_rows input untouched ({variant})")


def _check_reductions(chk: Checks, rank: int, p: int, group: Any) -> None:
    xs = [_rand(1300 + r, 3, 4) for r in range(p)]
    x = xs[rank].clone()
    total = all_reduce_sum(x, group)
    chk.close(total, sum(xs), "all_reduce_sum")
    chk.equal(x, xs[rank], "all_reduce_sum input untouched")
    chk.true(total.data_ptr() != x.data_ptr(), "all_reduce_sum returned its input")
    for dst in sorted({0, p - 1}):
        got = reduce_to(x, dst, group)
        if rank == dst:
            chk.close(got, sum(xs), f"reduce_to dst={dst}")
        chk.equal(x, xs[rank], f"reduce_to input untouched dst={dst}")
        chk.true(got.data_ptr() != x.data_ptr(), "reduce_to returned its input")
    for src in sorted({0, p - 1}):
        got = broadcast_from(x if rank == src else torch.empty(0, dtype=F64), src, group, shape=(3, 4))
        chk.equal(got, xs[src], f"broadcast_from src={src}")
    # the row primitives with uneven sizes
    sizes = split_sizes(2 * p + 1, p)
    off = _offsets(tuple(sizes))
    full = _rand(1350, 2 * p + 1, 2)
    chk.equal(all_gather_rows(full[off[rank] : off[rank + 1]], sizes, group), full, "all_gather_rows uneven")
    # all_gather_rows(at_once=True): rows wide enough for gloo's own all-gather (past PAIRWISE_BYTES), then one
    # all-to-all where comm.GATHER_AT_ONCE is set (alike on every rank) and the pairwise path is not forced off
    wide = _rand(1355, 2 * p + 1, comm.PAIRWISE_BYTES // 8 + 1)  # [2p + 1, k] float64: a row is 4 KiB and more
    at_once, before = [], (comm.GATHER_AT_ONCE, comm._gather_at_once)
    comm._gather_at_once = lambda *args: at_once.append(1) or before[1](*args)  # counts the calls
    try:
        for agreed in (False, True):
            comm.GATHER_AT_ONCE = agreed
            for at_once_sizes in (sizes, [0 if r == p - 1 else 2 for r in range(p)]):  # uneven; a rank sending nothing
                bounds = _offsets(tuple(at_once_sizes))
                whole = wide[: bounds[p]]
                mine = whole[bounds[rank] : bounds[rank + 1]]
                got = all_gather_rows(mine, at_once_sizes, group, at_once=True)
                chk.equal(got, whole, f"all_gather_rows at once {at_once_sizes} (agreed: {agreed})")
                chk.true(p == 1 or got.data_ptr() != mine.data_ptr(), "all_gather_rows at once returned its input")
    finally:
        comm.GATHER_AT_ONCE, comm._gather_at_once = before
    runs = 2 if p > 1 and comm.PAIRWISE is not False else 0  # the agreed pass's two gathers; none forced ringed
    chk.true(len(at_once) == runs, f"all_gather_rows ran {len(at_once)} gathers at once, not {runs}")
    # the gather at once is agreed: only where every rank polls (one rank that does not turns it off everywhere)
    spin = comm.HOST_SPIN_S
    for spinning, expected in (([True] * p, p > 1), ([r != p - 1 for r in range(p)], False)):
        comm.HOST_SPIN_S = comm.SPIN_LIMIT_S if spinning[rank] else 0.0
        try:
            chk.true(comm.gather_at_once(group) == expected, f"gather_at_once with polling {spinning}")
        finally:
            comm.HOST_SPIN_S = spin
    parts = [_rand(1360 + q, 2 * p + 1, 2) for q in range(p)]
    got = reduce_scatter_rows(parts[rank], sizes, group)
    chk.close(got, sum(parts)[off[rank] : off[rank + 1]], "reduce_scatter_rows uneven")
    # every rank holds the same bits of a sum (the pairwise path adds in rank order on every rank)
    for numel in (5, comm.PAIRWISE_BYTES // 8 + 1):  # a small one and one past the pairwise threshold
        mine = _rand(1370 + rank, numel)
        total = all_reduce_sum(mine, group)
        chk.close(total, sum(_rand(1370 + q, numel) for q in range(p)), f"all_reduce_sum of {numel}")
        every = all_gather_rows(total.view(1, -1), [1] * p, group)  # [1, n] -> [p, n]
        chk.true(all(torch.equal(every[0], row) for row in every), f"all_reduce_sum of {numel} differs between ranks")
    try:  # a shard of the wrong size is refused on every rank, before the all-gather
        all_gather_rows(torch.zeros(sizes[rank] + 1, 2), sizes, group)
        chk.true(False, "all_gather_rows accepted a shard of the wrong size")
    except ValueError as err:
        chk.true(str(sizes[rank] + 1) in str(err), f"unclear error: {err}")


def _check_ring_pass(chk: Checks, rank: int, p: int, group: Any) -> None:
    shifts = (1, 2, -1) if p >= 3 else (1, -1)
    for shift in shifts:
        xs = [_rand(1400 + 10 * shift + r, 2, r + 2) for r in range(p)]
        src = (rank - shift) % p
        x = xs[rank].clone()
        pending = ring_pass_start(x, group, shift, recv_shape=xs[src].shape)
        busy = x.sum()  # compute overlapping the transfer
        got = pending.wait()
        chk.equal(got, xs[src], f"ring_pass_start shift={shift} receives from r-{shift}")
        chk.equal(x, xs[rank], f"ring_pass_start shift={shift} input untouched")
        chk.true(got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), "ring receive into its input")
        chk.true(bool(torch.isfinite(busy)), "overlap")
        chk.equal(pending.wait(), got, "a second wait returns the same tensor")
    same = [_rand(1480 + r, 3) for r in range(p)]
    chk.equal(ring_pass(same[rank], group), same[(rank - 1) % p], "ring_pass default shape")


# --------------------------------------------------------------------------------------------------
# Pitfalls 1 and 2: parameters untouched by every mode, non-zero sharded gradients
# --------------------------------------------------------------------------------------------------

_RECEIVING = {  # collective -> index of the argument it writes into
    "all_gather_single": 0,
    "all_gather_into_tensor": 0,
    "reduce_scatter_single": 0,
    "reduce_scatter_tensor": 0,
    "all_to_all_single": 0,
    "broadcast": 0,
    "reduce": 0,
    "all_reduce": 0,
}


@contextmanager
def _record_receive_buffers() -> Iterator[list[tuple[int, int]]]:
    """Record the storage range of every buffer a collective writes into, for the duration."""
    ranges: list[tuple[int, int]] = []

    def keep(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

    originals: dict[str, Any] = {}
    for name, index in _RECEIVING.items():
        if not hasattr(dist, name):
            continue
        original = getattr(dist, name)
        originals[name] = original

        def wrapped(*args: Any, _original: Any = original, _index: int = index, **kwargs: Any) -> Any:
            keep(args[_index])
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)
    original_batch = dist.batch_isend_irecv

    def batch(ops: list[Any]) -> Any:
        for op in ops:
            if getattr(op.op, "__name__", "") == "irecv":
                keep(op.tensor)
        return original_batch(ops)

    dist.batch_isend_irecv = batch  # type: ignore[assignment]
    try:
        yield ranges
    finally:
        dist.batch_isend_irecv = original_batch  # type: ignore[assignment]
        for name, original in originals.items():
            setattr(dist, name, original)


def _feasible_modes(model: Any, p: int) -> tuple[list[str], list[str]]:
    """The modes every attention op, and every MLP op, of ``model`` can run on ``p`` ranks."""
    ops = dispatchers(model)
    attn = [op for _, op in ops if isinstance(op, AttentionDispatch)]
    mlp = [op for _, op in ops if not isinstance(op, AttentionDispatch)]
    attn_ok = [m for m in MODES if all(op.infeasible(m, p) is None for op in attn)]
    mlp_ok = [m for m in MODES if all(op.infeasible(m, p) is None for op in mlp)]
    return attn_ok, mlp_ok


def _feasible_plans(model: Any, p: int, n_layers: int) -> list[tuple[str, Plan]]:
    attn_ok, mlp_ok = _feasible_modes(model, p)
    plans: list[tuple[str, Plan]] = []
    for mode in MODES:
        if mode in attn_ok and mode in mlp_ok:
            op = OpPlan(mode)
            plans.append((mode, Plan((LayerPlan(op, op),) * n_layers)))
        elif mode in mlp_ok:  # the attention cannot be split this way: still run the MLP in this mode
            plans.append((f"ring+{mode}", Plan((LayerPlan(OpPlan("ring"), OpPlan(mode)),) * n_layers)))
    for k in range(2):  # mixed plans: every layer and op in a different feasible mode, some recomputed
        layers = tuple(
            LayerPlan(
                OpPlan(attn_ok[(i + k) % len(attn_ok)], recompute=(i + k) % 2 == 0),
                OpPlan(mlp_ok[(i + k + 1) % len(mlp_ok)], recompute=(i + k) % 2 == 1),
            )
            for i in range(n_layers)
        )
        plans.append((f"mixed#{k}", Plan(layers)))
    return plans


def _model_step(model: Any, tokens: torch.Tensor, targets: torch.Tensor, ctx: SeqContext, plan: Plan) -> float:
    configure(model, ctx, plan)
    model.zero_grad(set_to_none=True)
    layout, rank = ctx.layout, ctx.rank
    logits = model(layout.shard(tokens, rank), ctx.positions())
    loss = F.cross_entropy(logits.flatten(0, 1), layout.shard(targets, rank).flatten(), reduction="sum")
    (loss / targets.numel()).backward()
    return float(all_reduce_sum(loss.detach(), ctx.group)) / targets.numel()


def _check_parameters_untouched(chk: Checks, rank: int, p: int, group: Any) -> None:
    for name in ("llama-tiny", "gpt-tiny"):
        torch.manual_seed(0)
        plain = build_model(name)
        n_layers = len(plain.layers)
        tokens = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(1))
        tokens, targets = tokens[:, :-1], tokens[:, 1:]  # 13 tokens: not divisible by p
        ref = float(F.cross_entropy(plain(tokens).flatten(0, 1), targets.flatten()))
        model = copy.deepcopy(plain)
        parallelize(model, group)
        ctx = SeqContext(SeqLayout.for_sequence(tokens.shape[1], p, is_causal(model)), group)
        params = dict(model.named_parameters())
        snapshot = {n: (t.detach().clone(), t.data_ptr()) for n, t in params.items()}
        storages = {n: (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for n, t in params.items()}
        plans = _feasible_plans(model, p, n_layers)
        sharded = [n for n in shard_sources(model) if n.rsplit(".", 1)[-1] in SHARDED_WEIGHTS]
        chk.true(len(sharded) >= 6 * n_layers, f"{name}: sharded weights not found: {sharded}")
        first_loss: float | None = None
        loss: float | None = None
        for label, plan in [*plans, plans[0]]:  # the first plan again: a corrupted parameter changes its loss
            tag = f"{name} p={p} {label}"
            with _record_receive_buffers() as received:
                try:
                    loss = _model_step(model, tokens, targets, ctx, plan)
                except NotImplementedError:
                    chk.notes["skipped"].append(f"{tag} [{plan}]")
                    continue
            chk.notes["ran"].append(f"{tag} [{plan}]")
            chk.true(math.isfinite(loss) and abs(loss - ref) <= 1e-4 * abs(ref), f"{tag}: loss {loss} != ref {ref}")
            if first_loss is None:
                first_loss = loss
            for pname, t in params.items():
                before, ptr = snapshot[pname]
                chk.true(torch.equal(t.detach(), before), f"{tag}: parameter {pname} was written")
                chk.true(t.data_ptr() == ptr, f"{tag}: parameter {pname} moved")
                start, nbytes = storages[pname]
                hit = [r for r in received if r[0] < start + nbytes and start < r[1]]
                chk.true(not hit, f"{tag}: a collective received into the storage of {pname}")
            chk.true(len(received) > 0, f"{tag}: no collective recorded (the recorder is broken)")
            for pname in sharded:
                grad = params[pname].grad
                ok = grad is not None and grad.shape == params[pname].shape
                chk.true(ok and float(grad.norm()) > 0, f"{tag}: {pname} has a zero or no gradient")
        chk.true(first_loss is not None, f"{name}: no plan ran")
        chk.true(first_loss == loss, f"{name}: the first plan's loss changed when run again ({first_loss} -> {loss})")


# --------------------------------------------------------------------------------------------------
# Pitfalls 4 and 6: ring attention with large logits, and its dtype
# --------------------------------------------------------------------------------------------------


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Plain float64 softmax attention on the full sequence: ``[b, n, s, d]``, GQA by repetition."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [b, n, s, s]
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _attention_inputs(seed: int, s: int, big: float) -> tuple[torch.Tensor, ...]:
    """``q [1, 4, s, 8], k/v [1, 2, s, 8]`` (GQA) and an upstream gradient, float64.

    With ``big > 0`` every logit is ``±big`` plus a spread of a few units per query row: the keys
    share one direction ``e`` that the queries follow with a large random sign, and differ from it
    by ``1e-4``. The softmax is not saturated (its gradients are meaningful) but every partial
    log-sum-exp is about ``±big``, so exponentiating one overflows (or underflows to 0/0).
    """
    b, n, n_kv, d = 1, 4, 2, 8
    q, k = _rand(seed, b, n, s, d), _rand(seed + 1, b, n_kv, s, d)
    if big:
        e = torch.zeros(d, dtype=F64)
        e[0] = 1.0
        sign = torch.where(_rand(seed + 2, b, n, s, 1) > 0, 1.0, -1.0)
        q = sign * big * math.sqrt(d) * e + q
        k = e + 1e-4 * k
    return q, k, _rand(seed + 3, b, n_kv, s, d), _rand(seed + 4, b, n, s, d)


def _ring_case(
    chk: Checks,
    rank: int,
    layout: SeqLayout,
    group: Any,
    causal: bool,
    big: float,
    dtype: torch.dtype,
    rtol: float,
    tag: str,
) -> None:
    """Ring attention on the layout against float64 softmax attention on the full sequence, with grads."""
    seed = 1500 + 10 * int(causal) + 20 * layout.balanced + int(big > 0)
    full_q, full_k, full_v, full_up = _attention_inputs(seed, layout.seq_len, big)
    leaves = [t.to(dtype).double().requires_grad_() for t in (full_q, full_k, full_v)]  # what the ring sees
    ref = _reference_attention(*leaves, causal)
    ref_grads = torch.autograd.grad(ref, leaves, full_up)
    if big:
        qd, kd = leaves[0].detach(), leaves[1].detach().repeat_interleave(2, 1)
        logits = qd @ kd.transpose(-1, -2) / math.sqrt(qd.shape[-1])
        low = float(logits.abs().min())
        chk.true(low > 0.9 * big, f"{tag}: the logits are not large (smallest |logit| {low})")
    q, k, v = (layout.shard(t.detach(), rank, dim=2).to(dtype).requires_grad_() for t in leaves)
    out = ring_attention(q, k, v, SeqContext(layout, group), Scores(causal))
    chk.true(out.dtype == dtype, f"{tag}: output dtype {out.dtype} != input dtype {dtype}")
    chk.true(bool(torch.isfinite(out).all()), f"{tag}: output not finite")
    chk.close(out.detach().double(), layout.shard(ref.detach(), rank, dim=2), f"{tag}: output", rtol)
    grads = torch.autograd.grad(out, (q, k, v), layout.shard(full_up, rank, dim=2).to(dtype))
    for label, got, want in zip("qkv", grads, ref_grads):
        chk.true(got.dtype == dtype, f"{tag}: d{label} dtype {got.dtype} != {dtype}")
        # with big logits dq is a difference of nearly equal keys (about 1e-4 of its natural O(1) scale):
        # its error is measured against that natural scale
        floor = 1.0 if big and label == "q" else 1e-30
        chk.close(got.double(), layout.shard(want, rank, dim=2), f"{tag}: d{label}", rtol, floor)


def _check_ring_large_logits(chk: Checks, rank: int, p: int, group: Any) -> None:
    s = 13
    for causal, balanced in ((False, False), (True, True), (True, False)):
        layout = SeqLayout(s, p, balanced=balanced)
        tag = f"causal={causal} balanced={balanced}"
        _ring_case(chk, rank, layout, group, causal, 0.0, F64, 1e-10, f"{tag} normal logits")
        # logits ~±1e4: exp(lse) overflows float64 and float32; a max-subtracted merge does not
        _ring_case(chk, rank, layout, group, causal, 1e4, F64, 1e-9, f"{tag} logits 1e4 float64")
        _ring_case(chk, rank, layout, group, causal, 1e4, torch.float32, 5e-3, f"{tag} logits 1e4 float32")


def _check_ring_dtype(chk: Checks, rank: int, p: int, group: Any) -> None:
    layout = SeqLayout.for_sequence(13, p, causal=True)
    for dtype, rtol in ((F64, 1e-10), (torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        _ring_case(chk, rank, layout, group, True, 0.0, dtype, rtol, f"dtype {dtype}")


def _check_ring_window(chk: Checks, rank: int, p: int, group: Any) -> None:
    """A causal sliding window on the balanced layout, alone and inside packed documents: tiles wholly outside the
    window are skipped, partial ones masked; outputs and gradients against a float64 masked attention."""
    s, window = 23, 4
    pos = torch.arange(s)
    for docs in (None, torch.bucketize(pos, torch.tensor([9, 14]), right=True)):
        layout = SeqLayout.for_sequence(s, p, causal=True)
        q, k, v, up = _attention_inputs(1700 + p, s, 0.0)
        allowed = in_window(pos, pos, window)
        if docs is not None:
            allowed = allowed & (docs[:, None] == docs[None, :])
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        kk, vv = (t.repeat_interleave(2, 1) for t in leaves[1:])
        ref = F.scaled_dot_product_attention(leaves[0], kk, vv, allowed)
        ref_grads = torch.autograd.grad(ref, leaves, up)
        local = [layout.shard(t.detach(), rank, dim=2).requires_grad_() for t in leaves]
        out = ring_attention(*local, SeqContext(layout, group, docs), Scores(True, window=window))
        tag = f"window {window}, documents {docs is not None}"
        chk.close(out.detach(), layout.shard(ref.detach(), rank, dim=2), f"{tag}: output", 1e-10)
        grads = torch.autograd.grad(out, local, layout.shard(up, rank, dim=2))
        for label, got, want in zip("qkv", grads, ref_grads):
            chk.close(got, layout.shard(want, rank, dim=2), f"{tag}: d{label}", 1e-10)


# --------------------------------------------------------------------------------------------------
# The spawned worker and its cache
# --------------------------------------------------------------------------------------------------

COLLECTIVE_CHECKS = {
    "gather_scatter_seq": _check_gather_scatter_seq,
    "seq_heads": _check_seq_heads,
    "gather_weight": _check_gather_weight,
    "ring_shift": _check_ring_shift,
    "broadcast_weight": _check_broadcast_weight,
    "all_to_all": _check_all_to_all,
    "reductions": _check_reductions,
    "ring_pass": _check_ring_pass,
    "ring_large_logits": _check_ring_large_logits,
    "ring_dtype": _check_ring_dtype,
    "ring_window": _check_ring_window,
}
MODEL_WORLDS = (2, 3)
STAGED_CHECKS = ("ring_shift", "ring_pass", "ring_dtype", "ring_window")
"""Ring hops staged through host memory (what gloo groups of ranks sharing one GPU run): forced on CPU here."""
PAIRWISE_CHECKS = ("reductions", "gather_scatter_seq", "gather_weight")
"""Checks of collectives that host tensors of a gloo group run through one all-to-all (``comm.PAIRWISE``): run again
through the backend's own all-gather, reduce-scatter and all-reduce (what GPU tensors take)."""


def _forcing(switch: str, value: bool, fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` run with ``comm.<switch>`` forced to ``value`` (back to ``None``, the default, after)."""

    def run(*args: Any) -> None:
        setattr(comm, switch, value)
        try:
            fn(*args)
        finally:
            setattr(comm, switch, None)

    return run


POLLED_CHECKS = ("reductions", "all_to_all", "gather_weight")
"""Checks run again waiting by polling (``comm.polled`` with ``comm.HOST_SPIN_S`` set, what a data-parallel step's
exchanges do on the host): the same values."""


def _polling(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` run inside ``comm.polled()`` with ``comm.HOST_SPIN_S`` at its limit (back to ``0`` after)."""

    def run(*args: Any) -> None:
        comm.HOST_SPIN_S = comm.SPIN_LIMIT_S
        try:
            with comm.polled():
                fn(*args)
        finally:
            comm.HOST_SPIN_S = 0.0

    return run


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(1234)
    chk = Checks(rank)
    group = dist.group.WORLD
    for name, fn in COLLECTIVE_CHECKS.items():
        chk.run(name, fn, rank, world, group)
    for name in STAGED_CHECKS:
        chk.run(f"{name}_staged", _forcing("STAGE_P2P", True, COLLECTIVE_CHECKS[name]), rank, world, group)
    for name in PAIRWISE_CHECKS:
        chk.run(f"{name}_ringed", _forcing("PAIRWISE", False, COLLECTIVE_CHECKS[name]), rank, world, group)
    for name in POLLED_CHECKS:
        chk.run(f"{name}_polled", _polling(COLLECTIVE_CHECKS[name]), rank, world, group)
    if world in MODEL_WORLDS:
        chk.run("parameters_untouched", _check_parameters_untouched, rank, world, group)
    return chk.result()


_CACHE: dict[int, list[dict[str, Any]]] = {}


def _results(world: int) -> list[dict[str, Any]]:
    if world not in _CACHE:
        _CACHE[world] = run_distributed(_worker, world, timeout=240)
    return _CACHE[world]


def _assert_check(world: int, name: str) -> list[dict[str, Any]]:
    results = _results(world)
    for result in results:
        assert name in result["ran"], f"check {name} did not run"
    failures = [f for result in results for f in result["failures"].get(name, [])]
    assert not failures, f"{len(failures)} failure(s) at p={world}:\n" + "\n".join(failures[:40])
    return results


WORLDS = pytest.mark.parametrize("world", [2, 3, 4])


@WORLDS
@pytest.mark.parametrize("name", STAGED_CHECKS)
def test_ring_hops_staged_through_host_memory(world: int, name: str) -> None:
    """The host-staged ring (gloo on CUDA tensors: several ranks on one GPU) moves the same values as the direct one."""
    _assert_check(world, f"{name}_staged")


@WORLDS
def test_ring_attention_with_a_sliding_window(world: int) -> None:
    _assert_check(world, "ring_window")


@WORLDS
def test_gather_scatter_seq(world: int) -> None:
    _assert_check(world, "gather_scatter_seq")


@WORLDS
def test_seq_to_heads_heads_to_seq(world: int) -> None:
    _assert_check(world, "seq_heads")


@WORLDS
def test_gather_weight(world: int) -> None:
    _assert_check(world, "gather_weight")


@WORLDS
def test_ring_shift(world: int) -> None:
    _assert_check(world, "ring_shift")


@WORLDS
def test_broadcast_weight(world: int) -> None:
    _assert_check(world, "broadcast_weight")


@WORLDS
def test_all_to_all_rows(world: int) -> None:
    _assert_check(world, "all_to_all")


@WORLDS
def test_reductions_and_row_primitives(world: int) -> None:
    _assert_check(world, "reductions")


@WORLDS
@pytest.mark.parametrize("name", PAIRWISE_CHECKS)
def test_backend_collectives_where_not_pairwise(world: int, name: str) -> None:
    """The backend's own all-gather, reduce-scatter and all-reduce (GPU tensors) move the same values as the one
    all-to-all that host tensors of a gloo group take."""
    _assert_check(world, f"{name}_ringed")


@WORLDS
@pytest.mark.parametrize("name", POLLED_CHECKS)
def test_collectives_waited_for_by_polling(world: int, name: str) -> None:
    """Waiting by polling (a data-parallel step's exchanges on the host) moves the same values as blocking."""
    _assert_check(world, f"{name}_polled")


class _Work:
    """A collective in flight that completes after ``polls`` polls."""

    def __init__(self, polls: int) -> None:
        self.polls, self.asked, self.waited = polls, 0, False

    def is_completed(self) -> bool:
        self.asked += 1
        return self.asked > self.polls

    def wait(self) -> bool:
        self.waited = True
        return True


def test_only_the_exchanges_poll_and_only_where_each_rank_has_a_core() -> None:
    """Polling happens inside ``polled()`` on host tensors with ``HOST_SPIN_S`` set, else the backend's wait at once;
    the strategy sets ``HOST_SPIN_S`` only for host ranks that each can have a core."""
    host = torch.zeros(1)
    comm.HOST_SPIN_S = 1.0
    try:
        work = _Work(polls=3)
        comm._settle(work, host)  # outside polled(): blocks at once
        assert work.asked == 0 and work.waited
        with comm.polled():
            work = _Work(polls=3)
            comm._settle(work, host)
            assert work.asked == 4 and work.waited  # polled until complete, then the backend's wait
        work = _Work(polls=3)
        comm._settle(work, host)  # polled() left: blocking again
        assert work.asked == 0
    finally:
        comm.HOST_SPIN_S = 0.0
    with comm.polled():
        work = _Work(polls=3)
        comm._settle(work, host)  # nothing set (the default, a GPU run): blocks at once
        assert work.asked == 0 and work.waited
    cpu = torch.device("cpu")
    assert comm.host_spin_seconds(cpu, 1) == comm.SPIN_LIMIT_S
    assert comm.host_spin_seconds(cpu, 10_000) == 0.0  # more ranks than cores: a polling rank would take a core
    assert comm.host_spin_seconds(torch.device("cuda", 0), 1) == 0.0


@WORLDS
def test_ring_pass_start(world: int) -> None:
    _assert_check(world, "ring_pass")


@WORLDS
def test_ring_attention_large_logits(world: int) -> None:
    _assert_check(world, "ring_large_logits")


@WORLDS
def test_ring_attention_keeps_dtype(world: int) -> None:
    _assert_check(world, "ring_dtype")


@pytest.mark.parametrize("world", MODEL_WORLDS)
def test_parameters_untouched_and_sharded_grads_nonzero(world: int) -> None:
    results = _assert_check(world, "parameters_untouched")
    skipped = results[0]["notes"].get("skipped", [])
    assert all("metp" in tag for tag in skipped), f"only metp may be unimplemented: {skipped}"
    ran = results[0]["notes"]["ran"]
    for mode in MODES:  # every mode ran at least one op (a uniform plan, or its MLP beside ring attention)
        assert any(mode in tag for tag in ran) or any(mode in tag for tag in skipped), (mode, ran)
    assert sum("mixed" in tag for tag in ran) >= 2, ran
    if skipped:
        pytest.skip(f"not implemented yet: {skipped}")


# --------------------------------------------------------------------------------------------------
# Single process: gqa_kv_index and the size-1 no-ops
# --------------------------------------------------------------------------------------------------


def _needed_kv(n: int, n_kv: int, p: int, j: int) -> list[int]:
    per, group = n // p, n // n_kv
    return sorted({i // group for i in range(j * per, (j + 1) * per)})


@pytest.mark.parametrize("n_kv", [12, 4, 2, 1])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_gqa_kv_index(n_kv: int, p: int) -> None:
    n = 12
    needed = [_needed_kv(n, n_kv, p, j) for j in range(p)]
    if len({len(heads) for heads in needed}) > 1:
        with pytest.raises(ValueError) as err:
            gqa_kv_index(n, n_kv, p)
        assert str(n_kv) in str(err.value) and str(p) in str(err.value)
        return
    index = gqa_kv_index(n, n_kv, p)
    m = len(index) // p
    assert len(index) == m * p
    for j in range(p):
        assert index[j * m : (j + 1) * m] == needed[j]
    assert set(index) == set(range(n_kv))


@pytest.mark.parametrize(
    ("n", "n_kv", "p", "expected"),
    [
        (12, 12, 4, list(range(12))),
        (12, 4, 2, [0, 1, 2, 3]),
        (12, 4, 3, [0, 1, 1, 2, 2, 3]),
        (12, 2, 4, [0, 0, 1, 1]),
        (12, 1, 3, [0, 0, 0]),
        (12, 2, 1, [0, 1]),
    ],
)
def test_gqa_kv_index_values(n: int, n_kv: int, p: int, expected: list[int]) -> None:
    assert gqa_kv_index(n, n_kv, p) == expected


@pytest.mark.parametrize(("n", "n_kv", "p"), [(12, 2, 3), (12, 12, 5), (12, 4, 5), (12, 5, 2)])
def test_gqa_kv_index_errors(n: int, n_kv: int, p: int) -> None:
    with pytest.raises(ValueError) as err:
        gqa_kv_index(n, n_kv, p)
    assert str(n_kv) in str(err.value) and str(p) in str(err.value)


def test_every_function_is_a_no_op_without_group() -> None:
    layout = SeqLayout(7, 1)
    x = torch.randn(2, 7, 4, 3)
    w = torch.randn(5, 3)
    assert gather_seq(x, layout, None) is x
    assert scatter_seq(x, layout, None) is x
    assert seq_to_heads(x, layout, None) is x
    assert heads_to_seq(x, layout, None) is x
    assert gather_weight(w, [5], None) is w
    assert ring_shift(w, None) is w
    assert broadcast_weight(w, 0, None) is w
    assert all_gather_rows(w, [5], None) is w
    assert reduce_scatter_rows(w, [5], None) is w
    assert all_to_all_rows(w, [5], [5], None) is w
    assert ring_pass(w, None) is w
    assert ring_pass_start(w, None).wait() is w
    assert ring_pass_start(w, None, recv_shape=(2, 3)).wait().shape == (2, 3)
    assert broadcast_from(w, 0, None) is w
    assert reduce_to(w, 0, None) is w
    assert all_reduce_sum(w, None) is w
    assert comm.group_size(None) == 1 and comm.group_rank(None) == 0
    # autograd still flows through the no-ops
    leaf = w.clone().requires_grad_()
    (g,) = torch.autograd.grad(gather_weight(leaf, [5], None).sum(), leaf)
    assert torch.equal(g, torch.ones_like(w))


def test_comm_counter_counts_nothing_without_group() -> None:
    with comm.CommCounter() as counter:
        all_gather_rows(torch.randn(4, 2), [4], None)
    assert counter.total == 0
