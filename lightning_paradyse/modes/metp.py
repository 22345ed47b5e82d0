"""``metp``: memory-efficient tensor parallelism (Liang et al., FITEE 26(5):770-787, 2025).

The activations stay sequence-sharded, ``[b, s_r, h]``, and the weights stay in their 1/p shards;
instead of gathering either, METP moves *one weight shard at a time* past the local tokens, so no
full-width intermediate ever exists (ParaDySe reference, section 4).

Attention (two-level loop). For head shard ``j = 0..p-1``, rank ``j`` broadcasts its packed shard
``[q_j | k_j | v_j | o_t_j | biases]`` (one flat message, ``4h^2/p`` elements for multi-head
attention); every rank projects its ``s_r`` tokens to the ``n/p`` query heads of group ``j`` and the
key/value heads they read, runs ring attention over the sequence for those heads (the inner loop,
:func:`~lightning_paradyse.modes.ring.ring_forward`) and adds ``out_j @ o_t_j`` into its ``[b, s_r, h]``
output. Only the input and, per group, the attention output and log-sum-exp are saved (``s_r x h``
in all). Backward broadcasts every shard again, recomputes q/k/v from the saved input, runs the
K,V / dK,dV ring and sums each group's weight gradient onto its owner with one reduce. With fewer
key/value heads than ranks the k/v shards are not head-aligned: the (small) k/v weights are
all-gathered once per call, each group picks its kv heads, and their gradient is reduce-scattered.
Weight traffic per rank and step: ``3p`` collectives of ``(p-1)/p`` shards (p broadcasts forward,
p broadcasts and p reduces backward), ``~12h^2 (p-1)/p`` elements whatever the length.

MLP (weight ring). The packed shard ``[up | gate | down_t | b_up | b_gate]`` circulates on a
point-to-point ring: at step ``t`` rank ``r`` holds owner ``(r - t) % p``'s shard, adds
``act(x @ up^T) @ down_t`` to its output while the shard travels on (``p - 1`` hops, overlapped).
The intermediate is ``[b, s_r, f_j]``, never ``[b, s_r, f]``; only the input is saved. Backward
circulates the weights again and carries each shard's gradient accumulator one hop behind them, as
ring attention carries dK/dV: the accumulator of shard ``j`` starts at rank ``j + 1`` and reaches its
owner after ``p - 1`` hops. Weight traffic: ``3 (p-1)`` shard transfers per rank and step.

Every buffer that is sent or received is fresh (a ``torch.cat`` or a new receive buffer), so a
collective never writes into a parameter's storage (pitfall 2 of the reference), and every
transfer carries a whole shard (pitfall 3).

Mixed precision (see :mod:`~lightning_paradyse.modes.base`): the input and the travelling weight shards
are cast to the compute dtype once (the values autocast would give the matmuls; under bf16 half the
weight bytes), the per-group outputs are summed in float32 and returned in the compute dtype, the weight
gradients are packed, reduced and ring-carried in the parameters' dtype, and the backward replays the
forward's autocast so that its recomputed q/k/v and MLP steps are the forward's, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from lightning_paradyse.distributed.comm import (
    all_gather_rows,
    broadcast_from,
    gqa_kv_index,
    reduce_dtype,
    reduce_scatter_rows,
    reduce_to,
    ring_pass_start,
)
from lightning_paradyse.distributed.devices import index_on
from lightning_paradyse.modes.base import (
    Autocast,
    Mode,
    accumulation_dtype,
    add_bias,
    heads_infeasible,
    merge_heads,
    mlp_hidden,
    prepare_heads,
    split_heads,
)
from lightning_paradyse.modes.ring import ring_backward, ring_forward
from lightning_paradyse.modes.specs import AttnSpec, AttnWeights, MlpSpec, MlpWeights, SeqContext, row_sizes

Parts = dict[str, torch.Tensor]
"""Named weight pieces in packing order."""
Shapes = dict[str, tuple[int, ...]]

_ATTN_ARGS = ("q", "k", "v", "o_t", "bq", "bk", "bv")
"""The weight arguments of the attention Function, in order."""
_MLP_ARGS = ("up", "gate", "down_t", "b_up", "b_gate")
"""The weight arguments of the MLP Function, in order; also the packing order of an MLP shard."""


def _present(named: dict[str, torch.Tensor | None]) -> Parts:
    return {name: t for name, t in named.items() if t is not None}


def _pack(parts: Parts, dtype: torch.dtype) -> torch.Tensor:
    """One fresh flat buffer (never a parameter's storage) of ``dtype``: ``{name: [..]} -> [sum of numels]``."""
    return torch.cat([t.reshape(-1).to(dtype) for t in parts.values()])


def _unpack(flat: torch.Tensor, shapes: Shapes) -> Parts:
    """Views into ``flat``: ``[sum of numels] -> {name: shape}``."""
    pieces = flat.split([math.prod(s) for s in shapes.values()])
    return {name: piece.view(shape) for (name, shape), piece in zip(shapes.items(), pieces)}


def _shapes(parts: Parts) -> Shapes:
    return {name: tuple(t.shape) for name, t in parts.items()}


def _leaves(parts: Parts) -> Parts:
    """Detached aliases that require grad: the leaves of a local recomputation graph."""
    return {name: t.detach().requires_grad_() for name, t in parts.items()}


# --------------------------------------------------------------------------------------------------
# Attention: broadcast one head shard at a time, ring attention inside the group
# --------------------------------------------------------------------------------------------------


def _kv_aligned(spec: AttnSpec, p: int) -> bool:
    """Whether the k/v row shards are exactly the kv heads of the local query heads."""
    return spec.n_kv_heads % p == 0


def _broadcast_parts(w: AttnWeights, aligned: bool) -> Parts:
    """The pieces of this rank's packed broadcast shard (k/v only when head-aligned)."""
    if not aligned:
        return _present({"q": w.q, "o_t": w.o_t, "bq": w.bq})
    return _present({"q": w.q, "k": w.k, "v": w.v, "o_t": w.o_t, "bq": w.bq, "bk": w.bk, "bv": w.bv})


def _kv_columns(w: AttnWeights) -> Parts:
    """k/v weights and biases as column blocks of one ``[kv_rows/p, 2h (+2)]`` matrix."""
    return _present(
        {
            "k": w.k,
            "bk": None if w.bk is None else w.bk.unsqueeze(1),
            "v": w.v,
            "bv": None if w.bv is None else w.bv.unsqueeze(1),
        }
    )


def _gather_kv(w: AttnWeights, spec: AttnSpec, ctx: SeqContext, dtype: torch.dtype) -> torch.Tensor:
    """All k/v weights of the op in ``dtype``: ``[kv_rows/p, cols] -> [kv_rows, cols]`` (uneven rows allowed)."""
    packed = torch.cat([t.to(dtype) for t in _kv_columns(w).values()], dim=1)  # [kv_rows/p, cols], fresh
    return all_gather_rows(packed, row_sizes(spec.kv_rows, ctx.p), ctx.group)


def _kv_of_group(kv_full: torch.Tensor, widths: list[int], names: list[str], j: int, spec: AttnSpec, p: int) -> Parts:
    """The k/v weights of the kv heads group ``j``'s query heads read (differentiable)."""
    index = gqa_kv_index(spec.n_heads, spec.n_kv_heads, p)
    m = len(index) // p
    heads = index_on(index[j * m : (j + 1) * m], kv_full.device)
    rows = kv_full.view(spec.n_kv_heads, spec.head_dim, -1).index_select(0, heads)  # -> [m, d, cols]
    cols = rows.flatten(0, 1).split(widths, dim=1)  # [m*d, cols] -> pieces [m*d, width]
    return {n: c.squeeze(1) if n.startswith("b") else c for n, c in zip(names, cols)}


def _project(
    x: torch.Tensor, g: Parts, spec: AttnSpec, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys, values of one head shard for the local tokens, rotated at global positions."""
    return prepare_heads(
        F.linear(x, g["q"], g.get("bq")),  # [b, s_r, h] -> [b, s_r, n/p*d]
        F.linear(x, g["k"], g.get("bk")),  # [b, s_r, h] -> [b, s_r, m*d]
        F.linear(x, g["v"], g.get("bv")),
        spec,
        positions,
    )  # -> [b, n/p, s_r, d], [b, m, s_r, d], [b, m, s_r, d]


class _Groups:
    """Per-call helper: the head shards' weights as each one is broadcast, in group order."""

    def __init__(self, w: AttnWeights, spec: AttnSpec, ctx: SeqContext, x: torch.Tensor) -> None:
        self.spec, self.ctx = spec, ctx
        self.dtype = x.dtype
        """The compute dtype (of the input, already cast): the broadcast shards travel in it."""
        self.param_dtype = w.q.dtype
        """The parameters' dtype: weight gradients are packed and reduced in it."""
        self.positions = ctx.positions(x.device)  # [s_r] global positions of the local tokens
        self.own = _broadcast_parts(w, _kv_aligned(spec, ctx.p))
        self.shapes = _shapes(self.own)  # equal on every rank: n and the kv shards split evenly
        self.flat = _pack(self.own, self.dtype)  # [numel], fresh
        self.kv_full = None if _kv_aligned(spec, ctx.p) else _gather_kv(w, spec, ctx, self.dtype)  # [kv_rows, cols]
        kv_cols = _kv_columns(w)
        self.kv_names, self.kv_widths = list(kv_cols), [t.shape[1] for t in kv_cols.values()]

    def receive(self, j: int) -> Parts:
        """Group ``j``'s broadcast shard on every rank: ``[numel]`` from rank ``j`` -> named views."""
        return _unpack(broadcast_from(self.flat, j, self.ctx.group, self.flat.shape), self.shapes)

    def kv(self, j: int, kv_full: torch.Tensor) -> Parts:
        return _kv_of_group(kv_full, self.kv_widths, self.kv_names, j, self.spec, self.ctx.p)


def _group_backward(
    x: torch.Tensor, dy: torch.Tensor, groups: _Groups, j: int, bc: Parts, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Any, tuple[torch.Tensor | None, ...]]:
    """``(dx_j, packed dW_j of the broadcast shard, d kv_full or None, d prepare_params)`` for head shard ``j``."""
    spec, ctx = groups.spec, groups.ctx
    with torch.enable_grad():
        leaves = _leaves({n: t for n, t in bc.items() if n != "o_t"})
        kv_full = None if groups.kv_full is None else groups.kv_full.detach().requires_grad_()
        xl = x.detach().requires_grad_()
        g = leaves if kv_full is None else {**leaves, **groups.kv(j, kv_full)}
        q, k, v = _project(xl, g, spec, groups.positions)
    o_t = bc["o_t"]
    dout = split_heads(dy @ o_t.t(), spec.head_dim)  # [b, s_r, h] -> [b, s_r, n/p*d] -> [b, n/p, s_r, d]
    d_o_t = merge_heads(out).flatten(0, 1).t() @ dy.flatten(0, 1)  # [n/p*d, b*s_r] @ [b*s_r, h]
    dq, dk, dv = ring_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, ctx, spec.scores())
    inputs = [xl, *leaves.values(), *([] if kv_full is None else [kv_full])]
    extra = list(spec.prepare_params)  # the model's own parameters between projections and attention (q/k norms)
    grads = torch.autograd.grad((q, k, v), inputs + extra, (dq, dk, dv), allow_unused=True)
    grads, d_extra = grads[: len(inputs)], tuple(grads[len(inputs) :])
    named = dict(zip(leaves, grads[1 : 1 + len(leaves)]))
    packed = _pack({n: d_o_t if n == "o_t" else named[n] for n in bc}, groups.param_dtype)  # shard order
    return grads[0], packed, None if kv_full is None else grads[-1], d_extra


class _MetpAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, spec: AttnSpec, ctx: SeqContext, *weights: Any) -> torch.Tensor:
        amp = Autocast.current(x)
        fctx.amp, fctx.x_dtype = amp, x.dtype
        x = x.to(amp.compute_dtype(x, weights[0]))  # what every projection reads (and what is saved)
        weights = weights[: len(_ATTN_ARGS)]  # then spec.prepare_params, read through spec.prepare
        groups = _Groups(AttnWeights(*weights), spec, ctx, x)
        b, s_r, _ = x.shape
        y = x.new_zeros((b, s_r, weights[3].shape[1]), dtype=accumulation_dtype(x.dtype))  # [b, s_r, h]
        saved: list[torch.Tensor] = []
        for j in range(ctx.p):
            g = groups.receive(j)
            if groups.kv_full is not None:
                g.update(groups.kv(j, groups.kv_full))
            q, k, v = _project(x, g, spec, groups.positions)
            out, lse = ring_forward(q, k, v, ctx, spec.scores())  # [b, n/p, s_r, d], lse
            y += merge_heads(out) @ g["o_t"]  # [b, n/p, s_r, d] -> [b, s_r, n/p*d] -> [b, s_r, h]
            saved += [out, lse]
        fctx.save_for_backward(x, *weights, *saved)
        fctx.spec, fctx.ctx = spec, ctx
        return y.to(x.dtype)  # the summed head shards, in the compute dtype like a plain projection's output

    @staticmethod
    def backward(fctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, *rest = fctx.saved_tensors  # read once (checkpointed recomputation allows no second read)
        weights, saved = rest[: len(_ATTN_ARGS)], rest[len(_ATTN_ARGS) :]
        with fctx.amp.replay():  # the recomputed projections are the forward's
            dx, grads, d_extra = _attention_backward(fctx, dy, x, weights, saved)
        named = (grads.get(n) if w is not None else None for n, w in zip(_ATTN_ARGS, weights))
        return (dx, None, None, *named, *d_extra)


def _attention_backward(
    fctx: Any, dy: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor], saved: list[torch.Tensor]
) -> tuple[torch.Tensor, Parts, tuple[torch.Tensor | None, ...]]:
    """``(dx in the input's dtype, {name: gradient of this rank's shard}, gradients of spec.prepare_params from
    this rank's tokens)`` of :class:`_MetpAttention`.

    ``x`` is the saved input (compute dtype), ``saved`` every head shard's ``out, lse``.
    """
    ctx: SeqContext = fctx.ctx
    groups = _Groups(AttnWeights(*weights), fctx.spec, ctx, x)
    dy = dy.to(x.dtype)
    dx = torch.zeros_like(x, dtype=accumulation_dtype(x.dtype))
    d_kv = None if groups.kv_full is None else torch.zeros_like(groups.kv_full, dtype=groups.param_dtype)
    mine: torch.Tensor | None = None  # the summed gradient of this rank's own shard
    d_extra: list[torch.Tensor | None] = [None] * len(fctx.spec.prepare_params)
    for j in range(ctx.p):
        bc = groups.receive(j)
        dx_j, packed, d_kv_j, d_extra_j = _group_backward(x, dy, groups, j, bc, saved[2 * j], saved[2 * j + 1])
        d_extra = [a if b is None else b if a is None else a + b for a, b in zip(d_extra, d_extra_j)]
        dx += dx_j
        if d_kv is not None:
            d_kv += d_kv_j
        total = reduce_to(packed.to(reduce_dtype(packed.dtype)), j, ctx.group).to(packed.dtype)  # [numel] onto j
        if j == ctx.rank:
            mine = total
    assert mine is not None
    grads = _unpack(mine, groups.shapes)
    if d_kv is not None:  # [kv_rows, cols] -> [kv_rows/p, cols], this rank's rows
        wide = d_kv.to(reduce_dtype(d_kv.dtype))  # summed in float32 where the parameters are half precision
        local = reduce_scatter_rows(wide, row_sizes(fctx.spec.kv_rows, ctx.p), ctx.group).to(d_kv.dtype)
        cols = local.split(groups.kv_widths, dim=1)
        grads.update({n: c.squeeze(1) if n.startswith("b") else c for n, c in zip(groups.kv_names, cols)})
    return dx.to(fctx.x_dtype), grads, tuple(d_extra)


# --------------------------------------------------------------------------------------------------
# MLP: the packed shard travels on a ring, its gradient one hop behind
# --------------------------------------------------------------------------------------------------


def _mlp_shapes(names: list[str], rows: int, h: int) -> Shapes:
    return {n: (rows,) if n.startswith("b_") else (rows, h) for n in names}


def _mlp_numel(names: list[str], rows: int, h: int) -> int:
    """Elements of a packed shard of ``rows`` hidden units: ``h`` per matrix and 1 per bias, each."""
    return rows * sum(1 if n.startswith("b_") else h for n in names)


def _weight_ring(
    flat: torch.Tensor, names: list[str], h: int, spec: MlpSpec, ctx: SeqContext
) -> Iterator[tuple[int, int, Parts]]:
    """Yield ``(t, owner, owner's shard)`` for ``t = 0..p-1``, sending the shard on while it is used."""
    p, r = ctx.p, ctx.rank
    rows = row_sizes(spec.ffn, p)
    for t in range(p):
        src = (r - t) % p
        pending = None
        if t < p - 1:  # [numel of shard src] -> rank r+1; receive shard src-1 from rank r-1
            numel = _mlp_numel(names, rows[(src - 1) % p], h)
            pending = ring_pass_start(flat, ctx.group, 1, (numel,))
        yield t, src, _unpack(flat, _mlp_shapes(names, rows[src], h))
        if pending is not None:
            flat = pending.wait()


def _mlp_step(x: torch.Tensor, w: Parts, spec: MlpSpec) -> torch.Tensor:
    """One shard's contribution: ``[b, s_r, h] -> [b, s_r, f_j] -> [b, s_r, h]``."""
    up = F.linear(x, w["up"], w.get("b_up"))  # [b, s_r, h] -> [b, s_r, f_j]
    gate = F.linear(x, w["gate"], w.get("b_gate")) if "gate" in w else None
    return mlp_hidden(up, gate, spec) @ w["down_t"]  # [b, s_r, f_j] -> [b, s_r, h]


def _mlp_step_backward(
    x: torch.Tensor, dy: torch.Tensor, w: Parts, spec: MlpSpec, param_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recompute one step locally: ``(dx_t, packed dW of the shard in hand, in param_dtype)``."""
    with torch.enable_grad():
        xl, leaves = x.detach().requires_grad_(), _leaves(w)
        y = _mlp_step(xl, leaves, spec)
    grads = torch.autograd.grad(y, [xl, *leaves.values()], dy)
    return grads[0], _pack(dict(zip(leaves, grads[1:])), param_dtype)  # [numel of the shard], fresh


class _MetpMlp(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, spec: MlpSpec, ctx: SeqContext, *weights: Any) -> torch.Tensor:
        amp = Autocast.current(x)
        fctx.amp, fctx.x_dtype = amp, x.dtype
        own = _present(dict(zip(_MLP_ARGS, weights)))
        x = x.to(amp.compute_dtype(x, own["up"]))  # what every step reads (and what is saved)
        h = own["down_t"].shape[1]
        y = x.new_zeros((*x.shape[:2], h), dtype=accumulation_dtype(x.dtype))  # [b, s_r, h]
        for _, _, shard in _weight_ring(_pack(own, x.dtype), list(own), h, spec, ctx):  # shards in compute dtype
            y += _mlp_step(x, shard, spec)
        fctx.save_for_backward(x, *weights)
        fctx.spec, fctx.ctx = spec, ctx
        return y.to(x.dtype)

    @staticmethod
    def backward(fctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, *weights = fctx.saved_tensors  # read once (checkpointed recomputation allows no second read)
        with fctx.amp.replay():  # the recomputed steps are the forward's
            dx, grads = _mlp_backward(fctx, dy, x, weights)
        return (dx, None, None, *(grads.get(n) if w is not None else None for n, w in zip(_MLP_ARGS, weights)))


def _mlp_backward(
    fctx: Any, dy: torch.Tensor, x: torch.Tensor, weights: list[torch.Tensor]
) -> tuple[torch.Tensor, Parts]:
    """``(dx in the input's dtype, {name: gradient of this rank's shard})`` of :class:`_MetpMlp`.

    ``x`` is the saved input (compute dtype). The weights circulate in the compute dtype, the gradient
    accumulators in the parameters' dtype (float32 for half-precision parameters: :func:`~.comm.reduce_dtype`).
    """
    spec, ctx = fctx.spec, fctx.ctx
    own = _present(dict(zip(_MLP_ARGS, weights)))
    h, rows, param_dtype = own["down_t"].shape[1], row_sizes(spec.ffn, ctx.p), own["up"].dtype
    acc_dtype = reduce_dtype(param_dtype) if ctx.p > 1 else param_dtype
    dy = dy.to(x.dtype)
    dx = torch.zeros_like(x, dtype=accumulation_dtype(x.dtype))
    home = carried = None
    for t, src, shard in _weight_ring(_pack(own, x.dtype), list(own), h, spec, ctx):
        dx_t, dw = _mlp_step_backward(x, dy, shard, spec, acc_dtype)
        dx += dx_t
        if t == 0:  # this rank's own shard: its contribution stays home
            home = dw
            continue
        acc = dw if carried is None else carried + dw  # accumulator of shard src, fresh
        numel = _mlp_numel(list(own), rows[(src - 1) % ctx.p], h)  # shard src-1 arrives from r-1
        carried = ring_pass_start(acc, ctx.group, 1, (numel,)).wait()  # -> rank r+1 (home at t=p-1)
    assert home is not None
    total = home if carried is None else home + carried
    return dx.to(fctx.x_dtype), _unpack(total.to(param_dtype), _shapes(own))


class MemoryEfficientTensorParallel(Mode):
    """Weight shards travel (broadcast per head shard, ring for the MLP); no full-width intermediate."""

    name = "metp"

    def attention_infeasible(self, spec: AttnSpec, p: int) -> str | None:
        if spec.adapted:
            return "metp does not add LoRA branches to the projections it computes in its weight ring yet"
        return heads_infeasible(spec, p, self.name)

    def mlp_infeasible(self, spec: MlpSpec, p: int) -> str | None:
        if spec.adapted:
            return "metp does not add LoRA branches to the projections it computes in its weight ring yet"
        return None

    def attention(self, x: torch.Tensor, w: AttnWeights, spec: AttnSpec, ctx: SeqContext) -> torch.Tensor:
        reason = self.attention_infeasible(spec, ctx.p)
        if reason is not None:
            raise ValueError(reason)
        weights = (w.q, w.k, w.v, w.o_t, w.bq, w.bk, w.bv, *spec.prepare_params)
        y = _MetpAttention.apply(x, spec, ctx, *weights)  # [b, s_r, h]
        return add_bias(y, w.bo)

    def mlp(self, x: torch.Tensor, w: MlpWeights, spec: MlpSpec, ctx: SeqContext) -> torch.Tensor:
        y = _MetpMlp.apply(x, spec, ctx, w.up, w.gate, w.down_t, w.b_up, w.b_gate)  # [b, s_r, h]
        return add_bias(y, w.b_down)
