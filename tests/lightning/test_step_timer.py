"""A step's time from two marks: the host clock, or events on a GPU's stream read once the step ran."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_paradyse.lightning.step_timer import Span, mark


def test_host_marks_are_read_at_once() -> None:
    start = mark(torch.device("cpu"))
    time.sleep(0.01)
    span = Span(start, mark(torch.device("cpu")))
    assert span.done()
    assert 0.01 <= span.seconds() < 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_marks_time_the_kernels_between_them() -> None:
    device = torch.device("cuda")
    x = torch.randn(2048, 2048, device=device)
    torch.cuda.synchronize()
    start = mark(device)
    for _ in range(20):
        x = x @ x / 2048
    span = Span(start, mark(device))
    seconds = span.seconds()  # waits for the end mark
    assert span.done() and seconds > 0
