"""The equivalence checker: every mode and mixed plans against a single-process reference.

For one model and one batch, each rank runs the plain model on the whole sequence (the reference:
loss and every parameter gradient), then the same weights parallelized on the group under each plan,
and compares the loss and every gradient (consolidated to the plain model's names). This is what
``python cli.py check`` runs and what the test suite asserts, at p = 1, 2, 3 and 4.

Relative error of a gradient is ``max|par - ref| / max(max|ref|, 1e-3 * G)`` where ``G`` is the largest
gradient entry of the whole model: a gradient that is analytically zero (the key bias, since softmax
is invariant to a shift of all scores of a row) is compared against the model's gradient scale, not
against its own rounding noise. The loss error is ``|par - ref| / |ref|``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_paradyse.distributed.comm import Group, all_reduce_sum, group_rank, group_size
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.models import CONFIGS, build_model, lm_loss_sum
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan, parse_plan, random_plan, uniform_plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime.parallel import (
    configure,
    consolidated,
    feasible_modes,
    is_causal,
    parallelize,
    reduce_replicated_grads,
)

TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.float64: (1e-10, 1e-9)}
"""(loss, gradient) relative tolerances per dtype."""


@dataclass(frozen=True)
class CheckSettings:
    """What to check: one model, one batch, several plans."""

    model: str = "llama-tiny"
    """Model config name (see ``lightning_paradyse.models.CONFIGS``)."""
    seq_len: int = 64
    """Tokens per sequence (need not be divisible by the world size)."""
    batch: int = 1
    """Sequences per batch."""
    plan: str | list[Any] = "all"
    """``all`` (every mode, uniform, plus random mixed plans), ``random``, a mode name or a per-layer list."""
    seed: int = 0
    """Seed of weights, data and random plans."""
    dtype: str = "float32"
    """``float32`` or ``float64``."""
    random_plans: int = 3
    """How many random mixed plans ``all``/``random`` draw."""
    uniform_recompute: bool = True
    """``all``: also run every uniform plan with recomputation (random plans draw recompute flags anyway)."""


@dataclass
class CaseResult:
    """Errors of one plan."""

    label: str
    plan: str
    loss_err: float = 0.0
    grad_errs: dict[str, float] = field(default_factory=dict)
    infeasible: str | None = None

    @property
    def max_grad_err(self) -> float:
        return max(self.grad_errs.values(), default=0.0)

    @property
    def worst_param(self) -> str:
        return max(self.grad_errs, key=lambda k: self.grad_errs[k], default="-")


def reference_step(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Single-process loss (mean over tokens) and gradients of the plain model."""
    model.zero_grad(set_to_none=True)
    positions = torch.arange(tokens.shape[1])
    loss = lm_loss_sum(model, tokens, targets, positions) / targets.numel()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def parallel_step(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, plan: Plan, group: Group
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and consolidated gradients of a parallelized model under ``plan`` (same batch on every rank)."""
    p, rank = group_size(group), group_rank(group)
    layout = SeqLayout.for_sequence(tokens.shape[1], p, is_causal(model))
    ctx = SeqContext(layout, group)
    configure(model, ctx, plan)
    model.zero_grad(set_to_none=True)
    local = lm_loss_sum(model, layout.shard(tokens, rank), layout.shard(targets, rank), ctx.positions())
    loss = local / targets.numel()  # normalised by the global number of real tokens
    loss.backward()
    reduce_replicated_grads(model, group)
    total = all_reduce_sum(loss.detach(), group)
    return total, consolidated(model, group, grads=True)


def backward_and_compare(
    model: nn.Module, local_loss: torch.Tensor, group: Group, ref_loss: torch.Tensor, ref_grads: dict[str, torch.Tensor]
) -> tuple[float, dict[str, float]]:
    """Backward of this rank's share of the loss, the replicated-gradient sum, then the errors of the global
    loss and of every consolidated gradient against a single-process reference."""
    local_loss.backward()
    reduce_replicated_grads(model, group)
    total = all_reduce_sum(local_loss.detach(), group)
    ref = ref_loss.detach()
    return float(abs(total - ref) / ref), grad_errors(consolidated(model, group, grads=True), ref_grads)


def tolerance_failures(results: Sequence[tuple[str, tuple[float, dict[str, float]]]], dtype: torch.dtype) -> list[str]:
    """The cases of ``(label, (loss error, gradient errors))`` over the tolerances of ``dtype``, described."""
    loss_tol, grad_tol = TOLERANCES[dtype]
    bad = []
    for label, (loss_err, errors) in results:
        worst = max(errors, key=lambda k: errors[k])
        if loss_err > loss_tol or errors[worst] > grad_tol:
            bad.append(f"{label}: loss {loss_err:.2e}, {worst} {errors[worst]:.2e}")
    return bad


def rel_err(par: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    """``max|par - ref| / max(max|ref|, floor)`` (in float64)."""
    scale = ref.double().abs().max().clamp_min(floor)
    return float((par.double() - ref.double()).abs().max() / scale)


def grad_errors(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-parameter relative errors with the model-wide floor of the module docstring."""
    missing = set(ref) ^ set(grads)
    if missing:
        raise AssertionError(f"gradient names differ from the reference: {sorted(missing)}")
    floor = 1e-3 * max(float(g.double().abs().max()) for g in ref.values())
    return {name: rel_err(grads[name], r, floor) for name, r in ref.items()}


def _plans(settings: CheckSettings, n_layers: int) -> list[tuple[str, Plan]]:
    if settings.plan in ("all", "random"):
        plans = []
        if settings.plan == "all":
            for mode in MODES:
                plans.append((mode, uniform_plan(mode, n_layers)))
                if settings.uniform_recompute:
                    plans.append((f"{mode}+rc", uniform_plan(mode, n_layers, recompute=True)))
        for k in range(settings.random_plans):
            plans.append((f"random#{k}", random_plan(n_layers, list(MODES), settings.seed * 1000 + k)))
        return plans
    label = settings.plan if isinstance(settings.plan, str) else "explicit"
    return [(label, parse_plan(settings.plan, n_layers))]


def _infeasible(model: nn.Module, plan: Plan, p: int) -> str | None:
    """Why a plan cannot run on ``p`` ranks (the first layer/op that cannot), or ``None``."""
    for i, (attn_ok, mlp_ok) in enumerate(feasible_modes(model, p, list(MODES))):
        layer = plan.layers[i]
        if layer.attention.mode not in attn_ok:
            return f"layer {i} attention: {layer.attention.mode} infeasible (feasible: {', '.join(attn_ok)})"
        if layer.mlp.mode not in mlp_ok:
            return f"layer {i} mlp: {layer.mlp.mode} infeasible (feasible: {', '.join(mlp_ok)})"
    return None


def check_worker(rank: int, world: int, settings: CheckSettings) -> list[CaseResult]:
    """Run every plan of ``settings`` on this rank; identical results on all ranks."""
    group = dist.group.WORLD if world > 1 else None
    dtype = getattr(torch, settings.dtype)
    torch.manual_seed(settings.seed)
    plain = build_model(settings.model).to(dtype)
    config = CONFIGS[settings.model]
    tokens = torch.randint(0, config.vocab_size, (settings.batch, settings.seq_len + 1))
    tokens, targets = tokens[:, :-1], tokens[:, 1:]  # targets shifted in the data
    ref_loss, ref_grads = reference_step(copy.deepcopy(plain), tokens, targets)
    template = copy.deepcopy(plain)
    parallelize(template, group)
    results = []
    for label, plan in _plans(settings, config.n_layers):
        if label.startswith("random"):
            plan = _redraw_feasible(template, plan, world, settings.seed)
        reason = _infeasible(template, plan, world)
        result = CaseResult(label, str(plan))
        if reason:
            result.infeasible = reason
            results.append(result)
            continue
        loss, grads = parallel_step(copy.deepcopy(template), tokens, targets, plan, group)
        result.loss_err = float(abs(loss.double() - ref_loss.double()) / abs(ref_loss.double()))
        result.grad_errs = grad_errors(grads, ref_grads)
        results.append(result)
    return results


def _redraw_feasible(model: nn.Module, plan: Plan, p: int, seed: int) -> Plan:
    """Replace each op's mode by a feasible one (deterministically), keeping the recompute flags."""
    layers = []
    for i, ((attn_ok, mlp_ok), layer) in enumerate(zip(feasible_modes(model, p, list(MODES)), plan.layers)):
        attn, mlp = layer.attention, layer.mlp
        if attn.mode not in attn_ok:
            attn = OpPlan(attn_ok[(seed + i) % len(attn_ok)], attn.recompute)
        if mlp.mode not in mlp_ok:
            mlp = OpPlan(mlp_ok[(seed + i) % len(mlp_ok)], mlp.recompute)
        layers.append(LayerPlan(attn, mlp))
    return Plan(tuple(layers))


def format_report(results: Sequence[CaseResult], settings: CheckSettings, world: int) -> tuple[str, bool]:
    """A table of the errors and whether every feasible case is within tolerance."""
    loss_tol, grad_tol = TOLERANCES[getattr(torch, settings.dtype)]
    lines = [
        f"model={settings.model} p={world} seq_len={settings.seq_len} batch={settings.batch} "
        f"dtype={settings.dtype} seed={settings.seed} (tolerance: loss {loss_tol:g}, gradients {grad_tol:g})",
        f"{'plan':<12} {'loss rel err':>13} {'max grad rel err':>17}  {'worst parameter':<28} status",
    ]
    ok = True
    for r in results:
        if r.infeasible:
            lines.append(f"{r.label:<12} {'-':>13} {'-':>17}  {'-':<28} infeasible: {r.infeasible}")
            continue
        good = r.loss_err <= loss_tol and r.max_grad_err <= grad_tol
        ok &= good
        lines.append(
            f"{r.label:<12} {r.loss_err:>13.2e} {r.max_grad_err:>17.2e}  {r.worst_param:<28} "
            f"{'ok' if good else 'FAIL'}" + (f"   [{r.plan}]" if r.label.startswith(("random", "explicit")) else "")
        )
    return "\n".join(lines), ok
