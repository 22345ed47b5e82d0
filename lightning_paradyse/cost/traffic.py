"""Which collectives one op issues, per phase of a step: kind, number of calls, bytes, overlap.

:mod:`lightning_paradyse.modes.volume` gives the exact bytes each rank sends per op and phase (checked
against :class:`~lightning_paradyse.distributed.comm.CommCounter`). An alpha-beta time model also needs the
number of calls of each collective kind and whether the mode overlaps it with compute, so this module
splits the same volume into :class:`Collective` entries. Their bytes sum to ``volume.op_traffic``
exactly (a test checks it for every mode, op and phase), so the communication terms of the time model
rest on the measured-exact volumes.

Overlap follows the code: the key/value blocks of ring attention (``ring``, and ``metp``'s inner ring)
and the weight shards of ``metp``'s MLP travel while the op computes; the gradient accumulators that
follow them in backward are waited for at once, and every other collective is synchronous.

A sliding window changes none of it: ring attention (``ring``, ``metp``) skips the tiles outside the window but
still passes every key/value block (and its gradient accumulator) around the whole ring, and the other modes'
collectives do not depend on the attention pattern. What the window changes is how much compute the ring's hops
hide behind (:mod:`lightning_paradyse.cost.time`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_paradyse.cost.dims import ModelDims
from lightning_paradyse.distributed.comm import reduce_itemsize

KINDS = ("all_gather", "reduce_scatter", "all_to_all", "ring", "broadcast", "reduce", "all_reduce")
"""Collective kinds, named as :class:`~lightning_paradyse.distributed.comm.CommCounter` names them."""

PHASES = ("forward", "backward", "recompute")


@dataclass(frozen=True)
class Collective:
    """``calls`` collectives of one kind moving ``nbytes`` in all (bytes one rank sends, mean over ranks)."""

    kind: str
    """One of :data:`KINDS`."""
    calls: int
    """Number of calls (each pays the latency ``alpha`` once)."""
    nbytes: float
    """Bytes sent by one rank over all the calls (algorithmic volume, as ``volume.py`` counts)."""
    overlapped: bool = False
    """Issued asynchronously while the op computes (ring hops), else waited for at once."""


Phases = dict[str, list[Collective]]


@dataclass(frozen=True)
class _Case:
    d: ModelDims
    s: int
    b: int
    p: int

    @property
    def frac(self) -> float:
        return (self.p - 1) / self.p

    @property
    def e(self) -> int:
        """Element size of what the modes ship: activations and weights in the compute dtype (autocast's, else the
        parameters'); gradients are summed in float32 at least (:meth:`gbytes`)."""
        return self.d.act_bytes

    @property
    def kv_sent(self) -> int:
        """kv width a head-sharded mode ships (kv heads replicated to every rank that reads them)."""
        return self.p * self.d.kv_heads_per_rank(self.p) * self.d.head_dim

    def wbytes(self, elements: float) -> float:
        """Bytes of gathering (or scattering) ``elements`` sharded weight elements cast to the compute dtype first
        (the ZeRO-3 and METP matrices)."""
        return elements * self.frac * self.e

    def pbytes(self, elements: float) -> float:
        """Bytes of gathering ``elements`` sharded weight elements as they are stored, autocast casting them after
        the gather (``tp_sp``'s gathered k/v weights, ZeRO-3's biases)."""
        return elements * self.frac * self.d.dtype_bytes

    def gbytes(self, elements: float) -> float:
        """Bytes of summing the gradients of ``elements`` sharded weight elements over the ranks: in the parameters'
        dtype, float32 for half-precision ones (:func:`~lightning_paradyse.distributed.comm.reduce_itemsize`)."""
        return elements * self.frac * reduce_itemsize(self.d.dtype_bytes)


def _zero3(c: _Case, mats: int, n_mats: int, biases: int, n_biases: int) -> Phases:
    """ZeRO-3 weights: all-gather forward, all-gather again and reduce-scatter the gradient backward."""
    fwd = [Collective("all_gather", n_mats, c.wbytes(mats))]
    bwd = [Collective("all_gather", n_mats, c.wbytes(mats)), Collective("reduce_scatter", n_mats, c.gbytes(mats))]
    if n_biases:
        fwd.append(Collective("all_gather", n_biases, c.pbytes(biases)))
        bwd.append(Collective("reduce_scatter", n_biases, c.gbytes(biases)))
    return {"forward": fwd, "backward": bwd, "recompute": list(fwd)}


def _attn_weights(c: _Case) -> Phases:
    d = c.d
    mats = (2 * d.q_rows + 2 * d.kv_rows) * d.hidden
    return _zero3(c, mats, 4, d.q_rows + 2 * d.kv_rows, 3 if d.biases else 0)


def _mlp_weights(c: _Case) -> Phases:
    d = c.d
    return _zero3(
        c, (d.branches + 1) * d.ffn * d.hidden, d.branches + 1, d.branches * d.ffn, d.branches if d.biases else 0
    )


def _merge(*parts: Phases) -> Phases:
    return {phase: [coll for part in parts for coll in part[phase]] for phase in PHASES}


def _kv_ring(c: _Case, kv_width: int, groups: int) -> Phases:
    """``groups`` rings of ``p-1`` key/value hops; backward adds the dK/dV accumulators (float32)."""
    hops = groups * (c.p - 1)
    elements = groups * 2 * c.b * c.s * kv_width * c.frac  # (p-1) hops of [2, b, s/p, kv_width] per ring
    kv = Collective("ring", hops, elements * c.e, overlapped=True)
    grads = Collective("ring", hops, elements * c.d.acc_bytes)
    return {"forward": [kv], "backward": [kv, grads], "recompute": [kv]}


def _tp_sp(c: _Case, op: str) -> Phases:
    d = c.d
    one = c.b * c.s * d.hidden * c.frac * c.e  # one all-gather or reduce-scatter of [b, s, h]
    gather, scatter = Collective("all_gather", 1, one), Collective("reduce_scatter", 1, one)
    phases = {"forward": [gather, scatter], "backward": [scatter, gather], "recompute": [gather]}
    if op == "attention" and d.n_kv_heads % c.p:  # k/v weights (and biases) gathered
        calls = 4 if d.biases else 2
        kv = 2 * d.kv_rows * (d.hidden + (1 if d.biases else 0))
        phases["forward"].append(Collective("all_gather", calls, c.pbytes(kv)))
        phases["backward"].append(Collective("reduce_scatter", calls, c.gbytes(kv)))
        phases["recompute"].append(Collective("all_gather", calls, c.pbytes(kv)))
    return phases


def _ulysses(c: _Case, op: str) -> Phases:
    if op == "mlp":
        return _mlp_weights(c)
    width = 2 * c.d.q_rows + 2 * c.kv_sent
    a2a = Collective("all_to_all", 2, c.b * c.s / c.p * width * c.frac * c.e)
    return _merge({"forward": [a2a], "backward": [a2a], "recompute": [a2a]}, _attn_weights(c))


def _ring(c: _Case, op: str) -> Phases:
    if op == "mlp":
        return _mlp_weights(c)
    return _merge(_kv_ring(c, c.d.kv_rows, 1), _attn_weights(c))


def _metp(c: _Case, op: str) -> Phases:
    d = c.d
    if op == "mlp":  # the packed shard rides the ring; its gradient accumulator follows, waited for
        once = c.wbytes(d.mlp_params())
        hop = Collective("ring", c.p - 1, once, overlapped=True)
        grads = Collective("ring", c.p - 1, c.gbytes(d.mlp_params()))
        return {"forward": [hop], "backward": [hop, grads], "recompute": [hop]}
    once = c.wbytes(d.attn_params())
    bcast = Collective("broadcast", c.p, once)
    reduce = Collective("reduce", c.p, c.gbytes(d.attn_params()))
    shards = {"forward": [bcast], "backward": [bcast, reduce], "recompute": [bcast]}
    return _merge(_kv_ring(c, c.kv_sent // c.p, c.p), shards)


_MODES: dict[str, Callable[[_Case, str], Phases]] = {"tp_sp": _tp_sp, "ulysses": _ulysses, "ring": _ring, "metp": _metp}


def op_collectives(mode: str, op: str, seq_len: int, batch: int, p: int, dims: ModelDims) -> Phases:
    """``{phase: [Collective, ...]}`` of one op of one layer for ``forward``, ``backward``, ``recompute``."""
    if mode not in _MODES or op not in ("attention", "mlp"):
        raise ValueError(f"no collectives known for mode {mode!r}, op {op!r}")
    if p == 1:
        return {phase: [] for phase in PHASES}
    return _MODES[mode](_Case(dims, seq_len, batch, p), op)


def phase_bytes(collectives: list[Collective]) -> float:
    """Bytes of a list of collectives."""
    return sum(c.nbytes for c in collectives)
