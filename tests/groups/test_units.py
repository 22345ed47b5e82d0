"""The units of a batch (rows or documents), a group's batch cut out of it, and the group costs."""

from __future__ import annotations

import pytest
import torch

from lightning_paradyse.cost.dims import dims_from_config
from lightning_paradyse.groups import imbalance, packed_cost, rows_cost
from lightning_paradyse.groups.units import Units
from lightning_paradyse.models import CONFIGS
from lightning_paradyse.runtime.slicing import describe_batch, shifted_labels


def _ragged() -> dict[str, torch.Tensor]:
    ids = torch.arange(3 * 8).view(3, 8)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # 5 real tokens
    mask[2, 2:] = 0  # 2 real tokens
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "weights": torch.tensor([1.0, 2.0, 3.0])}


def test_rows_of_a_right_padded_batch_are_cut_to_the_groups_longest_row() -> None:
    batch = _ragged()
    units = Units.of(describe_batch(batch, 2, 0, causal=True))
    assert units is not None and not units.packed and units.lengths == (8, 5, 2)
    sub = units.cut(batch, [2, 1])
    assert units.length([2, 1]) == 5
    assert torch.equal(sub["input_ids"], batch["input_ids"][[2, 1], :5])
    assert torch.equal(sub["attention_mask"], batch["attention_mask"][[2, 1], :5])
    assert torch.equal(sub["weights"], torch.tensor([3.0, 2.0]))  # per-row tensors follow their rows
    listed = units.cut({**batch, "ids": ["a", "b", "c"], "pair": (0, 1, 2), "other": [1, 2]}, [2, 1])
    assert listed["ids"] == ["c", "b"] and listed["pair"] == (2, 1) and listed["other"] == [1, 2]  # per row: b long
    assert all(v.is_contiguous() for v in sub.values())
    shifts = units.shifted_sources(batch, [2, 1])
    whole = shifted_labels(batch["labels"])
    assert torch.equal(shifts["labels"][0], whole[[2, 1], :5]) and shifts["labels"][1] == int((whole != -100).sum())
    assert shifts["labels"][2] == int((batch["labels"] != -100).sum())


def test_rows_keep_their_padding_where_the_batch_holds_another_tensor_of_its_rows() -> None:
    """A second sequence padded otherwise (a preference pair's rejected answer), per-token weights or a per-row
    vector: no key says it is padded where the tokens are, so no row is cut (until 2026-12-01 the rejected answer's
    real tokens past the group's longest real row were dropped)."""
    batch = _ragged()
    for key, extra in (("rejected_ids", batch["input_ids"].flip(1)), ("w", torch.ones(3, 8)), ("x", torch.ones(3, 4))):
        units = Units.of(describe_batch(batch, 2, 0, causal=True), {**batch, key: extra})
        assert units is not None and units.lengths == (8, 8, 8)  # "x" names tokens, but the batch's are "input_ids"
        assert torch.equal(units.cut({**batch, key: extra}, [2, 1])[key], extra[[2, 1]])
    aligned = {**batch, "position_ids": torch.arange(8).expand(3, 8), "token_type_ids": torch.zeros(3, 8)}
    units = Units.of(describe_batch(batch, 2, 0, causal=True), aligned)
    assert units is not None and units.lengths == (8, 5, 2)


def test_a_tuple_or_tensor_batchs_labels_are_counted_over_the_whole_batch() -> None:
    batch = _ragged()
    units = Units.of(describe_batch(batch, 2, 0, causal=True))
    assert units is not None
    whole = shifted_labels(batch["labels"])
    pair = units.shifted_sources((batch["input_ids"], batch["labels"]), [2, 1])  # keyed as BatchSource keys them
    assert sorted(pair) == ["#0", "#1"] and pair["#1"][1] == int((whole != -100).sum())
    assert torch.equal(pair["#1"][0], whole[[2, 1], :5])
    alone = units.shifted_sources(batch["input_ids"], [0])  # the batch itself the tokens
    assert list(alone) == ["#0"] and alone["#0"][2] == 3 * 8


def test_one_row_is_one_unit_one_document_none_and_documents_are_cut_in_order() -> None:
    one = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    units = Units.of(describe_batch(one, 2, 0, causal=True))
    assert units is not None and units.lengths == (8,)  # it may run on fewer ranks than all, the others idle
    single = {"input_ids": torch.arange(8)[None], "doc_ids": torch.zeros(8, dtype=torch.long)}
    assert Units.of(describe_batch(single, 2, 0, causal=True)) is None
    doc_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    packed = {"input_ids": torch.arange(8)[None], "targets": torch.arange(8)[None], "doc_ids": doc_ids}
    units = Units.of(describe_batch(packed, 2, 0, causal=True))
    assert units is not None and units.packed and units.lengths == (3, 2, 3)
    sub = units.cut(packed, [2, 0])
    assert sub["input_ids"].tolist() == [[5, 6, 7, 0, 1, 2]] and sub["doc_ids"].tolist() == [2, 2, 2, 0, 0, 0]


def test_an_idle_group_gets_a_placeholder_of_a_token_a_rank_from_the_shortest_row() -> None:
    x = torch.arange(18).view(3, 6)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1] * 4 + [0, 0]])
    batch = {"input_ids": x, "targets": (x + 100).masked_fill(mask == 0, -100), "attention_mask": mask}
    units = Units.of(describe_batch(batch, 2, 0, causal=True))
    assert units is not None and units.lengths == (6, 3, 4) and units.shortest == 1
    idle = units.cut(batch, (), idle_tokens=2)
    assert idle["input_ids"].tolist() == [[6, 7]] and idle["targets"].tolist() == [[106, 107]]
    assert idle["attention_mask"].tolist() == [[1, 1]]
    with pytest.raises(ValueError, match="packed batch leaves no group idle"):
        packed = {"input_ids": torch.arange(8)[None], "doc_ids": torch.tensor([0, 0, 1, 1, 1, 1, 2, 2])}
        described = Units.of(describe_batch(packed, 2, 0, causal=True))
        assert described is not None
        described.cut(packed, ())


def test_group_costs_are_monotone_and_count_attention_per_unit() -> None:
    dims = dims_from_config(CONFIGS["llama-tiny"], 4)
    rows, packed = rows_cost(dims), packed_cost(dims)
    assert rows((100, 40), 1) == pytest.approx(2 * rows((100,), 1))  # a batch of the longest row
    assert rows((100, 40), 2) == pytest.approx(rows((100, 40), 1) / 2)
    assert rows((1,), 2) is None  # a group needs a token per rank
    assert packed((50, 50), 1) < packed((100,), 1)  # documents do not attend to each other
    assert imbalance([2.0, 1.0, 0.0]) == pytest.approx(2.0 / 1.5) and imbalance([]) == 1.0
