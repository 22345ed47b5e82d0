"""LoRA branches on the modes' projections (``lightning_paradyse.modes.adapters``), against peft's own layer.

A column projection's branch from ``B``'s rows and ``A`` whole, and a row projection's from ``A`` transposed and ``B``
whole, add to the projection what peft's ``lora.Linear`` adds (float64, one process; the modes' multi-rank runs are
``tests/exact`` cases ``lora-*``); the parts of ``B`` a rank holds give the rows of the output it computes, and the
parts of ``A_t`` give partial sums that add up to the whole branch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_paradyse.graph.adapters import lora_parts
from lightning_paradyse.modes.adapters import add_column, add_row, kv_rows_of_heads
from lightning_paradyse.modes.specs import Adapter

peft = pytest.importorskip("peft")


def _lora_linear(n_in: int, n_out: int) -> nn.Module:
    torch.manual_seed(0)
    holder = nn.Sequential(nn.Linear(n_in, n_out, dtype=torch.float64))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False)
    return peft.get_peft_model(holder, config).base_model.model[0].double()


def test_a_column_branch_from_b_rows_and_a_row_branch_from_a_parts_equal_peft() -> None:
    layer = _lora_linear(12, 8)
    parts = lora_parts(layer)
    assert parts is not None and parts.scale == 2.0
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    base = layer.base_layer
    want = layer(x)
    whole = add_column(F.linear(x, base.weight, base.bias), x, Adapter(parts.a, parts.b, parts.scale))
    torch.testing.assert_close(whole, want, rtol=1e-14, atol=1e-14)
    rows = slice(3, 8)  # a rank's rows of the output: B's rows alike
    mine = add_column(F.linear(x, base.weight[rows], base.bias[rows]), x, Adapter(parts.a, parts.b[rows], parts.scale))
    torch.testing.assert_close(mine, want[..., rows], rtol=1e-14, atol=1e-14)
    a_t = parts.a.t()  # a row projection: input features split, each part's branch a partial sum
    halves = [slice(0, 7), slice(7, 12)]
    partial = sum(
        add_row(x[..., h] @ base.weight[:, h].t(), x[..., h], Adapter(a_t[h], parts.b, parts.scale)) for h in halves
    )
    torch.testing.assert_close(partial + base.bias, want, rtol=1e-13, atol=1e-13)
    assert add_column(want, x, None) is want and add_row(want, x, None) is want


def test_the_kv_heads_a_rank_reads_select_b_rows_as_the_weights() -> None:
    b = torch.arange(3 * 2 * 4, dtype=torch.float64).view(6, 4)  # 3 kv heads of width 2, rank 4
    picked = kv_rows_of_heads(Adapter(torch.zeros(4, 5), b, 1.0), torch.tensor([2, 0]), 3, 2)
    assert picked is not None
    assert torch.equal(picked.b, torch.cat([b[4:6], b[0:2]]))
    assert kv_rows_of_heads(None, torch.tensor([0]), 3, 2) is None
