"""The interface every parallel mode implements, and helpers the modes share.

A mode runs the *core* of an op on the unified layout: it receives the normalised local input
``x [b, s_r, h]`` and returns the local update ``[b, s_r, h]`` that the caller adds to the residual
stream. Norms and residual additions are token-wise and stay outside the modes, so every mode reads
and writes the same layout and a plan can change mode between any two ops for free.

A mode that cannot run an op on a group (for example heads not divisible by ``p``) says so through
``attention_infeasible`` / ``mlp_infeasible`` with a reason, instead of failing inside a collective.

Mixed precision (:class:`Autocast`): every mode computes what the plain op computes under the caller's
autocast (``Trainer(precision="bf16-mixed")``) or in the parameters' dtype (``"bf16-true"``). Its
matmuls run in the *compute dtype* (autocast's, else the operands'), its output is in that dtype like a
plain ``nn.Linear``'s, weights travel in the compute dtype (the values autocast would cast them to,
half the bytes), weight gradients leave in the parameter's dtype and are summed over ranks in it, and
activation gradients leave in the activation's dtype. A custom autograd Function records autocast in
its forward and replays it in its backward, as ``torch.amp.custom_fwd``/``custom_bwd`` do for a device
type fixed at decoration, here for the device of the input.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from lightning_paradyse.modes.specs import AttnSpec, AttnWeights, MlpSpec, MlpWeights, SeqContext

_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes autocast casts to its own (float64 is left alone)."""


@dataclass(frozen=True)
class Autocast:
    """Autocast on one device type as a custom autograd Function's forward saw it, to replay in its backward."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @staticmethod
    def current(x: torch.Tensor) -> Autocast:
        """The autocast state in effect now for ``x``'s device."""
        kind = x.device.type
        return Autocast(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

    def replay(self) -> torch.autocast:
        """A context that runs code under this autocast state (enabled or not), whatever is in effect now."""
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)

    def compute_dtype(self, *tensors: torch.Tensor) -> torch.dtype:
        """The dtype a matmul of ``tensors`` runs in: autocast's when it is on (and would cast them all),
        else their promoted dtype."""
        dtypes = [t.dtype for t in tensors]
        if self.enabled and all(d in _AUTOCAST_ELIGIBLE for d in dtypes):
            return self.dtype
        return functools.reduce(torch.promote_types, dtypes)


def autocast_off(x: torch.Tensor) -> torch.autocast:
    """A context with autocast disabled on ``x``'s device (for kernels that choose their own precision)."""
    return torch.autocast(x.device.type, enabled=False)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums of ``dtype`` terms are accumulated in: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y + bias`` in ``y``'s dtype, as ``F.linear`` adds its bias under autocast (a replicated output bias)."""
    return y if bias is None else y + bias.to(y.dtype)


class Mode:
    """Base class of the parallel modes. Subclasses set ``name`` and implement ``attention``/``mlp``."""

    name: ClassVar[str] = ""

    def attention_infeasible(self, spec: AttnSpec, p: int) -> str | None:
        """Why this mode cannot run ``spec``'s attention on ``p`` ranks, or ``None`` if it can."""
        return None

    def mlp_infeasible(self, spec: MlpSpec, p: int) -> str | None:
        """Why this mode cannot run ``spec``'s MLP on ``p`` ranks, or ``None`` if it can."""
        return None

    def attention(self, x: torch.Tensor, w: AttnWeights, spec: AttnSpec, ctx: SeqContext) -> torch.Tensor:
        """Attention core: ``[b, s_r, h] -> [b, s_r, h]`` (without the residual)."""
        raise NotImplementedError

    def mlp(self, x: torch.Tensor, w: MlpWeights, spec: MlpSpec, ctx: SeqContext) -> torch.Tensor:
        """MLP core: ``[b, s_r, h] -> [b, s_r, h]`` (without the residual)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def heads_infeasible(spec: AttnSpec, p: int, mode: str, splits_heads: bool = True) -> str | None:
    """The head-divisibility rule of the head-sharded modes (``tp_sp``, ``ulysses``, ``metp``); with
    ``splits_heads`` (the model's pre-attention code runs on a subset of the heads) also the head-mixing rule."""
    if splits_heads and spec.mixes_heads and p > 1:
        return f"{mode} runs the model's code before the attention on 1/p of the heads, and that code mixes heads"
    if spec.n_heads % p:
        return f"{mode} needs the {spec.n_heads} attention heads divisible by the group size {p}"
    if spec.n_kv_heads % p and p % spec.n_kv_heads:
        return f"{mode} needs the {spec.n_kv_heads} key/value heads to divide or be divisible by the group size {p}"
    return None


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[b, t, n*d] -> [b, n, t, d]``."""
    b, t, _ = x.shape
    return x.view(b, t, -1, head_dim).transpose(1, 2)


def prepare_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projections ``[b, t, heads*d]`` -> attention inputs ``[b, heads, t, d]`` of the tokens at ``positions``:
    the model's own code (``spec.prepare``: norms, rotary) or a plain split into heads."""
    if spec.prepare is not None:
        return spec.prepare(q, k, v, positions)
    d = spec.head_dim
    return split_heads(q, d), split_heads(k, d), split_heads(v, d)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[b, n, t, d] -> [b, t, n*d]``."""
    b, n, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, n * d)


def mlp_hidden(up: torch.Tensor, gate: torch.Tensor | None, spec: MlpSpec) -> torch.Tensor:
    """The elementwise middle of the MLP on already projected (possibly sharded) features."""
    return spec.act(gate) * up if spec.gated and gate is not None else spec.act(up)


def local_mlp(x: torch.Tensor, w: MlpWeights, spec: MlpSpec) -> torch.Tensor:
    """The MLP on full (gathered) weights: ``[.., h] -> [.., h]`` without ``b_down``."""
    up = F.linear(x, w.up, w.b_up)
    gate = F.linear(x, w.gate, w.b_gate) if w.gate is not None else None
    return mlp_hidden(up, gate, spec) @ w.down_t
