"""The optimizer settings ``configure_optimizers`` gives each parameter, on the plain model and on the rewritten one.

Lightning calls ``configure_optimizers`` once, after the strategy's setup, on the rewritten model: a projection's
shard is named by its role (``self_attn.q``, ``mlp.up_bias``) and sits in a dispatch module, not an ``nn.Linear``.
A rule that groups parameters by what the rewrite changes (``isinstance(m, nn.Linear)``, as minGPT's; a name ending in
``.weight``; a plain module's name such as ``q_proj``) then gives a projection other settings than one process gives it
(no weight decay where one process decays it), silently.

So the strategy calls ``configure_optimizers`` once more, on the plain model's structure (the rewritten model seen
through :func:`~lightning_paradyse.runtime.plain_view.plain_view`: the replaced sub-modules in place again, their
parameters stand-ins of the plain shapes; :func:`plain_settings`; the optimizers and schedulers it makes are dropped),
and compares, parameter by plain
parameter, the settings of its group (every key but the parameters: learning rate, weight decay, betas, ...) and the
optimizer it is in with what Lightning's own call gave the shards (:func:`check_settings`). A difference is refused
on every rank alike, before the first step, naming the parameters and the fix.

The extra call runs as Lightning's would (after the strategy kept the loaders' samplers), and leaves no trace: the
module's attributes are put back afterwards (a tensor learning rate ``self.lr`` that a scheduler's constructor fills in
place; :func:`~lightning_paradyse.lightning.step_check.kept_attributes`), the random streams too, and a training loader
it set up (``self.trainer.estimated_stepping_batches`` does, and its iterator draws a seed) is set up again where one
process sets it up, by Lightning's own call. Settings that choose an implementation, not
the arithmetic (``fused``, ``foreach``, ``capturable``), are not compared. The comparison is made at every fit, the
module's first or not (a module validated or tested under the strategy before its fit is rewritten already).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from torch import nn
from torch.optim import Optimizer

from lightning_paradyse.lightning.step_check import kept_attributes
from lightning_paradyse.runtime import parallel
from lightning_paradyse.runtime.checkpoint import PlainModel, plain_targets
from lightning_paradyse.runtime.exactness import kept_rng
from lightning_paradyse.runtime.plain_view import plain_view

Entry = tuple[int, dict[str, Any]]
"""(Index of an optimizer, the settings of the param group a parameter is in there)."""
Settings = dict[str, list[Entry]]
"""Plain parameter name -> its entries, one per optimizer it is in (one process may put it in several)."""

_NOT_SETTINGS = frozenset({"params", "param_names", "fused", "foreach", "capturable"})
"""Group keys not compared: those that list the parameters (``param_names``: an optimizer built from
``named_parameters()``), and those that choose an implementation (see the module docstring)."""

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
                    out.setdefault(name, []).append((i, settings))  # a shard per entry, on the rewritten model
    return out


def plain_settings(module: pl.LightningModule, device: torch.device) -> Settings:
    """Call ``module.configure_optimizers`` as Lightning does and return each parameter's settings by name, leaving no
    trace (see the module docstring): the optimizers and schedulers made are dropped, the module's attributes put
    back, the random streams too (host and ``device``), and a training loader the call set up is set up again by
    Lightning's own call, where one process sets it up (``estimated_stepping_batches``: its iterator draws a seed)."""
    names = {id(p): n for n, p in module.named_parameters()}
    restore = kept_attributes(module)
    loop = module.trainer.fit_loop
    loader = loop._combined_loader  # Lightning 2.6's (pinned): the fit loop's training loader, once set up
    try:
        with kept_rng(device):
            optimizers, _ = _init_optimizers_and_lr_schedulers(module)
        return settings_of(optimizers, names)
    finally:
        restore()
        loop._combined_loader = loader  # none yet: Lightning's call (or its fit loop) sets the loader up again


def viewed_settings(module: pl.LightningModule, plain: PlainModel, device: torch.device) -> Settings:
    """:func:`plain_settings` of the parallelised ``module`` seen with the plain structure
    (:func:`~lightning_paradyse.runtime.plain_view.plain_view`): the replaced parameters' stand-ins on ``meta`` (no
    memory, also for an optimizer that makes its state in its constructor, as ``Adagrad`` does), else, where the call
    needs a real device (``fused=True``, ``capturable=True``), one element each on ``device``."""
    targets = plain_targets(module, plain)
    current = {targets[n][0]: p for n, p in module.named_parameters()}  # a plain name -> one of its shards now
    parts = parallel.step_state(module).plain_parts
    try:
        with plain_view(module, parts, torch.device("meta"), current):
            return plain_settings(module, device)
    except Exception:  # the call again on the device; its own error, if any, raised from there
        with plain_view(module, parts, device, current):
            return plain_settings(module, device)


def plain_ids(module: nn.Module, plain: PlainModel) -> dict[int, str]:
    """Each parameter's id in the parallelised ``module`` -> the plain parameter it is, or is a shard of."""
    targets = plain_targets(module, plain)
    return {id(p): targets[n][0] for n, p in module.named_parameters()}


def check_settings(optimizers: Sequence[Optimizer], plain_names: Mapping[int, str], plain: Settings) -> None:
    """Refuse optimizers whose settings for a plain parameter differ from ``plain``'s (:func:`plain_settings` of the
    plain model). ``plain_names``: each parameter's id in the rewritten model -> the plain parameter it is (a shard of).
    Raises the same error on every rank (every rank computes both sides alike)."""
    mine = settings_of(optimizers, plain_names)
    differing = []
    for name in sorted(set(plain) | set(mine)):
        want = {i: settings for i, settings in plain.get(name, [])}
        got = mine.get(name, [])
        how = _difference(want, got)
        if how is not None:
            differing.append((name, how))
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


def _difference(want: dict[int, dict[str, Any]], got: list[Entry]) -> str | None:
    """How the entries of a plain parameter's shards ``got`` differ from one process's, by optimizer, ``want``;
    ``None`` if they do not."""
    if not want and got:
        return "in no optimizer on one process, optimized here"
    if want and not got:
        return "optimized on one process, in no optimizer here"
    if set(want) != {i for i, _ in got}:
        return f"in optimizer(s) {sorted(want)} on one process, {sorted({i for i, _ in got})} here"
    for i, settings in got:
        keys = [k for k in sorted(set(want[i]) | set(settings)) if not _equal(want[i].get(k), settings.get(k))]
        if keys:
            return ", ".join(f"{k}={settings.get(k)!r} here, {want[i].get(k)!r} on one process" for k in keys)
    return None


_VALUES = (bool, int, float, complex, str, bytes, type(None))


def _equal(x: Any, y: Any) -> bool:
    """Whether two group settings are equal: tensors by value, sequences item by item, numbers and text by value;
    other objects (a callable, a config) cannot be told apart from another call's and count as equal if of one type."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x.cpu(), y.cpu())
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_equal(u, v) for u, v in zip(x, y))
    if isinstance(x, _VALUES) or isinstance(y, _VALUES):
        return bool(x == y)
    return type(x) is type(y)
