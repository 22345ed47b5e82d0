"""The optimizer settings ``configure_optimizers`` gives each parameter, on the plain model and on the rewritten one.

Lightning calls ``configure_optimizers`` once, after the strategy's setup, on the rewritten model: a projection's
shard is named by its role (``self_attn.q``, ``mlp.up_bias``) and sits in a dispatch module, not an ``nn.Linear``.
A rule that groups parameters by what the rewrite changes (``isinstance(m, nn.Linear)``, as minGPT's; a name ending in
``.weight``; a plain module's name such as ``q_proj``) then gives a projection other settings than one process gives it
(no weight decay where one process decays it), silently.

So the strategy calls ``configure_optimizers`` once more, on the plain model before it is rewritten
(:func:`plain_settings`; the optimizers and schedulers it makes are dropped), and compares, parameter by plain
parameter, the settings of its group (every key but the parameters: learning rate, weight decay, betas, ...) and the
optimizer it is in with what Lightning's own call gave the shards (:func:`check_settings`). A difference is refused
on every rank alike, before the first step, naming the parameters and the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from torch import nn
from torch.optim import Optimizer

from lightning_paradyse.runtime.checkpoint import PlainModel, plain_targets

Settings = dict[str, tuple[int, dict[str, Any]]]
"""Plain parameter name -> (index of its optimizer, its param group's settings)."""

_NOT_SETTINGS = frozenset({"params", "param_names"})
"""Group keys that list the parameters (``param_names``: an optimizer built from ``named_parameters()``)."""

SHOWN = 4
"""The most parameters an error names."""


def settings_of(optimizers: Sequence[Optimizer], names: Mapping[int, str]) -> Settings:
    """Each parameter's settings in ``optimizers``, by the name ``names`` gives its id (a parameter not named there
    is left out: the strategy refuses it elsewhere)."""
    out: Settings = {}
    for i, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k not in _NOT_SETTINGS}
            for param in group["params"]:
                name = names.get(id(param))
                if name is not None:
                    out.setdefault(name, (i, settings))
    return out


def plain_settings(module: pl.LightningModule) -> Settings:
    """Call ``module.configure_optimizers`` as Lightning does (its warnings silenced: Lightning's own call warns) and
    return each parameter's settings by name; the optimizers and schedulers made are dropped."""
    names = {id(p): n for n, p in module.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizers, _ = _init_optimizers_and_lr_schedulers(module)
    return settings_of(optimizers, names)


def plain_ids(module: nn.Module, plain: PlainModel) -> dict[int, str]:
    """Each parameter's id in the parallelised ``module`` -> the plain parameter it is, or is a shard of."""
    targets = plain_targets(module, plain)
    return {id(p): targets[n][0] for n, p in module.named_parameters()}


def check_settings(optimizers: Sequence[Optimizer], plain_names: Mapping[int, str], plain: Settings) -> None:
    """Refuse optimizers whose settings for a plain parameter differ from ``plain``'s (:func:`plain_settings` of the
    plain model). ``plain_names``: each parameter's id in the rewritten model -> the plain parameter it is (a shard of).
    Raises the same error on every rank (every rank computes both sides alike)."""
    mine: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for i, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k not in _NOT_SETTINGS}
            for param in group["params"]:
                name = plain_names.get(id(param))
                if name is not None:
                    mine.setdefault(name, []).append((i, settings))
    differing = []
    for name in sorted(set(plain) | set(mine)):
        want = plain.get(name)
        for got in mine.get(name, [None]):  # type: ignore[list-item]
            if not _same(want, got):
                differing.append((name, _describe(want, got)))
                break
    if differing:
        shown = "; ".join(f"{name}: {how}" for name, how in differing[:SHOWN])
        more = f" (and {len(differing) - SHOWN} more)" if len(differing) > SHOWN else ""
        raise ValueError(
            f"configure_optimizers gives {len(differing)} parameter(s) other optimizer settings on the parallel model "
            f"than on the plain one: {shown}{more}. It runs on the rewritten model, whose projections are shards named "
            f"by their role (self_attn.q, mlp.up, mlp.up_bias) in dispatch modules, not nn.Linear: a rule that reads "
            f"module types (isinstance(m, nn.Linear)), a name ending in '.weight' or a plain module's name (q_proj) "
            f"sorts them differently. Group by p.ndim (decay p.ndim >= 2), or by '\"bias\" in name' and the norms' "
            f"names, which the rewrite keeps"
        )


def _same(a: tuple[int, dict[str, Any]] | None, b: tuple[int, dict[str, Any]] | None) -> bool:
    if a is None or b is None:
        return a is b
    if a[0] != b[0] or a[1].keys() != b[1].keys():
        return False
    return all(_equal(a[1][k], b[1][k]) for k in a[1])


def _equal(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x.cpu(), y.cpu())
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_equal(u, v) for u, v in zip(x, y))
    try:
        return bool(x == y)
    except Exception:  # an object without a plain truth value: its text
        return repr(x) == repr(y)


def _describe(want: tuple[int, dict[str, Any]] | None, got: tuple[int, dict[str, Any]] | None) -> str:
    if want is None:
        return "in no optimizer on one process, optimized here"
    if got is None:
        return "optimized on one process, in no optimizer here"
    if want[0] != got[0]:
        return f"in optimizer {want[0]} on one process, {got[0]} here"
    keys = [k for k in sorted(set(want[1]) | set(got[1])) if not _equal(want[1].get(k), got[1].get(k))]
    return ", ".join(f"{k}={got[1].get(k)!r} here, {want[1].get(k)!r} on one process" for k in keys)
