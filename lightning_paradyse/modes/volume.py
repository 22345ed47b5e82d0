"""Analytic communication volume: the bytes each rank sends per op (one layer) and training step.

The numbers are what :class:`~lightning_paradyse.distributed.comm.CommCounter` records: algorithmic volume, the
bytes a rank *sends* with bandwidth-optimal algorithms (ring all-gather / reduce-scatter send
``(total - own)`` rows, an all-to-all sends what leaves for other ranks, a ring hop sends the
tensor, a pipelined broadcast or reduce of ``N`` elements ``N*(p-1)/p``), averaged over the ranks of
the group. Averaging makes uneven sequence chunks and weight shards exact: over all ranks the
``(total - own)`` rows sum to ``total*(p-1)``, so the mean is ``total*(p-1)/p`` whatever the split.

Notation of the peers' review (reference/peers.md, section 4): ``s`` tokens, ``b`` sequences,
``h`` model width, ``h_kv = n_kv_heads*head_dim``, ``p`` ranks. Published formulas (elements per
device per layer, forward + backward, ``b = 1``) and how each is generalised here:

* **Megatron TP+SP** (``tp_sp``): ``8*s*h*(p-1)/p`` per layer, i.e. ``4*b*s*h*(p-1)/p`` per op
  (forward all-gather + reduce-scatter of ``[b, s, h]``, backward reduce-scatter + all-gather).
  Added: with fewer kv heads than ranks (``n_kv % p != 0``) the k/v weights (and biases) are
  all-gathered forward and reduce-scattered backward, ``2*(2*h_kv*h [+ 2*h_kv])*(p-1)/p``.
* **Ulysses** (``ulysses`` attention): ``2*(s/p)*(2h + 2h_kv)*(p-1)/p``: one all-to-all of packed
  q/k/v and one of the output per pass, forward and backward. Generalised: ``h`` becomes the query
  width ``n_heads*head_dim`` and ``h_kv`` the kv width actually sent, ``p*m*head_dim`` with ``m`` kv
  heads per rank from :func:`~lightning_paradyse.distributed.comm.gqa_kv_index` (kv heads are replicated to
  every rank that reads them when ``n_kv < p``).
* **Ring, pass-KV** (``ring`` attention): forward ``(p-1)`` hops of the local ``[2, b, n_kv, s/p, d]``
  K/V block, backward K/V again plus the dK/dV accumulators, ``3*(p-1)*2*b*(s/p)*h_kv`` elements,
  the ``~12*h_kv*(p-1)/p`` bytes per token of the table at 2 B. Generalised: the dK/dV
  accumulators travel in the attention's accumulation dtype (float32, float64 for float64 inputs,
  see :mod:`lightning_paradyse.modes.attention`), so in bf16 the backward hops cost ``2 + 4`` bytes.
* **ZeRO-3 parameters** (weights of ``ulysses`` and ``ring``): ``~3*12h^2*(p-1)/p`` per layer, i.e.
  ``3*W*(p-1)/p`` for the ``W`` sharded matrix elements of an op (forward gather, backward
  re-gather, gradient reduce-scatter; gradients of half-precision weights travel in float32,
  :data:`~lightning_paradyse.distributed.comm.GRAD_REDUCE_DTYPE`). Exactly: a sharded bias is gathered by an autograd
  all-gather whose backward is a single reduce-scatter, so biases cost ``2*W_bias*(p-1)/p``. Replicated biases
  (``o``, ``down``) never move inside the op.
* **METP** (ParaDySe reference, sections 3 and 4: ``~12h^2`` weight elements forward, ``~2x``
  backward): attention sends ``p`` broadcasts of the packed per-head-group shard forward, ``p``
  again and ``p`` reduces of its gradient backward, ``3*W*(p-1)/p`` with ``W`` every sharded
  element of the op, biases included (when ``n_kv % p != 0`` the k/v part is all-gathered twice
  and reduce-scattered once instead: the same volume), plus per head shard the K/V ring of
  ``ring`` over that group's kv heads (``h_kv`` as for Ulysses). The MLP's packed
  ``[up | gate | down | biases]`` shard makes ``p-1`` ring hops forward, ``p-1`` weight hops and
  ``p-1`` gradient-accumulator hops backward: ``3*W*(p-1)/p``.

Recomputation (activation checkpointing) repeats the forward's collectives in backward, except that
PyTorch's non-reentrant checkpoint stops recomputing after the last op that saves a tensor for
backward (``torch.utils.checkpoint.set_checkpoint_early_stop``, on by default): ``tp_sp``'s trailing
reduce-scatter of the output is then not repeated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_paradyse.distributed.comm import gqa_kv_index, reduce_itemsize
from lightning_paradyse.modes.specs import AttnSpec, MlpSpec


@dataclass(frozen=True)
class Volume:
    """Bytes one rank sends (mean over the group), split by what travels."""

    activations: float = 0.0
    """Sequence-proportional traffic: hidden states, heads, key/value blocks and their gradients."""
    weights: float = 0.0
    """Length-independent traffic: weight shards and their gradients (the CPC term)."""

    @property
    def total(self) -> float:
        return self.activations + self.weights

    def __add__(self, other: Volume) -> Volume:
        return Volume(self.activations + other.activations, self.weights + other.weights)


@dataclass(frozen=True)
class OpTraffic:
    """One op's traffic per rank, by phase of a training step."""

    forward: Volume
    backward: Volume
    recompute: Volume
    """What a recomputed forward sends again in backward (activation checkpointing)."""

    def step(self, recompute: bool = False) -> Volume:
        """Forward + backward (+ the recomputation when the op is checkpointed)."""
        total = self.forward + self.backward
        return total + self.recompute if recompute else total

    def __add__(self, other: OpTraffic) -> OpTraffic:
        return OpTraffic(self.forward + other.forward, self.backward + other.backward, self.recompute + other.recompute)


@dataclass(frozen=True)
class _Case:
    """One op of one layer on one group, with the derived sizes the formulas share."""

    seq_len: int
    batch: int
    p: int
    attn: AttnSpec
    mlp: MlpSpec
    dtype_bytes: int
    biases: bool

    @property
    def frac(self) -> float:
        """``(p-1)/p``: the share of a gathered or scattered tensor that crosses the network."""
        return (self.p - 1) / self.p

    @property
    def tokens(self) -> int:
        """``b*s``: tokens of the whole group."""
        return self.batch * self.seq_len

    @property
    def grad_bytes(self) -> int:
        """Element size of weight gradients summed over ranks: float32 for half-precision weights (the default of
        :data:`~lightning_paradyse.distributed.comm.GRAD_REDUCE_DTYPE`), else the weights' own."""
        return reduce_itemsize(self.dtype_bytes)

    @property
    def acc_bytes(self) -> int:
        """Element size of attention gradient accumulators: float32, or float64 for float64."""
        return max(self.dtype_bytes, 4)

    @property
    def kv_aligned(self) -> bool:
        """Whether the k/v row shards are whole kv heads of the local query heads (``n_kv % p == 0``)."""
        return self.attn.n_kv_heads % self.p == 0

    @property
    def kv_sent(self) -> int:
        """Width of the kv heads a head-sharded mode ships: ``h_kv``, more when kv heads are replicated."""
        a = self.attn
        return len(gqa_kv_index(a.n_heads, a.n_kv_heads, self.p)) * a.head_dim

    def attn_params(self) -> tuple[int, int]:
        """Sharded ``(matrix, bias)`` elements of the attention op: q, k, v, o and bq, bk, bv."""
        a = self.attn
        rows = 2 * a.q_rows + 2 * a.kv_rows
        return rows * a.hidden, (a.q_rows + 2 * a.kv_rows if self.biases else 0)

    def mlp_params(self) -> tuple[int, int]:
        """Sharded ``(matrix, bias)`` elements of the MLP op: up, gate, down and b_up, b_gate."""
        m = self.mlp
        branches = 2 if m.gated else 1
        return (branches + 1) * m.ffn * m.hidden, (branches * m.ffn if self.biases else 0)


def _zero3(mats: int, biases: int, c: _Case) -> OpTraffic:
    """ZeRO-3 weights: matrices gathered, re-gathered and reduce-scattered; biases gathered and reduce-scattered."""
    forward = Volume(weights=(mats + biases) * c.frac * c.dtype_bytes)
    backward = Volume(weights=(mats * c.dtype_bytes + (mats + biases) * c.grad_bytes) * c.frac)  # re-gather, grads
    return OpTraffic(forward, backward, forward)


def _moving_shards(params: tuple[int, int], c: _Case) -> OpTraffic:
    """METP weights: every sharded element sent once forward and twice backward (weights + gradients)."""
    once = Volume(weights=sum(params) * c.frac * c.dtype_bytes)
    grads = Volume(weights=sum(params) * c.frac * c.grad_bytes)
    return OpTraffic(once, once + grads, once)


def _kv_ring(h_kv: int, c: _Case) -> OpTraffic:
    """``p-1`` hops of the ``[2, b, kv heads, s/p, d]`` block forward; K/V and dK/dV hops backward."""
    elements = 2 * c.tokens * h_kv * c.frac  # (p-1) hops of 2*b*(s/p)*h_kv
    forward = Volume(activations=elements * c.dtype_bytes)
    backward = Volume(activations=elements * (c.dtype_bytes + c.acc_bytes))
    return OpTraffic(forward, backward, forward)


def _tp_sp_attention(c: _Case) -> OpTraffic:
    """Sequence all-gather before and reduce-scatter after, both reversed backward; k/v weights if unaligned."""
    one = c.tokens * c.attn.hidden * c.frac * c.dtype_bytes  # one all-gather or reduce-scatter of [b, s, h]
    kv = 0.0
    if not c.kv_aligned:
        kv = 2 * c.attn.kv_rows * (c.attn.hidden + (1 if c.biases else 0)) * c.frac
    return OpTraffic(
        Volume(2 * one, kv * c.dtype_bytes), Volume(2 * one, kv * c.grad_bytes), Volume(one, kv * c.dtype_bytes)
    )


def _tp_sp_mlp(c: _Case) -> OpTraffic:
    one = c.tokens * c.mlp.hidden * c.frac * c.dtype_bytes
    return OpTraffic(Volume(2 * one), Volume(2 * one), Volume(one))


def _ulysses_attention(c: _Case) -> OpTraffic:
    """Per pass one all-to-all of packed q/k/v ``[b, s/p, q + 2 kv]`` and one of the output ``[b, s, q/p]``."""
    width = 2 * c.attn.q_rows + 2 * c.kv_sent
    a2a = Volume(activations=c.tokens / c.p * width * c.frac * c.dtype_bytes)
    return OpTraffic(a2a, a2a, a2a) + _zero3(*c.attn_params(), c)


def _ring_attention(c: _Case) -> OpTraffic:
    return _kv_ring(c.attn.kv_rows, c) + _zero3(*c.attn_params(), c)


def _zero3_mlp(c: _Case) -> OpTraffic:
    return _zero3(*c.mlp_params(), c)


def _metp_attention(c: _Case) -> OpTraffic:
    """p broadcasts (+ kv gather) of the packed head-group shards and their reduces; a K/V ring per group."""
    return _kv_ring(c.kv_sent, c) + _moving_shards(c.attn_params(), c)


def _metp_mlp(c: _Case) -> OpTraffic:
    return _moving_shards(c.mlp_params(), c)


_FORMULAS: dict[tuple[str, str], Callable[[_Case], OpTraffic]] = {
    ("tp_sp", "attention"): _tp_sp_attention,
    ("tp_sp", "mlp"): _tp_sp_mlp,
    ("ulysses", "attention"): _ulysses_attention,
    ("ulysses", "mlp"): _zero3_mlp,
    ("ring", "attention"): _ring_attention,
    ("ring", "mlp"): _zero3_mlp,
    ("metp", "attention"): _metp_attention,
    ("metp", "mlp"): _metp_mlp,
}


def op_traffic(
    mode: str,
    op: str,
    *,
    seq_len: int,
    batch: int,
    p: int,
    attn: AttnSpec,
    mlp: MlpSpec,
    dtype_bytes: int,
    biases: bool = False,
) -> OpTraffic:
    """Forward, backward and recomputation bytes one rank sends (mean over ranks) for one op of one layer.

    ``biases``: the q/k/v/o and up/gate/down linears have biases (those of o and down are replicated and
    never move inside the op). ``dtype_bytes``: element size of activations and weights.
    """
    formula = _FORMULAS.get((mode, op))
    if formula is None:
        modes = sorted({m for m, _ in _FORMULAS})
        raise ValueError(f"no volume formula for mode {mode!r}, op {op!r}; modes: {modes}, ops: attention, mlp")
    if p < 1 or seq_len < 1 or batch < 1 or dtype_bytes < 1:
        raise ValueError(f"need p, seq_len, batch, dtype_bytes >= 1, got {p}, {seq_len}, {batch}, {dtype_bytes}")
    return formula(_Case(seq_len, batch, p, attn, mlp, dtype_bytes, biases))


def op_volume(
    mode: str,
    op: str,
    *,
    seq_len: int,
    batch: int,
    p: int,
    attn: AttnSpec,
    mlp: MlpSpec,
    dtype_bytes: int,
    biases: bool = False,
    recompute: bool = False,
) -> Volume:
    """Bytes one rank sends for one op of one layer in one forward + backward, split activations/weights."""
    traffic = op_traffic(
        mode, op, seq_len=seq_len, batch=batch, p=p, attn=attn, mlp=mlp, dtype_bytes=dtype_bytes, biases=biases
    )
    return traffic.step(recompute)


def op_bytes(
    mode: str,
    op: str,
    *,
    seq_len: int,
    batch: int,
    p: int,
    attn: AttnSpec,
    mlp: MlpSpec,
    dtype_bytes: int,
    biases: bool = False,
    recompute: bool = False,
) -> float:
    """Total bytes one rank sends (mean over ranks) for one op of one layer in one forward + backward."""
    volume = op_volume(
        mode,
        op,
        seq_len=seq_len,
        batch=batch,
        p=p,
        attn=attn,
        mlp=mlp,
        dtype_bytes=dtype_bytes,
        biases=biases,
        recompute=recompute,
    )
    return volume.total
