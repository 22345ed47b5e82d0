"""``ulysses``: DeepSpeed-Ulysses all-to-all attention with ZeRO-3 weights (UlyssesZ).

Attention: project this rank's tokens with the gathered (ZeRO-3) q/k/v weights, one all-to-all
turns ``[b, s_r, heads]`` into ``[b, s, heads/p]`` (q, k and v packed into one message; with fewer
key/value heads than ranks each kv head is sent to every rank whose query heads read it), full
attention over the sequence for ``n/p`` heads, one all-to-all back, output projection with the
gathered weight. MLP: token-wise with gathered weights (the same as ``ring``'s MLP).

Activation traffic ``(s/p)*(2h + 2h_kv)*(p-1)/p`` per pass falls as ``1/p``; the weight gathers cost
``~3*12h^2*(p-1)/p`` per layer and step whatever the length.
"""

from __future__ import annotations

import torch

from lightning_paradyse.distributed.comm import gqa_kv_index, heads_to_seq, seq_to_heads
from lightning_paradyse.distributed.devices import index_on
from lightning_paradyse.modes.attention import full_attention
from lightning_paradyse.modes.base import Mode, heads_infeasible, prepare_heads
from lightning_paradyse.modes.specs import Adapter, AttnSpec, AttnWeights, MlpSpec, MlpWeights, SeqContext
from lightning_paradyse.modes.zero3 import zero3_linear, zero3_mlp, zero3_out


def zero3_project(
    x: torch.Tensor,
    shard: torch.Tensor,
    bias: torch.Tensor | None,
    rows: int,
    ctx: SeqContext,
    adapter: Adapter | None = None,
) -> torch.Tensor:
    """``[b, t, h] -> [b, t, rows]`` with a ZeRO-3 gathered weight, bias and LoRA adapter."""
    return zero3_linear(x, shard, rows, ctx.group, bias, adapter)


class Ulysses(Mode):
    """All-to-all sequence <-> heads attention, ZeRO-3 weights."""

    name = "ulysses"

    def attention_infeasible(self, spec: AttnSpec, p: int) -> str | None:
        return heads_infeasible(spec, p, self.name, splits_heads=False)  # its model code runs on every head

    def attention(self, x: torch.Tensor, w: AttnWeights, spec: AttnSpec, ctx: SeqContext) -> torch.Tensor:
        p, layout, d = ctx.p, ctx.layout, spec.head_dim
        b, s_r, _ = x.shape
        q, k, v = (
            t.transpose(1, 2)  # [b, heads, s_r, d] -> [b, s_r, heads, d]
            for t in prepare_heads(
                zero3_project(x, w.q, w.bq, spec.q_rows, ctx, w.adapters.get("q")),  # [b, s_r, h] -> [b, s_r, n*d]
                zero3_project(x, w.k, w.bk, spec.kv_rows, ctx, w.adapters.get("k")),  # -> [b, s_r, n_kv*d]
                zero3_project(x, w.v, w.bv, spec.kv_rows, ctx, w.adapters.get("v")),
                spec,
                ctx.positions(x.device),  # the model's code on the local tokens, every head, before the all-to-all
            )
        )
        index = gqa_kv_index(spec.n_heads, spec.n_kv_heads, p)
        if index != list(range(spec.n_kv_heads)):  # kv heads replicated to the ranks that read them
            heads = index_on(index, x.device)
            k, v = k.index_select(2, heads), v.index_select(2, heads)  # [b, s_r, p*m, d]
        nq, m = spec.n_heads // p, k.shape[2] // p
        packed = torch.cat(
            [q.reshape(b, s_r, p, nq, d), k.reshape(b, s_r, p, m, d), v.reshape(b, s_r, p, m, d)], dim=3
        ).view(b, s_r, p * (nq + 2 * m), d)  # [b, s_r, p*(n/p + 2m), d], rank j's heads contiguous
        full = seq_to_heads(packed, layout, ctx.group)  # -> [b, s, n/p + 2m, d] (gathered order)
        if not layout.is_natural:
            full = full.index_select(1, layout.natural_index(x.device))  # -> natural order
        full = full.transpose(1, 2)  # [b, s, heads, d] -> [b, heads, s, d]
        qh, kh, vh = full.split([nq, m, m], dim=1)
        o = full_attention(
            qh, kh, vh, spec.causal, ctx.doc_bounds(), spec.scale, spec.window, spec.softcap, ctx.real_lengths
        )
        o = o.transpose(1, 2)  # [b, n/p, s, d] -> [b, s, n/p, d]
        if not layout.is_natural:
            o = o.index_select(1, layout.gathered_positions(x.device))  # -> gathered order
        o = heads_to_seq(o, layout, ctx.group).reshape(b, s_r, spec.q_rows)  # -> [b, s_r, n*d]
        return zero3_out(o, w.o_t, w.bo, spec.q_rows, ctx.group, w.adapters.get("o_t"))  # [b, s_r, n*d] -> [b, s_r, h]

    def mlp(self, x: torch.Tensor, w: MlpWeights, spec: MlpSpec, ctx: SeqContext) -> torch.Tensor:
        return zero3_mlp(x, w, spec, ctx.group)
