"""Hugging Face outputs beside the logits under the strategy: hidden states kept, attention weights refused.

* **Hidden states** (``output_hidden_states=True``). transformers 5 records them with hooks it installs per call from
  a registry of each model class's ``_can_record_outputs``, filled in ``PreTrainedModel.__init__``. A worker the
  ``spawn`` or ``forkserver`` launcher started unpickles the model without running ``__init__``, so the registry is
  empty there and every call returns ``hidden_states=None`` (a term guarded by ``is not None`` dropped, silently;
  Lightning's ``ddp_spawn`` has it too). :func:`register_output_capture` fills it in every process, as ``__init__``
  does. The blocks stay where they were (rewritten in place), so the hooks on them record every rank's tokens.
* **Attention weights** (``output_attentions=True``, or ``config.output_attentions``). They are recorded from the
  attention modules the rewrite replaces (the call returned none: a regulariser of them trained as zero, silently),
  and no rank holds a row's whole ``[s, s]`` scores: refused at the call, on every rank, before any collective of it
  (:func:`refuse_attention_weights`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch.nn as nn

ATTENTION_WEIGHTS_REFUSAL = (
    "the attention weights (output_attentions=True) are not returned under ParaDySeStrategy: the parallel modes "
    "compute the attention without forming the [s, s] scores of a whole sequence (each rank holds a slice of it), so "
    "no rank holds them; call the model without output_attentions (and config.output_attentions=False), or compute "
    "what needs them in one plain process from a checkpoint of the run"
)


def register_output_capture(module: nn.Module) -> None:
    """Register every Hugging Face model in ``module`` with transformers' output-capture registry, as its
    ``__init__`` does (a model unpickled in a spawned worker is not): ``output_hidden_states=True`` then returns the
    hidden states there too. Nothing where transformers is not imported."""
    if "transformers" not in sys.modules:
        return
    try:  # optional package; the registry is transformers 5's
        from transformers.modeling_utils import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        return
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel) and not _CAN_RECORD_REGISTRY.get(sub):
            _CAN_RECORD_REGISTRY[sub] = getattr(sub, "_can_record_outputs", None)


def refuse_attention_weights(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A forward pre-hook on the modules that own the blocks: refuse a call that asks for the attention weights (by
    keyword, or through the model's config); the same call on every rank, so every rank raises here."""
    asked = kwargs.get("output_attentions")
    if asked is None:
        asked = getattr(getattr(mod, "config", None), "output_attentions", False)
    if asked is True:
        raise ValueError(f"{type(mod).__name__} called with output_attentions=True: {ATTENTION_WEIGHTS_REFUSAL}")
