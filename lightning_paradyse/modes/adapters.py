"""LoRA branches on the projections the modes compute: ``y + B(A(x)) * scale`` (:class:`~.specs.Adapter`).

A column-parallel projection's branch needs ``A`` whole (every input feature) and the rows of ``B`` the mode computes
(this rank's shard, or all of them gathered); a row-parallel one's needs the rows of ``A`` transposed that match the
input features the mode holds, and ``B`` whole. The branch is computed as peft computes it, ``B(A(x)) * scale``
added to the projection's output, so that each mode's result differs from one process's by rounding only; where the
input features are split over the ranks (``tp_sp``'s output projection) each rank adds its part of the branch to its
partial sum, which the reduction sums.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from lightning_paradyse.distributed.comm import Group, gather_weight, group_size
from lightning_paradyse.modes.specs import Adapter, row_sizes


def add_column(y: torch.Tensor, x: torch.Tensor, adapter: Adapter | None) -> torch.Tensor:
    """``y + B(A(x)) * scale`` with the ``B`` rows of ``y``'s features: ``x [.., h_in]``, ``y [.., n]``."""
    if adapter is None:
        return y
    return y + F.linear(F.linear(x, adapter.a), adapter.b) * adapter.scale  # [.., h_in] -> [.., r] -> [.., n]


def add_row(y: torch.Tensor, x: torch.Tensor, adapter: Adapter | None) -> torch.Tensor:
    """``y + B(x @ A_t) * scale`` with the ``A_t`` rows of ``x``'s features: ``x [.., n_in]``, ``y [.., h]`` (a
    partial sum where ``x`` holds some of the input features)."""
    if adapter is None:
        return y
    return y + F.linear(x @ adapter.a, adapter.b) * adapter.scale  # [.., n_in] -> [.., r] -> [.., h]


def gathered_column(adapter: Adapter | None, rows: int, group: Group) -> Adapter | None:
    """A column projection's adapter with every row of ``B`` (forward all-gather, backward reduce-scatter of its
    gradient onto the shard, as the ZeRO-3 weight's): ``[rows/p, r] -> [rows, r]``."""
    if adapter is None or group_size(group) == 1:
        return adapter
    return dataclasses.replace(adapter, b=gather_weight(adapter.b, row_sizes(rows, group_size(group)), group))


def gathered_row(adapter: Adapter | None, rows: int, group: Group) -> Adapter | None:
    """A row projection's adapter with every row of ``A_t`` gathered: ``[rows/p, r] -> [rows, r]``."""
    if adapter is None or group_size(group) == 1:
        return adapter
    return dataclasses.replace(adapter, a=gather_weight(adapter.a, row_sizes(rows, group_size(group)), group))


def kv_rows_of_heads(adapter: Adapter | None, heads: torch.Tensor, n_kv_heads: int, head_dim: int) -> Adapter | None:
    """A gathered k/v adapter's ``B`` rows of the kv heads ``heads``: ``[n_kv*d, r] -> [m*d, r]`` (as ``tp_sp``
    selects the weight's rows when there are fewer kv heads than ranks)."""
    if adapter is None:
        return None
    b = adapter.b.view(n_kv_heads, head_dim, -1).index_select(0, heads).flatten(0, 1)  # [n_kv, d, r] -> [m*d, r]
    return dataclasses.replace(adapter, b=b)


__all__ = ["add_column", "add_row", "gathered_column", "gathered_row", "kv_rows_of_heads"]
