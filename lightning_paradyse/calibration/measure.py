"""Measurements a profiling rank takes: kernel rates, collectives, segments and whole steps.

Every function runs on every rank of the group in the same order (they issue collectives), times with
``time.perf_counter`` after a barrier and a warm-up, and measures memory with
:class:`~lightning_paradyse.calibration.tracker.MemoryTracker`. The reference models' blocks are used
(``layers[0]`` with its ``attn_norm`` / ``mlp_norm``); see :mod:`lightning_paradyse.calibration.profile`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lightning_paradyse.calibration.tracker import MemoryTracker
from lightning_paradyse.cost.dims import ModelDims
from lightning_paradyse.cost.time import full_pairs, tile_side
from lightning_paradyse.distributed.comm import (
    CommCounter,
    all_gather_rows,
    all_reduce_sum,
    all_to_all_rows,
    broadcast_from,
    collective_device,
    reduce_scatter_rows,
    reduce_to,
    ring_pass,
    ring_pass_start,
)
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.graph.dispatch import AttentionDispatch, MlpDispatch
from lightning_paradyse.models import lm_loss_sum
from lightning_paradyse.modes.attention import block_backward, block_forward, in_window
from lightning_paradyse.modes.plan import OpPlan, Plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime.parallel import (
    configure,
    dispatchers,
    gather_param_like,
    is_causal,
    reduce_replicated_grads,
    shard_sources,
)

COLLECTIVE_SIZES = (256, 16_384, 262_144, 1_048_576)
"""float32 elements per rank of the benchmarked collectives (1 KiB to 4 MiB)."""
GPU_COLLECTIVE_SIZES = (256, 262_144, 4_194_304, 16_777_216, 67_108_864)
"""float32 elements per rank of the collectives benchmarked on GPUs (1 KiB for the latency, then 1 MiB to 256 MiB:
NVLink reaches its bandwidth only on large messages, which small ones extrapolate far too low)."""

KERNEL_REPS = 5
"""Repetitions of a kernel or collective benchmark (the median counts)."""


def collective_sizes(device: torch.device | str) -> tuple[int, ...]:
    """The benchmarked message sizes on ``device``'s type."""
    return GPU_COLLECTIVE_SIZES if torch.device(device).type == "cuda" else COLLECTIVE_SIZES


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sync() -> None:
    """Wait for queued CUDA work, so that wall-clock times cover it (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


MAX_REPS = 40
"""Most timed repetitions of one measurement when ``min_seconds`` asks for more than ``reps``."""
MIN_REPS = 5
"""Fewest timed repetitions of one measurement (the median of fewer is not much steadier than one run)."""


def agreed_reps(warm_seconds: float, reps: int, min_seconds: float) -> int:
    """Repetitions so that they take about ``min_seconds`` (at least ``reps``, at most :data:`MAX_REPS`).

    Decided from the slowest rank's warm-up (one all-reduce), so that every rank runs the same number of
    barriers.
    """
    if min_seconds <= 0:
        return reps
    device = collective_device(dist.group.WORLD) if dist.is_initialized() else torch.device("cpu")
    slowest = torch.tensor([warm_seconds], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    wanted = math.ceil(min_seconds / max(float(slowest), 1e-6))
    return max(reps, min(wanted, MAX_REPS))


def timed(fn: Callable[[], Any], reps: int, min_seconds: float = 0.0) -> float:
    """Median seconds of ``fn()`` over at least ``reps`` runs (and :data:`MIN_REPS`) after one warm-up, each
    started after a barrier.

    The median, not the minimum: with two ranks on two cores, a step that synchronises its ranks varies by up
    to 2x from one run to the next (a rank waits for the other to be scheduled and woken), and training sees
    the typical run, not the luckiest. The median is also the steadier statistic here: the same 8 steps
    measured twice (each time 4 rounds of 25 runs) had medians 2.2% apart on average, minima 4.0%. With
    ``min_seconds``, short measurements are repeated more often (see :func:`agreed_reps`).
    """
    _sync()
    _barrier()
    start = time.perf_counter()
    fn()
    _sync()
    reps = agreed_reps(time.perf_counter() - start, max(reps, MIN_REPS), min_seconds)
    times = []
    for _ in range(reps):
        _barrier()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _kernel_seconds(settings: Any) -> float:
    return float(getattr(settings, "kernel_seconds", 0.0))


def _dtype(settings: Any) -> torch.dtype:
    return getattr(torch, settings.dtype)  # type: ignore[no-any-return]


def _device(settings: Any) -> torch.device:
    return torch.device(getattr(settings, "device", "cpu"))


# --------------------------------------------------------------------------------------------------
# Machine benchmarks
# --------------------------------------------------------------------------------------------------


def bench_gemm(dims: ModelDims, settings: Any, p: int, s: int) -> tuple[float, float]:
    """``(local tokens, FLOP/s)`` of ``[t, h] @ [h, f]`` at the local token count of length ``s``."""
    w = torch.randn(dims.hidden, dims.ffn, dtype=_dtype(settings), device=_device(settings))
    a = torch.randn(max(s * settings.batch // p, 1), dims.hidden, dtype=_dtype(settings), device=_device(settings))
    seconds = timed(functools.partial(torch.matmul, a, w), KERNEL_REPS, _kernel_seconds(settings))
    return float(a.shape[0]), 2.0 * a.shape[0] * dims.hidden * dims.ffn / seconds


def _sdpa_times(dims: ModelDims, settings: Any, p: int, s: int) -> tuple[float, float, float]:
    """``(attention FLOPs, forward seconds, backward seconds)`` of SDPA over ``n/p`` heads and ``s`` tokens."""
    b, heads = settings.batch, max(dims.n_heads // p, 1)
    q, k, v = (
        torch.randn(b, heads, s, dims.head_dim, dtype=_dtype(settings), device=_device(settings), requires_grad=True)
        for _ in range(3)
    )
    flops = 4 * b * dims.head_dim * heads * full_pairs(s, dims.causal)
    fwd = timed(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=dims.causal), KERNEL_REPS, _kernel_seconds(settings)
    )
    out = F.scaled_dot_product_attention(q, k, v, is_causal=dims.causal)
    dout = torch.randn_like(out)

    def both() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=dims.causal).backward(dout)

    bwd = max(timed(both, KERNEL_REPS, _kernel_seconds(settings)) - fwd, 1e-9)
    return flops, fwd, bwd


def _band_times(dims: ModelDims, settings: Any, p: int, window: int) -> tuple[float, float, float]:
    """``(attention FLOPs, forward seconds, backward seconds)`` of one query chunk of a sliding window in the SDPA
    path (:func:`~lightning_paradyse.modes.attention.full_attention`): ``w`` queries against the ``2w - 1`` keys they
    can see, over ``n/p`` heads, with the band mask; all ``w(2w - 1)`` pairs counted, as the kernel computes them."""
    b, heads, w = settings.batch, max(dims.n_heads // p, 1), window
    make = functools.partial(torch.randn, dtype=_dtype(settings), device=_device(settings), requires_grad=True)
    q, k, v = (
        make(b, heads, w, dims.head_dim),
        make(b, heads, 2 * w - 1, dims.head_dim),
        make(b, heads, 2 * w - 1, dims.head_dim),
    )
    positions = torch.arange(2 * w - 1, device=_device(settings))
    mask = in_window(positions[w - 1 :], positions, w)  # [w, 2w - 1]: a chunk away from the sequence's start
    flops = 4 * b * dims.head_dim * heads * w * (2 * w - 1)
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, mask), KERNEL_REPS, _kernel_seconds(settings))
    dout = torch.randn(b, heads, w, dims.head_dim, dtype=_dtype(settings), device=_device(settings))

    def both() -> None:
        F.scaled_dot_product_attention(q, k, v, mask).backward(dout)

    bwd = max(timed(both, KERNEL_REPS, _kernel_seconds(settings)) - fwd, 1e-9)
    return flops, fwd, bwd


def band_windows(dims: ModelDims, settings: Any) -> list[int]:
    """The windows the band kernel is measured at: the model's, at most half the longest benchmarked length (a
    longer window's rate is the nearest measured one)."""
    cap = max(max(settings.kernel_lengths) // 2, 1)
    return sorted({min(w, cap) for w in dims.windows if w is not None})


def _tile_times(
    dims: ModelDims, settings: Any, p: int, s: int, diagonal: bool, group: bool, masked: bool = False
) -> tuple[float, float, float]:
    """``(attention FLOPs, forward seconds, backward seconds)`` of one ring tile of length ``s``'s chunk.

    ``diagonal``: the causal tile on the diagonal (masked inside; all its pairs counted, as the ring
    computes it whole), which costs about twice a tile in the past on CPU. ``group``: over one head
    group (``n/p`` query heads and the kv heads they read), as ``metp`` calls it, else over all heads.
    ``masked``: a tile in the past that a sliding window's edge crosses (half its pairs in the window, all counted),
    which runs the explicit kernel with a mask.
    """
    b, c = settings.batch, tile_side(s, p, dims.causal)
    dtype = _dtype(settings)
    heads = max(dims.n_heads // p, 1) if group else dims.n_heads
    kv_heads = max(heads * dims.n_kv_heads // dims.n_heads, 1)
    q = torch.randn(b, heads, c, dims.head_dim, dtype=dtype, device=_device(settings))
    k, v = (torch.randn(b, kv_heads, c, dims.head_dim, dtype=dtype, device=_device(settings)) for _ in range(2))
    positions = torch.arange(c, device=_device(settings))
    allowed = in_window(positions + c, positions, c) if masked else None  # [c, c]: the window's edge on the diagonal
    flops = 4 * b * dims.head_dim * heads * c * c
    fwd = timed(lambda: block_forward(q, k, v, diagonal, allowed=allowed), KERNEL_REPS, _kernel_seconds(settings))
    out, lse = block_forward(q, k, v, diagonal, allowed=allowed)
    dout = torch.randn_like(out)
    delta = (dout * out).sum(-1)
    bwd = timed(
        lambda: block_backward(dout, q, k, v, lse, delta, diagonal, allowed=allowed, out=out),
        KERNEL_REPS,
        _kernel_seconds(settings),
    )
    return flops, fwd, bwd


def bench_kernels(dims: ModelDims, settings: Any, p: int) -> dict[str, list[tuple[float, float]]]:
    """Rate curves ``{kernel: [(size, FLOP/s), ...]}`` of the GEMM, SDPA and ring tile kernels.

    Ring tiles come in four kinds: over all heads (``tile``, ring attention) or one head shard
    (``gtile``, ``metp``), each in the past or on the causal diagonal (``_diag``); for a model with sliding
    windows also the tiles a window's edge crosses (``_mask``, the explicit kernel), and the SDPA path's query
    chunks against a band mask (``sdpa_band``, at each window ``w``, size ``2w``).

    Measured at every length of ``settings.kernel_lengths`` (the profiled lengths and a few longer
    ones): single-kernel microbenchmarks, so that rates at lengths beyond the profiled ones (caches
    overflowing, larger tiles) come from measurement rather than extrapolation.
    """
    out: dict[str, list[tuple[float, float]]] = {}
    for s in settings.kernel_lengths:
        out.setdefault("gemm", []).append(bench_gemm(dims, settings, p, s))
        flops, fwd, bwd = _sdpa_times(dims, settings, p, s)
        out.setdefault("sdpa_fwd", []).append((float(s), flops / fwd))
        out.setdefault("sdpa_bwd", []).append((float(s), 2.5 * flops / bwd))
        side = float(tile_side(s, p, dims.causal))
        kernels = ("tile", "tile_diag", "gtile", "gtile_diag") + (("tile_mask", "gtile_mask") if dims.windows else ())
        for kernel in kernels:
            diagonal, group, masked = kernel.endswith("_diag"), kernel.startswith("g"), kernel.endswith("_mask")
            if (diagonal and not dims.causal) or (group and p == 1):
                continue
            flops, fwd, bwd = _tile_times(dims, settings, p, s, diagonal, group, masked)
            out.setdefault(f"{kernel}_fwd", []).append((side, flops / fwd))
            out.setdefault(f"{kernel}_bwd", []).append((side, 2.5 * flops / bwd))
    for w in band_windows(dims, settings):
        flops, fwd, bwd = _band_times(dims, settings, p, w)
        out.setdefault("sdpa_band_fwd", []).append((float(2 * w), flops / fwd))
        out.setdefault("sdpa_band_bwd", []).append((float(2 * w), 2.5 * flops / bwd))
    return out


def _collective_calls(n: int, p: int, group: Any, device: torch.device) -> dict[str, Callable[[], Any]]:
    x, big = torch.randn(n, 1, device=device), torch.randn(n * p, 1, device=device)
    sizes = [n] * p
    return {
        "all_gather": lambda: all_gather_rows(x, sizes, group),
        "reduce_scatter": lambda: reduce_scatter_rows(big, sizes, group),
        "all_to_all": lambda: all_to_all_rows(big, sizes, sizes, group),
        "ring": lambda: ring_pass(x, group),
        "broadcast": lambda: broadcast_from(x, 0, group),
        "reduce": lambda: reduce_to(x, 0, group),
        "all_reduce": lambda: all_reduce_sum(x, group),
    }


def bench_collectives(
    p: int,
    reps: int,
    group: Any = None,
    device: torch.device | None = None,
    sizes: tuple[int, ...] = COLLECTIVE_SIZES,
) -> dict[str, list[tuple[float, float]]]:
    """``{kind: [(bytes one rank sends, seconds), ...]}`` over ``sizes`` (elements per rank) on ``group``."""
    out: dict[str, list[tuple[float, float]]] = {}
    if p == 1:
        return out
    group = group if group is not None else dist.group.WORLD
    for n in sizes:
        for kind, call in _collective_calls(n, p, group, device or torch.device("cpu")).items():
            with CommCounter() as counter:
                call()
            seconds = timed(call, max(reps, KERNEL_REPS))
            out.setdefault(kind, []).append((counter.total, seconds))
    return out


def bench_overlap(dims: ModelDims, p: int, device: torch.device | None = None) -> float:
    """Overlap efficiency of a ring transfer with a GEMM: ``(T_gemm + T_ring - T_both) / min(T_gemm, T_ring)``."""
    if p == 1:
        return 1.0
    device = device or torch.device("cpu")
    side = 4096 if device.type == "cuda" else 512  # a GEMM of about the transfer's time
    a, w = torch.randn(side, side, device=device), torch.randn(side, side, device=device)
    x = torch.randn(1_048_576 if device.type == "cpu" else 16_777_216, device=device)
    group = dist.group.WORLD
    t_gemm = timed(lambda: a @ w, 2 * KERNEL_REPS)
    t_ring = timed(lambda: ring_pass(x, group), 2 * KERNEL_REPS)

    def both() -> None:
        pending = ring_pass_start(x, group)
        a @ w
        pending.wait()

    t_both = timed(both, 2 * KERNEL_REPS)
    eta = (t_gemm + t_ring - t_both) / min(t_gemm, t_ring)
    return float(min(max(eta, 0.0), 1.0))


# --------------------------------------------------------------------------------------------------
# Segments, the head and whole steps
# --------------------------------------------------------------------------------------------------


def segment_fn(
    model: nn.Module, op: str, mode: str, rc: bool, ctx: SeqContext
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Layer 0's norm and op in ``mode``: ``[b, s_r, h] -> [b, s_r, h]`` (without the residual)."""
    block: Any = model.get_submodule("layers.0")
    ops = [m for _, m in dispatchers(model) if m.layer == 0]
    attn = next(m for m in ops if isinstance(m, AttentionDispatch))
    mlp = next(m for m in ops if isinstance(m, MlpDispatch))
    target = attn if op == "attention" else mlp
    target.configure(ctx, OpPlan(mode, rc))
    if op == "attention":
        return lambda x: attn(block.attn_norm(x), ctx.positions(x.device))
    return lambda x: mlp(block.mlp_norm(x))


def segment_seconds(
    model: nn.Module, op: str, mode: str, rc: bool, ctx: SeqContext, batch: int, reps: int = MIN_REPS
) -> float:
    """The median seconds of layer 0's norm and op in ``mode`` (forward and backward), as :func:`measure_segment`
    times them, without its memory measurements."""
    fn = segment_fn(model, op, mode, rc, ctx)
    x0 = _segment_input(model, ctx, batch)

    def run() -> None:
        model.zero_grad(set_to_none=True)
        x = x0.detach().clone().requires_grad_()
        y = fn(x)
        y.backward(torch.ones_like(y))

    seconds = timed(run, reps)
    model.zero_grad(set_to_none=True)
    return seconds


@contextlib.contextmanager
def whole_on_each_rank(model: nn.Module, group: Any) -> Iterator[None]:
    """Inside, the dispatch modules read the whole weights, gathered from the shards over ``group`` (collective), as a
    step on groups of one reads them: what a group of one rank measures. Put back on the way out."""
    refs = shard_sources(model)
    ops = dispatchers(model)
    for path, op in ops:  # [rows/P, ...] -> [rows, ...] per piece: what a group of one holds
        op.set_group_shards(
            {
                name: gather_param_like(w.detach(), refs[f"{path}.{name}"], group).requires_grad_(w.requires_grad)
                for name, w in ((name, op.get_parameter(name)) for name in op.sources)
            }
        )
    try:
        yield
    finally:
        for _, op in ops:
            op.set_group_shards(None)
        model.zero_grad(set_to_none=True)


def memory_of(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], x0: torch.Tensor) -> tuple[int, int, int]:
    """``(saved, forward peak, backward peak)`` bytes of ``fn`` on a copy of ``x0`` (see ``cost.memory``)."""
    model.zero_grad(set_to_none=True)
    with MemoryTracker() as mem:
        x = x0.detach().clone().requires_grad_()
        before = mem.live
        mem.reset_peak()
        y = fn(x)
        fwd = mem.peak - before
        x_bytes = x.untyped_storage().nbytes()
        del x
        saved = mem.live - (before - x_bytes) - y.untyped_storage().nbytes()
        dy = torch.randn_like(y) if y.dim() else None
        start = mem.live
        mem.reset_peak()
        y.backward(dy)
        bwd = mem.peak - start
        del y, dy
    return saved, fwd, bwd


def _time_and_memory(
    model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], x0: torch.Tensor, reps: int, min_seconds: float
) -> dict[str, Any]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        x = x0.detach().clone().requires_grad_()
        y = fn(x)
        y.backward(torch.ones_like(y) if y.dim() else None)

    seconds = timed(run, 2 * reps + 1, min_seconds)
    mems = [memory_of(model, fn, x0) for _ in range(max(reps, 2))]
    return {
        "time_s": seconds,
        "saved": min(m[0] for m in mems),
        "fwd": statistics.median(m[1] for m in mems),
        "bwd": statistics.median(m[2] for m in mems),
    }


def measure_segment(
    model: nn.Module, op: str, mode: str, rc: bool, ctx: SeqContext, batch: int, reps: int, min_seconds: float = 0.0
) -> dict[str, Any]:
    """Time and memory of one segment (layer 0's norm and op) in ``mode``."""
    fn = segment_fn(model, op, mode, rc, ctx)
    return _time_and_memory(model, fn, _segment_input(model, ctx, batch), reps, min_seconds)


def _segment_input(model: nn.Module, ctx: SeqContext, batch: int) -> torch.Tensor:
    """A segment's input: this rank's ``[batch, s_r, hidden]`` of random values."""
    norm: Any = model.get_submodule("layers.0.attn_norm")
    param = next(model.parameters())
    t = ctx.layout.local_len(ctx.rank)
    return torch.randn(batch, t, int(norm.weight.shape[0]), dtype=param.dtype, device=param.device)


def measure_head(model: nn.Module, ctx: SeqContext, settings: Any) -> dict[str, Any]:
    """Time and memory of the final norm, the LM head and the float32 cross-entropy (sum) on the local tokens."""
    lm: Any = model
    vocab = lm.lm_head.out_features
    t = ctx.layout.local_len(ctx.rank)
    param = next(model.parameters())
    targets = torch.randint(0, vocab, (settings.batch, t), device=param.device)

    def head(x: torch.Tensor) -> torch.Tensor:
        logits = lm.lm_head(lm.norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

    hidden = lm.norm.weight.shape[0]
    x0 = torch.randn(settings.batch, t, hidden, dtype=param.dtype, device=param.device)
    return _time_and_memory(model, head, x0, settings.reps, settings.segment_seconds)


def measure_step(model: nn.Module, plan: Plan, seq_len: int, settings: Any, p: int) -> dict[str, Any]:
    """Time and peak memory of one training step (forward, backward, replicated-gradient reduction)."""
    group = dist.group.WORLD if p > 1 else None
    ctx = SeqContext(SeqLayout.for_sequence(seq_len, p, is_causal(model)), group)
    lm: Any = model
    vocab = lm.lm_head.out_features
    device = next(model.parameters()).device
    tokens = torch.randint(0, vocab, (settings.batch, seq_len + 1), device=device)
    local = ctx.layout.shard(tokens[:, :-1], ctx.rank)
    targets = ctx.layout.shard(tokens[:, 1:], ctx.rank)
    positions = ctx.positions(device)

    def step() -> None:
        configure(model, ctx, plan)
        model.zero_grad(set_to_none=True)
        loss = lm_loss_sum(model, local, targets, positions) / (settings.batch * seq_len)
        loss.backward()
        reduce_replicated_grads(model, group)

    seconds = timed(step, settings.reps, settings.step_seconds)
    peaks = []
    for _ in range(settings.step_memory_reps):
        model.zero_grad(set_to_none=True)
        with MemoryTracker() as mem:
            step()
        peaks.append(mem.peak)
    model.zero_grad(set_to_none=True)
    return {"time_s": seconds, "peak": min(peaks)}
