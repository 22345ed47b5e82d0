"""Reference spatial-temporal transformer (video-style: frames x patches), plain code that knows nothing about
parallelism.

Tokens come as a grid ``[b, T, S]`` (``T`` frames of ``S`` patches). Blocks alternate between **spatial**
attention (every frame on its own: the patches of one frame attend to each other) and **temporal** attention
(every patch position on its own: the frames attend to each other), as in Latte or OpenSora-style video
transformers. Each block reshapes the hidden states ``[b, T, S, h]`` into a batch of sequences along its
axis, runs an ordinary bidirectional attention, and reshapes back; the MLP is token-wise. Learned frame and
patch position embeddings are added at the input. The output is a logit per grid token.

``ParaDySeStrategy(axes=2)`` (or ``parallelize(..., axes=2)``) accepts it unmodified: the blocks are found and
rewritten as for a language model, and each block's attention axis is read off its own reshape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_paradyse.models.llama import MLP, _check_positive, init_weights

__all__ = ["STBlock", "STConfig", "SpatialTemporalTransformer"]


@dataclass(frozen=True)
class STConfig:
    """Hyper-parameters of a :class:`SpatialTemporalTransformer`."""

    vocab_size: int
    """Token ids per grid cell (rows of ``tok_emb``, outputs of ``head``)."""
    n_layers: int
    """Blocks, alternating spatial (even) and temporal (odd)."""
    hidden: int
    """Model width."""
    n_heads: int
    """Attention heads."""
    ffn: int
    """Inner width of the GELU MLP."""
    max_frames: int
    """Rows of the frame position embedding."""
    max_patches: int
    """Rows of the patch position embedding."""

    def __post_init__(self) -> None:
        _check_positive(
            type(self).__name__,
            vocab_size=self.vocab_size,
            n_layers=self.n_layers,
            hidden=self.hidden,
            n_heads=self.n_heads,
            ffn=self.ffn,
            max_frames=self.max_frames,
            max_patches=self.max_patches,
        )
        if self.hidden % self.n_heads:
            raise ValueError(f"STConfig.hidden ({self.hidden}) must be divisible by n_heads ({self.n_heads})")


class SelfAttention(nn.Module):
    """Bidirectional multi-head self-attention over ``[n, L, h]`` (a batch of ``n`` sequences of ``L``)."""

    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, hidden // n_heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        n, length, _ = x.shape
        shape = (n, length, self.n_heads, self.head_dim)
        q, k, v = (lin(x).view(shape).transpose(1, 2) for lin in (self.q, self.k, self.v))  # [n, heads, L, d]
        y = F.scaled_dot_product_attention(q, k, v)  # [n, heads, L, d]
        return self.o(y.transpose(1, 2).reshape(n, length, -1))  # [n, heads, L, d] -> [n, L, h]


class STBlock(nn.Module):
    """Pre-norm block attending along one axis of the grid: ``temporal`` (frames) or spatial (patches)."""

    def __init__(self, config: STConfig, temporal: bool) -> None:
        super().__init__()
        self.temporal = temporal
        self.attn_norm = nn.LayerNorm(config.hidden)
        self.attn = SelfAttention(config.hidden, config.n_heads)
        self.mlp_norm = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config.hidden, config.ffn, gated=False, bias=True, act=F.gelu)

    def forward(self, x: Tensor) -> Tensor:
        b, t, s, h = x.shape
        y = self.attn_norm(x)
        if self.temporal:  # every patch position is a sequence of t frames
            y = y.transpose(1, 2).reshape(b * s, t, h)  # [b, t, s, h] -> [b*s, t, h]
            y = self.attn(y).view(b, s, t, h).transpose(1, 2)  # -> [b, t, s, h]
        else:  # every frame is a sequence of s patches
            y = self.attn(y.reshape(b * t, s, h)).view(b, t, s, h)  # [b*t, s, h] -> [b, t, s, h]
        x = x + y
        return x + self.mlp(self.mlp_norm(x))


class SpatialTemporalTransformer(nn.Module):
    """``tokens [b, T, S] -> logits [b, T, S, vocab]``, blocks alternating spatial and temporal attention."""

    def __init__(self, config: STConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.frame_emb = nn.Embedding(config.max_frames, config.hidden)
        self.patch_emb = nn.Embedding(config.max_patches, config.hidden)
        self.layers = nn.ModuleList(STBlock(config, temporal=i % 2 == 1) for i in range(config.n_layers))
        self.norm = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab_size)
        self.apply(init_weights)

    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """``positions`` ``[T]``: the frames' global indices (default ``arange(T)``)."""
        _, t, s = tokens.shape
        if positions is None:
            positions = torch.arange(t, device=tokens.device)
        patches = torch.arange(s, device=tokens.device)
        x = self.tok_emb(tokens) + self.frame_emb(positions)[:, None] + self.patch_emb(patches)  # [b, t, s, h]
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))  # [b, t, s, h] -> [b, t, s, vocab]
