"""Reference GPT/BERT-style transformer (learned absolute positions, GELU MLP, LayerNorm, biased linears),
written as plain ``nn.Module`` code that knows nothing about parallelism.

``GPTConfig.causal`` selects a GPT-style causal decoder (``True``) or a BERT-style bidirectional encoder
(``False``). The attention and MLP modules are the generic ones from :mod:`lightning_paradyse.models.llama`,
configured with biases, no rotary embedding, and an un-gated exact-GELU MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from lightning_paradyse.models.llama import MLP, Attention, _check_positive, init_weights, resolve_positions

__all__ = ["GPT", "GPTBlock", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of a :class:`GPT` model."""

    vocab_size: int
    """Number of tokens in the vocabulary (rows of ``tok_emb``, outputs of ``lm_head``)."""
    n_layers: int
    """Number of :class:`GPTBlock` s."""
    hidden: int
    """Model (residual stream) width."""
    n_heads: int
    """Number of attention heads (multi-head attention: as many key/value heads as query heads)."""
    ffn: int
    """Inner width of the GELU MLP."""
    max_seq_len: int
    """Rows of the learned position embedding: every position id must be ``< max_seq_len``."""
    causal: bool = True
    """``True``: GPT-style causal attention; ``False``: BERT-style bidirectional attention."""
    norm_eps: float = 1e-5
    """Epsilon of the LayerNorm layers."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_positive(
            name,
            vocab_size=self.vocab_size,
            n_layers=self.n_layers,
            hidden=self.hidden,
            n_heads=self.n_heads,
            ffn=self.ffn,
            max_seq_len=self.max_seq_len,
            norm_eps=self.norm_eps,
        )
        if self.hidden % self.n_heads != 0:
            raise ValueError(
                f"{name}.hidden must be divisible by n_heads, got hidden={self.hidden}, n_heads={self.n_heads}"
            )

    @property
    def n_kv_heads(self) -> int:
        """Number of key/value heads; always ``n_heads`` (no grouped-query attention)."""
        return self.n_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.n_heads

    def num_params(self) -> int:
        """Analytic parameter count of ``GPT(self)`` (``== sum(p.numel() for p in model.parameters())``)."""
        h, f = self.hidden, self.ffn
        attn = 4 * (h * h + h)  # q, k, v, o with biases
        mlp = (h * f + f) + (f * h + h)  # up, down with biases
        norms = 2 * (2 * h)  # attn_norm, mlp_norm (weight + bias)
        per_layer = attn + mlp + norms
        embeddings = self.vocab_size * h + self.max_seq_len * h  # tok_emb, pos_emb
        return embeddings + self.n_layers * per_layer + 2 * h + h * self.vocab_size


class GPTBlock(nn.Module):
    """Pre-norm transformer block: LayerNorm -> MHA attention, LayerNorm -> GELU MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.attn = Attention(
            config.hidden,
            config.n_heads,
            config.n_kv_heads,
            bias=True,
            causal=config.causal,
            rotary=None,
        )
        self.mlp_norm = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.mlp = MLP(config.hidden, config.ffn, gated=False, bias=True, act=F.gelu)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), positions)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class GPT(nn.Module):
    """GPT/BERT-style language model: ``idx [b, s] -> logits [b, s, vocab]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.hidden)
        self.layers = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.apply(init_weights)

    def forward(self, idx: Tensor, positions: Tensor | None = None) -> Tensor:
        """Logits ``[b, s, vocab]`` of token ids ``idx`` ``[b, s]``.

        ``positions`` ``[s]`` are the tokens' GLOBAL position ids (default ``arange(s)``).
        """
        positions = resolve_positions(positions, idx.shape[1], self.config.max_seq_len, idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)  # [b, s, h] + [s, h] -> [b, s, h]
        for block in self.layers:
            x = block(x, positions)
        return self.lm_head(self.norm(x))  # [b, s, h] -> [b, s, vocab]
