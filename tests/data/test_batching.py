"""Token-budget batching, packing and the resumable sampler.

Checked: every batch respects the budget (padding counted) and every chunk appears exactly once per epoch in
every order; chunks cover every document's tokens; packed batches have targets that never cross a document,
positions restarting at 0 and contiguous doc ids accepted by ``SeqContext``; sorted order ascends and is the
same each epoch, shuffled order is seeded per epoch; a sampler saved after k batches and restored in a new
object continues with exactly the batches of an uninterrupted run, across an epoch boundary.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_paradyse.data.batching import (
    BatchingConfig,
    TokenBudgetSampler,
    chunk_documents,
    make_dataloader,
    pack_documents,
    pad_documents,
    plan_batches,
)
from lightning_paradyse.data.corpus import write_token_corpus
from lightning_paradyse.data.length_traces import length_trace
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.modes.specs import SeqContext, document_bounds

LENGTHS = np.array(length_trace("github", 3000, 512, seed=7, min_len=2))


def cost(batch: list[int], lengths: np.ndarray, pack: bool) -> int:
    sizes = lengths[batch]
    return int(sizes.sum()) if pack else len(batch) * int(sizes.max())


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("order", ["sorted", "shuffled", "natural"])
def test_budget_and_exact_coverage(order: str, pack: bool) -> None:
    config = BatchingConfig(max_tokens=2048, max_len=512, pack=pack, order=order, sort_window=64)  # type: ignore[arg-type]
    batches = plan_batches(LENGTHS, config, seed=3, epoch=1)
    assert all(cost(b, LENGTHS, pack) <= 2048 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))


def test_max_docs_and_too_long_items() -> None:
    batches = plan_batches(LENGTHS, BatchingConfig(max_tokens=4096, max_len=512, max_docs=3))
    assert max(len(b) for b in batches) == 3
    with pytest.raises(ValueError, match="more than max_len=100; cut documents with chunk_documents"):
        plan_batches([50, 200], BatchingConfig(max_tokens=400, max_len=100))
    with pytest.raises(ValueError, match="need 1 <= max_len <= max_tokens"):
        BatchingConfig(max_tokens=100, max_len=200)


def test_sorted_order_is_the_ascending_curriculum() -> None:
    config = BatchingConfig(max_tokens=2048, max_len=512, order="sorted")
    batches = plan_batches(LENGTHS, config, seed=0, epoch=0)
    for a, b in pairwise(batches):
        assert LENGTHS[a].max() <= LENGTHS[b].min()
    assert batches == plan_batches(LENGTHS, config, seed=5, epoch=3)


def test_shuffled_order_is_seeded_per_epoch() -> None:
    config = BatchingConfig(max_tokens=2048, max_len=512, order="shuffled")
    e0 = plan_batches(LENGTHS, config, seed=1, epoch=0)
    assert e0 == plan_batches(LENGTHS, config, seed=1, epoch=0)
    assert e0 != plan_batches(LENGTHS, config, seed=1, epoch=1)
    assert e0 != plan_batches(LENGTHS, config, seed=2, epoch=0)
    windowed = BatchingConfig(max_tokens=2048, max_len=512, order="shuffled", sort_window=256)
    pad = lambda bs: sum(cost(b, LENGTHS, False) for b in bs)  # noqa: E731
    assert pad(plan_batches(LENGTHS, windowed, seed=1)) < 0.8 * pad(e0)  # sorting inside windows cuts padding


def test_chunks_cover_documents() -> None:
    lengths = [1, 5, 1025, 3000, 1024]
    chunks = chunk_documents(lengths, max_len=1024, min_len=2)
    assert chunks.length.max() <= 1024 and chunks.length.min() >= 2
    assert 0 not in chunks.doc.tolist()  # a 1-token document has no target: left out
    for d in range(1, 5):
        mine = chunks.doc == d
        starts, sizes = chunks.start[mine], chunks.length[mine]
        assert starts.tolist() == [0, *np.cumsum(sizes)[:-1].tolist()] and sizes.sum() == lengths[d]
        assert sizes.max() - sizes.min() <= 1  # near-equal pieces, no 1-token tail
    assert chunk_documents(lengths, 1024, docs=[3]).doc.tolist() == [3, 3, 3]


def test_packed_batch_format() -> None:
    docs = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]
    batch = pack_documents(docs)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert batch["targets"].tolist() == [[6, 7, -100, -100, 10, -100]]
    assert batch["positions"].tolist() == [0, 1, 2, 0, 0, 1]
    assert batch["doc_ids"].tolist() == [0, 0, 0, 1, 2, 2]
    ctx = SeqContext(SeqLayout(6, 2), None, batch["doc_ids"])  # the format SeqContext expects, batch 1
    assert ctx.doc_bounds() == [(0, 3), (3, 4), (4, 6)]


def test_padded_batch_format() -> None:
    batch = pad_documents([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]
    assert batch["targets"].tolist() == [[2, 3, -100], [5, -100, -100]]


@pytest.mark.parametrize("pack", [False, True])
def test_dataloader_batches_reproduce_the_corpus(tmp_path: Path, pack: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 128, (int(n),), generator=gen) for n in length_trace("grch38", 60, 300, seed=2)]
    corpus = write_token_corpus(tmp_path / "tok", docs, vocab_size=128)
    config = BatchingConfig(max_tokens=600, max_len=200, pack=pack, order="shuffled")
    loader = make_dataloader(corpus, config, seed=4)
    seen: dict[int, list[int]] = {}
    for batch, indices in zip(loader, TokenBudgetSampler(loader.batch_sampler.lengths, config, seed=4)):
        assert batch["input_ids"].numel() <= 600
        if pack:
            bounds = document_bounds(batch["doc_ids"], batch["input_ids"].shape[1])
            assert len(bounds) == len(indices)
            last = [b - 1 for _, b in bounds]
            assert (batch["targets"][0, last] == -100).all() and (batch["targets"][0] != -100).sum() == sum(
                b - a - 1 for a, b in bounds
            )
            assert all(batch["positions"][a] == 0 for a, _ in bounds)
            rows = [batch["input_ids"][0, a:b] for a, b in bounds]
        else:
            real = (batch["targets"] != -100).sum(dim=1) + 1  # a row's length: its targets plus the last token
            rows = [batch["input_ids"][i, : int(n)] for i, n in enumerate(real)]
        for i, row in zip(indices, rows):
            seen[i] = row.tolist()
    chunks = loader.dataset.chunks
    for d in range(len(docs)):
        pieces = [seen[i] for i in np.flatnonzero(chunks.doc == d)]
        assert [t for piece in pieces for t in piece] == docs[d].tolist()


def test_sampler_resume_is_exact() -> None:
    config = BatchingConfig(max_tokens=2048, max_len=512, order="shuffled")
    reference = TokenBudgetSampler(LENGTHS, config, seed=9)
    per_epoch = len(reference)
    expected = [b for _ in range(3) for b in reference]  # three uninterrupted epochs
    for k in (0, 5, per_epoch - 1, per_epoch, per_epoch + 7):
        first = TokenBudgetSampler(LENGTHS, config, seed=9)
        got = []
        while len(got) < k:
            it = iter(first)
            got += [b for _, b in zip(range(k - len(got)), it)]
        state = first.state_dict()
        resumed = TokenBudgetSampler(LENGTHS, config, seed=9)
        resumed.load_state_dict(state)
        resumed.set_epoch(state["epoch"])  # what Lightning does at the start of the restored epoch
        while len(got) < len(expected):
            got += list(resumed)
        assert got == expected, f"resume after {k} batches"


def test_sampler_epochs_groups_and_errors() -> None:
    config = BatchingConfig(max_tokens=2048, max_len=512, order="shuffled")
    sampler = TokenBudgetSampler(LENGTHS, config, seed=1)
    sampler.set_epoch(2)
    assert list(sampler) == plan_batches(LENGTHS, config, seed=1, epoch=2) and sampler.epoch == 3
    plan = plan_batches(LENGTHS, config, seed=1, epoch=0)
    groups = [list(TokenBudgetSampler(LENGTHS, config, seed=1, num_groups=3, group_index=g)) for g in range(3)]
    assert len({len(g) for g in groups}) == 1 and len(groups[0]) == len(plan) // 3
    assert groups[1][:2] == [plan[1], plan[4]]
    other = TokenBudgetSampler(LENGTHS, config, seed=2)
    with pytest.raises(ValueError, match=r"saved for another plan .* the seed or the number of groups changed"):
        other.load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="invalid position"):
        sampler.load_state_dict({"epoch": 0, "next_batch": 10**6})
    with pytest.raises(ValueError, match="group_index < num_groups"):
        TokenBudgetSampler(LENGTHS, config, num_groups=2, group_index=2)


def test_attention_aware_budget_balances_compute() -> None:
    """``attention_len``: packed batches are filled by tokens plus quadratic attention (Hydraulis-style)."""
    from lightning_paradyse.cost.dims import dims_from_config
    from lightning_paradyse.data.length_traces import length_trace
    from lightning_paradyse.groups import attention_crossover
    from lightning_paradyse.models import CONFIGS

    crossover = attention_crossover(dims_from_config(CONFIGS["llama-tiny"], 1))
    assert 64 <= crossover <= 4096  # attention overtakes the projections at a few hundred tokens for h = 96
    lengths = np.array(length_trace("github", 600, 2048, seed=1, min_len=8))
    plain = BatchingConfig(max_tokens=4096, max_len=2048, pack=True, order="shuffled")
    aware = BatchingConfig(max_tokens=4096 * 3, max_len=2048, pack=True, order="shuffled", attention_len=crossover)
    for config in (plain, aware):
        batches = plan_batches(lengths, config, seed=3)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # every chunk once
        assert all(sum(config.weight(int(lengths[i])) for i in b) <= config.max_tokens or len(b) == 1 for b in batches)

    def spread(config: BatchingConfig) -> float:  # max / mean of the batches' compute (tokens + attention)
        work = [sum(aware.weight(int(lengths[i])) for i in b) for b in plan_batches(lengths, config, seed=3)[:-1]]
        return max(work) / (sum(work) / len(work))

    assert spread(aware) < spread(plain)
    with pytest.raises(ValueError, match="attention_len"):
        BatchingConfig(max_tokens=4096, max_len=2048, pack=False, attention_len=crossover)
    with pytest.raises(ValueError, match="raise max_tokens or attention_len"):
        BatchingConfig(max_tokens=2100, max_len=2048, pack=True, attention_len=64)
