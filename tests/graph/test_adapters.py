"""PEFT layers as the rewrite reads them (``lightning_paradyse.graph.adapters``): a LoRA ``Linear`` is one projection
with its adapter, what the modes cannot compute is refused by name with the fix, and the stand-in switch follows
peft's ``disable_adapter()`` and refuses merging."""

from __future__ import annotations

import pytest
import torch.nn as nn

from lightning_paradyse.graph.adapters import base_layer, is_lora_linear, is_peft_layer, lora_parts, switch_for

peft = pytest.importorskip("peft")


def _adapted(**settings: object) -> nn.Module:
    holder = peft.get_peft_model(nn.Sequential(nn.Linear(6, 4)), peft.LoraConfig(r=2, target_modules=["0"], **settings))
    return holder.base_model.model[0]


def test_a_lora_linear_is_one_projection_with_its_adapter() -> None:
    layer = _adapted(lora_alpha=4)
    assert is_peft_layer(layer) and is_lora_linear(layer) and base_layer(layer) is layer.base_layer
    parts = lora_parts(layer)
    assert parts is not None and parts.adapter == "default" and parts.scale == 2.0
    assert parts.a.shape == (2, 6) and parts.b.shape == (4, 2)
    plain = nn.Linear(6, 4)
    assert lora_parts(plain) is None and base_layer(plain) is plain and not is_peft_layer(plain)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (dict(lora_dropout=0.05), "lora_dropout=0.0"),
        (dict(use_dora=True), "DoRA"),
        (dict(lora_bias=True), "lora_bias=False"),
    ],
)
def test_what_the_modes_cannot_compute_is_refused_with_the_fix(settings: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        lora_parts(_adapted(**settings))


def test_a_second_adapter_and_other_peft_methods_are_refused() -> None:
    model = peft.get_peft_model(nn.Sequential(nn.Linear(6, 4)), peft.LoraConfig(r=2, target_modules=["0"]))
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["0"]))
    with pytest.raises(ValueError, match="keep one adapter"):
        lora_parts(model.base_model.model[0])
    ia3 = peft.get_peft_model(
        nn.Sequential(nn.Linear(6, 4)), peft.IA3Config(target_modules=["0"], feedforward_modules=[])
    ).base_model.model[0]
    with pytest.raises(ValueError, match="of a kind the modes do not compute"):
        lora_parts(ia3)


def test_the_switch_follows_peft_and_refuses_merging() -> None:
    layer = _adapted()
    parts = lora_parts(layer)
    assert parts is not None
    switch = switch_for(layer, parts)
    assert switch.adapted and not list(switch.parameters())
    switch.enable_adapters(False)  # what model.disable_adapter() calls on every tuner layer it finds
    assert not switch.adapted
    switch.enable_adapters(True)
    assert switch.adapted
    with pytest.raises(ValueError, match="merge_and_unload"):
        switch.merge()


@pytest.mark.parametrize("kind", ["PromptTuningConfig", "PrefixTuningConfig"])
def test_prompt_learning_is_refused_at_the_setup(kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    from lightning_paradyse.runtime.parallel import parallelize

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, num_key_value_heads=2))
    config = getattr(peft, kind)(task_type="CAUSAL_LM", num_virtual_tokens=4)
    with pytest.raises(ValueError, match=r"PEFT prompt learning .* adapt the model with LoRA"):
        parallelize(peft.get_peft_model(model, config), None)
