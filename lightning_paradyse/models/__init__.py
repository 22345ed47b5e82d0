"""Reference transformer models (plain ``nn.Module`` code, no parallelism) and named configs.

``CONFIGS`` maps a name to a config instance: tiny ones for tests, realistic ones for planning only (never
instantiate those on a laptop). :func:`resolve_config` accepts such a name or the path of a YAML/JSON file
describing another model; ``build_model`` turns a name, a file or a config into the matching module.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_paradyse.models.gpt import GPT, GPTBlock, GPTConfig
from lightning_paradyse.models.llama import (
    MLP,
    Attention,
    Llama,
    LlamaBlock,
    LlamaConfig,
    RMSNorm,
    RotaryEmbedding,
    init_weights,
)


def lm_loss_sum(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies of a language model: ``tokens/targets [b, t]``."""
    logits = model(tokens, positions)  # [b, t, vocab]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


__all__ = [
    "CONFIGS",
    "GPT",
    "MLP",
    "Attention",
    "GPTBlock",
    "GPTConfig",
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
    "ModelConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "build_model",
    "init_weights",
    "lm_loss_sum",
    "resolve_config",
]

ModelConfig = LlamaConfig | GPTConfig
"""Any config ``build_model`` accepts."""

_LONG = 1_048_576

CONFIGS: dict[str, LlamaConfig | GPTConfig] = {
    # tiny test configs
    "llama-tiny": LlamaConfig(
        vocab_size=128, n_layers=2, hidden=96, n_heads=12, n_kv_heads=2, ffn=192, max_seq_len=1024
    ),
    "llama-tiny-mha": LlamaConfig(
        vocab_size=128, n_layers=2, hidden=96, n_heads=12, n_kv_heads=12, ffn=192, max_seq_len=1024
    ),
    "llama-tiny-mqa": LlamaConfig(
        vocab_size=128, n_layers=2, hidden=96, n_heads=12, n_kv_heads=1, ffn=192, max_seq_len=1024
    ),
    "gpt-tiny": GPTConfig(vocab_size=128, n_layers=2, hidden=96, n_heads=12, ffn=384, max_seq_len=1024, causal=True),
    "bert-tiny": GPTConfig(vocab_size=128, n_layers=2, hidden=96, n_heads=12, ffn=384, max_seq_len=1024, causal=False),
    # realistic planning configs (analytic use only: do not build these in tests)
    "llama-7b": LlamaConfig(
        vocab_size=32000, n_layers=32, hidden=4096, n_heads=32, n_kv_heads=32, ffn=11008, max_seq_len=_LONG
    ),
    "llama-70b": LlamaConfig(
        vocab_size=32000, n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, ffn=28672, max_seq_len=_LONG
    ),
    "gpt-175b": GPTConfig(
        vocab_size=50257, n_layers=96, hidden=12288, n_heads=96, ffn=49152, max_seq_len=_LONG, causal=True
    ),
    # the paper's setting: an 8-layer slice of GPT-175B on one 8-GPU node (planning only; its learned position
    # table is kept at 4096 rows so that it does not dominate the static memory of the slice)
    "gpt-175b-8l": GPTConfig(
        vocab_size=50257, n_layers=8, hidden=12288, n_heads=96, ffn=49152, max_seq_len=4096, causal=True
    ),
    "bert-large": GPTConfig(
        vocab_size=30522, n_layers=24, hidden=1024, n_heads=16, ffn=4096, max_seq_len=_LONG, causal=False
    ),
}


_FAMILIES: dict[str, type[LlamaConfig] | type[GPTConfig]] = {"llama": LlamaConfig, "gpt": GPTConfig}


def resolve_config(name_or_path: str) -> ModelConfig:
    """The config named ``name_or_path`` in :data:`CONFIGS`, or the one a YAML/JSON file describes.

    The file is a mapping with ``family: llama`` (:class:`LlamaConfig`) or ``family: gpt`` (:class:`GPTConfig`)
    and that config's fields, e.g. ``{family: llama, vocab_size: 32000, n_layers: 16, hidden: 2048, n_heads: 16,
    n_kv_heads: 4, ffn: 5632, max_seq_len: 65536}``.
    """
    if name_or_path in CONFIGS:
        return CONFIGS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(CONFIGS))
        raise ValueError(
            f"unknown model config {name_or_path!r}: give one of {known}, or the path of a YAML/JSON file with "
            f"'family: llama' or 'family: gpt' and the config's fields"
        )
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data: Any = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as err:  # a parse error of either format
        raise ValueError(f"cannot read the model config {path}: {err}") from None
    if not isinstance(data, dict) or data.get("family") not in _FAMILIES:
        raise ValueError(f"{path}: expected a mapping with 'family: llama' or 'family: gpt' and the config's fields")
    cls = _FAMILIES[data["family"]]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields - {"family"})
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown} for family {data['family']}; fields: {sorted(fields)}")
    try:
        return cls(**{k: v for k, v in data.items() if k != "family"})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None


def build_model(name_or_config: str | LlamaConfig | GPTConfig) -> Llama | GPT:
    """Build the model for a config, for the name of one in :data:`CONFIGS`, or for a config file."""
    if isinstance(name_or_config, str):
        config = resolve_config(name_or_config)
    else:
        config = name_or_config
    if isinstance(config, LlamaConfig):
        return Llama(config)
    if isinstance(config, GPTConfig):
        return GPT(config)
    raise TypeError(f"build_model expects a config name, LlamaConfig or GPTConfig, got {type(name_or_config).__name__}")
