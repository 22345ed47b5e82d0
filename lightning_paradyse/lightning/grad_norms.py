"""Lightning's ``grad_norm(module, norm_type)`` on a parallelised model: one process's per-parameter norms and total.

Lightning documents gradient-norm logging as ``self.log_dict(grad_norm(self, norm_type=2))`` in
``on_before_optimizer_step``. Its function walks ``module.named_parameters()`` and takes each gradient's norm. On the
rewritten model that lists this rank's shards under their rewritten names (``attn.q``, ``mlp.down_t``) with their
shards' norms, and a total over the shards: rank 0's part of the model, logged silently as if it were the model.

While the strategy runs, :class:`GradNormInterception` puts :meth:`GradNormInterception.grad_norm` wherever Lightning's
function is bound: on ``lightning.pytorch.utilities`` and its ``grads`` module, under any name in any loaded module
that holds the function itself (``from lightning.pytorch.utilities import grad_norm`` at the top of the user's file
binds it there before the strategy starts), and in the globals of the functions the LightningModule's and the
callbacks' classes define (a script the spawn launcher runs again in each worker is no loaded module: until
2026-11-30 a module defined in the launched script logged rank 0's shards). Called on a module that holds shards, it
returns what one process returns: the plain model's parameter names relative to ``module``, in the plain model's order,
each with the norm of the whole gradient (:func:`plain_grad_norms`: each shard's ``sum |g|^p``, or its largest ``|g|``,
summed or maxed over the ranks in one gather; a parameter every rank holds whole counted once), and the total computed
from them as Lightning computes it. It is a collective: call it on every rank, as ``on_before_optimizer_step`` does (a
call on rank 0 alone would wait for the others). A module without shards gets Lightning's own function. Put back at the
teardown.

A reference the scan cannot see (a ``functools.partial`` of the function, or a copy of it in a closure) is not
replaced: call it through ``lightning.pytorch.utilities.grad_norm``, or log norms from a checkpoint's whole weights.
"""

from __future__ import annotations

import itertools
import operator
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import lightning.pytorch.utilities as pl_utilities
import lightning.pytorch.utilities.grads as pl_grads
import torch
from torch import Tensor, nn

from lightning_paradyse.distributed.comm import Group, all_gather_rows, collective_device, group_size
from lightning_paradyse.runtime.checkpoint import PlainModel, Target, plain_targets

_ORIGINAL: Callable[..., dict[str, Any]] = pl_grads.grad_norm
"""Lightning's ``grad_norm`` (as imported before any strategy replaced it)."""


def plain_grad_norms(
    module: nn.Module,
    prefix: str,
    targets: Mapping[str, Target],
    plain: PlainModel,
    group: Group,
    norm_type: float,
    separator: str = "/",
) -> dict[str, Tensor]:
    """What Lightning's ``grad_norm(module, norm_type, separator)`` returns in one process, for ``module`` at
    ``prefix`` (``""``, or its path and a dot) in a parallelised model whose parameters ``targets`` maps to the plain
    ones (:func:`~lightning_paradyse.runtime.checkpoint.plain_targets`) and whose plain structure ``plain`` recorded. A
    collective over ``group``: one gather of two numbers per plain parameter held as shards."""
    inf = norm_type == float("inf")
    aliases_of: dict[str, list[str]] = {}
    for alias, first in plain.aliases.items():
        aliases_of.setdefault(first, []).append(alias)
    whole: dict[str, Tensor] = {}  # plain name (relative) -> the gradient every rank holds whole
    pieces: dict[str, list[Tensor]] = {}  # plain name (relative) -> this rank's pieces' gradients
    for name, param in module.named_parameters():
        target, ref = targets.get(prefix + name, (prefix + name, None))
        key = _relative(target, prefix, aliases_of)
        if ref is not None:
            pieces.setdefault(key, []).extend([] if param.grad is None else [param.grad.detach()])
        elif param.grad is not None:
            whole[key] = param.grad.detach()
    keys = list(pieces)  # the same on every rank: every rank holds a piece of every sharded parameter
    values: dict[str, Tensor] = {key: grad.norm(norm_type) for key, grad in whole.items()}
    if keys:
        device = collective_device(group) if group_size(group) > 1 else None
        parts = [_part(pieces[key], norm_type, device) for key in keys]
        local = torch.stack([part.to(parts[0].device) for part in parts], dim=1)  # [2, n] float64
        if group_size(group) > 1:
            every = all_gather_rows(local[None], [1] * group_size(group), group)  # [1, 2, n] -> [p, 2, n]
            local = torch.stack([every[:, 0].amax(0) if inf else every[:, 0].sum(0), every[:, 1].sum(0)])  # [2, n]
        local = local.cpu()  # the one read from the device
        for i, key in enumerate(keys):
            if local[1, i] > 0:  # some rank's piece has a gradient (a frozen parameter has none anywhere)
                like = next(iter(pieces[key]), None)
                value = local[0, i] if inf else local[0, i] ** (1.0 / norm_type)
                values[key] = value if like is None else value.to(device=like.device, dtype=like.dtype)
    last = len(plain.positions)
    order = sorted(values, key=lambda k: plain.positions.get(plain.aliases.get(prefix + k, prefix + k), last))
    norms = {f"grad_{norm_type}_norm{separator}{key}": values[key] for key in order}
    if norms:  # as Lightning computes it, from the parameters' norms
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms


def _part(grads: list[Tensor], norm_type: float, device: torch.device | None) -> Tensor:
    """``[2]`` float64: this rank's pieces' ``sum |g|^p`` (their largest ``|g|`` for the infinity norm), norms taken in
    at least float32, and how many pieces have a gradient; on ``device`` (the group's collectives'; ``None``: where
    the gradients are)."""
    if not grads:
        return torch.zeros(2, dtype=torch.float64, device=device)
    wide = [torch.linalg.vector_norm(g, norm_type, dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads]
    norms = torch.stack(wide).double()  # [pieces]
    part = norms.amax() if norm_type == float("inf") else (norms**norm_type).sum()
    out = torch.stack([part, part.new_tensor(float(len(grads)))])  # [2]
    return out if device is None else out.to(device)


def _relative(target: str, prefix: str, aliases_of: Mapping[str, list[str]]) -> str:
    """The plain name ``target`` relative to the sub-module at ``prefix`` (a tied parameter under the name it has
    there)."""
    for name in (target, *aliases_of.get(target, ())):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return target


def _globals_of(cls: type) -> list[dict[str, Any]]:
    """The globals of every function the classes of ``cls``'s method resolution order define (not Python's, torch's or
    Lightning's own)."""
    out = []
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in ("builtins", "torch", "lightning", "lightning_fabric"):
            continue
        for value in vars(klass).values():
            function = getattr(value, "__func__", value)  # a staticmethod's or classmethod's function
            if isinstance(function, types.FunctionType):
                out.append(function.__globals__)
    return out


class GradNormInterception:
    """While active, Lightning's ``grad_norm`` on a module holding shards returns one process's norms."""

    def __init__(
        self,
        root: Callable[[], nn.Module | None],
        plain: Callable[[], PlainModel | None],
        group: Callable[[], Group],
        sharded: Callable[[], set[int]],
    ) -> None:
        """``root``: the LightningModule; ``plain``: its recorded plain structure; ``group``: the strategy's group;
        ``sharded``: ids of the parameters held as shards."""
        self._root, self._plain, self._group, self._sharded = root, plain, group, sharded
        self._replaced: list[tuple[dict[str, Any], str]] = []
        self._paths: dict[int, str] = {}  # id of a sub-module of the root -> its path and a dot (one walk a fit)
        self._targets: dict[str, Target] = {}

    def grad_norm(self, module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Any]:
        """Lightning's ``grad_norm``, with the whole model's gradients where ``module`` holds shards."""
        norm_type = float(norm_type)
        if norm_type <= 0:  # Lightning's own check and message
            raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
        root, plain, sharded = self._root(), self._plain(), self._sharded()
        if root is None or plain is None or not any(id(p) in sharded for p in module.parameters()):
            return _ORIGINAL(module, norm_type, group_separator)
        if not self._paths:
            self._paths = {id(sub): (path + "." if path else "") for path, sub in root.named_modules()}
            self._targets = plain_targets(root, plain)
        if id(module) not in self._paths:  # shards of this model, reached through another module
            return _ORIGINAL(module, norm_type, group_separator)
        prefix = self._paths[id(module)]
        return plain_grad_norms(module, prefix, self._targets, plain, self._group(), norm_type, group_separator)

    def start(self, users: Iterable[object] = ()) -> None:
        """Bind :meth:`grad_norm` wherever Lightning's function is bound: its modules, names in loaded modules, and
        the globals of the functions the classes of ``users`` (the LightningModule, the callbacks) define, which need
        not be a loaded module's (a script run by the spawn launcher is run again in each worker as ``__mp_main__``,
        its functions' globals a dictionary of their own)."""
        if self._replaced:
            return
        self._paths, self._targets = {}, {}
        own = vars(sys.modules[__name__])  # holds the original, to call it
        spaces = {id(own): own}
        candidates: list[Any] = [vars(pl_grads), vars(pl_utilities)]
        candidates += [getattr(m, "__dict__", {}) for m in list(sys.modules.values())]
        candidates += [space for user in users for space in _globals_of(type(user))]
        for space in candidates:
            if id(space) in spaces or not isinstance(space, dict):
                continue
            spaces[id(space)] = space
            if not any(map(operator.is_, space.values(), itertools.repeat(_ORIGINAL))):  # skipped without a Python loop
                continue
            for name in [name for name, value in space.items() if value is _ORIGINAL]:
                space[name] = self.grad_norm
                self._replaced.append((space, name))

    def stop(self) -> None:
        """Put Lightning's function back where ours is still bound (a later rebinding is left alone)."""
        for space, name in self._replaced:
            if space.get(name) == self.grad_norm:
                space[name] = _ORIGINAL
        self._replaced, self._paths, self._targets = [], {}, {}


__all__ = ["GradNormInterception", "plain_grad_norms"]
