"""What every spawned process does: Lightning Trainers for every (trace, run, pass), then the length search.

Each process of :func:`lightning_paradyse.distributed.spawn.run_distributed` runs :func:`bench_worker`. It sets the
environment variables that make Lightning treat the processes as launched externally (as under ``torchrun``:
no strategy launches anything), then, for each fit, creates a fresh process group (gloo on CPU, NCCL on
CUDA; file store, no ports), builds a fresh :class:`~benchmarks.runs.BenchLM` from the same seed and a fresh
``Trainer`` with the run's strategy, trains one epoch over its batches of the trace (one per global batch: the whole
batch, or its data-parallel share, :func:`benchmarks.workload.rank_items`) and destroys the group.

Order (noise hits every run alike): for every trace, one instrumented pass over all runs (memory and bytes
sent), then ``repeats`` timed passes, each over all runs in an order rotated by one per pass. After the
traces, the largest trainable length of every run is searched: doubling from ``search.start``, then
bisection; each probe is one training step (forward, backward, optimizer step) of one sequence (on every rank:
data parallelism gives each rank a whole copy of it).

The adaptive run plans with the package's exact cost-model planner on the profile that
:mod:`benchmarks.profiling` calibrates before the runs (``on_infeasible="skip"``: a batch no plan fits is skipped
and counted as an OOM step); without a profile, the strategy's length-threshold policy stands in.

Lightning was chosen over a hand-written loop so that every strategy runs exactly as a user would run it
(DDP's reducer, ``ModelParallelStrategy``'s ``configure_model``, ParaDySe's switcher callback); its per-step
overhead (a few milliseconds, the same for every run) is inside every step time.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from benchmarks.instrument import StepRecorder, matmul_rate
from benchmarks.runs import BenchLM, RunSpec, make_strategy, parallelism, run_spec
from benchmarks.settings import MEASURED, BenchSettings
from benchmarks.workload import Trace, probe_batch, rank_items
from lightning_paradyse.distributed.devices import resolve_backend

PROBE_ESTIMATE = 8
"""Probes per run assumed by the progress bar before the search starts."""


@dataclass
class Context:
    """One process's view of the benchmark."""

    rank: int
    """This process's rank."""
    world: int
    """Number of processes."""
    settings: BenchSettings
    """What the benchmark runs."""
    store_dir: str
    """Folder of the file stores of the per-fit process groups."""
    device: torch.device
    """This process's device (a GPU, or the CPU)."""
    bar: Any = None
    """Rank 0's progress bar (``None`` elsewhere)."""
    fits: int = 0
    """Process groups created so far (names their file stores)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Extra ``ParaDySeStrategy`` arguments of the adaptive run (thresholds, cost profile, ``on_infeasible``)."""

    def tick(self) -> None:
        """One step or probe done (rank 0's progress bar)."""
        if self.bar is not None:
            self.bar.update(1)


def quiet() -> None:
    """Silence Lightning's per-fit banners and hints (the progress bar tells what runs)."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_paradyse"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"lightning\..*")
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")


def init_group(ctx: Context) -> None:
    """A fresh process group for the next fit (Lightning then uses it instead of creating one)."""
    ctx.fits += 1
    # NCCL refuses two ranks on one GPU: ranks sharing GPUs (more ranks than GPUs) run over gloo
    devices = [select_device_of(r) for r in range(ctx.world)] if ctx.device.type == "cuda" else [ctx.device]
    backend = resolve_backend(devices, None)
    kwargs: dict[str, Any] = {"device_id": ctx.device} if backend == "nccl" else {}
    dist.init_process_group(
        backend,
        init_method=f"file://{os.path.join(ctx.store_dir, f'pg-{ctx.fits}')}",
        rank=ctx.rank,
        world_size=ctx.world,
        timeout=timedelta(seconds=600),
        **kwargs,
    )


def make_trainer(ctx: Context, spec: RunSpec, callbacks: list[pl.Callback]) -> pl.Trainer:
    """A Trainer for one epoch of ``spec`` with our callbacks and nothing else (no logger, checkpoints, bars)."""
    s = ctx.settings
    strategy = make_strategy(spec, s.model.layers, s.budget, ctx.world, ctx.extra)
    return pl.Trainer(
        accelerator=ctx.device.type,
        devices=ctx.world,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        log_every_n_steps=1,  # the strategy measures group times and the fixed part on the steps it logs: every one
    )


def fit(
    ctx: Context,
    spec: RunSpec,
    items: list[dict[str, torch.Tensor]],
    instrumented: bool,
    warmup: int = 1,
    tick: bool = True,
) -> dict[str, Any]:
    """Train ``spec`` for one epoch over ``items``: every rank's steps (the first ``warmup`` ones not recorded:
    callers prepend warm-up batches), the plans, or the error."""
    from lightning_paradyse import ParaDySeSwitcher

    init_group(ctx)
    try:
        pl.seed_everything(ctx.settings.seed, verbose=False)
        module = BenchLM(ctx.settings.model.config(), ctx.settings.lr, parallelism(spec), spec.checkpointing)
        switcher = ParaDySeSwitcher(log_plan=False) if spec.uses_paradyse else None
        recorder = StepRecorder(instrumented, on_step=ctx.tick if tick else None, warmup=warmup, switcher=switcher)
        callbacks: list[pl.Callback] = [recorder] + ([switcher] if switcher is not None else [])
        trainer = make_trainer(ctx, spec, callbacks)
        start = time.perf_counter()
        trainer.fit(module, train_dataloaders=DataLoader(items, batch_size=None, shuffle=False))  # type: ignore[arg-type]
        return {"steps": recorder.gathered, "fit_s": time.perf_counter() - start}
    except Exception as err:  # one failing run must not stop the others
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def probe(ctx: Context, spec: RunSpec, length: int) -> dict[str, Any]:
    """One training step of one ``length``-token sequence (on every rank): does it fit the budget?"""
    result = fit(ctx, spec, [probe_batch(length)], instrumented=True, warmup=0, tick=False)
    if "error" in result:
        return {"fits": False, "error": result["error"]}
    steps = [s for per_rank in result["steps"] for s in per_rank]
    peak = max(s["peak"] for s in steps)
    fits = peak <= ctx.settings.budget and not any(s["cuda_oom"] or s["skipped"] for s in steps)
    return {"fits": fits, "peak": peak}


def search_length(ctx: Context, spec: RunSpec) -> dict[str, Any]:
    """The largest length whose training step fits the budget: doubling, then bisection (``settings.search``)."""
    s = ctx.settings.search
    probes: dict[int, dict[str, Any]] = {}
    if s.cap <= 0:  # the search is switched off
        return {"max_len": None, "capped": False, "probes": probes}

    def fits(length: int) -> bool:
        probes[length] = probe(ctx, spec, length)
        ctx.tick()
        return bool(probes[length]["fits"])

    lo, hi, length = 0, None, s.start
    while hi is None and lo < s.cap:
        if fits(length):
            lo, length = length, min(2 * length, s.cap)
        else:
            hi = length
    if hi is None:
        return {"max_len": lo, "capped": True, "probes": probes}
    while lo == 0 and hi // 2 >= 2 * ctx.world:  # even the first probe failed: halve
        lo, hi = (hi // 2, hi) if fits(hi // 2) else (0, hi // 2)
    while lo > 0 and hi - lo > max(s.min_step, s.resolution * lo):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"max_len": lo, "capped": False, "probes": probes}


def rotated(runs: tuple[str, ...], k: int) -> list[str]:
    """``runs`` rotated left by ``k`` (round-robin order of the timed passes)."""
    k %= max(len(runs), 1)
    return [*runs[k:], *runs[:k]]


def trace_passes(ctx: Context, traces: list[Trace]) -> list[dict[str, Any]]:
    """Every (trace, pass, run) fit: pass 0 instrumented, passes 1.. timed in rotated order."""
    out = []
    for trace in traces:
        for pass_index in range(1 + ctx.settings.repeats):
            for name in rotated(ctx.settings.runs, pass_index):
                spec = run_spec(name)
                if ctx.bar is not None:
                    ctx.bar.set_description(f"{trace.name} pass {pass_index} {name}")
                items = rank_items(trace, ctx.rank, ctx.world, spec.data_parallel)
                warmup = ctx.settings.warmup
                items = [items[0]] * warmup + items  # warm-up steps: the first global batch again, not recorded
                result = fit(ctx, spec, items, instrumented=pass_index == 0, warmup=warmup)
                out.append({"run": name, "trace": trace.name, "pass": pass_index, **result})
    return out


def total_ticks(settings: BenchSettings, traces: list[Trace]) -> int:
    """Steps (and estimated probes) rank 0 will report to the progress bar."""
    total = sum(len(trace.batches) * len(settings.runs) * (1 + settings.repeats) for trace in traces)
    return total + PROBE_ESTIMATE * len(settings.runs)


def select_device_of(rank: int) -> torch.device:
    """Rank ``rank``'s device: GPU ``rank % count`` when CUDA is available (ranks share GPUs when there are more
    ranks than GPUs), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def select_device(rank: int) -> torch.device:
    """This process's device (:func:`select_device_of`), made current."""
    device = select_device_of(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def bench_worker(
    rank: int, world: int, settings: BenchSettings, traces: list[Trace], store_dir: str, profile: str | None
) -> Any:
    """The body of every spawned process; rank 0 returns all results, the others their matmul rates (measured
    before and after the runs; the larger one is this process's rate, the other was slowed by other load).

    ``profile`` is the adaptive run's cost profile (``None``: the strategy's threshold policy stands in;
    :data:`~benchmarks.settings.MEASURED`: none, the machine the strategy measures at setup).
    """
    dist.destroy_process_group()  # the harness's group; every fit gets its own
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")  # never used: the group exists before Lightning looks
    quiet()
    device = select_device(rank)
    extra: dict[str, Any] = {"thresholds": settings.thresholds}  # the stand-in planner without a profile
    if profile == MEASURED:  # the cost model on the machine the strategy measures at setup (no profile)
        extra = {"on_infeasible": "skip"}
    elif profile is not None:  # the cost model plans; a batch no plan fits is skipped and counted
        extra = {"profile": profile, "on_infeasible": "skip"}
    ctx = Context(rank, world, settings, store_dir, device, extra=extra)
    rate = matmul_rate(device)
    if rank == 0:
        from tqdm.auto import tqdm

        ctx.bar = tqdm(total=total_ticks(settings, traces), unit="step", dynamic_ncols=True)
    fits = trace_passes(ctx, traces)
    searches = {}
    for name in settings.runs:
        if ctx.bar is not None:
            ctx.bar.set_description(f"length search {name}")
        searches[name] = search_length(ctx, run_spec(name))
    if ctx.bar is not None:
        ctx.bar.close()
    rates = {"matmul_start": rate, "matmul_end": matmul_rate(device)}  # the best of both: the machine's rate
    rates["matmul"] = max(rates.values())
    if rank != 0:
        return rates
    return {**rates, "fits": fits, "search": searches, "device": str(device)}


__all__ = ["Context", "bench_worker", "fit", "probe", "rotated", "search_length", "total_ticks"]
