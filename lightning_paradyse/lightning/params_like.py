"""A module's own tensors shaped like its parameters (a running average of the weights), whole in checkpoints.

Under the strategy each rank holds shards of the rewritten blocks' weights, under other names
(``model.layers.0.self_attn.q``); a tensor the module keeps per parameter (an exponential moving average over
``self.named_parameters()``) is then this rank's shards too. :func:`gather_like_params` makes such tensors the plain
model's (whole, under its names: what one process's module keeps), for ``on_save_checkpoint``; :func:`shard_like_params`
makes the plain model's this rank's again, for ``on_load_checkpoint``. Both return the tensors as they are where the
module is not parallelized (one process, DDP), so the same module runs under any strategy::

    def on_save_checkpoint(self, checkpoint):
        checkpoint["ema"] = gather_like_params(self, self.ema)  # every rank calls it (a collective per shard)

    def on_load_checkpoint(self, checkpoint):  # the strategy restores after its setup: the model is sharded here
        self.ema = shard_like_params(self, checkpoint["ema"])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn as nn
from torch import Tensor

from lightning_paradyse.runtime import parallel


def _strategy(module: nn.Module) -> Any:
    """The strategy of ``module``'s trainer (``None`` without one)."""
    trainer = getattr(module, "_trainer", None)
    return None if trainer is None else trainer.strategy


def gather_like_params(module: nn.Module, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` keyed and shaped like ``module.named_parameters()`` as the plain model's: whole, under its names, in
    its parameters' order, on the host (a GPU holds one gathered tensor at a time), on every rank (call it on every
    rank, as Lightning calls ``on_save_checkpoint``). As they are where ``module`` is not parallelized."""
    if not parallel.is_parallelized(module):
        return dict(tensors)
    strategy = _strategy(module)
    whole = parallel.consolidated_like(module, tensors, getattr(strategy, "group", None), host=True)
    plain = getattr(strategy, "plain_model", None)
    if plain is None:
        return whole
    return dict(sorted(whole.items(), key=lambda kv: plain.positions.get(kv[0], len(plain.positions))))


def shard_like_params(module: nn.Module, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of :func:`gather_like_params`: the plain model's tensors as this rank's, keyed as
    ``module.named_parameters()`` names them in the fit (nothing moves between ranks). As they are where ``module`` is
    not parallelized."""
    if not parallel.is_parallelized(module):
        return dict(tensors)
    return parallel.sharded_like(module, tensors, getattr(_strategy(module), "group", None))


__all__ = ["gather_like_params", "shard_like_params"]
