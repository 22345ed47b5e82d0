"""Positions Hugging Face models derive themselves, and the refusals of what the rewrite cannot read.

The float64 runs against one process are the ``tests/exact`` cases ``hf-roberta-mlm`` and ``hf-flattened*``."""

from __future__ import annotations

import pytest
import torch
import transformers

from lightning_paradyse.runtime.hf_positions import (
    own_positions,
    packed_documents,
    same_documents,
    watch_packing,
)
from lightning_paradyse.runtime.parallel import parallelize
from lightning_paradyse.runtime.slicing import find_tokens

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)


def test_documents_start_where_a_position_is_not_the_one_before_plus_one() -> None:
    flat = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])  # DataCollatorWithFlattening: 3 documents
    assert packed_documents(flat).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    assert packed_documents(torch.tensor([5, 6, 7, 2, 3])).tolist() == [[0, 0, 0, 1, 1]]  # [s]; a row may start at 5
    assert packed_documents(torch.arange(6)[None].expand(2, -1)) is None  # one document a row: none
    two = packed_documents(torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]]))
    assert two is not None and two.tolist() == [[0, 0, 0, 0], [0, 0, 1, 1]]
    assert same_documents(torch.tensor([0, 0, 1, 1, 2]), torch.tensor([7, 7, 3, 3, 9]))
    assert not same_documents(torch.tensor([0, 0, 1, 1, 2]), torch.tensor([0, 1, 1, 1, 2]))


def test_roberta_numbers_its_tokens_from_their_ids_and_llama_does_not() -> None:
    config = transformers.RobertaConfig(**TINY, pad_token_id=1, max_position_embeddings=64)
    numbering = own_positions(transformers.RobertaModel(config))
    assert numbering is not None and numbering.embeds_start == 2
    ids = torch.tensor([[5, 1, 7, 8], [1, 1, 9, 3]])  # 1: the padding id
    assert numbering.of_ids(ids).tolist() == [[2, 1, 3, 4], [1, 1, 2, 3]]  # padding_idx + running count
    assert own_positions(transformers.LlamaModel(transformers.LlamaConfig(**TINY))) is None


def _asks_for_documents(model: torch.nn.Module, **call: object) -> bool:
    """Whether a call of ``model`` with restarting ``position_ids`` has transformers' masks ask for packed documents
    (what the strategy follows: it does not guess from the model's class or configuration)."""
    asked: list[bool] = []
    stop = watch_packing(lambda position_ids: asked.append(position_ids is not None))
    try:
        ids = torch.randint(3, 60, (1, 9))
        with torch.no_grad():
            model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]), **call)
    finally:
        stop()
    return bool(asked)


def test_the_masks_ask_for_packed_documents_only_where_one_process_keeps_them_apart() -> None:
    from transformers import masking_utils

    own = masking_utils.find_packed_sequence_indices
    llama = transformers.LlamaModel(transformers.LlamaConfig(**TINY, attn_implementation="sdpa")).eval()
    assert _asks_for_documents(llama, use_cache=False)
    assert not _asks_for_documents(llama, use_cache=True)  # a cache: the masks attend across the documents
    assert not _asks_for_documents(llama, use_cache=False, attention_mask=torch.ones(1, 9, dtype=torch.long))
    roberta = transformers.RobertaModel(transformers.RobertaConfig(**TINY, max_position_embeddings=64)).eval()
    assert not _asks_for_documents(roberta, use_cache=False)  # bidirectional: its masks never read the positions
    assert masking_utils.find_packed_sequence_indices is own  # transformers' own function back after each call


def test_blocks_the_rewrite_cannot_read_are_refused_naming_why_and_what_to_use() -> None:
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4))
    with pytest.raises(ValueError, match=r"attention-bias argument \('alibi'.*strategy='ddp'"):
        parallelize(bloom.double(), None)
    opt_config = transformers.OPTConfig(
        vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4, word_embed_proj_dim=32
    )
    opt = transformers.OPTForCausalLM(opt_config)
    with pytest.raises(ValueError, match=r"the block reshapes them, as OPT's flattens.*strategy='ddp'"):
        parallelize(opt.double(), None)


def test_a_batch_of_images_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"this batch is images \(pixel_values"):
        find_tokens({"pixel_values": torch.zeros(2, 3, 8, 8), "labels": torch.zeros(2, dtype=torch.long)})
    assert find_tokens({"input_ids": torch.zeros(2, 5), "pixel_values": torch.zeros(2, 3, 8, 8)}).shape == (2, 5)
