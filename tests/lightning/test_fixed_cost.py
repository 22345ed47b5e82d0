"""The fixed part of a training step: wall time less the priced part, the median of the last steps."""

from __future__ import annotations

import pytest

from lightning_paradyse.lightning import fixed_cost
from lightning_paradyse.lightning.fixed_cost import WINDOW, FixedCost


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    made = Clock()
    monkeypatch.setattr(fixed_cost.time, "perf_counter", made)
    return made


def step(cost: FixedCost, clock: Clock, before: float, priced: tuple[float, ...], after: float) -> None:
    """One training step: ``before`` seconds to the priced part, its pieces (with 1 s between them), ``after``."""
    cost.begin()
    clock.now += before
    for i, seconds in enumerate(priced):
        if i:
            clock.now += 1.0
        cost.enter()
        clock.now += seconds
        cost.leave()
    clock.now += after
    cost.stepped()


def test_the_fixed_part_is_the_wall_time_less_the_priced_part(clock: Clock) -> None:
    cost = FixedCost()
    assert cost.seconds == 0.0  # nothing measured yet
    step(cost, clock, before=0.5, priced=(3.0,), after=0.25)
    assert cost.seconds == pytest.approx(0.75)
    step(cost, clock, before=0.5, priced=(2.0, 2.0), after=0.5)  # two priced pieces, 1 s between them
    assert cost.seconds == pytest.approx(2.0)  # the fit's first step (cold) counts only until another is measured
    step(cost, clock, before=0.5, priced=(1.0,), after=0.5)
    assert cost.seconds == pytest.approx((2.0 + 1.0) / 2)  # median of the steps after the first


def test_the_estimate_settles_on_the_second_measured_step(clock: Clock) -> None:
    # until then the cycle times every training step (on a GPU a synchronisation), later only the logged ones
    cost = FixedCost()
    assert not cost.settled
    step(cost, clock, before=0.5, priced=(3.0,), after=0.25)
    assert not cost.settled  # the fit's first step runs cold: it counts only until another is measured
    cost.begin()
    cost.exclude()  # a step that measures nothing (the step check, or an untimed step) does not settle it
    cost.enter()
    cost.leave()
    cost.stepped()
    assert not cost.settled
    step(cost, clock, before=0.5, priced=(1.0,), after=0.5)
    assert cost.settled
    cost.reset()  # a new fit
    assert not cost.settled


def test_a_wait_for_the_previous_steps_kernels_is_left_out_of_the_estimate(clock: Clock) -> None:
    cost = FixedCost()
    cost.begin()
    cost.waited(0.25)  # a timed step on a GPU waits for the previous step's kernels first
    clock.now += 0.75
    cost.enter()
    clock.now += 3.0
    cost.leave()
    cost.stepped()
    assert cost.seconds == pytest.approx(0.5)


def test_the_decision_is_left_out_of_the_estimate(clock: Clock) -> None:
    cost = FixedCost()
    cost.begin()
    clock.now += 0.75
    cost.decided(0.5)  # of the 0.75 s before the priced part
    cost.enter()
    clock.now += 3.0
    cost.leave()
    clock.now += 0.25
    cost.stepped()
    assert cost.seconds == pytest.approx(0.5)
    cost.decided(9.0)  # outside a training batch: ignored
    step(cost, clock, before=0.5, priced=(1.0,), after=0.0)
    assert cost.seconds == pytest.approx(0.5)


def test_the_estimate_is_the_median_of_the_last_steps_and_ignores_an_outlier(clock: Clock) -> None:
    cost = FixedCost()
    for _ in range(WINDOW - 1):
        step(cost, clock, before=0.1, priced=(1.0,), after=0.1)
    step(cost, clock, before=5.0, priced=(1.0,), after=0.1)  # a cold decision
    assert cost.seconds == pytest.approx(0.2)
    for _ in range(WINDOW):
        step(cost, clock, before=0.3, priced=(1.0,), after=0.1)  # the window moved on
    assert cost.seconds == pytest.approx(0.4)


def test_a_step_without_a_priced_part_or_a_begin_is_not_measured(clock: Clock) -> None:
    cost = FixedCost()
    cost.begin()
    clock.now += 1.0
    cost.stepped()  # e.g. a skipped batch: nothing priced
    cost.stepped()  # no batch begun
    cost.enter()  # entered outside a training batch (no begin): ignored
    clock.now += 1.0
    cost.leave()
    cost.stepped()
    assert cost.seconds == 0.0
    step(cost, clock, before=0.5, priced=(1.0,), after=0.5)
    cost.reset()
    assert cost.seconds == 0.0


def test_the_priced_part_starts_at_its_first_mark(clock: Clock) -> None:
    """When the weights ride on the agreement the cycle marks the priced part before it and again after it: the
    second mark keeps the first."""
    cost = FixedCost()
    cost.begin()
    clock.now += 0.5
    cost.enter()  # before the agreement that gathers the weights
    clock.now += 1.0
    cost.enter()  # after it: no new start
    clock.now += 2.0
    cost.leave()
    cost.stepped()
    assert cost.seconds == pytest.approx(0.5)


def priced_step(cost: FixedCost, clock: Clock, kind: tuple[int, ...], predicted: float, measured: float) -> None:
    """A training step of ``kind`` whose priced part the cost model put at ``predicted`` seconds and took
    ``measured``."""
    cost.begin()
    cost.predicted(kind, predicted)
    cost.enter()
    clock.now += measured
    cost.leave()
    cost.stepped()


def test_the_scale_is_the_median_measured_over_predicted_priced_part_per_kind_of_step(clock: Clock) -> None:
    cost = FixedCost()
    assert cost.scale((1, 1)) == 1.0  # nothing measured yet
    priced_step(cost, clock, (1, 1), predicted=2.0, measured=3.0)
    assert cost.scale((1, 1)) == pytest.approx(1.5)
    assert cost.scale((2,)) == 1.0  # another kind of step keeps its own
    priced_step(cost, clock, (2,), predicted=4.0, measured=2.0)
    assert cost.scale((2,)) == pytest.approx(0.5)
    priced_step(cost, clock, (1, 1), predicted=2.0, measured=5.0)
    assert cost.scale((1, 1)) == pytest.approx(2.5)  # a kind's first step (cold) counts until another is measured
    priced_step(cost, clock, (1, 1), predicted=1.0, measured=1.0)
    priced_step(cost, clock, (1, 1), predicted=1.0, measured=1.5)
    assert cost.scale((1, 1)) == pytest.approx(1.5)  # median of 2.5, 1.0 and 1.5
    for _ in range(WINDOW):
        priced_step(cost, clock, (1, 1), predicted=1.0, measured=1.25)  # the window moved on
    assert cost.scale((1, 1)) == pytest.approx(1.25)
    cost.reset()
    assert cost.scale((1, 1)) == cost.scale((2,)) == 1.0


def test_a_prediction_counts_only_for_the_step_it_was_made_in(clock: Clock) -> None:
    cost = FixedCost()
    cost.predicted((1, 1), 1.0)  # outside a training batch: ignored
    step(cost, clock, before=0.0, priced=(2.0,), after=0.0)
    assert cost.scale((1, 1)) == 1.0
    cost.begin()  # a micro-batch that does not step: its prediction is dropped with it
    cost.predicted((1, 1), 1.0)
    cost.begin()
    cost.enter()
    clock.now += 2.0
    cost.leave()
    cost.stepped()
    assert cost.scale((1, 1)) == 1.0
    cost.begin()  # a step that never entered its priced part (a skipped batch) measures nothing
    cost.predicted((1, 1), 1.0)
    cost.stepped()
    assert cost.scale((1, 1)) == 1.0


def test_a_step_that_ran_the_step_check_measures_nothing(clock: Clock) -> None:
    cost = FixedCost()
    priced_step(cost, clock, (1, 1), predicted=1.0, measured=1.0)
    cost.begin()
    cost.predicted((1, 1), 1.0)
    cost.exclude()  # the step check ran in this step: its forward passes are no cost of the step's
    cost.enter()
    clock.now += 9.0
    cost.leave()
    clock.now += 9.0
    cost.stepped()
    assert cost.scale((1, 1)) == pytest.approx(1.0) and cost.seconds == 0.0
    priced_step(cost, clock, (1, 1), predicted=1.0, measured=2.0)  # the next step is measured again
    assert cost.scale((1, 1)) == pytest.approx(2.0)


def test_lightnings_loop_between_two_steps_counts_unless_an_evaluation_came_between(clock: Clock) -> None:
    cost = FixedCost()
    step(cost, clock, before=0.5, priced=(1.0,), after=0.5)  # the fit's first: counted until another
    clock.now += 0.25  # the loop: the next batch fetched, the hooks before the strategy's
    step(cost, clock, before=0.5, priced=(1.0,), after=0.5)
    assert cost.seconds == pytest.approx(1.25)
    cost.interrupt()  # an evaluation batch ran
    clock.now += 7.0
    step(cost, clock, before=0.5, priced=(1.0,), after=0.5)
    assert cost.seconds == pytest.approx((1.25 + 1.0) / 2)  # counted from its own start
    cost.reset()
    clock.now += 5.0  # a new fit: nothing before its first step counts
    step(cost, clock, before=0.5, priced=(1.0,), after=0.5)
    assert cost.seconds == pytest.approx(1.0)
