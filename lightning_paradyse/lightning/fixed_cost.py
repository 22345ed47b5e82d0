"""The fixed part of a training step: what the cost model does not price, measured on the run's own steps.

The cost model prices the part of a step that depends on the plan and the split: the weight exchange into the
groups, every group's forward and backward, the gradient return. A step costs more than that: the batch described
and decided, the digest that agrees on it, Lightning's loop and hooks, the optimizer step on this rank's shards.
That part is about the same for every step of a run and every candidate plan, so it changes no decision; on short
steps (a small model, a few hundred tokens) it is most of the step, and a prediction without it is far too low.

:class:`FixedCost` measures it on every training step that steps the optimizer, as the step's wall time (from the
start of the strategy's per-batch cycle to the end of the optimizer step) less the time spent in the priced part
(from the weights moving into the groups, with the agreement when they ride on it, to the end of the gradient
return) and less the step's decision (the split and the plans:
known before the step runs, cold when a length bucket is planned for the first time, warm after), and keeps the
median of the last :data:`WINDOW` steps. The step record adds that estimate and the step's own decision time to
its predictions (``plan/predicted_fixed_s``).

On a GPU the priced part ends where the gradient return's results are read on the host (a synchronisation the return
makes anyway); nothing here synchronises the device.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

WINDOW = 16
"""Training steps the estimate is the median of."""


class FixedCost:
    """Measures the fixed part of the training steps (see the module docstring).

    Per training batch: :meth:`begin` when the cycle starts, :meth:`decided` with the decision's seconds,
    :meth:`enter` and :meth:`leave` around the priced part (several pairs add up), :meth:`stepped` after the
    optimizer step. :attr:`seconds` is the estimate without the decision (0 before the first measured step).
    """

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=WINDOW)
        self._began: float | None = None
        self._entered: float | None = None
        self._priced = 0.0
        self._decided = 0.0

    @property
    def seconds(self) -> float:
        """The median fixed part, decision excluded, of the last :data:`WINDOW` measured steps (0.0 before the
        first)."""
        return statistics.median(self._samples) if self._samples else 0.0

    def begin(self) -> None:
        """A training batch's cycle starts (a micro-batch that does not step starts the next one over)."""
        self._began, self._entered, self._priced, self._decided = time.perf_counter(), None, 0.0, 0.0

    def decided(self, seconds: float) -> None:
        """The batch's decision took ``seconds`` (the record adds them itself: they are known before the step)."""
        if self._began is not None:
            self._decided += seconds

    def enter(self) -> None:
        """The priced part starts (the weights start moving into the groups; once until :meth:`leave`)."""
        if self._began is not None and self._entered is None:
            self._entered = time.perf_counter()

    def leave(self) -> None:
        """The priced part ends (the gradients are back where they belong)."""
        if self._entered is not None:
            self._priced += time.perf_counter() - self._entered
            self._entered = None

    def stepped(self) -> None:
        """The optimizer stepped: the step's fixed part is measured (a batch that never entered the priced part,
        e.g. a skipped one, is not)."""
        began, self._began = self._began, None
        if began is None or self._priced <= 0.0:
            return
        self._samples.append(max(0.0, time.perf_counter() - began - self._priced - self._decided))

    def reset(self) -> None:
        """Forget every measurement (a new fit)."""
        self._samples.clear()
        self._began, self._entered, self._priced, self._decided = None, None, 0.0, 0.0


__all__ = ["WINDOW", "FixedCost"]
