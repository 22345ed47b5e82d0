"""ZeRO-3 linear layers on the unified layout: the weight is gathered for the matmul and freed.

``ulysses`` and ``ring`` keep whole weights in their compute, which the unified layout makes
compliant by pairing them with ZeRO-3 (DESIGN.md): the 1/p row shard is all-gathered just before the
matmul, not saved for backward, gathered again in backward, and the weight gradient is
reduce-scattered back onto the shard. Three weight collectives per linear per step, independent of
the sequence length (the CPC term of the cost model). Under autocast the weight is gathered in the
compute dtype and its gradient reduce-scattered in the parameter's dtype (see
:mod:`~lightning_paradyse.modes.base`).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_paradyse.distributed.comm import (
    Group,
    all_gather_rows,
    gather_weight,
    group_size,
    reduce_dtype,
    reduce_scatter_rows,
)
from lightning_paradyse.modes.adapters import add_column, add_row, gathered_column, gathered_row
from lightning_paradyse.modes.base import Autocast, add_bias, mlp_hidden
from lightning_paradyse.modes.specs import Adapter, MlpSpec, MlpWeights, row_sizes


class _Zero3Linear(torch.autograd.Function):
    """``x @ W.T`` (or ``x @ W_t``) with the row-sharded weight gathered in forward and again in backward.

    Mixed precision as the plain matmul runs under autocast: the shard is cast to the compute dtype
    *before* the all-gather (the values autocast would use, half the bytes under bf16), the input is
    saved in that dtype, ``dx`` leaves in the input's dtype and the weight gradient is reduce-scattered
    in the shard's dtype (float32 parameters: float32 sums over ranks).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, shard: torch.Tensor, rows: int, transposed: bool, group: Group
    ) -> torch.Tensor:
        dtype = Autocast.current(x).compute_dtype(x, shard)
        sizes = row_sizes(rows, group_size(group))
        w = all_gather_rows(shard.to(dtype), sizes, group)  # [rows/p, k] -> [rows, k], compute dtype
        xc = x.to(dtype)
        ctx.save_for_backward(xc, shard)
        ctx.sizes, ctx.transposed, ctx.group, ctx.x_dtype = sizes, transposed, group, x.dtype
        return xc @ w if transposed else xc @ w.t()  # [.., rows] -> [.., k]  or  [.., k] -> [.., rows]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        xc, shard = ctx.saved_tensors
        w = all_gather_rows(shard.to(xc.dtype), ctx.sizes, ctx.group)  # gathered again: [rows/p, k] -> [rows, k]
        dy = dy.to(xc.dtype)
        x2 = xc.reshape(-1, xc.shape[-1])  # [b, t, in] -> [b*t, in]
        dy2 = dy.reshape(-1, dy.shape[-1])  # [b, t, out] -> [b*t, out]
        if ctx.transposed:  # y = x @ w, w [rows=in, k=out]
            dx = dy @ w.t()
            dw = x2.t() @ dy2  # [in, out]
        else:  # y = x @ w.T, w [rows=out, k=in]
            dx = dy @ w
            dw = dy2.t() @ x2  # [out, in]
        dw = dw.to(reduce_dtype(shard.dtype))  # summed over ranks in float32 where the shard is half precision
        dshard = reduce_scatter_rows(dw, ctx.sizes, ctx.group).to(shard.dtype)  # [rows, k] -> [rows/p, k]
        return dx.to(ctx.x_dtype), dshard, None, None, None


def zero3_linear(
    x: torch.Tensor,
    shard: torch.Tensor,
    rows: int,
    group: Group,
    bias: torch.Tensor | None = None,
    adapter: Adapter | None = None,
) -> torch.Tensor:
    """``x @ W.T + b`` for an ``nn.Linear`` weight ``W [rows, in]`` held as row shards: ``[.., in] -> [.., rows]``.

    ``bias`` (optional) is the bias's row shard, gathered whole and added in the output's dtype; ``adapter`` a LoRA
    adapter whose ``B`` rows are gathered alike, its branch added last (as peft adds it).
    """
    y = x @ shard.t() if group_size(group) == 1 else _Zero3Linear.apply(x, shard, rows, False, group)
    return add_column(add_bias(y, zero3_bias(bias, rows, group)), x, gathered_column(adapter, rows, group))


def zero3_linear_t(x: torch.Tensor, shard_t: torch.Tensor, rows: int, group: Group) -> torch.Tensor:
    """``x @ W_t`` for a transposed weight ``W_t [rows, out]`` held as row shards: ``[.., rows] -> [.., out]``."""
    if group_size(group) == 1:
        return x @ shard_t
    return _Zero3Linear.apply(x, shard_t, rows, True, group)


def zero3_out(
    x: torch.Tensor,
    shard_t: torch.Tensor,
    bias: torch.Tensor | None,
    rows: int,
    group: Group,
    adapter: Adapter | None = None,
) -> torch.Tensor:
    """An output projection (``o``, ``down``) on local tokens: ``x @ W_t + b``, then a LoRA branch with ``A_t``
    gathered whole (``[rows/p, r] -> [rows, r]``): ``[.., rows] -> [.., out]``."""
    y = add_bias(zero3_linear_t(x, shard_t, rows, group), bias)
    return add_row(y, x, gathered_row(adapter, rows, group))


def zero3_bias(b: torch.Tensor | None, rows: int, group: Group) -> torch.Tensor | None:
    """A sharded bias gathered whole (forward all-gather, backward reduce-scatter)."""
    if b is None:
        return None
    return gather_weight(b, row_sizes(rows, group_size(group)), group)


def zero3_mlp(x: torch.Tensor, w: MlpWeights, spec: MlpSpec, group: Group) -> torch.Tensor:
    """The MLP on local tokens with ZeRO-3 weights: ``[b, s_r, h] -> [b, s_r, h]``.

    The intermediate is ``[b, s_r, f]``: full width for this rank's tokens (UlyssesZ / CP+ZeRO).
    """
    ad = w.adapters
    up = zero3_linear(x, w.up, spec.ffn, group, w.b_up, ad.get("up"))  # [b, s_r, h] -> [b, s_r, f]
    gate = None if w.gate is None else zero3_linear(x, w.gate, spec.ffn, group, w.b_gate, ad.get("gate"))
    hidden = mlp_hidden(up, gate, spec)  # [b, s_r, f]
    return zero3_out(hidden, w.down_t, w.b_down, spec.ffn, group, ad.get("down_t"))  # [b, s_r, f] -> [b, s_r, h]
