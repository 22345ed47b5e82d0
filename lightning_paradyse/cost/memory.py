"""Memory of one op per mode: what it saves for backward and its transient peaks, in bytes per rank.

The unit of the memory model is a *segment*: the norm before an op plus the op's core (the mode),
i.e. what runs between two residual additions. For a segment in a given mode, recompute flag,
length ``s`` and batch ``b`` on ``p`` ranks the model gives three numbers:

* ``saved``: bytes the segment leaves alive after its forward until its backward (the norm's input
  and statistics, the tensors the mode saves; with recomputation only the op's input).
* ``fwd``: the peak of the segment's forward above the memory alive before it (its input included).
* ``bwd``: the peak of the segment's backward above the memory alive when it starts (its saved
  tensors and the incoming gradient included); with recomputation the re-run forward is in it.

How a whole step composes them (saved bytes accumulate over the ops, transients do not add up, weight
gradients accumulate in backward) is in :mod:`lightning_paradyse.cost.model`.

Each number is split into a length-independent part (gathered weights, weight shards in flight: known
exactly from the shapes) and a length-dependent part (activations, attention tiles), because the profile
calibrates only the latter with a multiplicative factor. The formulas were derived from the modes' code
(``modes/*.py``) and checked tensor by tensor against :class:`~lightning_paradyse.calibration.tracker.MemoryTracker`
on CPU: ``saved`` is exact for ``b = 1`` (float32), the transients are the dominant moments of each
op and agree to about 10%. Symbols (all per rank): ``t = b*ceil(s/p)`` local tokens, ``T = b*s``,
``X = t*h*e`` a local hidden state, ``XG = T*h*e`` a gathered one, ``e`` the activations' element size, ``r`` the
parameters' (and the residual stream's).

Under autocast (``precision="bf16-mixed"``: float32 parameters, bf16 matmuls; checked tensor by tensor with
autograd's saved-tensor hooks and against the tracker) what a mode computes is in the compute dtype (``e = 2``)
while the residual stream, the norms (they compute in float32 and return the stream's dtype), the rotary tables,
log-sum-exps and accumulators stay float32 (``XR = t*h*r``). A mode keeps its input cast to the compute dtype;
a recomputed segment keeps the stream's; the input's gradient returns in the stream's dtype. ``tp_sp``'s projections
(and every mode's on one rank) are autocast's own matmuls on the weight shards: autocast's casts of the shards
(``e`` bytes per element) are saved for backward, and its cache keeps them until the forward ends even in a
recomputed segment; the other modes cast weights inside their own functions and keep the float32 shards. The
saved bytes are checked against the tracker with autocast open over the forward; the transients under autocast
(the casts and the input's gradient added to the float32 moments) are not checked one by one.

A layer with a causal sliding window ``w`` shorter than the sequence (checked with the tracker at ``p = 2``):

* the SDPA path (``tp_sp``, ``ulysses``) runs query chunks of ``w`` tokens with a band mask (see
  :func:`~lightning_paradyse.cost.time.sdpa_chunks`). Each chunk's boolean mask becomes a ``[queries, keys]`` float
  mask in the activations' dtype that the kernel keeps for backward, ``e`` bytes per pair of every chunk (once,
  whatever ``b`` and the heads); ``tp_sp`` also keeps the chunks' outputs beside their concatenation (``T*q/p*e``;
  ``ulysses`` copies its output for the all-to-all anyway). Building one chunk's mask holds :data:`BAND_BYTES`
  per pair of the chunk (int64 position differences, three boolean masks, the previous chunk's mask).
* ring attention runs a tile the window's edge crosses in the explicit kernel, which holds score tiles even where
  unmasked tiles run the flash kernel, plus the tiles' boolean masks (one byte per pair, those of one source's
  block at a time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from lightning_paradyse.cost.dims import ModelDims
from lightning_paradyse.cost.time import ring_tiles, sdpa_chunks, sdpa_pairs
from lightning_paradyse.distributed.comm import reduce_itemsize
from lightning_paradyse.distributed.layout import SeqLayout

BAND_BYTES = 12
"""Bytes per (query, key) pair of one chunk while its band mask is built: the ``int64`` position differences, the
two comparisons and their conjunction, and the previous chunk's boolean mask (see the module docstring)."""


@dataclass(frozen=True)
class Mem:
    """Bytes split into a length-independent and a length-dependent part."""

    fixed: float = 0.0
    """Length-independent bytes (weights, weight shards, weight gradients)."""
    var: float = 0.0
    """Length-dependent bytes (activations, attention tiles); what calibration scales."""

    @property
    def total(self) -> float:
        return self.fixed + self.var

    def __add__(self, other: Mem) -> Mem:
        return Mem(self.fixed + other.fixed, self.var + other.var)

    def scaled(self, var_factor: float) -> Mem:
        return Mem(self.fixed, self.var * var_factor)


def peak(*moments: Mem) -> Mem:
    """The largest of several candidate moments (the first one on ties)."""
    return max(moments, key=lambda m: m.total)


@dataclass(frozen=True)
class SegmentMemory:
    """One segment (norm + op) in one mode: bytes per rank."""

    saved: Mem
    """Alive from the end of the segment's forward to its backward."""
    fwd: Mem
    """Forward peak above the bytes alive before the segment (its input included)."""
    bwd: Mem
    """Backward peak above the bytes alive when the segment's backward starts."""


@dataclass(frozen=True)
class _Shape:
    """Per-rank sizes of one (length, batch, group) case: the symbols of the module docstring."""

    d: ModelDims
    s: int
    b: int
    p: int
    flash: bool = False
    """Attention tiles run in a flash kernel (no score tile is materialised)."""
    window: int | None = None
    """The layer's causal sliding window (``None``: the whole sequence)."""

    @property
    def e(self) -> int:
        return self.d.act_bytes

    @property
    def r(self) -> int:
        """Element size of the parameters and the residual stream."""
        return self.d.dtype_bytes

    @property
    def a(self) -> int:
        return self.d.acc_bytes

    @property
    def s_r(self) -> int:
        """Tokens of the fullest rank."""
        return math.ceil(self.s / self.p)

    @property
    def t(self) -> int:
        return self.b * self.s_r

    @property
    def T(self) -> int:
        return self.b * self.s

    @property
    def X(self) -> float:
        return self.t * self.d.hidden * self.e

    @property
    def XG(self) -> float:
        return self.T * self.d.hidden * self.e

    @property
    def XR(self) -> float:
        """A local hidden state of the residual stream (in the parameters' dtype)."""
        return self.t * self.d.hidden * self.r

    def casts(self, op: str) -> float:
        """Autocast's compute-dtype copies of the op's weights on this rank (nothing without autocast): the ``1/p``
        shards, and for attention the key/value rows of the local heads' kv heads (replicated when ``n_kv < p``)."""
        if not self.d.autocast:
            return 0.0
        d = self.d
        if op == "mlp":
            return d.mlp_params() / self.p * self.e
        biases = self.qr + 2 * self.kvr if d.biases else 0
        return ((2 * self.qr + 2 * self.kvr) * d.hidden + biases) * self.e

    @property
    def balanced(self) -> bool:
        """The head-tail layout of causal attention (see :class:`~lightning_paradyse.distributed.layout.SeqLayout`)."""
        return self.d.causal and self.p > 1 and self.s >= 2 * self.p

    @property
    def qr(self) -> int:
        """Query width of the ``n/p`` local heads."""
        return self.d.q_rows // self.p

    @property
    def kvr(self) -> int:
        """Key width of the kv heads the local query heads read (``m*d``)."""
        return self.d.kv_heads_per_rank(self.p) * self.d.head_dim

    @property
    def kr(self) -> int:
        """Key width the attention kernel sees per rank: repeated to ``n/p`` heads when grouped."""
        return self.qr if self.d.n_heads // self.p > self.d.kv_heads_per_rank(self.p) else self.kvr

    @property
    def chunk(self) -> int:
        """Tokens of one ring tile side: ``s/2p`` in the balanced layout, else ``s/p``."""
        return math.ceil(self.s / (2 * self.p)) if self.balanced else self.s_r

    @cached_property
    def masked_tiles(self) -> int:
        """Ring tiles a sliding window masks, the most of one source's block (0 without a window)."""
        return ring_tiles(self.s, self.p, self.d.causal, self.window).masked_tiles if self.window else 0

    def tile(self, heads: int) -> float:
        """Bytes of one attention score tile ``[b, heads, chunk, chunk]`` in the accumulation dtype: nothing in a
        flash kernel, unless a sliding window masks tiles (they run in the explicit kernel)."""
        if self.flash and not self.masked_tiles:
            return 0.0
        return self.b * heads * self.chunk * self.chunk * self.a

    def tile_masks(self) -> float:
        """The boolean ``[chunk, chunk]`` masks of one source's window-masked ring tiles."""
        return self.masked_tiles * self.chunk * self.chunk

    @property
    def band(self) -> bool:
        """The SDPA path runs query chunks against a band mask (a window shorter than the sequence)."""
        return self.window is not None and self.s > self.window

    def band_masks(self) -> float:
        """The float band masks the SDPA kernel keeps for backward, ``e`` bytes per pair of every chunk."""
        return sdpa_pairs(self.s, True, self.window) * self.e if self.band else 0.0

    def band_build(self) -> float:
        """Building one chunk's band mask: :data:`BAND_BYTES` per pair of the largest chunk."""
        if not self.band or self.window is None:
            return 0.0
        return BAND_BYTES * max(q * k for q, k in sdpa_chunks(self.s, self.window))

    def rot(self, tokens: int) -> float:
        """The float32 cos/sin tables a rotary op saves (two per q and k) for ``tokens`` positions."""
        return 4 * tokens * self.d.head_dim * 4 if self.d.rotary else 0.0

    @cached_property
    def pad(self) -> float:
        """The padded buffers of a sequence gather or reduce-scatter when the ranks hold different token counts
        (see :func:`~lightning_paradyse.distributed.comm.all_gather_rows`): the ``[p * max_r]`` output and the
        ``[max_r]`` padded input, which gloo may release only after the call has returned; nothing when the counts are
        equal (the collective then reads the input and writes the result in place)."""
        lens = SeqLayout.for_sequence(self.s, self.p, self.d.causal).local_lens
        return self.b * (self.p + 1) * max(lens) * self.d.hidden * self.e if len(set(lens)) > 1 else 0.0

    def index(self) -> float:
        """The two int64 permutations of a balanced gather (natural order and back)."""
        return 2 * 8 * self.s if self.balanced else 0.0


# --------------------------------------------------------------------------------------------------
# Per mode: (saved without the op input, saves its input, fwd peak, bwd peak, fwd peak when recomputed)
# --------------------------------------------------------------------------------------------------


def _wide_grads(c: _Shape, w: float) -> float:
    """Bytes a weight gradient of ``w`` bytes adds while it is summed over ranks in float32 for half-precision
    weights (:func:`~lightning_paradyse.distributed.comm.reduce_dtype`): its float32 copy and the float32 reduced
    shard."""
    wide = w * reduce_itemsize(c.e) / c.e
    return 0.0 if wide == w else wide * (1 + 1 / c.p)


@dataclass(frozen=True)
class _Core:
    saved: Mem
    """Saved by the op's core, not counting its input."""
    saves_input: bool
    """The core keeps its input (the norm's output) for backward."""
    fwd: Mem
    """Core forward peak, not counting the input."""
    bwd: Mem
    """Core backward peak above its start."""
    fwd_rc: Mem | None = None
    """Core forward peak when checkpointed (nothing saved, intermediates freed early); default ``fwd``."""
    input_casts: int = 1
    """Copies of its input the core keeps under autocast, each cast to the compute dtype by the projection that
    reads it (one shared input without autocast)."""


def _full_attention_saved(c: _Shape, q_view_of: str) -> float:
    """q, k, v, out and lse of full-sequence attention over the ``n/p`` local heads (``tp_sp``, ``ulysses``).

    ``q_view_of``: ``own`` when un-rotated q/k/v are views of their own projections (``tp_sp``),
    ``full`` when they are views of one all-to-all buffer, which then stays alive whole (``ulysses``).
    """
    d, T, e = c.d, c.T, c.e
    repeat = c.kr == c.qr and d.n_heads // c.p > d.kv_heads_per_rank(c.p)
    lse = c.b * (d.n_heads // c.p) * c.s * 4
    if q_view_of == "own":
        return T * (2 * c.qr + 2 * c.kr) * e + lse
    new = (c.qr if d.rotary else 0) + (c.kr if (d.rotary or repeat) else 0) + (c.kr if repeat else 0)
    views = (not d.rotary) or (not repeat)
    return T * (new + c.qr) * e + (T * (c.qr + 2 * c.kvr) * e if views else 0.0) + lse


def _tp_sp_attention(c: _Shape) -> _Core:
    XG = c.XG
    band = c.band_masks() + (c.T * c.qr * c.e if c.band else 0.0)  # masks; chunk outputs beside their concatenation
    saved = XG + _full_attention_saved(c, "own") + c.rot(c.s) + c.index() + band
    after = XG if c.balanced else c.X  # the output re-ordered (balanced) or the reduce-scatter result
    fwd = peak(Mem(0.0, saved + XG + after + c.pad), Mem(0.0, saved + c.band_build()))
    bwd = Mem(0.0, XG * (3 if c.balanced else 2) + c.pad)
    attending = 2 * XG + c.T * (2 * c.qr + c.kvr) * c.e  # what a checkpointed forward holds inside the attention
    fwd_rc = peak(Mem(0.0, attending + after + c.pad), Mem(0.0, attending + c.band_build()))
    return _Core(Mem(0.0, saved), False, fwd, bwd, fwd_rc)


def _ulysses_attention(c: _Shape) -> _Core:
    d, t, T, e = c.d, c.t, c.T, c.e
    saved = _full_attention_saved(c, "full") + c.rot(c.s) + c.index() + t * d.q_rows * e + c.band_masks()
    kv_sent = c.p * c.kvr  # kv width shipped, kv heads replicated when n_kv < p
    act = 2 * t * (d.q_rows + 2 * kv_sent) * e + T * (c.qr + 2 * c.kvr) * e + 2 * T * c.qr * e
    w_out = d.q_rows * d.hidden * e
    fwd = peak(Mem(w_out * (1 + 1 / c.p), saved + act), Mem(0.0, saved + c.band_build()))
    bwd = peak(Mem(w_out * (2 + 1 / c.p) + _wide_grads(c, w_out), c.X), Mem(2 * w_out, 2 * T * c.qr * e))
    rc = 2 * t * (d.q_rows + 2 * kv_sent) * e + T * (2 * c.qr + 3 * c.kvr) * e + t * d.q_rows * e + c.band_build()
    return _Core(Mem(0.0, saved), True, fwd, bwd, Mem(w_out * (1 + 1 / c.p), rc), input_casts=3)  # q, k, v


def _ring_attention(c: _Shape) -> _Core:
    d, t, e, a = c.d, c.t, c.e, c.a
    q, kv, n = d.q_rows, d.kv_rows, d.n_heads
    saved = c.rot(c.s_r) + t * (q + 2 * kv) * e + 2 * t * q * e + c.b * n * c.s_r * a
    tiles = Mem(0.0, saved - 2 * t * q * e + 4 * t * kv * e + 1.5 * t * q * a + 3 * c.tile(n) + c.tile_masks())
    w_max = max(q, kv) * d.hidden * e
    weights = Mem(w_max * (1 + 1 / c.p), saved + c.X)
    fwd = peak(tiles, weights)
    ring = Mem(q * d.hidden * e / c.p, 5 * c.tile(n) + c.tile_masks() + t * q * a + 6 * t * kv * a + c.X)
    bwd = peak(ring, Mem(w_max * (2 + 1 / c.p) + _wide_grads(c, w_max), c.X))
    return _Core(Mem(0.0, saved), True, fwd, bwd, input_casts=3)  # q, k, v


def _metp_attention(c: _Shape) -> _Core:
    """Derived from ``modes/metp.py`` and checked against the tracker at ``p = 2, 4`` (``tests/cost/test_model.py``).

    Forward, at the last head shard: the output accumulator, the earlier shards' outputs and log-sum-exps, the
    two packed shards (this rank's, the one received), and either the shard's projections while its queries are
    rotated (q, k, v, the rotated k, four query-sized rotation temporaries, the float64 rotary tables and their
    casts, two copies of the positions) or the ring's tiles; with fewer key/value heads than ranks the gathered
    key/value weights and the shard's rows of them besides. Backward, while the last shard's projections are
    differentiated: the packed shards (this rank's, the one received, the previous shard's gradient, the reduced
    gradient of this rank's own shard and, from ``p = 4``, the previous reduction's result, which Python keeps
    alive until it is replaced), the output weight's and the key/value weights' gradients, the ``dx`` accumulator
    and the previous shard's ``dx``, three hidden-sized gradients in flight, the output gradient and its contiguous
    copy, the query gradient and its accumulator, four key/value-sized gradients (the gathered key/value weights,
    their gradient and its accumulator besides when they are gathered); or the ring's moment."""
    d, t, e, a = c.d, c.t, c.e, c.a
    qr, kvr, nr, h = c.qr, c.kvr, d.n_heads // c.p, d.hidden
    b_q, b_kv = (d.q_rows, 2 * d.kv_rows) if d.biases else (0, 0)
    if d.n_kv_heads % c.p == 0:  # the k/v shards are the local heads': they travel with the broadcast
        shard, kv_fwd, kv_bwd = d.attn_params() / c.p * e, 0.0, 0.0
    else:  # q and o_t travel; the k/v weights are gathered whole, each shard picks its heads' rows
        shard = (2 * d.q_rows * h + b_q) / c.p * e
        kv_all = (2 * d.kv_rows * h + b_kv) * e
        rows = kvr * (2 * h + (2 if d.biases else 0)) * e
        kv_fwd, kv_bwd = kv_all + rows, 3 * kv_all + rows  # backward: gathered, their gradient, its accumulator
    saved = t * d.q_rows * e + c.b * d.n_heads * c.s_r * a  # every head shard's output and log-sum-exp
    earlier = saved * (c.p - 1) / c.p
    positions = 8 * c.s_r  # int64 positions of the local tokens
    tables = 24 * c.s_r * d.head_dim if d.rotary else 0.0  # float64 cos/sin and their float32 casts
    rotating = (4 * t * qr + t * kvr) * e if d.rotary else 0.0
    projecting = t * (qr + 2 * kvr) * e + rotating + tables + 2 * positions
    ring = 1.5 * t * (qr + 2 * kvr) * e + 4 * t * kvr * e + 1.5 * t * qr * a + 3 * c.tile(nr) + c.tile_masks()
    fwd = Mem(2 * shard + kv_fwd, t * h * a + earlier + max(projecting, ring))
    shards = 4 + (1 if c.p > 2 else 0)
    weights = shards * shard + (qr + 2 * kvr) * h * e + kv_bwd + _wide_grads(c, shard)
    dx = t * h * a + (c.X if c.p > 1 else 0.0)  # the accumulator and the previous shard's dx
    differentiating = 3 * c.X + 2 * t * qr * e + t * qr * (a + e) + 4 * t * kvr * e + positions
    recompute = t * (qr + 2 * kvr) * e + c.rot(c.s_r) + t * qr * e + t * qr * a + 6 * t * kvr * a
    ringing = 2 * t * qr * e + recompute + 5 * c.tile(nr) + c.tile_masks()
    bwd = Mem(weights, dx + max(differentiating, ringing))
    return _Core(Mem(0.0, saved), True, fwd, bwd)


def _mlp_saved_factor(d: ModelDims) -> int:
    """``[.., f]`` tensors an MLP saves: up, gate, act(gate), product when gated; up, act(up) otherwise."""
    return 4 if d.gated else 2


def _tp_sp_mlp(c: _Shape) -> _Core:
    d, T, e = c.d, c.T, c.e
    f_r = d.ffn // c.p
    saved = c.XG + _mlp_saved_factor(d) * T * f_r * e
    fwd = Mem(0.0, saved + c.XG + c.X + c.pad)
    bwd = Mem(f_r * d.hidden * e, c.XG + T * f_r * e + c.pad)
    return _Core(Mem(0.0, saved), False, fwd, bwd, Mem(0.0, saved + c.pad))


def _zero3_mlp(c: _Shape) -> _Core:
    d, t, e = c.d, c.t, c.e
    w = d.ffn * d.hidden * e  # one gathered MLP matrix
    saved = _mlp_saved_factor(d) * t * d.ffn * e
    fwd = Mem(w * (1 + 1 / c.p), saved)
    bwd = peak(Mem(w * (2 + 1 / c.p) + _wide_grads(c, w), t * d.ffn * e), Mem(w / c.p, 2 * t * d.ffn * e))
    fwd_rc = Mem(w * (1 + 1 / c.p), (_mlp_saved_factor(d) - 1) * t * d.ffn * e)
    return _Core(Mem(0.0, saved), True, fwd, bwd, fwd_rc, input_casts=d.branches)


def _metp_mlp(c: _Shape) -> _Core:
    """Derived from ``modes/metp.py`` and checked against the tracker at ``p = 2, 4`` (``tests/cost/test_model.py``).

    Backward, while one ring step's shard is differentiated: the shards alive (the weights in hand and, before the
    last step, the next one arriving; from ``p = 4`` the gradient accumulators too: this rank's own, the one
    received, the one sent and the step's own, the last two kept alive by their Python names), the ``dx``
    accumulator and two hidden-sized gradients, and either the re-run step's ``[t, f/p]`` intermediates and
    gradients with one weight gradient, or every weight gradient of the shard with five hidden-sized ones, or (from
    ``p = 4``) the step's gradient being packed beside its pieces and the accumulators, or (short sequences) the
    last sum of this rank's own shard's gradient beside every accumulator still named. Forward:
    the two shards, the output accumulator and either the step's intermediates or, at its down projection, the
    step's output beside them (the gate's activation freed); from ``p = 4``, on short sequences, three shards
    (a transfer starting while the previous step's shard is still held)."""
    d, t, e, a = c.d, c.t, c.e, c.a
    f_r, h = d.ffn // c.p, d.hidden
    shard = d.mlp_params() / c.p * e  # the packed shard travelling on the ring
    acc = shard * reduce_itemsize(e) / e if c.p > 1 else shard  # a gradient accumulator (float32 for half weights)
    inter = _mlp_saved_factor(d) * t * f_r * e
    out = c.X + inter - (t * f_r * e if d.gated else 0.0)  # at the down projection (the gate's activation freed)
    fwd = Mem(2 * shard, t * h * a + max(inter, out))
    if c.p > 2:  # a later step's transfer starts while the step before still holds its shard
        fwd = peak(fwd, Mem(3 * shard, t * h * a))
    mats = 3 if d.gated else 2
    if c.p <= 2:  # the weights and the next ones arriving, or the weights and the home sum
        held, packing = shard + max(shard, acc), 0.0
    else:  # from the third step: the accumulators sent and received; the packing one beside them
        held = 2 * shard + (3 if c.p <= 4 else 4) * acc
        packing = held + acc + mats * f_r * h * e
    rerun = Mem(held + f_r * h * e, t * h * a + 2 * c.X + (_mlp_saved_factor(d) + 2) * t * f_r * e)
    grads = Mem(held + mats * f_r * h * e, t * h * a + 5 * c.X)
    packed = Mem(packing, t * h * a + 3 * c.X) if packing else Mem()
    summing = Mem(shard + (4 if c.p <= 2 else 5) * acc, t * h * a + c.X) if c.p > 1 else Mem()
    return _Core(Mem(), True, fwd, peak(rerun, grads, packed, summing))


_CORES: dict[tuple[str, str], Callable[[_Shape], _Core]] = {
    ("tp_sp", "attention"): _tp_sp_attention,
    ("tp_sp", "mlp"): _tp_sp_mlp,
    ("ulysses", "attention"): _ulysses_attention,
    ("ulysses", "mlp"): _zero3_mlp,
    ("ring", "attention"): _ring_attention,
    ("ring", "mlp"): _zero3_mlp,
    ("metp", "attention"): _metp_attention,
    ("metp", "mlp"): _metp_mlp,
}


# --------------------------------------------------------------------------------------------------
# Norms, segments and the model's ends
# --------------------------------------------------------------------------------------------------


def _norm(c: _Shape) -> tuple[float, float]:
    """``(saved, allocated before the core)`` of the norm, its output (the op's input) included in the latter.

    RMSNorm (float32 compute) saves its input, the normalised input and ``1/rms``; a low-precision input
    is first copied to float32. LayerNorm saves its input, mean and ``1/std``. Both read the residual stream and
    return its dtype (autocast runs them in float32).
    """
    t, h, r, X = c.t, c.d.hidden, c.r, c.XR
    if c.d.norm == "layer":
        return X + 8 * t, 8 * t + X
    if r >= 4:
        return 2 * X + 4 * t, 4 * t + 2 * X
    return 2 * t * h * 4 + 4 * t, 2 * t * h * 4 + 4 * t + X


def segment_memory(
    mode: str,
    op: str,
    recompute: bool,
    seq_len: int,
    batch: int,
    p: int,
    dims: ModelDims,
    flash: bool = False,
    window: int | None = None,
) -> SegmentMemory:
    """Bytes per rank of one segment (norm + ``op`` in ``mode``); see the module docstring.

    ``flash``: ring attention tiles run in a fused flash kernel (on CPU, tiles without a document mask), so no
    ``[b, heads, chunk, chunk]`` score tile is ever held; the explicit implementation materialises it.
    ``window``: the layer's causal sliding window (``None``: the whole sequence; the MLP ignores it).
    """
    return segment_memories(mode, op, seq_len, batch, p, dims, flash, window, (recompute,))[0]


def segment_memories(
    mode: str,
    op: str,
    seq_len: int,
    batch: int,
    p: int,
    dims: ModelDims,
    flash: bool = False,
    window: int | None = None,
    recompute: tuple[bool, ...] = (False, True),
) -> tuple[SegmentMemory, ...]:
    """:func:`segment_memory` for every flag of ``recompute``, in order: the shape, the core's formula and the norm
    worked out once for all of them (the planner prices both of every mode's variants)."""
    formula = _CORES.get((mode, op))
    if formula is None:
        raise ValueError(f"no memory formula for mode {mode!r}, op {op!r}")
    c = _Shape(dims, seq_len, batch, p, flash, window if op == "attention" else None)
    core = formula(c)
    norm_saved, norm_alloc = _norm(c)
    return tuple(_segment(mode, op, rc, p, dims, c, core, norm_saved, norm_alloc) for rc in recompute)


def _segment(
    mode: str,
    op: str,
    recompute: bool,
    p: int,
    dims: ModelDims,
    c: _Shape,
    core: _Core,
    norm_saved: float,
    norm_alloc: float,
) -> SegmentMemory:
    """One variant's bytes from the segment's shape ``c``, its core and its norm (:func:`segment_memories`)."""
    before = Mem(0.0, norm_alloc)
    inputs, cast_in, dx, kept = 1, Mem(), Mem(), Mem()
    if dims.autocast:
        inputs = core.input_casts
        cast_in = Mem(0.0, (inputs if core.saves_input else 1) * c.X)  # the input's casts, through the forward
        dx = Mem(0.0, c.XR)  # the input's gradient in the stream's dtype, beside the compute dtype's
        # autocast's casts of the weight shards (its own matmuls: tp_sp's, every mode's on one rank), which its cache
        # keeps until the forward ends even where the segment is recomputed
        kept = Mem(c.casts(op) if mode == "tp_sp" or p == 1 else 0.0, 0.0)
    if recompute:  # only the input is saved; backward re-runs the forward, saving, then the backward
        saved = kept + Mem(0.0, norm_saved + c.XR)
        bwd = peak(kept + core.saved + core.bwd + dx, core.fwd + cast_in)
        return SegmentMemory(saved, before + cast_in + (core.fwd_rc or core.fwd), bwd)
    saved = kept + Mem(0.0, norm_saved + (inputs * c.X if core.saves_input else 0.0)) + core.saved
    return SegmentMemory(saved, before + cast_in + core.fwd, core.bwd + dx)


def head_memory(seq_len: int, batch: int, p: int, dims: ModelDims) -> SegmentMemory:
    """The final norm, the LM head and a float32 cross-entropy on the local tokens, as a segment.

    Under autocast the head keeps its input and its weight cast to the compute dtype, and the forward's peak is the
    logits' upcast (the compute-dtype logits beside their float32 copy, the norm's output and the two casts);
    measured on the host: saved exact, the forward's peak 8% above the tracker's."""
    c = _Shape(dims, seq_len, batch, p)
    t, V, e = c.t, dims.vocab, c.e
    norm_saved, norm_alloc = _norm(c)
    logits32 = t * V * 4
    if dims.autocast:
        cast = V * dims.hidden * e  # the head's weight in the compute dtype
        saved = Mem(cast, norm_saved + c.X + logits32)
        fwd = Mem(cast, norm_alloc + c.X + t * V * e + logits32)
        grad = V * dims.hidden * (e + c.r)  # the weight's gradient in the compute dtype, then in the parameters'
        return SegmentMemory(saved, fwd, Mem(grad, 2 * logits32 + t * V * e + c.X))
    upcast = logits32 if e < 4 else 0.0
    saved = Mem(0.0, norm_saved + c.X + logits32)
    fwd = Mem(0.0, norm_alloc + t * V * e + upcast + logits32)
    bwd = Mem(V * dims.hidden * e, 2 * logits32 + t * V * e + c.X)
    return SegmentMemory(saved, fwd, bwd)


def stream_bytes(seq_len: int, batch: int, p: int, dims: ModelDims) -> float:
    """One local hidden state ``[b, s/p, h]``: the residual stream, or its gradient."""
    return _Shape(dims, seq_len, batch, p).XR


def op_grad_bytes(op: str, p: int, dims: ModelDims) -> float:
    """Gradient bytes one segment leaves after its backward: its weight shards, norm and output bias."""
    return (math.ceil(dims.op_params(op) / p) + dims.op_replicated()) * dims.dtype_bytes


def outer_grad_bytes(dims: ModelDims) -> float:
    """Gradient bytes of the replicated parameters outside the blocks (embedding, head, final norm)."""
    return dims.outer_params() * dims.dtype_bytes


def param_bytes(p: int, dims: ModelDims) -> float:
    """Parameter bytes per rank: the 1/p shards of every block weight and the replicated rest."""
    per_layer = sum(math.ceil(dims.op_params(op) / p) + dims.op_replicated() for op in ("attention", "mlp"))
    return (dims.n_layers * per_layer + dims.outer_params()) * dims.dtype_bytes
