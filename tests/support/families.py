"""Tiny models of the accepted families, built from ordinary code that knows nothing about parallelism.

* ``hf-llama``: a Hugging Face ``LlamaForCausalLM`` (random init, no download), trained with
  ``labels`` that the model shifts inside (the label-shift trap of sequence parallelism); ``granite``
  the same with Granite's own attention scale and multipliers.
* ``tel`` / ``tel-causal``: a model built from ``torch.nn.TransformerEncoderLayer`` (pre-norm,
  learned positions, a causal mask of its own when causal), targets shifted in the data.
* the package's reference models come from ``lightning_paradyse.models``.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def _tiny_decoder(n_kv_heads: int, n_layers: int) -> dict[str, object]:
    """The config fields every tiny Hugging Face decoder here shares."""
    return dict(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=n_layers,
        num_attention_heads=12,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )


def hf_llama(n_kv_heads: int = 4, n_layers: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_tiny_decoder(n_kv_heads, n_layers)))


def hf_granite(n_kv_heads: int = 4, n_layers: int = 2) -> nn.Module:
    """Granite: a Llama-like block with its own attention scale (``attention_multiplier``, not 1/sqrt(d)) and
    multipliers on the embeddings, the residuals and the logits."""
    from transformers import GraniteConfig, GraniteForCausalLM

    multipliers = dict(attention_multiplier=0.07, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=1.5)
    return GraniteForCausalLM(GraniteConfig(**_tiny_decoder(n_kv_heads, n_layers), **multipliers))


class EncoderLM(nn.Module):
    """A language model made of ``nn.TransformerEncoderLayer`` blocks."""

    def __init__(self, causal: bool, vocab: int = 128, hidden: int = 96, layers: int = 2) -> None:
        super().__init__()
        self.causal = causal
        self.emb = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(1024, hidden)
        layer = nn.TransformerEncoderLayer(hidden, 12, 2 * hidden, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        h = self.emb(x) + self.pos(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1]) if self.causal else None
        return self.head(self.encoder(h, mask=mask, is_causal=self.causal))
