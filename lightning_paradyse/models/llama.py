"""Reference Llama-style decoder (RoPE, grouped-query attention, SwiGLU, RMSNorm), written as plain
``nn.Module`` code that knows nothing about parallelism.

The building blocks shared with :mod:`lightning_paradyse.models.gpt` (:class:`Attention`, :class:`MLP`,
:func:`init_weights`, :func:`resolve_positions`) live here too.

Every ``forward`` takes the GLOBAL position ids of the tokens it is given, so a module may be run on any
slice of a sequence (``idx[:, a:b]`` with ``positions=torch.arange(a, b)``), which is how sequence
parallelism uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MLP",
    "Attention",
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "init_weights",
    "resolve_positions",
]


def _check_positive(cls_name: str, **values: float) -> None:
    """Raise ``ValueError`` naming the first field of ``values`` that is not strictly positive."""
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{cls_name}.{name} must be > 0, got {name}={value!r}")


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a :class:`Llama` model."""

    vocab_size: int
    """Number of tokens in the vocabulary (rows of ``tok_emb``, outputs of ``lm_head``)."""
    n_layers: int
    """Number of :class:`LlamaBlock` s."""
    hidden: int
    """Model (residual stream) width."""
    n_heads: int
    """Number of query heads."""
    n_kv_heads: int
    """Number of key/value heads (grouped-query attention); must divide ``n_heads``."""
    ffn: int
    """Inner width of the SwiGLU MLP."""
    max_seq_len: int
    """Largest sequence length the model accepts: every position id must be ``< max_seq_len``."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorm layers."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_positive(
            name,
            vocab_size=self.vocab_size,
            n_layers=self.n_layers,
            hidden=self.hidden,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn=self.ffn,
            max_seq_len=self.max_seq_len,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
        )
        if self.hidden % self.n_heads != 0:
            raise ValueError(
                f"{name}.hidden must be divisible by n_heads, got hidden={self.hidden}, n_heads={self.n_heads}"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"{name}.n_heads must be divisible by n_kv_heads, got n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"{name}.head_dim (hidden // n_heads) must be even for rotary embeddings, got "
                f"head_dim={self.head_dim} (hidden={self.hidden}, n_heads={self.n_heads})"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.n_heads

    def num_params(self) -> int:
        """Analytic parameter count of ``Llama(self)`` (``== sum(p.numel() for p in model.parameters())``)."""
        h, d = self.hidden, self.head_dim
        attn = h * self.n_heads * d + 2 * h * self.n_kv_heads * d + self.n_heads * d * h  # q, k, v, o
        mlp = 3 * h * self.ffn  # gate, up, down
        norms = 2 * h  # attn_norm, mlp_norm
        per_layer = attn + mlp + norms
        return self.vocab_size * h + self.n_layers * per_layer + h + h * self.vocab_size


def init_weights(module: nn.Module) -> None:
    """Reference initialisation: N(0, 0.02) for linears/embeddings, zero biases, unit norm weights.

    Meant for ``model.apply(init_weights)``; deterministic under ``torch.manual_seed``.
    """
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, (RMSNorm, nn.LayerNorm)):
        if module.weight is not None:
            nn.init.ones_(module.weight)
        bias = getattr(module, "bias", None)
        if bias is not None:
            nn.init.zeros_(bias)


def resolve_positions(positions: Tensor | None, seq_len: int, max_seq_len: int, device: torch.device) -> Tensor:
    """Return the global position ids of ``seq_len`` tokens, validating them against ``max_seq_len``.

    ``None`` means ``torch.arange(seq_len)``. Positions need not start at 0 nor be contiguous. On the host a
    position out of range raises a ``ValueError`` naming it; on a CUDA GPU the range is asserted on the device (reading
    the positions on the host would synchronise it in every forward), and a bad position stops the run with a
    device-side assertion.
    """
    if positions is None:
        if seq_len > max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={max_seq_len}")
        return torch.arange(seq_len, device=device)
    if positions.dim() != 1 or positions.shape[0] != seq_len:
        raise ValueError(
            f"positions must be a 1-D tensor with one entry per token (seq_len={seq_len}), "
            f"got shape {tuple(positions.shape)}"
        )
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer tensor, got dtype {positions.dtype}")
    if seq_len > 0 and positions.device.type == "cuda":  # checked on the device: no host read
        in_range = ((positions >= 0) & (positions < max_seq_len)).all()
        torch._assert_async(in_range, f"positions must be in [0, max_seq_len={max_seq_len})")
    elif seq_len > 0 and positions.device.type != "meta":
        lo, hi = int(positions.min()), int(positions.max())
        if hi >= max_seq_len:
            raise ValueError(f"position {hi} is out of range: positions must be < max_seq_len={max_seq_len}")
        if lo < 0:
            raise ValueError(f"position {lo} is out of range: positions must be >= 0")
    return positions


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in at least float32 and cast back to the input dtype."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.hidden = hidden
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: Tensor) -> Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        xc = x.to(compute)
        xc = xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xc * self.weight.to(compute)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half convention).

    A pure function of ``(q, k, positions)``: it holds no buffers, so applying it to any subset of tokens
    with their global positions equals slicing the result of applying it to the whole sequence.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"RotaryEmbedding needs an even head_dim, got head_dim={head_dim}")
        self.head_dim = head_dim
        self.theta = theta

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Float64 ``cos`` and ``sin`` tables of shape ``[t, head_dim]`` for the given positions.

        Computed in float64 so that large positions keep their angle accuracy; cast by the caller.
        """
        d = self.head_dim
        exponent = torch.arange(0, d, 2, device=positions.device, dtype=torch.float64) / d  # [d/2]
        inv_freq = 1.0 / (self.theta**exponent)  # [d/2]
        freqs = torch.outer(positions.to(torch.float64), inv_freq)  # [t] x [d/2] -> [t, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [t, d/2] -> [t, d]
        return emb.cos(), emb.sin()

    @staticmethod
    def _rotate_half(x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)  # [..., d] -> 2 x [..., d/2]
        return torch.cat((-x2, x1), dim=-1)  # 2 x [..., d/2] -> [..., d]

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate ``q`` ``[b, nq, t, d]`` and ``k`` ``[b, nk, t, d]`` by their global ``positions`` ``[t]``.

        Returns ``(q_rot, k_rot)`` in the input dtypes.
        """
        cos, sin = self.cos_sin(positions)  # [t, d] each, broadcast over [b, n, t, d]

        def rotate(x: Tensor) -> Tensor:
            compute = torch.promote_types(x.dtype, torch.float32)
            xc = x.to(compute)
            out = xc * cos.to(compute) + self._rotate_half(xc) * sin.to(compute)
            return out.to(x.dtype)

        return rotate(q), rotate(k)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with optional rotary embedding.

    ``Llama`` uses it without biases and with a :class:`RotaryEmbedding`; ``GPT`` with biases and
    ``rotary=None``.
    """

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        n_kv_heads: int,
        *,
        bias: bool,
        causal: bool,
        rotary: RotaryEmbedding | None,
    ) -> None:
        super().__init__()
        if hidden % n_heads != 0 or n_heads % n_kv_heads != 0:
            raise ValueError(
                f"Attention needs hidden % n_heads == 0 and n_heads % n_kv_heads == 0, got "
                f"hidden={hidden}, n_heads={n_heads}, n_kv_heads={n_kv_heads}"
            )
        self.hidden = hidden
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = hidden // n_heads
        self.causal = causal
        self.q = nn.Linear(hidden, n_heads * self.head_dim, bias=bias)
        self.k = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=bias)
        self.v = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=bias)
        self.o = nn.Linear(n_heads * self.head_dim, hidden, bias=bias)
        self.rotary = rotary

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        q = self.q(x).view(b, s, self.n_heads, d).transpose(1, 2)  # [b, s, nq*d] -> [b, nq, s, d]
        k = self.k(x).view(b, s, self.n_kv_heads, d).transpose(1, 2)  # [b, s, nk*d] -> [b, nk, s, d]
        v = self.v(x).view(b, s, self.n_kv_heads, d).transpose(1, 2)  # [b, s, nk*d] -> [b, nk, s, d]
        if self.rotary is not None:
            q, k = self.rotary(q, k, positions)
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            # query head i reads kv head i // group
            k = k.repeat_interleave(group, dim=1)  # [b, nk, s, d] -> [b, nq, s, d]
            v = v.repeat_interleave(group, dim=1)  # [b, nk, s, d] -> [b, nq, s, d]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # [b, nq, s, d]
        y = y.transpose(1, 2).reshape(b, s, self.n_heads * d)  # [b, nq, s, d] -> [b, s, nq*d]
        return self.o(y)


class MLP(nn.Module):
    """Feed-forward block: gated ``down(act(gate(x)) * up(x))`` or plain ``down(act(up(x)))``."""

    def __init__(self, hidden: int, ffn: int, *, gated: bool, bias: bool, act: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.hidden = hidden
        self.ffn = ffn
        self.gated = gated
        self.act: Callable[[Tensor], Tensor] = act
        self.gate: nn.Linear | None = nn.Linear(hidden, ffn, bias=bias) if gated else None
        self.up = nn.Linear(hidden, ffn, bias=bias)
        self.down = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is not None:
            return self.down(self.act(self.gate(x)) * self.up(x))  # [b, s, h] -> [b, s, f] -> [b, s, h]
        return self.down(self.act(self.up(x)))  # [b, s, h] -> [b, s, f] -> [b, s, h]

    def extra_repr(self) -> str:
        return f"gated={self.gated}, act={getattr(self.act, '__name__', self.act)}"


class LlamaBlock(nn.Module):
    """Pre-norm decoder block: RMSNorm -> rotary GQA attention, RMSNorm -> SwiGLU MLP."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, eps=config.norm_eps)
        self.attn = Attention(
            config.hidden,
            config.n_heads,
            config.n_kv_heads,
            bias=False,
            causal=True,
            rotary=RotaryEmbedding(config.head_dim, config.rope_theta),
        )
        self.mlp_norm = RMSNorm(config.hidden, eps=config.norm_eps)
        self.mlp = MLP(config.hidden, config.ffn, gated=True, bias=False, act=F.silu)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), positions)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class Llama(nn.Module):
    """Llama-style causal language model: ``idx [b, s] -> logits [b, s, vocab]``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.apply(init_weights)

    def forward(self, idx: Tensor, positions: Tensor | None = None) -> Tensor:
        """Logits ``[b, s, vocab]`` of token ids ``idx`` ``[b, s]``.

        ``positions`` ``[s]`` are the tokens' GLOBAL position ids (default ``arange(s)``).
        """
        positions = resolve_positions(positions, idx.shape[1], self.config.max_seq_len, idx.device)
        x = self.tok_emb(idx)  # [b, s] -> [b, s, h]
        for block in self.layers:
            x = block(x, positions)
        return self.lm_head(self.norm(x))  # [b, s, h] -> [b, s, vocab]
