"""What the role-finding passes (:mod:`lightning_paradyse.graph.passes`) say about a block: neutral, frozen records
that the dispatch modules (:mod:`lightning_paradyse.graph.dispatch`) are built from, and what counts as a projection.

Nothing here finds or runs anything: the passes fill these records, the dispatch modules read them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from lightning_paradyse.graph.adapters import base_layer, is_lora_linear
from lightning_paradyse.graph.program import Program
from lightning_paradyse.graph.trace import ArgRef


@dataclass(frozen=True)
class AttentionRoles:
    """The attention op of a block."""

    core: str
    """Path (inside the block) of the sub-module that computes the op."""
    kind: str
    """``linear`` (q/k/v/o ``nn.Linear`` + scaled-dot-product attention) or ``mha`` (``nn.MultiheadAttention``)."""
    q: str
    k: str
    v: str
    o: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    causal: bool | None
    """``None`` when decided per call (``nn.MultiheadAttention``'s mask / ``is_causal``)."""
    hidden: ArgRef
    """The normalised input in the core module's call (the input the core normalises itself where it has a
    :attr:`head`)."""
    program: Program | None = None
    """The block's own code from the projections to the attention inputs (norms, rotary), replayed in every mode;
    ``None`` when it only splits the projections into heads."""
    positions: tuple[ArgRef, ...] = ()
    """The program's positional inputs in the core call (``(positions,)``, ``(cos, sin)``, ...)."""
    token_dims: tuple[int | None, ...] = ()
    """The token dimension of each positional input (``None``: not per token)."""
    output_item: int | None = None
    """``None`` if the core returns the projection itself, else its index in the returned tuple."""
    output_len: int = 1
    scale: float | None = None
    """The attention call's ``scale`` when it is not ``1/sqrt(head_dim)`` (Granite's ``attention_multiplier``)."""
    window: int | None = None
    """The layer's causal sliding window (:func:`sliding_window`), ``None`` for global attention."""
    rows: tuple[tuple[int, ...] | None, tuple[int, ...] | None, tuple[int, ...] | None] = (None, None, None)
    """For q, k, v from one fused projection: each one's rows of the fused weight (:class:`~.program.FusedStart`)."""
    tail: Program | None = None
    """The block's code after the output projection inside the op's module (:func:`~.program.extract_tail`)."""
    tail_values: tuple[ArgRef, ...] = ()
    """The tail's inputs from the op module's call (a residual)."""
    tail_token_dims: tuple[int | None, ...] = ()
    """The token dimension of each tail input (``None``: not per token)."""
    head: Program | None = None
    """The core's own code from :attr:`hidden` to the projections' input, per token (ESM's attention normalises its
    input itself); ``None`` where q, k and v project :attr:`hidden`."""
    head_values: tuple[ArgRef, ...] = ()
    """The head's other inputs from the core's call."""
    head_token_dims: tuple[int | None, ...] = ()
    """The token dimension of each head input (``None``: not per token)."""
    softcap: float | None = None
    """Logit soft-capping of a written-out (eager) attention (Gemma 2)."""


@dataclass(frozen=True)
class MlpRoles:
    """The MLP op of a block."""

    core: str | None
    """Path of the sub-module computing the MLP, or ``None`` if the block computes it inline."""
    up: str
    down: str
    gate: str | None
    act: Callable[[torch.Tensor], torch.Tensor]
    opaque: bool = False
    """A mixture of experts (:func:`expert_core`): run whole on each rank's tokens, its projections unsplit."""
    rows: tuple[tuple[int, ...] | None, tuple[int, ...] | None] = (None, None)
    """For gate and up from one fused projection (Phi-3's ``gate_up_proj``): up's and gate's rows of its weight."""
    tail: Program | None = None
    """The code after the down projection inside the MLP's module (GPT-2's dropout)."""
    tail_values: tuple[ArgRef, ...] = ()
    """The tail's inputs from the MLP module's call."""
    tail_token_dims: tuple[int | None, ...] = ()
    """The token dimension of each tail input (``None``: not per token)."""


def is_projection(module: nn.Module) -> bool:
    """``nn.Linear``, transformers' ``Conv1D`` (GPT-2: a linear whose weight is stored ``[in, out]``), or a PEFT LoRA
    layer around one (:mod:`~lightning_paradyse.graph.adapters`)."""
    return isinstance(module, nn.Linear) or is_conv1d(module) or is_lora_linear(module)


def is_conv1d(module: nn.Module) -> bool:
    """A ``Conv1D``, or a LoRA layer around one."""
    module = base_layer(module)
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2


def projection_weight(module: nn.Module) -> torch.Tensor:
    """The projection's weight as ``nn.Linear`` holds it, ``[out, in]`` (a view for ``Conv1D``; a LoRA layer's base
    weight)."""
    module = base_layer(module)
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight.t() if is_conv1d(module) else weight


def out_features(module: nn.Module) -> int:
    return int(projection_weight(module).shape[0])


def no_activation(x: torch.Tensor) -> torch.Tensor:
    """The activation of an MLP the rewrite does not split (a mixture of experts runs its own)."""
    return x
