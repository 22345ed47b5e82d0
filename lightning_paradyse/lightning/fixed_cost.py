"""The fixed part of a training step: what the cost model does not price, measured on the run's own steps.

The cost model prices the part of a step that depends on the plan and the split: the weight exchange into the
groups, every group's forward and backward, the gradient return. A step costs more than that: the batch described
and decided, the digest that agrees on it, Lightning's loop and hooks, the optimizer step on this rank's shards.
That part is about the same for every step of a run and every candidate plan, so it changes no decision; on short
steps (a small model, a few hundred tokens) it is most of the step, and a prediction without it is far too low.

:class:`FixedCost` measures it on every training step that steps the optimizer, as the step's wall time (from the end
of the previous training step's optimizer step, so that Lightning's loop between two steps counts, its fetch of the
batch and its hooks; from the start of the strategy's per-batch cycle when an evaluation batch, a replica check, a
checkpoint's consolidation (:meth:`FixedCost.interrupt`), a micro-batch that did not step, a skipped batch or nothing
came before; to the end of the optimizer step) less the time spent in the priced part
(from the weights moving into the groups, with the agreement when they ride on it, to the end of the gradient
return) and less the step's decision (the split and the plans:
known before the step runs, cold when a length bucket is planned for the first time, warm after), and keeps the
median of the last :data:`WINDOW` steps (the fit's first step, which runs cold: the optimizer's first step makes its
state, Lightning's loop and the hooks run for the first time, counts only until another is measured). A step that
ran the step check (its extra forward passes) is not measured at all (:meth:`FixedCost.exclude`). The step
record adds that estimate and the step's own decision time to its predictions (``plan/predicted_fixed_s``).

The priced part itself runs slower or faster than the cost model says on a loaded machine: ranks that reach a
collective apart, processes that share cores, a GPU that other ranks share. :class:`FixedCost` keeps, per kind of
step (the cycle's key: the group sizes, ``(1, 1)`` for a data-parallel step of two ranks, ``(2,)`` for one group of
both, and how the step was priced and entered), the median of the measured priced part over the predicted one on the
last :data:`WINDOW` such steps (the first, cold, again only until another): :meth:`FixedCost.scale`. The step record
multiplies its priced prediction by it (``plan/predicted_scale``). Only the reported prediction is corrected. The
decisions price the cost model alone: a rerun on the same machine decides alike, and no rank's own measurement can
make it decide apart from the others.

Only timed steps are measured: the fit's first ones until a step after the cold first is (:attr:`FixedCost.settled`),
then the steps the logger logs (every ``log_every_n_steps``). On a GPU such a step starts by waiting for the previous
step's kernels (which an untimed step does not wait for; the wait is left out, :meth:`FixedCost.waited`) and its
priced part ends where the device has finished it (the gradient return waits for it), which the other steps do not
wait for. Nothing here synchronises the device. Which steps are timed is the same on every rank.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Hashable

WINDOW = 16
"""Training steps the estimate is the median of."""


class FixedCost:
    """Measures the fixed part of the training steps (see the module docstring).

    Per training batch: :meth:`begin` when the cycle starts, :meth:`decided` with the decision's seconds,
    :meth:`enter` and :meth:`leave` around the priced part (several pairs add up), :meth:`predicted` with the
    cost model's seconds of that part, :meth:`exclude` when the step check runs in it or the step is not timed,
    :meth:`stepped` after the
    optimizer step; :meth:`interrupt` when something else ran between two steps (an evaluation batch, a replica
    check, a checkpoint). :attr:`seconds` is the estimate without the decision (0 before the first measured step);
    :meth:`scale` the measured over the predicted priced part of a kind of step (1 before the first).
    """

    def __init__(self) -> None:
        self._samples = _Window()
        self._ratios: dict[Hashable, _Window] = {}
        self._began: float | None = None
        self._entered: float | None = None
        self._priced = 0.0
        self._decided = 0.0
        self._waited = 0.0
        self._predicted: tuple[Hashable, float] | None = None
        self._excluded = False
        self._last: float | None = None

    @property
    def seconds(self) -> float:
        """The median fixed part, decision excluded, of the last :data:`WINDOW` measured steps (the fit's first only
        until another is measured; 0.0 before the first)."""
        return self._samples.median(0.0)

    @property
    def settled(self) -> bool:
        """Whether the estimate stands on a step after the fit's first (cold) one: until then every training step is
        timed (:meth:`~lightning_paradyse.lightning.cycle.StepCycle.after_backward`), later only the logged ones."""
        return len(self._samples) > 1

    def scale(self, kind: Hashable) -> float:
        """The median of measured over predicted priced seconds of the last :data:`WINDOW` steps of this ``kind``
        (the kind's first only until another is measured; 1.0 before the first)."""
        ratios = self._ratios.get(kind)
        return 1.0 if ratios is None else ratios.median(1.0)

    def begin(self) -> None:
        """A training batch's cycle starts (a micro-batch that does not step starts the next one over). Its step
        counts from the end of the previous one when that stepped and nothing came between (:meth:`interrupt`)."""
        began, self._last = self._last, None
        self._began = time.perf_counter() if began is None else began
        self._entered, self._priced, self._decided, self._waited = None, 0.0, 0.0, 0.0
        self._predicted, self._excluded = None, False

    def interrupt(self) -> None:
        """Something else ran since the last step (an evaluation batch, a replica check, a checkpoint): the next step
        counts from its own start."""
        self._last = None

    def predicted(self, kind: Hashable, seconds: float) -> None:
        """The cost model's seconds of this step's priced part, a step of ``kind``."""
        if self._began is not None:
            self._predicted = (kind, seconds)

    def exclude(self) -> None:
        """This step measures nothing (the step check runs in it: extra forward passes; or it is not timed:
        its priced part's end was not waited for)."""
        self._excluded = True

    def waited(self, seconds: float) -> None:
        """The step waited ``seconds`` for the device to finish the previous step's kernels (a timed step, on a GPU):
        left out of the estimate, as the decision is."""
        if self._began is not None:
            self._waited += seconds

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
        predicted, self._predicted = self._predicted, None
        now = time.perf_counter()
        self._last = now  # the next training step counts from here
        if began is None or self._priced <= 0.0 or self._excluded:
            return
        self._samples.append(max(0.0, now - began - self._priced - self._decided - self._waited))
        if predicted is not None and predicted[1] > 0.0:
            kind, seconds = predicted
            self._ratios.setdefault(kind, _Window()).append(self._priced / seconds)

    def reset(self) -> None:
        """Forget every measurement (a new fit)."""
        self._samples = _Window()
        self._ratios.clear()
        self._began, self._entered, self._priced, self._decided, self._waited = None, None, 0.0, 0.0, 0.0
        self._predicted, self._excluded, self._last = None, False, None


class _Window:
    """The last :data:`WINDOW` samples of a fit, less its first once there is another: the first step of a fit (the
    optimizer makes its state, the loop runs for the first time) and the first of a kind of step (a group's first
    collectives, first buffers) run cold."""

    def __init__(self) -> None:
        self._first: float | None = None
        self._rest: deque[float] = deque(maxlen=WINDOW)

    def append(self, value: float) -> None:
        if self._first is None and not self._rest:
            self._first = value
        else:
            self._rest.append(value)

    def __len__(self) -> int:
        return (self._first is not None) + len(self._rest)

    def median(self, default: float) -> float:
        if self._rest:
            return statistics.median(self._rest)
        return default if self._first is None else self._first


__all__ = ["WINDOW", "FixedCost"]
