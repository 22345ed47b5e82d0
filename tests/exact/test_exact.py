"""Every user path, under ParaDySeStrategy on 2 and 3 processes, against plain Lightning in float64.

Each case of :mod:`tests.exact.cases` is trained under the strategy (spawned jobs run them, the 2-rank cases in
:data:`P2_PARTS` jobs, every job the tests collected started together: :func:`jobs`) and in
one plain Lightning process; per-step losses, validation and test losses, every weight of the final
checkpoint and every optimizer state tensor must agree to 1e-9 relative, or the case must be refused with its
named error on every rank. The cases of :func:`~tests.exact.cases.cases_launched` are launched by the strategy
itself from the test's process (its default start method, spawn), each in a fresh pair of workers.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from tests.exact.cases import cases_launched, cases_p2, cases_p2_part, cases_p3, cases_p4, cases_shared_device
from tests.exact.harness import Case, Result, differences, job_cache, run_launched, run_parallel, run_plain
from tests.support.dist import Together, module_items

pytestmark = pytest.mark.dist


def _check(name: str, case: Case, ours: Result) -> list[str]:
    if case.refused is not None:
        if ours.error is None or case.refused not in ours.error:
            return [f"{name}: expected a refusal naming {case.refused!r}, got {ours.error or 'no error'}"]
        return []
    if ours.error is not None:
        return [f"{name}: {ours.error}"]
    if not case.compare:
        return [] if len(ours.losses) == 4 else [f"{name}: trained {len(ours.losses)} steps, not 4"]
    if case.splits is not None and [n for n in ours.groups if n] != [
        len(case.splits[i % len(case.splits)]) for i in range(sum(1 for n in ours.groups if n))
    ]:
        return [f"{name}: ran the group counts {ours.groups}, not the splits {list(case.splits)} in turn"]
    if case.splits is not None and not any(ours.groups):
        return [f"{name}: no step ran on groups"]
    if case.plans is not None and tuple(ours.plans) != case.plans:
        return [f"{name}: ran the plans {ours.plans}, not {list(case.plans)}"]
    if not case.fit and not ours.predictions:
        return [f"{name}: predicted nothing"]
    if case.fit and (not ours.losses or not ours.checkpoint):
        return [f"{name}: recorded {len(ours.losses)} losses and {'a' if ours.checkpoint else 'no'} checkpoint"]
    plain = run_plain(case)
    assert plain.error is None, f"{name}: the plain run failed: {plain.error}"
    assert plain.losses or not case.fit, f"{name}: the plain run trained no step"
    return [f"{name}: {line}" for line in differences(ours, plain)]


P2_PARTS = 2
"""The jobs the 2-rank cases are cut into (:func:`~tests.exact.cases.cases_p2_part`)."""

JOBS = {
    **{f"p2-{k}": (functools.partial(cases_p2_part, k, P2_PARTS), 2) for k in range(P2_PARTS)},
    "p3": (cases_p3, 3),
    "p4": (cases_p4, 4),
}
"""Every spawned job of this module: its cases and its ranks."""

RESULTS = {"results_p2": [f"p2-{k}" for k in range(P2_PARTS)], "results_p3": ["p3"], "results_p4": ["p4"]}
"""Each results fixture's jobs."""


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest) -> Iterator[Together]:
    """The jobs of every results fixture a collected test asks for (by name or as a parameter), started together on
    first use (a job asked for later starts then), each keeping its measured machines apart (:func:`job_cache`).

    One job of 2 ranks leaves about a quarter of 2 cores idle (its ranks wait for each other in the collectives and
    the rendezvous, rank 0 alone writes the checkpoints): the 2-rank cases in two jobs with the 3- and 4-rank ones
    beside them took this file from 271-277 s to 234-273 s (2 cores; two runs before, three after)."""
    asked: set[str] = set()
    for item in module_items(request):
        params = getattr(item, "callspec", None)
        asked |= set(getattr(item, "fixturenames", ()))
        asked |= {value for value in (params.params.values() if params else ()) if isinstance(value, str)}
    with tempfile.TemporaryDirectory(prefix="paradyse-jobs-") as caches:
        calls = {
            name: functools.partial(run_parallel, make, world, 900, job_cache(caches, name))
            for name, (make, world) in JOBS.items()
        }
        with Together(calls) as running:
            for fixture, names in RESULTS.items():
                for name in names if fixture in asked else ():
                    running.start(name)
            yield running


@pytest.fixture(scope="module")
def results_p2(jobs: Together) -> dict[str, Any]:
    return {name: result for job in RESULTS["results_p2"] for name, result in jobs.result(job).items()}


@pytest.fixture(scope="module")
def results_p3(jobs: Together) -> dict[str, Any]:
    return jobs.result("p3")


@pytest.fixture(scope="module")
def results_p4(jobs: Together) -> dict[str, Any]:
    return jobs.result("p4")


@pytest.mark.parametrize("name", list(cases_p2()))
def test_two_processes_equal_plain_lightning(name: str, results_p2: dict[str, Result]) -> None:
    bad = _check(name, cases_p2()[name], results_p2[name])
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", list(cases_p3()))
def test_three_processes_equal_plain_lightning(name: str, results_p3: dict[str, Result]) -> None:
    bad = _check(name, cases_p3()[name], results_p3[name])
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", list(cases_p4()))
def test_four_processes_on_groups_equal_plain_lightning(name: str, results_p4: dict[str, Result]) -> None:
    bad = _check(name, cases_p4()[name], results_p4[name])
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("results", ["results_p2", "results_p4"])
def test_the_default_auto_decides_alike_in_two_runs(results: str, request: pytest.FixtureRequest) -> None:
    """``plan="auto"`` without a profile measures the machine once and caches it: a second run of the same job
    runs the same plans on the same group splits."""
    runs = request.getfixturevalue(results)
    first, again = runs["groups-auto"], runs["groups-auto-again"]
    assert first.error is None and again.error is None, (first.error, again.error)
    assert any(first.groups), f"the default never split the ranks into groups: {first.groups}"
    assert (first.plans, first.groups) == (again.plans, again.groups)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(cases_launched()))
def test_launched_by_the_strategy_equals_plain_lightning(name: str) -> None:
    case = cases_launched()[name]
    bad = _check(name, case, run_launched(case, 2))
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(cases_shared_device()))
def test_ranks_sharing_one_device_equal_plain_lightning(name: str) -> None:
    """``devices=1`` and ``ranks_per_device=2``: the strategy starts two ranks on the one device (gloo)."""
    case = cases_shared_device()[name]
    ours = run_launched(case, 1)
    bad = _check(name, case, ours)
    assert not bad, "\n".join(bad)
    assert ours.world_size == 2, f"{ours.world_size} rank(s) trained on the one device, not 2"
