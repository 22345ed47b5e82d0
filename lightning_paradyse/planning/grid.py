"""The plan of a grid model (``axes=2``): dimension switching or a sequence mode, per block, exactly.

Between blocks the grid ``[b, T, S, h]`` is sharded along one axis. A block attending along the *other* axis runs
locally whatever its mode. A block attending along the sharded axis either switches the shard to the other
axis (``dsp``: one all-to-all) and runs locally, or keeps the sharding and runs a sequence mode along it
(``ulysses``: q/k/v and the output through all-to-alls; ``ring``: key/value passes; ``tp_sp``: sequence
gather and scatter). After the last block the shard returns to the frames (one more switch if needed).

Compute is the same in every option (the same attention and MLP FLOPs on ``1/p`` of the tokens), so the planner
minimises the activation bytes each rank sends per step (forward and backward), in units of the local grid's
bytes ``V = b*T*S*h*bytes/p``; with ``r = n_kv/n`` (grouped-query attention) and ``p`` ranks:

* ``dsp``: ``2 V (p-1)/p`` (one switch forward, one backward); the sharded axis flips;
* ``ulysses``: ``2 (2 + 2r) V (p-1)/p``; ``ring``: ``6 r V (p-1)``; ``tp_sp``: ``4 V (p-1)``.

Every term is proportional to ``V``, so the best plan does not depend on the lengths. The search is exact: a
dynamic programme over the blocks with the sharded axis as its state (checked against enumerating every
assignment in ``tests/planning/test_grid.py``). MLPs are token-wise and always use ``dsp`` (ZeRO-3 weights).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan

GRID_ATTENTION_MODES = ("dsp", "ulysses", "ring", "tp_sp")
"""The attention modes a grid plan may use."""


def sharded_cost(mode: str, p: int, kv_ratio: float) -> float:
    """Bytes per rank, in units of ``V``, of a block attending along the sharded axis in ``mode``."""
    unit = (p - 1) / p
    costs = {"dsp": 2 * unit, "ulysses": 2 * (2 + 2 * kv_ratio) * unit, "ring": 6 * kv_ratio * (p - 1)}
    costs["tp_sp"] = 4.0 * (p - 1)
    return costs[mode]


def _step(axis: int, sharded: int, mode: str, p: int, kv_ratio: float) -> tuple[float, int]:
    """``(bytes in V, sharded axis after)`` of one block attending along ``axis``."""
    if axis != sharded:
        return 0.0, sharded  # whole sequences on every rank: local
    flipped = 3 - sharded
    return sharded_cost(mode, p, kv_ratio), flipped if mode == "dsp" else sharded


def plan_cost(plan_modes: Sequence[str], axes: Sequence[int], p: int, kv_ratio: float = 1.0) -> float:
    """Bytes per rank in units of ``V`` of the attention modes ``plan_modes`` (one per block), final switch included."""
    sharded, total = 1, 0.0
    for mode, axis in zip(plan_modes, axes):
        cost, sharded = _step(axis, sharded, mode, p, kv_ratio)
        total += cost
    return total + (sharded_cost("dsp", p, kv_ratio) if sharded != 1 else 0.0)


def best_grid_modes(
    axes: Sequence[int], p: int, kv_ratio: float = 1.0, modes: Sequence[str] = GRID_ATTENTION_MODES
) -> tuple[tuple[str, ...], float]:
    """The attention mode per block with the least bytes (dynamic programme over the sharded axis), and its cost.

    Ties go to the earlier mode in ``modes``; a block attending along an unsharded axis gets ``dsp`` (local).
    """
    best: dict[int, tuple[float, tuple[str, ...]]] = {1: (0.0, ())}
    for axis in axes:
        nxt: dict[int, tuple[float, tuple[str, ...]]] = {}
        for sharded, (cost, chosen) in sorted(best.items()):
            for mode in modes if axis == sharded else ("dsp",):
                step, after = _step(axis, sharded, mode, p, kv_ratio)
                candidate = (cost + step, (*chosen, mode))
                if after not in nxt or candidate[0] < nxt[after][0]:
                    nxt[after] = candidate
        best = nxt
    finals = [
        (cost + (sharded_cost("dsp", p, kv_ratio) if sharded != 1 else 0.0), chosen)
        for sharded, (cost, chosen) in sorted(best.items())
    ]
    cost, chosen = min(finals, key=lambda item: item[0])
    return chosen, cost


def brute_force_grid(
    axes: Sequence[int], p: int, kv_ratio: float = 1.0, modes: Sequence[str] = GRID_ATTENTION_MODES
) -> float:
    """The least cost over every assignment of ``modes`` to the blocks (the reference of the tests)."""
    return min(plan_cost(choice, axes, p, kv_ratio) for choice in itertools.product(modes, repeat=len(axes)))


class GridPlanner:
    """The strategy's planner for grid models: the same least-bytes plan for every batch (see the module docstring)."""

    def __init__(self, axes: Sequence[int], p: int, kv_ratio: float, modes: Sequence[str], recompute: bool = False):
        allowed = tuple(m for m in GRID_ATTENTION_MODES if m in (*modes, "dsp"))
        chosen, self.bytes_in_v = best_grid_modes(axes, p, kv_ratio, allowed)
        self._plan = Plan(tuple(LayerPlan(OpPlan(m, recompute), OpPlan("dsp", recompute)) for m in chosen))

    def plan(self, seq_len: int, batch: int) -> Plan:
        return self._plan

    def __repr__(self) -> str:
        return f"GridPlanner({self._plan}, {self.bytes_in_v:.3g} V per step)"


__all__ = ["GRID_ATTENTION_MODES", "GridPlanner", "best_grid_modes", "brute_force_grid", "plan_cost", "sharded_cost"]
