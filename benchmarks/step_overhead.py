"""What a data-parallel step costs against DDP's: wall and CPU time per step of many identical short batches.

    python benchmarks/step_overhead.py [--devices 2] [--steps 60] [--repeats 3] [--layers N] [--vary] [--profile DIR]
                                       [--calls] [--functions] [--no-poll] [--logged]

Every spawned process trains the quick preset's model (:meth:`benchmarks.settings.BenchSettings.quick`) for
``--steps`` steps on global batches of ``--rows`` rows of ``--length`` tokens, alternately with
``ParaDySeStrategy(plan="auto")`` (whose planner sends such batches to groups of one, data parallelism, on an
idle machine: it weighs measured times, so under other load it may not; the timed steps' splits are counted) and with
Lightning's ``DDPStrategy`` (each rank its ``rows / devices`` rows), ``--repeats`` fits each, one fresh process
group per fit (a file store: no ports). After ``--warmup`` steps it takes the median step of each fit, between
consecutive ``on_train_batch_start`` hooks: wall clock, and this process's CPU time (what the process computed,
its waits excluded). Prints one line per run: the fits' medians on every rank, then DDP's over ours, then the
median of each part of the step (:data:`PHASES`: where ours and DDP's differ).

``--layers`` deepens the model (the quick preset's has 2 blocks): what of the difference grows with the number of
weights the exchange handles one by one.

``--vary`` gives every step its own length, drawn between half and one and a half ``--length`` (the same draws in
every fit), as real data does: each batch is then a first sight for whatever the step keeps per shape.

``--profile DIR`` first runs one more fit of each, left out of the timings, and writes rank 0's ``cProfile`` of its
steps after the warm-up (``DIR/<run>.prof``; read with ``python -m pstats``): where the difference goes. The
profiler slows Python-heavy code most.

It also prints each part's median CPU time of the main thread (the thread clock): what the rank computed there. Our
step's exchanges wait by polling where each rank has a core (:func:`~lightning_paradyse.distributed.comm.polled`), so
their waits count as CPU; ``--no-poll`` makes them block as DDP's do, which shows what each part computes (and slows
our steps: compare the wall times without it).

``--logged`` logs every step (``log_every_n_steps=1``) and gives ours the ``ParaDySeSwitcher``, as the quick preset's
trainer does (:func:`benchmarks.worker.make_trainer`): a logged step is a timed one (its priced part and group times
measured, :mod:`~lightning_paradyse.lightning.fixed_cost`), and the switcher records it.

``--calls`` first runs one more fit of each, left out of the timings, and prints how many Python and C function calls
rank 0's main thread makes per step, in each part of the step (a ``sys.setprofile`` hook): a count that, unlike a
time on a loaded machine, does not move between invocations (what a change of the step's Python saves shows here
when the times cannot resolve it).

``--functions`` then runs one more fit of each, left out of the timings, and prints the main thread's CPU time and
the wall time per call of the step's own functions (:data:`FUNCTIONS`: ours, the agreement, the gather, the
decision, the return, their collectives, and the model's forward in both runs) on rank 0, after the warm-up: each
wrapped by a clock, which adds a few microseconds a call (an outer function's time includes its timed inner ones'),
where a profiler slows every Python call.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import importlib
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from benchmarks.gpu_check import Tokens
from benchmarks.settings import BenchSettings

RUNS = ("paradyse", "ddp")


PHASES = ("to the loss", "backward", "to the optimizer", "optimizer", "between steps")
"""A step's parts: batch start -> the module's training step returns its loss (the batch's agreement, decision and
slicing, the forward) -> ``on_after_backward`` (DDP's all-reduce inside, and our gradient return, which comes before
that hook since 2026-11-30 as DDP's does) -> ``on_before_optimizer_step`` -> batch end -> the next batch's start
(Lightning's loop)."""


FUNCTIONS = (
    ("lightning_paradyse.lightning.cycle", "StepCycle.begin"),
    ("lightning_paradyse.lightning.cycle", "StepCycle.inspect"),
    ("lightning_paradyse.groups.runner", "GroupRunner.decide"),
    ("lightning_paradyse.lightning.cycle", "StepCycle.agree"),
    ("lightning_paradyse.groups.exchange", "gather_whole"),
    ("lightning_paradyse.distributed.comm", "all_gather_rows"),
    ("lightning_paradyse.groups.runner", "GroupRunner.enter"),
    ("lightning_paradyse.lightning.language_model", "LanguageModel.forward"),
    ("lightning_paradyse.lightning.cycle", "StepCycle.after_backward"),
    ("lightning_paradyse.groups.exchange", "exit_group"),
    ("lightning_paradyse.distributed.comm", "all_to_all_rows"),
)
"""What ``--functions`` times: ``(module, name in it)``; a module-level function is rebound too where another module
of the package imported it by name."""


class FunctionClock:
    """Calls, wall and main-thread CPU seconds of every function of :data:`FUNCTIONS` while :attr:`on`."""

    def __init__(self) -> None:
        self.on = False
        self.totals: dict[str, list[float]] = {}

    def install(self) -> None:
        for module_name, qualname in FUNCTIONS:
            module = importlib.import_module(module_name)
            *path, name = qualname.split(".")
            owner: Any = functools.reduce(getattr, path, module)
            original = getattr(owner, name)
            timed = self._timed(qualname, original)
            setattr(owner, name, timed)
            if path:
                continue
            for other in list(sys.modules.values()):  # ``from ... import name`` elsewhere in the package
                if vars(other).get(name) is original and other.__name__.startswith("lightning_paradyse"):
                    setattr(other, name, timed)

    def _timed(self, qualname: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                total = self.totals.setdefault(qualname, [0, 0.0, 0.0])
                total[0] += 1
                total[1] += time.perf_counter() - wall
                total[2] += time.thread_time() - cpu

        return timed

    def per_call(self, steps: int) -> dict[str, tuple[float, float, float]]:
        """Per function called: calls per step, wall and CPU seconds per call."""
        return {k: (n / max(1, steps), w / n, c / n) for k, (n, w, c) in self.totals.items()}


class StepClock(pl.Callback):
    """Wall and process CPU time at every batch start and at the end of training, the wall clock at the hooks that
    part a step (:data:`PHASES`); profiles the steps after ``warmup`` when given a profiler."""

    def __init__(
        self,
        warmup: int,
        profiler: cProfile.Profile | None,
        count_calls: bool = False,
        functions: FunctionClock | None = None,
    ) -> None:
        self.warmup, self.profiler, self.count_calls, self.functions = warmup, profiler, count_calls, functions
        self.calls = [0] * len(PHASES)
        """With ``count_calls``: the Python and C calls of the main thread in each part of the steps after the
        warm-up (:meth:`calls_per_step`)."""
        self._loss_at = (0.0, 0.0)
        """The wall and thread clocks where the module's step last returned its loss (:meth:`loss_computed`)."""
        self._phase = 0
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.marks: list[list[float]] = []
        """Per step: the wall clock at its start, before and after the backward, before the optimizer step, at its
        end."""
        self.thread: list[float] = []
        self.thread_marks: list[list[float]] = []
        """:attr:`marks` on the main thread's clock (its CPU time)."""
        self.splits: list[tuple[int, ...]] = []
        """Every step's group sizes (``()``: one group of every rank, or not a ParaDySe run)."""

    def _tick(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.thread.append(time.thread_time())

    def _mark(self) -> None:
        self.marks[-1].append(time.perf_counter())
        self.thread_marks[-1].append(time.thread_time())
        self._phase = len(self.marks[-1]) - 1  # the part of the step that starts here

    def _count(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.calls[self._phase] += 1

    def on_train_batch_start(self, *args: Any) -> None:
        self._tick()
        self.marks.append([self.wall[-1]])
        self.thread_marks.append([self.thread[-1]])
        self._phase = 0
        if self.profiler is not None and len(self.wall) == self.warmup + 1:
            self.profiler.enable()
        if self.count_calls and len(self.wall) == self.warmup + 1:
            sys.setprofile(self._count)
        if self.functions is not None and len(self.wall) == self.warmup + 1:
            self.functions.on = True

    def loss_computed(self) -> None:
        """The module's training step returned its loss (:class:`_Clocked`): the end of the step's first part, kept
        until the backward ends (a step the strategy checks calls the step more than once: the last call counts).
        Not a callback's ``on_before_backward``: a callback overriding it makes our strategy hand it the global loss,
        one more all-reduce per step on groups, which the timed step would then pay and the quick preset does not."""
        self._loss_at = (time.perf_counter(), time.thread_time())
        self._phase = 1

    def on_after_backward(self, *args: Any) -> None:
        wall, thread = self._loss_at
        self.marks[-1].append(wall)
        self.thread_marks[-1].append(thread)
        self._mark()

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._mark()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._mark()
        record = getattr(trainer.strategy, "step_record", None)
        self.splits.append(getattr(record, "split", ()))

    def on_train_end(self, *args: Any) -> None:
        self._tick()
        if self.profiler is not None:
            self.profiler.disable()
        if self.count_calls:
            sys.setprofile(None)
        if self.functions is not None:
            self.functions.on = False

    def calls_per_step(self) -> list[float]:
        """The mean calls per step after the warm-up in each of :data:`PHASES` (the last step's "between steps" is
        its way to the end of training)."""
        steps = max(1, len(self.wall) - 1 - self.warmup)
        return [n / steps for n in self.calls]

    def medians(self) -> tuple[float, float]:
        """Median wall and CPU seconds of the steps after the warm-up."""
        wall, cpu = self.wall[self.warmup :], self.cpu[self.warmup :]
        return (
            statistics.median(b - a for a, b in itertools.pairwise(wall)),
            statistics.median(b - a for a, b in itertools.pairwise(cpu)),
        )

    def phases(self, cpu: bool = False) -> list[float]:
        """Median seconds of each of :data:`PHASES` over the steps after the warm-up that stepped the optimizer (a
        skipped step has no ``on_before_optimizer_step``); with ``cpu`` the main thread's CPU seconds."""
        marks, ends = (self.thread_marks, self.thread) if cpu else (self.marks, self.wall)
        steps = [(m, nxt) for m, nxt in zip(marks[self.warmup :], ends[self.warmup + 1 :]) if len(m) == 5]
        if not steps:  # every timed step skipped its optimizer step (no plan fitted): nothing to part
            return [math.nan] * len(PHASES)
        return [statistics.median([*m, nxt][i + 1] - [*m, nxt][i] for m, nxt in steps) for i in range(len(PHASES))]


class Varied(Tokens):
    """:class:`~benchmarks.gpu_check.Tokens` whose step ``i`` has its own length, between half and one and a half
    ``length`` (drawn from ``i``: the same in every fit and on every rank)."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(10_000 + i)
        length = int(torch.randint(max(1, self.length // 2), self.length * 3 // 2 + 1, (), generator=gen))
        window = torch.randint(0, self.vocab, (self.rows, length + 1), generator=gen)
        return {"input_ids": window[:, :-1], "targets": window[:, 1:]}


def _fit(
    run: str,
    args: argparse.Namespace,
    rank: int,
    world: int,
    store: str,
    profile: Path | None,
    calls: bool = False,
    functions: FunctionClock | None = None,
) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_paradyse import ParaDySeStrategy
    from lightning_paradyse.lightning.language_model import LanguageModel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    pl.seed_everything(0, verbose=False)
    quick = BenchSettings.quick()
    config = replace(quick.model, layers=args.layers or quick.model.layers).config()
    profiler = cProfile.Profile() if profile is not None and rank == 0 else None
    clock = StepClock(args.warmup, profiler, count_calls=calls and rank == 0, functions=functions)

    class _Clocked(LanguageModel):
        """The model whose training step tells the clock when its loss is computed."""

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            clock.loss_computed()
            return loss

    module = _Clocked(model=config, lr=1e-3)
    if run == "paradyse":
        budget = quick.budget * max(1, config.n_layers // quick.model.layers)  # the quick preset's per block
        strategy: Any = ParaDySeStrategy(plan="auto", memory_budget=budget, timeout=120)
        rows = args.rows  # the global batch: the strategy splits it
    else:
        strategy = DDPStrategy(gradient_as_bucket_view=True, timeout=timedelta(seconds=120))
        rows = args.rows // world  # each rank its share
    callbacks: list[pl.Callback] = [clock]
    if args.logged and run == "paradyse":  # as the quick preset's trainer: the switcher records every step
        from lightning_paradyse import ParaDySeSwitcher

        callbacks.append(ParaDySeSwitcher(log_plan=False, plot=False))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
        log_every_n_steps=1 if args.logged else 50,
    )
    made = Varied if args.vary else Tokens
    data = made(args.length, args.steps, config.vocab_size, rows)  # the same batches on every rank
    trainer.fit(module, DataLoader(data, batch_size=None))
    if profiler is not None and profile is not None:
        profiler.dump_stats(profile / f"{run}.prof")
    if dist.is_initialized():  # a strategy's teardown may have destroyed it
        dist.destroy_process_group()
    if calls:
        return clock.calls_per_step()
    if functions is not None:
        return functions.per_call(len(clock.wall) - 1 - args.warmup)
    return (*clock.medians(), clock.splits[args.warmup :], clock.phases(), clock.phases(cpu=True))


def _worker(rank: int, world: int, args: argparse.Namespace, store_dir: str) -> dict[str, list[Any]]:
    dist.destroy_process_group()  # the harness's group: every fit makes its own
    if args.no_poll:  # the step's exchanges block in gloo's wait (read by the strategy's setup)
        from lightning_paradyse.distributed import comm

        comm.SPIN_LIMIT_S = 0.0
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")  # never used: the group exists before Lightning looks
    from benchmarks.worker import quiet

    quiet()
    out: dict[str, list[Any]] = {run: [] for run in RUNS}
    if args.calls:  # one more fit of each, counted, left out of the timings
        for run in RUNS:
            out[f"{run} calls"] = [_fit(run, args, rank, world, os.path.join(store_dir, f"calls-{run}"), None, True)]
    for k in range(-1 if args.profile else 0, args.repeats):
        for run in RUNS:  # alternated: noise hits both alike
            profile = Path(args.profile) if k < 0 else None  # a profiled fit first, left out of the timings
            fit = _fit(run, args, rank, world, os.path.join(store_dir, f"pg-{k}-{run}"), profile)
            if k >= 0:
                out[run].append(fit)
    if args.functions:  # one more fit of each after them, its functions timed, left out of the timings
        functions = FunctionClock()
        functions.install()
        for run in RUNS:
            functions.totals = {}
            store = os.path.join(store_dir, f"functions-{run}")
            out[f"{run} functions"] = [_fit(run, args, rank, world, store, None, functions=functions)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=48)
    parser.add_argument("--layers", type=int, default=None, help="blocks of the model (default: the quick preset's)")
    parser.add_argument("--vary", action="store_true", help="every step its own length (see the docstring)")
    parser.add_argument("--profile", default=None, help="a folder for rank 0's cProfile of one more fit of each run")
    parser.add_argument("--calls", action="store_true", help="count rank 0's calls per step part in one more fit each")
    parser.add_argument(
        "--functions", action="store_true", help="time rank 0's calls of the step's own functions in one more fit each"
    )
    parser.add_argument("--no-poll", action="store_true", help="our step's exchanges block instead of polling")
    parser.add_argument(
        "--logged", action="store_true", help="every step logged, ours with the ParaDySeSwitcher (the quick preset's)"
    )
    args = parser.parse_args()
    if args.rows % args.devices:
        parser.error("--rows must be a multiple of --devices (DDP gives every rank the same share)")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    from lightning_paradyse.distributed.spawn import run_distributed

    with tempfile.TemporaryDirectory() as store_dir:
        per_rank = run_distributed(_worker, args.devices, args, store_dir, timeout=60.0 + 30.0 * args.repeats)
    print(
        f"{args.devices} processes, {args.layers or 2} blocks, {args.steps} steps of {args.rows} x {args.length} "
        "tokens, median step after "
        f"{args.warmup}{', lengths varied' if args.vary else ''}, {args.repeats} fits each (wall / CPU ms, per fit; "
        "rank 0 first):"
    )
    medians = {}
    for run in RUNS:
        fits = [fit for rank in per_rank for fit in rank[run]]
        medians[run] = statistics.median(wall for wall, *_ in fits)
        cells = "  ".join(f"{1e3 * wall:5.1f} / {1e3 * cpu:5.1f}" for wall, cpu, *_ in fits)
        splits = collections.Counter(
            "+".join(map(str, s)) or "all" for _, _, steps, *_ in per_rank[0][run] for s in steps
        )
        shown = ", ".join(f"{split}: {n}" for split, n in splits.most_common()) if run == "paradyse" else ""
        print(f"  {run:9s} {cells}" + (f"   (timed steps per split: {shown})" if shown else ""))
    print(f"  DDP / ours (median wall step): {medians['ddp'] / medians['paradyse']:.2f}x")
    print("  median ms per part of the step (the median over the fits and ranks):")
    print("    " + " " * 9 + "".join(f"{phase:>18s}" for phase in PHASES))
    for run in RUNS:
        fits = [fit[3] for rank in per_rank for fit in rank[run]]
        parts = [statistics.median(fit[i] for fit in fits) for i in range(len(PHASES))]  # nan: no step to part
        print(f"    {run:9s}" + "".join(f"{1e3 * part:18.2f}" for part in parts))
    polling = "blocking in its exchanges: --no-poll" if args.no_poll else "polling in its exchanges, counted"
    print(f"  median CPU ms of the main thread per part (ours {polling}):")
    print("    " + " " * 9 + "".join(f"{phase:>18s}" for phase in PHASES))
    for run in RUNS:
        fits = [fit[4] for rank in per_rank for fit in rank[run]]
        parts = [statistics.median(fit[i] for fit in fits) for i in range(len(PHASES))]
        print(f"    {run:9s}" + "".join(f"{1e3 * part:18.2f}" for part in parts))
    if args.calls:
        print("  Python and C calls per step on rank 0's main thread, per part (one more fit each, counted):")
        print("    " + " " * 9 + "".join(f"{phase:>18s}" for phase in PHASES) + f"{'step':>10s}")
        for run in RUNS:
            counts = per_rank[0][f"{run} calls"][0]
            print(f"    {run:9s}" + "".join(f"{n:18.0f}" for n in counts) + f"{sum(counts):10.0f}")
    if args.functions:
        print("  rank 0's functions after the warm-up (one more fit each, each call timed): calls a step, ms a call")
        print(f"    {'function':32s} {'run':9s} {'calls':>6s} {'wall':>8s} {'CPU':>8s}")
        for run in RUNS:
            for name, (n, wall, cpu) in per_rank[0][f"{run} functions"][0].items():
                print(f"    {name:32s} {run:9s} {n:6.1f} {1e3 * wall:8.3f} {1e3 * cpu:8.3f}")


if __name__ == "__main__":
    main()
