"""``dsp``: dimension switching for multi-dimensional sequences (DSP), with ZeRO-3 weights.

For models whose hidden states are a grid (``[b, T, S, h]``: frames x patches) and whose blocks attend along
one axis at a time. The grid is sharded along one axis; a block that attends along the *other* axis runs its
attention entirely on this rank's tokens: every sequence it attends over is whole here. A block that attends
along the sharded axis first moves the shard to the other axis with one all-to-all
(:func:`~lightning_paradyse.distributed.comm.move_shard`, done by :mod:`lightning_paradyse.runtime.parallel` before
the block), instead of the two all-to-alls (q/k/v in, output back) per attention that Ulysses pays to keep the sharding.

This module is the op side: attention on the local sequences ``[n, L, h]`` with gathered (ZeRO-3) q/k/v/o,
and the token-wise ZeRO-3 MLP. The activation traffic of a switch is ``(T*S/p)*h*(p-1)/p`` per rank; the
weight gathers are the same as ``ulysses``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_paradyse.distributed.comm import Group, move_shard
from lightning_paradyse.distributed.layout import split_sizes
from lightning_paradyse.modes.attention import full_attention
from lightning_paradyse.modes.base import Mode, merge_heads, prepare_heads
from lightning_paradyse.modes.specs import AttnSpec, AttnWeights, MlpSpec, MlpWeights, SeqContext
from lightning_paradyse.modes.ulysses import zero3_project
from lightning_paradyse.modes.zero3 import zero3_mlp, zero3_out


@dataclass
class GridState:
    """The sharding of grid-shaped hidden states ``[b, T, S, h]`` (models with ``axes=2``) during one step.

    ``sharded`` is the grid dimension (1: frames, 2: patches) split over the group right now; ``lengths`` the whole
    length of each. The step starts sharded along the frames (:meth:`reset`); before a block whose attention runs
    ``dsp`` along the sharded axis the shard moves to the other axis (:meth:`enter`), and after the last block it
    returns to the frames (:meth:`leave`). :mod:`lightning_paradyse.runtime.parallel` calls these from its block hooks.
    """

    sharded: int = 1
    lengths: dict[int, int] = field(default_factory=dict)

    def other(self) -> int:
        return 3 - self.sharded

    def reset(self, frames: int) -> None:
        """A new step: sharded along the frames, ``frames`` of them."""
        self.sharded, self.lengths = 1, {1: frames}

    def enter(self, x: torch.Tensor, switch: bool, first: bool, p: int, group: Group) -> torch.Tensor:
        """Before a block: ``switch`` (its attention runs ``dsp`` along the sharded axis) moves the shard to the
        other axis with one all-to-all."""
        if first:
            self.lengths[2] = int(x.shape[2])  # [b, T/p, S, h]: the patches are whole at the first block
        if not switch:
            return x
        src, dst = self.sharded, self.other()
        x = move_shard(x, src, dst, split_sizes(self.lengths[src], p), group)  # [.., n/p, .., m] -> [.., n, .., m/p]
        self.sharded = dst
        return x

    def leave(self, out: torch.Tensor, p: int, group: Group) -> torch.Tensor:
        """After the last block: the shard back on the frames, the layout the batch was split in."""
        if self.sharded == 1:
            return out
        src, self.sharded = self.sharded, 1
        return move_shard(out, src, 1, split_sizes(self.lengths[src], p), group)  # back to [b, T/p, S, h]


class DimensionSwitch(Mode):
    """Attention over sequences that are whole on this rank; ZeRO-3 weights."""

    name = "dsp"

    def attention(self, x: torch.Tensor, w: AttnWeights, spec: AttnSpec, ctx: SeqContext) -> torch.Tensor:
        q, k, v = prepare_heads(
            zero3_project(x, w.q, w.bq, spec.q_rows, ctx, w.adapters.get("q")),  # [n, L, h] -> [n, L, heads*d]
            zero3_project(x, w.k, w.bk, spec.kv_rows, ctx, w.adapters.get("k")),
            zero3_project(x, w.v, w.bv, spec.kv_rows, ctx, w.adapters.get("v")),
            spec,
            torch.arange(x.shape[1], device=x.device),
        )  # -> [n, heads, L, d]
        o = merge_heads(
            full_attention(q, k, v, spec.causal, scale=spec.scale, window=spec.window, softcap=spec.softcap)
        )  # [n, heads, L, d] -> [n, L, heads*d]
        return zero3_out(o, w.o_t, w.bo, spec.q_rows, ctx.group, w.adapters.get("o_t"))  # [n, L, heads*d] -> [n, L, h]

    def mlp(self, x: torch.Tensor, w: MlpWeights, spec: MlpSpec, ctx: SeqContext) -> torch.Tensor:
        return zero3_mlp(x, w, spec, ctx.group)  # token-wise: any local grid [.., h]
