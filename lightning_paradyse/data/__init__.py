"""Data: the bundled corpus (:mod:`~.corpus`), token-budget batching and packing (:mod:`~.batching`), the
LightningDataModules (:mod:`~.datamodule`: ``lightning_paradyse.data.CorpusDataModule`` and its siblings are found
here too), synthetic length traces (:mod:`~.length_traces`)."""

from __future__ import annotations

import importlib
from typing import Any

SUBMODULES = ("batching", "corpus", "datamodule", "length_traces")


def __getattr__(name: str) -> Any:  # the data modules, imported (with Lightning) when asked for
    if name in SUBMODULES:  # `from lightning_paradyse.data import batching` asks here first: no Lightning for it
        return importlib.import_module(f"lightning_paradyse.data.{name}")
    module = importlib.import_module("lightning_paradyse.data.datamodule")
    if name in getattr(module, "__all__", ()):
        return getattr(module, name)
    raise AttributeError(f"module 'lightning_paradyse.data' has no attribute {name!r}")
