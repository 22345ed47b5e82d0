"""The plain model's parameter names while ``configure_optimizers`` runs (the Lightning path is an exact case,
``named-groups``, in :mod:`tests.exact.cases`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_paradyse.models import build_model
from lightning_paradyse.runtime import parallel
from lightning_paradyse.runtime.checkpoint import PlainModel, consolidate_optimizer_state
from lightning_paradyse.runtime.plain_names import plain_named_parameters, plain_parameter_names


def _twin(plain: nn.Module) -> tuple[nn.Module, PlainModel]:
    twin = copy.deepcopy(plain)
    record = PlainModel.record(twin)
    parallel.parallelize(twin, None)
    return twin, record


def test_each_shard_is_named_as_its_plain_parameter() -> None:
    plain = build_model("llama-tiny")
    twin, record = _twin(plain)
    names = [n for n, _ in plain.named_parameters()]
    assert any(n not in names for n, _ in twin.named_parameters()), "the rewrite renames parameters"
    with plain_named_parameters(twin, record):
        shown = [n for n, _ in twin.named_parameters()]
        layer = [n for n, _ in twin.layers[0].named_parameters(prefix="block")]
    assert sorted(shown) == sorted(names)
    assert sorted(layer) == sorted(f"block.{n[len('layers.0.') :]}" for n in names if n.startswith("layers.0."))
    assert [n for n, _ in twin.named_parameters()] != shown  # the rewritten names again after the block


def test_pieces_of_a_fused_parameter_keep_its_words_and_are_unique() -> None:
    pytest.importorskip("transformers")
    from tests.support.families import hf_family

    twin, record = _twin(hf_family("gpt2"))
    shown = plain_parameter_names(twin, record)
    pieces = sorted(n for n in shown.values() if ".h.0.attn.c_attn." in n)
    assert pieces == [f"transformer.h.0.attn.c_attn.{p}" for p in ("bk.bias", "bq.bias", "bv.bias")] + [
        f"transformer.h.0.attn.c_attn.{p}.weight" for p in ("k", "q", "v")
    ]
    assert len(set(shown.values())) == len(shown)


def test_an_optimizer_of_named_parameters_saves_the_plain_names() -> None:
    plain = build_model("llama-tiny").double()
    twin, record = _twin(plain)
    with plain_named_parameters(twin, record):
        optimizer = torch.optim.AdamW(twin.named_parameters())
    for w in twin.parameters():
        w.grad = torch.ones_like(w)
    optimizer.step()
    saved = consolidate_optimizer_state(optimizer, twin, record, None)
    assert saved["param_groups"][0]["param_names"] == [n for n, _ in plain.named_parameters()]
