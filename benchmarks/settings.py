"""What a benchmark invocation runs: the model, the traces, the global batches, the runs, the memory budget and the
repetitions.

Every run trains the same *global batches*, one per optimizer step: the sequences of a trace grouped under a
token budget (:attr:`BenchSettings.batch_tokens`, padding counted) the way
:func:`lightning_paradyse.data.batching.plan_batches` groups them (see :mod:`benchmarks.workload`).

Two presets: :meth:`BenchSettings.full` (the numbers in ``benchmarks/RESULTS.md``, under 30 minutes on two CPU
cores) and :meth:`BenchSettings.quick` (the smoke test, well under 3 minutes). Every field can be changed from
the command line (``python benchmarks/run.py --help``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from lightning_paradyse.models import LlamaConfig

TraceKind = Literal["github", "grch38", "corpus", "mixed"]
TraceOrder = Literal["sorted", "shuffled"]
TRACE_KINDS: tuple[str, ...] = ("github", "grch38", "corpus", "mixed")
"""Every trace kind (see :class:`TraceSettings`)."""
MiB = 2**20

ALL_RUNS: tuple[str, ...] = (
    "paradyse-auto",
    "groups-tp_sp",
    "groups-ulysses",
    "static-tp_sp",
    "static-tp_sp+rc",
    "static-ulysses",
    "static-ulysses+rc",
    "static-ring",
    "static-ring+rc",
    "static-metp",
    "static-metp+rc",
    "lightning-ddp",
    "lightning-ddp+ac",
    "lightning-fsdp2",
    "lightning-fsdp2+ac",
    "lightning-tp",
)
"""Every run the benchmark knows, in table order (see :mod:`benchmarks.runs`)."""

QUICK_RUNS: tuple[str, ...] = ("paradyse-auto", "groups-tp_sp", "static-tp_sp", "static-ulysses+rc", "lightning-ddp")
"""The runs of ``--quick``: adaptive, groups with one fixed mode, two static modes, DDP."""


@dataclass(frozen=True)
class ModelSettings:
    """The Llama-style model every run trains (built with :class:`~lightning_paradyse.models.LlamaConfig`)."""

    layers: int = 4
    """Transformer blocks."""
    hidden: int = 128
    """Width of the residual stream."""
    heads: int = 4
    """Query heads (divisible by the number of processes for ``tp_sp`` and tensor parallelism)."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    ffn: int = 352
    """Inner width of the SwiGLU MLP."""
    vocab: int = 128
    """Vocabulary: byte tokens clipped to 7 bits, as the bundled corpus."""
    max_seq_len: int = 32768
    """Longest position the model accepts (bounds the length search)."""

    def config(self) -> LlamaConfig:
        """The model's config."""
        return LlamaConfig(
            vocab_size=self.vocab,
            n_layers=self.layers,
            hidden=self.hidden,
            n_heads=self.heads,
            n_kv_heads=self.kv_heads,
            ffn=self.ffn,
            max_seq_len=self.max_seq_len,
        )


@dataclass(frozen=True)
class TraceSettings:
    """One length trace: its sequences, grouped into global batches under the token budget in :attr:`order`."""

    kind: TraceKind
    """``github`` / ``grch38``: lengths drawn from the paper's bucket shares scaled to ``max_len``
    (:func:`lightning_paradyse.data.length_traces.length_trace`); ``corpus``: documents of the bundled corpus, cut into
    chunks of at most ``max_len``; ``mixed``: mostly short sequences with a few long ones (:attr:`long_share`)."""
    n: int
    """Sequences in the trace."""
    max_len: int
    """Longest sequence (at most :attr:`BenchSettings.batch_tokens`)."""
    min_len: int = 16
    """Shortest sequence."""
    seed: int = 0
    """Seed of the lengths, of the text windows and of a shuffled order."""
    order: TraceOrder = "sorted"
    """How sequences fill the global batches (:attr:`lightning_paradyse.data.batching.BatchingConfig.order`):
    ``sorted``, shortest first, the paper's curriculum (a batch holds sequences of similar lengths); ``shuffled``, a
    seeded random order (a batch mixes lengths)."""
    long_share: float = 0.125
    """``mixed``: the share of long sequences, log-uniform in ``[max_len / 2, max_len]``; the others are short,
    log-uniform in ``[min_len, max_len / 16]``."""

    @property
    def name(self) -> str:
        """The trace's name in tables and plots."""
        return self.kind


@dataclass(frozen=True)
class SearchSettings:
    """The search for the largest length one training step fits in the budget (doubling, then bisection)."""

    start: int = 256
    """First length probed."""
    cap: int = 16384
    """Largest length probed; a run that fits there is reported as ``>= cap``; 0 switches the search off."""
    resolution: float = 0.05
    """Bisection stops when the interval is narrower than this fraction of its lower end ..."""
    min_step: int = 64
    """... or than this many tokens."""


@dataclass(frozen=True)
class BenchSettings:
    """Everything one invocation of ``benchmarks/run.py`` runs."""

    devices: int = 2
    """Processes (CPU: gloo, one thread each; CUDA: one GPU each, NCCL)."""
    model: ModelSettings = field(default_factory=ModelSettings)
    """The model every run trains."""
    traces: tuple[TraceSettings, ...] = ()
    """The length traces."""
    batch_tokens: int = 4096
    """Token budget of one global batch (one optimizer step), padding counted: ``rows x longest row <= batch_tokens``
    (:attr:`lightning_paradyse.data.batching.BatchingConfig.max_tokens`)."""
    runs: tuple[str, ...] = ALL_RUNS
    """Names of the runs (see :data:`ALL_RUNS`)."""
    budget: int = 64 * MiB
    """Per-rank memory budget in bytes: a step whose measured peak exceeds it counts as an OOM step (and the
    adaptive run plans within it). A global batch holds about ``batch_tokens`` tokens, padding included, whatever
    its rows, so a run's steps peak alike: the full preset's budget lies between the peaks of the recomputing and
    ``metp`` runs and the about twice larger ones of the other modes and of DDP, FSDP2 and TP (see the results'
    peak column)."""
    repeats: int = 3
    """Timed passes over every (trace, run), interleaved round-robin (plus one instrumented pass)."""
    search: SearchSettings = field(default_factory=SearchSettings)
    """The largest-trainable-length search."""
    lr: float = 1e-3
    """AdamW learning rate."""
    warmup: int = 3
    """Unrecorded warm-up steps at the start of every fit (the trace's first global batch, repeated), the same for
    every run: the one-time step check of the ParaDySe strategy runs on the first, the group planners are made on
    the second, and its replica check runs after each of the first three optimizer steps
    (``ParaDySeStrategy(check_replicas_every=...)``: then every 50th); DDP's first step rebuilds its buckets. The full
    preset warms up through the 10th batch, where the step check runs again
    (:data:`~lightning_paradyse.lightning.step_check.AGAIN_EVERY`: then at the 100th, 1,000th, ...; on one group of
    every rank, with its extra forward passes): with three, the 10th batch was a timed step of every trace of 7 steps or
    more, and the adaptive run paid the check there (`mixed` 2026-12-01: its 7th step on one group of both ranks, 639
    against about 420 ms data parallel); a long fit pays it three times in a thousand steps. The quick preset's fits
    end before their 10th batch."""
    thresholds: tuple[int, int] = (256, 1024)
    """``ParaDySeStrategy(thresholds=...)`` of the adaptive run (used by its stand-in threshold policy)."""
    profile: str | None = None
    """A saved cost profile for the adaptive run (``ParaDySeStrategy(profile=...)``); ``None``: calibrate one first
    (:mod:`benchmarks.profiling`); :data:`MEASURED`: none, the strategy measures the machine at setup, as
    ``plan="auto"`` does without a profile (a user's default)."""
    seed: int = 0
    """Seed of the model weights."""
    timeout: float = 3600.0
    """Seconds before the spawned processes are given up."""
    preset: str = "custom"
    """``quick``, ``full`` or ``custom`` (recorded in the output)."""

    @classmethod
    def full(cls) -> BenchSettings:
        """The benchmark of ``benchmarks/RESULTS.md``: 14 runs, four traces, global batches of 4,096 tokens, three
        timed passes."""
        traces = (
            TraceSettings("github", n=200, max_len=3072, seed=1),
            TraceSettings("grch38", n=120, max_len=3072, seed=2),
            TraceSettings("corpus", n=10, max_len=2048, seed=3),
            TraceSettings("mixed", n=80, max_len=2048, seed=4, order="shuffled"),
        )
        return cls(traces=traces, batch_tokens=4096, search=SearchSettings(cap=8192), warmup=10, preset="full")

    @classmethod
    def quick(cls) -> BenchSettings:
        """A smoke run: a tiny model, one short trace in global batches of 512 tokens, five runs, eleven timed
        passes (its steps take 10-30 ms: one pass's times swing by a third between invocations; DDP's steps fall in
        two modes, 8-9 ms and 12-16 ms on 2 cores, so the median of three passes moved the adaptive/DDP ratio by
        0.75-1.21x and of five by 0.84-1.26x, with the same code), a short search."""
        return cls(
            # 8 heads: every head-sharded mode runs on up to 8 ranks
            model=ModelSettings(layers=2, hidden=64, heads=8, kv_heads=2, ffn=128, max_seq_len=4096),
            traces=(TraceSettings("github", n=64, max_len=512, min_len=16, seed=1),),
            batch_tokens=512,
            runs=QUICK_RUNS,
            budget=8 * MiB,
            repeats=11,
            search=SearchSettings(start=256, cap=1024, resolution=0.25, min_step=128),
            preset="quick",
        )

    def with_overrides(self, **changes: object) -> BenchSettings:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})  # type: ignore[arg-type]


MEASURED = "measured"
"""``--profile measured``: the adaptive run plans on the machine the strategy measures at setup (no profile)."""

__all__ = [
    "ALL_RUNS",
    "MEASURED",
    "QUICK_RUNS",
    "TRACE_KINDS",
    "BenchSettings",
    "ModelSettings",
    "SearchSettings",
    "TraceSettings",
]
