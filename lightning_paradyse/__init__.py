"""lightning_paradyse: per-batch, per-layer parallel-mode switching for variable-length training.

The Lightning strategy is registered under the name ``paradyse`` as soon as Lightning is imported
(before or after this package), so ``Trainer(strategy="paradyse")`` and ``--trainer.strategy=paradyse``
work. Lightning itself is loaded lazily: the mode library (and processes that only run it) does not
pay for importing Lightning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__all__ = ["DocumentScoreWriter", "ParaDySeStrategy", "ParaDySeSwitcher", "gather_like_params", "shard_like_params"]

_LAZY = {
    "DocumentScoreWriter": "lightning_paradyse.lightning.prediction_writer",
    "ParaDySeStrategy": "lightning_paradyse.lightning.strategy",
    "ParaDySeSwitcher": "lightning_paradyse.lightning.callbacks",
    "gather_like_params": "lightning_paradyse.lightning.params_like",
    "shard_like_params": "lightning_paradyse.lightning.params_like",
}
_TRIGGER = "lightning.pytorch.strategies"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_paradyse' has no attribute {name!r}")


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Registers the strategy right after Lightning's strategy registry is imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module  # type: ignore[attr-defined]

        def exec_module(module: Any) -> None:
            original(module)
            _register(module.StrategyRegistry)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _register(registry: Any) -> None:
    """``paradyse`` in Lightning's strategy registry: a factory that imports the strategy when a Trainer asks for it
    (importing it here, inside Lightning's own import, would import this package's modules half-way through it)."""
    if "paradyse" not in registry:
        registry.register(
            "paradyse", _paradyse_strategy, description="Per-batch, per-layer parallel-mode switching (ParaDySe)"
        )


def _paradyse_strategy(**kwargs: Any) -> Any:
    return importlib.import_module("lightning_paradyse.lightning.strategy").ParaDySeStrategy(**kwargs)


_MOVED = {
    **{
        name: f"{folder}.{name}"
        for folder, names in {
            "distributed": ("layout", "comm", "devices", "spawn"),
            "modes": ("attention", "plan", "volume"),
            "runtime": ("parallel", "slicing", "checkpoint", "hf_checkpointing"),
            "lightning": ("strategy", "callbacks", "summary", "plot"),
            "data": ("corpus", "batching"),
        }.items()
        for name in names
    },
    "guards": "runtime.exactness",
    "models.st": "models.spatial_temporal",
    "runtime.guards": "runtime.exactness",
    "spec": "modes.specs",
    "policy": "planning.fixed",
    "step": "lightning.records",
    "lit": "lightning.language_model",
    "traces": "data.length_traces",
    "check": "tools.mode_check",
    "cost.profile": "calibration.profile",
    "cost.measure": "calibration.measure",
    "cost.calibrate": "calibration.calibrate",
    "cost.quick": "calibration.quick",
    "cost.tracker": "calibration.tracker",
    "cost.planner": "planning.planner",
    "cost.grid": "planning.grid",
    "cost.cli": "tools.cost_cli",
}
"""Module paths of earlier versions -> where the module lives now (``lightning_paradyse.parallel`` still imports)."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of an earlier version's module path give the module at its place in the layout."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        old = fullname.removeprefix("lightning_paradyse.")
        if fullname.startswith("lightning_paradyse.") and old in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module("lightning_paradyse." + _MOVED[spec.name.removeprefix("lightning_paradyse.")])

    def exec_module(self, module: Any) -> None:
        return None


sys.meta_path.append(_MovedModules())

if _TRIGGER in sys.modules:
    _register(sys.modules[_TRIGGER].StrategyRegistry)
else:
    sys.meta_path.insert(0, _RegisterAfterLightning())
