"""Exact search for the fastest per-op plan under a memory budget (a Pareto dynamic programme).

The problem (:class:`PlanProblem`): ``K`` op positions in model order (attention, MLP, attention, ...),
each taking one *choice* (a mode and a recompute flag) from those allowed for its op type (a row of the cost
tables: attention and MLP, and the attention of layers with another sliding window, priced apart). Position
``k`` with choice ``c`` costs ``time[o_k][c]`` seconds and, for memory, keeps ``saved[o_k][c]`` bytes
until its backward and needs ``need_k(c)`` bytes above what earlier positions keep:

    need_k(c) = max(fwd_offset[k] + fwd[o_k][c],  saved[o_k][c] + bwd_offset[k] + bwd[o_k][c])

(its forward transient on top of the live residual stream; or, in backward, its saved bytes, the
incoming gradient and the weight gradients of later positions, plus its backward transient).
Consecutive positions pay ``switch[c_prev][c]`` seconds, and every mode a plan uses adds its persistent
``buffers[mode]`` bytes once. With ``P_k`` the bytes saved by positions ``< k``:

    time(plan) = base_time + sum_k (switch[c_{k-1}][c_k] + time[o_k][c_k])
    peak(plan) = static + sum_{modes used} buffers[mode]
                 + max(max_k (P_k + need_k(c_k)),  P_K + end_need,  fixed_need)

Saved bytes accumulate over the positions; transients do not add up: each is counted at its own
position, on top of what is alive there. The budget constraint is ``peak(plan) <= budget``.

**Algorithm.** A dynamic programme over positions whose states are ``(P, time, last choice)``: a
state at position ``k`` is a prefix of a plan. A transition to choice ``c`` at position ``k`` is
allowed when ``P + need_k(c) <= cap`` and leads to ``(P + saved[c], time + switch + time[c], c)``.
States with the same last choice are reduced to their Pareto front in ``(P, time)``.

**Why it is exact.** Take two prefixes ending in the same choice with ``P1 <= P2`` and ``t1 <= t2``.
Every constraint a completion must meet has the form ``P_k + need <= cap`` with ``P_k`` the prefix's
``P`` plus the completion's own saved bytes, so any completion feasible after prefix 2 is feasible
after prefix 1; the completion's time depends on the prefix only through the last choice (the
switching cost), so it adds the same to both. Hence prefix 1 followed by prefix 2's best completion
is feasible and no slower: discarding dominated states never loses the optimum. States are also cut
when even the smallest possible completion would overflow (a valid lower bound), which removes only
infeasible prefixes; and, when switching is free, a choice that another choice of the same op type
beats on every count (time, saved, forward and backward need) is dropped before the search, since
swapping it for its dominator never breaks feasibility nor slows a plan. Buffers are charged exactly by
solving once per subset ``U`` of the modes that have buffers, with the other buffered modes forbidden and
the budget reduced by ``U``'s buffers: the optimal plan, which uses some set ``V``, is found in the subproblem
``U = V``, and every subproblem's
answer costs at most what that subproblem charged. Without switching costs the last choice does not
matter and one front per position suffices.

**Cost.** ``O(K * C * F)`` with ``C`` choices and ``F`` the front size (the number of distinct
non-dominated saved-byte totals, at most the number of ways to spread the positions over choices with
distinct saved bytes); times ``C`` with switching costs and ``2^B`` with ``B`` buffered modes. The
numpy implementation takes a few milliseconds for 80 layers x 2 ops x 8 choices (see the tests).
:func:`min_peak` runs the same programme on ``(P, running peak)`` to find the least memory any plan
needs; :func:`exhaustive` enumerates every plan and is the reference the tests compare against.
Ties are broken deterministically (lower time, then lower peak, then the first in choice order), so
every rank computes the same plan.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Choice:
    """How one op runs: a mode and whether its activations are recomputed."""

    mode: str
    recompute: bool = False

    def __str__(self) -> str:
        return self.mode + ("+rc" if self.recompute else "")


@dataclass(frozen=True)
class PlanProblem:
    """Cost tables of one (length, batch): see the module docstring for the meaning of every field."""

    choices: tuple[Choice, ...]
    """All choices; tables are indexed by ``[op type][choice index]``."""
    ops: tuple[int, ...]
    """Op type (table row: 0 attention, 1 MLP, further rows the attention of layers with another window) of every
    position, in model order."""
    allowed: tuple[tuple[int, ...], ...]
    """Allowed choice indices per op type."""
    time: np.ndarray
    """``[R, C]`` seconds per op and step (``R`` op types, 2 without windows)."""
    saved: np.ndarray
    """``[R, C]`` int64 bytes kept from the op's forward to its backward."""
    fwd: np.ndarray
    """``[R, C]`` int64 forward transient bytes."""
    bwd: np.ndarray
    """``[R, C]`` int64 backward transient bytes."""
    fwd_offset: np.ndarray
    """``[K]`` int64 bytes alive at each position's forward besides the saved prefix (the residual stream)."""
    bwd_offset: np.ndarray
    """``[K]`` int64 bytes alive at each position's backward besides the saved prefix (gradients)."""
    end_need: int = 0
    """Bytes needed on top of all saved bytes after the last position (the LM head and loss)."""
    fixed_need: int = 0
    """Plan-independent peak above ``static`` (e.g. the gradient reduction after backward)."""
    static: int = 0
    """Bytes alive throughout (parameters, optimizer state)."""
    switch: np.ndarray | None = None
    """``[C, C]`` seconds when consecutive positions change choice; ``None`` when switching is free."""
    buffers: Mapping[str, int] = field(default_factory=dict)
    """Persistent buffer bytes of a mode, paid once if the plan uses it."""
    base_time: float = 0.0
    """Plan-independent seconds per step (embedding, head, gradient reduction)."""

    @property
    def n_positions(self) -> int:
        return len(self.ops)

    def need(self) -> np.ndarray:
        """``[K, C]`` int64 ``need_k(c)`` (see the module docstring)."""
        ops = np.asarray(self.ops)
        fwd = self.fwd_offset[:, None] + self.fwd[ops]
        bwd = self.saved[ops] + self.bwd_offset[:, None] + self.bwd[ops]
        return np.maximum(fwd, bwd)


@dataclass(frozen=True)
class Solution:
    """A plan as choice indices per position, with its time and peak."""

    seq: tuple[int, ...]
    time: float
    peak: int


def evaluate(problem: PlanProblem, seq: Sequence[int]) -> tuple[float, int]:
    """``(time, peak)`` of one plan, straight from the definitions (the reference for the search)."""
    need = problem.need()
    t, prefix, high, prev = 0.0, 0, 0, -1
    for k, c in enumerate(seq):
        o = problem.ops[k]
        if prev >= 0 and problem.switch is not None:
            t = t + float(problem.switch[prev, c])
        t = t + float(problem.time[o, c])
        high = max(high, prefix + int(need[k, c]))
        prefix += int(problem.saved[o, c])
        prev = c
    high = max(high, prefix + problem.end_need, problem.fixed_need)
    modes = {problem.choices[c].mode for c in seq}
    buffers = sum(problem.buffers.get(m, 0) for m in modes)
    return problem.base_time + t, problem.static + buffers + high


# --------------------------------------------------------------------------------------------------
# The Pareto dynamic programme
# --------------------------------------------------------------------------------------------------


@dataclass
class _Layer:
    """States after one position: saved prefix, objective, last choice, parent state index."""

    P: np.ndarray
    V: np.ndarray
    last: np.ndarray
    parent: np.ndarray


def _lower_bounds(problem: PlanProblem, allowed: Sequence[Sequence[int]], need: np.ndarray) -> np.ndarray:
    """``lb[k]``: the least bytes positions ``>= k`` need above ``P_k`` (relaxation: per-position minima)."""
    K = problem.n_positions
    lb = np.zeros(K + 1, dtype=np.int64)
    lb[K] = problem.end_need
    for k in range(K - 1, -1, -1):
        idx = list(allowed[problem.ops[k]])
        min_need = int(need[k, idx].min())
        min_saved = int(problem.saved[problem.ops[k], idx].min())
        lb[k] = max(min_need, min_saved + lb[k + 1])
    return lb


def _pareto(P: np.ndarray, V: np.ndarray, groups: np.ndarray | None) -> np.ndarray:
    """Indices of the non-dominated ``(P, V)`` points (per group), first of equal points kept."""
    order = np.lexsort((V, P)) if groups is None else np.lexsort((V, P, groups))
    Vs = V[order]
    keep = np.zeros(len(order), dtype=bool)
    if groups is None:
        run = np.minimum.accumulate(Vs)
        keep[0:1] = True
        keep[1:] = Vs[1:] < run[:-1]
        return np.asarray(order[keep])
    gs = groups[order]
    starts = np.flatnonzero(np.r_[True, gs[1:] != gs[:-1]])
    ends = np.r_[starts[1:], len(order)]
    for a, b in zip(starts, ends):
        run = np.minimum.accumulate(Vs[a:b])
        keep[a] = True
        keep[a + 1 : b] = Vs[a + 1 : b] < run[:-1]
    return np.asarray(order[keep])


def _step(
    prev: _Layer,
    k: int,
    problem: PlanProblem,
    allowed: np.ndarray,
    need: np.ndarray,
    cap: float,
    lb: np.ndarray,
    peak_objective: bool,
) -> _Layer:
    """All transitions from the states after position ``k - 1`` into position ``k``, Pareto-reduced."""
    o = problem.ops[k]
    here = prev.P[:, None] + need[k, allowed][None, :]  # [states, choices]: bytes at position k
    P = prev.P[:, None] + problem.saved[o, allowed][None, :]  # saved prefix after position k
    state, col = np.nonzero((here <= cap) & (P + lb[k + 1] <= cap))
    choice = allowed[col]
    if peak_objective:
        V = np.maximum(prev.V[state], here[state, col]).astype(np.float64)
    else:
        V = prev.V[state]
        if problem.switch is not None:
            last = prev.last[state]
            V = V + np.where(last >= 0, problem.switch[last, choice], 0.0)
        V = V + problem.time[o, choice]
    P = P[state, col]
    groups = choice if (problem.switch is not None and not peak_objective) else None
    keep = _pareto(P, V, groups) if len(P) else np.zeros(0, dtype=np.int64)
    return _Layer(P[keep], V[keep], choice[keep], state[keep])


def _run(
    problem: PlanProblem, allowed: Sequence[Sequence[int]], cap: float, peak_objective: bool
) -> tuple[list[_Layer], np.ndarray] | None:
    """The programme's layers and the final objective per last state, or ``None`` if nothing fits."""
    allowed = _undominated(problem, allowed, peak_objective)
    need = problem.need()
    lb = _lower_bounds(problem, allowed, need)
    if lb[0] > cap or problem.fixed_need > cap:
        return None
    layer = _Layer(np.zeros(1, np.int64), np.zeros(1), np.full(1, -1, np.int64), np.full(1, -1, np.int64))
    layers = []
    choices = [np.asarray(a, dtype=np.int64) for a in allowed]
    for k in range(problem.n_positions):
        layer = _step(layer, k, problem, choices[problem.ops[k]], need, cap, lb, peak_objective)
        if len(layer.P) == 0:
            return None
        layers.append(layer)
    end = layer.P + problem.end_need
    fits = end <= cap
    if not fits.any():
        return None
    final = np.maximum(np.maximum(layer.V, end), problem.fixed_need) if peak_objective else layer.V.copy()
    final[~fits] = np.inf
    return layers, final


def _backtrack(layers: list[_Layer], index: int) -> tuple[int, ...]:
    seq = []
    for layer in reversed(layers):
        seq.append(int(layer.last[index]))
        index = int(layer.parent[index])
    return tuple(reversed(seq))


def _subsets(problem: PlanProblem, allowed: Sequence[Sequence[int]]) -> list[tuple[int, list[list[int]]]]:
    """``(buffer bytes charged, allowed choices)`` for every subset of the buffered modes in use."""
    used = sorted({problem.choices[c].mode for a in allowed for c in a})
    buffered = [m for m in used if problem.buffers.get(m, 0) > 0]
    out = []
    for mask in range(2 ** len(buffered)):
        chosen = {m for i, m in enumerate(buffered) if mask >> i & 1}
        banned = set(buffered) - chosen
        sub = [[c for c in a if problem.choices[c].mode not in banned] for a in allowed]
        if all(sub[o] for o in set(problem.ops)):
            out.append((sum(problem.buffers[m] for m in chosen), sub))
    return out


def _allowed(problem: PlanProblem, modes: Sequence[str] | None) -> list[list[int]]:
    return [[c for c in a if modes is None or problem.choices[c].mode in modes] for a in problem.allowed]


def _undominated(problem: PlanProblem, allowed: Sequence[Sequence[int]], peak_objective: bool) -> list[list[int]]:
    """Drop choices another allowed choice beats on every count (only when switching is free).

    ``c'`` dominates ``c`` for an op type when it is no slower (ignored for the peak objective), saves
    no more, and needs no more in forward (``fwd``) and backward (``saved + bwd``): then every
    ``need_k`` is no larger too, and any plan using ``c`` stays feasible and no slower with ``c'``.
    Buffers are charged per subproblem, identically for both. Of identical choices the first is kept.
    """
    if problem.switch is not None:
        return [list(a) for a in allowed]
    out = []
    for o, choices in enumerate(allowed):
        cs = np.asarray(choices, dtype=np.int64)
        cols = [problem.saved[o, cs], problem.fwd[o, cs], problem.saved[o, cs] + problem.bwd[o, cs]]
        if not peak_objective:
            cols.append(problem.time[o, cs])
        A = np.stack([np.asarray(c, dtype=np.float64) for c in cols], axis=1)  # [n, criteria]
        no_worse = (A[None, :, :] <= A[:, None, :]).all(axis=2)  # [i, j]: j is no worse than i everywhere
        better = (A[None, :, :] < A[:, None, :]).any(axis=2)
        earlier = np.arange(len(cs))[None, :] < np.arange(len(cs))[:, None]
        dominated = (no_worse & (better | earlier)).any(axis=1)
        out.append([int(c) for c in cs[~dominated]])
    return out


def solve(problem: PlanProblem, budget: float, modes: Sequence[str] | None = None) -> Solution | None:
    """The fastest plan with ``peak <= budget`` (only ``modes`` if given), or ``None`` if none fits."""
    best: tuple[float, int, int] | None = None
    found: Solution | None = None
    for i, (charged, allowed) in enumerate(_subsets(problem, _allowed(problem, modes))):
        run = _run(problem, allowed, budget - problem.static - charged, peak_objective=False)
        if run is None:
            continue
        layers, final = run
        index = int(np.argmin(final))  # first of the fastest: the states are in deterministic order
        seq = _backtrack(layers, index)
        time, peak = evaluate(problem, seq)
        if best is None or (time, peak, i) < best:
            best, found = (time, peak, i), Solution(seq, time, peak)
    return found


def min_peak(problem: PlanProblem, modes: Sequence[str] | None = None) -> Solution | None:
    """The plan that needs the least memory (only ``modes`` if given); ``None`` if no choice is allowed."""
    best: Solution | None = None
    for _charged, allowed in _subsets(problem, _allowed(problem, modes)):  # buffers: evaluate() charges them
        run = _run(problem, allowed, math.inf, peak_objective=True)
        if run is None:
            continue
        layers, final = run
        seq = _backtrack(layers, int(np.argmin(final)))
        time, peak = evaluate(problem, seq)
        if best is None or (peak, time) < (best.peak, best.time):
            best = Solution(seq, time, peak)
    return best


def all_plans(
    problem: PlanProblem, modes: Sequence[str] | None = None, limit: int = 2_000_000
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every plan enumerated: ``(seqs [N, K], time [N], peak [N])``, computed like :func:`evaluate`."""
    allowed = _allowed(problem, modes)
    options = [allowed[o] for o in problem.ops]
    count = math.prod(len(a) for a in options)
    if count > limit:
        raise ValueError(f"{count} plans exceed the enumeration limit {limit}")
    seqs = np.array(list(itertools.product(*options)), dtype=np.int64).reshape(count, len(options))
    need, ops = problem.need(), np.asarray(problem.ops)
    t = np.zeros(count)
    prefix = np.zeros(count, dtype=np.int64)
    high = np.zeros(count, dtype=np.int64)
    for k in range(len(options)):
        c = seqs[:, k]
        if k and problem.switch is not None:
            t = t + problem.switch[seqs[:, k - 1], c]
        t = t + problem.time[ops[k], c]
        high = np.maximum(high, prefix + need[k, c])
        prefix = prefix + problem.saved[ops[k], c]
    high = np.maximum(np.maximum(high, prefix + problem.end_need), problem.fixed_need)
    modes_of = np.array([problem.choices[c].mode for c in range(len(problem.choices))])
    buffers = np.zeros(count, dtype=np.int64)
    for mode, nbytes in problem.buffers.items():
        buffers += nbytes * (modes_of[seqs] == mode).any(axis=1)
    return seqs, problem.base_time + t, problem.static + buffers + high


def exhaustive(problem: PlanProblem, budget: float, modes: Sequence[str] | None = None) -> Solution | None:
    """The fastest plan within ``budget`` by enumerating every plan (a reference for small problems)."""
    seqs, time, peak = all_plans(problem, modes)
    ok = np.flatnonzero(peak <= budget)
    if len(ok) == 0:
        return None
    best = ok[np.lexsort((peak[ok], time[ok]))[0]]
    return Solution(tuple(int(c) for c in seqs[best]), float(time[best]), int(peak[best]))
