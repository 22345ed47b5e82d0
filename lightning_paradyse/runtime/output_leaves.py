"""The model's outputs as leaves of a gradient: what the step check differentiates the step's loss by.

A loss can equal one process's in value and not in its gradient: a term divided by its own value taken without a
gradient (``ce / ce.detach()``, multi-task magnitude normalisation) is one on every rank and in one process, but
each rank's gradient is then scaled by its own slice's loss. Values alone cannot tell; the gradient of the loss with
respect to what the model returned can, and it needs no backward through the model.

While an :class:`OutputLeaves` is set on a parallelized model's step state
(:attr:`~lightning_paradyse.runtime.parallel.StepState.leaves`; :func:`collecting`), the outermost call of an owner
of the blocks runs without a gradient and each floating-point output of two or more dimensions reaches the step as a
copy of a fresh leaf that requires one (a copy: the step may write into it in place, as into any output). The step's
own code after the call then builds a graph back to those leaves alone; :func:`leaf_gradients` takes the loss's
gradient with respect to them. A call made while gradients are off (a teacher under ``torch.no_grad()``) is left as
it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch


class OutputLeaves:
    """The leaves the model's calls handed the step, in call order (module docstring)."""

    def __init__(self) -> None:
        self.leaves: list[torch.Tensor] = []
        self._depth = 0
        self._grad_before = False

    def enter(self) -> None:
        """A call of an owner of the blocks begins: the outermost one runs without a gradient."""
        self._depth += 1
        if self._depth == 1:
            self._grad_before = torch.is_grad_enabled()
            torch.set_grad_enabled(False)

    def exit(self, output: Any) -> Any:
        """A call ends (or raised: ``output`` is then ``None``): the outermost one's outputs as copies of leaves
        (``None``: the output unchanged)."""
        self._depth = max(self._depth - 1, 0)
        if self._depth:
            return None
        torch.set_grad_enabled(self._grad_before)
        if not self._grad_before or output is None:
            return None
        return self._wrapped(output)

    def _leaf(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() < 2:
            return value
        leaf = value.detach().requires_grad_(True)
        self.leaves.append(leaf)
        return leaf.clone()  # [b, s, ...]: not a leaf itself, so the step may write into it

    def _wrapped(self, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return self._leaf(output)
        if isinstance(output, (tuple, list)):
            return self._each(output)
        if isinstance(output, Mapping) and hasattr(output, "__setitem__"):  # a dict, a Hugging Face ModelOutput
            for key in list(output.keys()):
                value = output[key]
                # a model's hidden states: a tuple of [b, s, h] per layer
                wrapped = self._each(value) if isinstance(value, (tuple, list)) else self._leaf(value)
                if wrapped is not value:
                    output[key] = wrapped  # type: ignore[index]
            return output
        return None  # another object: left as it is

    def _each(self, values: tuple[Any, ...] | list[Any]) -> Any:
        """Every entry of a tuple or list made a leaf where it is an output (:meth:`_leaf`), its type kept (a named
        tuple's too)."""
        items = [self._leaf(v) for v in values]
        if isinstance(values, list):
            return items
        return values._make(items) if hasattr(values, "_make") else type(values)(items)  # type: ignore[union-attr]


@contextmanager
def collecting(state: Any, leaves: OutputLeaves, active: bool = True) -> Iterator[OutputLeaves]:
    """Inside: ``state``'s (a :class:`~lightning_paradyse.runtime.parallel.StepState`) model calls hand the step
    leaves (module docstring), and the step's own code runs with gradients on; nothing where not ``active``."""
    if not active:
        yield leaves
        return
    before, state.leaves = state.leaves, leaves
    try:
        with torch.enable_grad():
            yield leaves
    finally:
        state.leaves = before


def leaf_gradients(loss: torch.Tensor | None, leaves: OutputLeaves) -> list[torch.Tensor | None] | None:
    """The gradient of ``loss`` with respect to every leaf (``None`` for one it does not depend on), or ``None``
    where there is none to take (no loss, no leaf, or a loss without a gradient: one a Hugging Face model computed
    inside its call)."""
    if loss is None or not leaves.leaves or not loss.requires_grad or loss.numel() != 1:
        return None
    with torch.enable_grad():
        return list(torch.autograd.grad(loss.sum(), leaves.leaves, allow_unused=True))  # [1] or [] -> []
