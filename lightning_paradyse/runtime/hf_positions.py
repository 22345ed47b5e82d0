"""Positions a Hugging Face model derives itself: from the token ids (RoBERTa's family), and packed documents read
from restarting ``position_ids``.

* **Positions from the token ids.** RoBERTa and the models built like it (XLM-RoBERTa, CamemBERT, Data2Vec text,
  ...) number a row's tokens ``padding_idx + 1, padding_idx + 2, ...`` with padding tokens at ``padding_idx``
  (``create_position_ids_from_input_ids``: a running count of the row's non-padding tokens). Called without
  ``position_ids``, the strategy's position hook gave them the global positions ``0, 1, ...`` of their tokens instead:
  every token read the position embedding ``padding_idx + 1`` rows off, and another model trained, silently (until
  2026-12-01). :func:`own_positions` finds the model's own numbering; the hook applies it to the whole batch's token
  ids and hands each rank its tokens' numbers.
* **Packed documents by ``position_ids``** (Hugging Face's ``DataCollatorWithFlattening``: one row of concatenated
  documents, positions restarting at 0 in each, no ``attention_mask``). A causal model whose masks come from
  ``transformers.masking_utils`` keeps each document's attention to itself when called with such ``position_ids``,
  no ``attention_mask`` and no key/value cache: a new document starts wherever a position is not the one before
  plus 1 (``find_packed_sequence_indices``). The parallel modes attended across the documents there, silently (until
  2026-12-01). Whether a call's masks keep them apart depends on the model, its configuration and ``transformers``'
  version, so it is not guessed: :func:`watch_packing` sees the masks ask for the documents, and
  :func:`packed_documents` numbers them as Hugging Face does over the whole row, for the modes' ``doc_ids``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

PACKING_HOOK = "find_packed_sequence_indices"
"""The function of ``transformers.masking_utils`` its masks call (a global of that module) exactly when they keep
packed documents apart: a call given ``position_ids``, no ``attention_mask`` and no cache, of a model whose masks
read the positions (a causal mask built with them; not a bidirectional one, nor one built without them)."""


NUMBERING = "create_position_ids_from_input_ids"
"""The name of the function that numbers a row's tokens from their ids (RoBERTa's family)."""


@dataclass(frozen=True)
class Numbering:
    """A model's own numbering of its tokens (:func:`own_positions`)."""

    of_ids: Callable[[Tensor], Tensor]
    """``[b, s]`` token ids -> ``[b, s]`` positions."""
    embeds_start: int
    """The first position of a row given as embeddings (``inputs_embeds``)."""


def own_positions(owner: nn.Module) -> Numbering | None:
    """The numbering ``owner`` gives its tokens from their ids when called without ``position_ids``, or ``None`` when
    it numbers them ``0, 1, ...`` (every other model).

    Found on an embeddings module that has an integer ``padding_idx`` and ``nn.Embedding`` position embeddings, and
    ``create_position_ids_from_input_ids(input_ids, padding_idx)`` as a method (static or not) or in the module of
    its class or of a base class; a row given as embeddings is numbered from ``padding_idx + 1``."""
    for sub in owner.modules():
        padding_idx = getattr(sub, "padding_idx", None)
        if not isinstance(padding_idx, int) or not isinstance(getattr(sub, "position_embeddings", None), nn.Embedding):
            continue
        make = getattr(sub, NUMBERING, None)  # bound: a static method and a method alike
        if make is None:  # else a function of the module of its class or of a base class
            found = (getattr(sys.modules.get(cls.__module__), NUMBERING, None) for cls in type(sub).__mro__)
            make = next((f for f in found if f is not None), None)
        if callable(make):
            return Numbering(functools.partial(_numbered, make, padding_idx), padding_idx + 1)
    return None


def _numbered(make: Callable[[Tensor, int], Tensor], padding_idx: int, ids: Tensor) -> Tensor:
    return make(ids, padding_idx)  # [b, s] ids -> [b, s] positions


def watch_packing(asked: Callable[[Tensor], None]) -> Callable[[], None]:
    """Have ``asked(position_ids)`` called whenever ``transformers``' masks read packed documents from the
    ``position_ids`` they are given (:data:`PACKING_HOOK`, replaced until the returned function is called, which
    restores it; nothing is replaced where ``transformers`` is not imported or has no packing). The masks are built
    at the model's entry, before any block runs, and every rank runs the same code: ``asked`` runs alike on every
    rank, before any collective of the call."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, PACKING_HOOK, None)
    if masking is None or original is None:
        return _nothing

    def watched(position_ids: Tensor, *args: Any, **kwargs: Any) -> Tensor | None:
        asked(position_ids)
        return original(position_ids, *args, **kwargs)  # the model's own local mask (the modes apply the documents)

    setattr(masking, PACKING_HOOK, watched)
    return functools.partial(setattr, masking, PACKING_HOOK, original)


def _nothing() -> None:
    return None


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
