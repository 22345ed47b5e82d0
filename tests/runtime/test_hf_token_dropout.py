"""ESM's token dropout counted over the whole row (the float64 runs against one process are the ``tests/exact``
cases ``hf-esm-*``)."""

from __future__ import annotations

import pytest
import torch
import transformers

from lightning_paradyse.runtime.hf_token_dropout import dropped_embeddings, dropping_modules

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)


def _esm(**fields: object) -> transformers.EsmModel:
    config = transformers.EsmConfig(**TINY, pad_token_id=1, mask_token_id=4, token_dropout=True, **fields)
    return transformers.EsmModel(config).double()


def test_only_embeddings_that_drop_mask_tokens_are_found() -> None:
    esm = _esm(position_embedding_type="rotary")
    assert dropping_modules(esm) == [esm.embeddings]
    assert dropping_modules(transformers.BertModel(transformers.BertConfig(**TINY))) == []


@pytest.mark.parametrize("mask", [None, torch.long, torch.float64])
def test_each_slice_gets_the_share_of_its_whole_row(mask: torch.dtype | None) -> None:
    embeddings = _esm(position_embedding_type="rotary", emb_layer_norm_before=False).embeddings
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 64, (2, 12), generator=gen)
    ids[0, [1, 2, 9]] = 4  # mask tokens: 3 in the first row, 2 of them in its first half
    ids[1, 7] = 4
    attention = None if mask is None else torch.ones(ids.shape, dtype=mask)
    with torch.no_grad():
        whole = embeddings(input_ids=ids, attention_mask=attention, position_ids=torch.arange(12)[None])
        tokens = 12 if attention is None else attention.sum(-1)
        for cut in (slice(0, 6), slice(6, 12)):  # [2, 12] -> [2, 6]
            ours = dropped_embeddings(embeddings, ids[:, cut], ids, tokens)
            assert torch.equal(ours, whole[:, cut])  # bitwise: the same operations in the same dtypes
            mine = embeddings(input_ids=ids[:, cut], position_ids=torch.arange(6)[None])  # the slice's own share
            assert not torch.allclose(mine, whole[:, cut])
