"""PEFT LoRA layers on a block's projections: what the rewrite reads of them, and what it refuses.

A LoRA layer (``peft``'s ``lora.Linear`` around an ``nn.Linear`` or transformers' ``Conv1D``) computes
``base(x) + B(A(x)) * scale``. The rewrite treats it as one projection: its weight (and bias) are the base layer's,
and the adapter's ``A [r, in]``, ``B [out, r]`` and ``scale`` go to the modes, which add the branch to the
projection they compute (:mod:`lightning_paradyse.modes.adapters`). What a mode could not compute exactly is refused
by name (:func:`lora_parts`): dropout on the branch, DoRA, a bias on ``B``, several adapters, a merged adapter, other
PEFT methods. The layer's switch (``model.disable_adapter()``, ``enable_adapter_layers``) stays live: peft finds a
parameter-free stand-in of the layer in the rewritten model (:func:`switch_for`), and the dispatch reads it on every
call; merging through it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn


@dataclass(frozen=True)
class LoraParts:
    """The one adapter of a LoRA projection."""

    adapter: str
    """The adapter's name (``default``): its parameters are ``lora_A.<adapter>.weight``, ``lora_B.<adapter>.weight``."""
    a: torch.Tensor
    """``A``, ``[r, in]``."""
    b: torch.Tensor
    """``B``, ``[out, r]``."""
    scale: float
    """``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA)."""


def is_peft_layer(module: nn.Module) -> bool:
    """Any PEFT tuner layer (LoRA, DoRA, IA3, LoHa, ...): a subclass of peft's ``BaseTunerLayer``."""
    return any(c.__name__ == "BaseTunerLayer" and c.__module__.startswith("peft.") for c in type(module).__mro__)


def is_lora_linear(module: nn.Module) -> bool:
    """peft's LoRA ``Linear`` (exactly that class: AdaLoRA's and the quantized ones derive from others) around an
    ``nn.Linear`` or a ``Conv1D``; whether its settings are supported is :func:`lora_parts`' to say."""
    kind = type(module)
    if kind.__name__ != "Linear" or kind.__module__ != "peft.tuners.lora.layer":
        return False
    base = getattr(module, "base_layer", None)
    return isinstance(base, nn.Linear) or (
        type(base).__name__ == "Conv1D" and isinstance(base, nn.Module) and next(base.children(), None) is None
    )


def base_layer(module: nn.Module) -> nn.Module:
    """The projection a LoRA layer wraps, else the module itself."""
    return module.base_layer if is_lora_linear(module) else module  # type: ignore[return-value]


def lora_parts(module: Any) -> LoraParts | None:
    """The adapter of a LoRA projection (``None`` for a module that is not one). Raises ``ValueError`` naming what
    the modes cannot compute exactly, and the fix."""
    if not is_peft_layer(module):
        return None
    kind = f"{type(module).__module__}.{type(module).__name__}"
    if not is_lora_linear(module):
        raise ValueError(
            f"a PEFT layer ({kind}) of a kind the modes do not compute (they compute LoRA on nn.Linear and Conv1D "
            f"projections); use LoraConfig (LoRA) on the attention and MLP projections, or train this model with "
            f"Lightning's DDP or FSDP strategy"
        )
    names = sorted(module.lora_A.keys())
    active = list(module.active_adapters)
    if len(names) != 1 or active != names:
        raise ValueError(
            f"a LoRA layer with adapters {names} of which {active} are active: the modes compute one adapter; "
            f"keep one adapter on the model for this strategy"
        )
    (adapter,) = names
    why = _unsupported(module, adapter)
    if why:
        raise ValueError(f"a LoRA layer with {why}")
    return LoraParts(
        adapter, module.lora_A[adapter].weight, module.lora_B[adapter].weight, float(module.scaling[adapter])
    )


def _unsupported(module: Any, adapter: str) -> str:
    if module.merged:
        return "its adapter merged into the base weight: unmerge it (model.unmerge_adapter()) before the fit"
    if not isinstance(module.lora_dropout[adapter], nn.Identity):
        return "dropout on the adapter's input (lora_dropout > 0): set LoraConfig(lora_dropout=0.0)"
    if module.use_dora.get(adapter, False) or adapter in getattr(module, "lora_variant", {}):
        return "a variant of LoRA (DoRA, use_dora=True, and the like) the modes do not compute: use plain LoRA"
    if module.lora_bias.get(adapter, False) or module.lora_B[adapter].bias is not None:
        return "a bias on B (lora_bias=True): set LoraConfig(lora_bias=False)"
    if module.lora_A[adapter].bias is not None:
        return "a bias on A"
    return ""


def switch_for(layer: nn.Module, parts: LoraParts) -> nn.Module:
    """A parameter-free stand-in of ``layer`` that peft's adapter switches find in the model (a ``BaseTunerLayer``):
    ``disable_adapter()`` and ``enable_adapter_layers()`` set its flag as they set the layer's, which the dispatch
    reads on every call; merging through it is refused (the base weight is sharded)."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # optional package: present, since ``layer`` is peft's

    class AdapterSwitch(nn.Module, BaseTunerLayer):  # type: ignore[misc]
        """Where peft's switches of a rewritten LoRA projection land."""

        adapter_layer_names: tuple[str, ...] = ()

        def __init__(self) -> None:
            nn.Module.__init__(self)
            self._active_adapter = parts.adapter
            self._disable_adapters = bool(layer.disable_adapters)
            self.merged_adapters: list[str] = []

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            raise ValueError(
                "merging a LoRA adapter into its base weight during a fit under ParaDySeStrategy: each rank holds a "
                "shard of that weight; merge in one plain process from a checkpoint of the run (merge_and_unload())"
            )

        def unmerge(self) -> None:
            return None

        @property
        def adapted(self) -> bool:
            """Whether the branch runs now: adapters enabled and this one active."""
            return not self._disable_adapters and parts.adapter in self.active_adapters

    return AdapterSwitch()
