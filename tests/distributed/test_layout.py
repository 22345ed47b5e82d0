"""The unified sequence layout (no processes): chunk sizes, segments, shard/unshard and the two orders."""

from __future__ import annotations

import pytest
import torch

from lightning_paradyse.distributed.layout import SeqLayout, split_offsets, split_sizes

# (seq_len, world): divisible and not by p and by 2p, p = 1..5
CASES = [
    (1, 1),
    (7, 1),
    (8, 2),
    (9, 2),
    (10, 2),
    (11, 2),
    (12, 3),
    (13, 3),
    (14, 3),
    (16, 4),
    (13, 4),
    (19, 4),
    (10, 5),
    (23, 5),
    (64, 4),
    (65, 4),
    (67, 4),
]


@pytest.mark.parametrize(
    ("n", "parts", "expected"),
    [
        (10, 1, [10]),
        (10, 2, [5, 5]),
        (10, 3, [4, 3, 3]),
        (11, 4, [3, 3, 3, 2]),
        (2, 4, [1, 1, 0, 0]),
        (0, 3, [0, 0, 0]),
    ],
)
def test_split_sizes_values(n: int, parts: int, expected: list[int]) -> None:
    assert split_sizes(n, parts) == expected
    offsets = split_offsets(n, parts)
    assert offsets[0] == 0 and offsets[-1] == n and len(offsets) == parts + 1
    assert [offsets[i + 1] - offsets[i] for i in range(parts)] == expected


@pytest.mark.parametrize("parts", [0, -2])
def test_split_sizes_rejects_non_positive(parts: int) -> None:
    with pytest.raises(ValueError, match=str(parts)):
        split_sizes(10, parts)


def _covered(layout: SeqLayout) -> list[int]:
    return [i for r in range(layout.world) for a, b in layout.segments(r) for i in range(a, b)]


@pytest.mark.parametrize(("s", "p"), CASES)
def test_contiguous_layout(s: int, p: int) -> None:
    layout = SeqLayout(s, p)
    assert layout.is_natural
    # every position exactly once, in order: rank r holds one contiguous chunk
    assert _covered(layout) == list(range(s))
    assert all(len(layout.segments(r)) == 1 for r in range(p))
    lens = layout.local_lens
    assert len(lens) == p and sum(lens) == s
    assert max(lens) - min(lens) <= 1
    assert list(lens) == split_sizes(s, p)
    assert all(layout.local_len(r) == lens[r] for r in range(p))
    for r in range(p):
        assert layout.positions(r).tolist() == list(range(*layout.segments(r)[0]))
    assert layout.gathered_positions().tolist() == list(range(s))


@pytest.mark.parametrize(("s", "p"), [(s, p) for s, p in CASES if s >= 2 * p])
def test_balanced_layout(s: int, p: int) -> None:
    layout = SeqLayout(s, p, balanced=True)
    off = split_offsets(s, 2 * p)
    chunks = [(off[c], off[c + 1]) for c in range(2 * p)]
    for r in range(p):
        assert layout.segments(r) == (chunks[r], chunks[2 * p - 1 - r])  # head chunk r, tail chunk 2p-1-r
        assert layout.positions(r).tolist() == [*range(*chunks[r]), *range(*chunks[2 * p - 1 - r])]
    assert sorted(_covered(layout)) == list(range(s))
    assert len(_covered(layout)) == s
    lens = layout.local_lens
    assert sum(lens) == s and max(lens) - min(lens) <= 1
    # the work of a causal attention is balanced: every rank's tokens see about the same number of keys
    work = [sum(i + 1 for i in layout.positions(r).tolist()) for r in range(p)]
    assert max(work) - min(work) <= 2 * s


def test_balanced_layout_explicit() -> None:
    layout = SeqLayout(16, 4, balanced=True)  # 8 chunks of 2
    assert layout.positions(0).tolist() == [0, 1, 14, 15]
    assert layout.positions(1).tolist() == [2, 3, 12, 13]
    assert layout.positions(3).tolist() == [6, 7, 8, 9]
    assert layout.gathered_positions().tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    uneven = SeqLayout(13, 3, balanced=True)  # 6 chunks: 3, 2, 2, 2, 2, 2
    assert uneven.positions(0).tolist() == [0, 1, 2, 11, 12]
    assert uneven.positions(1).tolist() == [3, 4, 9, 10]
    assert uneven.positions(2).tolist() == [5, 6, 7, 8]
    assert uneven.local_lens == (5, 4, 4)


LAYOUT_CASES = [(s, p, False) for s, p in CASES] + [(s, p, True) for s, p in CASES if s >= 2 * p]


@pytest.mark.parametrize(("s", "p", "balanced"), LAYOUT_CASES)
def test_shard_unshard_round_trip(s: int, p: int, balanced: bool) -> None:
    layout = SeqLayout(s, p, balanced=balanced)
    x = torch.randn(2, s, 3)
    chunks = [layout.shard(x, r) for r in range(p)]
    for r, chunk in enumerate(chunks):
        assert chunk.shape == (2, layout.local_len(r), 3)
        assert torch.equal(chunk, x[:, layout.positions(r)])
    assert torch.equal(layout.unshard(chunks), x)
    # other dims work too: [b, n, s, d] sharded along dim 2
    y = torch.randn(1, 2, s, 4)
    y_chunks = [layout.shard(y, r, dim=2) for r in range(p)]
    assert torch.equal(layout.unshard(y_chunks, dim=2), y)
    # concatenating the shards gives gathered order
    assert torch.equal(torch.cat(chunks, dim=1), x[:, layout.gathered_positions()])


@pytest.mark.parametrize(("s", "p", "balanced"), LAYOUT_CASES)
def test_natural_index_inverts_gathered_positions(s: int, p: int, balanced: bool) -> None:
    layout = SeqLayout(s, p, balanced=balanced)
    gathered, natural = layout.gathered_positions(), layout.natural_index()
    assert sorted(gathered.tolist()) == list(range(s))  # a permutation
    assert gathered[natural].tolist() == list(range(s))
    assert natural[gathered].tolist() == list(range(s))
    x = torch.arange(s) * 10
    assert torch.equal(x[gathered][natural], x)


def test_natural_index_is_not_identity_when_balanced() -> None:
    layout = SeqLayout(12, 3, balanced=True)
    assert layout.natural_index().tolist() != list(range(12))
    assert not layout.is_natural


@pytest.mark.parametrize(("s", "p"), [(3, 4), (0, 1), (4, 5), (1, 2)])
def test_fewer_tokens_than_ranks_is_an_error(s: int, p: int) -> None:
    with pytest.raises(ValueError) as err:
        SeqLayout(s, p)
    message = str(err.value)
    assert f"{s} tokens" in message and f"{p} ranks" in message


def test_world_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        SeqLayout(10, 0)


@pytest.mark.parametrize(("s", "p"), [(5, 3), (7, 4), (3, 2)])
def test_balanced_needs_two_chunks_per_rank(s: int, p: int) -> None:
    with pytest.raises(ValueError, match=str(2 * p)):
        SeqLayout(s, p, balanced=True)


@pytest.mark.parametrize(
    ("s", "p", "causal", "balanced"),
    [
        (16, 4, True, True),
        (8, 4, True, True),
        (7, 4, True, False),
        (4, 4, True, False),
        (16, 4, False, False),
        (16, 1, True, False),
        (13, 3, True, True),
    ],
)
def test_for_sequence(s: int, p: int, causal: bool, balanced: bool) -> None:
    layout = SeqLayout.for_sequence(s, p, causal)
    assert layout.balanced is balanced
    assert (layout.seq_len, layout.world) == (s, p)
    assert sorted(_covered(layout)) == list(range(s))


def test_layout_is_hashable_value() -> None:
    assert SeqLayout(10, 2) == SeqLayout(10, 2)
    assert SeqLayout(10, 2) != SeqLayout(10, 2, balanced=True)
    assert len({SeqLayout(10, 2), SeqLayout(10, 2)}) == 1
