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


def hf_llama_classifier(num_labels: int = 3) -> nn.Module:
    """A Llama sequence classifier: its head scores each row's last real token (``pad_token_id`` marks padding)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    return LlamaForSequenceClassification(LlamaConfig(**_tiny_decoder(4, 2), num_labels=num_labels, pad_token_id=0))


def hf_llama_token_classifier(num_labels: int = 5) -> nn.Module:
    """A Llama token classifier (one class per token), its head's dropout off (random: not comparable)."""
    from transformers import LlamaConfig, LlamaForTokenClassification

    config = LlamaConfig(**_tiny_decoder(4, 2), num_labels=num_labels, pad_token_id=0, classifier_dropout=0.0)
    return LlamaForTokenClassification(config)


def hf_granite(n_kv_heads: int = 4, n_layers: int = 2) -> nn.Module:
    """Granite: a Llama-like block with its own attention scale (``attention_multiplier``, not 1/sqrt(d)) and
    multipliers on the embeddings, the residuals and the logits."""
    from transformers import GraniteConfig, GraniteForCausalLM

    multipliers = dict(attention_multiplier=0.07, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=1.5)
    return GraniteForCausalLM(GraniteConfig(**_tiny_decoder(n_kv_heads, n_layers), **multipliers))


HF_FAMILIES: dict[str, tuple[str, str, dict[str, object]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5, "qk_layernorm": True}),
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        {"partial_rotary_factor": 0.25, "use_parallel_residual": True, "qk_layernorm": True},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 8,
            "query_pre_attn_scalar": 12,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 6,
        },
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None}),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_inner": 192, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
    ),
    "gpt2-eager": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_inner": 192, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_implementation": "eager"},
    ),
    "neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {"rotary_pct": 0.5, "use_parallel_residual": True, "attention_bias": True, "num_key_value_heads": None},
    ),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": 6, "use_bias": True}),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        {"rotary_dim": 4, "n_inner": 192, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
    ),
    "codegen": (
        "CodeGenConfig",
        "CodeGenForCausalLM",
        {"rotary_dim": 4, "n_inner": 192, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
    ),
    "bigcode": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        {"n_inner": 192, "multi_query": True, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 8,
            "attn_implementation": "eager",
            "attn_logit_softcapping": 0.9,
            "query_pre_attn_scalar": 12,
            "sliding_window": 6,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "experts_implementation": "eager"},
    ),
    "qwen3moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 3,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "head_dim": 8,
            "experts_implementation": "eager",
        },
    ),
}
"""Hugging Face decoder families beyond Llama: config class, model class, the fields that make them themselves.

* ``qwen3``: an RMS norm per head on q and k between the projections and the attention (also Gemma 3's);
* ``olmo2``: one RMS norm over *all* heads' features of q and of k (mixes heads: only modes that hold every head
  of a token can run it);
* ``phi``: partial rotary (half of each head rotated), a LayerNorm per head on q and k, parallel attention and MLP;
* ``stablelm``: a quarter of each head rotated, a *separate* LayerNorm for every head (per-head parameters: mixes
  heads), parallel residual;
* ``gemma3``: q/k norms, a rotary per layer type, a sliding layer (window shorter than the sequence) and a full
  one, an attention scale from ``query_pre_attn_scalar``;
* ``mistral``: a sliding window (every layer) shorter than the sequence; ``qwen2``: biases, a full layer then a
  sliding one (``max_window_layers``);
* ``gemma``: exact before the rewrite ran the block's own code; kept as a regression case;
* ``phi3``: one fused ``qkv_proj`` laid out ``[Q | K | V]`` and one fused ``gate_up_proj``;
* ``gpt2``: ``Conv1D`` projections (weights stored ``[in, out]``), a fused ``c_attn`` cut by ``split``, learned
  absolute positions, dropout modules after the output projections;
* ``gpt2-eager``: the same with ``attn_implementation="eager"`` (the attention written out, its dropout a module);
* ``neox``: a fused ``query_key_value`` interleaved head by head (``[q_h | k_h | v_h]`` per head), half of each head
  rotated, parallel residual, biases;
* ``gptj``, ``codegen``: a rotary table of positions (``embed_positions``, not ``inv_freq``) giving ``(sin, cos)``,
  the first 4 features of each head rotated pairwise (``rotate_every_two``), parallel attention and MLP; CodeGen's
  q, k and v from one fused ``qkv_proj`` cut into 4 model-parallel parts of ``[q | v | k]``;
* ``bigcode``: GPT-BigCode (StarCoder 1, SantaCoder): multi-query attention, one fused ``c_attn`` unsqueezed and
  cut ``[q | k | v]`` (one key/value head), learned absolute positions, ``nn.Linear`` projections with biases;
* ``starcoder2``: functional dropout after the output projection, a sliding window shorter than the sequence,
  biases, a plain (non-gated) MLP;
* ``gemma2``: eager attention (Hugging Face runs no other for it) with logit soft-capping (a small cap: tanh far
  from linear), an attention scale from ``query_pre_attn_scalar``, a sliding layer (window 6 < sequence) and a
  full one;
* ``mixtral``, ``qwen3moe``: a mixture of experts as the MLP (experts stored ``[E, 2f, h]``, a top-k router; 3
  experts over 2 ranks: uneven shares), run whole on each rank's tokens (``experts_implementation="eager"``:
  the grouped-GEMM kernels have no float64).
"""


MORE_FAMILIES: dict[str, tuple[str, str, dict[str, object]]] = {
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {"clip_qkv": 0.5}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {"partial_rotary_factor": 0.5, "head_dim": 8}),
    "persimmon": (
        "PersimmonConfig",
        "PersimmonForCausalLM",
        {"partial_rotary_factor": 0.5, "qk_layernorm": True, "num_key_value_heads": None},
    ),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 8, "partial_rotary_factor": 0.5}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"head_dim": 8, "sliding_window": None}),
    "bigcode-mha": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        {"n_inner": 192, "multi_query": False, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
    ),
    "seedoss": (
        "SeedOssConfig",
        "SeedOssForCausalLM",
        {"head_dim": 8, "attention_dropout": 0.0, "residual_dropout": 0.0},
    ),
}
"""More Hugging Face decoder families, checked through Lightning only (``tests/exact`` ``family-*`` cases: on groups,
then ``ulysses`` on one group of 2, AdamW, the checkpoint's weights and optimizer state to 1e-9; probed on 2026-12-01),
each with its own block code as transformers writes it: OLMo with ``clip_qkv`` (q, k and v clamped), Nemotron and
GLM-4 with half of each head rotated, Persimmon (a fused ``query_key_value``, LayerNorms on q and k, half rotated),
SmolLM3 with a layer without rotary, EXAONE 4, GPT-BigCode without multi-query attention (its ``c_attn`` cut
head by head), Seed-OSS (biases on q, k and v; its dropouts off, as every comparison
here has them: dropout draws per rank). Helium is exact once its RMS norm computes in the model's dtype; as it stands
it computes in float32 (3.7e-9 apart, as Cohere's and Gemma's)."""


def hf_family(
    family: str, n_kv_heads: int = 4, n_layers: int = 2, user_defaults: bool = False, **overrides: object
) -> nn.Module:
    """A tiny random model of a family of :data:`HF_FAMILIES` (no download); ``user_defaults``: with the kernels a
    user gets by default where the family's entry picks others for float64 (the grouped-GEMM experts of MoE);
    ``overrides``: config fields over the family's (``num_experts=8``)."""
    import transformers

    config_cls, model_cls, fields = {**HF_FAMILIES, **MORE_FAMILIES}[family]
    fields = {**fields, **overrides}
    if user_defaults:
        fields = {k: v for k, v in fields.items() if k != "experts_implementation"}
    base = {**_tiny_decoder(n_kv_heads, n_layers), "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    merged = {k: v for k, v in {**base, **fields}.items() if v is not None}  # None: the family has no such field
    config = getattr(transformers, config_cls)(**merged)
    return getattr(transformers, model_cls)(config)  # type: ignore[no-any-return]


class BertLM(nn.Module):
    """A Hugging Face ``BertModel`` (bidirectional, post-norm: a residual and a LayerNorm inside its attention module
    after the output projection) with a token head: the encoder as users fine-tune it, dropout off."""

    def __init__(self, vocab: int = 128, hidden: int = 96, layers: int = 2) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=12,
            max_position_embeddings=1024,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="sdpa",
        )
        self.bert = BertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bert(input_ids=x).last_hidden_state)  # type: ignore[no-any-return]


class ModernBertLM(nn.Module):
    """A Hugging Face ``ModernBertModel`` with global attention in every layer (fused ``Wqkv`` laid out
    ``[3, heads, d]``, rotary, fused ``Wi`` cut into input and gate, post-norm free layers) and a token head."""

    def __init__(self, vocab: int = 128, hidden: int = 96, layers: int = 2, local_every: int = 1) -> None:
        super().__init__()
        from transformers import ModernBertConfig, ModernBertModel

        config = ModernBertConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=12,
            global_attn_every_n_layers=local_every,
            local_attention=8,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
            attn_implementation="sdpa",
        )
        self.bert = ModernBertModel(config)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bert(input_ids=x).last_hidden_state)  # type: ignore[no-any-return]


class _ListExperts(nn.Module):
    """A top-1 mixture of experts kept as a ``ModuleList`` whose forward runs only the experts some token visits (as
    transformers 4.x and many users' MoEs do): on a slice of the sequence, a rank may use fewer experts than another."""

    def __init__(self, hidden: int, n_experts: int = 16) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [b, t, h] -> [b*t, h]
        probs = torch.softmax(self.router(flat), dim=-1)
        weight, choice = probs.max(dim=-1)
        out = torch.zeros_like(flat)
        for e in choice.unique().tolist():  # only the experts visited here
            rows = (choice == e).nonzero().squeeze(1)
            out = out.index_add(0, rows, self.experts[e](flat[rows]) * weight[rows, None])
        return out.reshape(x.shape)


class _ListMoEBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = CausalAttention(hidden, heads)
        self.mlp = _ListExperts(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class CausalAttention(nn.Module):
    """q/k/v/o linears around one causal SDPA call: the plainest attention the rewrite reads."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (f(x).view(b, t, self.num_heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, n, t, d]
        return self.o(y.transpose(1, 2).reshape(b, t, h))  # type: ignore[no-any-return]


class ListMoELM(nn.Module):
    """Two blocks whose MLP is :class:`_ListExperts`, with learned positions and a token head."""

    def __init__(self, vocab: int = 128, hidden: int = 48, layers: int = 2) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(1024, hidden)
        self.layers = nn.ModuleList(_ListMoEBlock(hidden, 6) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        h = self.emb(x) + self.pos(positions)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)  # type: ignore[no-any-return]


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
