"""What the modes are given: the op's description, its weight shards and the sequence context.

The modes never see a model class. An op is described by a small frozen spec (head counts, causal
flag, window, the model's code between projections and attention, activation) and its weights arrive as
the 1/p row shards of the unified layout (DESIGN.md):

* ``q, k, v, up, gate``: the rows (output features) of the ``nn.Linear`` weight, ``[n_out/p, h]``
  (column-parallel shard in Megatron terms).
* ``o_t, down_t``: the *transposed* weight, ``[n_in/p, h]``, i.e. the input features of the
  ``nn.Linear`` (row-parallel shard), stored transposed so that every shard is a contiguous block of
  rows, as an all-gather needs.
* Biases of ``q, k, v, up, gate`` are sharded with their rows; ``bo`` and ``b_down`` are replicated
  and added once, after the partial sums are reduced.

Row shards follow :func:`~lightning_paradyse.distributed.layout.split_sizes`: when the head count is divisible
by ``p`` a shard is whole heads, which is at once the tensor-parallel, ZeRO-3 and METP shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from lightning_paradyse.distributed.comm import Group, group_rank, group_size
from lightning_paradyse.distributed.layout import SeqLayout, split_sizes
from lightning_paradyse.modes.attention import Scores

Prepare = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]
"""``prepare(q [b, t, nq*d], k [b, t, nk*d], v [b, t, nk*d], positions [t]) -> (q [b, nq, t, d], k, v)``: the
model's own code between the projections and the attention (per-head norms, rotary embeddings) on the tokens at
the global ``positions`` and the heads a mode holds."""


@dataclass(frozen=True)
class AttnSpec:
    """The attention op of one block, independent of any model class."""

    hidden: int
    """Model width ``h``."""
    n_heads: int
    """Query heads ``n``."""
    n_kv_heads: int
    """Key/value heads (``n`` for multi-head attention, fewer for GQA)."""
    head_dim: int
    """Width ``d`` of one head."""
    causal: bool
    """Causal (decoder) or bidirectional (encoder) attention."""
    prepare: Prepare | None = None
    """The model's code from the projections to the attention inputs, or ``None``: a plain split into heads."""
    scale: float | None = None
    """Softmax scale of the scores; ``None``: ``1/sqrt(head_dim)``."""
    window: int | None = None
    """Causal sliding window: a query attends its ``window`` most recent keys, itself included (``sliding_window``
    of Hugging Face models); ``None``: the whole (causal) sequence."""
    prepare_params: tuple[torch.Tensor, ...] = ()
    """The trainable parameters ``prepare`` reads (q/k norms): a mode that recomputes the projections in a backward
    of its own returns their gradients."""
    mixes_heads: bool = False
    """``prepare`` needs every head of a token at once (a norm over all heads): modes that split heads cannot run it."""
    softcap: float | None = None
    """Logit soft-capping (Gemma 2's ``attn_logit_softcapping``): ``softcap * tanh(scores / softcap)``."""
    adapted: bool = False
    """A projection carries a LoRA adapter (:class:`Adapter`): modes that do not add its branch cannot run it."""

    def scores(self) -> Scores:
        """How this layer forms its scores, for the kernels."""
        return Scores(self.causal, self.scale, self.window, self.softcap)

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    @property
    def q_rows(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class MlpSpec:
    """The MLP op of one block: ``down(act(up(x)) [* gate-branch])``."""

    hidden: int
    """Model width ``h``."""
    ffn: int
    """Intermediate width ``f``."""
    act: Callable[[torch.Tensor], torch.Tensor]
    """Elementwise activation (applied to ``gate(x)`` when gated, else to ``up(x)``)."""
    gated: bool = False
    """SwiGLU-style: ``down(act(gate(x)) * up(x))``."""
    adapted: bool = False
    """A projection carries a LoRA adapter (:class:`Adapter`): modes that do not add its branch cannot run it."""


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter on one projection, ``y += B(A(x)) * scale``, laid out like the projection's weight: on a
    column-parallel projection (``q, k, v, up, gate``) ``b`` is the row shard ``[n_out/p, r]`` (rows like the
    weight's) and ``a`` whole ``[r, h_in]``; on a row-parallel one (``o_t``, ``down_t``) ``a`` is ``A`` transposed
    and row-sharded, ``[n_in/p, r]``, and ``b`` whole ``[h, r]``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass
class AttnWeights:
    """This rank's shards of one attention op (parameters, used in place)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o_t: torch.Tensor
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    adapters: dict[str, Adapter] = field(default_factory=dict, kw_only=True)
    """LoRA adapters by projection (``q``, ``k``, ``v``, ``o_t``) where the branch runs this call."""


@dataclass
class MlpWeights:
    """This rank's shards of one MLP op (parameters, used in place)."""

    up: torch.Tensor
    down_t: torch.Tensor
    gate: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_gate: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    adapters: dict[str, Adapter] = field(default_factory=dict, kw_only=True)
    """LoRA adapters by projection (``up``, ``gate``, ``down_t``) where the branch runs this call."""


@dataclass(frozen=True)
class SeqContext:
    """The group and the token layout of the current batch."""

    layout: SeqLayout
    """Which tokens each rank holds."""
    group: Group
    """The ranks sharing the sequence (``None`` for a single process)."""
    doc_ids: torch.Tensor | None = None
    """Packed documents: the document id of every token of the whole sequence, ``[s]`` in natural order
    (documents contiguous). Attention never crosses a document boundary. ``None``: one document."""
    idle: bool = False
    """The group runs a placeholder (a group given no row of the batch, weighed by 0): nothing its tokens do
    counts, e.g. an expert they are routed to is not thereby used."""
    host_doc_ids: torch.Tensor | None = None
    """:attr:`doc_ids` on the host when the caller has them there (the batch's description does): read without
    waiting for a GPU. Else they are copied there once per context."""
    real_lengths: tuple[int, ...] | None = None
    """A whole run's right-padded rows (``p = 1``: predictions): each row's real tokens. A padding token's query then
    attends the real keys alone, as in a run given the attention mask; ``None``: its outputs are left as the causal
    attention makes them (training and evaluation: no padding token's output reaches a target there)."""

    def __post_init__(self) -> None:
        if self.doc_ids is not None and tuple(self.doc_ids.shape) != (self.layout.seq_len,):
            raise ValueError(
                f"doc_ids must have one id per token of the sequence, shape ({self.layout.seq_len},), "
                f"got {tuple(self.doc_ids.shape)}; packing uses one packed sequence per batch row and batch 1"
            )

    def doc_bounds(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of every document in natural order (one span without packing): read on the host once
        per context (every attention layer of the step asks; on a GPU each read would wait for it)."""
        return self._doc_bounds

    @cached_property
    def _doc_bounds(self) -> list[tuple[int, int]]:
        return document_bounds(self._host_doc_ids, self.layout.seq_len)

    def docs_of(self, rank: int) -> torch.Tensor | None:
        """Document ids of ``rank``'s tokens in local order, or ``None`` without packing."""
        return None if self.doc_ids is None else self.layout.shard(self.doc_ids, rank, dim=0)

    def host_docs_of(self, rank: int) -> torch.Tensor | None:
        """:meth:`docs_of` on the host (the document ids copied there once per context): what tiles are chosen from."""
        return None if self._host_doc_ids is None else self.layout.shard(self._host_doc_ids, rank, dim=0)

    @cached_property
    def _host_doc_ids(self) -> torch.Tensor | None:
        if self.doc_ids is None:
            return None
        return self.host_doc_ids if self.host_doc_ids is not None else self.doc_ids.cpu()  # [s] device -> host, once

    @property
    def p(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    def positions(self, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of this rank's tokens, ``[s_r]``."""
        return self.layout.positions(self.rank, device)


def document_bounds(doc_ids: torch.Tensor | None, seq_len: int) -> list[tuple[int, int]]:
    """``(start, stop)`` spans of equal consecutive ids; documents must be contiguous."""
    if doc_ids is None:
        return [(0, seq_len)]
    change = (doc_ids[1:] != doc_ids[:-1]).nonzero().flatten().add(1).tolist()
    starts, stops = [0, *change], [*change, seq_len]
    if len(set(doc_ids[starts].tolist())) != len(starts):
        raise ValueError("doc_ids: every document must be one contiguous span of the sequence")
    return list(zip(starts, stops))


def row_sizes(n: int, p: int) -> list[int]:
    """Rows of each rank's shard of a weight with ``n`` rows."""
    return split_sizes(n, p)


def shard_rows(w: torch.Tensor, p: int, rank: int) -> torch.Tensor:
    """This rank's contiguous block of rows of ``w`` (a copy)."""
    sizes = row_sizes(w.shape[0], p)
    start = sum(sizes[:rank])
    return w[start : start + sizes[rank]].clone()
