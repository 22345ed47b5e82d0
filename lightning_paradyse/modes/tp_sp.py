"""``tp_sp``: Megatron tensor parallelism with sequence parallelism (MegatronTS).

Attention: all-gather the sequence, project to this rank's ``n/p`` query heads (and the key/value
heads they read), attend over the whole sequence, project with the row shard of the output weight,
reduce-scatter the partial sums back onto the sequence layout. MLP: all-gather, column shard of
up/gate, activation, row shard of down, reduce-scatter.

No weight moves (except the key/value weights when there are fewer kv heads than ranks: those are
gathered, a small ``2*h*h_kv`` term). Activation traffic is ``4*s*h*(p-1)/p`` elements per op and
step, forward and backward, independent of ``p``: fast on short sequences, and the ``[b, s, h]``
gathered input and ``[b, s, f/p]`` intermediate make it the most memory-hungry mode on long ones.
Under autocast the input is cast to the compute dtype before it is gathered (the values the projections
read anyway); its gradient is reduce-scattered in that dtype, as the plain model sums it in that dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_paradyse.distributed.comm import gather_seq, gather_weight, gqa_kv_index, scatter_seq
from lightning_paradyse.distributed.devices import index_on
from lightning_paradyse.modes.adapters import add_column, add_row, gathered_column, kv_rows_of_heads
from lightning_paradyse.modes.attention import full_attention
from lightning_paradyse.modes.base import (
    Autocast,
    Mode,
    add_bias,
    heads_infeasible,
    merge_heads,
    mlp_hidden,
    prepare_heads,
)
from lightning_paradyse.modes.specs import Adapter, AttnSpec, AttnWeights, MlpSpec, MlpWeights, SeqContext, row_sizes


def _kv_local(
    xg: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    spec: AttnSpec,
    ctx: SeqContext,
    adapter: Adapter | None = None,
) -> torch.Tensor:
    """Keys or values of the kv heads this rank's query heads read: ``[b, s, h] -> [b, s, m*d]``."""
    p = ctx.p
    if spec.n_kv_heads % p == 0:  # the local shard is exactly the kv heads of the local q heads
        return add_column(F.linear(xg, weight, bias), xg, adapter)
    sizes = row_sizes(spec.kv_rows, p)
    full_w = gather_weight(weight, sizes, ctx.group)  # [kv_rows/p, h] -> [kv_rows, h]
    full_b = None if bias is None else gather_weight(bias, sizes, ctx.group)
    index = gqa_kv_index(spec.n_heads, spec.n_kv_heads, p)
    m = len(index) // p
    heads = index_on(index[ctx.rank * m : (ctx.rank + 1) * m], xg.device)
    w = full_w.view(spec.n_kv_heads, spec.head_dim, -1).index_select(0, heads).flatten(0, 1)  # [m*d, h]
    b = None if full_b is None else full_b.view(spec.n_kv_heads, -1).index_select(0, heads).flatten()
    full_adapter = gathered_column(adapter, spec.kv_rows, ctx.group)  # B: [kv_rows/p, r] -> [kv_rows, r]
    return add_column(F.linear(xg, w, b), xg, kv_rows_of_heads(full_adapter, heads, spec.n_kv_heads, spec.head_dim))


class TensorSequenceParallel(Mode):
    """Tensor parallel + sequence parallel (Megatron TP+SP)."""

    name = "tp_sp"

    def attention_infeasible(self, spec: AttnSpec, p: int) -> str | None:
        return heads_infeasible(spec, p, self.name)

    def attention(self, x: torch.Tensor, w: AttnWeights, spec: AttnSpec, ctx: SeqContext) -> torch.Tensor:
        layout = ctx.layout
        x = x.to(Autocast.current(x).compute_dtype(x, w.q))  # what the projections read: gathered at that width
        xg = gather_seq(x, layout, ctx.group)  # [b, s_r, h] -> [b, s, h] (gathered order)
        if not layout.is_natural:
            xg = xg.index_select(1, layout.natural_index(x.device))  # -> natural order
        ad = w.adapters
        q, k, v = prepare_heads(
            add_column(F.linear(xg, w.q, w.bq), xg, ad.get("q")),  # [b, s, h] -> [b, s, n/p*d]
            _kv_local(xg, w.k, w.bk, spec, ctx, ad.get("k")),  # [b, s, m*d]
            _kv_local(xg, w.v, w.bv, spec, ctx, ad.get("v")),
            spec,
            torch.arange(layout.seq_len, device=x.device),
        )  # -> [b, n/p, s, d], [b, m, s, d], [b, m, s, d]
        o = merge_heads(
            full_attention(
                q, k, v, spec.causal, ctx.doc_bounds(), spec.scale, spec.window, spec.softcap, ctx.real_lengths
            )
        )  # [b, n/p, s, d] -> [b, s, n/p*d]
        partial = add_row(o @ w.o_t, o, ad.get("o_t"))  # [b, s, n/p*d] -> [b, s, h], a partial sum over head shards
        if not layout.is_natural:
            partial = partial.index_select(1, layout.gathered_positions(x.device))  # -> gathered order
        y = scatter_seq(partial, layout, ctx.group)  # [b, s, h] -> [b, s_r, h], summed
        return add_bias(y, w.bo)

    def mlp(self, x: torch.Tensor, w: MlpWeights, spec: MlpSpec, ctx: SeqContext) -> torch.Tensor:
        x = x.to(Autocast.current(x).compute_dtype(x, w.up))
        xg = gather_seq(x, ctx.layout, ctx.group)  # [b, s_r, h] -> [b, s, h] (gathered order)
        ad = w.adapters
        up = add_column(F.linear(xg, w.up, w.b_up), xg, ad.get("up"))  # [b, s, h] -> [b, s, f/p]
        gate = add_column(F.linear(xg, w.gate, w.b_gate), xg, ad.get("gate")) if w.gate is not None else None
        hidden = mlp_hidden(up, gate, spec)  # [b, s, f/p]
        partial = add_row(hidden @ w.down_t, hidden, ad.get("down_t"))  # [b, s, f/p] -> [b, s, h], partial sum
        y = scatter_seq(partial, ctx.layout, ctx.group)  # [b, s, h] -> [b, s_r, h]
        return add_bias(y, w.b_down)
