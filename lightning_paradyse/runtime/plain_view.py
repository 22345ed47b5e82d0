"""The plain model's structure, seen again on a parallelised model: what a rule over modules and names sees.

The rewrite replaces a block's op sub-modules (an attention, an MLP, its projections) by dispatch modules holding
shards named by their role. Code that reads the model's structure, ``configure_optimizers`` grouping parameters by
``isinstance(m, nn.Linear)`` for example, sees another model afterwards. :class:`Shadows` keeps, while the blocks are
rewritten, a *skeleton* of each replaced sub-module (:func:`skeleton`: the same classes and attributes, shared, not
copied; no hooks; parameters and buffers on the ``meta`` device, no memory); those of its parameters the rewritten
model still holds (a norm a dispatch module adopted, a weight tied to one outside) are the model's own.
:func:`plain_view` puts the skeletons back in place for the span of a ``with``, and the dispatch modules after it.

In the view a replaced parameter is a stand-in of the plain shape on the device asked for (``meta``: no memory; a
real device: one element expanded), with the dtype and ``requires_grad`` its shards have now (``current``: frozen or
cast since the rewrite). Only the structure is the plain one: the view is for code that names or sorts parameters,
never for a forward or for values.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

Parts = dict[str, nn.Module]
"""A parallelised model's replaced sub-modules' skeletons, by their path in the model."""

_HOOKS = tuple(name for name, value in vars(nn.Module()).items() if "hook" in name and isinstance(value, dict))
"""The hook dictionaries of a module (a skeleton has empty ones)."""


def skeleton(module: nn.Module, tensor: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A copy of ``module``'s structure: the same class and attributes (shared, not copied: no tensor, hook or
    reference to a parent is duplicated), no hooks, each parameter and buffer replaced by ``tensor(it)`` and each
    sub-module by its skeleton."""
    out = copy.copy(module)  # a new object whose __dict__ holds the same values
    for name in _HOOKS:
        out.__dict__[name] = type(module.__dict__[name])()
    out.__dict__["_parameters"] = {k: None if p is None else tensor(p) for k, p in module._parameters.items()}
    out.__dict__["_buffers"] = {k: None if b is None else tensor(b) for k, b in module._buffers.items()}
    out.__dict__["_modules"] = {k: None if m is None else skeleton(m, tensor) for k, m in module._modules.items()}
    return out


class Shadows:
    """The skeletons of one model's replaced sub-modules, made while its blocks are rewritten (:meth:`before` and
    :meth:`after` around each block's rewrite, :meth:`finish` once)."""

    def __init__(self) -> None:
        self.parts: Parts = {}
        self._block: nn.Module | None = None
        self._origins: list[tuple[nn.Module, str, weakref.ref[torch.Tensor]]] = []
        """Each skeleton parameter's module, name and the parameter it stands for (weak: the rewrite frees a
        replaced weight)."""

    def before(self, block: nn.Module) -> None:
        """The skeleton of ``block`` (tensors on ``meta``), before it is rewritten."""
        made: dict[int, torch.Tensor] = {}
        stands_for: dict[int, torch.Tensor] = {}

        def shadow(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in made:  # a tensor the block holds twice has one stand-in
                meta = torch.empty_like(t, device="meta")
                made[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                stands_for[id(made[id(t)])] = t
            return made[id(t)]

        self._block = skeleton(block, shadow)
        for sub in self._block.modules():
            for key, p in sub._parameters.items():
                if p is not None:
                    self._origins.append((sub, key, weakref.ref(stands_for[id(p)])))

    def after(self, name: str, paths: Sequence[str]) -> None:
        """Keep the skeletons of block ``name``'s sub-modules at ``paths`` (inside the block), which its rewrite
        replaced."""
        assert self._block is not None
        for path in paths:
            self.parts[f"{name}.{path}"] = self._block.get_submodule(path)
        self._block = None

    def finish(self, model: nn.Module) -> Parts:
        """The skeletons, given the parameters ``model`` still holds."""
        held = {id(p): p for p in model.parameters()}
        for sub, key, origin in self._origins:
            real = origin()
            if real is not None and id(real) in held:
                sub._parameters[key] = held[id(real)]
        self._origins.clear()
        return self.parts


@contextmanager
def plain_view(
    model: nn.Module, parts: Parts, device: torch.device, current: Mapping[str, torch.Tensor]
) -> Iterator[nn.Module]:
    """``model`` with the skeletons ``parts`` in place of the dispatch modules for the span of the ``with`` (see the
    module docstring). ``current``: a plain parameter's name -> a tensor it is now (a shard), whose dtype and
    ``requires_grad`` its stand-in takes."""
    swapped = {path: model.get_submodule(path) for path in parts}
    try:
        for path, part in parts.items():
            model.set_submodule(path, _materialized(part, path, device, current))
        yield model
    finally:
        for path, dispatch in swapped.items():
            model.set_submodule(path, dispatch)


def _materialized(part: nn.Module, path: str, device: torch.device, current: Mapping[str, torch.Tensor]) -> nn.Module:
    """The skeleton ``part`` (at ``path``) with its ``meta`` tensors as stand-ins on ``device`` (the model's own
    parameters kept as they are)."""
    names = {id(p): f"{path}.{n}" for n, p in part.named_parameters(remove_duplicate=False)}
    made: dict[int, torch.Tensor] = {}

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t
        if id(t) not in made:
            now = current.get(names.get(id(t), ""), t)
            one = torch.zeros((), dtype=now.dtype, device=device).expand(t.shape)  # [] -> the plain shape
            made[id(t)] = nn.Parameter(one, now.requires_grad) if isinstance(t, nn.Parameter) else one
        return made[id(t)]

    return skeleton(part, stand_in)


__all__ = ["Parts", "Shadows", "plain_view", "skeleton"]
