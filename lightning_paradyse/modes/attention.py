"""Attention kernels shared by the modes.

* :func:`full_attention`: attention over a whole sequence in natural order (``tp_sp``, ``ulysses``),
  through ``torch.nn.functional.scaled_dot_product_attention`` so that autograd and the fastest
  backend of the device apply.
* :func:`block_forward` / :func:`block_backward`: one (query block, key block) tile returning the
  output and the log-sum-exp, and its backward (the flash-attention recurrences), used by ring
  attention. They compute in float32 (float64 stays float64) whatever the input dtype. On CPU, tiles
  without a document mask run PyTorch's fused flash kernel, which returns the log-sum-exp and never
  holds a score tile (:func:`fused_tiles`); otherwise the scores are materialised explicitly.
* :func:`in_window`: the causal sliding window (Hugging Face's ``sliding_window``: a query attends the ``window``
  most recent keys, itself included); :func:`full_attention` runs windowed layers by query chunks of the window's
  size against only the keys they can see, ring attention skips tiles outside the window and masks the rest.
* :class:`Scores`: how one layer forms its scores (causal, scale, window, logit soft-capping), one value handed
  from the op's spec to every kernel; soft-capping (Gemma 2: ``cap * tanh(scores / cap)``) runs the explicit
  score path (no fused kernel computes it).
* :func:`merge`: the numerically stable online-softmax merge of two partial results,
  ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.
  It never exponentiates a raw log-sum-exp, so large logits cannot overflow.

Tensors are ``[b, n, t, d]`` (heads before tokens). Grouped-query attention is handled by viewing the
query heads as ``[b, n_kv, g, t, d]``: no key/value copy is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Scores:
    """How one attention layer forms and masks its scores."""

    causal: bool
    """Keys after the query are masked (decoder) or not (encoder)."""
    scale: float | None = None
    """The factor on ``q . k``; ``None``: ``1/sqrt(d)``."""
    window: int | None = None
    """A causal sliding window (:func:`in_window`), ``None``: none."""
    softcap: float | None = None
    """Logit soft-capping: scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2)."""


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def in_window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``[tq, tk]`` True where key position ``k_pos`` is in the causal window of query position ``q_pos``:
    ``0 <= q - k < window`` (Hugging Face's ``sliding_window``)."""
    diff = q_pos[:, None] - k_pos[None, :]  # [tq, tk]
    return (diff >= 0) & (diff < window)


def full_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    bounds: list[tuple[int, int]] | None = None,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    real_lengths: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Softmax attention, natural token order: ``q [b, n, s, d], k/v [b, n_kv, s, d] -> [b, n, s, d]``.

    ``bounds`` are the ``(start, stop)`` token spans of packed documents: each document attends only
    to itself (one attention call per document, exact and without an ``s x s`` mask). ``scale``: the
    scores' factor (``None``: ``1/sqrt(d)``). ``window``: a causal sliding window (:func:`in_window`).
    ``softcap``: logit soft-capping (:class:`Scores`), computed explicitly per document. ``real_lengths``: each
    row's real tokens, the rest right padding whose queries attend the real keys alone (:func:`_padded_queries`).
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)  # [b, n_kv, s, d] -> [b, n, s, d]
        v = v.repeat_interleave(group, dim=1)
    if real_lengths is not None and any(n < q.shape[2] for n in real_lengths):
        windowed = window is not None and window < q.shape[2]  # a window as long as the batch changes nothing
        if not causal or (bounds is not None and len(bounds) > 1) or windowed or softcap is not None:
            raise ValueError(
                "padded rows are predicted exactly by causal attention without packed documents, a sliding window "
                "or logit soft-capping: give trainer.predict batches without padding (rows of one length, or one row)"
            )
        out = full_attention(q, k, v, causal, scale=scale)  # the real queries' rows, as causal attention makes them
        return _padded_queries(out, q, k, v, real_lengths, scale)
    spans = bounds if bounds is not None else [(0, q.shape[2])]
    if softcap is not None:
        scores = Scores(causal, scale, window, softcap)
        outs = [_capped_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scores) for a, b in spans]
        return torch.cat(outs, dim=2)  # per-document [b, n, len, d] -> [b, n, s, d]
    if len(spans) == 1 and (window is None or q.shape[2] <= window):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    outs = [_span_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal, scale, window) for a, b in spans]
    return torch.cat(outs, dim=2)  # per-document [b, n, len, d] -> [b, n, s, d]


def _padded_queries(
    out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...], scale: float | None
) -> torch.Tensor:
    """``out`` with each row's padding queries (from its ``lengths[r]``-th token on) attending its real keys alone,
    as a causal run given the attention mask computes them (every real key precedes them: no causal mask)."""
    s = q.shape[2]
    rows = []
    for r, n in enumerate(lengths):
        row = out[r : r + 1]  # [1, n_heads, s, d]
        if n < s:
            padded = F.scaled_dot_product_attention(  # the padded queries against the real keys alone
                q[r : r + 1, :, n:], k[r : r + 1, :, :n], v[r : r + 1, :, :n], scale=scale
            )  # [1, heads, s - n, d]
            row = torch.cat([row[:, :, :n], padded], dim=2)  # [1, heads, n, d] + [1, heads, s - n, d]
        rows.append(row)
    return torch.cat(rows)  # [1, heads, s, d] per row -> [b, heads, s, d]


def _span_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None, window: int | None
) -> torch.Tensor:
    """One document's attention; with a window shorter than it, by query chunks of the window's size, each
    against the ``< 2 * window`` keys it can see (a band mask, never an ``s x s`` one)."""
    s = q.shape[2]
    if window is None or s <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if not causal:
        raise ValueError("a sliding window is supported on causal attention")
    outs = []
    positions = torch.arange(s, device=q.device)
    for c0 in range(0, s, window):
        c1, k0 = min(c0 + window, s), max(0, c0 - window + 1)
        mask = in_window(positions[c0:c1], positions[k0:c1], window)  # [c, keys]
        outs.append(F.scaled_dot_product_attention(q[:, :, c0:c1], k[:, :, k0:c1], v[:, :, k0:c1], mask, scale=scale))
    return torch.cat(outs, dim=2)  # chunks [b, n, c, d] -> [b, n, s, d]


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores: Scores) -> torch.Tensor:
    """One document's attention with soft-capped logits, scores explicit (``[b, n, t, t]``; autograd backward)."""
    t = q.shape[2]
    scale = scores.scale if scores.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    positions = torch.arange(t, device=q.device)
    allowed = in_window(positions, positions, scores.window) if scores.window is not None else None
    s = _scores(q, k, scale, scores.causal, allowed, scores.softcap)  # [b, n_kv, g, t, t]
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v.to(s.dtype))  # [b, n_kv, g, t, d]
    return out.reshape(q.shape).to(q.dtype)


def _grouped(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    b, n, t, d = q.shape
    return q.reshape(b, n_kv, n // n_kv, t, d)  # [b, n, t, d] -> [b, n_kv, g, t, d]


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    causal: bool,
    allowed: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    acc = _acc_dtype(q.dtype)
    qg = _grouped(q.to(acc), k.shape[1])  # [b, n_kv, g, tq, d]
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.to(acc)) * scale  # [b, n_kv, g, tq, tk]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    tq, tk = s.shape[-2], s.shape[-1]
    blocked = torch.ones(tq, tk, dtype=torch.bool, device=s.device).triu(1) if causal else None  # future keys
    if allowed is not None:  # [tq, tk] True where query and key are in the same document
        blocked = ~allowed if blocked is None else blocked | ~allowed
    return s if blocked is None else s.masked_fill(blocked, float("-inf"))


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    allowed: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention tile: ``(out [b, n, tq, d], lse [b, n, tq])`` in the accumulation dtype.

    ``causal`` masks key ``j > i`` inside the tile: use it only when the query and key blocks are the
    same tokens (the diagonal tile). Tiles entirely in the past are called with ``causal=False``;
    tiles entirely in the future must not be called at all. ``allowed [tq, tk]`` restricts attention to
    pairs in the same packed document; a row with no allowed key gets ``lse = -inf`` and output 0.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if softcap is None and _fusable(q, k, allowed):
        return _fused_forward(q, k, v, causal, scale)
    s = _scores(q, k, scale, causal, allowed, softcap)  # [b, n_kv, g, tq, tk]
    lse = torch.logsumexp(s, dim=-1)  # [b, n_kv, g, tq]
    p = torch.exp(s - _finite(lse).unsqueeze(-1))  # masked rows: exp(-inf) = 0
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v.to(s.dtype))  # [b, n_kv, g, tq, d]
    b, n, tq, d = q.shape
    return out.reshape(b, n, tq, d), lse.reshape(b, n, tq)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    allowed: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one tile given the *final* ``lse`` and ``delta = rowsum(dout * out)``.

    ``dout [b, n, tq, d]``, ``lse``/``delta [b, n, tq]``. Returns ``dq [b, n, tq, d]`` and
    ``dk, dv [b, n_kv, tk, d]`` in the accumulation dtype; the caller sums them over tiles. With the
    final ``out [b, n, tq, d]`` (whose rows ``delta`` sums) the fused kernel may run instead.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if softcap is None and out is not None and _fusable(q, k, allowed):
        return _fused_backward(dout, q, k, v, out, lse, causal, scale)
    n_kv = k.shape[1]
    s = _scores(q, k, scale, causal, allowed, softcap)  # [b, n_kv, g, tq, tk]
    acc = s.dtype
    p = torch.exp(s - _grouped(lse.unsqueeze(-1).to(acc), n_kv))  # softmax rows of the full sequence
    dog = _grouped(dout.to(acc), n_kv)  # [b, n_kv, g, tq, d]
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dog)  # [b, n_kv, tk, d]
    dp = torch.einsum("bhgqd,bhkd->bhgqk", dog, v.to(acc))
    ds = p * (dp - _grouped(delta.unsqueeze(-1).to(acc), n_kv))  # [b, n_kv, g, tq, tk]
    if softcap is not None:  # through cap * tanh(x / cap): times 1 - tanh^2 (0 where masked)
        ds = ds * torch.where(torch.isfinite(s), 1 - (s / softcap) ** 2, torch.zeros_like(s))
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.to(acc)) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, _grouped(q.to(acc), n_kv)) * scale
    return dq.reshape(q.shape), dk, dv


def fused_tiles(device: torch.device | str) -> bool:
    """Whether tiles without a document mask run the fused flash kernel on ``device`` (CPU: no score tile)."""
    return torch.device(device).type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _fusable(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None) -> bool:
    return allowed is None and q.shape[-2] > 0 and k.shape[-2] > 0 and fused_tiles(q.device)


def _expand_kv(k: torch.Tensor, n: int) -> torch.Tensor:
    group = n // k.shape[1]
    return k if group == 1 else k.repeat_interleave(group, dim=1)  # [b, n_kv, t, d] -> [b, n, t, d]


def _fused_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    acc = _acc_dtype(q.dtype)
    n = q.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(acc), _expand_kv(k.to(acc), n), _expand_kv(v.to(acc), n), 0.0, causal, scale=scale
    )  # [b, n, tq, d], [b, n, tq]
    return out, lse.to(acc)


def _fused_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tile's gradients from the *final* output and log-sum-exp (the kernel forms ``rowsum(dout * out)``)."""
    acc = _acc_dtype(q.dtype)
    b, n, _, d = q.shape
    n_kv = k.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(acc),
        q.to(acc),
        _expand_kv(k.to(acc), n),
        _expand_kv(v.to(acc), n),
        out.to(acc),
        lse.to(acc),
        0.0,
        causal,
        scale=scale,
    )
    if n_kv != n:  # sum the query heads of each kv head: [b, n, tk, d] -> [b, n_kv, tk, d]
        dk = dk.reshape(b, n_kv, n // n_kv, -1, d).sum(2)
        dv = dv.reshape(b, n_kv, n // n_kv, -1, d).sum(2)
    return dq, dk, dv


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (rows that saw no key) replaced by 0, so ``s - lse`` stays ``-inf``, not nan."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable merge of two partial softmax results over disjoint key sets (``None`` = empty).

    Rows that have seen no key yet (``lse = -inf`` on both sides) stay ``-inf`` with output 0.
    """
    if out is None or lse is None:
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)  # [b, n, t]
    base = _finite(new)
    out = out * torch.exp(lse - base).unsqueeze(-1) + out_b * torch.exp(lse_b - base).unsqueeze(-1)
    return out, new
