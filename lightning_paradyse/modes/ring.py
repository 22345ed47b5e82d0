"""``ring``: ring attention over sequence chunks with ZeRO-3 weights (MegatronCZ / CP + ZeRO-3).

Each rank keeps its queries; key/value blocks travel around the ring (``p - 1`` hops), each hop
overlapped with the attention of the block in hand, and the partial results are merged with the
stable log-sum-exp rule of :func:`~lightning_paradyse.modes.attention.merge`. For causal attention the
layout is the balanced head-tail order (rank ``r`` holds chunks ``r`` and ``2p-1-r``), so every rank
attends to the same number of key tiles; tiles entirely in the future are skipped.

Backward re-circulates the key/value blocks and sends the dK/dV accumulators one hop behind them:
the accumulator of block ``j`` starts at rank ``j + 1`` and reaches its owner after ``p - 1`` hops,
so key/value traffic is ``3 * (p-1)`` block transfers per step (forward, backward, gradients), the
``12*h_kv*(p-1)/p`` bytes per token of the communication model. Only the inputs, the output and
the log-sum-exp are saved: activation memory is ``O(s/p)`` per rank.

:func:`ring_forward` and :func:`ring_backward` are public so METP can run the same ring per head
group with its own recomputation.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_paradyse.distributed.comm import ring_pass_start
from lightning_paradyse.distributed.devices import to_device
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.modes.attention import Scores, block_backward, block_forward, in_window, merge
from lightning_paradyse.modes.base import Mode, autocast_off, merge_heads, prepare_heads
from lightning_paradyse.modes.specs import AttnSpec, AttnWeights, MlpSpec, MlpWeights, SeqContext
from lightning_paradyse.modes.ulysses import zero3_project
from lightning_paradyse.modes.zero3 import zero3_mlp, zero3_out

Tile = tuple[slice, slice, bool]  # (local query slice, key slice in the block, causal diagonal)
MaskedTile = tuple[slice, slice, bool, torch.Tensor | None]  # + allowed [tq, tk] for packed documents


def _local_slices(layout: SeqLayout, rank: int) -> list[tuple[slice, int, int]]:
    """``(local slice, global start, global stop)`` of each segment ``rank`` holds."""
    out, at = [], 0
    for start, stop in layout.segments(rank):
        out.append((slice(at, at + stop - start), start, stop))
        at += stop - start
    return out


def tiles(layout: SeqLayout, rank: int, src: int, causal: bool) -> list[Tile]:
    """The (query segment, key segment) tiles ``rank`` computes against ``src``'s key/value block."""
    result: list[Tile] = []
    for q_sl, q0, q1 in _local_slices(layout, rank):
        for k_sl, k0, k1 in _local_slices(layout, src):
            if not causal:
                result.append((q_sl, k_sl, False))
            elif (k0, k1) == (q0, q1):
                result.append((q_sl, k_sl, True))  # the diagonal tile
            elif k1 <= q0:
                result.append((q_sl, k_sl, False))  # keys entirely in the past
            # keys entirely in the future: skipped
    return result


def doc_tiles(
    ctx: SeqContext,
    rank: int,
    src: int,
    causal: bool,
    window: int | None = None,
    device: torch.device | None = None,
) -> list[MaskedTile]:
    """:func:`tiles` with packed documents and a causal sliding window: tiles with no shared document or wholly
    outside the window are skipped (no work), tiles partly outside it are masked. The tiles are chosen on the host
    (document ids and positions there); the masks are handed over on ``device`` (the scores')."""
    plain = tiles(ctx.layout, rank, src, causal)
    docs_q, docs_k = ctx.host_docs_of(rank), ctx.host_docs_of(src)
    pos_q, pos_k = ctx.layout.positions(rank), ctx.layout.positions(src)  # [s_r] global positions (host)
    out: list[MaskedTile] = []
    for q_sl, k_sl, diag in plain:
        allowed = None
        if window is not None:
            nearest, farthest = int(pos_q[q_sl][0] - pos_k[k_sl][-1]), int(pos_q[q_sl][-1] - pos_k[k_sl][0])
            if nearest >= window:
                continue  # every key of the tile is older than the window
            if farthest >= window:
                allowed = in_window(pos_q[q_sl], pos_k[k_sl], window)  # [tq, tk]
        if docs_q is not None and docs_k is not None:
            same = docs_q[q_sl, None] == docs_k[None, k_sl]  # [tq, tk] same document
            allowed = same if allowed is None else allowed & same
        if allowed is None or bool(allowed.all()):
            out.append((q_sl, k_sl, diag, None))
        elif bool(allowed.any()):
            out.append((q_sl, k_sl, diag, to_device(allowed, device or pos_q.device)))  # host -> scores' device
    return out


def _kv_shape(k: torch.Tensor, layout: SeqLayout, rank: int) -> tuple[int, ...]:
    b, n_kv, _, d = k.shape
    return (2, b, n_kv, layout.local_len(rank), d)


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: SeqContext,
    scores: Scores,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward, no autograd: ``q [b, n, s_r, d], k/v [b, n_kv, s_r, d]``.

    Returns ``out [b, n, s_r, d]`` (dtype of ``q``) and ``lse [b, n, s_r]`` (accumulation dtype). The tiles
    compute in float32 (float64 stays float64) with autocast off: under autocast their score matmuls would
    otherwise drop to bfloat16. K/V travel in their own dtype.
    """
    with autocast_off(q):
        return _ring_forward(q, k, v, ctx, scores)


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: SeqContext, scores: Scores
) -> tuple[torch.Tensor, torch.Tensor]:
    p, r, layout = ctx.p, ctx.rank, ctx.layout
    outs: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    kv = torch.stack([k, v])  # [2, b, n_kv, s_r, d]
    for t in range(p):
        src = (r - t) % p
        pending = ring_pass_start(kv, ctx.group, 1, _kv_shape(k, layout, (src - 1) % p)) if t < p - 1 else None
        for q_sl, k_sl, diag, allowed in doc_tiles(ctx, r, src, scores.causal, scores.window, q.device):
            qt, kt, vt = q[:, :, q_sl], kv[0][:, :, k_sl], kv[1][:, :, k_sl]
            o, lse = block_forward(qt, kt, vt, diag, scores.scale, allowed=allowed, softcap=scores.softcap)
            key = q_sl.start
            outs[key] = merge(*outs.get(key, (None, None)), o, lse)
        if pending is not None:
            kv = pending.wait()
    keys = sorted(outs)  # every query segment has its diagonal tile, whatever the window
    out = torch.cat([outs[key][0] for key in keys], dim=2)  # type: ignore[misc]  # [b, n, s_r, d]
    lse = torch.cat([outs[key][1] for key in keys], dim=2)  # type: ignore[misc]  # [b, n, s_r]
    return out.to(q.dtype), lse


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ctx: SeqContext,
    scores: Scores,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention backward: ``(dq, dk, dv)`` for this rank's ``q, k, v`` (their dtypes).

    Autocast off, as :func:`ring_forward`; the dK/dV accumulators travel in the accumulation dtype.
    """
    with autocast_off(q):
        return _ring_backward(dout, q, k, v, out, lse, ctx, scores)


def _ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ctx: SeqContext,
    scores: Scores,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p, r, layout = ctx.p, ctx.rank, ctx.layout
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # [b, n, s_r]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])  # [2, b, n_kv, s_r, d]
    own = torch.zeros(kv.shape, dtype=acc, device=q.device)  # this rank's dK/dV contribution
    carried: torch.Tensor | None = None  # dK/dV accumulator of the block in hand (t >= 2)
    for t in range(p):
        src = (r - t) % p
        pending = ring_pass_start(kv, ctx.group, 1, _kv_shape(k, layout, (src - 1) % p)) if t < p - 1 else None
        dkv = own if t == 0 else (carried if carried is not None else torch.zeros_like(kv, dtype=acc))
        for q_sl, k_sl, diag, allowed in doc_tiles(ctx, r, src, scores.causal, scores.window, q.device):
            dq_t, dk_t, dv_t = block_backward(
                dout[:, :, q_sl],
                q[:, :, q_sl],
                kv[0][:, :, k_sl],
                kv[1][:, :, k_sl],
                lse[:, :, q_sl],
                delta[:, :, q_sl],
                diag,
                scores.scale,
                allowed=allowed,
                out=out[:, :, q_sl],
                softcap=scores.softcap,
            )
            dq[:, :, q_sl] += dq_t
            dkv[0][:, :, k_sl] += dk_t
            dkv[1][:, :, k_sl] += dv_t
        if t >= 1:  # pass the accumulator on: to the next holder of block src, or home at t = p-1
            nxt = (src - 1) % p if t < p - 1 else r
            carried = ring_pass_start(dkv, ctx.group, 1, _kv_shape(k, layout, nxt)).wait()
        if pending is not None:
            kv = pending.wait()
    if carried is not None:  # after the last hop: the sum of every other rank's contribution
        own = own + carried
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        fctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: SeqContext,
        scores: Scores,
    ) -> torch.Tensor:
        out, lse = ring_forward(q, k, v, ctx, scores)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.ctx, fctx.scores = ctx, scores
        return out

    @staticmethod
    def backward(fctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = fctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, fctx.ctx, fctx.scores)
        return dq, dk, dv, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: SeqContext, scores: Scores) -> torch.Tensor:
    """Differentiable ring attention on the layout: ``q [b, n, s_r, d], k/v [b, n_kv, s_r, d] -> [b, n, s_r, d]``."""
    return _RingAttention.apply(q, k, v, ctx, scores)


class Ring(Mode):
    """Ring attention (K/V blocks travel), ZeRO-3 weights."""

    name = "ring"

    def attention_infeasible(self, spec: AttnSpec, p: int) -> str | None:
        if spec.n_heads % spec.n_kv_heads:
            return f"ring needs the {spec.n_heads} heads divisible by the {spec.n_kv_heads} kv heads"
        return None

    def attention(self, x: torch.Tensor, w: AttnWeights, spec: AttnSpec, ctx: SeqContext) -> torch.Tensor:
        q, k, v = prepare_heads(
            zero3_project(x, w.q, w.bq, spec.q_rows, ctx, w.adapters.get("q")),  # [b, s_r, h] -> [b, s_r, n*d]
            zero3_project(x, w.k, w.bk, spec.kv_rows, ctx, w.adapters.get("k")),  # -> [b, s_r, n_kv*d]
            zero3_project(x, w.v, w.bv, spec.kv_rows, ctx, w.adapters.get("v")),
            spec,
            ctx.positions(x.device),  # the model's code at the global positions of the local tokens
        )  # -> [b, n, s_r, d], [b, n_kv, s_r, d], [b, n_kv, s_r, d]
        o = merge_heads(ring_attention(q, k, v, ctx, spec.scores()))  # [b, n, s_r, d] -> [b, s_r, n*d]
        return zero3_out(o, w.o_t, w.bo, spec.q_rows, ctx.group, w.adapters.get("o_t"))  # [b, s_r, n*d] -> [b, s_r, h]

    def mlp(self, x: torch.Tensor, w: MlpWeights, spec: MlpSpec, ctx: SeqContext) -> torch.Tensor:
        return zero3_mlp(x, w, spec, ctx.group)
