"""What a benchmark invocation runs: the model, the traces, the runs, the memory budget and the repetitions.

Two presets: :meth:`BenchSettings.full` (the numbers in ``benchmarks/RESULTS.md``, under 30 minutes on two CPU
cores) and :meth:`BenchSettings.quick` (the smoke test, well under 3 minutes). Every field can be changed from
the command line (``python benchmarks/run.py --help``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from lightning_paradyse.models import LlamaConfig

TraceKind = Literal["github", "grch38", "corpus"]
MiB = 2**20

ALL_RUNS: tuple[str, ...] = (
    "paradyse-auto",
    "static-tp_sp",
    "static-tp_sp+rc",
    "static-ulysses",
    "static-ulysses+rc",
    "static-ring",
    "static-ring+rc",
    "static-metp",
    "static-metp+rc",
    "lightning-ddp",
    "lightning-fsdp2",
    "lightning-tp",
)
"""Every run the benchmark knows, in table order (see :mod:`benchmarks.runs`)."""

QUICK_RUNS: tuple[str, ...] = ("paradyse-auto", "static-tp_sp", "static-ulysses+rc", "lightning-ddp")
"""The runs of ``--quick``: adaptive, two static modes, DDP."""


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
    """One length trace: every run trains on its sequences, shortest first (the paper's curriculum)."""

    kind: TraceKind
    """``github`` / ``grch38``: lengths drawn from the paper's bucket shares scaled to ``max_len``
    (:func:`lightning_paradyse.traces.length_trace`); ``corpus``: documents of the bundled corpus, cut into
    chunks of at most ``max_len``."""
    n: int
    """Sequences in the trace (rounded up to a multiple of the number of processes)."""
    max_len: int
    """Longest sequence."""
    min_len: int = 16
    """Shortest sequence."""
    seed: int = 0
    """Seed of the lengths and of the text windows."""

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
    runs: tuple[str, ...] = ALL_RUNS
    """Names of the runs (see :data:`ALL_RUNS`)."""
    budget: int = 48 * MiB
    """Per-rank memory budget in bytes: a step whose measured peak exceeds it counts as an OOM step."""
    repeats: int = 3
    """Timed passes over every (trace, run), interleaved round-robin (plus one instrumented pass)."""
    search: SearchSettings = field(default_factory=SearchSettings)
    """The largest-trainable-length search."""
    lr: float = 1e-3
    """AdamW learning rate."""
    thresholds: tuple[int, int] = (256, 1024)
    """``ParaDySeStrategy(thresholds=...)`` of the adaptive run (used by its stand-in threshold policy)."""
    profile: str | None = None
    """A saved cost profile for the adaptive run (``ParaDySeStrategy(profile=...)``); ``None``: calibrate one first
    (:mod:`benchmarks.profiling`)."""
    seed: int = 0
    """Seed of the model weights."""
    timeout: float = 3600.0
    """Seconds before the spawned processes are given up."""
    preset: str = "custom"
    """``quick``, ``full`` or ``custom`` (recorded in the output)."""

    @classmethod
    def full(cls) -> BenchSettings:
        """The benchmark of ``benchmarks/RESULTS.md``: 12 runs, three traces, three timed passes."""
        traces = (
            TraceSettings("github", n=40, max_len=3072, seed=1),
            TraceSettings("grch38", n=24, max_len=3072, seed=2),
            TraceSettings("corpus", n=12, max_len=2048, seed=3),
        )
        return cls(traces=traces, search=SearchSettings(cap=8192), preset="full")

    @classmethod
    def quick(cls) -> BenchSettings:
        """A smoke run: a tiny model, one short trace, four runs, one timed pass, a short search."""
        return cls(
            model=ModelSettings(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, max_seq_len=4096),
            traces=(TraceSettings("github", n=8, max_len=512, min_len=16, seed=1),),
            runs=QUICK_RUNS,
            budget=8 * MiB,
            repeats=1,
            search=SearchSettings(start=256, cap=1024, resolution=0.25, min_step=128),
            preset="quick",
        )

    def with_overrides(self, **changes: object) -> BenchSettings:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})  # type: ignore[arg-type]


__all__ = ["ALL_RUNS", "QUICK_RUNS", "BenchSettings", "ModelSettings", "SearchSettings", "TraceSettings"]
