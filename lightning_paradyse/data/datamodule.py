"""Data modules: the bundled corpus with token budgets and packing (:class:`CorpusDataModule`, the default of
the command line) and a small synthetic-window module for quick tests (:class:`TextDataModule`).

``CorpusDataModule`` wires :mod:`lightning_paradyse.data.corpus` (documents found on every machine, byte tokens,
cached) and :mod:`lightning_paradyse.data.batching` (token-budget batches, optional packing with document
boundaries, sorted or shuffled order, a resumable sampler): every rank of the sequence-parallel group
builds the same batches, and the sampler's position is saved in checkpoints so a resumed run sees exactly
the batches it would have seen.

``TextDataModule``:

The text is the source code of Python's standard library, read as bytes (non-ASCII bytes clipped to
127, so the vocabulary is 128). Batch ``i`` of a split has ``batch_size`` windows of one length drawn
from a long-tailed (log-uniform) distribution between ``min_len`` and ``max_len``: many short batches,
a few long ones. Everything is a pure function of ``(seed, split, i)``, so every process builds the
same batches. Targets are the inputs shifted by one token.

"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_paradyse.data.batching import BatchingConfig, make_dataloader
from lightning_paradyse.data.corpus import CorpusConfig, check_vocab, load_corpus, split_documents

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

    @override
    def predict_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        """The test split's batches (``python cli.py predict``)."""
        return self._loader("test")


class CorpusDataModule(pl.LightningDataModule):
    """Token-budget batches of a real corpus (by default the bundled Python sources), the same on every rank.

    Args:
        source: ``python`` (the standard library's and installed packages' ``*.py`` files, no download),
            ``folder`` (text files under ``path``), ``jsonl`` (``path``, field ``text_field``) or ``tokens``
            (a pre-tokenized folder at ``path``).
        path: The folder or file for the non-default sources.
        text_field: JSONL: the key of each document's text.
        corpus_bytes: Cap on source bytes read (``None``: the corpus default).
        ascii: Byte tokens clipped to 7 bits (vocabulary 128, as the tiny reference models).
        max_tokens: Token budget per batch, padding included.
        max_len: Longest sequence; longer documents are cut into chunks (``None``: ``max_tokens``).
        pack: Pack short documents into one sequence with document-aware attention (batch 1).
        order: ``shuffled`` (seeded per epoch), ``sorted`` (ascending lengths, the paper's curriculum) or
            ``natural``.
        val_fraction: Share of documents held out for validation and test.
        seed: Seed of the split and the shuffled order.
        cache_dir: Where the built corpus is cached (``None``: the user's cache directory).
    """

    def __init__(
        self,
        source: Literal["python", "folder", "jsonl", "tokens"] = "python",
        path: str | None = None,
        text_field: str = "text",
        corpus_bytes: int | None = 8_000_000,
        ascii: bool = True,
        max_tokens: int = 1024,
        max_len: int | None = 768,
        pack: bool = True,
        order: Literal["shuffled", "sorted", "natural"] = "shuffled",
        val_fraction: float = 0.02,
        seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"CorpusDataModule: val_fraction must be in [0, 1), got {val_fraction}")
        self.corpus_config = CorpusConfig(
            source=source, path=path, text_field=text_field, max_bytes=corpus_bytes, ascii=ascii, cache_dir=cache_dir
        )
        self.batching = BatchingConfig(max_tokens=max_tokens, max_len=max_len, pack=pack, order=order)
        self.val_fraction, self.seed = val_fraction, seed
        self._corpus: Any = None
        self._train: Any = None
        self._resume: dict[str, Any] | None = None

    @override
    def prepare_data(self) -> None:
        load_corpus(self.corpus_config)  # builds the cache once (on the first local rank)

    def corpus(self) -> Any:
        """The token corpus (loaded from the cache on first use)."""
        if self._corpus is None:
            self._corpus = load_corpus(self.corpus_config)
            vocab = getattr(getattr(self.trainer, "lightning_module", None), "vocab_size", None)
            if vocab is not None:
                check_vocab(self._corpus, int(vocab))
        return self._corpus

    def _split(self) -> tuple[Any, Any]:
        return split_documents(len(self.corpus()), self.val_fraction, self.seed)

    def _loader(self, docs: Any, order: str | None = None) -> DataLoader[Tensor]:
        config = self.batching if order is None else replace(self.batching, order=order)  # type: ignore[arg-type]
        return make_dataloader(self.corpus(), config, seed=self.seed, docs=docs)

    @override
    def train_dataloader(self) -> DataLoader[Tensor]:
        self._train = self._loader(self._split()[0])
        if self._resume is not None:
            sampler = self._train.batch_sampler
            sampler.load_state_dict(self._resume)
            if sampler.next_batch >= len(sampler.batches(sampler.epoch)):  # saved at the end of an epoch
                sampler.set_epoch(sampler.epoch + 1)
            self._resume = None
        return self._train

    @override
    def val_dataloader(self) -> DataLoader[Tensor]:
        return self._loader(self._split()[1], order="natural")

    @override
    def test_dataloader(self) -> DataLoader[Tensor]:
        return self._loader(self._split()[1], order="natural")

    @override
    def predict_dataloader(self) -> DataLoader[Tensor]:
        """The held-out documents' batches, as the test's (``python cli.py predict``)."""
        return self._loader(self._split()[1], order="natural")

    @override
    def state_dict(self) -> dict[str, Any]:
        """The sampler's position in batches *trained* (not fetched ahead), saved in checkpoints."""
        if self._train is None or self.trainer is None:
            return {}
        state = dict(self._train.batch_sampler.state_dict())
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        # checkpoints are written from on_train_batch_end: the batch in hand is processed, not yet "completed"
        processed = int(progress.processed)  # type: ignore[attr-defined]  # the batch tracker has it
        state["epoch"], state["next_batch"] = int(self.trainer.current_epoch), processed
        return {"sampler": state}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = state_dict.get("sampler")


__all__ = ["CorpusDataModule", "TextDataModule", "VariableLengthText", "draw_length", "stdlib_bytes"]
