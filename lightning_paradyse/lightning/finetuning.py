"""Lightning's ``BaseFinetuning`` callbacks under the strategy: their param groups saved by the plain model's names
and put back before the optimizer state is loaded.

``BaseFinetuning`` (and ``BackboneFinetuning``) freezes modules before training, adds them to the optimizer as new param
groups when it unfreezes them, and keeps those groups in its checkpoint state by parameter name, read from
``pl_module.named_parameters()``: the rewritten model's names under this strategy. A checkpoint holds them by the
plain model's names (:func:`to_plain`), as it holds the weights and the optimizer state, so a plain run resumes from
ours; loading turns them back into the rewritten model's (:func:`to_parallel`), so we resume from a plain run's or
from ours on any number of ranks. The callback puts its groups back in ``on_fit_start``, which Lightning calls before
it restores callback states when the strategy loads checkpoints after its setup (this one, as FSDP): the groups would
then be missing when the optimizer state is loaded (whose groups would not match); :func:`restore_groups` puts them
back just before (both bugs until 2026-11-30: a plain resume from ours raised a ``KeyError``, ours refused the
optimizer state).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn

from lightning_paradyse.runtime.checkpoint import PlainModel, parallel_names, plain_names, plain_targets

METADATA = "internal_optimizer_metadata"
"""The key of ``BaseFinetuning``'s checkpoint state that holds its param groups (``{optimizer index: [group, ...]}``,
each group's ``params`` a list of parameter names)."""


def to_plain(checkpoint: dict[str, Any], module: nn.Module, plain: PlainModel) -> dict[str, Any]:
    """``checkpoint`` with every finetuning callback's param groups by the plain model's parameter names."""
    targets = plain_targets(module, plain)
    return _renamed(checkpoint, lambda names: plain_names(names, targets, plain, module))


def to_parallel(checkpoint: dict[str, Any], module: nn.Module, plain: PlainModel) -> dict[str, Any]:
    """``checkpoint`` with every finetuning callback's param groups by the rewritten model's parameter names."""
    targets = plain_targets(module, plain)
    return _renamed(checkpoint, lambda names: parallel_names(names, targets))


def _renamed(checkpoint: dict[str, Any], rename: Callable[[Sequence[str]], list[str]]) -> dict[str, Any]:
    """A shallow copy of ``checkpoint`` whose callback states holding :data:`METADATA` have it renamed (the
    callbacks' own state is left alone)."""
    states = checkpoint.get("callbacks")
    if not isinstance(states, dict) or not any(isinstance(s, dict) and s.get(METADATA) for s in states.values()):
        return checkpoint
    renamed = {}
    for key, state in states.items():
        groups = state.get(METADATA) if isinstance(state, dict) else None
        if groups:
            state = {
                **state,
                METADATA: {i: [{**g, "params": rename(g["params"])} for g in gs] for i, gs in groups.items()},
            }
        renamed[key] = state
    return {**checkpoint, "callbacks": renamed}


def restore_groups(trainer: pl.Trainer, module: nn.Module) -> None:
    """Put back the param groups of every finetuning callback restored from a checkpoint, as its ``on_fit_start``
    does, where that ran before its state was restored (see the module docstring)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if not isinstance(callback, BaseFinetuning) or not callback._restarting:
            continue
        kept = callback._internal_optimizer_metadata
        named = dict(module.named_parameters())
        for index, optimizer in enumerate(trainer.optimizers):
            if index in kept:
                optimizer.param_groups = callback._apply_mapping_to_param_groups(kept[index], named)
        callback._restarting = False


__all__ = ["METADATA", "restore_groups", "to_parallel", "to_plain"]
