"""The model summary Lightning prints at the start of a fit, with the whole model's parameter counts.

Each rank holds a ``1/p`` shard of every projection, so Lightning's summary (``numel`` of the parameters it finds)
would report the shard: about half the model on 2 ranks. :class:`WholeModelSummary` counts every sharded
parameter as the whole piece it is a shard of; the strategy swaps Lightning's summary callback for one that uses it
(:func:`summarize_whole_model`), keeping its settings and its kind (plain or Rich).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch.nn as nn
from lightning.pytorch.callbacks import ModelSummary as SummaryCallback
from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary, ModelSummary
from typing_extensions import override

from lightning_paradyse.runtime import parallel


def whole_sizes(module: nn.Module) -> dict[int, int]:
    """``id(parameter)`` -> entries of the whole (unsharded) piece it holds, for every parameter of ``module``."""
    shards = parallel.shard_sources(module)
    sizes = {}
    for name, param in module.named_parameters():
        ref = shards.get(name)
        sizes[id(param)] = param.numel() if ref is None else ref.source.rows * math.prod(param.shape[1:])
    return sizes


class _WholeLayerSummary(LayerSummary):
    def __init__(self, module: nn.Module, sizes: dict[int, int]) -> None:
        self._sizes = sizes
        super().__init__(module)

    @property
    @override
    def num_parameters(self) -> int:
        return sum(self._sizes.get(id(p), p.numel()) for p in self._module.parameters())


class WholeModelSummary(ModelSummary):
    """Lightning's model summary with the whole model's parameter counts (shards counted whole)."""

    def __init__(self, model: pl.LightningModule, max_depth: int = 1) -> None:
        self._sizes = whole_sizes(model)
        super().__init__(model, max_depth)

    @override
    def summarize(self) -> dict[str, LayerSummary]:
        summary = super().summarize()
        for layer in summary.values():
            layer.detach_hook()
        return {name: _WholeLayerSummary(layer._module, self._sizes) for name, layer in summary.items()}

    @property
    @override
    def total_parameters(self) -> int:
        return sum(self._sizes.get(id(p), p.numel()) for p in self._model.parameters())

    @property
    @override
    def trainable_parameters(self) -> int:
        return sum(self._sizes.get(id(p), p.numel()) for p in self._model.parameters() if p.requires_grad)


def _whole_summary(self: Any, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ModelSummary:
    return WholeModelSummary(pl_module, max_depth=self._max_depth)


def summarize_whole_model(callbacks: list[pl.Callback]) -> None:
    """Replace each Lightning summary callback in ``callbacks`` by the same callback counting whole parameters."""
    for i, callback in enumerate(callbacks):
        if isinstance(callback, SummaryCallback) and not getattr(type(callback), "_paradyse_whole", False):
            kind = type(callback)
            whole = type(f"Whole{kind.__name__}", (kind,), {"_summary": _whole_summary, "_paradyse_whole": True})
            replacement: pl.Callback = object.__new__(whole)
            replacement.__dict__.update(callback.__dict__)
            callbacks[i] = replacement


__all__ = ["WholeModelSummary", "summarize_whole_model", "whole_sizes"]
