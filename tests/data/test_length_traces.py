"""Length traces follow the paper's bucket shares when scaled; length tables measure buckets like the paper's table.

Shares are checked on 20,000 draws: a bucket's observed share has a standard deviation of at most
sqrt(0.25 / 20000) = 0.35 points, so a tolerance of 1.5 points is over four deviations.
"""

from __future__ import annotations

import numpy as np
import pytest

from lightning_paradyse.data.length_traces import (
    GITHUB_CODE,
    GRCH38,
    PAPER_EDGES,
    bucket_counts,
    bucket_labels,
    length_table,
    length_trace,
    markdown_table,
    paper_table,
    scaled_edges,
)


@pytest.mark.parametrize("dist", [GITHUB_CODE, GRCH38], ids=lambda d: d.name)
@pytest.mark.parametrize("max_len", [4096, 65536])
def test_trace_reproduces_bucket_shares(dist, max_len: int) -> None:
    n = 20_000
    lengths = length_trace(dist.name, n, max_len, seed=1)
    assert len(lengths) == n and all(isinstance(x, int) for x in lengths[:10])
    assert min(lengths) >= 1 and max(lengths) <= max_len
    observed = np.array(bucket_counts(lengths, scaled_edges(dist.name, max_len))) / n
    assert np.abs(observed - dist.shares).max() < 0.015, (observed, dist.shares)


def test_trace_is_deterministic_per_seed() -> None:
    a = length_trace("github", 500, 8192, seed=3)
    assert a == length_trace("github", 500, 8192, seed=3)
    assert a != length_trace("github", 500, 8192, seed=4)
    assert length_trace("grch38", 0, 8192) == []


def test_trace_min_len_and_errors() -> None:
    lengths = length_trace("github", 5000, 8192, seed=0, min_len=64)
    assert min(lengths) >= 64
    with pytest.raises(ValueError, match="use a larger max_len"):
        length_trace("github", 10, 20)
    with pytest.raises(ValueError, match="unknown length distribution 'c4'"):
        length_trace("c4", 10, 8192)


def test_buckets_below_min_len_give_their_share_to_the_first_bucket_above() -> None:
    """At max_len 512 the two shortest GitHubCode buckets end below 14 tokens; with min_len=16 (8 ranks) their draws
    land in the first bucket that can hold them (``benchmarks/run.py --quick --devices 8`` crashed here)."""
    edges = scaled_edges("github", 512)
    lengths = length_trace("github", 4000, 512, seed=0, min_len=16)
    assert min(lengths) >= 16 and max(lengths) <= 512
    counts = bucket_counts(lengths, edges)
    assert counts[0] == counts[1] == 0
    shares = GITHUB_CODE.shares
    assert counts[2] / 4000 == pytest.approx(shares[0] + shares[1] + shares[2], abs=0.03)
    assert length_trace("github", 300, 512, seed=2, min_len=6) == length_trace("github", 300, 512, seed=2, min_len=6)
    with pytest.raises(ValueError, match="use a larger max_len"):
        length_trace("github", 10, 512, min_len=600)


def test_scaled_edges_map_paper_max_to_max_len() -> None:
    edges = scaled_edges("github", GITHUB_CODE.max_len)
    assert edges == [float(e) for e in PAPER_EDGES]
    half = scaled_edges("grch38", GRCH38.max_len // 2)
    assert half[1] == pytest.approx(2048)


def test_length_table_counts_buckets() -> None:
    lengths = [1, 4095, 4096, 8191, 20_000, 200_000, 200_000, 300_000]
    table = length_table(lengths, "toy")
    assert table.percents == pytest.approx((25.0, 25.0, 0.0, 12.5, 0.0, 0.0, 37.5))
    assert table.labels[0] == "(0,4K)" and table.labels[-1] == "[128K,∞)" and table.max_len == 300_000
    scaled = length_table([10, 1500], "s", scale_to=GITHUB_CODE.max_len // 4)
    assert scaled.labels[1] == "[1K,2K)" and scaled.percents[:2] == (50.0, 50.0)
    assert bucket_labels([0, 4096, 8192]) == ["(0,4K)", "[4K,8K)", "[8K,∞)"]


def test_markdown_table_matches_paper_format() -> None:
    text = markdown_table([paper_table("github"), paper_table("grch38")])
    lines = text.splitlines()
    assert lines[0] == "| Dataset | (0,4K) | [4K,8K) | [8K,16K) | [16K,32K) | [32K,64K) | [64K,128K) | [128K,∞) | Max |"
    assert lines[2].endswith("| 65.7% | 14.5% | 9.8% | 5.1% | 2.7% | 1.1% | 1.1% | 309K |")
    assert lines[3].endswith("| 3.5% | 26.4% | 28.7% | 21.2% | 11.9% | 5.5% | 1.9% | 624K |")
    two = markdown_table([paper_table("github"), length_table([5, 50], "x", scale_to=8192)])
    assert two.count("| Dataset |") == 2  # a new header where the buckets change
