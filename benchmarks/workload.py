"""The sequences every run trains on: length traces turned into token sequences, sorted shortest first.

* ``github`` / ``grch38``: lengths from :func:`lightning_paradyse.traces.length_trace` (the paper's bucket
  shares, scaled so the paper's longest sequence maps to the trace's ``max_len``), tokens from windows of the
  standard library's source text (:func:`lightning_paradyse.data.stdlib_bytes`).
* ``corpus``: chunks of the bundled corpus (the installed Python sources, byte tokens;
  :func:`lightning_paradyse.corpus.load_corpus`) drawn at random, so its lengths are the corpus's own.

Every trace is sorted by length, ascending, as the paper trains (its cumulative-time figures are drawn that
way). Length buckets are the paper's seven, scaled like the trace (``corpus`` uses GitHubCode's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.settings import TraceSettings
from lightning_paradyse.traces import bucket_labels, length_trace, scaled_edges


@dataclass(frozen=True)
class Trace:
    """A trace's sequences, ascending, each ``length + 1`` tokens (inputs and shifted targets)."""

    name: str
    """``github``, ``grch38`` or ``corpus``."""
    sequences: tuple[np.ndarray, ...]
    """Token ids of every sequence (int64, one more token than its length)."""
    edges: tuple[float, ...]
    """Lower edges of the length buckets (the last bucket is open)."""

    @property
    def lengths(self) -> list[int]:
        """Training length of every sequence."""
        return [len(s) - 1 for s in self.sequences]

    @property
    def labels(self) -> list[str]:
        """Bucket labels in the paper's style."""
        return bucket_labels(self.edges)

    def bucket(self, length: int) -> int:
        """Index of the bucket holding ``length``."""
        return int(np.searchsorted(np.asarray(self.edges[1:]), length, side="right"))


def batch_of(tokens: np.ndarray) -> dict[str, torch.Tensor]:
    """One training batch ``{"input_ids": [1, s], "targets": [1, s]}`` of ``s + 1`` tokens."""
    x = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)).unsqueeze(0)
    return {"input_ids": x[:, :-1], "targets": x[:, 1:]}


def rank_items(trace: Trace, rank: int, world: int, data_parallel: bool) -> list[dict[str, torch.Tensor]]:
    """The batches ``rank`` sees: every sequence (sequence or tensor parallel) or every ``world``-th one (data
    parallel: rank ``r`` takes sequences ``r, r + world, ...``)."""
    chosen = trace.sequences[rank::world] if data_parallel else trace.sequences
    return [batch_of(s) for s in chosen]


def text_windows(lengths: list[int], seed: int) -> list[np.ndarray]:
    """A window of ``length + 1`` tokens of standard-library source text per length (seeded)."""
    from lightning_paradyse.data import stdlib_bytes

    text = stdlib_bytes().numpy()
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(text) - max(lengths) - 2, size=len(lengths))
    return [text[a : a + s + 1].astype(np.int64) for a, s in zip(starts.tolist(), lengths)]


def corpus_chunks(n: int, max_len: int, min_len: int, seed: int) -> list[np.ndarray]:
    """``n`` random chunks (at most ``max_len`` tokens, at least ``min_len``) of the bundled corpus."""
    from lightning_paradyse.batching import chunk_documents
    from lightning_paradyse.corpus import CorpusConfig, load_corpus

    corpus = load_corpus(CorpusConfig(ascii=True, max_bytes=8_000_000, progress=False, verbose=False))
    chunks = chunk_documents(corpus.lengths, max_len + 1, min_len=min_len + 1)
    pick = np.random.default_rng(seed).choice(len(chunks), size=n, replace=len(chunks) < n)
    return [
        corpus.span(int(chunks.doc[i]), int(chunks.start[i]), int(chunks.start[i] + chunks.length[i])).numpy()
        for i in pick.tolist()
    ]


def build_trace(settings: TraceSettings, world: int) -> Trace:
    """The trace of ``settings``, its size rounded up to a multiple of ``world`` (data-parallel steps).

    The shortest length is lowered below the first bucket's upper edge when needed (never below ``2 * world``).
    """
    n = -(-settings.n // world) * world
    if settings.kind == "corpus":
        sequences = corpus_chunks(n, settings.max_len, settings.min_len, settings.seed)
        edges = scaled_edges("github", settings.max_len)
    else:
        edges = scaled_edges(settings.kind, settings.max_len)
        min_len = max(2 * world, min(settings.min_len, math.ceil(edges[1]) - 1))  # the first bucket must be non-empty
        lengths = length_trace(settings.kind, n, settings.max_len, settings.seed, min_len=min_len)
        sequences = text_windows(lengths, settings.seed)
    ordered = sorted(sequences, key=len)
    return Trace(settings.name, tuple(ordered), tuple(edges))


def probe_batch(length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch of one ``length``-token sequence of source text (the length search's probe)."""
    return batch_of(text_windows([length], seed)[0])


__all__ = ["Trace", "batch_of", "build_trace", "corpus_chunks", "probe_batch", "rank_items", "text_windows"]
