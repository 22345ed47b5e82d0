"""The interface every parallel mode implements, and helpers the modes share.

A mode runs the *core* of an op on the unified layout: it receives the normalised local input
``x [b, s_r, h]`` and returns the local update ``[b, s_r, h]`` that the caller adds to the residual
stream. Norms and residual additions are token-wise and stay outside the modes, so every mode reads
and writes the same layout and a plan can change mode between any two ops for free.

A mode that cannot run an op on a group (for example heads not divisible by ``p``) says so through
``attention_infeasible`` / ``mlp_infeasible`` with a reason, instead of failing inside a collective.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from lightning_paradyse.spec import AttnSpec, AttnWeights, MlpSpec, MlpWeights, SeqContext


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


def heads_infeasible(spec: AttnSpec, p: int, mode: str) -> str | None:
    """The head-divisibility rule of the head-sharded modes (``tp_sp``, ``ulysses``, ``metp``)."""
    if spec.n_heads % p:
        return f"{mode} needs the {spec.n_heads} attention heads divisible by the group size {p}"
    if spec.n_kv_heads % p and p % spec.n_kv_heads:
        return f"{mode} needs the {spec.n_kv_heads} key/value heads to divide or be divisible by the group size {p}"
    return None


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[b, t, n*d] -> [b, n, t, d]``."""
    b, t, _ = x.shape
    return x.view(b, t, -1, head_dim).transpose(1, 2)


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
