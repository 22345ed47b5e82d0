"""Shared test set-up: one thread per process, no leftover process group, float32 default."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from lightning_paradyse.distributed.spawn import use_forkserver

# Machines measured by plan="auto" are kept for the test session only (set before the fork server starts), and
# removed at its end by the process that made the folder (forked workers inherit the exit hook: they leave it).
if "PARADYSE_CACHE_DIR" not in os.environ:
    _cache_dir = os.environ["PARADYSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="paradyse-cache-")
    _maker = os.getpid()
    atexit.register(lambda: os.getpid() == _maker and shutil.rmtree(_cache_dir, ignore_errors=True))

# Spawned gloo jobs fork from one server that imported these once: a job starts in ~0.2 s instead of 3-6 s.
use_forkserver(
    [
        "torch",
        "torch.distributed",
        "lightning.pytorch",
        "lightning_paradyse",
        "lightning_paradyse.lightning.strategy",
        "transformers",
        "transformers.models.llama.modeling_llama",
        "tests.support.lightning",
        "tests.exact.harness",
        "tests.support.frozen",  # last: everything above frozen out of the workers' collections
    ]
)


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    torch.set_num_threads(1)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
