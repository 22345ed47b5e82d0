"""The attention kernels against PyTorch's attention with an explicit mask, in float64: windows and documents."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_paradyse.modes.attention import block_backward, block_forward, full_attention, in_window, merge


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


def _capped_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, cap: float) -> Any:
    """Hugging Face's eager attention with soft-capping: ``cap * tanh(q k / sqrt(d) / cap)``, mask, softmax, ``@ v``."""
    g = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.repeat_interleave(g, 1)


@pytest.mark.parametrize(("window", "causal"), [(None, True), (5, True), (None, False)])
def test_soft_capped_attention_in_every_kernel(window: int | None, causal: bool) -> None:
    """Logit soft-capping (Gemma 2) in the whole-sequence kernel and in ring tiles (forward, and the backward's
    recurrences through ``1 - tanh^2``) against autograd of the explicit formula, in float64."""
    torch.manual_seed(3)
    s, cap = 12, 0.7  # a small cap: tanh far from linear
    q = torch.randn(1, 4, s, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, s, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    pos = torch.arange(s)
    allowed = in_window(pos, pos, window) if window else (pos[:, None] >= pos[None, :]) | (not causal)
    want = _capped_reference(q, k, v, allowed, cap)
    weights = torch.randn_like(want)
    expected = torch.autograd.grad((want * weights).sum(), (q, k, v))
    got = full_attention(q, k, v, causal, window=window, softcap=cap)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(torch.autograd.grad((got * weights).sum(), (q, k, v)), expected):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # two key tiles, merged, as ring attention runs them
        half = s // 2
        parts = [
            block_forward(q, k[:, :, a:b], v[:, :, a:b], False, allowed=allowed[:, a:b], softcap=cap)
            for a, b in ((0, half), (half, s))
        ]
        out, lse = merge(*parts[0], *parts[1])
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        delta = (weights * out).sum(-1)
        grads = [
            block_backward(weights, q, k[:, :, a:b], v[:, :, a:b], lse, delta, False, None, allowed[:, a:b], None, cap)
            for a, b in ((0, half), (half, s))
        ]
    torch.testing.assert_close(grads[0][0] + grads[1][0], expected[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 2), expected[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 2), expected[2], rtol=1e-10, atol=1e-12)


def test_padded_rows_attend_their_real_keys_as_a_masked_run() -> None:
    """Right padding (``real_lengths``): every query, padding's included, sees the causal keys that are real, as
    attention given the mask computes it; a row without padding is the causal attention's."""
    torch.manual_seed(3)
    s, lengths = 11, (7, 11, 1)
    q = torch.randn(3, 4, s, 8, dtype=torch.float64)
    k, v = (torch.randn(3, 2, s, 8, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(s)
    real = pos[None, :] < torch.tensor(lengths)[:, None]  # [b, s]
    allowed = (pos[:, None] >= pos[None, :])[None] & real[:, None, :]  # [b, s, s]: causal and a real key
    want = _reference(q, k, v, allowed[:, None])
    got = full_attention(q, k, v, True, [(0, s)], real_lengths=lengths)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(full_attention(q, k, v, True)[0, :, 7:], want[0, :, 7:])  # what the padding changes


@pytest.mark.parametrize("kind", ["bidirectional", "window", "softcap", "documents"])
def test_padded_rows_are_refused_where_the_kernel_cannot_mask_them(kind: str) -> None:
    q = k = v = torch.zeros(1, 2, 6, 4)
    causal = kind != "bidirectional"
    bounds = [(0, 3), (3, 6)] if kind == "documents" else None
    with pytest.raises(ValueError, match="batches without padding"):
        full_attention(
            q,
            k,
            v,
            causal,
            bounds,
            window=2 if kind == "window" else None,
            softcap=5.0 if kind == "softcap" else None,
            real_lengths=(4,),
        )


def test_a_window_as_long_as_the_batch_takes_padded_rows() -> None:
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    windowed = full_attention(q, k, v, True, window=6, real_lengths=(4, 6))
    torch.testing.assert_close(windowed, full_attention(q, k, v, True, real_lengths=(4, 6)), rtol=0, atol=0)
