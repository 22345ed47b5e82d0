"""Token-budget batching of variable-length documents: chunking, batch plans, packing or padding, a resumable sampler.

What: :func:`make_dataloader` turns a :class:`~lightning_paradyse.data.corpus.TokenCorpus` into a ``DataLoader`` whose
batches hold as many documents as a token budget allows. The pieces, usable on their own:

* :func:`chunk_documents` cuts documents longer than ``max_len`` into near-equal chunks (each chunk is then a
  document of its own) and drops chunks shorter than ``min_len`` (a 1-token document has no target);
* :func:`plan_batches` orders the chunks (``sorted``: the paper's ascending-length curriculum, the same every
  epoch; ``shuffled``: seeded per ``(seed, epoch)``; ``natural``: corpus order) and fills batches greedily under
  ``max_tokens``, padding counted (``batch * longest <= max_tokens``) or, packed, the total length;
* :class:`TokenBudgetSampler` deals that plan to the sequence-parallel groups and remembers its position
  (``state_dict``/``load_state_dict``), so a resumed run sees exactly the batches an uninterrupted run would;
* :class:`ChunkDataset` reads one chunk from the memory-mapped corpus, :class:`Collate` builds the batch with
  :func:`pack_documents` or :func:`pad_documents`.

Batch formats (targets are the next token inside the same document, ``-100`` where there is none):

* packed, batch 1: ``{"input_ids": [1, s], "targets": [1, s], "positions": [s], "doc_ids": [s]}``; positions
  restart at 0 for every document and the document ids are contiguous, the ``doc_ids`` that
  :class:`~lightning_paradyse.modes.specs.SeqContext` takes;
* padded: ``{"input_ids": [b, L], "targets": [b, L]}``, ``L`` the longest chunk of the batch, ``-100`` at each
  document's last token and on the padding.

Why: variable-length training wastes work on padding and on batches of very different cost. A token budget
keeps the cost of a batch near constant whatever its lengths, sorting (globally or inside windows) keeps the
padding small, and a deterministic plan lets every rank of a group build the same batches without
communicating. Every chunk appears exactly once per epoch (with several groups, up to ``num_groups - 1``
batches at the end of the plan are left out so that every group gets as many batches).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_paradyse.data.corpus import TokenCorpus

Order = Literal["sorted", "shuffled", "natural"]
ORDERS: tuple[str, ...] = ("sorted", "shuffled", "natural")
"""The values of :attr:`BatchingConfig.order`."""
IGNORE_INDEX = -100
"""The target of a token that predicts nothing (a document's last token, padding)."""

Lengths = Sequence[int] | np.ndarray


def _is_int(value: object) -> TypeGuard[int | np.integer]:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _require(ok: bool | np.bool_, field: str, value: object, need: str, fix: str) -> None:
    if not ok:
        raise ValueError(f"BatchingConfig({field}={value!r}): need {need}; {fix}")


@dataclass(frozen=True)
class BatchingConfig:
    """How document chunks are grouped into batches under a token budget."""

    max_tokens: int
    """Token budget of one batch, padding counted: ``batch * longest_chunk <= max_tokens`` when padded, the sum
    of the chunk lengths when packed."""
    max_len: int | None = None
    """Longest chunk: longer documents are cut into near-equal chunks of at most this many tokens.
    ``None``: ``max_tokens`` (a batch may then hold a single chunk of the full budget)."""
    pack: bool = False
    """Pack a batch's chunks into one sequence (batch 1, with positions and document ids) instead of padding them
    into rows."""
    order: Order = "sorted"
    """``sorted``: ascending length, the paper's curriculum, the same every epoch; ``shuffled``: a random order
    seeded per ``(seed, epoch)``; ``natural``: the corpus order."""
    sort_window: int = 0
    """``shuffled``/``natural``: sort the chunks by length inside consecutive windows of this many chunks before
    filling batches (less padding, still mixed; shuffled batches are then shuffled again). ``0``: no sorting."""
    max_docs: int | None = None
    """At most this many chunks in one batch (``None``: only the token budget limits it)."""
    min_len: int = 2
    """Chunks shorter than this are dropped (a 1-token chunk has no target)."""
    pad_id: int = 0
    """Token id written into the padding of padded batches (its targets are ``-100``)."""
    attention_len: int | None = None
    """Packed batches, Hydraulis-style: count a chunk of ``n`` tokens as ``n + n*n/attention_len`` against
    ``max_tokens``, so that batches cost the same compute (projections and MLP linear in ``n``, attention
    quadratic) instead of holding the same number of tokens. ``attention_len`` is the length at which a
    sequence's attention costs as much as the rest of its block
    (:func:`lightning_paradyse.groups.attention_crossover`). ``None``: tokens only."""

    def __post_init__(self) -> None:
        _require(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "a positive integer (the tokens of one batch, padding counted)",
            "set e.g. max_tokens=8192",
        )
        _require(
            self.max_len is None or (_is_int(self.max_len) and 1 <= self.max_len <= self.max_tokens),
            "max_len",
            self.max_len,
            f"1 <= max_len <= max_tokens (max_tokens={self.max_tokens}: one chunk must fit a batch)",
            "lower max_len, raise max_tokens, or leave max_len=None (= max_tokens)",
        )
        _require(self.order in ORDERS, "order", self.order, f"one of {list(ORDERS)}", "pick one of them")
        _require(
            _is_int(self.sort_window) and self.sort_window >= 0,
            "sort_window",
            self.sort_window,
            "an integer >= 0",
            "use 0 for no sorting or a window of chunks such as 256",
        )
        self._check_counts()

    def _check_counts(self) -> None:
        _require(
            self.max_docs is None or (_is_int(self.max_docs) and self.max_docs >= 1),
            "max_docs",
            self.max_docs,
            "None or an integer >= 1",
            "use None to let only the token budget limit a batch",
        )
        _require(
            _is_int(self.min_len) and 1 <= self.min_len <= self.chunk_len,
            "min_len",
            self.min_len,
            f"1 <= min_len <= max_len (max_len={self.chunk_len})",
            "use the default min_len=2 (a chunk needs 2 tokens to have a target)",
        )
        _require(_is_int(self.pad_id) and self.pad_id >= 0, "pad_id", self.pad_id, "a token id >= 0", "use 0")
        if self.attention_len is not None:
            _require(
                _is_int(self.attention_len) and self.attention_len >= 1 and self.pack,
                "attention_len",
                self.attention_len,
                "None, or an integer >= 1 with pack=True",
                "set pack=True, or leave attention_len=None",
            )
            _require(
                self.weight(self.chunk_len) <= self.max_tokens,
                "attention_len",
                self.attention_len,
                f"a longest chunk ({self.chunk_len} tokens, weighing {self.weight(self.chunk_len):.0f}) within "
                f"max_tokens={self.max_tokens}",
                "raise max_tokens or attention_len, or lower max_len",
            )

    def weight(self, n: int) -> float:
        """What a packed chunk of ``n`` tokens counts against ``max_tokens`` (see :attr:`attention_len`)."""
        return n if self.attention_len is None else n + n * n / self.attention_len

    @property
    def chunk_len(self) -> int:
        """The longest chunk: ``max_len``, or ``max_tokens`` when it is ``None``."""
        return self.max_tokens if self.max_len is None else int(self.max_len)


# ---------------------------------------------------------------------------------------------- chunks


@dataclass(frozen=True, eq=False)
class Chunks:
    """Document chunks as parallel int64 arrays: chunk ``i`` is tokens ``start[i]:start[i] + length[i]`` of
    document ``doc[i]``. Chunks of a document are consecutive and in order."""

    doc: np.ndarray
    """The document of each chunk (an index into the corpus)."""
    start: np.ndarray
    """First token of each chunk inside its document."""
    length: np.ndarray
    """Tokens of each chunk."""

    def __len__(self) -> int:
        return len(self.length)


def _as_lengths(lengths: Lengths, what: str) -> np.ndarray:
    """``lengths`` as a 1-D int64 array of non-negative integers."""
    array = np.asarray(lengths)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(
            f"{what} must be a 1-D sequence of integer token counts, got shape {array.shape} {array.dtype}"
        )
    array = array.astype(np.int64)
    if array.size and array.min() < 0:
        raise ValueError(f"{what} must not be negative, found {int(array.min())}")
    return array


def chunk_documents(lengths: Lengths, max_len: int, min_len: int = 2, docs: Lengths | None = None) -> Chunks:
    """Cut documents into chunks of at most ``max_len`` tokens; drop chunks shorter than ``min_len``.

    A document of ``n > max_len`` tokens becomes ``ceil(n / max_len)`` chunks whose sizes differ by at most one
    (the longer ones first), so no tiny tail is left. Each chunk is then trained on as a document of its own.

    Args:
        lengths: Tokens of every document of the corpus.
        max_len: The longest chunk.
        min_len: The shortest chunk kept (shorter ones, e.g. 1-token documents, are dropped).
        docs: The documents to chunk (e.g. a training split), in this order; ``None``: all of them.
    """
    sizes = _as_lengths(lengths, "chunk_documents: lengths")
    if not (_is_int(max_len) and _is_int(min_len) and max_len >= 1 and min_len >= 1):
        raise ValueError(f"chunk_documents: need max_len >= 1 and min_len >= 1, got max_len={max_len}, {min_len=}")
    doc = np.arange(len(sizes), dtype=np.int64) if docs is None else _as_lengths(docs, "chunk_documents: docs")
    if doc.size and doc.max() >= len(sizes):
        raise ValueError(f"chunk_documents: document {int(doc.max())} does not exist ({len(sizes)} documents)")
    size = sizes[doc]
    pieces = -(-size // max_len)  # 0 for an empty document
    owner, total, count = (np.repeat(a, pieces) for a in (doc, size, pieces))
    j = np.arange(owner.size, dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    base, extra = total // np.maximum(count, 1), total % np.maximum(count, 1)
    length = base + (j < extra)
    start = j * base + np.minimum(j, extra)
    keep = length >= min_len
    return Chunks(owner[keep], start[keep], length[keep].astype(np.int64))


# ---------------------------------------------------------------------------------------------- plans


def _check_lengths(lengths: Lengths, config: BatchingConfig) -> np.ndarray:
    sizes = _as_lengths(lengths, "plan_batches: lengths")
    if sizes.size and sizes.min() < 1:
        raise ValueError(f"plan_batches: item {int(np.argmin(sizes))} is empty; drop empty items before batching")
    if sizes.size and sizes.max() > config.chunk_len:
        i = int(np.argmax(sizes))
        raise ValueError(
            f"plan_batches: item {i} has {int(sizes[i])} tokens, more than max_len={config.chunk_len}; "
            f"cut documents with chunk_documents(lengths, max_len) and batch the chunks"
        )
    return sizes


def _rng(seed: int, epoch: int) -> np.random.Generator:
    if not (_is_int(seed) and _is_int(epoch) and seed >= 0 and epoch >= 0):
        raise ValueError(f"batching: seed and epoch must be integers >= 0, got seed={seed!r}, epoch={epoch!r}")
    return np.random.default_rng([int(seed), int(epoch)])


def _item_order(sizes: np.ndarray, config: BatchingConfig, rng: np.random.Generator) -> np.ndarray:
    """The order in which items fill batches."""
    if config.order == "sorted":
        return np.argsort(sizes, kind="stable")
    order = rng.permutation(len(sizes)) if config.order == "shuffled" else np.arange(len(sizes))
    if config.sort_window > 0:
        window = np.arange(len(order)) // config.sort_window
        order = order[np.lexsort((sizes[order], window))]  # by window, then by length inside it (stable)
    return order


def _fill(sizes: np.ndarray, order: np.ndarray, config: BatchingConfig) -> list[list[int]]:
    """Greedy batches of ``order``: a batch is closed when the next item would break the budget or ``max_docs``."""
    cap = config.max_docs if config.max_docs is not None else len(sizes) + 1
    batches: list[list[int]] = []
    current: list[int] = []
    longest, total = 0, 0.0
    for i, n in zip(order.tolist(), sizes[order].tolist()):
        cost = total + config.weight(n) if config.pack else (len(current) + 1) * max(longest, n)
        if current and (cost > config.max_tokens or len(current) >= cap):
            batches.append(current)
            current, longest, total = [], 0, 0.0
        current.append(i)
        longest, total = max(longest, n), total + (config.weight(n) if config.pack else n)
    if current:
        batches.append(current)
    return batches


def plan_batches(lengths: Lengths, config: BatchingConfig, seed: int = 0, epoch: int = 0) -> list[list[int]]:
    """The batches of one epoch: lists of item indices, every item exactly once, each batch within the budget.

    Args:
        lengths: Tokens of every item (chunk); none may exceed ``config.chunk_len``.
        config: Budget, order and limits.
        seed: Seed of the shuffled order (the sorted and natural orders ignore it).
        epoch: The epoch (shuffled: a new order every epoch).
    """
    sizes = _check_lengths(lengths, config)
    rng = _rng(seed, epoch)
    batches = _fill(sizes, _item_order(sizes, config, rng), config)
    if config.order == "shuffled" and config.sort_window > 0:  # windows fill batches short to long: mix them
        batches = [batches[i] for i in rng.permutation(len(batches)).tolist()]
    return batches


# ---------------------------------------------------------------------------------------------- sampler


def plan_id(lengths: np.ndarray, config: BatchingConfig, seed: int, num_groups: int) -> str:
    """A digest of everything the batch plan depends on (not the group index: all groups share one plan)."""
    settings = {
        "max_tokens": config.max_tokens,
        "max_len": config.chunk_len,
        "pack": config.pack,
        "order": config.order,
        "sort_window": config.sort_window,
        "max_docs": config.max_docs,
        "seed": int(seed),
        "num_groups": int(num_groups),
    }
    if config.attention_len is not None:  # only when set: plans saved before the option keep their digest
        settings["attention_len"] = config.attention_len
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    digest.update(np.ascontiguousarray(lengths, dtype="<i8").tobytes())
    return digest.hexdigest()[:16]


class TokenBudgetSampler(Sampler[list[int]]):
    """Batch sampler over chunk lengths: yields lists of chunk indices, one token-budget batch at a time.

    The global plan of an epoch is :func:`plan_batches` for ``(seed, epoch)``; with ``num_groups`` sequence-parallel
    groups it is dealt round-robin (group ``g`` gets batches ``g, g + num_groups, ...``) and cut so that every
    group gets ``len(plan) // num_groups`` batches. Every rank of one group sees the same batches.

    Iterating yields the rest of the current epoch from :attr:`next_batch` and then moves to the next epoch, so
    iterating again gives the next epoch. :meth:`set_epoch` to another epoch starts it from its first batch;
    to the current epoch it keeps the position (what a restored run needs). :meth:`state_dict` records the
    batches handed out so far; with DataLoader workers or a prefetching loop these can be ahead of the batches
    trained on.

    Args:
        lengths: Tokens of every chunk (``Chunks.length``).
        config: The batching settings.
        seed: Seed of the shuffled order.
        num_groups: Number of sequence-parallel groups that each take their own batches.
        group_index: This process's group, ``0 <= group_index < num_groups``.
    """

    def __init__(
        self, lengths: Lengths, config: BatchingConfig, seed: int = 0, num_groups: int = 1, group_index: int = 0
    ) -> None:
        super().__init__()
        if not (_is_int(num_groups) and _is_int(group_index) and num_groups >= 1 and 0 <= group_index < num_groups):
            raise ValueError(
                f"TokenBudgetSampler: got num_groups={num_groups!r}, group_index={group_index!r}; need num_groups >= 1 "
                f"and 0 <= group_index < num_groups (the index of this process's sequence-parallel group)"
            )
        self.lengths = _check_lengths(lengths, config)
        self.config, self.seed = config, int(seed)
        self.num_groups, self.group_index = int(num_groups), int(group_index)
        _rng(self.seed, 0)  # checks the seed now rather than at the first epoch
        self.plan_id = plan_id(self.lengths, config, self.seed, self.num_groups)
        self.epoch = 0
        """The current epoch."""
        self.next_batch = 0
        """Index (in this group's batches of :attr:`epoch`) of the next batch to hand out."""
        self._cached: tuple[int, list[list[int]]] | None = None

    def batches(self, epoch: int) -> list[list[int]]:
        """This group's batches of ``epoch``."""
        if self._cached is None or self._cached[0] != epoch:
            plan = plan_batches(self.lengths, self.config, self.seed, epoch)
            per_group = len(plan) // self.num_groups
            self._cached = (epoch, plan[self.group_index :: self.num_groups][:per_group])
        return self._cached[1]

    def __len__(self) -> int:
        """Batches of the current epoch for this group (all of them, not only those left)."""
        return len(self.batches(self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches(self.epoch)
        while self.next_batch < len(batches):
            batch = batches[self.next_batch]
            self.next_batch += 1
            yield batch
        self.epoch += 1
        self.next_batch = 0

    def set_epoch(self, epoch: int) -> None:
        """Go to ``epoch`` (from its first batch); the current epoch keeps its position."""
        if not (_is_int(epoch) and epoch >= 0):
            raise ValueError(f"TokenBudgetSampler.set_epoch: the epoch must be an integer >= 0, got {epoch!r}")
        if epoch != self.epoch:
            self.epoch, self.next_batch = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "next_batch", "plan_id"}``: where iteration stands and which plan it belongs to."""
        return {"epoch": self.epoch, "next_batch": self.next_batch, "plan_id": self.plan_id}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, possibly of another group of the same run).

        Raises ``ValueError`` when it was saved for another plan (other chunks, settings, seed or number of groups)
        or names a position outside its epoch. A state without ``plan_id`` is trusted.
        """
        saved = state.get("plan_id")
        if saved is not None and saved != self.plan_id:
            raise ValueError(
                f"TokenBudgetSampler: the state was saved for another plan (plan_id {saved!r}, this sampler's is "
                f"{self.plan_id!r}): the corpus or its split, the batching settings, the seed or the number of groups "
                f"changed; restore them, or start this sampler afresh instead of loading the state"
            )
        epoch, position = state.get("epoch"), state.get("next_batch")
        epoch_ = int(epoch) if _is_int(epoch) else -1
        position_ = int(position) if _is_int(position) else -1
        if epoch_ < 0 or not 0 <= position_ <= len(self.batches(epoch_)):
            raise ValueError(
                f"TokenBudgetSampler: invalid position epoch={epoch!r}, next_batch={position!r} in the loaded state; "
                f"need an epoch >= 0 and 0 <= next_batch <= the batches of that epoch"
            )
        self.epoch, self.next_batch = epoch_, position_


# ---------------------------------------------------------------------------------------------- batches


def _check_docs(docs: Sequence[Tensor], what: str) -> list[int]:
    sizes = [int(d.numel()) for d in docs]
    if not sizes or min(sizes) < 1 or any(d.dim() != 1 for d in docs):
        raise ValueError(f"{what}: need at least one document, each a non-empty 1-D tensor; got sizes {sizes}")
    return sizes


def pack_documents(docs: Sequence[Tensor]) -> dict[str, Tensor]:
    """Documents packed into one sequence (batch 1), with next-token targets that never cross a document.

    Returns ``input_ids`` and ``targets`` ``[1, s]`` (``-100`` at each document's last token), ``positions``
    ``[s]`` (restarting at 0 for each document) and contiguous ``doc_ids`` ``[s]`` (0, 1, ...).
    """
    sizes = torch.tensor(_check_docs(docs, "pack_documents"), dtype=torch.int64)
    tokens = torch.cat([d.to(torch.int64) for d in docs])
    ends = torch.cumsum(sizes, 0)
    doc_ids = torch.repeat_interleave(torch.arange(len(docs)), sizes)
    positions = torch.arange(len(tokens)) - (ends - sizes)[doc_ids]
    targets = torch.roll(tokens, -1)
    targets[ends - 1] = IGNORE_INDEX
    return {"input_ids": tokens[None], "targets": targets[None], "positions": positions, "doc_ids": doc_ids}


def pad_documents(docs: Sequence[Tensor], pad_id: int = 0) -> dict[str, Tensor]:
    """Documents as rows padded to the longest: ``input_ids`` and ``targets`` ``[b, L]``, targets ``-100`` at
    each document's last token and on the padding."""
    sizes = _check_docs(docs, "pad_documents")
    input_ids = torch.full((len(docs), max(sizes)), pad_id, dtype=torch.int64)
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    for row, (doc, n) in enumerate(zip(docs, sizes)):
        input_ids[row, :n] = doc
        targets[row, : n - 1] = doc[1:]
    return {"input_ids": input_ids, "targets": targets}


@dataclass(frozen=True)
class Collate:
    """``collate_fn`` of the DataLoader: a list of chunks to a packed or a padded batch."""

    pack: bool = False
    """:func:`pack_documents` instead of :func:`pad_documents`."""
    pad_id: int = 0
    """The padding token of padded batches."""

    def __call__(self, docs: Sequence[Tensor]) -> dict[str, Tensor]:
        return pack_documents(docs) if self.pack else pad_documents(docs, self.pad_id)


class ChunkDataset(Dataset[Tensor]):
    """Item ``i`` is chunk ``i``'s tokens (int64), read from the memory-mapped corpus without the rest of it.

    Args:
        corpus: The token corpus.
        chunks: The chunks of its documents (:func:`chunk_documents`).
    """

    def __init__(self, corpus: TokenCorpus, chunks: Chunks) -> None:
        self.corpus, self.chunks = corpus, chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> Tensor:
        start = int(self.chunks.start[i])
        return self.corpus.span(int(self.chunks.doc[i]), start, start + int(self.chunks.length[i]))


def make_dataloader(
    corpus: TokenCorpus,
    config: BatchingConfig,
    seed: int = 0,
    docs: Lengths | None = None,
    num_groups: int = 1,
    group_index: int = 0,
    num_workers: int = 0,
) -> DataLoader[Tensor]:
    """The DataLoader of token-budget batches of ``corpus``; ``loader.batch_sampler`` is its
    :class:`TokenBudgetSampler` (``set_epoch``, ``state_dict``) and ``loader.dataset.chunks`` its chunks.

    Args:
        corpus: The token corpus.
        config: The batching settings.
        seed: Seed of the shuffled order (the same on every rank).
        docs: The documents to use (e.g. the training split of :func:`~lightning_paradyse.data.corpus.split_documents`);
            ``None``: all.
        num_groups: Number of sequence-parallel groups (data-parallel replicas of a group).
        group_index: This process's group.
        num_workers: DataLoader worker processes reading the corpus.
    """
    chunks = chunk_documents(corpus.lengths, config.chunk_len, config.min_len, docs)
    if len(chunks) == 0:
        raise ValueError(
            f"make_dataloader: no chunk of at least min_len={config.min_len} tokens in {corpus!r} "
            f"({'all' if docs is None else len(docs)} documents chosen); choose other documents or lower min_len"
        )
    sampler = TokenBudgetSampler(chunks.length, config, seed, num_groups, group_index)
    return DataLoader(
        ChunkDataset(corpus, chunks),
        batch_sampler=sampler,
        collate_fn=Collate(config.pack, config.pad_id),
        num_workers=num_workers,
    )


__all__ = [
    "IGNORE_INDEX",
    "ORDERS",
    "BatchingConfig",
    "ChunkDataset",
    "Chunks",
    "Collate",
    "TokenBudgetSampler",
    "chunk_documents",
    "make_dataloader",
    "pack_documents",
    "pad_documents",
    "plan_batches",
    "plan_id",
]
