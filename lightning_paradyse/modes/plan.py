"""Plans: which mode (and recompute flag) each op of each layer runs for one batch.

A plan is a frozen, hashable value, identical on every rank. It is written by users (YAML/CLI) as:

* a mode name, e.g. ``"ring"``: every op of every layer;
* a list with one entry per layer, each entry a mode name or a mapping such as
  ``{attention: ring, mlp: metp, recompute: true}`` (``recompute`` may also be given per op:
  ``{attention: {mode: ring, recompute: true}, mlp: tp_sp}``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_paradyse.modes import MODES, get_mode

OPS = ("attention", "mlp")


@dataclass(frozen=True)
class OpPlan:
    """How one op runs."""

    mode: str
    """Name of the parallel mode (see ``lightning_paradyse.modes.MODES``)."""
    recompute: bool = False
    """Recompute the op's activations in backward instead of saving them."""

    def __post_init__(self) -> None:
        get_mode(self.mode)  # raises on an unknown name

    def __str__(self) -> str:
        return self.mode + ("+rc" if self.recompute else "")


@dataclass(frozen=True)
class LayerPlan:
    """How the two ops of one block run."""

    attention: OpPlan
    mlp: OpPlan

    def op(self, name: str) -> OpPlan:
        return self.attention if name == "attention" else self.mlp

    def __str__(self) -> str:
        return f"{self.attention},{self.mlp}"

    def to_dict(self) -> dict[str, Any]:
        """The mapping form accepted by :func:`parse_plan`."""
        return {
            "attention": {"mode": self.attention.mode, "recompute": self.attention.recompute},
            "mlp": {"mode": self.mlp.mode, "recompute": self.mlp.recompute},
        }


@dataclass(frozen=True)
class Plan:
    """One :class:`LayerPlan` per layer."""

    layers: tuple[LayerPlan, ...]

    def __len__(self) -> int:
        return len(self.layers)

    def to_list(self) -> list[dict[str, Any]]:
        return [layer.to_dict() for layer in self.layers]

    def mode_counts(self) -> dict[str, int]:
        """``"<op>/<mode>" -> number of layers`` (for logging)."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            for op in OPS:
                key = f"{op}/{layer.op(op)}"
                counts[key] = counts.get(key, 0) + 1
        return counts

    def __str__(self) -> str:
        """``"tp_sp,tp_sp | ulysses+rc,metp"``, computed once per plan (a step's digest reads every group's)."""
        known = self.__dict__.get("_str")
        if known is None:
            known = " | ".join(str(layer) for layer in self.layers)
            object.__setattr__(self, "_str", known)
        return known  # type: ignore[no-any-return]

    def __hash__(self) -> int:
        """The hash of :attr:`layers`, computed once per plan (a plan is looked up several times a step)."""
        known = self.__dict__.get("_hash")
        if known is None:
            known = hash(self.layers)
            object.__setattr__(self, "_hash", known)
        return known  # type: ignore[no-any-return]

    def __getstate__(self) -> dict[str, Any]:
        """The fields only: a string's hash differs between processes, so the kept hash does not travel."""
        return {"layers": self.layers}


def _parse_op(value: Any, recompute: bool, where: str) -> OpPlan:
    if isinstance(value, str):
        return OpPlan(value, recompute)
    if isinstance(value, Mapping):
        unknown = set(value) - {"mode", "recompute"}
        if unknown or "mode" not in value:
            raise ValueError(f"{where}: an op entry needs 'mode' (and optional 'recompute'), got {dict(value)}")
        return OpPlan(str(value["mode"]), bool(value.get("recompute", recompute)))
    raise ValueError(f"{where}: expected a mode name or a mapping, got {value!r}")


def _parse_layer(entry: Any, where: str) -> LayerPlan:
    if isinstance(entry, LayerPlan):
        return entry
    if isinstance(entry, str):
        return LayerPlan(OpPlan(entry), OpPlan(entry))
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"attention", "mlp", "recompute", "mode"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; use attention, mlp, recompute")
        rc = bool(entry.get("recompute", False))
        default = entry.get("mode")
        attn, mlp = entry.get("attention", default), entry.get("mlp", default)
        if attn is None or mlp is None:
            raise ValueError(f"{where}: give a mode for both 'attention' and 'mlp' (or 'mode' for both)")
        return LayerPlan(_parse_op(attn, rc, where), _parse_op(mlp, rc, where))
    raise ValueError(f"{where}: expected a mode name or a mapping, got {entry!r}")


def parse_plan(spec: str | Sequence[Any] | Plan, n_layers: int) -> Plan:
    """A :class:`Plan` for ``n_layers`` layers from a mode name, a per-layer list or a plan."""
    if isinstance(spec, Plan):
        plan = spec
    elif isinstance(spec, str):
        try:
            plan = Plan(tuple(_parse_layer(spec, "plan") for _ in range(n_layers)))
        except ValueError as err:
            raise ValueError(f"plan {spec!r}: {err}") from None
    else:
        plan = Plan(tuple(_parse_layer(entry, f"plan entry {i}") for i, entry in enumerate(spec)))
    if len(plan) != n_layers:
        raise ValueError(
            f"the plan has {len(plan)} entries but the model has {n_layers} layers: give one entry per layer "
            f"or a single mode name"
        )
    return plan


def random_plan(n_layers: int, modes: Sequence[str], seed: int, recompute: bool = True) -> Plan:
    """A reproducible random mixed plan: each op of each layer draws a mode (and recompute flag)."""
    rng = random.Random(seed)

    def draw() -> OpPlan:
        return OpPlan(rng.choice(list(modes)), recompute and rng.random() < 0.5)

    return Plan(tuple(LayerPlan(draw(), draw()) for _ in range(n_layers)))


def uniform_plan(mode: str, n_layers: int, recompute: bool = False) -> Plan:
    """Every op of every layer in ``mode``."""
    op = OpPlan(mode, recompute)
    return Plan(tuple(LayerPlan(op, op) for _ in range(n_layers)))


__all__ = ["MODES", "OPS", "LayerPlan", "OpPlan", "Plan", "parse_plan", "random_plan", "uniform_plan"]
