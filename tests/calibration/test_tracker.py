"""MemoryTracker on known allocations: exact bytes, live against peak, freed tensors, views, backward.

The tracker counts the untyped storage of every tensor an ATen op creates while it is active and
forgets it when the storage is freed. Every expected number below is computed from shapes and
element sizes, so the comparisons are exact.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from lightning_paradyse.calibration.tracker import MemoryTracker


def test_exact_bytes_of_new_tensors_and_frees() -> None:
    with MemoryTracker() as mem:
        a = torch.empty(1000, dtype=torch.float32)
        assert mem.live == 4000 and mem.peak == 4000
        b = torch.zeros(10, 10, dtype=torch.float64)
        assert mem.live == 4800 and mem.peak == 4800
        del a
        assert mem.live == 800 and mem.peak == 4800  # freed: live drops, the peak stays
        c = torch.tensor([1, 2, 3], dtype=torch.int64)  # built outside ATen, handed over by lift_fresh
        assert mem.live == 824
        del b, c
        assert mem.live == 0 and mem.peak == 4800


def test_views_in_place_and_out_are_not_new_memory() -> None:
    with MemoryTracker() as mem:
        x = torch.ones(256)  # 1024 bytes
        y = x.view(16, 16).t()[2:]  # views share the storage
        x.add_(1.0)  # in place
        torch.mul(x, 2.0, out=x)  # out= writes into an existing storage
        assert mem.live == 1024 and mem.peak == 1024
        z = x.clone()
        assert mem.live == 2048
        del x
        assert mem.live == 2048  # y still holds the first storage
        del y, z
        assert mem.live == 0


def test_pre_existing_storages_are_not_counted() -> None:
    before = torch.randn(1000)
    with MemoryTracker() as mem:
        view = before[10:20]
        assert mem.live == 0
        del before, view  # freeing memory allocated outside the tracker changes nothing
        assert mem.live == 0 and mem.peak == 0


def test_peak_of_a_transient_and_reset_peak() -> None:
    with MemoryTracker() as mem:
        x = torch.ones(100)  # 400
        y = (x * 2 + 1).sum()  # x, x*2 and x*2+1 alive at once (1200); then the temporaries go, the sum stays
        assert mem.live == 404 and mem.peak == 1200
        mem.reset_peak()
        assert mem.peak == 404
        del x, y
        assert mem.live == 0 and mem.peak == 404


def test_backward_and_recomputation_are_seen() -> None:
    w = torch.randn(64, 64, requires_grad=True)  # created outside: its gradient is not
    with MemoryTracker() as mem:
        x = torch.randn(8, 64, requires_grad=True)  # 2048
        h = x @ w  # 2048; matmul saves x (and w), not h
        y = h.relu()  # 2048; relu saves its output
        del h
        assert mem.live == 4096
        y.sum().backward()
        # kept: x, y, w.grad (16384), x.grad (2048)
        assert mem.live == 2048 + 2048 + 16384 + 2048
        w.grad = None
        x.grad = None
        del y
        start = mem.live
        z = checkpoint(lambda t: (t @ w).relu() @ w, x, use_reentrant=False)
        assert mem.live == start + 2048  # only the output: the checkpoint keeps nothing it did not get
        mem.reset_peak()
        z.sum().backward()  # recomputes (t @ w).relu() inside backward
        assert mem.peak > start + 2048 + 16384


def test_resident_storages_count_until_freed() -> None:
    """Gradients alive at a step's start count until the loop frees them; then new ones take their place."""
    param = torch.zeros(1000)  # 4,000 bytes, stays alive
    grad = torch.zeros(1000)  # 4,000 bytes, freed during the span
    view = grad[:10]  # a view shares the storage: counted once
    with MemoryTracker(resident=[param, grad, view]) as mem:
        assert mem.live == mem.peak == 8000
        del grad, view  # the training loop's zero_grad(set_to_none=True)
        assert mem.live == 4000
        new = torch.ones(1000)
        assert mem.live == 8000 and mem.peak == 8000  # not 12,000: the old gradient is gone
        del new
    assert param.sum() == 0
