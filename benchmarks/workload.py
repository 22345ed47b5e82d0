"""What every run trains on: length traces turned into token sequences, grouped into global batches.

Traces (each sequence is ``length + 1`` tokens: inputs and shifted targets):

* ``github`` / ``grch38``: lengths from :func:`lightning_paradyse.data.length_traces.length_trace` (the paper's bucket
  shares, scaled so the paper's longest sequence maps to the trace's ``max_len``), tokens from windows of the
  standard library's source text (:func:`lightning_paradyse.data.datamodule.stdlib_bytes`);
* ``corpus``: chunks of the bundled corpus (the installed Python sources, byte tokens;
  :func:`lightning_paradyse.data.corpus.load_corpus`) drawn at random, so its lengths are the corpus's own;
* ``mixed``: mostly short sequences with a few long ones (:func:`mixed_lengths`), tokens as ``github``.

**Global batches.** One optimizer step of every run trains one global batch: the trace's sequences are grouped
by :func:`lightning_paradyse.data.batching.plan_batches` under the token budget ``batch_tokens`` (padding counted:
``rows x longest <= batch_tokens``), in the trace's order (``sorted``: shortest first, the paper's curriculum;
``shuffled``: seeded), as :class:`~lightning_paradyse.data.batching.TokenBudgetSampler` and ``CorpusDataModule``
group chunks. A global batch is the rows right-padded to its longest (:func:`pad_rows`)::

    {"input_ids": [b, L], "targets": [b, L], "attention_mask": [b, L]}

targets ``-100`` and ``attention_mask`` 0 on the padding, so the padding predicts nothing and
``LanguageModel``'s mean token cross-entropy is the mean over the batch's real tokens.

**Who gets what** (:func:`rank_items`): ParaDySe runs and tensor parallelism get the whole global batch on every
rank (the ParaDySe strategy checks that every rank holds the same one). Data parallelism (DDP, FSDP2) splits its
rows as a user would (:func:`data_parallel_share`): rank ``r`` takes rows ``r, r + p, ...``, cut to its longest
real row; a rank left without a row (a batch of fewer rows than ranks) gets one padding token whose target is
``-100`` (it still runs the forward, backward and gradient synchronisation with a zero loss). So that one
optimizer step is the same for everyone, each data-parallel rank's loss is its *sum* of token losses times
``loss_scale = p / N`` (``N`` the real targets of the whole global batch; see :class:`benchmarks.runs.BenchLM`):
DDP and FSDP2 average the gradients over the ``p`` ranks, which makes them the gradients of the global batch's
mean token loss, the loss every other run minimises.

Length buckets are the paper's seven, scaled like the trace (``corpus`` and ``mixed`` use GitHubCode's); a
global batch falls in the bucket of its longest row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from benchmarks.settings import TraceSettings
from lightning_paradyse.data.batching import IGNORE_INDEX, BatchingConfig, plan_batches
from lightning_paradyse.data.length_traces import bucket_labels, length_trace, scaled_edges


@dataclass(frozen=True)
class Trace:
    """A trace's sequences and its global batches."""

    name: str
    """``github``, ``grch38``, ``corpus`` or ``mixed``."""
    sequences: tuple[np.ndarray, ...]
    """Token ids of every sequence (int64, one more token than its length), in the order they were drawn."""
    batches: tuple[tuple[int, ...], ...]
    """The global batches in training order: indices into :attr:`sequences`, each batch's rows in order."""
    edges: tuple[float, ...]
    """Lower edges of the length buckets (the last bucket is open)."""

    @property
    def lengths(self) -> list[int]:
        """Training length of every sequence."""
        return [len(s) - 1 for s in self.sequences]

    def batch_lengths(self, step: int) -> list[int]:
        """Training lengths of the rows of global batch ``step``."""
        return [len(self.sequences[i]) - 1 for i in self.batches[step]]

    @property
    def labels(self) -> list[str]:
        """Bucket labels in the paper's style."""
        return bucket_labels(self.edges)

    def bucket(self, length: int) -> int:
        """Index of the bucket holding ``length``."""
        return int(np.searchsorted(np.asarray(self.edges[1:]), length, side="right"))

    def global_batch(self, step: int) -> dict[str, Tensor]:
        """Global batch ``step`` as padded rows (:func:`pad_rows`)."""
        return pad_rows([self.sequences[i] for i in self.batches[step]])


def pad_rows(sequences: Sequence[np.ndarray], pad_id: int = 0) -> dict[str, Tensor]:
    """Sequences of ``n_i + 1`` tokens as rows right-padded to the longest ``L = max n_i``.

    Returns ``input_ids`` ``[b, L]`` (a row's first ``n_i`` tokens, then ``pad_id``), ``targets`` ``[b, L]`` (its
    next ``n_i`` tokens, then ``-100``) and ``attention_mask`` ``[b, L]`` (1 on the ``n_i`` real tokens, 0 on the
    padding). Every real token has a real target; no padding token has one.
    """
    sizes = [len(s) - 1 for s in sequences]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"pad_rows: need at least one sequence of 2 tokens or more, got lengths {sizes}")
    b, width = len(sizes), max(sizes)
    input_ids = torch.full((b, width), pad_id, dtype=torch.int64)  # [b, L]
    targets = torch.full((b, width), IGNORE_INDEX, dtype=torch.int64)  # [b, L]
    mask = torch.zeros((b, width), dtype=torch.int64)  # [b, L]
    for row, (tokens, n) in enumerate(zip(sequences, sizes)):
        x = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))  # [n + 1]
        input_ids[row, :n] = x[:-1]
        targets[row, :n] = x[1:]
        mask[row, :n] = 1
    return {"input_ids": input_ids, "targets": targets, "attention_mask": mask}


def data_parallel_share(batch: dict[str, Tensor], rank: int, world: int) -> dict[str, Tensor]:
    """Rank ``rank``'s share of a global batch under data parallelism (DDP, FSDP2).

    Rows ``rank, rank + world, ...`` cut to their longest real row, plus ``loss_scale`` (a 0-d float64 tensor,
    ``world / N``, ``N`` the real targets of the whole global batch) that makes the ranks' averaged gradients
    those of the global mean token loss (see :class:`benchmarks.runs.BenchLM`). A rank without a row gets one
    padding token with target ``-100`` (``[1, 1]`` tensors).
    """
    n_targets = int((batch["targets"] != IGNORE_INDEX).sum())
    scale = torch.tensor(world / max(n_targets, 1), dtype=torch.float64)
    rows = list(range(rank, batch["input_ids"].shape[0], world))
    if not rows:  # fewer rows than ranks: a zero-loss row, so the collectives of the step still match
        empty = {
            "input_ids": torch.zeros((1, 1), dtype=torch.int64),
            "targets": torch.full((1, 1), IGNORE_INDEX, dtype=torch.int64),
            "attention_mask": torch.zeros((1, 1), dtype=torch.int64),
        }
        return {**empty, "loss_scale": scale}
    index = torch.tensor(rows)
    longest = int(batch["attention_mask"].index_select(0, index).sum(dim=1).max())
    share = {k: v.index_select(0, index)[:, :longest].contiguous() for k, v in batch.items()}  # [b_r, L_r]
    return {**share, "loss_scale": scale}


def rank_items(trace: Trace, rank: int, world: int, data_parallel: bool) -> list[dict[str, Tensor]]:
    """The batches ``rank`` trains, one per global batch: the whole batch (ParaDySe, tensor parallel) or its
    data-parallel share (:func:`data_parallel_share`)."""
    batches = [trace.global_batch(i) for i in range(len(trace.batches))]
    return [data_parallel_share(b, rank, world) for b in batches] if data_parallel else batches


def text_windows(lengths: list[int], seed: int) -> list[np.ndarray]:
    """A window of ``length + 1`` tokens of standard-library source text per length (seeded)."""
    from lightning_paradyse.data.datamodule import stdlib_bytes

    text = stdlib_bytes().numpy()
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(text) - max(lengths) - 2, size=len(lengths))
    return [text[a : a + s + 1].astype(np.int64) for a, s in zip(starts.tolist(), lengths)]


def corpus_chunks(n: int, max_len: int, min_len: int, seed: int) -> list[np.ndarray]:
    """``n`` random chunks (at most ``max_len`` tokens, at least ``min_len``) of the bundled corpus."""
    from lightning_paradyse.data.batching import chunk_documents
    from lightning_paradyse.data.corpus import CorpusConfig, load_corpus

    corpus = load_corpus(CorpusConfig(ascii=True, max_bytes=8_000_000, progress=False, verbose=False))
    chunks = chunk_documents(corpus.lengths, max_len + 1, min_len=min_len + 1)
    pick = np.random.default_rng(seed).choice(len(chunks), size=n, replace=len(chunks) < n)
    return [
        corpus.span(int(chunks.doc[i]), int(chunks.start[i]), int(chunks.start[i] + chunks.length[i])).numpy()
        for i in pick.tolist()
    ]


def mixed_lengths(n: int, max_len: int, min_len: int, long_share: float, seed: int) -> list[int]:
    """``n`` lengths, mostly short with a few long ones: a share ``long_share`` log-uniform in
    ``[max_len / 2, max_len]``, the others log-uniform in ``[min_len, max(min_len, max_len / 16)]`` (seeded)."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < long_share
    lo = np.where(long, max_len / 2, min_len).astype(np.float64)
    hi = np.where(long, max_len, max(min_len, max_len / 16)).astype(np.float64)
    lengths = np.floor(np.exp(np.log(lo) + rng.random(n) * (np.log(hi) - np.log(lo))))
    return np.clip(lengths, min_len, max_len).astype(np.int64).tolist()


def build_trace(settings: TraceSettings, world: int, batch_tokens: int) -> Trace:
    """The trace of ``settings`` and its global batches under ``batch_tokens`` (padding counted).

    For ``github`` / ``grch38`` the shortest length is lowered below the first bucket's upper edge when needed
    (never below ``2 * world``: a sequence-parallel rank needs tokens).
    """
    min_len = max(2 * world, settings.min_len)
    if settings.kind == "corpus":
        sequences = corpus_chunks(settings.n, settings.max_len, min_len, settings.seed)
        edges = scaled_edges("github", settings.max_len)
    elif settings.kind == "mixed":
        lengths = mixed_lengths(settings.n, settings.max_len, min_len, settings.long_share, settings.seed)
        sequences = text_windows(lengths, settings.seed)
        edges = scaled_edges("github", settings.max_len)
    else:
        edges = scaled_edges(settings.kind, settings.max_len)
        min_len = max(2 * world, min(settings.min_len, math.ceil(edges[1]) - 1))  # the first bucket must be non-empty
        lengths = length_trace(settings.kind, settings.n, settings.max_len, settings.seed, min_len=min_len)
        sequences = text_windows(lengths, settings.seed)
    config = BatchingConfig(max_tokens=batch_tokens, max_len=settings.max_len, order=settings.order, min_len=1)
    plan = plan_batches([len(s) - 1 for s in sequences], config, seed=settings.seed)
    return Trace(settings.name, tuple(sequences), tuple(tuple(b) for b in plan), tuple(edges))


def probe_batch(length: int, seed: int = 0) -> dict[str, Tensor]:
    """A batch of one ``length``-token sequence of source text (the length search's probe), ``[1, length]``."""
    x = torch.from_numpy(text_windows([length], seed)[0]).unsqueeze(0)  # [1, length + 1]
    return {"input_ids": x[:, :-1].contiguous(), "targets": x[:, 1:].contiguous()}


__all__ = [
    "Trace",
    "build_trace",
    "corpus_chunks",
    "data_parallel_share",
    "mixed_lengths",
    "pad_rows",
    "probe_batch",
    "rank_items",
    "text_windows",
]
