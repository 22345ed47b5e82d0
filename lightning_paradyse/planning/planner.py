"""The cost-model planner: the fastest plan for a batch within a per-rank memory budget.

:class:`CostPlanner` implements the strategy's ``Planner`` protocol (``plan(seq_len, batch) -> Plan``).
For each batch it builds the cost tables of the :class:`~lightning_paradyse.cost.model.CostModel` and
solves them exactly (:func:`lightning_paradyse.cost.search.solve`): every per-layer, per-op assignment
of the allowed modes and recompute flags is implicitly considered, not a greedy subset.

**Length buckets.** Plans are cached per ``(bucket, batch)``, where the bucket of a length ``s`` is
``ceil(s / bucket_tokens) * bucket_tokens`` (default 512 tokens) and the plan is computed for the
bucket's upper end: memory grows with the length, so that plan fits every length of the bucket (but for
the padded buffers of a length the ranks split unevenly, which the upper end's even split does not have:
on the benchmark's model at 2-4 ranks, at most 0.6% of the budget over), and a new plan is searched only
once per bucket. Batches of ``b`` sequences are bucketed alike, by the next power of two.

**Near the budget**, where the buckets' upper end does not fit but the shape itself might, the shape is
planned for its own length and the upper end of its *fine* row bucket (the power-of-two bucket cut in
eight), or for the most rows of its fine bucket that fit: shapes near the budget share a few searches,
and a shape is found feasible exactly when its own search would find it so. Lengths are not cut finer:
the padded buffers of an uneven split make a length's memory not always grow with it. On one rank (a group of
one: nothing is split) it does, and a shape that did not fit rules out every longer one with as many rows
without a search.

**Determinism.** The inputs (model dimensions, profile or cluster, budget, length, batch) are the same
on every rank and the search breaks ties deterministically, so every rank computes the same plan
without communicating; a process keeps what its searches found for planners alike (the same cost model, budget and
options: every fit, validation and test call makes its planners anew), so each shape is searched once per process.
**Infeasibility** is detected in that computation, i.e. on every rank before
any collective of the step: :class:`PlanInfeasible` names the length, the budget and the least memory
any plan needs; with ``on_infeasible="skip"`` it is :class:`PlanSkipped` instead (a subclass, counted in
``skipped``, logged as a warning) so that the caller can skip the batch.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch.nn as nn

from lightning_paradyse.calibration.profile import Profile, load_profile
from lightning_paradyse.cost.cluster import Cluster, load_cluster
from lightning_paradyse.cost.dims import ModelDims, dims_from_config, dims_from_module
from lightning_paradyse.cost.model import CostModel, OpCalibration
from lightning_paradyse.cost.search import PlanProblem, Solution, evaluate, min_peak, solve
from lightning_paradyse.cost.time import Machine
from lightning_paradyse.models import ModelConfig
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan, uniform_plan
from lightning_paradyse.runtime.parallel import feasible_modes

log = logging.getLogger(__name__)

GiB = 2**30


def format_bytes(n: float) -> str:
    """``12.3 GiB``-style sizes for messages."""
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


class PlanInfeasible(ValueError):
    """No plan fits the memory budget for a batch. ``missing``: the memory-saving options the planner was not
    allowed (``recompute``, ``metp``), named in the fix."""

    def __init__(
        self, seq_len: int, batch: int, budget: int, minimum: int | None, missing: Sequence[str] = ("recompute", "metp")
    ) -> None:
        self.seq_len, self.batch, self.budget, self.minimum = seq_len, batch, budget, minimum
        least = (
            "no allowed mode can run"
            if minimum is None
            else f"the smallest any plan needs is {format_bytes(minimum)} ({minimum} bytes)"
        )
        more = f", or allow {' and '.join(missing)}" if missing else ""
        super().__init__(
            f"no plan fits a batch of {batch} x {seq_len} tokens in the memory budget of {format_bytes(budget)} "
            f"({budget} bytes) per rank: {least}. Use shorter sequences, more ranks or a larger memory_budget{more}."
        )


class PlanSkipped(PlanInfeasible):
    """A :class:`PlanInfeasible` for a batch the caller chose to skip (``on_infeasible="skip"``)."""


@dataclass(frozen=True)
class PlannedStep:
    """A plan with its predicted cost."""

    plan: Plan
    time_s: float
    """Predicted seconds of the step."""
    peak_bytes: int
    """Predicted peak bytes per rank."""
    seq_len: int
    """The length the plan was computed for (the bucket's upper end, or the length itself)."""
    batch: int = 1
    """The sequences the plan was computed for (the batch bucket's upper end, or the batch itself)."""


def to_plan(problem: PlanProblem, seq: Sequence[int]) -> Plan:
    """The :class:`Plan` of a solution's choice indices (attention, MLP per layer)."""
    ops = [OpPlan(problem.choices[c].mode, problem.choices[c].recompute) for c in seq]
    return Plan(tuple(LayerPlan(ops[i], ops[i + 1]) for i in range(0, len(ops), 2)))


class CostPlanner:
    """Exact cost-model planner with a per-bucket cache (see the module docstring).

    Args:
        model: The cost model (model dimensions, group size, machine or profile).
        budget_bytes: Per-rank memory budget in bytes.
        modes: The modes the planner may use.
        recompute: The recompute flags it may use (``(False, True)``: both).
        allowed: Per op ``(attention modes, MLP modes)`` the model can run (default: from the model's
            dimensions; pass ``lightning_paradyse.runtime.parallel.feasible_modes`` for a parallelized module).
        bucket_tokens: Width of a length bucket.
        on_infeasible: ``raise`` (:class:`PlanInfeasible`) or ``skip`` (:class:`PlanSkipped`, counted).
        prefer_tp_sp: Take ``tp_sp`` everywhere (no recomputation) when it fits and is predicted at most this
            fraction slower than the fastest plan. The uncalibrated model measured at setup leaves the per-op
            overheads out, which are largest for ``ring`` and ``metp`` (many small calls): without a profile the
            strategy sets 0.25 so that a short batch is not given a mode that only looks faster on paper. A group
            of one rank takes ``math.inf`` (:data:`ONE_RANK_PREFER_TP_SP`): ``tp_sp`` whenever it fits.
    """

    def __init__(
        self,
        model: CostModel,
        budget_bytes: int,
        modes: Sequence[str] = tuple(MODES),
        recompute: Sequence[bool] = (False, True),
        allowed: tuple[Sequence[str], Sequence[str]] | None = None,
        bucket_tokens: int = 512,
        on_infeasible: str = "raise",
        prefer_tp_sp: float = 0.0,
    ) -> None:
        if on_infeasible not in ("raise", "skip"):
            raise ValueError(f"on_infeasible must be 'raise' or 'skip', got {on_infeasible!r}")
        if bucket_tokens < 1 or budget_bytes < 1:
            raise ValueError(f"bucket_tokens and budget_bytes must be positive, got {bucket_tokens}, {budget_bytes}")
        self.model, self.budget = model, int(budget_bytes)
        self.modes, self.recompute = tuple(modes), tuple(recompute)
        base = model.allowed_modes(self.modes)
        chosen = allowed if allowed is not None else base
        self.allowed: tuple[tuple[str, ...], tuple[str, ...]] = (
            tuple(m for m in self.modes if m in chosen[0]),
            tuple(m for m in self.modes if m in chosen[1]),
        )
        if not self.allowed[0] or not self.allowed[1]:
            raise ValueError(f"no allowed mode can run the attention {self.allowed[0]} / MLP {self.allowed[1]}")
        self.bucket_tokens, self.on_infeasible = bucket_tokens, on_infeasible
        self.prefer_tp_sp = float(prefer_tp_sp)
        self.skipped = 0
        """Batches skipped because no plan fit (``on_infeasible="skip"``)."""
        self._cache: dict[tuple[int, int], PlannedStep] = {}
        self._infeasible: set[tuple[int, int]] = set()
        self._too_many: dict[int, int] = {}
        """Per planned length, the fewest rows known not to fit (more rows of it need more memory: not searched); a
        group of one rank keeps :attr:`_stairs` instead."""
        self._length_grows = model.p == 1
        """A group of one rank: its memory grows with the length too (no split, so no padded buffer of an uneven
        one), and a shape that did not fit rules out every longer one with as many rows."""
        self._stairs: tuple[list[int], list[int]] = ([], [])
        """With :attr:`_length_grows`: the lengths of failures no other rules out, ascending, and their rows,
        descending (:meth:`_fewest_failing` reads the last at or below a length)."""
        self._least: dict[tuple[int, int], int | None] = {}
        self._frontiers: dict[tuple[int, int], int] = {}
        """Per length and fine row bucket, the most rows that fit in it (:meth:`_frontier`)."""
        self._solved = _solutions(
            (repr(model), self.budget, self.modes, self.recompute, self.allowed, self.prefer_tp_sp)
        )
        """Every shape this process searched for a planner of the same cost model, budget and options
        (:func:`_solutions`): what :meth:`_solve` found there, searched once."""

    def bucket(self, seq_len: int) -> int:
        """The upper end of ``seq_len``'s bucket: the next power of two up to ``bucket_tokens`` (a short batch is not
        planned as if it were ``bucket_tokens`` long: its best mode differs), multiples of ``bucket_tokens`` beyond."""
        if seq_len <= self.bucket_tokens:
            return min(self.bucket_tokens, 1 << max(0, seq_len - 1).bit_length())
        return math.ceil(seq_len / self.bucket_tokens) * self.bucket_tokens

    def bucket_start(self, seq_len: int) -> int:
        """The lower end of ``seq_len``'s bucket, itself not in it: the bucket below's upper end (0 for the first)."""
        top = self.bucket(seq_len)
        if top > self.bucket_tokens:
            return top - self.bucket_tokens
        return 0 if top == 1 else 1 << ((top - 1).bit_length() - 1)

    @staticmethod
    def bucket_rows(batch: int) -> int:
        """The upper end of ``batch``'s bucket of sequences: the next power of two (a step of 37 rows is planned
        for 64; every batch size between two powers of two shares one search)."""
        return 1 << max(0, batch - 1).bit_length()

    @staticmethod
    def fine_rows(batch: int) -> int:
        """The upper end of ``batch``'s fine bucket: its coarse bucket (:meth:`bucket_rows`) cut in ``FINE`` equal
        steps (37 rows are planned as 40). Where the coarse buckets' upper end does not fit the budget, the shapes
        of one length near it share this search. Lengths have no fine buckets: memory grows with the rows, but
        not always with the length (a length the ranks split unevenly pays padded buffers that a longer, even
        one does not)."""
        step, low = CostPlanner._fine_step(batch), CostPlanner.bucket_rows(batch) // 2
        return batch if step < 1 else low + math.ceil((batch - low) / step) * step

    @staticmethod
    def _fine_step(batch: int) -> int:
        """Rows in one fine step of ``batch``'s coarse bucket (0: the bucket has fewer than ``FINE`` rows)."""
        top = CostPlanner.bucket_rows(batch)
        return (top - top // 2) // FINE

    def coarse(self, seq_len: int, batch: int) -> tuple[int, int]:
        """The upper ends of the shape's coarse buckets: ``(bucket(seq_len), bucket_rows(batch))``."""
        return self.bucket(seq_len), self.bucket_rows(batch)

    def problem(self, seq_len: int, batch: int, modes: Sequence[str] | None = None) -> PlanProblem:
        """The cost tables for a batch shape (restricted to ``modes`` if given)."""
        use = self.modes if modes is None else tuple(m for m in self.modes if m in modes)
        allowed = (tuple(m for m in use if m in self.allowed[0]), tuple(m for m in use if m in self.allowed[1]))
        return self.model.problem(seq_len, batch, use, self.recompute, allowed)

    def step(self, seq_len: int, batch: int) -> PlannedStep:
        """The plan for a batch with its predicted time and peak, cached per bucket: planned for the upper ends of
        the length's and the batch's buckets (its peak bounds the real shape's, which needs no more memory), or,
        when that shape does not fit the budget, for the batch itself."""
        found = self.try_step(seq_len, batch, prune=False)
        return found if found is not None else self._fail(seq_len, batch)

    def try_step(self, seq_len: int, batch: int, prune: bool = True) -> PlannedStep | None:
        """:meth:`step`, or ``None`` when no plan fits (nothing counted, logged or explained: what a caller weighing
        shapes, such as the group cost, asks). ``prune``: a shape with more rows of a length that did not fit is
        not searched (memory grows with the rows); :meth:`step` searches every batch it is given.

        The shapes tried, the first that fits taken: the coarse buckets' upper ends, the length with the fine
        bucket's rows (:meth:`fine_rows`), then the most rows of the length that fit in the fine bucket
        (:meth:`_frontier`: every batch of the length near the budget shares that search)."""
        if seq_len < 1 or batch < 1:
            raise ValueError(f"seq_len and batch must be positive, got {seq_len}, {batch}")
        fine = self.fine_rows(batch)
        for key in dict.fromkeys((self.coarse(seq_len, batch), (seq_len, fine))):
            if key not in self._cache and prune and self._too_many_rows(key):
                continue
            found = self._search(key)
            if found is not None:
                return found
        if prune and self._too_many_rows((seq_len, batch)):
            return None
        most = self._frontier(seq_len, batch)
        if most >= batch:
            return self._search((seq_len, most))
        return None if prune else self._search((seq_len, batch))  # a batch to run: its own shape, to be sure

    def warm(self, max_tokens: int) -> int:
        """Plan ahead every bucket a short batch can fall in (what :meth:`step` would plan on first sight, so every
        later decision is the same): lengths of ``p`` tokens up to ``bucket_tokens`` (the powers of two), rows
        doubling while ``length * rows <= max_tokens`` and the shape fits the budget. Returns the shapes planned."""
        planned, power = 0, 1 << max(0, self.model.p - 1).bit_length()  # a group needs a token a rank
        while power < 2 * self.bucket_tokens and self.model.p <= self.bucket_tokens:
            length, power = min(power, self.bucket_tokens), 2 * power  # the buckets of :meth:`bucket`
            rows = 1
            while length * rows <= max_tokens and not self._too_many_rows((length, rows)):
                known = (length, rows) in self._cache or (length, rows) in self._infeasible
                planned += not known
                if self._search((length, rows)) is None:
                    break
                rows *= 2
        return planned

    def _search(self, key: tuple[int, int]) -> PlannedStep | None:
        """The plan of the shape ``key``: cached, or searched once (``None``, remembered, when nothing fits)."""
        if key in self._cache:
            return self._cache[key]
        if key in self._infeasible:
            return None
        found = self._solve(*key)
        if found is None:
            self._infeasible.add(key)
            self._did_not_fit(*key)
        else:
            self._cache[key] = found
        return found

    def _frontier(self, seq_len: int, batch: int) -> int:
        """The most rows of ``seq_len`` tokens that fit in ``batch``'s fine bucket (:meth:`fine_rows`), 0 if none:
        found by bisection, ``batch`` itself tried first (memory grows with the rows), once per length and bucket,
        so that every batch of the length in the bucket shares one search."""
        top = self.fine_rows(batch)
        if (seq_len, top) not in self._frontiers:
            low = top - max(1, self._fine_step(batch))  # the fine bucket is (low, top]
            # rows <= lo fit (or lo is the bucket's lower end), rows >= hi do not (known ones not searched again)
            lo, hi = low, min(top + 1, self._fewest_failing(seq_len, top + 1))
            mid = batch if batch < hi else (lo + hi) // 2
            while hi - lo > 1:
                if self._search((seq_len, mid)) is None:
                    hi = mid
                else:
                    lo = mid
                mid = (lo + hi) // 2
            self._frontiers[seq_len, top] = 0 if lo == low else lo
        return self._frontiers[seq_len, top]

    def _too_many_rows(self, key: tuple[int, int]) -> bool:
        """Whether the shape ``key`` has at least as many rows as a shape that did not fit, of its length or, for a
        group of one rank, of any length up to its own."""
        return key[1] >= self._fewest_failing(key[0], key[1] + 1)

    def _fewest_failing(self, seq_len: int, default: int) -> int:
        """The fewest rows known not to fit at ``seq_len`` tokens (``default`` when none is known): a shape of the
        length that did not fit, or for a group of one rank (:attr:`_length_grows`) one of any length up to it."""
        if not self._length_grows:
            return self._too_many.get(seq_len, default)
        lengths, fewest = self._stairs
        i = bisect.bisect_right(lengths, seq_len)
        return fewest[i - 1] if i else default

    def _did_not_fit(self, seq_len: int, rows: int) -> None:
        """Remember that ``rows`` rows of ``seq_len`` tokens do not fit (and, on one rank, nothing longer with as many
        rows: the staircase :attr:`_stairs` keeps the failures no other one rules out)."""
        if not self._length_grows:
            self._too_many[seq_len] = min(rows, self._too_many.get(seq_len, rows))
            return
        if rows >= self._fewest_failing(seq_len, rows + 1):  # ruled out already
            return
        lengths, fewest = self._stairs
        i = j = bisect.bisect_left(lengths, seq_len)
        while j < len(lengths) and fewest[j] >= rows:  # longer failures with as many rows: ruled out by this one
            j += 1
        lengths[i:j], fewest[i:j] = [seq_len], [rows]

    def plan(self, seq_len: int, batch: int) -> Plan:
        """The fastest plan within the budget for ``batch`` sequences of ``seq_len`` tokens."""
        return self.step(seq_len, batch).plan

    def _solve(self, seq_len: int, batch: int) -> PlannedStep | None:
        """The fastest plan of exactly ``batch`` rows of ``seq_len`` tokens within the budget (``None``: none fits),
        searched once per process for planners alike (:attr:`_solved`)."""
        key = (seq_len, batch)
        if key not in self._solved:
            self._solved[key] = self._search_plan(seq_len, batch)
        return self._solved[key]

    def _search_plan(self, seq_len: int, batch: int) -> PlannedStep | None:
        problem = self.problem(seq_len, batch)
        simple = self._simple(problem, seq_len, batch) if self.prefer_tp_sp > 0 else None
        if simple is not None and self.prefer_tp_sp == math.inf:  # taken whenever it fits: nothing to search
            return simple
        found = solve(problem, self.budget)
        if found is None:
            return None
        if simple is not None and simple.time_s <= found.time * (1 + self.prefer_tp_sp):
            return simple
        return PlannedStep(to_plan(problem, found.seq), found.time, found.peak, seq_len, batch)

    def _simple(self, problem: PlanProblem, seq_len: int, batch: int) -> PlannedStep | None:
        """``tp_sp`` everywhere without recomputation, priced on ``problem`` (the shape's cost tables), when the
        planner may use it and it fits the budget."""
        choice = next((c for c, ch in enumerate(problem.choices) if (ch.mode, ch.recompute) == ("tp_sp", False)), None)
        if choice is None or any(choice not in allowed for allowed in problem.allowed):
            return None
        time_s, peak = evaluate(problem, [choice] * len(problem.ops))
        if peak > self.budget:
            return None
        return PlannedStep(uniform_plan("tp_sp", self.model.dims.n_layers), time_s, peak, seq_len, batch)

    def minimum(self, seq_len: int, batch: int, modes: Sequence[str] | None = None) -> Solution | None:
        """The plan needing the least memory (its peak is the smallest any plan needs)."""
        return min_peak(self.problem(seq_len, batch, modes))

    def _fail(self, seq_len: int, batch: int) -> PlannedStep:
        key = (seq_len, batch)
        if key not in self._least:  # the error's "least memory any plan needs", computed once per shape
            least = self.minimum(seq_len, batch)
            self._least[key] = None if least is None else least.peak
        error_type = PlanSkipped if self.on_infeasible == "skip" else PlanInfeasible
        options = (("recompute", True in self.recompute), ("metp", "metp" in self.modes))
        missing = [name for name, allowed in options if not allowed]  # what the fix may name
        error = error_type(seq_len, batch, self.budget, self._least[key], missing)
        if self.on_infeasible == "skip":
            self.skipped += 1
            log.warning("skipping the batch (%d so far): %s", self.skipped, error)
        raise error

    def fits(self, seq_len: int, batch: int, modes: Sequence[str] | None = None) -> bool:
        """Whether some plan (using only ``modes`` if given) fits the budget."""
        least = self.minimum(seq_len, batch, modes)
        return least is not None and least.peak <= self.budget

    def largest_length(self, batch: int = 1, modes: Sequence[str] | None = None, limit: int = 2**24) -> int:
        """The largest length some plan (using only ``modes``) fits, 0 if none; at most ``limit``."""
        return largest_true(lambda s: self.fits(s, batch, modes), self.model.p, limit)

    def __repr__(self) -> str:
        return (
            f"CostPlanner(p={self.model.p}, budget={format_bytes(self.budget)}, modes={list(self.modes)}, "
            f"bucket_tokens={self.bucket_tokens}, cached={len(self._cache)})"
        )


FINE = 8
"""Fine row buckets per coarse one (:meth:`CostPlanner.fine_rows`)."""


SOLVED_CONFIGS = 16
"""Planner configurations whose searches a process keeps (:func:`_solutions`), the least recently made dropped."""

_SOLVED: OrderedDict[tuple[Any, ...], dict[tuple[int, int], PlannedStep | None]] = OrderedDict()


def _solutions(config: tuple[Any, ...]) -> dict[tuple[int, int], PlannedStep | None]:
    """The shapes searched so far in this process for a planner of ``config`` (the cost model's ``repr``, which
    names every field of it, the budget, the modes, the recompute flags, the allowed modes per op and
    ``prefer_tp_sp``: everything a search reads) and what each search found.

    A search is a pure function of these, so a planner made again for the same model and machine (every fit,
    validation or test call sets one up, and warms it: :meth:`CostPlanner.warm`) finds its plans here rather than
    searching them again; a different budget or profile is another configuration. Per process: ranks still plan
    alike, each computing what the others compute."""
    found = _SOLVED.pop(config, None)
    _SOLVED[config] = {} if found is None else found  # the most recently made last
    while len(_SOLVED) > SOLVED_CONFIGS:
        _SOLVED.popitem(last=False)
    return _SOLVED[config]


def forget_solutions() -> None:
    """Drop every kept search (:func:`_solutions`): the next planner searches every shape itself."""
    _SOLVED.clear()


def _source_model(dims: ModelDims, p: int, source: Any, **model_kwargs: Any) -> CostModel:

    if isinstance(source, Machine):  # measured or described rates, nothing calibrated per op
        return CostModel(dims, p, source, **model_kwargs)
    if isinstance(source, (str, Path)):
        path = Path(source)
        is_profile = path.suffix == ".json" and '"calibration"' in path.read_text()
        source = load_profile(path) if is_profile else load_cluster(path)
    if isinstance(source, Profile):
        if source.p != p:
            raise ValueError(f"the profile was measured on {source.p} ranks but the group has {p}; profile again")
        return source.cost_model(dims, **model_kwargs)
    if isinstance(source, Cluster):
        model_kwargs.setdefault("optimizer_bytes_per_param", source.optimizer_bytes_per_param)
        return CostModel(dims, p, source.machine(), **model_kwargs)
    raise TypeError(
        f"source must be a Profile, a Cluster, a Machine or a path to a profile or cluster file, "
        f"got {type(source).__name__}"
    )


def make_planner(
    model: nn.Module | ModelConfig | ModelDims,
    p: int,
    budget_bytes: int,
    source: Any,
    modes: Sequence[str] = tuple(MODES),
    **kwargs: Any,
) -> CostPlanner:
    """A :class:`CostPlanner` for a parallelized module, a model config or dimensions.

    ``source`` is a :class:`~lightning_paradyse.calibration.profile.Profile`, a
    :class:`~lightning_paradyse.cost.cluster.Cluster`, a :class:`~lightning_paradyse.cost.time.Machine`
    (e.g. :func:`~lightning_paradyse.calibration.quick.quick_machine`), or a path to a JSON profile or a cluster file.
    For a parallelized module the dimensions come from its dispatch modules' specs and the allowed
    modes per op from :func:`lightning_paradyse.runtime.parallel.feasible_modes` (every layer must allow them).
    ``kwargs`` go to :class:`CostPlanner` (``recompute``, ``bucket_tokens``, ``on_infeasible``, ``prefer_tp_sp``) or to
    :class:`~lightning_paradyse.cost.model.CostModel` (``optimizer_bytes_per_param``, ``switch_s``, ...);
    ``compute_bytes``: the element size autocast computes in (:attr:`~lightning_paradyse.cost.dims.ModelDims.
    compute_bytes`; ``None``: no autocast).
    """

    compute_bytes = kwargs.pop("compute_bytes", None)
    planner_keys = {"recompute", "bucket_tokens", "on_infeasible", "prefer_tp_sp"}
    planner_kwargs = {k: v for k, v in kwargs.items() if k in planner_keys}
    model_kwargs = {k: v for k, v in kwargs.items() if k not in planner_keys}
    allowed = None
    if isinstance(model, nn.Module):
        dims = dims_from_module(model)
        per_layer = feasible_modes(model, p, list(modes))
        allowed = tuple(tuple(m for m in modes if all(m in layer[o] for layer in per_layer)) for o in (0, 1))
    elif isinstance(model, ModelDims):
        dims = model
    else:
        dims = dims_from_config(model, 4)
    if compute_bytes is not None:
        dims = replace(dims, compute_bytes=compute_bytes)
    cost = _source_model(dims, p, source, **model_kwargs)
    return CostPlanner(cost, budget_bytes, modes, allowed=allowed, **planner_kwargs)  # type: ignore[arg-type]


DOMINATED_ON_ONE_RANK = ("ulysses", "ring")
"""Modes a group of one rank does not plan (:func:`single_rank_modes`)."""


ONE_RANK_PREFER_TP_SP = math.inf
"""``prefer_tp_sp`` of a group of one rank: ``tp_sp`` whenever it fits the budget, whatever the other plans are
predicted to take. On one rank the modes compute the same thing (:func:`single_rank_modes`) and ``tp_sp``'s path
is the plain one, so the others only trade time for memory; the cost model, whose per-mode constants are fitted
where the modes communicate, once priced ``metp`` attention below ``tp_sp`` there (4 rows of 69 tokens, the quick
preset): it ran 30% slower."""


def single_rank_modes(modes: Sequence[str]) -> tuple[str, ...]:
    """The modes worth planning for a group of one rank (data parallelism): ``modes`` without
    :data:`DOMINATED_ON_ONE_RANK` (unchanged when nothing else is left).

    On one rank every mode computes the same local attention and MLP and no collective moves anything, so they
    differ only in their code's overhead and in what they keep for the backward, and the cost model's per-mode
    constants (fitted where the modes communicate) price that case poorly: a quick profile once made ``ring``
    look faster than ``tp_sp`` there, and it ran slower. ``tp_sp``'s path is the plain one (its gathers and
    reduce-scatters are no-ops); ``ulysses`` keeps at least as much for the same work and ``ring`` as much with its
    tiles' overhead besides: both are dominated. ``metp`` keeps only its input and recomputes its projections in
    the backward: slower than ``tp_sp`` (``benchmarks/single_rank_modes.py``) but a memory lever between ``tp_sp``
    and recomputing the whole op."""
    kept = tuple(m for m in modes if m not in DOMINATED_ON_ONE_RANK)
    return kept or tuple(modes)


def group_planning(g: int, modes: Sequence[str], prefer_tp_sp: float = 0.0) -> tuple[tuple[str, ...], float]:
    """``(modes, prefer_tp_sp)`` of the planner of a group of ``g`` ranks cut from a world planned with ``modes``
    and ``prefer_tp_sp``: a group of one plans :func:`single_rank_modes` and takes ``tp_sp`` whenever it fits
    (:data:`ONE_RANK_PREFER_TP_SP`); larger groups plan as the world does."""
    if g == 1:
        return single_rank_modes(modes), ONE_RANK_PREFER_TP_SP
    return tuple(modes), prefer_tp_sp


def group_calibration(g: int, world: CostModel) -> dict[str, OpCalibration]:
    """The per-op constants of the planner of a group of ``g`` ranks cut from the world that ``world`` prices.

    A group of one has its own where the profile measured them
    (:attr:`~lightning_paradyse.cost.model.CostModel.one_rank`, the whole weights on one rank; a profile written
    before they were measured: the machine's rates alone). No collective runs there, and the world's constants,
    fitted where the modes communicate, would price it poorly. A group of ``1 < g`` ranks runs the world's modes with
    their collectives on fewer ranks: it takes the world's time constants (the per-op overheads the FLOP and
    alpha-beta terms do not see, the elementwise work: properties of the modes' code; the collectives' own sizes are
    priced by the machine). On the rates alone its ops had no per-op overhead at all (milliseconds per op on two CPU
    processes, where the world's were priced with theirs): a group of 2 of 4 or 8 ranks looked cheaper than the
    world and than groups of one by what it did not price. The memory factors stay at one (the formulas as they are,
    as before), so what fits such a group does not move with factors fitted on ``P`` ranks. What the world's per-op
    overhead holds per rank of the world (a ring's ``P - 1`` passes) prices a smaller group's op a little high; a
    group of one of an older profile, on the rates, a little low."""
    if g == 1:
        return dict(world.one_rank)
    return {key: replace(cal, saved=1.0, fwd=1.0, bwd=1.0) for key, cal in world.calibration.items()}


def largest_true(pred: Callable[[int], bool], low: int, limit: int) -> int:
    """The largest ``n`` in ``[low, limit]`` with ``pred(n)`` for a monotone (true, then false) ``pred``; 0 if none."""
    if not pred(low):
        return 0
    hi = low
    while hi < limit and pred(min(2 * hi, limit)):
        hi = min(2 * hi, limit)
    if hi >= limit:
        return limit
    lo, hi = hi, min(2 * hi, limit)  # pred(lo) holds, pred(hi) fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo
