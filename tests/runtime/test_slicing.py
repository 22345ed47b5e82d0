"""Batch slicing on one process: the batch digest, padding rules, the filler target, label shifting, sources."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from lightning_paradyse.runtime.slicing import (
    IGNORE_INDEX,
    checksum,
    describe_batch,
    find_padding,
    find_tokens,
    shard_batch,
    shifted_labels,
)


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 12), generator=gen)
    return {"input_ids": ids, "targets": torch.roll(ids, -1, dims=1)}


def test_checksum_sees_every_byte_row_order_and_targets() -> None:
    batch = _batch()
    base = checksum(batch)
    assert checksum({k: v.clone() for k, v in batch.items()}) == base
    swapped = {k: v.flip(0) for k, v in batch.items()}  # the same rows in another order
    assert checksum(swapped) != base
    ids = batch["input_ids"].clone()
    ids[0, 2], ids[0, 3] = ids[0, 2] + 1, ids[0, 3] - 1  # a two-token change with an equal sum
    assert checksum({**batch, "input_ids": ids}) != base
    targets = batch["targets"].clone()
    targets[1, -1] = IGNORE_INDEX  # only the targets differ
    assert checksum({**batch, "targets": targets}) != base
    assert checksum({**batch, "note": "a"}) != checksum({**batch, "note": "b"})


def test_right_padding_on_causal_is_kept_left_inner_or_bidirectional_refused() -> None:
    mask = torch.ones(2, 6, dtype=torch.long)
    assert find_padding({"attention_mask": mask}, 2, 6, causal=True) is None
    right = mask.clone()
    right[1, 4:] = 0
    padding = find_padding({"attention_mask": right}, 2, 6, causal=True)
    assert padding is not None and padding.tolist()[1] == [False] * 4 + [True] * 2 and not padding[0].any()
    left = mask.clone()
    left[0, :2] = 0
    with pytest.raises(ValueError, match="left padding"):
        find_padding({"attention_mask": left}, 2, 6, causal=True)
    inner = mask.clone()
    inner[0, 3] = 0
    with pytest.raises(ValueError, match="left padding"):
        find_padding({"attention_mask": inner}, 2, 6, causal=True)
    with pytest.raises(ValueError, match="both directions"):
        find_padding({"attention_mask": right}, 2, 6, causal=False)


def test_padding_with_real_targets_is_refused() -> None:
    batch = _batch()
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 9:] = 0
    with pytest.raises(ValueError, match="set the targets of padding to -100"):
        describe_batch({**batch, "attention_mask": mask}, 2, 0, causal=True)
    targets = batch["targets"].clone()
    targets[0, 9:] = IGNORE_INDEX
    info = describe_batch({**batch, "targets": targets, "attention_mask": mask}, 2, 0, causal=True)
    assert info.padding is not None and int(info.padding.sum()) == 3


def test_a_rank_with_only_prompt_gets_one_filler_target_under_a_mean_loss() -> None:
    batch = _batch()
    targets = batch["targets"].clone()
    targets[:, :8] = IGNORE_INDEX  # the prompt covers rank 0's half (bidirectional layout: contiguous halves)
    batch = {**batch, "targets": targets}
    infos = [describe_batch(batch, 2, r, causal=False) for r in (0, 1)]
    empty = [r for r, info in enumerate(infos) if info.n_local == 0]
    assert empty == [0] and infos[0].fill_target and not infos[1].fill_target
    local, sources = shard_batch(batch, infos[0], 0)
    assert int((local["targets"] != IGNORE_INDEX).sum()) == 1 and int(local["targets"].view(-1)[0]) == 0
    assert sources[0].key == "targets" and sources[0].local is local["targets"]  # targets first, the filled slice
    assert not describe_batch(batch, 2, 0, causal=False, mean_loss=False).fill_target  # a sum needs no filler


def test_namedtuple_batches_stay_namedtuples_with_every_slice_as_a_source() -> None:
    Pair = namedtuple("Pair", ["tokens", "targets"])
    ids = _batch()["input_ids"]
    batch = Pair(ids, torch.roll(ids, -1, dims=1))
    info = describe_batch(batch, 2, 1, causal=True)
    local, sources = shard_batch(batch, info, 1)
    assert isinstance(local, Pair) and local.tokens.shape == (2, info.layout.local_lens[1])
    # the targets (a sequence's last tensor) first, as a dict's: labels traced by their values try them first
    assert [s.key for s in sources] == ["#1", "#0"] and all(s.whole.shape == (2, 12) for s in sources)


def test_shifted_labels_end_with_an_ignored_position() -> None:
    labels = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert shifted_labels(labels).tolist() == [[2, 3, IGNORE_INDEX], [5, 6, IGNORE_INDEX]]


def test_tokens_in_a_nested_dict_name_the_fix() -> None:
    """A dict batch whose tokens sit in a nested dict (``{"inputs": {"input_ids": ...}, "targets": ...}``) is refused
    naming the fix (probe 17: it was refused as a call on another length, naming CombinedLoader)."""
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(TypeError, match=r"'inputs' holds 'input_ids' in a nested dict.*batch's top level"):
        find_tokens({"inputs": {"input_ids": ids}, "targets": ids})
    assert find_tokens({"input_ids": ids, "extra": {"input_ids": ids[:, :2]}}) is ids  # the top level's first


def test_negative_targets_other_than_minus_100_are_refused() -> None:
    """-1 (nanoGPT's ignore_index) marks positions a step leaves out by its own rule, which the strategy would count
    as real targets: refused naming -100; -100 and float targets are left alone."""
    batch = _batch()
    batch["targets"][0, -2:] = -1
    with pytest.raises(ValueError, match=r"'targets' hold -1: .*targets\[targets == -1\] = -100"):
        describe_batch(batch, 2, 0, causal=True)
    batch["targets"][0, -2:] = -100
    assert describe_batch(batch, 2, 0, causal=True).n_global == 22
    assert describe_batch({**batch, "targets": torch.full((2, 12), -0.5)}, 2, 0, causal=True).n_global == 24
