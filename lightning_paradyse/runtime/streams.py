"""The random streams of a training step: the step's own code draws from the process's streams, the model's calls
from a stream of this rank's own.

* **The step's code** (``training_step`` around the model's calls) draws from the process's streams, which are the
  same on every rank (no rank is re-seeded, and the ranks hold the same batches): a branch or a factor it draws
  (``if torch.rand(()) < 0.5``: a task sampled per step) is the same on every rank, and one process's. (Until
  2026-11-30 the whole step drew from the rank's own stream: the ranks took different branches, and a branch that
  called the model on one rank only was a collective mismatch, a crash on gloo and a hang on NCCL.)
* **The model's calls** (a call of a module that owns the parallelized blocks; the outermost one where they nest)
  draw from a stream of this rank's own, seeded from the run's seed, the step, the call and the rank: dropout does not
  drop the same positions of every rank's slice. The process's streams are put back after the call, so dropout
  leaves them as they were, alike on every rank (one process's dropout advances them: after a model with dropout,
  what the step draws is no longer one process's draw, but it is still the same on every rank).

A tensor the step draws in the shape of its slice (a masking ``torch.rand(ids.shape)``) is not one process's draw for
the batch whatever the stream: the step check refuses such a step (:mod:`~lightning_paradyse.lightning.
step_check`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

RngState = tuple[torch.Tensor, torch.Tensor | None]
"""The host's torch stream and the device's (``None`` on the host)."""


def _cuda_index(device: torch.device | None) -> int | None:
    if device is None or device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def rng_state(device: torch.device | None) -> RngState:
    """The host's torch stream and ``device``'s (a GPU's; none on the host)."""
    index = _cuda_index(device)
    return torch.get_rng_state(), None if index is None else torch.cuda.get_rng_state(index)


def set_rng_state(state: RngState, device: torch.device | None) -> None:
    """Put back what :func:`rng_state` returned."""
    torch.set_rng_state(state[0])
    index = _cuda_index(device)
    if index is not None and state[1] is not None:
        torch.cuda.set_rng_state(state[1], index)


def seed_streams(seed: int, device: torch.device | None) -> None:
    """Seed the host's torch stream and ``device``'s (these generators only: ``torch.manual_seed`` visits every
    device)."""
    torch.default_generator.manual_seed(seed)
    index = _cuda_index(device)
    if index is not None:
        torch.cuda.default_generators[index].manual_seed(seed)


def stream_seed(seed: int, rank: int, step: int, call: int) -> int:
    """The seed of rank ``rank``'s stream for call ``call`` of training step ``step`` (reproducible on resume)."""
    return (seed * 1_000_003 + step * 8_191 + call * 131_071 + rank + 1) % (2**63)


@dataclass
class CallStreams:
    """Which stream the model's calls draw from (module docstring): this rank's own during a training step on several
    ranks (:meth:`step`), the process's otherwise."""

    seed: int | None = None
    """The run's seed while a training step runs on several ranks (``None``: the calls draw from the process's)."""
    rank: int = 0
    step: int = 0
    device: torch.device | None = None
    calls: int = 0
    """The model's calls so far in this step (each its own stream)."""
    saved: list[RngState | None] = field(default_factory=list)
    """The process's streams, one entry per model call running (``None`` for a call nested in another)."""

    @contextmanager
    def step_of(self, seed: int, rank: int, step: int, device: torch.device) -> Iterator[None]:
        """Inside: the model's calls draw from this rank's streams; the process's streams are as the step leaves them
        after it (a call that raised has its process's streams put back here too)."""
        self.seed, self.rank, self.step, self.device, self.calls, self.saved = seed, rank, step, device, 0, []
        try:
            yield
        finally:
            first = next((s for s in self.saved if s is not None), None)
            if first is not None:  # a call that never returned
                set_rng_state(first, self.device)
            self.seed, self.saved = None, []

    def enter(self) -> None:
        """A model call begins: the outermost one switches to this rank's stream for the call."""
        if self.seed is None or any(s is not None for s in self.saved):
            self.saved.append(None)
            return
        self.saved.append(rng_state(self.device))
        seed_streams(stream_seed(self.seed, self.rank, self.step, self.calls), self.device)
        self.calls += 1

    def exit(self) -> None:
        """A model call ends (or raised): the process's streams back where the outermost call switched."""
        if not self.saved:
            return
        state = self.saved.pop()
        if state is not None:
            set_rng_state(state, self.device)


__all__ = ["CallStreams", "RngState", "rng_state", "seed_streams", "set_rng_state", "stream_seed"]
