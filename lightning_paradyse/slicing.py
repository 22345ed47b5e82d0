"""Slicing the global batch: where its tokens and targets are, how it is validated, and each rank's slice of it.

Conventions (those of common language-model data): the tokens are the batch itself, the first tensor of a
tuple/list, or a dict entry named in :data:`TOKEN_KEYS`; the targets a dict entry named in :data:`TARGET_KEYS`
or the last tensor of a tuple/list of two or more (``-100`` marks no target). ``labels`` means the Hugging
Face convention (the model shifts them). :func:`describe_batch` validates a batch and describes it
(:class:`BatchInfo`) without any collective, so a bad batch raises alike on every rank; :func:`shard_batch`
gives a rank its tokens of every ``[b, s, ...]`` tensor along the unified layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_paradyse.layout import SeqLayout

IGNORE_INDEX = -100
"""Target value of a token that is not a real target (padding, prompt): the cross-entropy default."""
TOKEN_KEYS = ("input_ids", "tokens", "idx", "input", "inputs", "x")
"""Keys of the token tensor in a dict batch, first match wins (else the first tensor)."""
TARGET_KEYS = ("labels", "targets", "target", "y")
"""Keys of the target tensor in a dict batch (else: the last tensor of a tuple or list batch)."""
TOKEN_1D_KEYS = ("positions", "position_ids", "doc_ids")
"""Keys of per-token ``[s]`` tensors in a dict batch (packed sequences), sliced like the tokens."""


@dataclass(frozen=True)
class BatchInfo:
    """What the strategy knows about the current global batch (identical on every rank but ``n_local``)."""

    batch: int
    """Sequences ``b`` in the batch."""
    seq_len: int
    """Global sequence length ``s``."""
    layout: SeqLayout
    """Which tokens each rank holds."""
    n_local: int
    """Real target tokens on this rank (``targets != -100``; every token when there are no targets)."""
    n_global: int
    """Real target tokens in the whole batch."""
    checksum: int
    """A cheap fingerprint of the token ids (ranks compare it to catch diverging data)."""
    shift_labels: Tensor | None = None
    """HF-style batches: this rank's slice of ``labels[:, 1:]`` padded with -100 at the end."""
    n_shift_labels: int | None = None
    """HF-style batches: real shifted labels in the whole batch."""
    doc_ids: Tensor | None = None
    """Packed batches: the document id of every token ``[s]`` (attention stays inside each document)."""
    skip: bool = False
    """No plan fits the memory budget and the strategy was told to skip such batches."""


def find_tokens(batch: Any) -> Tensor:
    """The token tensor ``[b, s, ...]`` of a batch: a tensor, a dict (:data:`TOKEN_KEYS`) or a sequence."""
    if isinstance(batch, Tensor):
        tensors = [batch]
    elif isinstance(batch, Mapping):
        named = [batch[k] for k in TOKEN_KEYS if isinstance(batch.get(k), Tensor)]
        tensors = named or [v for v in batch.values() if isinstance(v, Tensor)]
    elif isinstance(batch, Sequence):
        tensors = [v for v in batch if isinstance(v, Tensor)]
    else:
        tensors = []
    if not tensors or tensors[0].dim() < 2:
        raise TypeError(
            f"ParaDySeStrategy cannot find the token tensor [batch, seq] in a batch of type {type(batch).__name__}: "
            f"yield a tensor, a tuple/list whose first tensor holds the tokens, or a dict with one of {TOKEN_KEYS}"
        )
    return tensors[0]


def find_targets(batch: Any) -> tuple[str | None, Tensor | None]:
    """``(key, targets)``: a dict's :data:`TARGET_KEYS` entry, or the last of two or more tensors of a sequence."""
    if isinstance(batch, Mapping):
        for key in TARGET_KEYS:
            if isinstance(batch.get(key), Tensor):
                return key, batch[key]
        return None, None
    if isinstance(batch, Sequence) and not isinstance(batch, (str, Tensor)):
        tensors = [v for v in batch if isinstance(v, Tensor)]
        if len(tensors) >= 2:
            return None, tensors[-1]
    return None, None


def shard_batch(batch: Any, info: BatchInfo, rank: int) -> Any:
    """This rank's tokens of every tensor of ``batch`` whose dims 0, 1 are ``[b, s]``, and of the per-token
    ``[s]`` entries of a dict batch (:data:`TOKEN_1D_KEYS`); other values unchanged."""

    def cut(t: Tensor) -> Tensor:
        if t.dim() >= 2 and tuple(t.shape[:2]) == (info.batch, info.seq_len):
            return info.layout.shard(t, rank)  # [b, s, ...] -> [b, s_r, ...]
        return t

    if isinstance(batch, Mapping):
        per_token = {
            k: info.layout.shard(v, rank, dim=0)  # [s] -> [s_r]
            for k, v in batch.items()
            if k in TOKEN_1D_KEYS and isinstance(v, Tensor) and tuple(v.shape) == (info.seq_len,)
        }
        return {k: per_token[k] if k in per_token else apply_to_collection(v, Tensor, cut) for k, v in batch.items()}
    return apply_to_collection(batch, Tensor, cut)


def find_doc_ids(batch: Any, b: int, s: int) -> Tensor | None:
    """The ``doc_ids`` ``[s]`` of a packed dict batch (batch size 1), or ``None``."""
    doc_ids = batch.get("doc_ids") if isinstance(batch, Mapping) else None
    if not isinstance(doc_ids, Tensor):
        return None
    if b != 1 or tuple(doc_ids.shape) != (s,):
        raise ValueError(
            f"a packed batch needs batch size 1 and doc_ids of shape ({s},), got batch {b} and doc_ids "
            f"{tuple(doc_ids.shape)}: pack the documents of a batch into one sequence"
        )
    return doc_ids


def checksum(tokens: Tensor) -> int:
    """A position-weighted sum of the token ids: equal on ranks that hold the same batch."""
    t = tokens.long().reshape(tokens.shape[0], tokens.shape[1], -1)  # [b, s, ...] -> [b, s, rest]
    weights = torch.arange(1, t.shape[1] + 1, device=t.device).view(1, -1, 1)
    return int((t * weights).sum())


def target_counts(targets: Tensor | None, layout: SeqLayout, b: int, s: int) -> list[int]:
    """Real target tokens held by each rank (all tokens when the batch has no ``[b, s]`` targets)."""
    if targets is None or targets.dim() < 2 or tuple(targets.shape[:2]) != (b, s):
        return [b * n for n in layout.local_lens]
    valid = targets != IGNORE_INDEX
    return [int(layout.shard(valid, r).sum()) for r in range(layout.world)]


def shifted_labels(labels: Tensor) -> Tensor:
    """``labels[:, 1:]`` padded with -100 at the end: the targets a label-shifting model computes."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def describe_batch(
    batch: Any, p: int, rank: int, causal: bool, max_seq_len: int | None = None, mean_loss: bool = True
) -> BatchInfo:
    """Validate a global batch for ``p`` ranks and describe it (no collective: raises alike on every rank).

    Raises:
        ValueError: For a batch longer than ``max_seq_len``, shorter than ``p``, without real targets, or (for a
            mean loss) with a rank holding no real target.
    """
    tokens = find_tokens(batch)
    b, s = int(tokens.shape[0]), int(tokens.shape[1])
    if max_seq_len is not None and s > max_seq_len:
        raise ValueError(
            f"a batch of length {s} exceeds ParaDySeStrategy(max_seq_len={max_seq_len}): "
            f"cut or drop longer sequences in the data, or raise max_seq_len"
        )
    if s < p:
        raise ValueError(f"a batch of length {s} is shorter than the {p} processes: every rank needs a token")
    layout = SeqLayout.for_sequence(s, p, causal)
    key, targets = find_targets(batch)
    counts = target_counts(targets, layout, b, s)
    _check_counts(counts, s, mean_loss and key != "labels")
    doc_ids = find_doc_ids(batch, b, s)
    if key == "labels" and targets is not None:
        shifted = shifted_labels(targets)
        local, n_shift = layout.shard(shifted, rank), int((shifted != IGNORE_INDEX).sum())
        return BatchInfo(b, s, layout, counts[rank], sum(counts), checksum(tokens), local, n_shift, doc_ids)
    return BatchInfo(b, s, layout, counts[rank], sum(counts), checksum(tokens), doc_ids=doc_ids)


def _check_counts(counts: list[int], seq_len: int, every_rank: bool) -> None:
    if sum(counts) == 0:
        raise ValueError(f"a batch of length {seq_len} has no real target token (all targets are -100)")
    empty = [r for r, n in enumerate(counts) if n == 0]
    if empty and every_rank:
        raise ValueError(
            f"rank(s) {empty} hold no real target token of this batch of length {seq_len}, so their mean loss "
            f"is undefined; use ParaDySeStrategy(loss_reduction='sum') with a summed loss, or less padding"
        )


__all__ = [
    "IGNORE_INDEX",
    "TARGET_KEYS",
    "TOKEN_1D_KEYS",
    "TOKEN_KEYS",
    "BatchInfo",
    "checksum",
    "describe_batch",
    "find_doc_ids",
    "find_targets",
    "find_tokens",
    "shard_batch",
    "shifted_labels",
    "target_counts",
]
