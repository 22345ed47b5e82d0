"""The model as the cost model sees it: a handful of dimensions, no module.

Every formula of the cost model (FLOPs, bytes saved for backward, transients, communication volume)
is a function of these numbers, the sequence length ``s``, the batch ``b`` and the group size ``p``.
They come from a model config (:func:`dims_from_config`, so that ``cli.py plan`` can plan for a 70B
model without building it) or from a parallelized module (:func:`dims_from_module`, which reads the
:class:`~lightning_paradyse.modes.specs.AttnSpec` / :class:`~lightning_paradyse.modes.specs.MlpSpec` of its
dispatch modules, so user models are covered too).

Every layer has the same widths; what may differ per layer is the attention's causal sliding window
(:attr:`ModelDims.windows`: Gemma 3's sliding and full layers, Qwen2's ``max_window_layers``), which the
formulas take per op as ``window`` (see :mod:`lightning_paradyse.cost.time`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_paradyse.distributed.comm import gqa_kv_index
from lightning_paradyse.graph.dispatch import AttentionDispatch, ColumnDispatch, MlpDispatch, OpaqueDispatch
from lightning_paradyse.models import GPTConfig, LlamaConfig
from lightning_paradyse.modes.specs import AttnSpec, MlpSpec
from lightning_paradyse.runtime.parallel import dispatchers, n_layers


@dataclass(frozen=True)
class ModelDims:
    """The dimensions of a transformer that the cost formulas need."""

    hidden: int
    """Model width ``h``."""
    n_heads: int
    """Query heads ``n``."""
    n_kv_heads: int
    """Key/value heads."""
    head_dim: int
    """Width ``d`` of a head."""
    ffn: int
    """MLP intermediate width ``f``."""
    n_layers: int
    """Transformer blocks ``L``; the planner places ``2L`` ops (attention, MLP per block)."""
    vocab: int
    """Vocabulary size (LM head and embedding)."""
    gated: bool = True
    """SwiGLU-style MLP (gate and up projections) or a plain one (up only)."""
    biases: bool = False
    """The q/k/v/o and MLP linears have biases."""
    causal: bool = True
    """Causal attention (balanced layout, half the attention FLOPs) or bidirectional."""
    rotary: bool = True
    """RoPE on q and k (float32 cos/sin tables are saved for backward)."""
    norm: str = "rms"
    """``rms`` (RMSNorm) or ``layer`` (LayerNorm): what the norm before each op saves."""
    dtype_bytes: int = 4
    """Element size of the parameters, their gradients and the residual stream (4 for float32, 2 for bf16)."""
    compute_bytes: int | None = None
    """Element size of what the matmuls read and write under autocast (``precision="bf16-mixed"``: 2): the
    projections' inputs, outputs and the weights cast for them; ``None``: no autocast, the parameters' own."""
    extra_params: int = 0
    """Replicated parameters outside the blocks and norms beyond ``2*vocab*h`` (e.g. position embeddings)."""
    windows: tuple[int | None, ...] = ()
    """Per layer, the causal sliding window of its attention in tokens (a query attends its ``window`` most recent
    keys, itself included), ``None`` for a layer attending the whole causal sequence; empty: no layer has one."""
    inline_mlp: bool = False
    """The block computes its MLP itself (``nn.TransformerEncoderLayer``): its two linears are rewritten one by one and
    the activation between them is the block's code, so recomputing the linears keeps what the activation saves
    (:meth:`~lightning_paradyse.cost.model.CostModel.op_costs` prices that recomputation no cheaper in memory)."""

    def __post_init__(self) -> None:
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"norm must be 'rms' or 'layer', got {self.norm!r}")
        if min(self.hidden, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn, self.n_layers, self.vocab) < 1:
            raise ValueError(f"every dimension must be positive: {self}")
        windows = tuple(None if w is None else int(w) for w in self.windows)  # a profile's JSON gives a list
        object.__setattr__(self, "windows", windows if any(w is not None for w in windows) else ())
        if self.windows and len(self.windows) != self.n_layers:
            raise ValueError(f"windows: one per layer ({self.n_layers}), got {len(self.windows)}: {self.windows}")
        if any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"windows must be positive token counts or None, got {self.windows}")
        if self.windows and not self.causal:
            raise ValueError("a sliding window needs causal attention")

    def window(self, layer: int) -> int | None:
        """The causal sliding window of ``layer``'s attention (``None``: the whole causal sequence)."""
        return self.windows[layer] if self.windows else None

    @property
    def q_rows(self) -> int:
        """Query width ``n*d``."""
        return self.n_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        """Key (or value) width ``n_kv*d``."""
        return self.n_kv_heads * self.head_dim

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    @property
    def branches(self) -> int:
        """Input projections of the MLP: 2 (gate, up) when gated, else 1."""
        return 2 if self.gated else 1

    @property
    def act_bytes(self) -> int:
        """Element size of the activations a mode computes and ships: autocast's compute dtype, else the
        parameters'."""
        return self.compute_bytes or self.dtype_bytes

    @property
    def autocast(self) -> bool:
        """Autocast computes in a dtype other than the parameters' (its casts of the weights are new tensors)."""
        return self.act_bytes != self.dtype_bytes

    @property
    def acc_bytes(self) -> int:
        """Element size of the ring attention's accumulators (float32, float64 for float64)."""
        return max(self.dtype_bytes, 4)

    def kv_heads_per_rank(self, p: int) -> int:
        """``m``: kv heads a head-sharded mode holds per rank (replicated when ``n_kv < p``)."""
        return len(gqa_kv_index(self.n_heads, self.n_kv_heads, p)) // p

    def attn_params(self) -> int:
        """Sharded elements of one attention op (q, k, v, o and the q/k/v biases)."""
        biases = self.q_rows + 2 * self.kv_rows if self.biases else 0
        return (2 * self.q_rows + 2 * self.kv_rows) * self.hidden + biases

    def mlp_params(self) -> int:
        """Sharded elements of one MLP op (up, gate, down and the up/gate biases)."""
        biases = self.branches * self.ffn if self.biases else 0
        return (self.branches + 1) * self.ffn * self.hidden + biases

    def op_params(self, op: str) -> int:
        return self.attn_params() if op == "attention" else self.mlp_params()

    def norm_params(self) -> int:
        """Replicated elements of one norm (weight, and bias for LayerNorm)."""
        return self.hidden * (2 if self.norm == "layer" else 1)

    def op_replicated(self) -> int:
        """Replicated elements of one op: its norm and, with biases, its output bias."""
        return self.norm_params() + (self.hidden if self.biases else 0)

    def outer_params(self) -> int:
        """Replicated elements outside the blocks: embedding, LM head, final norm and extras."""
        return 2 * self.vocab * self.hidden + self.norm_params() + self.extra_params

    def attn_spec(self, window: int | None = None) -> AttnSpec:
        """The :class:`AttnSpec` the volume formulas take (of a layer with ``window``)."""
        return AttnSpec(self.hidden, self.n_heads, self.n_kv_heads, self.head_dim, self.causal, window=window)

    def mlp_spec(self) -> MlpSpec:
        """The :class:`MlpSpec` the volume formulas take (the activation does not matter to them)."""
        return MlpSpec(self.hidden, self.ffn, F.silu if self.gated else F.gelu, gated=self.gated)

    def with_dtype(self, dtype_bytes: int) -> ModelDims:
        return dataclasses.replace(self, dtype_bytes=dtype_bytes)


def dims_from_config(config: LlamaConfig | GPTConfig, dtype_bytes: int = 4) -> ModelDims:
    """The dimensions of a model config of :mod:`lightning_paradyse.models` (nothing is built)."""
    family: dict[str, Any]
    if isinstance(config, LlamaConfig):
        n_kv_heads = config.n_kv_heads
        family = {"gated": True, "biases": False, "causal": True, "rotary": True, "norm": "rms"}
    else:  # GPT/BERT: multi-head, biases, LayerNorm, a learned position table
        n_kv_heads = config.n_heads
        family = {"gated": False, "biases": True, "causal": config.causal, "rotary": False, "norm": "layer"}
        family["extra_params"] = config.max_seq_len * config.hidden
    return ModelDims(
        config.hidden,
        config.n_heads,
        n_kv_heads,
        config.head_dim,
        config.ffn,
        config.n_layers,
        config.vocab_size,
        dtype_bytes=dtype_bytes,
        **family,
    )


def _ops(module: nn.Module) -> tuple[AttentionDispatch, MlpSpec, bool]:
    """The first attention dispatch module, the MLP's spec and whether the blocks compute the MLP inline (its up
    projection a :class:`~lightning_paradyse.graph.dispatch.ColumnDispatch`; gated ones are refused by the rewrite)."""
    ops = [op for _, op in dispatchers(module)]
    attn = next((op for op in ops if isinstance(op, AttentionDispatch)), None)
    mlp = next((op for op in ops if isinstance(op, (MlpDispatch, OpaqueDispatch))), None)
    up = next((op for op in ops if isinstance(op, ColumnDispatch)), None)
    if attn is None or (mlp is None and up is None):
        raise ValueError("the cost model needs a parallelized module with attention and MLP dispatch modules")
    if mlp is not None:  # priced as inline (no memory gain from recomputing it) if any block computes it inline
        return attn, mlp.spec, up is not None
    assert up is not None  # its output features are the MLP's width; the activation does not matter to the cost
    return attn, MlpSpec(attn.spec.hidden, up.rows, F.gelu, gated=False), True


def dims_from_module(module: nn.Module, vocab: int | None = None) -> ModelDims:
    """The dimensions of a module parallelized by :func:`lightning_paradyse.runtime.parallel.parallelize`.

    ``vocab`` defaults to the largest ``num_embeddings`` of an ``nn.Embedding`` in the module. The
    norm kind is RMS when a module whose class name contains ``RMS`` exists, else LayerNorm. Each layer's
    sliding window is its attention dispatch module's (``AttnSpec.window``), so a model mixing sliding and
    full layers is priced per layer.
    """

    attn, m, inline = _ops(module)
    layers = n_layers(module)
    windows: list[int | None] = [None] * layers
    for _, op in dispatchers(module):
        if isinstance(op, AttentionDispatch) and op.layer < layers:
            windows[op.layer] = op.spec.window
    a = attn.spec
    if vocab is None:
        sizes = [e.num_embeddings for e in module.modules() if isinstance(e, nn.Embedding)]
        vocab = max(sizes, default=1)
    rms = any("rms" in type(sub).__name__.lower() for sub in module.modules())
    dtype_bytes = attn.req("q").element_size()
    return ModelDims(
        a.hidden,
        a.n_heads,
        a.n_kv_heads,
        a.head_dim,
        m.ffn,
        layers,
        vocab,
        gated=m.gated,
        biases=attn.opt("q_bias") is not None,
        causal=bool(attn.roles.causal is not False),
        rotary=attn.roles.program is not None,
        norm="rms" if rms else "layer",
        dtype_bytes=dtype_bytes,
        windows=tuple(windows),
        inline_mlp=inline,
    )


def dtype_size(dtype: str | torch.dtype) -> int:
    """Bytes of one element of ``dtype`` (a ``torch.dtype`` or its name, e.g. ``bfloat16``)."""
    resolved = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return torch.empty((), dtype=resolved).element_size()
