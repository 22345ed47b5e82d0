"""ESM's token dropout, counted over the whole row.

ESM's embeddings (``EsmEmbeddings`` with ``token_dropout``, on in ESM-2's configurations) zero the embeddings of the
mask tokens and scale a row's embeddings by ``(1 - 0.15 * 0.8) / (1 - r)``, ``r`` the row's share of mask tokens
(over its ``attention_mask``'s count of tokens, else over its length), in training and evaluation alike. On a rank's
slice of the row that share would be the slice's own: each rank would scale its tokens by another factor than one
process does. :func:`dropping_modules` finds such modules; :func:`dropped_embeddings` makes a slice's embeddings with
the share of its whole row, which the strategy hands the module in place of its own token dropout.
"""

from __future__ import annotations

import torch.nn as nn
from torch import Tensor

TRAINED_RATIO = 0.15 * 0.8
"""The share of mask tokens ESM was trained with (a constant of its embeddings' ``forward``)."""


def dropping_modules(owner: nn.Module) -> list[nn.Module]:
    """The modules under ``owner`` that drop mask tokens so: a ``token_dropout`` switch, an integer
    ``mask_token_id`` and ``nn.Embedding`` word embeddings (ESM's embeddings). Their switch is read at each call."""
    return [
        sub
        for sub in owner.modules()
        if hasattr(sub, "token_dropout")
        and isinstance(getattr(sub, "mask_token_id", None), int)
        and isinstance(getattr(sub, "word_embeddings", None), nn.Embedding)
    ]


def dropped_embeddings(mod: nn.Module, ids: Tensor, whole_ids: Tensor, whole_tokens: Tensor | int) -> Tensor:
    """The embeddings ``mod`` makes of a slice ``ids`` ``[b, s_r]`` of the rows ``whole_ids`` ``[b, s]`` with its
    token dropout on, the share of mask tokens counted over the whole rows (``whole_tokens``: their count of tokens,
    ``[b]`` or the length ``s``), in the dtypes ``mod`` computes it in (the share in float32)."""
    mask_id: int = getattr(mod, "mask_token_id")  # noqa: B009 (an attribute of the user's module)
    words: nn.Embedding = getattr(mod, "word_embeddings")  # noqa: B009
    share = (whole_ids == mask_id).sum(-1).float() / whole_tokens  # [b, s] -> [b]: each row's share, float32
    embeddings = words(ids)  # [b, s_r] -> [b, s_r, h]
    embeddings = embeddings.masked_fill((ids == mask_id)[..., None], 0.0)  # mask tokens zeroed
    scaled = embeddings * (1 - TRAINED_RATIO) / (1 - share)[:, None, None]  # [b, s_r, h] * [b, 1, 1]
    return scaled.to(embeddings.dtype)
