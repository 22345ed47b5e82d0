"""The plain structure seen again on a parallelised model (``runtime/plain_view.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_paradyse.models import build_model
from lightning_paradyse.runtime.checkpoint import PlainModel, plain_targets
from lightning_paradyse.runtime.parallel import parallelize, step_state
from lightning_paradyse.runtime.plain_view import plain_view
from tests.support.families import hf_family, hf_llama

META = torch.device("meta")


def _structure(model: nn.Module) -> list[tuple[str, str, tuple[int, ...], torch.dtype, bool]]:
    """Each parameter's name, the type of the module holding it, its shape, dtype and ``requires_grad``."""
    out = []
    for name, module in model.named_modules():
        for key, p in module.named_parameters(recurse=False):
            out.append((f"{name}.{key}".lstrip("."), type(module).__name__, tuple(p.shape), p.dtype, p.requires_grad))
    return out


def _hf(family: str) -> nn.Module:
    pytest.importorskip("transformers")
    return hf_llama(n_layers=2) if family == "llama" else hf_family(family)


MODELS = {
    "llama-tiny": lambda: build_model("llama-tiny"),
    "gpt-tiny": lambda: build_model("gpt-tiny"),
    "hf-llama": lambda: _hf("llama"),
    "hf-qwen3": lambda: _hf("qwen3"),  # q/k norms the attention dispatch adopts: the model's own in the view
}


def _parallelized(model: nn.Module) -> PlainModel:
    plain = PlainModel.record(model)
    parallelize(model, None)
    return plain


def _current(model: nn.Module, plain: PlainModel) -> dict[str, torch.Tensor]:
    targets = plain_targets(model, plain)
    return {targets[n][0]: p for n, p in model.named_parameters()}


@pytest.mark.parametrize("device", [META, torch.device("cpu")])
@pytest.mark.parametrize("name", MODELS)
def test_the_view_shows_the_plain_structure_and_puts_the_rewrite_back(name: str, device: torch.device) -> None:
    model = MODELS[name]().double()
    for p in model.parameters():  # a frozen parameter keeps its flag in the view
        p.requires_grad_(False)
        break
    structure, plain_params = _structure(model), dict(model.named_parameters())  # kept alive: ids not reused
    plain = _parallelized(model)
    rewritten, held = _structure(model), {id(p) for p in model.parameters()}
    assert rewritten != structure
    with plain_view(model, step_state(model).plain_parts, device, _current(model, plain)) as view:
        kept = {n for n, p in view.named_parameters() if id(p) in held}
        assert any("q_norm" in n for n in kept) == (name == "hf-qwen3")
        assert _structure(view) == structure  # names, module types, shapes, dtypes, flags
        for n, p in view.named_parameters():  # what the rewrite kept is the model's own parameter
            assert (id(p) in held) == (id(plain_params[n]) in held)
            if id(p) not in held:  # a stand-in: no memory on meta, one element elsewhere
                assert p.device == device and p.untyped_storage().nbytes() in (0, p.element_size())
    assert _structure(model) == rewritten
    assert {id(p) for p in model.parameters()} == held


def test_stand_ins_follow_the_shards_frozen_or_cast_since_the_rewrite() -> None:
    model = build_model("llama-tiny")
    plain = _parallelized(model)
    model.double()
    for p in model.parameters():
        p.requires_grad_(False)
    with plain_view(model, step_state(model).plain_parts, META, _current(model, plain)) as view:
        assert {(p.dtype, p.requires_grad) for p in view.parameters()} == {(torch.float64, False)}


def test_a_deep_copy_carries_its_own_view() -> None:
    model = build_model("llama-tiny")
    structure = _structure(model)
    plain = _parallelized(model)
    twin = copy.deepcopy(model)
    held = {id(p) for p in twin.parameters()}
    with plain_view(twin, step_state(twin).plain_parts, META, _current(twin, plain)) as view:
        assert _structure(view) == structure
        assert not {id(p) for p in view.parameters()} & {id(p) for p in model.parameters()}  # none of the original's
        assert {id(p) for p in view.parameters()} & held  # its own embeddings, norms, head


def test_skeletons_share_attributes_and_carry_no_hooks() -> None:
    """A skeleton copies no tensor, hook or reference (a hook bound to a large module kept a copy of it per block)."""
    model = build_model("llama-tiny")
    attn = model.layers[0].attn
    attn.scale_table = torch.ones(1000)  # a tensor attribute that is no buffer
    attn.register_forward_hook(lambda *args: None)
    _parallelized(model)
    part = step_state(model).plain_parts["layers.0.attn"]
    assert part.scale_table is attn.scale_table or part.scale_table.data_ptr() == attn.scale_table.data_ptr()
    assert not part._forward_hooks


def test_a_model_never_parallelised_has_no_parts() -> None:
    model = nn.Linear(2, 2)
    with plain_view(model, {}, META, {}) as view:
        assert view is model
