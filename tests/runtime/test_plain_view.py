"""The plain structure seen again on a parallelised model (``runtime/plain_view.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_paradyse.models import build_model
from lightning_paradyse.runtime.parallel import parallelize
from lightning_paradyse.runtime.plain_view import plain_view
from tests.support.families import hf_family, hf_llama


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


@pytest.mark.parametrize("name", MODELS)
def test_the_view_shows_the_plain_structure_and_puts_the_rewrite_back(name: str) -> None:
    model = MODELS[name]().double()
    for p in model.parameters():  # a frozen parameter keeps its flag in the view
        p.requires_grad_(False)
        break
    plain, plain_params = _structure(model), dict(model.named_parameters())  # kept alive: ids not reused
    parallelize(model, None)
    rewritten = _structure(model)
    assert rewritten != plain
    held = {id(p) for p in model.parameters()}
    with plain_view(model, torch.device("cpu")) as view:
        kept = {n for n, p in view.named_parameters() if id(p) in held}
        assert any("q_norm" in n for n in kept) == (name == "hf-qwen3")
        assert _structure(view) == plain  # names, module types, shapes, dtypes, flags
        for name, p in view.named_parameters():  # what the rewrite kept is the model's own parameter
            assert (id(p) in held) == (id(plain_params[name]) in held)
            assert id(p) in held or p.untyped_storage().nbytes() == p.element_size()  # a stand-in holds one element
    assert _structure(model) == rewritten
    assert {id(p) for p in model.parameters()} == held


def test_a_model_never_parallelised_is_its_own_view() -> None:
    model = nn.Linear(2, 2)
    with plain_view(model, torch.device("cpu")) as view:
        assert view is model
