"""Sequence-length distributions of the ParaDySe paper, length traces for benchmarks, length tables.

The paper (reference/paradyse-system.md, section 8) describes its two datasets only by the share of
sequences in seven length buckets, ``(0,4K) [4K,8K) [8K,16K) [16K,32K) [32K,64K) [64K,128K) [128K,∞)``,
and the longest sequence: GitHubCode (code, GPT-2 tokens, max 309K) and GRCh38 (a genome, 3-mer tokens,
max 624K). ``K`` is read as 1024, as in the power-of-two edges.

Benchmarks need the same *shape* at a length our machines can run, so every function here can scale
the bucket edges by ``max_len / paper_max``: the paper's longest sequence maps to ``max_len`` and every
edge moves with it. :func:`length_trace` draws lengths from such a scaled distribution (a bucket by its
share, then a log-uniform length inside it), deterministically per seed. :func:`length_table` measures
the same bucket shares for any list of lengths (our corpora), and :func:`markdown_table` prints rows in
the paper's format, so a README can show our corpus next to GitHubCode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

K = 1024
"""The paper's "K" (its bucket edges are powers of two)."""

PAPER_EDGES: tuple[int, ...] = (0, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K)
"""Lower edges of the paper's seven buckets; the last bucket is open, ``[128K, ∞)``."""


@dataclass(frozen=True)
class LengthDistribution:
    """One dataset of the paper, as the paper reports it: bucket shares and the longest sequence."""

    name: str
    """Short name used by :func:`length_trace` (``github`` or ``grch38``)."""
    title: str
    """The dataset as the paper's table names it."""
    percents: tuple[float, ...]
    """Percent of sequences per bucket of :data:`PAPER_EDGES` (GRCh38's sum to 99.1: normalised when drawn)."""
    max_len: int
    """The longest sequence, in the dataset's tokens."""

    @property
    def shares(self) -> np.ndarray:
        """Bucket probabilities, normalised to sum to 1."""
        p = np.asarray(self.percents, dtype=np.float64)
        return p / p.sum()


GITHUB_CODE = LengthDistribution(
    "github", "GitHubCode (CodeParrot, GPT-2 tokeniser)", (65.7, 14.5, 9.8, 5.1, 2.7, 1.1, 1.1), 309 * K
)
GRCH38 = LengthDistribution(
    "grch38", "GRCh38 (human genome p14, 3-mer tokens)", (3.5, 26.4, 28.7, 21.2, 11.9, 5.5, 1.9), 624 * K
)
DISTRIBUTIONS: dict[str, LengthDistribution] = {d.name: d for d in (GITHUB_CODE, GRCH38)}
"""The paper's datasets by short name."""

FIRST_BUCKET_FLOOR = 1 / 16
"""Traces draw the first bucket ``(0, 4K)`` log-uniformly from ``4K / 16`` (256 tokens at the paper's scale)."""


def get_distribution(kind: str) -> LengthDistribution:
    """The paper's dataset called ``kind`` (``github`` or ``grch38``)."""
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"unknown length distribution {kind!r}; choose one of {sorted(DISTRIBUTIONS)}")
    return DISTRIBUTIONS[kind]


def scaled_edges(kind: str, max_len: int) -> list[float]:
    """Lower bucket edges scaled so the paper's longest sequence of ``kind`` maps to ``max_len``."""
    scale = max_len / get_distribution(kind).max_len
    return [e * scale for e in PAPER_EDGES]


def _integer_ranges(kind: str, max_len: int, min_len: int | None) -> tuple[list[tuple[int, int]], list[int]]:
    """``[lo, hi)`` integer lengths of every scaled bucket (the last one ends at ``max_len`` included, none starts
    below ``min_len``), and the buckets that lie wholly below ``min_len``."""
    edges = [*scaled_edges(kind, max_len), float(max_len + 1)]
    floor = edges[1] * FIRST_BUCKET_FLOOR if min_len is None else min_len
    los = [max(1, math.ceil(floor))] + [max(math.ceil(e), min_len or 1) for e in edges[1:-1]]
    his = [math.ceil(e) for e in edges[1:-1]] + [max_len + 1]
    ranges = list(zip(los, his))
    below = [i for i, (_, hi) in enumerate(ranges) if min_len is not None and hi <= min_len]
    empty = [i for i, (lo, hi) in enumerate(ranges) if lo >= hi and i not in below]
    if empty or len(below) == len(ranges):
        raise ValueError(
            f"length_trace({kind!r}, max_len={max_len}, min_len={min_len}): bucket(s) {empty or below} hold no "
            f"integer length (ranges {ranges}); use a larger max_len (the first bucket is "
            f"4K/{get_distribution(kind).max_len} of it) or a smaller min_len"
        )
    return ranges, below


def length_trace(kind: str, n: int, max_len: int, seed: int = 0, min_len: int | None = None) -> list[int]:
    """``n`` sequence lengths following the paper's bucket shares of ``kind``, scaled to ``max_len``.

    A bucket is drawn with the paper's share, then a length inside it, log-uniformly (short lengths are more
    frequent inside a bucket, as in a long tail). Edges are :func:`scaled_edges`; every length lies in
    ``[min_len, max_len]`` and in its scaled bucket. A bucket that lies wholly below ``min_len`` (at a small
    ``max_len``, the shortest buckets scale to a few tokens, fewer than a group of many ranks needs) gives its share
    to the first bucket that does not. The same ``(kind, n, max_len, seed, min_len)`` gives the same list on every
    machine (numpy's PCG64).

    Args:
        kind: ``github`` (GitHubCode) or ``grch38``.
        n: Number of lengths.
        max_len: The longest possible length (the paper's max, 309K or 624K, maps to it).
        seed: Seed of the draw.
        min_len: Shortest length; default 1/16 of the first bucket's upper edge.
    """
    if n < 0:
        raise ValueError(f"length_trace: n must not be negative, got {n}")
    ranges, below = _integer_ranges(kind, max_len, min_len)
    rng = np.random.default_rng(seed)
    buckets = rng.choice(len(ranges), size=n, p=get_distribution(kind).shares)
    if below:  # drawn as before (the same stream), then moved to the first bucket above min_len
        buckets = np.where(np.isin(buckets, below), max(below) + 1, buckets)
    lo = np.array([r[0] for r in ranges], dtype=np.float64)[buckets]
    hi = np.array([r[1] for r in ranges], dtype=np.float64)[buckets]
    u = rng.random(n)
    lengths = np.floor(np.exp(np.log(lo) + u * (np.log(hi) - np.log(lo)))).astype(np.int64)
    return np.clip(lengths, lo.astype(np.int64), hi.astype(np.int64) - 1).tolist()


def bucket_counts(lengths: Sequence[int] | np.ndarray, edges: Sequence[float]) -> list[int]:
    """Number of lengths in each bucket ``[edges[i], edges[i + 1])``, the last bucket open."""
    idx = np.searchsorted(np.asarray(edges[1:], dtype=np.float64), np.asarray(lengths, dtype=np.float64), "right")
    return np.bincount(idx, minlength=len(edges)).tolist()


def _fmt(x: float) -> str:
    if x >= K and abs(x / K - round(x / K)) < 1e-9:
        return f"{round(x / K)}K"
    if x >= 10 * K:
        return f"{x / K:.1f}K"
    return str(math.ceil(x)) if x != int(x) else str(int(x))


def bucket_labels(edges: Sequence[float]) -> list[str]:
    """Labels in the paper's style: ``(0,4K)``, ``[4K,8K)``, ..., ``[128K,∞)``."""
    labels = [f"{'(' if i == 0 else '['}{_fmt(edges[i])},{_fmt(edges[i + 1])})" for i in range(len(edges) - 1)]
    return [*labels, f"[{_fmt(edges[-1])},∞)"]


@dataclass(frozen=True)
class LengthTable:
    """Share of sequences per length bucket, one row of the paper's table."""

    name: str
    """Row label (the dataset)."""
    labels: tuple[str, ...]
    """Bucket labels, see :func:`bucket_labels`."""
    percents: tuple[float, ...]
    """Percent of sequences per bucket."""
    max_len: int
    """The longest sequence."""
    count: int
    """Number of sequences measured (0 for the paper's rows, which give no count)."""

    def markdown(self) -> str:
        """This row alone as a markdown table."""
        return markdown_table([self])


def length_table(
    lengths: Sequence[int] | np.ndarray, name: str = "corpus", scale_to: int | None = None, reference: str = "github"
) -> LengthTable:
    """Bucket shares of ``lengths``, with the paper's edges or with edges scaled so ``reference``'s max is ``scale_to``.

    ``scale_to=None`` uses the paper's absolute edges (4K, 8K, ...). With ``scale_to=m`` the edges are
    ``scaled_edges(reference, m)``: choose ``m`` = the longest sequence you train on (or the corpus maximum)
    to compare the *shape* of a corpus of shorter documents with the paper's.
    """
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        raise ValueError(f"length_table({name!r}): no lengths given")
    edges = list(PAPER_EDGES) if scale_to is None else scaled_edges(reference, scale_to)
    counts = bucket_counts(arr, edges)
    percents = tuple(100.0 * c / arr.size for c in counts)
    return LengthTable(name, tuple(bucket_labels(edges)), percents, int(arr.max()), int(arr.size))


def paper_table(kind: str) -> LengthTable:
    """The paper's row for ``kind`` (absolute edges)."""
    d = get_distribution(kind)
    return LengthTable(d.title, tuple(bucket_labels(PAPER_EDGES)), d.percents, d.max_len, 0)


def markdown_table(rows: Sequence[LengthTable]) -> str:
    """Rows in the paper's format, ``| Dataset | (0,4K) | ... | Max |``; a new header wherever the buckets change."""
    if not rows:
        raise ValueError("markdown_table: no rows")
    lines: list[str] = []
    for i, row in enumerate(rows):
        if i == 0 or row.labels != rows[i - 1].labels:
            head = ["Dataset", *row.labels, "Max"]
            lines += ([""] if lines else []) + ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        cells = [row.name, *(f"{p:.1f}%" for p in row.percents), _fmt(row.max_len)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "DISTRIBUTIONS",
    "GITHUB_CODE",
    "GRCH38",
    "PAPER_EDGES",
    "LengthDistribution",
    "LengthTable",
    "bucket_counts",
    "bucket_labels",
    "get_distribution",
    "length_table",
    "length_trace",
    "markdown_table",
    "paper_table",
    "scaled_edges",
]
