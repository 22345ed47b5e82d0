"""Hugging Face outputs beside the logits (``lightning_paradyse.runtime.hf_outputs``): a model whose class lost its
recorded outputs (as one unpickled in a spawned worker: transformers fills its registry in ``__init__``) returns its
hidden states again once registered; asking for the attention weights is refused. The launched path end to end:
``tests/exact`` case ``hf-hidden-states-launched``."""

from __future__ import annotations

import pytest
import torch

from lightning_paradyse.runtime.hf_outputs import refuse_attention_weights, register_output_capture
from tests.support.families import hf_llama

transformers = pytest.importorskip("transformers")


def test_hidden_states_come_back_once_the_model_is_registered() -> None:
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    model = hf_llama()
    ids = torch.randint(5, 100, (1, 9))
    key = str(model.model.__class__)
    kept = dict(_CAN_RECORD_REGISTRY)
    try:
        for name in [k for k in _CAN_RECORD_REGISTRY if "llama" in k.lower()]:
            del _CAN_RECORD_REGISTRY[name]  # as in a spawned worker: the model unpickled, no __init__ run
        assert model(input_ids=ids, output_hidden_states=True).hidden_states is None
        register_output_capture(model)
        assert key in _CAN_RECORD_REGISTRY
        assert len(model(input_ids=ids, output_hidden_states=True).hidden_states) == 3  # embeddings + 2 layers
    finally:
        _CAN_RECORD_REGISTRY.clear()
        _CAN_RECORD_REGISTRY.update(kept)


def test_asking_for_the_attention_weights_is_refused() -> None:
    model = hf_llama()
    model.register_forward_pre_hook(refuse_attention_weights, with_kwargs=True)
    ids = torch.randint(5, 100, (1, 9))
    model(input_ids=ids)
    with pytest.raises(ValueError, match=r"output_attentions=True: the attention weights .* are not returned"):
        model(input_ids=ids, output_attentions=True)
    model.set_attn_implementation("eager")  # the only attention that returns its weights
    model.config.output_attentions = True
    with pytest.raises(ValueError, match="LlamaForCausalLM called with output_attentions=True"):
        model(input_ids=ids)
    model(input_ids=ids, output_attentions=False)
