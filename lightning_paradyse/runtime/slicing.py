"""Slicing the global batch: where its tokens and targets are, how it is validated, and each rank's slice of it.

Conventions (those of common language-model data): the tokens are the batch itself, the first tensor of a
tuple/list, or a dict entry named in :data:`TOKEN_KEYS`; the targets a dict entry named in :data:`TARGET_KEYS`
or the last tensor of a tuple/list of two or more (``-100`` marks no target). ``labels`` means the Hugging
Face convention (the model shifts them). :func:`describe_batch` validates a batch and describes it
(:class:`BatchInfo`) without any collective, so a bad batch raises alike on every rank; :func:`shard_batch`
gives a rank its tokens of every ``[b, s, ...]`` tensor along the unified layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_paradyse.distributed.layout import SeqLayout

IGNORE_INDEX = -100
"""Target value of a token that is not a real target (padding, prompt): the cross-entropy default."""
TOKEN_KEYS = ("input_ids", "tokens", "idx", "input", "inputs", "x")
"""Keys of the token tensor in a dict batch, first match wins (else the first tensor)."""
TARGET_KEYS = ("targets", "target", "y", "labels")
"""Keys of the target tensor in a dict batch, first match wins (else: the last tensor of a tuple or list batch).
Targets shifted in the data come before Hugging Face ``labels``: a batch holding both (a collator's ``labels`` kept
beside the ``targets`` the step's own loss reads) is weighed by the real ``targets`` each rank holds, which is what
that loss averages over (until 2026-11-30 ``labels`` won, and each rank's mean was weighed by its unshifted labels:
7.6e-2 off one process with the step check off, a generic refusal with it on). A model handed ``labels=`` returns its
share of the global mean whatever this choice (the strategy hands it the global count)."""
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
    """A digest of every tensor of the batch (ranks compare it to catch diverging data)."""
    doc_ids: Tensor | None = None
    """Packed batches: the document id of every token ``[s]`` (attention stays inside each document)."""
    skip: bool = False
    """No plan fits the memory budget and the strategy was told to skip such batches."""
    padding: Tensor | None = None
    """Right padding of a causal batch (``attention_mask`` 0), ``[b, s]`` True at padding tokens: their targets
    must be ignored (checked here, and in the labels the model is handed)."""
    fill_target: bool = False
    """This rank's slice holds no real target and the loss is a mean: one target of the slice is made real so the
    module's mean stays finite; the strategy weighs this rank's loss by ``n_local / n_global = 0``."""
    idle: bool = False
    """This rank's group was given no row of the batch: its step runs on a placeholder (a few tokens of the shortest
    row, :meth:`~lightning_paradyse.groups.units.Units.cut`) whose loss the strategy weighs by 0."""
    host_doc_ids: Tensor | None = None
    """:attr:`doc_ids` on the host, kept by :func:`on_device` when it moves them: what the modes read there (the
    documents' spans) without waiting for a GPU."""


@dataclass(frozen=True)
class BatchSource:
    """One tensor of the global batch and this rank's slice of it (what the step was handed)."""

    key: str
    """Where it sits in the batch (a dict key, or ``#i`` for the i-th tensor of a tuple/list)."""
    local: Tensor
    """This rank's slice, ``[b, s_r, ...]`` (or ``[s_r]`` for per-token entries)."""
    whole: Tensor
    """The global tensor, ``[b, s, ...]`` (or ``[s]``), in the step's coordinates."""
    shifted: Tensor | None = None
    """``whole`` shifted left by one over the *whole* batch (for a sub-batch of documents, cut out of the whole
    batch's shift); ``None``: :func:`shifted_labels` of ``whole``."""
    n_items: int | None = None
    """Real (non-ignored) entries of the shifted labels in the whole batch; ``None``: counted in ``shifted``."""
    n_given: int | None = None
    """Real entries of the labels as given (unshifted) in the whole batch; ``None``: counted in ``whole``."""

    def shifted_whole(self) -> Tensor:
        return self.shifted if self.shifted is not None else shifted_labels(self.whole)

    def items(self, shifted: Tensor) -> int:
        return self.n_items if self.n_items is not None else int((shifted != IGNORE_INDEX).sum())

    def given_items(self) -> int:
        return self.n_given if self.n_given is not None else int((self.whole != IGNORE_INDEX).sum())


def find_tokens(batch: Any) -> Tensor:
    """The token tensor ``[b, s, ...]`` of a batch: a tensor, a dict (:data:`TOKEN_KEYS`) or a sequence."""
    found: Tensor | None = None
    if isinstance(batch, Tensor):
        found = batch
    elif isinstance(batch, Mapping):  # the first of TOKEN_KEYS, else the first tensor
        images = batch.get("pixel_values")
        if (
            isinstance(images, Tensor)
            and images.dim() == 4
            and not any(isinstance(batch.get(k), Tensor) for k in TOKEN_KEYS)
        ):
            raise TypeError(
                "ParaDySeStrategy splits every batch along its token sequence, and this batch is images (pixel_values "
                "[batch, channels, height, width]), whose sequence of patches a vision model makes inside itself: no "
                "rank can be handed its slice of them; train a vision model under another strategy (e.g. "
                "strategy='ddp')"
            )
        nested = [
            f"{outer!r} holds {key!r}"
            for outer, inner in batch.items()
            if isinstance(inner, Mapping)
            for key in TOKEN_KEYS
            if isinstance(inner.get(key), Tensor)
        ]
        own = [v for v in batch.values() if isinstance(v, Tensor)]  # none: several loaders' batches (named below)
        if nested and own and not any(isinstance(batch.get(k), Tensor) for k in TOKEN_KEYS):
            raise TypeError(
                f"ParaDySeStrategy reads the tokens of a dict batch at its top level, and this batch's {nested[0]} "
                f"in a nested dict: its tensors would not be split along the sequence with the others; put the nested "
                f"dict's tensors at the batch's top level (batch = {{**inputs, 'targets': targets}}), and call the "
                f"model with them from there"
            )
        for value in (*(batch.get(k) for k in TOKEN_KEYS if k in batch), *batch.values()):
            if isinstance(value, Tensor):
                found = value
                break
    elif isinstance(batch, Sequence):
        for value in batch:
            if isinstance(value, Tensor):
                found = value
                break
    if found is None and _holds_batches(batch):
        raise TypeError(
            f"ParaDySeStrategy cannot find the token tensor [batch, seq] in a batch of type {type(batch).__name__} "
            "that holds batches or samples (several loaders' batches, as Lightning's CombinedLoader yields them, or "
            "rows left unstacked, e.g. collate_fn=list): one batch is split along one token sequence; stack the rows "
            "(the default collate) and train on one loader (join datasets with torch.utils.data.ConcatDataset, or "
            f"sample them in one dataset), whose batch is a tensor, a tuple/list or a dict with one of {TOKEN_KEYS}"
        )
    if found is None or found.dim() < 2:
        raise TypeError(
            f"ParaDySeStrategy cannot find the token tensor [batch, seq] in a batch of type {type(batch).__name__}: "
            f"yield a tensor, a tuple/list whose first tensor holds the tokens, or a dict with one of {TOKEN_KEYS}"
        )
    return found


def _holds_batches(batch: Any) -> bool:
    """Whether a dict or sequence batch with no tensor of its own holds dicts or sequences that hold tensors (the
    batches of several loaders, or rows left unstacked)."""
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, Sequence) else ()
    inner = [v for v in values if isinstance(v, (Mapping, Sequence)) and not isinstance(v, (str, bytes))]
    return any(isinstance(x, Tensor) for v in inner for x in (v.values() if isinstance(v, Mapping) else v))


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


def shard_batch(batch: Any, info: BatchInfo, rank: int) -> tuple[Any, tuple[BatchSource, ...]]:
    """This rank's tokens of every tensor of ``batch`` whose dims 0, 1 are ``[b, s]``, and of the per-token
    ``[s]`` entries of a dict batch (:data:`TOKEN_1D_KEYS`); other values unchanged. Also returns every sliced
    tensor with its slice (:class:`BatchSource`), in the order labels are traced back: targets first. Slices are
    contiguous, as the batch's own tensors are (a step may ``view`` them: ``BertForMaskedLM`` does its labels)."""
    sources: list[BatchSource] = []

    def cut(t: Tensor, key: str) -> Tensor:
        if t.dim() >= 2 and tuple(t.shape[:2]) == (info.batch, info.seq_len):
            local = info.layout.shard(t, rank).contiguous()  # [b, s, ...] -> [b, s_r, ...], as a batch is laid out
            sources.append(BatchSource(key, local, t))
            return local
        return t

    if isinstance(batch, Mapping):
        out = {}
        for k, v in batch.items():
            if k in TOKEN_1D_KEYS and isinstance(v, Tensor) and tuple(v.shape) == (info.seq_len,):
                out[k] = info.layout.shard(v, rank, dim=0)  # [s] -> [s_r]
                sources.append(BatchSource(str(k), out[k], v))
            elif isinstance(v, Tensor):
                out[k] = cut(v, str(k))
            else:
                out[k] = apply_to_collection(v, Tensor, lambda t, k=k: cut(t, f"{k}.*"))
        local: Any = out
    elif isinstance(batch, Tensor):
        local = cut(batch, "#0")
    elif isinstance(batch, Sequence) and not isinstance(batch, str):
        items = [cut(v, f"#{i}") if isinstance(v, Tensor) else v for i, v in enumerate(batch)]
        if hasattr(batch, "_fields"):  # a namedtuple
            local = batch._make(items)  # type: ignore[attr-defined]
        else:
            local = tuple(items) if isinstance(batch, tuple) else items
    else:
        local = apply_to_collection(batch, Tensor, lambda t: cut(t, "?"))
    if info.fill_target:
        local, sources = _fill_one_target(local, sources)
    order = {key: i for i, key in enumerate(TARGET_KEYS)}
    if isinstance(batch, Sequence) and not isinstance(batch, (str, Tensor)):  # the targets: the last tensor
        last = max((i for i, v in enumerate(batch) if isinstance(v, Tensor)), default=None)
        order[f"#{last}"] = -1
    sources.sort(key=lambda src: order.get(src.key, len(order)))
    return local, tuple(sources)


def _fill_one_target(local: Any, sources: list[BatchSource]) -> tuple[Any, list[BatchSource]]:
    """Make the first target of this rank's slice real (class 0): its mean loss is then finite (weighted by 0)."""
    key, targets = find_targets(local)
    if targets is None:
        return local, sources
    filled = targets.clone()
    filled.view(-1)[0] = 0
    if isinstance(local, Mapping):
        local = {**local, key: filled}
    else:
        at = max(i for i, v in enumerate(local) if v is targets)
        items = [filled if i == at else v for i, v in enumerate(local)]
        local = local._make(items) if hasattr(local, "_fields") else type(local)(items)
    return local, [replace(src, local=filled) if src.local is targets else src for src in sources]


def check_ignored_targets(targets: Tensor | None, key: str | None) -> None:
    """Integer targets leave a position out with -100 alone: every other value counts as a real target (each rank's
    mean loss is weighed by its share of them), and no class id is negative, so another negative value (-1, nanoGPT's
    ``ignore_index``) marks positions the step leaves out by a rule of its own, which the strategy would count
    (silent until 2026-12-02 where the step kept ``targets >= 0``: probe 18). Raised alike on every rank."""
    if targets is None or targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        return
    negative = (targets < 0) & (targets != IGNORE_INDEX)  # [b, s, ...]
    if bool(negative.any()):  # host read: the batch is described on the host
        value = int(targets[negative][0])
        raise ValueError(
            f"the batch's {key or 'targets'!r} hold {value}: ParaDySeStrategy counts every target that is not -100 as "
            f"real (it weighs each rank's mean loss by its share of them), and a class id is never negative; mark the "
            f"targets to leave out with -100 in the data (targets[targets == {value}] = -100) and leave them to the "
            f"loss's default ignore_index"
        )


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


def checksum(batch: Any) -> int:
    """A digest (SHA-256, 64 bits) of the batch's structure and of every byte of every tensor in it: equal on
    ranks that hold the same batch, different when any value, row order or target differs."""
    digest = hashlib.sha256()

    def visit(value: Any) -> None:
        if isinstance(value, Tensor):
            data = value.detach().contiguous().cpu()
            digest.update(repr((str(data.dtype), tuple(data.shape))).encode())
            digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, Mapping):
            for k in value:
                digest.update(repr(k).encode())
                visit(value[k])
        elif isinstance(value, (list, tuple)):
            digest.update(f"[{len(value)}".encode())
            for v in value:
                visit(v)
        elif value is None or isinstance(value, (bool, int, float, str)):
            digest.update(repr(value).encode())
        else:  # other objects: their type only (their repr may hold a per-process address)
            digest.update(repr(type(value).__name__).encode())

    visit(batch)
    return int.from_bytes(digest.digest()[:8], "little", signed=True)


def target_counts(targets: Tensor | None, layout: SeqLayout, b: int, s: int) -> list[int]:
    """Real target tokens held by each rank (all tokens when the batch has no ``[b, s]`` targets)."""
    if targets is None or targets.dim() < 2 or tuple(targets.shape[:2]) != (b, s):
        return [b * n for n in layout.local_lens]
    valid = targets != IGNORE_INDEX  # [b, s, ...]
    per_position = valid.sum(dim=(0, *range(2, valid.dim())))  # [b, s, ...] -> [s]
    before = [0, *torch.cumsum(per_position, 0).tolist()]  # real targets before each position: one read
    return [sum(before[stop] - before[start] for start, stop in layout.segments(r)) for r in range(layout.world)]


def shifted_labels(labels: Tensor) -> Tensor:
    """``labels[:, 1:]`` padded with -100 at the end: the targets a label-shifting model computes."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def describe_batch(
    batch: Any,
    p: int,
    rank: int,
    causal: bool,
    max_seq_len: int | None = None,
    mean_loss: bool = True,
    require_targets: bool = True,
    digest: bool = True,
) -> BatchInfo:
    """Validate a global batch for ``p`` ranks and describe it (no collective: raises alike on every rank).

    ``require_targets=False`` accepts a batch without a real target (a group's share of a batch that has some).
    ``digest=False`` leaves :attr:`BatchInfo.checksum` 0 (a group's share, whose step digests the whole batch's).

    Raises:
        ValueError: For a batch longer than ``max_seq_len``, shorter than ``p``, without real targets, or with
            padding the strategy cannot honour (:func:`find_padding`).
    """
    tokens = find_tokens(batch)
    b, s = int(tokens.shape[0]), int(tokens.shape[1])
    if max_seq_len is not None and s > max_seq_len:
        raise ValueError(
            f"a batch of length {s} exceeds ParaDySeStrategy(max_seq_len={max_seq_len}): "
            f"cut or drop longer sequences in the data, or raise max_seq_len"
        )
    if s < p:
        raise ValueError(
            f"a batch of length {s} is shorter than the {p} processes: every rank needs a token of each batch. The "
            f"fix: drop or pad sequences shorter than {p} tokens in the data (a filter in the dataset, or right "
            f"padding with targets -100 and the attention_mask 0)"
        )
    layout = SeqLayout.for_sequence(s, p, causal)
    key, targets = find_targets(batch)
    check_ignored_targets(targets, key)
    counts = target_counts(targets, layout, b, s)
    if require_targets and sum(counts) == 0:
        raise ValueError(f"a batch of length {s} has no real target token (all targets are -100)")
    padding = find_padding(batch, b, s, causal)
    if padding is not None and targets is not None and tuple(targets.shape[:2]) == (b, s):
        check_padding_targets(padding, shifted_labels(targets) if key == "labels" else targets, key or "targets")
    doc_ids = find_doc_ids(batch, b, s)
    fill = mean_loss and counts[rank] == 0
    return BatchInfo(
        b,
        s,
        layout,
        counts[rank],
        sum(counts),
        checksum(batch) if digest else 0,
        doc_ids,
        padding=padding,
        fill_target=fill,
    )


def to_host(batch: Any) -> Any:
    """The batch with every tensor on the host: device tensors copied in one go (queued without blocking, then one
    wait), host tensors as they are. What :func:`describe_batch` reads (checksum, target counts, padding) is then
    read on the host, not one synchronisation per value."""
    moved: list[Tensor] = []

    def copy(t: Tensor) -> Tensor:
        if t.device.type == "cpu":
            return t
        moved.append(t)
        return t.to("cpu", non_blocking=True)

    host = apply_to_collection(batch, Tensor, copy)
    if moved and moved[0].device.type == "cuda":
        torch.cuda.current_stream(moved[0].device).synchronize()  # the one wait for every copy
    return host


def on_device(info: BatchInfo, device: torch.device) -> BatchInfo:
    """``info`` with its tensors (documents, padding) on ``device`` (those of a description of a host batch)."""
    if info.doc_ids is None and info.padding is None:
        return info
    return replace(
        info,
        doc_ids=None if info.doc_ids is None else info.doc_ids.to(device, non_blocking=True),
        padding=None if info.padding is None else info.padding.to(device, non_blocking=True),
        host_doc_ids=info.doc_ids if info.host_doc_ids is None else info.host_doc_ids,
    )


PAD_MASK_KEYS = ("attention_mask",)
"""Keys of a ``[b, s]`` padding mask in a dict batch (1: a real token, 0: padding), the Hugging Face convention."""


def find_padding(batch: Any, b: int, s: int, causal: bool) -> Tensor | None:
    """The padding ``[b, s]`` (True: a padding token) of a batch whose ``attention_mask`` has zeros, else ``None``.

    Padding is honoured exactly when it cannot change a real token's attention: a causal model padded on the
    right (every real token sees only earlier tokens, all real). Other padding is refused (no collective yet).
    """
    named = [batch.get(k) for k in PAD_MASK_KEYS] if isinstance(batch, Mapping) else []
    mask = next((m for m in named if isinstance(m, Tensor)), None)
    if mask is None or mask.dim() != 2 or tuple(mask.shape) != (b, s) or bool(mask.bool().all()):
        return None
    real = mask.bool()
    if not causal:
        raise ValueError(
            "the batch's attention_mask marks padding, and the model attends in both directions: ParaDySeStrategy "
            "cannot mask padding keys across ranks yet; batch sequences of equal length (no padding) or pack "
            "them into one sequence with doc_ids"
        )
    if bool((real[:, 1:] & ~real[:, :-1]).any()):  # a real token after a padding token: left or inner padding
        raise ValueError(
            "the batch's attention_mask has padding before real tokens (left padding): ParaDySeStrategy honours "
            "padding only on the right of causal sequences; pad on the right (tokenizer.padding_side='right') "
            "or pack the sequences with doc_ids"
        )
    return ~real


def check_padding_targets(padding: Tensor, shifted: Tensor, name: str) -> None:
    """Right padding is exact only if no padding token predicts a target (its outputs differ from a masked run)."""
    if bool((shifted[padding] != IGNORE_INDEX).any()):
        raise ValueError(
            f"padding tokens of the batch (attention_mask 0) have real targets in {name!r}: their outputs depend on "
            f"the mask, which ParaDySeStrategy does not apply; set the targets of padding to -100 (as Hugging Face's "
            f"data collators do)"
        )


__all__ = [
    "IGNORE_INDEX",
    "PAD_MASK_KEYS",
    "TARGET_KEYS",
    "TOKEN_1D_KEYS",
    "TOKEN_KEYS",
    "BatchInfo",
    "BatchSource",
    "check_ignored_targets",
    "check_padding_targets",
    "checksum",
    "describe_batch",
    "find_doc_ids",
    "find_padding",
    "find_targets",
    "find_tokens",
    "on_device",
    "shard_batch",
    "shifted_labels",
    "target_counts",
    "to_host",
]
