"""TextDataModule: small variable-length language-modelling batches from text found on every machine.

The text is the source code of Python's standard library, read as bytes (non-ASCII bytes clipped to
127, so the vocabulary is 128). Batch ``i`` of a split has ``batch_size`` windows of one length drawn
from a long-tailed (log-uniform) distribution between ``min_len`` and ``max_len``: many short batches,
a few long ones. Everything is a pure function of ``(seed, split, i)``, so every process builds the
same batches. Targets are the inputs shifted by one token.

A later issue replaces this module by a full corpus pipeline (token budgets, packing); it is kept small.
"""

from __future__ import annotations

import math
import sysconfig
from functools import lru_cache
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

SPLIT_SEEDS = {"train": 0, "val": 1, "test": 2}


@lru_cache(maxsize=4)
def stdlib_bytes(limit: int = 2_000_000) -> Tensor:
    """Up to ``limit`` bytes of the standard library's ``*.py`` files (sorted by name), clipped to 127."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()[: limit - total]
        chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        total += len(data)
        if total >= limit:
            break
    if not chunks:
        raise RuntimeError(f"no Python sources found under {root}")
    return torch.cat(chunks).clamp_max(127).long()


def draw_length(gen: torch.Generator, min_len: int, max_len: int) -> int:
    """A log-uniform length in ``[min_len, max_len]`` (long-tailed: short lengths are the most frequent)."""
    u = float(torch.rand((), generator=gen))
    return min(max_len, int(math.exp(math.log(min_len) + u * (math.log(max_len + 1) - math.log(min_len)))))


class VariableLengthText(Dataset[dict[str, Tensor]]):
    """Item ``i`` is a whole batch ``{"input_ids": [b, s_i], "targets": [b, s_i]}`` (use ``batch_size=None``).

    Args:
        data: The token stream.
        n_batches: Number of batches.
        batch_size: Sequences per batch.
        min_len: Shortest sequence.
        max_len: Longest sequence.
        seed: Seed of lengths and window starts.
    """

    def __init__(self, data: Tensor, n_batches: int, batch_size: int, min_len: int, max_len: int, seed: int) -> None:
        if len(data) <= max_len + 1:
            raise ValueError(f"the text has {len(data)} tokens, fewer than max_len + 2 = {max_len + 2}")
        self.data, self.n_batches, self.batch_size = data, n_batches, batch_size
        self.min_len, self.max_len, self.seed = min_len, max_len, seed

    def __len__(self) -> int:
        return self.n_batches

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        s = draw_length(gen, self.min_len, self.max_len)
        starts = torch.randint(0, len(self.data) - s - 1, (self.batch_size,), generator=gen)
        windows = torch.stack([self.data[a : a + s + 1] for a in starts.tolist()])  # [b, s + 1]
        return {"input_ids": windows[:, :-1], "targets": windows[:, 1:]}


class TextDataModule(pl.LightningDataModule):
    """Variable-length batches of standard-library source text, identical on every process.

    Args:
        batch_size: Sequences per batch.
        min_len: Shortest sequence (tokens).
        max_len: Longest sequence (tokens).
        train_batches: Batches per training epoch.
        val_batches: Batches per validation (and test) run.
        seed: Seed of the lengths and windows.
        text_bytes: How many bytes of source text to read.
    """

    def __init__(
        self,
        batch_size: int = 2,
        min_len: int = 64,
        max_len: int = 512,
        train_batches: int = 64,
        val_batches: int = 4,
        seed: int = 0,
        text_bytes: int = 2_000_000,
    ) -> None:
        super().__init__()
        if not 0 < min_len <= max_len:
            raise ValueError(f"TextDataModule: need 0 < min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        if batch_size < 1 or train_batches < 1 or val_batches < 0:
            raise ValueError(
                f"TextDataModule: batch_size and train_batches must be positive and val_batches not negative, got "
                f"batch_size={batch_size}, train_batches={train_batches}, val_batches={val_batches}"
            )
        self.batch_size, self.min_len, self.max_len = batch_size, min_len, max_len
        self.train_batches, self.val_batches = train_batches, val_batches
        self.seed, self.text_bytes = seed, text_bytes

    def dataset(self, split: str) -> VariableLengthText:
        """The batches of ``split`` (``train``, ``val`` or ``test``)."""
        n = self.train_batches if split == "train" else self.val_batches
        seed = self.seed * 10 + SPLIT_SEEDS[split]
        return VariableLengthText(stdlib_bytes(self.text_bytes), n, self.batch_size, self.min_len, self.max_len, seed)

    def _loader(self, split: str) -> DataLoader[dict[str, Tensor]]:
        return DataLoader(self.dataset(split), batch_size=None, shuffle=False)

    @override
    def train_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return self._loader("train")

    @override
    def val_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return self._loader("val")

    @override
    def test_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return self._loader("test")


__all__ = ["TextDataModule", "VariableLengthText", "draw_length", "stdlib_bytes"]
