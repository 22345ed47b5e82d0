"""The parallel modes, one file each, and their registry.

``MODES`` maps a mode name to its (stateless) implementation. Every mode runs the attention op and
the MLP op of a block on the unified layout; see :class:`~lightning_paradyse.modes.base.Mode`.
"""

from __future__ import annotations

from lightning_paradyse.modes.base import Mode
from lightning_paradyse.modes.dsp import DimensionSwitch
from lightning_paradyse.modes.metp import MemoryEfficientTensorParallel
from lightning_paradyse.modes.ring import Ring
from lightning_paradyse.modes.tp_sp import TensorSequenceParallel
from lightning_paradyse.modes.ulysses import Ulysses

MODES: dict[str, Mode] = {
    mode.name: mode for mode in (TensorSequenceParallel(), Ulysses(), Ring(), MemoryEfficientTensorParallel())
}
"""Every sequence mode by name: ``tp_sp``, ``ulysses``, ``ring``, ``metp``."""

GRID_MODES: dict[str, Mode] = {"dsp": DimensionSwitch()}
"""Modes for models whose hidden states are a grid of several sequence axes (``axes=2``): ``dsp``."""


def get_mode(name: str) -> Mode:
    """The mode called ``name``; a ``ValueError`` naming the known modes otherwise."""
    mode = MODES.get(name) or GRID_MODES.get(name)
    if mode is None:
        raise ValueError(f"unknown parallel mode {name!r}; known modes: {', '.join([*MODES, *GRID_MODES])}")
    return mode


__all__ = ["GRID_MODES", "MODES", "Mode", "get_mode"]
