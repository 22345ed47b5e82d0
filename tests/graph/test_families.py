"""Unmodified models of other families, rewritten automatically, against the single-process reference.

Hugging Face ``LlamaForCausalLM`` and ``GraniteForCausalLM`` (its own attention scale and multipliers)
trained with ``labels`` (the model shifts them inside, across the sequence chunks of the ranks: the
strategy passes the globally shifted labels and the global token
count through a forward hook) and models built from ``torch.nn.TransformerEncoderLayer`` (causal with
the model's own mask, and bidirectional). Every feasible uniform plan, with and without
recomputation, and random mixed per-layer, per-op plans; loss and every gradient (consolidated to
the plain model's names) within the mode-test tolerances, at p = 2, 3 and 4.

The Hugging Face families of :data:`~tests.support.families.HF_FAMILIES` (q/k norms, partial rotary, norms that
mix heads, sliding windows shorter than the sequence, per-layer rotary) in float64 at p = 2 and 3; the families
the rewrite does not reach yet are refused by name.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime.parallel import (
    configure,
    feasible_modes,
    is_causal,
    parallelize,
    set_step_sources,
    step_state,
)
from lightning_paradyse.runtime.slicing import BatchSource
from lightning_paradyse.tools.mode_check import TOLERANCES, backward_and_compare, tolerance_failures
from tests.support.dist import Together, run_distributed
from tests.support.families import (
    HF_FAMILIES,
    BertLM,
    EncoderLM,
    ListMoELM,
    ModernBertLM,
    hf_family,
    hf_granite,
    hf_llama,
)

pytest.importorskip("transformers")


def _plans(model: nn.Module, p: int, seed: int) -> list[tuple[str, Plan]]:
    feasible = feasible_modes(model, p, list(MODES))
    plans = []
    for mode in MODES:
        for rc in (False, True):
            if all(mode in a and mode in m for a, m in feasible):
                op = OpPlan(mode, rc)
                plans.append((f"{mode}{'+rc' if rc else ''}", Plan(tuple(LayerPlan(op, op) for _ in feasible))))
    gen = torch.Generator().manual_seed(seed)
    for k in range(2):
        layers = []
        for attn_ok, mlp_ok in feasible:
            pick = [int(torch.randint(0, len(ok), (1,), generator=gen)) for ok in (attn_ok, mlp_ok)]
            layers.append(LayerPlan(OpPlan(attn_ok[pick[0]], k == 1), OpPlan(mlp_ok[pick[1]], k == 0)))
        plans.append((f"mixed#{k}", Plan(tuple(layers))))
    return plans


DEVICE = torch.device(os.environ.get("PARADYSE_TEST_DEVICE", "cpu"))
"""Where the families run (``cuda``: ``benchmarks/gpu_check.py``, every rank on the one GPU over gloo)."""


def _is_hf(kind: str) -> bool:
    return kind in ("hf", "granite") or kind.removesuffix("-defaults") in HF_FAMILIES


def _loss(kind: str, model: nn.Module, ids: torch.Tensor, layout: SeqLayout | None, rank: int) -> torch.Tensor:
    """The model's loss: HF style with labels, or targets shifted in the data (sum / global count)."""
    if _is_hf(kind):
        if layout is None:
            return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]
        local = layout.shard(ids, rank)
        return model(input_ids=local, labels=local).loss  # type: ignore[no-any-return]
    tokens, targets = ids[:, :-1], ids[:, 1:]
    if layout is not None:
        tokens, targets = layout.shard(tokens, rank), layout.shard(targets, rank)
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / (ids.shape[1] - 1)


def _build(kind: str, p: int) -> nn.Module:
    if kind == "bert":
        return BertLM().double()
    if kind == "modernbert":
        return ModernBertLM().double()
    if kind == "list-moe":
        return ListMoELM().double()
    if kind.endswith("-defaults"):  # the kernels users get (grouped-GEMM experts: no float64), in float32
        return hf_family(kind.removesuffix("-defaults"), n_kv_heads=4, user_defaults=True)
    if kind in HF_FAMILIES:  # float64: rounding ~1e-15, so the 1e-9 tolerance separates a wrong op from noise
        return hf_family(kind, n_kv_heads=6 if p == 3 else 4).double()
    if kind == "hf":
        return hf_llama(n_kv_heads=12 if p == 3 else 4)
    if kind == "granite":
        return hf_granite(n_kv_heads=12 if p == 3 else 4)
    return EncoderLM(causal=kind == "tel-causal")


def _case(rank: int, world: int, kind: str, seq_len: int, seed: int) -> list[tuple[str, Any]]:
    group = dist.group.WORLD
    torch.manual_seed(seed)
    plain = _build(kind, world).to(DEVICE)
    ids = torch.randint(0, 128, (1, seq_len)).to(DEVICE)
    reference = copy.deepcopy(plain)
    ref_loss = _loss(kind, reference, ids, None, rank)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    template = copy.deepcopy(plain)
    parallelize(template, group)
    results = []
    for label, plan in _plans(template, world, seed):
        model = copy.deepcopy(template)
        length = seq_len if _is_hf(kind) else seq_len - 1
        layout = SeqLayout.for_sequence(length, world, is_causal(model))
        configure(model, SeqContext(layout, group), plan)
        if _is_hf(kind):  # the batch the step slices: labels are traced back and shifted globally
            set_step_sources(model, (BatchSource("input_ids", layout.shard(ids, rank), ids),))
        loss = _loss(kind, model, ids, layout, rank)
        assert not _is_hf(kind) or step_state(model).labels_consumed
        results.append((f"{kind}/{label}", backward_and_compare(model, loss, group, ref_loss, ref_grads)))
    return results


def _worker(rank: int, world: int) -> list[tuple[str, Any]]:
    out = []
    for i, kind in enumerate(("hf", "tel-causal", "tel", "granite")):
        out += _case(rank, world, kind, 8 * world + 3 + i, seed=world * 10 + i)
    return out


def _hf_worker(rank: int, world: int, kinds: list[str]) -> list[tuple[str, Any]]:
    out = []
    for i, kind in enumerate(kinds):
        out += _case(rank, world, kind, 8 * world + 3 + i, seed=world * 100 + i)
    return out


HF_CASES = {
    2: [*HF_FAMILIES, "bert", "modernbert", "list-moe"],
    3: [
        *("qwen3", "olmo2", "phi", "gemma3", "gemma2", "mistral", "phi3", "gpt2", "neox", "bert", "mixtral"),
        *("qwen3moe", "list-moe", "gptj", "codegen", "bigcode"),
    ],
}
"""Families per group size; at 3 the lengths are not divisible by the group (and there are 6 kv heads)."""


@pytest.fixture(scope="module")
def hf_jobs(request: pytest.FixtureRequest) -> Iterator[Together]:
    """The jobs of :func:`test_hugging_face_families_match_single_process_in_float64`, run side by side."""
    calls = {p: functools.partial(run_distributed, _hf_worker, p, cases, timeout=400) for p, cases in HF_CASES.items()}
    with Together.of(request, "test_hugging_face_families_match_single_process_in_float64", calls) as jobs:
        yield jobs


@pytest.mark.parametrize("p", sorted(HF_CASES))
def test_hugging_face_families_match_single_process_in_float64(p: int, hf_jobs: Together) -> None:
    """Loss and every gradient in float64 against one process, every feasible uniform plan and mixed plans.

    OLMo 2 and StableLM run code that mixes heads before the attention: their feasible modes exclude the
    head-splitting ones (checked here too)."""
    results = hf_jobs.result(p)[0]
    labels = {label.split("/")[0] for label, _ in results}
    assert labels == set(HF_CASES[p])
    for kind in ("olmo2", "stablelm"):
        modes = {label.split("/")[1] for label, _ in results if label.startswith(kind + "/")}
        assert kind not in labels or (not modes & {"tp_sp", "metp"} and {"ring", "ulysses"} <= modes)
    bad = []
    first: dict[str, dict[str, float]] = {}
    for label, (loss_err, errors) in results:
        kind = label.split("/")[0]
        grad_tol = FLOAT32_INSIDE.get(kind, TOLERANCES[torch.float64][1])
        if DEVICE.type == "cuda" and kind in FLOAT32_NORMS:
            grad_tol = FLOAT32_NORMS_ON_GPU
            alike = first.setdefault(kind, errors)  # the norms' rounding: the same in every mode
            moved = max(abs(errors[k] - alike[k]) for k in errors)
            if moved > TOLERANCES[torch.float64][1]:
                bad.append(f"{label}: its errors differ from the family's first mode's by {moved:.2e}")
        worst = max(errors, key=lambda k: errors[k])
        if loss_err > HF_LOSS_TOL or errors[worst] > grad_tol:
            bad.append(f"{label}: loss {loss_err:.2e}, {worst} {errors[worst]:.2e}")
    assert not bad, "\n".join(bad)


def test_mixture_of_experts_with_the_default_grouped_gemm_kernels_matches_single_process() -> None:
    """Mixtral and Qwen3-MoE as users build them (transformers' default experts implementation: grouped GEMMs, which
    have no float64): set up (traced, probed and verified in float32 on the host) and exact to float32 rounding
    against one process, every feasible plan, at p = 2."""
    pytest.importorskip("transformers")
    results = run_distributed(_hf_worker, 2, ["mixtral-defaults", "qwen3moe-defaults"], timeout=400)[0]
    assert {label.split("/")[0] for label, _ in results} == {"mixtral-defaults", "qwen3moe-defaults"}
    bad = tolerance_failures(results, torch.float32)
    assert not bad, "\n".join(bad)


HF_LOSS_TOL = 1e-6
"""Hugging Face computes its causal-LM loss on ``logits.float()``: in float32 whatever the model's dtype, so the
loss of two ranks' shares differs from one process's by float32 rounding (~1e-7); the gradients stay float64."""
FLOAT32_NORMS = ("qwen3", "olmo2", "mistral", "qwen2", "phi3", "mixtral", "qwen3moe")
"""Families whose RMSNorm computes in float32 whatever the model's dtype (Llama's norm: upcast, normalise, cast
back). On a GPU the mean of a row is summed in an order that depends on how many rows the kernel reduces, so one
process (the whole sequence) and the ranks (their shards) round it differently: about 1.3e-7 to 2.4e-7 in the
gradients at p = 2 and 3 (H100, torch 2.11), the same in every mode, since every mode normalises the same shards
(checked: the errors of all of a family's modes agree within float64's tolerance). On the host the order does not
depend on the rows, and these families are held to float64's tolerance."""
FLOAT32_NORMS_ON_GPU = 1e-6
"""The gradient tolerance of :data:`FLOAT32_NORMS` on a GPU."""
FLOAT32_INSIDE = {"gemma": 1e-5, "gemma3": 1e-5, "gemma2": 1e-5}
"""Families whose norms compute in float32 whatever the model's dtype (Gemma's RMSNorm upcasts and casts back), or
whose own attention computes its softmax in float32 (Gemma 2's eager attention; the modes compute it in the model's
dtype): their gradients carry float32 rounding (~2e-7 here) in every mode alike."""


@pytest.fixture(scope="module")
def family_jobs(request: pytest.FixtureRequest) -> Iterator[Together]:
    """The jobs of :func:`test_families_match_single_process`, run side by side."""
    calls = {p: functools.partial(run_distributed, _worker, p, timeout=400) for p in (2, 3, 4)}
    with Together.of(request, "test_families_match_single_process", calls) as jobs:
        yield jobs


@pytest.mark.parametrize("p", [2, 3, 4])
def test_families_match_single_process(p: int, family_jobs: Together) -> None:
    results = family_jobs.result(p)[0]
    labels = [label for label, _ in results]
    assert any(label.startswith("hf/") for label in labels) and any(label.startswith("tel/") for label in labels)
    assert any("mixed" in label for label in labels)
    bad = tolerance_failures(results, torch.float32)
    assert not bad, "\n".join(bad)


def test_modernbert_local_layers_are_refused_by_name() -> None:
    """ModernBERT's local layers attend a window in both directions, which the windowed kernels (causal) do not run:
    refused at setup with the block, its class and the reason (its global layers are exact, above)."""
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"layers\.1 \(ModernBertEncoderLayer\).*sliding window on bidirectional"):
        parallelize(ModernBertLM(layers=2, local_every=2), None)


def test_mixture_of_experts_auxiliary_loss_is_refused_at_setup_and_at_run_time() -> None:
    """The router's load-balancing loss mixes every token's routing: refused when the config asks for it (setup)
    and when a call does (before the model runs)."""
    pytest.importorskip("transformers")
    model = hf_family("mixtral", n_layers=1)
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=True: the mixture-of-experts auxiliary"):
        parallelize(model, None)
    model = hf_family("mixtral", n_layers=1)
    parallelize(model, None)
    with pytest.raises(ValueError, match="called with output_router_logits=True"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), output_router_logits=True)
