"""Packed documents with document-aware attention equal running the documents separately, in every mode.

Several documents of different lengths are packed into one sequence (positions restart at every
document, targets never cross a boundary) and trained under every mode and mixed plans on 2 and 3
processes; the reference runs each document alone through the plain model. Loss and every gradient
must match within the mode-test tolerances, for a causal Llama, a causal GPT (learned positions) and
a bidirectional BERT.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.models import build_model
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan, random_plan
from lightning_paradyse.modes.specs import SeqContext, document_bounds
from lightning_paradyse.runtime.parallel import (
    configure,
    feasible_modes,
    is_causal,
    parallelize,
)
from lightning_paradyse.tools.mode_check import backward_and_compare, tolerance_failures
from tests.support.dist import run_distributed


def pack(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, targets, positions, doc_ids)`` of the packed sequence, each ``[s]``."""
    targets = [torch.cat([d[1:], torch.tensor([-100])]) for d in docs]  # no target across a boundary
    positions = [torch.arange(len(d)) for d in docs]
    ids = [torch.full((len(d),), i) for i, d in enumerate(docs)]
    return torch.cat(docs), torch.cat(targets), torch.cat(positions), torch.cat(ids)


def test_document_bounds() -> None:
    assert document_bounds(torch.tensor([0, 0, 1, 1, 1, 2]), 6) == [(0, 2), (2, 5), (5, 6)]
    assert document_bounds(None, 4) == [(0, 4)]
    with pytest.raises(ValueError, match="contiguous"):
        document_bounds(torch.tensor([0, 1, 0]), 3)


def _plans(model: torch.nn.Module, p: int) -> list[Plan]:
    feasible = feasible_modes(model, p, list(MODES))
    plans = [
        Plan(tuple(LayerPlan(OpPlan(m), OpPlan(m)) for _ in feasible))
        for m in MODES
        if all(m in a and m in b for a, b in feasible)
    ]
    mixed = random_plan(len(feasible), list(MODES), seed=p)
    plans.append(
        Plan(
            tuple(
                LayerPlan(
                    layer.attention if layer.attention.mode in a else OpPlan(a[0], layer.attention.recompute),
                    layer.mlp if layer.mlp.mode in b else OpPlan(b[0], layer.mlp.recompute),
                )
                for layer, (a, b) in zip(mixed.layers, feasible)
            )
        )
    )
    return plans


def _case(rank: int, world: int, name: str, lengths: list[int]) -> list[tuple[str, Any]]:
    group = dist.group.WORLD
    torch.manual_seed(len(lengths) + world)
    plain = build_model(name)
    docs = [torch.randint(0, 128, (n,)) for n in lengths]
    tokens, targets, positions, doc_ids = pack(docs)
    count = int((targets != -100).sum())
    reference = copy.deepcopy(plain)
    ref_loss = (
        sum(  # every document alone, from position 0
            F.cross_entropy(reference(d[None], torch.arange(len(d)))[0, :-1], d[1:], reduction="sum") for d in docs
        )
        / count
    )
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    template = copy.deepcopy(plain)
    parallelize(template, group)
    out = []
    for plan in _plans(template, world):
        model = copy.deepcopy(template)
        layout = SeqLayout.for_sequence(len(tokens), world, is_causal(model))
        configure(model, SeqContext(layout, group, doc_ids), plan)
        logits = model(layout.shard(tokens[None], rank), layout.shard(positions, rank, dim=0))
        loss = F.cross_entropy(logits[0], layout.shard(targets, rank, dim=0), reduction="sum") / count
        out.append((f"{name}/{plan}", backward_and_compare(model, loss, group, ref_loss, ref_grads)))
    return out


def _worker(rank: int, world: int) -> list[tuple[str, Any]]:
    cases = [("llama-tiny-mha", [9, 17, 4, 13]), ("gpt-tiny", [21, 6, 11]), ("bert-tiny", [5, 14, 19, 3])]
    return [item for name, lengths in cases for item in _case(rank, world, name, lengths)]


@pytest.mark.parametrize("p", [2, 3])
def test_packed_documents_match_separate_runs(p: int) -> None:
    results = run_distributed(_worker, p, timeout=300)[0]
    assert len(results) >= 3 * 5
    bad = tolerance_failures(results, torch.float32)
    assert not bad, "\n".join(bad)
