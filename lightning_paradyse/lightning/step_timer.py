"""The measured time of a training step, read without a host synchronisation of its own.

On the host a step's time is the clock between its start and its end. On a GPU the host runs ahead of the kernels
it queued: the step ends when the device reaches the end, and waiting for that each step (a synchronisation) would
stop the host from queueing the next step's work meanwhile. So the start and end are marked on the device's
current stream (CUDA events), and a :class:`Span` is read once its end has passed, usually a step later
(:meth:`Span.done` asks without waiting); :meth:`Span.seconds` waits only when asked before that (at the end of a
fit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Span:
    """A step's start and end marks: host clock readings, or events on a GPU's stream."""

    start: float | torch.cuda.Event
    end: float | torch.cuda.Event

    def done(self) -> bool:
        """Whether :meth:`seconds` can be read without waiting (always on the host)."""
        return not isinstance(self.end, torch.cuda.Event) or bool(self.end.query())

    def seconds(self) -> float:
        """Seconds from start to end (on a GPU: waits for the end mark unless :meth:`done`)."""
        if isinstance(self.start, torch.cuda.Event) and isinstance(self.end, torch.cuda.Event):
            self.end.synchronize()
            return float(self.start.elapsed_time(self.end)) / 1e3  # milliseconds
        assert isinstance(self.start, float) and isinstance(self.end, float)
        return self.end - self.start


def mark(device: torch.device) -> float | torch.cuda.Event:
    """A mark now: on a GPU an event recorded on its current stream (reached when the kernels queued before it
    ran), else the host clock."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return time.perf_counter()


__all__ = ["Span", "mark"]
