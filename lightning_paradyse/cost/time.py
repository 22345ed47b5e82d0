"""Time of one op per mode: FLOPs at measured rates plus alpha-beta collectives, with overlap.

For one op of one layer in a mode, on ``p`` ranks, for ``s`` tokens and ``b`` sequences, each phase of
a step (forward, backward, and the re-run forward of activation recomputation) costs

    compute = GEMM FLOPs / GEMM rate  +  attention FLOPs / attention-kernel rate
    comm    = sum over collectives of  alpha(kind, p) * calls + bytes / beta(kind, p)
    time    = compute_rest + comm_exposed + overlap(compute_hidden, comm_overlapped)

with ``overlap(c, m) = c + m - eta * min(c, m)``: ``eta = 1`` is perfect overlap (``max(c, m)``), ``eta =
0`` none. What overlaps follows the code (see :mod:`lightning_paradyse.cost.traffic`): ring attention's
key/value hops hide behind the attention tiles (``ring``, and ``metp``'s inner ring), ``metp``'s MLP
weight ring behind the MLP matmuls.

FLOPs per rank (``t = b*s/p`` local tokens, ``T = b*s``, ``q = n*d``, ``kv = n_kv*d``):

* projections: ``2*t*h*(q + 2*kv) + 2*t*q*h`` (``tp_sp`` computes the kv heads its query heads read,
  ``metp`` each head shard's, which differs only with fewer kv heads than ranks); MLP ``2*t*h*f*(B+1)``
  with ``B`` input branches. Backward is twice the forward; ``metp`` recomputes its projections (and
  the MLP step) inside backward, once more.
* attention: ``4*d`` FLOPs per (query, key) pair and head, forward; backward ``2.5x`` (five products
  against two). Full-sequence attention (``tp_sp``, ``ulysses``, the fused SDPA kernel) over ``n/p``
  heads and ``s(s+1)/2`` pairs when causal; ring attention (``ring``, ``metp``, tile by tile) over all
  heads and exactly the pairs of the tiles :func:`lightning_paradyse.modes.ring.tiles` computes (a
  diagonal tile is computed whole and masked, at its own measured rate: the mask makes it slower).

Sliding windows (a layer's ``window`` ``w``, :attr:`~lightning_paradyse.cost.dims.ModelDims.windows`) are priced by
the work each mode really does for them:

* a causal window over ``s`` tokens has ``sum_i min(i+1, w) = s*w - w(w-1)/2`` (query, key) pairs for ``s > w``
  (:func:`window_pairs`; per document with packing, :func:`attention_pairs`);
* the SDPA path (``tp_sp``, ``ulysses``: :func:`lightning_paradyse.modes.attention.full_attention`) runs a sequence
  longer than the window by query chunks of ``w`` tokens, each against the ``<= 2w - 1`` keys it can see, with a band
  mask; a chunk computes its whole rectangle (``w(2w-1)`` pairs, about twice the pairs in the window), at the rate of
  that masked call (kernel ``sdpa_band``, measured per window when the model has windows; else the causal kernel's rate
  over ``2w`` tokens, as many pairs, stands in) (:func:`sdpa_pairs`, :func:`sdpa_size`);
* ring attention (``ring``, ``metp``: :func:`lightning_paradyse.modes.ring.doc_tiles`) skips a tile whose keys are
  all older than the window and masks a tile the window's edge crosses; a masked tile is computed whole by the
  explicit kernel (the fused one takes no mask), at its own rate (kernel ``tile_mask``/``gtile_mask``, measured
  when the model has windows; else the diagonal tile's rate stands in, optimistic on CPU, where the explicit
  kernel is several times slower) (:func:`ring_tiles`);
* the traffic does not change: every key/value block still travels the whole ring (a skipped tile skips its
  compute, not its hop), so less of that traffic hides behind attention.

Rates come from a :class:`Machine`: measured on this machine by the profile (a GEMM, the SDPA kernel
and the ring tile kernel at the model's head size, collectives of several sizes), or derived from a
cluster description (:mod:`lightning_paradyse.cost.cluster`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_paradyse.cost.dims import ModelDims
from lightning_paradyse.cost.traffic import KINDS, Collective, op_collectives
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.modes.ring import tiles


@dataclass(frozen=True)
class AlphaBeta:
    """Time of ``calls`` collectives moving ``nbytes``: ``alpha * calls + nbytes / beta``."""

    alpha: float
    """Seconds per call (latency, launch and synchronisation)."""
    beta: float
    """Bytes per second of the algorithmic volume one rank sends."""

    def time(self, calls: int, nbytes: float) -> float:
        return self.alpha * calls + nbytes / self.beta


@dataclass(frozen=True)
class Links:
    """A cluster's network, for collectives of any group size (no measurement)."""

    gpus_per_node: int
    """GPUs sharing the fast intra-node links."""
    intra_bytes_s: float
    """Per-GPU bandwidth inside a node (bytes/s), e.g. NVLink."""
    inter_bytes_s: float
    """Per-GPU bandwidth across nodes (bytes/s), e.g. InfiniBand."""
    latency_s: float
    """Latency of one hop (seconds)."""

    def alpha_beta(self, kind: str, p: int) -> AlphaBeta:
        """Ring-algorithm collectives pay ``p - 1`` hop latencies; a point-to-point hop pays one."""
        hops = 1 if kind == "ring" else max(1, p - 1)
        beta = self.intra_bytes_s if p <= self.gpus_per_node else self.inter_bytes_s
        return AlphaBeta(self.latency_s * hops, beta)


@dataclass(frozen=True)
class Machine:
    """Compute rates and collective costs of one machine (measured) or cluster (described)."""

    name: str
    """What was measured or described, e.g. ``cpu-gloo`` or ``8x A100-80GB NVLink``."""
    gemm_flops: float
    """Matrix-multiply rate (FLOP/s) at the model's shapes."""
    sdpa_fwd_flops: float
    """Fused attention kernel, forward, in attention FLOPs per second (``4*d`` per pair and head)."""
    sdpa_bwd_flops: float
    """Fused attention kernel, backward (``10*d`` per pair and head)."""
    tile_fwd_flops: float
    """Ring attention tile kernel (:func:`lightning_paradyse.modes.attention.block_forward`), forward."""
    tile_bwd_flops: float
    """Ring attention tile kernel, backward."""
    overlap: float = 1.0
    """Overlap efficiency ``eta`` in ``[0, 1]`` of asynchronous transfers with compute."""
    collectives: Mapping[str, Mapping[int, AlphaBeta]] = field(default_factory=dict)
    """Measured ``{kind: {p: AlphaBeta}}``."""
    links: Links | None = None
    """A network description used for group sizes without measurements."""
    flash_tiles: bool = False
    """Ring tiles run in a flash kernel that never holds a score tile (CPU tiles without a document mask, GPU
    clusters); else the tile is materialised."""
    op_overhead_s: float = 0.0
    """Fixed time per op and step when nothing is calibrated (kernel launches)."""
    curves: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """Measured ``{kernel: ((size, FLOP/s), ...)}`` for ``gemm`` (size: local tokens), ``sdpa_fwd``/``sdpa_bwd``
    (sequence length), ``sdpa_band_fwd``/``sdpa_band_bwd`` (twice the window), ``tile_fwd``/``tile_bwd``, the causal
    diagonal ``tile_diag_fwd``/``tile_diag_bwd`` and the window-masked ``tile_mask_fwd``/``tile_mask_bwd``
    (tile side); rates in between are interpolated in log-size,
    outside the measured sizes the nearest is used. Kernels without a curve use the scalar rates."""

    def rate(self, kernel: str, size: float) -> float:
        """FLOP/s of ``kernel`` (``gemm``, ``sdpa_fwd``, ...) at ``size`` (see :attr:`curves`)."""
        curve = self.curves.get(kernel)
        if not curve:
            return float(getattr(self, f"{kernel}_flops"))
        sizes = [math.log(max(x, 1.0)) for x, _ in curve]
        return float(np.interp(math.log(max(size, 1.0)), sizes, [r for _, r in curve]))

    def collective(self, kind: str, p: int) -> AlphaBeta:
        """The alpha-beta model of ``kind`` on ``p`` ranks."""
        measured = self.collectives.get(kind, {})
        if p in measured:
            return measured[p]
        if self.links is not None:
            return self.links.alpha_beta(kind, p)
        sizes = sorted({q for table in self.collectives.values() for q in table})
        raise ValueError(f"{self.name}: no {kind} measurement for {p} ranks (measured group sizes: {sizes})")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in ("name", "gemm_flops", "overlap", "flash_tiles")}
        out.update({k: getattr(self, k) for k in ("sdpa_fwd_flops", "sdpa_bwd_flops", "tile_fwd_flops")})
        out.update(tile_bwd_flops=self.tile_bwd_flops, op_overhead_s=self.op_overhead_s)
        out["curves"] = {k: [list(point) for point in v] for k, v in self.curves.items()}
        out["collectives"] = {
            kind: {str(p): {"alpha": ab.alpha, "beta": ab.beta} for p, ab in table.items()}
            for kind, table in self.collectives.items()
        }
        out["links"] = None if self.links is None else vars(self.links)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Machine:
        collectives = {
            kind: {int(p): AlphaBeta(float(v["alpha"]), float(v["beta"])) for p, v in table.items()}
            for kind, table in data.get("collectives", {}).items()
        }
        links = Links(**data["links"]) if data.get("links") else None
        keys = ("gemm_flops", "sdpa_fwd_flops", "sdpa_bwd_flops", "tile_fwd_flops", "tile_bwd_flops")
        rates = {k: float(data[k]) for k in keys}
        curves = {k: tuple((float(x), float(r)) for x, r in v) for k, v in data.get("curves", {}).items()}
        return cls(
            curves=curves,
            name=str(data["name"]),
            overlap=float(data.get("overlap", 1.0)),
            collectives=collectives,
            links=links,
            flash_tiles=bool(data.get("flash_tiles", False)),
            op_overhead_s=float(data.get("op_overhead_s", 0.0)),
            **rates,
        )


@dataclass(frozen=True)
class RingTiles:
    """The ring attention tiles of one rank, by kind, in (query, key) pairs; every computed tile counted whole."""

    pairs: int
    """Pairs of every tile the rank computes."""
    diag_pairs: int
    """Of which in diagonal tiles run by the fused kernel (causal mask inside, no window mask)."""
    masked_pairs: int = 0
    """Of which in tiles a sliding window's edge crosses (run by the explicit kernel with a mask)."""
    masked_tiles: int = 0
    """The most window-masked tiles the rank computes against one source's block (their masks are built together)."""


@functools.lru_cache(maxsize=4096)
def ring_tiles(seq_len: int, p: int, causal: bool, window: int | None = None) -> RingTiles:
    """The tiles the busiest rank (the most pairs) computes in ring attention, as
    :func:`lightning_paradyse.modes.ring.doc_tiles` chooses them without packed documents.

    A tile of query positions ``[q0, q1)`` and key positions ``[k0, k1)`` is skipped when its nearest pair is out
    of the window (``q0 - (k1 - 1) >= w``) and masked when its farthest pair is (``q1 - 1 - k0 >= w``).
    """
    layout = SeqLayout.for_sequence(seq_len, p, causal)
    most = RingTiles(0, 0)
    for rank in range(p):
        pairs = diag_pairs = masked_pairs = masked_tiles = 0
        for src in range(p):
            masked_here = 0
            for (q0, q1), (k0, k1), diag in _segment_tiles(layout, rank, src, causal):
                n = (q1 - q0) * (k1 - k0)
                if window is not None and q0 - (k1 - 1) >= window:
                    continue  # every key is older than the window
                pairs += n
                if window is not None and q1 - 1 - k0 >= window:
                    masked_pairs, masked_here = masked_pairs + n, masked_here + 1
                elif diag:
                    diag_pairs += n
            masked_tiles = max(masked_tiles, masked_here)
        here = RingTiles(pairs, diag_pairs, masked_pairs, masked_tiles)
        if (here.pairs, here.masked_pairs, here.diag_pairs) > (most.pairs, most.masked_pairs, most.diag_pairs):
            most = here
    return most


def _segment_tiles(
    layout: SeqLayout, rank: int, src: int, causal: bool
) -> list[tuple[tuple[int, int], tuple[int, int], bool]]:
    """:func:`~lightning_paradyse.modes.ring.tiles` as global ``((q0, q1), (k0, k1), diagonal)`` position spans."""
    spans_q, spans_k = layout.segments(rank), layout.segments(src)
    starts_q = _local_starts(spans_q)
    starts_k = _local_starts(spans_k)
    out = []
    for q_sl, k_sl, diag in tiles(layout, rank, src, causal):
        out.append((spans_q[starts_q[q_sl.start]], spans_k[starts_k[k_sl.start]], diag))
    return out


def _local_starts(spans: tuple[tuple[int, int], ...]) -> dict[int, int]:
    """``{local start: segment index}`` of the segments a rank holds, in local order."""
    out, at = {}, 0
    for i, (start, stop) in enumerate(spans):
        out[at] = i
        at += stop - start
    return out


def ring_tile_pairs(seq_len: int, p: int, causal: bool) -> tuple[int, int]:
    """``(pairs, of which in diagonal tiles)`` the busiest rank computes in ring attention.

    Diagonal tiles are computed whole (and masked inside), so all their pairs count.
    """
    tiles_ = ring_tiles(seq_len, p, causal)
    return tiles_.pairs, tiles_.diag_pairs


def ring_pairs(seq_len: int, p: int, causal: bool, window: int | None = None) -> int:
    """(query, key) pairs the busiest rank computes in ring attention, diagonal and masked tiles counted whole."""
    return ring_tiles(seq_len, p, causal, window).pairs


def full_pairs(seq_len: int, causal: bool) -> int:
    """(query, key) pairs of full-sequence attention: ``s(s+1)/2`` causal, ``s^2`` otherwise."""
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len


def window_pairs(seq_len: int, window: int) -> int:
    """(query, key) pairs of a causal sliding window over ``s`` tokens: query ``i`` sees ``min(i + 1, w)`` keys,
    ``s*w - w(w-1)/2`` in all when ``s > w``, ``s(s+1)/2`` (the whole causal sequence) otherwise."""
    if seq_len <= window:
        return full_pairs(seq_len, True)
    return seq_len * window - window * (window - 1) // 2


def attention_pairs(seq_len: int, causal: bool, window: int | None = None, docs: tuple[int, ...] | None = None) -> int:
    """(query, key) pairs attention really relates: per packed document (``docs``: their lengths, summing to
    ``seq_len``; ``None``: one document), causal or not, within the window if any."""
    lengths = docs if docs is not None else (seq_len,)
    if sum(lengths) != seq_len:
        raise ValueError(f"document lengths {lengths} do not add up to the sequence length {seq_len}")
    if window is None:
        return sum(full_pairs(n, causal) for n in lengths)
    if not causal:
        raise ValueError("a sliding window needs causal attention")
    return sum(window_pairs(n, window) for n in lengths)


def sdpa_chunks(seq_len: int, window: int) -> list[tuple[int, int]]:
    """``[(queries, keys), ...]`` of the query chunks :func:`lightning_paradyse.modes.attention.full_attention` runs
    for one document of ``s > w`` tokens: chunk ``[c0, c0 + w)`` against the keys ``[max(0, c0 - w + 1), c0 + w)``."""
    out = []
    for c0 in range(0, seq_len, window):
        c1, k0 = min(c0 + window, seq_len), max(0, c0 - window + 1)
        out.append((c1 - c0, c1 - k0))
    return out


def sdpa_pairs(seq_len: int, causal: bool, window: int | None = None) -> int:
    """(query, key) pairs the SDPA path computes: a causal call's ``s(s+1)/2`` (``s^2`` bidirectional) when the
    sequence fits the window, else every query chunk's whole ``[queries, keys]`` rectangle (:func:`sdpa_chunks`)."""
    if window is None or seq_len <= window:
        return full_pairs(seq_len, causal)
    return sum(q * k for q, k in sdpa_chunks(seq_len, window))


def sdpa_size(seq_len: int, window: int | None = None) -> int:
    """The length the SDPA rate is looked up at: ``s``, or ``2w`` for query chunks (a ``[w, 2w - 1]`` rectangle has
    the pairs of a causal call over ``2w`` tokens)."""
    return seq_len if window is None or seq_len <= window else 2 * window


@dataclass(frozen=True)
class Work:
    """Compute of one phase of one op, per rank."""

    gemm: float
    """Matrix-multiply FLOPs."""
    attn: float = 0.0
    """Attention FLOPs (``4*d`` per pair and head forward, ``10*d`` backward)."""
    kernel: str = ""
    """``sdpa`` (full-sequence fused kernel), ``sdpa_band`` (its query chunks against a sliding window's band mask),
    ``tile`` (ring attention tiles over all heads) or ``gtile`` (``metp``'s ring tiles over one head shard, ``n/p``
    heads)."""
    hidden: str = ""
    """Which compute hides the overlapped transfers: ``attn`` or ``gemm`` (or nothing)."""
    gemm_size: float = 1.0
    """Local tokens of the GEMMs (the size their rate is looked up at)."""
    attn_size: float = 1.0
    """Sequence length (``sdpa``) or tile side (``tile``) the attention rate is looked up at."""
    attn_diag: float = 0.0
    """The part of ``attn`` in diagonal (masked) ring tiles, timed at the ``tile_diag`` rate where measured."""
    attn_masked: float = 0.0
    """The part of ``attn`` in ring tiles a sliding window masks (explicit kernel), at the ``tile_mask`` rate."""


def op_work(
    mode: str, op: str, seq_len: int, batch: int, p: int, dims: ModelDims, window: int | None = None
) -> dict[str, Work]:
    """``{forward, backward, recompute}`` compute of one op of one layer whose attention has the causal sliding
    ``window`` (``None``: the whole sequence); see the module docstring."""
    d, b = dims, batch
    t = b * math.ceil(seq_len / p)
    if op == "mlp":
        fwd = 2 * t * d.hidden * d.ffn * (d.branches + 1)
        hidden = "gemm" if mode == "metp" else ""
        extra = fwd if mode == "metp" else 0.0  # the ring step is recomputed inside backward
        return {
            "forward": Work(fwd, hidden=hidden, gemm_size=t),
            "backward": Work(2 * fwd + extra, hidden=hidden, gemm_size=t),
            "recompute": Work(fwd, hidden=hidden, gemm_size=t),
        }
    kv = d.kv_rows
    if mode in ("tp_sp", "metp"):
        kv = p * d.kv_heads_per_rank(p) * d.head_dim if p > 1 else d.kv_rows
    qkv = 2 * t * d.hidden * (d.q_rows + 2 * kv)
    fwd = qkv + 2 * t * d.q_rows * d.hidden
    diag = masked = 0.0
    if mode in ("tp_sp", "ulysses"):  # query chunks against a band mask when the window is shorter ("sdpa_band")
        pairs, size = sdpa_pairs(seq_len, d.causal, window), sdpa_size(seq_len, window)
        kernel = "sdpa_band" if window is not None and seq_len > window else "sdpa"
        attn = 4 * b * d.head_dim * (d.n_heads / p) * pairs
    else:  # metp runs the ring once per head shard, on n/p heads at a time ("gtile")
        ring = ring_tiles(seq_len, p, d.causal, window)
        per_pair = 4 * b * d.head_dim * d.n_heads
        kernel, attn = ("gtile" if mode == "metp" else "tile"), per_pair * ring.pairs
        diag, masked = per_pair * ring.diag_pairs, per_pair * ring.masked_pairs
        size = tile_side(seq_len, p, d.causal)
    hidden = "" if kernel.startswith("sdpa") else "attn"
    extra = qkv if mode == "metp" else 0.0
    return {
        "forward": Work(fwd, attn, kernel, hidden, t, size, diag, masked),
        "backward": Work(2 * fwd + extra, 2.5 * attn, kernel, hidden, t, size, 2.5 * diag, 2.5 * masked),
        "recompute": Work(fwd, attn, kernel, hidden, t, size, diag, masked),
    }


def tile_side(seq_len: int, p: int, causal: bool) -> int:
    """Tokens on a side of a ring attention tile: ``s/2p`` in the balanced layout, else ``s/p``."""
    if SeqLayout.for_sequence(seq_len, p, causal).balanced:
        return math.ceil(seq_len / (2 * p))
    return math.ceil(seq_len / p)


FALLBACK = {
    "gtile_diag": ("tile_diag", "gtile", "tile"),
    "tile_diag": ("tile",),
    "gtile": ("tile",),
    "tile_mask": ("tile_diag", "tile"),
    "gtile_mask": ("tile_mask", "gtile_diag", "tile_diag", "gtile", "tile"),
    "sdpa_band": ("sdpa",),
}
"""Kernels whose rate stands in where a kernel has no measured curve (e.g. a cluster file, an older profile)."""


def kernel_rate(machine: Machine, kernel: str, direction: str, size: float) -> float:
    """FLOP/s of ``kernel`` (``sdpa``, ``sdpa_band``, ``tile``, ``tile_diag``, ``tile_mask``, ``gtile``,
    ``gtile_diag``, ``gtile_mask``), ``fwd``/``bwd``."""
    for name in (kernel, *FALLBACK.get(kernel, ())):
        if f"{name}_{direction}" in machine.curves:
            return machine.rate(f"{name}_{direction}", size)
    base = "sdpa" if kernel.startswith("sdpa") else "tile"
    return machine.rate(f"{base}_{direction}", size)


def attn_seconds(machine: Machine, work: Work, backward: bool) -> float:
    """Seconds of a phase's attention kernels; diagonal and window-masked ring tiles at their own rates where they
    were measured."""
    direction = "bwd" if backward else "fwd"
    full = work.attn - work.attn_diag - work.attn_masked
    seconds = full / kernel_rate(machine, work.kernel, direction, work.attn_size) if full else 0.0
    if work.attn_diag:
        seconds += work.attn_diag / kernel_rate(machine, f"{work.kernel}_diag", direction, work.attn_size)
    if work.attn_masked:
        seconds += work.attn_masked / kernel_rate(machine, f"{work.kernel}_mask", direction, work.attn_size)
    return seconds


def comm_time(collectives: list[Collective], p: int, machine: Machine) -> tuple[float, float]:
    """``(exposed, overlapped)`` seconds of a phase's collectives."""
    exposed = overlapped = 0.0
    for coll in collectives:
        seconds = machine.collective(coll.kind, p).time(coll.calls, coll.nbytes)
        if coll.overlapped:
            overlapped += seconds
        else:
            exposed += seconds
    return exposed, overlapped


def overlap(compute: float, comm: float, eta: float) -> float:
    """Time of ``compute`` and ``comm`` running together with overlap efficiency ``eta``."""
    return compute + comm - eta * min(compute, comm)


@dataclass(frozen=True)
class PhaseTime:
    """One phase of an op: GEMM and attention compute, each split into exposed and hidden, and collectives."""

    gemm: float
    """Seconds of GEMMs not hidden behind transfers."""
    attn: float
    """Seconds of attention kernels not hidden behind transfers."""
    hidden_gemm: float
    """Seconds of GEMMs that asynchronous transfers run behind."""
    hidden_attn: float
    """Seconds of attention kernels that asynchronous transfers run behind."""
    exposed: float
    """Seconds of collectives waited for at once."""
    overlapped: float
    """Seconds of asynchronous transfers."""


@dataclass(frozen=True)
class OpTime:
    """An op's modelled time for one step, per phase.

    Calibration scales only the GEMM seconds (``gemm_factor``): the benchmarked GEMM does not include
    the elementwise work around an op's projections (norm, rotary, activation, copies), which grows with
    the tokens like the GEMMs do. The attention seconds are those of the very kernels the op calls,
    benchmarked at the same sizes, and are not scaled; that keeps the quadratic term, which dominates
    long sequences, anchored in measurement rather than in a fit at short lengths.
    """

    phases: tuple[PhaseTime, ...]
    """Forward, backward (and the recomputed forward)."""
    eta: float
    """Overlap efficiency of the machine."""

    def total(self, gemm_factor: float = 1.0, attn_factor: float = 1.0) -> float:
        """Seconds, with the GEMM and attention seconds scaled by calibration constants."""
        out = 0.0
        for ph in self.phases:
            out += ph.gemm * gemm_factor + ph.attn * attn_factor + ph.exposed
            hidden = ph.hidden_gemm * gemm_factor + ph.hidden_attn * attn_factor
            out += overlap(hidden, ph.overlapped, self.eta)
        return out

    @property
    def comm(self) -> float:
        """Seconds of collectives (exposed and overlapped)."""
        return sum(ph.exposed + ph.overlapped for ph in self.phases)


def op_time(
    mode: str,
    op: str,
    recompute: bool,
    seq_len: int,
    batch: int,
    p: int,
    dims: ModelDims,
    machine: Machine,
    window: int | None = None,
) -> OpTime:
    """Modelled time of one op of one layer for one step (forward + backward [+ recomputation]); ``window``: the
    layer's causal sliding window (it changes the attention's work, not its traffic)."""
    return op_times(mode, op, seq_len, batch, p, dims, machine, window, (recompute,))[0]


def op_times(
    mode: str,
    op: str,
    seq_len: int,
    batch: int,
    p: int,
    dims: ModelDims,
    machine: Machine,
    window: int | None = None,
    recompute: tuple[bool, ...] = (False, True),
) -> tuple[OpTime, ...]:
    """:func:`op_time` for every flag of ``recompute``, in order: the work, the collectives and the forward's and
    backward's seconds worked out once for all of them (a recomputing op adds one phase)."""
    work = op_work(mode, op, seq_len, batch, p, dims, window)
    colls = op_collectives(mode, op, seq_len, batch, p, dims)
    names = ("forward", "backward", "recompute") if any(recompute) else ("forward", "backward")
    phases = []
    for phase in names:
        w = work[phase]
        gemm = w.gemm / machine.rate("gemm", w.gemm_size)
        attn = attn_seconds(machine, w, phase == "backward") if w.attn else 0.0
        hide_gemm, hide_attn = (gemm if w.hidden == "gemm" else 0.0), (attn if w.hidden == "attn" else 0.0)
        exposed, overlapped = comm_time(colls[phase], p, machine)
        phases.append(PhaseTime(gemm - hide_gemm, attn - hide_attn, hide_gemm, hide_attn, exposed, overlapped))
    return tuple(OpTime(tuple(phases if rc else phases[:2]), machine.overlap) for rc in recompute)


def head_work(seq_len: int, batch: int, p: int, dims: ModelDims) -> float:
    """GEMM FLOPs of the LM head for a step (forward + backward)."""
    t = batch * math.ceil(seq_len / p)
    return 3 * 2 * t * dims.hidden * dims.vocab


def head_time(seq_len: int, batch: int, p: int, dims: ModelDims, machine: Machine) -> float:
    """Modelled seconds of the LM head's GEMMs for a step."""
    t = batch * math.ceil(seq_len / p)
    return head_work(seq_len, batch, p, dims) / machine.rate("gemm", t)


__all__ = [
    "KINDS",
    "AlphaBeta",
    "Links",
    "Machine",
    "OpTime",
    "RingTiles",
    "Work",
    "attention_pairs",
    "attn_seconds",
    "kernel_rate",
    "op_time",
    "op_times",
    "op_work",
    "ring_pairs",
    "ring_tile_pairs",
    "ring_tiles",
    "sdpa_chunks",
    "sdpa_pairs",
    "sdpa_size",
    "window_pairs",
]
