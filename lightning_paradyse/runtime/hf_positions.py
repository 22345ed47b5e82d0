"""Positions a Hugging Face model derives itself: from the token ids (RoBERTa's family), and packed documents read
from restarting ``position_ids``.

* **Positions from the token ids.** RoBERTa and the models built like it (XLM-RoBERTa, CamemBERT, Data2Vec text, ESM,
  ...) number a row's tokens ``padding_idx + 1, padding_idx + 2, ...`` with padding tokens at ``padding_idx``
  (``create_position_ids_from_input_ids``: a running count of the row's non-padding tokens). Called without
  ``position_ids``, the strategy's position hook gave them the global positions ``0, 1, ...`` of their tokens instead:
  every token read the position embedding ``padding_idx + 1`` rows off, and another model trained, silently (until
  2026-12-01). :func:`own_positions` finds the model's own numbering; the hook applies it to the whole batch's token
  ids and hands each rank its tokens' numbers.
* **Packed documents by ``position_ids``** (Hugging Face's ``DataCollatorWithFlattening``: one row of concatenated
  documents, positions restarting at 0 in each, no ``attention_mask``). A model whose masks come from
  ``transformers.masking_utils`` keeps each document's attention to itself when called with such ``position_ids``,
  no ``attention_mask`` and no key/value cache: a new document starts wherever a position is not the one before
  plus 1 (``find_packed_sequence_indices``). The parallel modes attended across the documents there, silently (until
  2026-12-01). :func:`hf_packing` says whether a call is such a call, and :func:`packed_documents` numbers its
  documents as Hugging Face does, for the modes' ``doc_ids``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

MASK_BUILDERS = (
    "create_causal_mask",
    "create_sliding_window_causal_mask",
    "create_chunked_causal_mask",
    "create_masks_for_generate",
)
"""``transformers.masking_utils``' functions that read packed documents from ``position_ids`` (a model's module that
imports one builds its masks with them)."""


def own_positions(owner: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """The numbering ``owner`` gives its tokens from their ids when called without ``position_ids`` (``[b, s]`` ids
    -> ``[b, s]`` positions), or ``None`` when it numbers them ``0, 1, ...`` (every other model).

    Found on an embeddings module that has a ``padding_idx`` and position embeddings and whose class (or its module)
    defines ``create_position_ids_from_input_ids(input_ids, padding_idx)``."""
    for sub in owner.modules():
        padding_idx = getattr(sub, "padding_idx", None)
        if not isinstance(padding_idx, int) or not isinstance(getattr(sub, "position_embeddings", None), nn.Embedding):
            continue
        make = getattr(type(sub), "create_position_ids_from_input_ids", None)
        if make is None:
            make = getattr(sys.modules.get(type(sub).__module__), "create_position_ids_from_input_ids", None)
        if callable(make):
            return functools.partial(_numbered, make, padding_idx)
    return None


def _numbered(make: Callable[[Tensor, int], Tensor], padding_idx: int, ids: Tensor) -> Tensor:
    return make(ids, padding_idx)  # [b, s] ids -> [b, s] positions


def embeds_positions(owner: nn.Module) -> int:
    """The first position ``owner`` numbers a row given as embeddings (``inputs_embeds``) from: ``padding_idx + 1``
    for the models of :func:`own_positions`, else 0."""
    for sub in owner.modules():
        padding_idx = getattr(sub, "padding_idx", None)
        if isinstance(padding_idx, int) and isinstance(getattr(sub, "position_embeddings", None), nn.Embedding):
            return padding_idx + 1
    return 0


def masks_packed_documents(owner: nn.Module) -> bool:
    """Whether ``owner`` (a Hugging Face model) builds its attention masks with ``transformers.masking_utils``, which
    reads packed documents from restarting ``position_ids`` (a ``transformers`` that has
    ``find_packed_sequence_indices``)."""
    if not hasattr(owner, "config"):
        return False
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        return False
    module = sys.modules.get(type(owner).__module__)
    imported = vars(module) if module is not None else {}
    builders = [getattr(masking, name) for name in MASK_BUILDERS if hasattr(masking, name)]
    return any(value is builder for value in imported.values() for builder in builders)


def uses_cache(owner: nn.Module, use_cache: Any) -> bool | None:
    """Whether a call of ``owner`` with ``use_cache=`` (``None``: not given) makes a key/value cache: ``True``,
    ``False``, or ``None`` where ``transformers``' versions differ (a cache asked for while gradient checkpointing
    trains, which recent versions turn off for the call and older ones after the masks are built)."""
    wanted = use_cache if use_cache is not None else getattr(getattr(owner, "config", None), "use_cache", False)
    if not wanted:
        return False
    if getattr(owner, "gradient_checkpointing", False) and owner.training and torch.is_grad_enabled():
        return None
    return True


def packed_documents(position_ids: Tensor) -> Tensor | None:
    """Hugging Face's documents of ``position_ids`` (``[b, s]``, ``[1, s]`` or ``[s]``): ``[b, s]`` ids counting the
    places where a position is not the one before plus 1, or ``None`` where no row has one."""
    rows = position_ids.reshape(-1, position_ids.shape[-1])  # [..., s] -> [b, s]
    first = rows[:, :1] - 1  # [b, 1]: the first position starts no new document
    starts = torch.diff(rows, prepend=first, dim=-1) != 1  # [b, s]
    if not bool(starts.any()):
        return None
    return starts.long().cumsum(-1)  # [b, s] document ids


def same_documents(a: Tensor, b: Tensor) -> bool:
    """Whether two ``[s]`` id tensors cut the sequence into the same documents (ids may differ)."""
    return bool(torch.equal(a[1:] != a[:-1], b[1:].to(a.device) != b[:-1].to(a.device)))
