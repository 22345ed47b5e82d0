"""Hugging Face gradient checkpointing under the strategy (``lightning_paradyse.runtime.hf_checkpointing``), in process.

The training itself (exact against one plain Lightning process with HF's own checkpointing, through the
strategy's spawn launcher and inside a spawned job, every layer and every other layer) is in ``tests/exact``.
"""

from __future__ import annotations

import functools
import pickle

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from lightning_paradyse.modes.plan import parse_plan
from lightning_paradyse.runtime.hf_checkpointing import (
    checkpointed_layers,
    inputs_require_grad,
    prepare_for_launch,
    run_directly,
    with_recompute,
)
from tests.support.families import hf_llama

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing_(en|dis)able` is deprecated:FutureWarning")

LAYERS = ["model.layers.0", "model.layers.1", "model.layers.2"]


def checkpointed_llama(**kwargs: object) -> nn.Module:
    model = hf_llama(n_layers=3)
    model.gradient_checkpointing_enable(**kwargs)
    return model


def test_prepare_for_launch_makes_the_model_picklable_and_keeps_the_hook() -> None:
    model = checkpointed_llama()
    with pytest.raises(AttributeError, match="make_inputs_require_grads"):
        pickle.dumps(model)  # the spawn launcher's error before the fix
    hooks = model.model.embed_tokens._forward_hooks
    keys = list(hooks)
    prepare_for_launch(model)
    assert list(hooks) == keys and list(hooks.values()) == [inputs_require_grad]
    copy = pickle.loads(pickle.dumps(model))
    assert copy.model.embed_tokens(torch.tensor([[1, 2]])).requires_grad  # the hook still does its work
    assert copy.model.layers[0].gradient_checkpointing  # the launching process's model keeps HF's checkpointing
    model.disable_input_require_grads()  # HF removes it by its handle
    assert not hooks


def test_every_layer_is_recomputed_and_no_longer_wrapped_by_hf() -> None:
    model = checkpointed_llama()
    assert checkpointed_layers(model, LAYERS) == (0, 1, 2)
    assert all(layer._gradient_checkpointing_func is run_directly for layer in model.model.layers)
    assert model.model._gradient_checkpointing_func is run_directly  # the enclosing model (its flag is unused)
    assert checkpointed_layers(model, LAYERS) == (0, 1, 2)  # read again before every batch: the same
    model.gradient_checkpointing_disable()
    assert checkpointed_layers(model, LAYERS) == ()


def test_every_other_layer_and_the_forward_of_a_layer_run_directly() -> None:
    model = checkpointed_llama(every_n_layers=2, gradient_checkpointing_kwargs={"use_reentrant": True})
    assert checkpointed_layers(model, LAYERS) == (0, 2)
    model.train()
    ids = torch.tensor([[3, 4, 5, 6]])
    model(input_ids=ids, labels=ids).loss.backward()  # the layers run without a checkpoint around them
    assert all(p.grad is not None for p in model.parameters())


def test_an_enclosing_module_that_checkpoints_its_blocks_counts_for_every_block() -> None:
    """Older transformers: the model checkpoints each layer call itself; the layers carry no flag."""
    model = nn.Module()
    model.gradient_checkpointing = True
    model._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    model.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    assert checkpointed_layers(model, ["layers.0", "layers.1"]) == (0, 1)
    assert model._gradient_checkpointing_func is run_directly


def test_with_recompute_sets_both_ops_of_the_named_layers() -> None:
    plan = parse_plan(["tp_sp", {"attention": "ring", "mlp": "metp"}, "ulysses"], 3)
    assert with_recompute(plan, ()) is plan
    forced = with_recompute(plan, (0, 2))
    assert str(forced.layers[0]) == "tp_sp+rc,tp_sp+rc" and str(forced.layers[2]) == "ulysses+rc,ulysses+rc"
    assert forced.layers[1] == plan.layers[1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"offload": True}, r"with offload=True: the saved activations go to host memory"),
        ({"gradient_checkpointing_kwargs": {"preserve_rng_state": False}}, r"preserve_rng_state=False: the plan"),
        ({"gradient_checkpointing_kwargs": {"context_fn": dict}}, r"context_fn=.*does not apply it"),
    ],
)
def test_what_the_plan_cannot_stand_for_is_refused_with_the_fix(kwargs: dict[str, object], match: str) -> None:
    model = checkpointed_llama(**kwargs)
    fix = "Call model.gradient_checkpointing_enable\\(\\) with default arguments"
    with pytest.raises(ValueError, match=rf"model.layers.0 \(LlamaDecoderLayer\) is set for .*{match}.*{fix}"):
        checkpointed_layers(model, LAYERS)
    with pytest.raises(ValueError, match=rf"model.layers.0 .*{match}"):  # in the launching process, before pickling
        prepare_for_launch(model)


def test_a_checkpoint_function_of_ones_own_is_refused() -> None:
    model = hf_llama(n_layers=3)
    model.model.layers[1].gradient_checkpointing = True
    model.model.layers[1]._gradient_checkpointing_func = lambda f, *a: f(*a)
    with pytest.raises(ValueError, match=r"model.layers.1 .* its own checkpoint function .*<lambda>"):
        checkpointed_layers(model, LAYERS)
