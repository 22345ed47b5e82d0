"""What a model is called with at run time, checked by the hooks
:func:`~lightning_paradyse.runtime.parallel.parallelize`
installs: an input that would change the attention is honoured or refused, never ignored."""

from __future__ import annotations

import pytest
import torch

from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.models import build_model
from lightning_paradyse.modes.plan import uniform_plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime.parallel import configure, parallelize, set_step_sources, shifts_labels
from lightning_paradyse.runtime.slicing import BatchSource
from tests.support.families import hf_llama

pytest.importorskip("transformers")

IDS = torch.arange(1, 9)[None]  # [1, 8]


def _configured(padding: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.nn.Module:
    model = hf_llama(n_layers=1)
    parallelize(model, None)
    configure(model, SeqContext(SeqLayout(IDS.shape[1], 1), None), uniform_plan("tp_sp", 1))
    sources = [BatchSource("input_ids", IDS, IDS)]
    if mask is not None:
        sources.append(BatchSource("attention_mask", mask, mask))
    set_step_sources(model, tuple(sources), padding)
    return model


@pytest.mark.parametrize(
    ("kind", "mask"),
    [
        ("4D", torch.zeros(1, 1, 8, 8)),
        ("dict", {"full_attention": torch.zeros(1, 1, 8, 8)}),
        ("2D not the batch's", torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])),
        ("2D not the batch's", torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])),
    ],
)
def test_attention_masks_the_modes_would_not_apply_are_refused(kind: str, mask: object) -> None:
    model = _configured()
    with pytest.raises(ValueError, match=r"attention_mask= a .*the parallel modes apply the attention pattern"):
        model(input_ids=IDS, attention_mask=mask)


def test_attention_masks_the_modes_honour_pass() -> None:
    """All ones, or the batch's own right padding of a causal model (validated by the strategy)."""
    _configured()(input_ids=IDS, attention_mask=torch.ones_like(IDS))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    _configured(padding=~mask.bool(), mask=mask)(input_ids=IDS, attention_mask=mask)


def test_only_a_model_that_shifts_its_labels_asks_for_them_shifted_over_the_batch() -> None:
    """A Hugging Face causal LM shifts the ``labels`` it is given: a step cut from a larger batch must hand it labels
    shifted over that batch. A model that takes targets as they are needs no shifting (nothing is computed for it)."""
    causal = hf_llama(n_layers=1)
    parallelize(causal, None)
    plain = build_model("llama-tiny")
    parallelize(plain, None)
    assert shifts_labels(causal) and not shifts_labels(plain)


def test_a_parametrized_projection_in_a_block_is_refused_by_name() -> None:
    """``weight_norm`` on a block's projection: refused before any block is rewritten, naming it (a crash inside the
    rewrite until 2026-12-02, probe 19); on the head, outside the blocks, the model is parallelized."""
    from lightning_paradyse.models import CONFIGS

    model = build_model(CONFIGS["llama-tiny"])
    torch.nn.utils.parametrizations.weight_norm(model.layers[1].mlp.gate)
    with pytest.raises(
        ValueError, match=r"layers\.1\.mlp\.gate is parametrized .*weight_norm.*Remove it from the blocks"
    ):
        parallelize(model, None)
    assert not any("dispatch" in type(m).__name__.lower() for m in model.modules())  # nothing rewritten
    head = build_model(CONFIGS["llama-tiny"])
    torch.nn.utils.parametrizations.weight_norm(head.lm_head)
    parallelize(head, None)
