"""Planners: which :class:`~lightning_paradyse.modes.plan.Plan` a batch of a given length runs.

The strategy asks a :class:`Planner` for the plan of every batch (``ParaDySeStrategy.begin_batch``). Two
planners live here:

* :class:`FixedPlanner`: the same plan for every batch (a user-written plan or a single mode).
* :class:`ThresholdPolicy`: a simple, deterministic length-threshold policy, used when
  ``ParaDySeStrategy(thresholds=...)`` is given without a profile (``plan="auto"`` otherwise plans with the
  exact cost-model planner of :mod:`lightning_paradyse.planning.planner`): short batches run the fastest
  communication-light mode (``tp_sp``), middle ones ``ulysses``, long ones ring attention with a METP MLP and
  recomputation. Only the modes it is allowed and that are feasible for the model on the group are chosen.

A planner must be deterministic: every rank asks it for the same lengths and must get the same plan
(the strategy verifies this with an all-gather of a hash of the plan).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from itertools import product
from typing import Any, Protocol, runtime_checkable

from lightning_paradyse.modes import GRID_MODES, MODES
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan, parse_plan, uniform_plan

PlanSpec = str | Sequence[str | Mapping[str, Any]] | Plan
"""What users write for a plan: ``"auto"``, a mode name, a per-layer list, or a :class:`Plan`."""

PlanCheck = Callable[[Plan], None]
"""Raises ``ValueError`` (naming the layer and the reason) when a plan cannot run; returns otherwise."""


@runtime_checkable
class Planner(Protocol):
    """Anything that maps a batch's global shape to a plan."""

    def plan(self, seq_len: int, batch: int) -> Plan:
        """The plan for a batch of ``batch`` sequences of ``seq_len`` tokens (deterministic)."""
        ...


class FixedPlanner:
    """The same plan for every batch.

    Args:
        plan: The plan every batch runs.
    """

    def __init__(self, plan: Plan) -> None:
        self.fixed = plan

    def plan(self, seq_len: int, batch: int) -> Plan:
        """The fixed plan, whatever the batch."""
        return self.fixed

    def __repr__(self) -> str:
        return f"FixedPlanner({self.fixed})"


# Preference order per length tier: (attention modes, MLP modes, recompute), fastest first.
_TIERS: tuple[tuple[tuple[str, ...], tuple[str, ...], bool], ...] = (
    (("tp_sp", "ulysses", "ring", "metp"), ("tp_sp", "ulysses", "ring", "metp"), False),  # short
    (("ulysses", "ring", "tp_sp", "metp"), ("ulysses", "tp_sp", "ring", "metp"), False),  # middle
    (("ring", "ulysses", "metp", "tp_sp"), ("metp", "ulysses", "ring", "tp_sp"), True),  # long
)


class ThresholdPolicy:
    """A length-threshold policy: short -> ``tp_sp``, middle -> ``ulysses``, long -> ``ring`` + ``metp``.

    A batch of length ``s`` is *short* when ``s <= thresholds[0]``, *middle* when
    ``s <= thresholds[1]`` and *long* otherwise. Each tier has a preference order of (attention, MLP)
    modes; the first pair whose modes are all in ``modes`` and whose uniform plan passes ``check``
    wins, so a mode that is not allowed or infeasible for the model on the group is never chosen.
    Long batches recompute both ops. Plans are cached per tier, so the policy is deterministic and
    costs nothing after the first batch of a tier.

    Args:
        n_layers: Number of transformer blocks of the model.
        modes: The modes the policy may use.
        thresholds: ``(short_max, middle_max)`` sequence lengths, ``0 < short_max <= middle_max``.
        check: Optional feasibility check of a plan (e.g. :func:`lightning_paradyse.runtime.parallel.check_plan`
            bound to the model and group size); raises ``ValueError`` for an infeasible plan.

    Raises:
        ValueError: For an unknown or empty mode set, non-increasing thresholds, or (at :meth:`plan`)
            a tier for which no allowed mode is feasible.

    Example::

        policy = ThresholdPolicy(n_layers=2, modes=["tp_sp", "ring", "metp"], thresholds=(256, 1024))
        policy.plan(seq_len=4096, batch=1)  # ring attention, metp MLP, recompute
    """

    def __init__(
        self,
        n_layers: int,
        modes: Sequence[str] = tuple(MODES),
        thresholds: Sequence[int] = (256, 1024),
        check: PlanCheck | None = None,
    ) -> None:
        if n_layers < 1:
            raise ValueError(f"ThresholdPolicy: n_layers must be at least 1, got {n_layers}")
        unknown = [m for m in modes if m not in MODES and m not in GRID_MODES]
        if unknown or not modes:
            raise ValueError(f"ThresholdPolicy: modes must be a non-empty subset of {list(MODES)}, got {list(modes)}")
        if len(thresholds) != 2 or not 0 < thresholds[0] <= thresholds[1]:
            raise ValueError(
                f"ThresholdPolicy: thresholds must be two lengths (short_max, middle_max) with "
                f"0 < short_max <= middle_max, got {list(thresholds)}"
            )
        self.n_layers = n_layers
        self.modes = tuple(modes)
        self.thresholds = (int(thresholds[0]), int(thresholds[1]))
        self.check = check
        self._cache: dict[int, Plan] = {}

    def tier(self, seq_len: int) -> int:
        """0 (short), 1 (middle) or 2 (long)."""
        return 0 if seq_len <= self.thresholds[0] else 1 if seq_len <= self.thresholds[1] else 2

    def plan(self, seq_len: int, batch: int) -> Plan:
        """The cached plan of ``seq_len``'s tier (``batch`` does not matter to this policy)."""
        tier = self.tier(seq_len)
        if tier not in self._cache:
            self._cache[tier] = self._choose(tier)
        return self._cache[tier]

    def _choose(self, tier: int) -> Plan:
        attn_modes, mlp_modes, recompute = _TIERS[tier]
        allowed = [m for m in attn_modes if m in self.modes], [m for m in mlp_modes if m in self.modes]
        reasons: list[str] = []
        for attn, mlp in product(*allowed):
            layer = LayerPlan(OpPlan(attn, recompute), OpPlan(mlp, recompute))
            plan = Plan((layer,) * self.n_layers)
            try:
                if self.check is not None:
                    self.check(plan)
            except ValueError as err:
                reasons.append(f"{layer}: {err}")
                continue
            return plan
        raise ValueError(
            f"no allowed mode is feasible for this model and group (allowed modes: {list(self.modes)}): "
            + "; ".join(reasons)
            + ". Allow more modes (ParaDySeStrategy(modes=...)) or change the number of processes."
        )

    def __repr__(self) -> str:
        return f"ThresholdPolicy(n_layers={self.n_layers}, modes={list(self.modes)}, thresholds={self.thresholds})"


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_memory_budget(value: int | float | str | None) -> int | None:
    """Bytes of a per-rank memory budget: an integer, or a string such as ``"4GiB"``, ``"512 MB"``, ``"1e9"``.

    Raises:
        ValueError: naming the bad value and the accepted forms.
    """
    if value is None:
        return None
    hint = 'give a positive number of bytes or a size such as "4GiB", "512MiB", "16GB"'
    if isinstance(value, bool):
        raise ValueError(f"memory_budget={value!r} is not a size: {hint}")
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"memory_budget={value!r} is not a size: {hint} (units: B, KB, MB, GB, TB, KiB ... TiB)")
        number = float(match.group(1)) * _UNITS[unit]
    else:
        number = float(value)
    if not number >= 1:
        raise ValueError(f"memory_budget={value!r} must be at least one byte: {hint}")
    return int(number)


def validate_plan_spec(plan: PlanSpec, modes: Sequence[str]) -> PlanSpec:
    """Check a plan as far as possible without the model (mode names, entry syntax, allowed modes).

    The number of layers and the feasibility of each mode need the model and are checked at setup.

    Raises:
        ValueError: naming the plan, the bad entry and the fix.
    """
    if isinstance(plan, str) and plan == "auto":
        return plan
    grid = ", ".join(repr(m) for m in GRID_MODES)
    fix = f"use 'auto', one of the modes {list(MODES)} ({grid} with axes=2), or a list with one entry per layer"
    try:
        if isinstance(plan, str):
            parsed = uniform_plan(plan, 1)
        elif isinstance(plan, Plan):
            parsed = plan
        elif isinstance(plan, Sequence) and len(plan) > 0:
            parsed = parse_plan(plan, len(plan))
        else:
            raise ValueError("expected a string or a non-empty list")
    except ValueError as err:
        raise ValueError(f"plan={plan!r}: {err}; {fix}") from None
    used = {op.mode for layer in parsed.layers for op in (layer.attention, layer.mlp)}
    outside = sorted(used - set(modes))
    if outside:
        raise ValueError(
            f"plan={plan!r} uses the mode(s) {outside} which are not in modes={list(modes)}; "
            f"add them to modes or change the plan"
        )
    return plan


def validate_modes(modes: Sequence[str] | None) -> tuple[str, ...]:
    """The allowed modes (all four by default), each a known mode name, without duplicates."""
    if modes is None:
        return tuple(MODES)
    if isinstance(modes, str) or not isinstance(modes, Sequence):
        raise ValueError(f"modes={modes!r} must be a list of mode names such as {list(MODES)}")
    unknown = [m for m in modes if m not in MODES and m not in GRID_MODES]
    if unknown or not modes:
        raise ValueError(
            f"modes={list(modes)!r}: {'unknown mode(s) ' + str(unknown) if unknown else 'empty'}; "
            f"give a non-empty list drawn from {list(MODES)}"
        )
    return tuple(dict.fromkeys(modes))


__all__ = [
    "FixedPlanner",
    "PlanCheck",
    "PlanSpec",
    "Planner",
    "ThresholdPolicy",
    "parse_memory_budget",
    "validate_modes",
    "validate_plan_spec",
]
