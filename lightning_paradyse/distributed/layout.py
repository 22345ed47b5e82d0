"""The unified sequence layout shared by every parallel mode.

At every block boundary each rank of a group of size ``p`` holds ``s_r`` tokens of the sequence,
``[b, s_r, h]``, with ``sum(s_r) == s``. Every mode reads and writes this one layout, which is why a
plan may switch modes between blocks (or between the attention and MLP of one block) with no data
movement.

Two token orders exist, chosen once per batch and shared by all modes:

* ``contiguous``: the sequence is cut into ``p`` chunks; rank ``r`` holds chunk ``r``.
* ``balanced`` (causal attention): the sequence is cut into ``2p`` chunks; rank ``r`` holds chunks
  ``r`` and ``2p - 1 - r`` (the "zigzag" or head-tail order), so every rank does the same causal
  attention work in ring attention.

Lengths need not be divisible by ``p``: chunk sizes differ by at most one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous pieces of ``n`` items, the first ``n % parts`` one larger."""
    if parts <= 0:
        raise ValueError(f"cannot split into {parts} parts: the number of parts must be positive")
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split_offsets(n: int, parts: int) -> list[int]:
    """Start offsets of the pieces of :func:`split_sizes` plus the end, ``len == parts + 1``."""
    offsets = [0]
    for size in split_sizes(n, parts):
        offsets.append(offsets[-1] + size)
    return offsets


@dataclass(frozen=True)
class SeqLayout:
    """Which tokens of a length-``seq_len`` sequence each of ``world`` ranks holds."""

    seq_len: int
    """Number of tokens in the (global) sequence."""
    world: int
    """Size ``p`` of the group that shares the sequence."""
    balanced: bool = False
    """Use the load-balanced head-tail order (for causal attention) instead of contiguous chunks."""

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"the group size must be at least 1, got {self.world}")
        if self.seq_len < self.world:
            raise ValueError(
                f"the sequence has {self.seq_len} tokens but the group has {self.world} ranks: every rank "
                f"needs at least one token. Use fewer processes or longer sequences."
            )
        if self.balanced and self.seq_len < 2 * self.world:
            raise ValueError(
                f"the balanced layout needs at least 2*p = {2 * self.world} tokens, got {self.seq_len}; "
                f"use SeqLayout.for_sequence(...), which falls back to contiguous chunks"
            )

    @classmethod
    def for_sequence(cls, seq_len: int, world: int, causal: bool) -> SeqLayout:
        """The layout every mode uses for one batch: balanced for causal attention when possible."""
        return cls(seq_len, world, balanced=causal and world > 1 and seq_len >= 2 * world)

    @cached_property
    def _segments(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        if not self.balanced:
            off = split_offsets(self.seq_len, self.world)
            return tuple(((off[r], off[r + 1]),) for r in range(self.world))
        off = split_offsets(self.seq_len, 2 * self.world)
        last = 2 * self.world - 1
        return tuple(((off[r], off[r + 1]), (off[last - r], off[last - r + 1])) for r in range(self.world))

    def segments(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The ``(start, stop)`` ranges of global positions held by ``rank``, in local order."""
        return self._segments[rank]

    def local_len(self, rank: int) -> int:
        """Number of tokens ``s_r`` held by ``rank``."""
        return sum(stop - start for start, stop in self._segments[rank])

    @cached_property
    def local_lens(self) -> tuple[int, ...]:
        """``s_r`` for every rank."""
        return tuple(self.local_len(r) for r in range(self.world))

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global position ids of the tokens of ``rank``, ``[s_r]``, in local order."""
        parts = [torch.arange(a, b, device=device) for a, b in self._segments[rank]]
        return torch.cat(parts)

    @cached_property
    def gathered_positions_list(self) -> tuple[int, ...]:
        """Global positions in the order an all-gather of the local chunks produces (rank 0 first)."""
        out: list[int] = []
        for r in range(self.world):
            for a, b in self._segments[r]:
                out.extend(range(a, b))
        return tuple(out)

    def gathered_positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[s]`` positions after an all-gather; index a natural-order tensor with it to reorder (made once per
        device and kept: read it, never write to it)."""
        return self._index("gathered", device)

    def natural_index(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[s]`` index that turns a gathered-order tensor into natural (position) order (kept like
        :meth:`gathered_positions`)."""
        return self._index("natural", device)

    @cached_property
    def _indices(self) -> dict[tuple[str, torch.device], torch.Tensor]:
        return {}

    def _index(self, kind: str, device: torch.device | str | None) -> torch.Tensor:
        """The ``kind`` index on ``device``: made on the host once, its copy onto a GPU queued without blocking (a
        blocking one would synchronise the host in every layer that reorders tokens)."""
        where = torch.device("cpu" if device is None else device)
        key = (kind, where)
        if key not in self._indices:
            with torch.inference_mode(False):  # kept for training steps too: never an inference tensor
                host = torch.tensor(self.gathered_positions_list, dtype=torch.long)  # [s]
                index = host if kind == "gathered" else torch.argsort(host)
                self._indices[key] = index.to(where, non_blocking=True)
        return self._indices[key]

    @property
    def is_natural(self) -> bool:
        """Whether gathered order is already natural order (contiguous chunks)."""
        return not self.balanced

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """The tokens of ``rank`` from a full, natural-order tensor: ``[.., s, ..] -> [.., s_r, ..]``."""
        parts = [x.narrow(dim, a, b - a) for a, b in self._segments[rank]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def unshard(self, chunks: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of :meth:`shard` over all ranks: local chunks -> full natural-order tensor."""
        gathered = torch.cat(chunks, dim=dim)  # [.., s, ..] in gathered order
        if self.is_natural:
            return gathered
        return gathered.index_select(dim, self.natural_index(gathered.device))
