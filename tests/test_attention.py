"""The attention kernels against PyTorch's attention with an explicit mask, in float64: windows and documents."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_paradyse.attention import full_attention, in_window


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), allowed)


@pytest.mark.parametrize(("s", "window", "docs"), [(23, 5, None), (23, 1, None), (16, 16, None), (23, 4, (9, 14))])
def test_windowed_attention_matches_an_explicit_mask(s: int, window: int, docs: tuple[int, int] | None) -> None:
    """A causal sliding window (query i sees keys i - window < j <= i), alone and inside packed documents; outputs
    and the gradients of q, k and v."""
    torch.manual_seed(s + window)
    q = torch.randn(2, 6, s, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, s, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    pos = torch.arange(s)
    allowed = in_window(pos, pos, window)
    bounds = None
    if docs is not None:
        bounds = [(0, docs[0]), (docs[0], docs[1]), (docs[1], s)]
        doc = torch.bucketize(pos, torch.tensor(docs), right=True)
        allowed = allowed & (doc[:, None] == doc[None, :])
    want = _reference(q, k, v, allowed)
    got = full_attention(q, k, v, True, bounds, window=window)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(want)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    for g, w in zip(grads, torch.autograd.grad((want * weights).sum(), (q, k, v))):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_in_window_is_huggingface_sliding_window() -> None:
    """Hugging Face's causal sliding window: ``kv_idx > q_idx - sliding_window`` and ``kv_idx <= q_idx``."""
    pos = torch.arange(9)
    mask = in_window(pos, pos, 3)
    expected = torch.tensor([[(j <= i) and (j > i - 3) for j in range(9)] for i in range(9)])
    assert torch.equal(mask, expected)
