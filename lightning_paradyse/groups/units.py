"""The units of a training batch that groups share out: its rows, or the documents of a packed batch.

An ordinary batch ``[b, s, ...]`` of several sequences (padded on the right or not) is dealt row by row: a group
trains the batch of its rows, cut to its longest row's real tokens. A packed batch (``doc_ids``, batch size 1) is
dealt document by document: a group trains its documents packed into one sequence. :class:`Units` describes
either and cuts a group's batch out of the global one; every rank computes the same from the batch alone.

Cutting is exact: rows are independent sequences; right padding past a group's longest row is never computed,
which changes no real token of a causal model (refused otherwise by
:func:`~lightning_paradyse.runtime.slicing.find_padding`)
and drops only padding, whose targets are ignored (checked by
:func:`~lightning_paradyse.runtime.slicing.check_padding_targets`). Labels a model shifts itself are shifted over the
global batch first, then cut (:meth:`Units.shifted_sources`): a row's last kept token keeps its target.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_paradyse.distributed.devices import to_device
from lightning_paradyse.modes.specs import document_bounds
from lightning_paradyse.runtime.slicing import (
    IGNORE_INDEX,
    PAD_MASK_KEYS,
    TARGET_KEYS,
    TOKEN_1D_KEYS,
    BatchInfo,
    find_tokens,
    shifted_labels,
)

ALIGNED_KEYS = (*PAD_MASK_KEYS, *TARGET_KEYS, *TOKEN_1D_KEYS, "shift_labels", "token_type_ids")
"""Keys of a dict batch's ``[b, s]`` tensors padded where the tokens are (their padding holds nothing a loss reads:
the targets' is -100, checked), beside the tokens themselves
(:func:`~lightning_paradyse.runtime.slicing.find_tokens`): a group may cut its rows' padding off them.
Any other tensor of ``b`` rows (a second sequence padded otherwise, per-token loss weights, a per-row value) keeps
every row's columns."""


@dataclass(frozen=True)
class Units:
    """The rows or documents of one global batch ``[b, s]``, with their real lengths."""

    packed: bool
    """Documents of a packed batch (``True``) or rows of a batch of sequences (``False``)."""
    lengths: tuple[int, ...]
    """Real tokens of every unit (a row's tokens before its right padding; a document's tokens)."""
    spans: tuple[tuple[int, int], ...]
    """Packed: every document's ``(start, stop)`` in the sequence. Rows: ``(0, length)`` per row."""
    b: int
    s: int

    @classmethod
    def of(cls, info: BatchInfo, batch: Any = None) -> Units | None:
        """The batch's units, or ``None`` when it holds a single document (nothing to share out). A single row is one
        unit: the groups may run it on fewer ranks than all, leaving the others idle (:meth:`cut`).

        A padded row's unit is its real tokens, unless ``batch`` (a dict) holds a tensor of ``b`` rows other than
        those :data:`ALIGNED_KEYS` name: then every row keeps its ``s`` columns, padding included (computed exactly,
        as a step on one group computes it). Until 2026-12-01 such a tensor was cut to the tokens' longest real row
        in the group: the real tokens of a second sequence padded otherwise (a preference pair's rejected answer)
        were dropped, silently (``tests/exact`` case ``pairs-padded-apart``)."""
        if info.doc_ids is not None:
            spans = tuple(document_bounds(info.doc_ids, info.seq_len))
            if len(spans) < 2:
                return None
            return cls(True, tuple(b - a for a, b in spans), spans, 1, info.seq_len)
        if info.padding is None or _holds_unaligned(batch, info.batch):
            lengths = (info.seq_len,) * info.batch
        else:
            real = (~info.padding).sum(dim=1).tolist()  # right padding: the real tokens come first
            lengths = tuple(max(1, int(n)) for n in real)
        return cls(False, lengths, tuple((0, n) for n in lengths), info.batch, info.seq_len)

    def length(self, members: Sequence[int]) -> int:
        """The sequence length of the group's batch: its documents' total, or its longest row."""
        picked = [self.lengths[i] for i in members]
        return sum(picked) if self.packed else max(picked)

    @property
    def shortest(self) -> int:
        """The shortest unit (the first of them): an idle group's placeholder row."""
        return min(range(len(self.lengths)), key=lambda i: (self.lengths[i], i))

    def cut(self, batch: Any, members: Sequence[int], idle_tokens: int = 1) -> Any:
        """The group's batch: packed, its documents in the order ``members`` (every ``[1, s, ...]`` and per-token
        ``[s]`` tensor cut); rows, its rows (every tensor whose first dimension is ``b``) cut to
        :meth:`length` tokens (also the per-token ``[s]`` entries of a dict).

        No ``members`` (rows only): an idle group's placeholder, the first ``idle_tokens`` tokens of the
        :attr:`shortest` row. Its step runs like any other (hooks and collectives of the module's step run on every
        rank) and the strategy weighs its loss by 0."""
        if not members:
            if self.packed:
                raise ValueError("a packed batch leaves no group idle: every group packs at least one document")
            rows = torch.tensor([self.shortest], dtype=torch.long)
            return _cut(batch, self.b, self.s, lambda t, dim: t.narrow(dim, 0, idle_tokens), rows)
        if self.packed:
            index = torch.cat([torch.arange(*self.spans[d]) for d in members])  # [s_group] token indices
            return _cut(batch, self.b, self.s, lambda t, dim: t.index_select(dim, to_device(index, t.device)), None)
        rows = torch.tensor(list(members), dtype=torch.long)
        n = self.length(members)
        return _cut(batch, self.b, self.s, lambda t, dim: t.narrow(dim, 0, n), rows)

    def shifted_sources(
        self, batch: Any, members: Sequence[int], idle_tokens: int = 1
    ) -> dict[str, tuple[Tensor, int, int]]:
        """Per ``[b, s]`` tensor of the batch (a dict's entries by key; a tuple's or list's, or the batch itself, as
        ``#i``: the keys of :class:`~lightning_paradyse.runtime.slicing.BatchSource`): the global batch's labels
        shifted left by one (as a label-shifting model computes them) cut to the group (:meth:`cut`), their real
        count in the whole batch, and the real count of the labels as given (unshifted) in the whole batch.

        (Until 2026-11-30 a tuple or list batch got none: a Hugging Face model handed ``labels=batch[1]`` on a step
        on groups divided by its group's count, and trained at twice one process's loss, silently.)"""
        if isinstance(batch, Mapping):
            named: list[tuple[str, Any]] = [(str(k), v) for k, v in batch.items()]
        elif isinstance(batch, Tensor):
            named = [("#0", batch)]
        elif isinstance(batch, Sequence) and not isinstance(batch, str):
            named = [(f"#{i}", v) for i, v in enumerate(batch)]
        else:
            return {}
        whole = {
            k: v for k, v in named if isinstance(v, Tensor) and v.dim() == 2 and tuple(v.shape) == (self.b, self.s)
        }
        shifted = {k: shifted_labels(v) for k, v in whole.items()}  # shifted over the whole batch, then cut
        cut = self.cut(shifted, members, idle_tokens)
        return {
            k: (cut[k].contiguous(), int((shifted[k] != IGNORE_INDEX).sum()), int((whole[k] != IGNORE_INDEX).sum()))
            for k in shifted
        }


def _holds_unaligned(batch: Any, b: int) -> bool:
    """Whether a dict ``batch`` holds a tensor of ``b`` rows (and a dimension beyond them) other than its tokens that
    no key of :data:`ALIGNED_KEYS` names."""
    if not isinstance(batch, Mapping):
        return False
    tokens = find_tokens(batch)
    return any(
        isinstance(v, Tensor) and v.dim() >= 2 and v.shape[0] == b and v is not tokens and k not in ALIGNED_KEYS
        for k, v in batch.items()
    )


def _cut(batch: Any, b: int, s: int, tokens: Any, rows: Tensor | None) -> Any:
    """Every ``[b, s, ...]`` tensor: rows picked (``rows``), then its tokens cut by ``tokens(t, dim)``; the per-token
    ``[s]`` entries of a dict (:data:`~lightning_paradyse.runtime.slicing.TOKEN_1D_KEYS`) cut alike; with ``rows``,
    other tensors whose first dimension is ``b``, and a dict's lists and tuples of ``b`` values without a tensor (a
    collator's per-row ids, strings or weights), lose the other rows. Slices are contiguous (a step may ``view``
    them). (Until 2026-11-30 such a list kept every row on a step on groups: a step zipping it with its rows crashed.)
    """

    def cut(t: Tensor) -> Tensor:
        if rows is not None and t.dim() >= 1 and t.shape[0] == b:
            t = t.index_select(0, to_device(rows, t.device))  # [b, ...] -> [b_g, ...]
            if t.dim() >= 2 and t.shape[1] == s:
                t = tokens(t, 1)  # [b_g, s, ...] -> [b_g, s_g, ...]
            return t.contiguous()
        if rows is None and t.dim() >= 2 and tuple(t.shape[:2]) == (b, s):
            return tokens(t, 1).contiguous()  # [1, s, ...] -> [1, s_g, ...]
        return t

    if isinstance(batch, Mapping):
        out = {}
        for k, v in batch.items():
            if k in TOKEN_1D_KEYS and isinstance(v, Tensor) and tuple(v.shape) == (s,):
                out[k] = tokens(v, 0).contiguous()  # [s] -> [s_g]
            elif rows is not None and _per_row(v, b):
                picked = [v[i] for i in rows.tolist()]  # b values -> b_g, in the group's row order
                out[k] = picked if isinstance(v, list) else type(v)(picked)
            else:
                out[k] = apply_to_collection(v, Tensor, cut)
        return out  # as shard_batch hands a mapping on: a dict
    return apply_to_collection(batch, Tensor, cut)


def _per_row(value: Any, b: int) -> bool:
    """A list or tuple (not a named tuple) of ``b`` values none of which holds a tensor: one value per row."""
    if not isinstance(value, (list, tuple)) or hasattr(value, "_fields") or len(value) != b:
        return False
    found: list[bool] = []
    apply_to_collection(value, Tensor, lambda t: found.append(True))
    return not found


__all__ = ["Units"]
