"""Every mode and random mixed plans against the single-process reference: loss and every gradient.

Each rank runs the plain model on the whole sequence (the reference), then the same weights
parallelized under each plan (uniform plans of every mode, also with recomputation at p <= 2, and
random per-layer, per-op mixed plans with random recompute flags), and compares the loss and every
parameter gradient, consolidated to the plain model's names (``lightning_paradyse.tools.mode_check``). fp32 tolerances
from the issue: 1e-5 relative on the loss, 1e-4 on gradients. Models cover causal GQA with kv heads < p (Llama
kv=2 at p=4, MQA kv=1 at p=3), MHA, a causal GPT with biases and a bidirectional BERT; lengths
divisible and not divisible by p. One spawn per world size keeps the suite fast.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest

from lightning_paradyse.tools.mode_check import CaseResult, CheckSettings, check_worker, format_report
from tests.support.dist import Together, run_distributed

MODELS = ["llama-tiny", "llama-tiny-mqa", "llama-tiny-mha", "gpt-tiny", "bert-tiny"]


def _settings(p: int) -> list[CheckSettings]:
    lengths = (16 * p, 16 * p + 5)  # divisible and not divisible by p (and by 2p)
    return [
        CheckSettings(
            model=m, seq_len=s, batch=1 + (i % 2), plan="all", seed=i, random_plans=3, uniform_recompute=p <= 2
        )
        for i, (m, s) in enumerate((m, s) for m in MODELS for s in lengths)
    ]


def _worker(rank: int, world: int, settings: list[CheckSettings]) -> list[list[CaseResult]]:
    return [check_worker(rank, world, s) for s in settings]


def _assert_all_ok(p: int, settings: list[CheckSettings], results: list[list[CaseResult]]) -> None:
    failures, ran = [], 0
    for s, cases in zip(settings, results):
        report, ok = format_report(cases, s, p)
        ran += sum(c.infeasible is None for c in cases)
        if not ok:
            failures.append(report)
    assert not failures, "\n\n".join(failures)
    assert ran >= len(settings) * 5, f"only {ran} feasible cases ran"


def test_single_process_matches_reference() -> None:
    settings = _settings(1)
    _assert_all_ok(1, settings, _worker(0, 1, settings))


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest) -> Iterator[Together]:
    """The jobs of :func:`test_modes_and_mixed_plans_match_reference`, run side by side."""
    calls = {p: functools.partial(run_distributed, _worker, p, _settings(p), timeout=400) for p in (2, 3, 4)}
    with Together.of(request, "test_modes_and_mixed_plans_match_reference", calls) as started:
        yield started


@pytest.mark.parametrize("p", [2, 3, 4])
def test_modes_and_mixed_plans_match_reference(p: int, jobs: Together) -> None:
    settings = _settings(p)
    results = jobs.result(p)
    _assert_all_ok(p, settings, results[0])
    for rank in range(1, p):  # every rank computed the same errors (same consolidated gradients)
        assert [[c.grad_errs for c in r] for r in results[rank]] == [[c.grad_errs for c in r] for r in results[0]]
