"""ZeRO-3 linear layers on the unified layout: the weight is gathered for the matmul and freed.

``ulysses`` and ``ring`` keep whole weights in their compute, which the unified layout makes
compliant by pairing them with ZeRO-3 (DESIGN.md): the 1/p row shard is all-gathered just before the
matmul, not saved for backward, gathered again in backward, and the weight gradient is
reduce-scattered back onto the shard. Three weight collectives per linear per step, independent of
the sequence length (the CPC term of the cost model).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_paradyse.comm import Group, all_gather_rows, gather_weight, group_size, reduce_scatter_rows
from lightning_paradyse.modes.base import mlp_hidden
from lightning_paradyse.spec import MlpSpec, MlpWeights, row_sizes


class _Zero3Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, shard: torch.Tensor, rows: int, transposed: bool, group: Group
    ) -> torch.Tensor:
        sizes = row_sizes(rows, group_size(group))
        w = all_gather_rows(shard, sizes, group)  # [rows/p, k] -> [rows, k]
        ctx.save_for_backward(x, shard)
        ctx.sizes, ctx.transposed, ctx.group = sizes, transposed, group
        return x @ w if transposed else x @ w.t()  # [.., rows] -> [.., k]  or  [.., k] -> [.., rows]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        x, shard = ctx.saved_tensors
        w = all_gather_rows(shard, ctx.sizes, ctx.group)  # gathered again: [rows/p, k] -> [rows, k]
        x2 = x.reshape(-1, x.shape[-1])  # [b, t, in] -> [b*t, in]
        dy2 = dy.reshape(-1, dy.shape[-1])  # [b, t, out] -> [b*t, out]
        if ctx.transposed:  # y = x @ w, w [rows=in, k=out]
            dx = dy @ w.t()
            dw = x2.t() @ dy2  # [in, out]
        else:  # y = x @ w.T, w [rows=out, k=in]
            dx = dy @ w
            dw = dy2.t() @ x2  # [out, in]
        dshard = reduce_scatter_rows(dw, ctx.sizes, ctx.group)  # [rows, k] -> [rows/p, k]
        return dx, dshard, None, None, None


def zero3_linear(x: torch.Tensor, shard: torch.Tensor, rows: int, group: Group) -> torch.Tensor:
    """``x @ W.T`` for an ``nn.Linear`` weight ``W [rows, in]`` held as row shards: ``[.., in] -> [.., rows]``."""
    if group_size(group) == 1:
        return x @ shard.t()
    return _Zero3Linear.apply(x, shard, rows, False, group)


def zero3_linear_t(x: torch.Tensor, shard_t: torch.Tensor, rows: int, group: Group) -> torch.Tensor:
    """``x @ W_t`` for a transposed weight ``W_t [rows, out]`` held as row shards: ``[.., rows] -> [.., out]``."""
    if group_size(group) == 1:
        return x @ shard_t
    return _Zero3Linear.apply(x, shard_t, rows, True, group)


def zero3_bias(b: torch.Tensor | None, rows: int, group: Group) -> torch.Tensor | None:
    """A sharded bias gathered whole (forward all-gather, backward reduce-scatter)."""
    if b is None:
        return None
    return gather_weight(b, row_sizes(rows, group_size(group)), group)


def zero3_mlp(x: torch.Tensor, w: MlpWeights, spec: MlpSpec, group: Group) -> torch.Tensor:
    """The MLP on local tokens with ZeRO-3 weights: ``[b, s_r, h] -> [b, s_r, h]``.

    The intermediate is ``[b, s_r, f]``: full width for this rank's tokens (UlyssesZ / CP+ZeRO).
    """
    up = zero3_linear(x, w.up, spec.ffn, group)  # [b, s_r, h] -> [b, s_r, f]
    b_up = zero3_bias(w.b_up, spec.ffn, group)
    if b_up is not None:
        up = up + b_up
    gate = None
    if w.gate is not None:
        gate = zero3_linear(x, w.gate, spec.ffn, group)
        b_gate = zero3_bias(w.b_gate, spec.ffn, group)
        if b_gate is not None:
            gate = gate + b_gate
    hidden = mlp_hidden(up, gate, spec)  # [b, s_r, f]
    y = zero3_linear_t(hidden, w.down_t, spec.ffn, group)  # [b, s_r, f] -> [b, s_r, h]
    return y if w.b_down is None else y + w.b_down
