"""Shared test set-up: one thread per process, no leftover process group, float32 default."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _clean_state() -> Iterator[None]:
    torch.set_num_threads(1)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
