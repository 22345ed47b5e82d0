"""The plain model's structure, seen again on a parallelised model: what a rule over modules and names sees.

The rewrite replaces a block's op sub-modules (an attention, an MLP, its projections) by dispatch modules holding
shards named by their role. Code that reads the model's structure, ``configure_optimizers`` grouping parameters by
``isinstance(m, nn.Linear)`` for example, sees another model afterwards. :class:`Shadows` keeps, while the blocks are
rewritten, a copy of each replaced sub-module whose tensors live on the ``meta`` device (no memory); those of its
parameters that the rewritten model still holds (a norm a dispatch module adopted, a weight tied to one outside) are
the model's own. :func:`plain_view` puts the copies back in place for the span of a ``with`` (their parameters then
single elements on the device, expanded to the plain shape: their shape, dtype, device and ``requires_grad`` are the
plain ones, their values are not), and the dispatch modules after it.

Only the structure is the plain one in the view: it is for code that names or sorts parameters, never for a forward
or for values.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

_PARTS: weakref.WeakKeyDictionary[nn.Module, dict[str, nn.Module]] = weakref.WeakKeyDictionary()
"""Parallelised model -> its replaced sub-modules' copies by their path in the model (tensors on ``meta``)."""


class Shadows:
    """The copies of one model's replaced sub-modules, made while its blocks are rewritten (:meth:`before` and
    :meth:`after` around each block's rewrite, :meth:`finish` once)."""

    def __init__(self) -> None:
        self.parts: dict[str, nn.Module] = {}
        self._shadow: nn.Module | None = None
        self._origins: dict[int, weakref.ref[torch.Tensor]] = {}
        """A copy's ``meta`` tensor -> the tensor it copies (weak: the rewrite frees a replaced weight)."""

    def before(self, block: nn.Module) -> None:
        """Copy ``block`` on ``meta``, before it is rewritten."""
        memo: dict[int, Any] = {}
        for t in (*block.parameters(), *block.buffers()):
            shadow = torch.empty_like(t, device="meta")
            if isinstance(t, nn.Parameter):
                shadow = nn.Parameter(shadow, requires_grad=t.requires_grad)
            memo[id(t)] = shadow
            self._origins[id(shadow)] = weakref.ref(t)
        self._shadow = copy.deepcopy(block, memo)

    def after(self, name: str, paths: Sequence[str]) -> None:
        """Keep the copies of block ``name``'s sub-modules at ``paths`` (inside the block), which its rewrite
        replaced."""
        assert self._shadow is not None
        for path in paths:
            self.parts[f"{name}.{path}"] = self._shadow.get_submodule(path)
        self._shadow = None

    def finish(self, model: nn.Module) -> None:
        """Give the copies the parameters ``model`` still holds, and keep them as ``model``'s."""
        held = {id(p): p for p in model.parameters()}
        for part in self.parts.values():
            for sub in part.modules():
                for key, param in sub._parameters.items():
                    origin = self._origins.get(id(param)) if param is not None else None
                    real = origin() if origin is not None else None
                    if real is not None and id(real) in held:
                        sub._parameters[key] = held[id(real)]
        self._origins.clear()
        _PARTS[model] = self.parts


@contextmanager
def plain_view(model: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """``model`` with the plain sub-modules in place of the dispatch modules for the span of the ``with`` (see the
    module docstring); the copies' own parameters are single elements on ``device`` expanded to their shapes. A model
    that was never parallelised is yielded as it is."""
    parts = _PARTS.get(model)
    if parts is None:
        yield model
        return
    swapped = {path: model.get_submodule(path) for path in parts}
    try:
        for path, part in parts.items():
            model.set_submodule(path, _materialized(part, device))
        yield model
    finally:
        for path, dispatch in swapped.items():
            model.set_submodule(path, dispatch)


def _materialized(part: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``part`` whose ``meta`` tensors are single elements on ``device``, expanded (the model's own
    parameters kept as they are: never copied)."""
    memo: dict[int, Any] = {}
    for t in (*part.parameters(), *part.buffers()):
        if not t.is_meta:
            memo[id(t)] = t
            continue
        one = torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)  # [] -> the plain shape, one element
        memo[id(t)] = nn.Parameter(one, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else one
    return copy.deepcopy(part, memo)


__all__ = ["Shadows", "plain_view"]
