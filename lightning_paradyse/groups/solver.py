"""Heterogeneous sequence-parallel groups: which group size trains which sequence of a step (FlexSP-style).

ParaDySe shares every sequence among all ``P`` ranks, so a short sequence pays a ``P``-way split and its
collectives. Viewing the world as groups of different power-of-two sizes that run at the same time (e.g.
8 = 4 + 2 + 1 + 1), each group trains its own share of the step's sequences; the step takes as long as its
slowest group. This module chooses the split and the assignment; :mod:`lightning_paradyse.groups` runs it.

The problem: ``n`` sequences, ``P`` ranks, and a cost ``cost(lengths, g)``: the seconds a group of ``g``
ranks needs for the sequences ``lengths`` (``None`` when they do not fit its memory). Find group sizes
``g_1 + ... + g_m = P`` (powers of two) and a partition of the sequences into the groups minimising
``max_j cost(S_j, g_j)``; an empty group idles, at no cost or at ``idle(g)`` (the placeholder step it runs; for
free, a layout whose large group idles can tie with one of smaller groups and win by coming first in
:func:`layouts` order). The cost must be monotone: adding a sequence to a group never makes it faster or free up
memory, which holds for any real step; an idle group costs no more than one sequence (:func:`assign_rows` holds
``idle(g)`` to the cost of the shortest row alone on ``g`` ranks).

* :func:`layouts` enumerates the splits of ``P`` into powers of two (10 for ``P = 8``, 1,828 for ``P = 64``);
  the solvers choose among :func:`splits`, all of them up to 32 ranks, beyond them those of larger groups.
* :func:`assign_exact`: branch and bound, per layout, over the sequences longest first: a sequence goes to
  each group in turn (among empty groups of one size only the first, as they are interchangeable); a branch
  is cut when its slowest group is already no faster than the best complete assignment (by monotonicity its
  completions cannot do better) or a group overflows. Exact for the cost; exponential in ``n`` in the worst
  case, used up to :data:`EXACT_UP_TO` sequences.
* :func:`assign_greedy`: the documented approximation beyond: per layout, longest sequence first to the group
  that finishes it earliest (LPT), then moves and swaps of single sequences while the slowest group gets faster.
* :func:`assign_rows`: exact and fast for the rows of an ordinary batch, whose cost depends only on a group's
  longest row and its number of rows (:data:`ShapeCost`). Some optimum gives every group a run of consecutive
  rows in the order of length: dealing the longest rows to the group with the longest row, the next ones to
  the group with the next longest, keeping every group's count, changes no count and lengthens no group's
  longest row. A dynamic programme over the sorted rows and the multisets of group sizes left (which size takes
  the next run is part of the choice: every order of a layout's sizes at once) finds the runs, each group's run
  next to where its cost crosses the best of the groups left after it (its cost grows with its run, theirs
  shrinks), found for every start in one sweep (the crossing never moves back as the start moves on): ``O(n)``
  cost lookups per multiset and size. The multisets are few (165 below 16 ranks, 1,625 below 32) where the
  layouts' orders are not (5,272 at 16 ranks, 47 million at 32, 3.5 million of them for one layout).
* :func:`brute_force`: every layout and every map of sequences to groups; the reference of the tests.

Ties are broken deterministically (time, then layouts in :func:`splits` order, then the first assignment
found; in the rows solver, the larger group size for the next run, then the first end its sweep finds), so every
rank reaches the same answer. Past 32 ranks the solvers are exact among :func:`splits` (the rows solver: with the
groups below the smallest size on the last runs).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

GroupCost = Callable[[tuple[int, ...], int], "float | None"]
"""``cost(lengths, g)``: seconds for a group of ``g`` ranks to train ``lengths``; ``None`` if they do not fit."""

ShapeCost = Callable[[int, int, int], "float | None"]
"""``cost(s, b, g)``: seconds for a group of ``g`` ranks to train ``b`` rows padded to ``s`` tokens (rows of an
ordinary batch, cut to the group's longest); ``None`` if they do not fit. Monotone in ``s`` and in ``b``."""

IdleCost = Callable[[int], float]
"""``idle(g)``: seconds of an idle group of ``g`` ranks (its placeholder step); without one an idle group is free."""

EXACT_UP_TO = 10
"""Sequences per step up to which :func:`assign` solves exactly."""

MAX_GROUPS = 32
"""Groups of the smallest size a step is split into at most: beyond ``MAX_GROUPS`` ranks that size grows
(:func:`smallest_group`; what does not divide into it adds a few smaller groups, :func:`splits`). The rows solver
keeps a row per multiset of sizes smaller than the world: 1,625 below 32 ranks (about half a second of Python for a
batch of 117 rows), 25,509 below 64."""


@dataclass(frozen=True)
class Assignment:
    """Group sizes, the sequences (indices into the step's lengths) of each group, and each group's time."""

    sizes: tuple[int, ...]
    """Ranks per group, largest first; they sum to the world size."""
    groups: tuple[tuple[int, ...], ...]
    """Sequence indices per group (ascending); every sequence in exactly one group."""
    times: tuple[float, ...]
    """Predicted seconds per group (an idle group's: 0, or its ``idle`` cost)."""

    @property
    def time(self) -> float:
        """The step's predicted time: its slowest group's."""
        return max(self.times)


@functools.lru_cache(maxsize=64)
def layouts(world: int) -> tuple[tuple[int, ...], ...]:
    """Every split of ``world`` ranks into power-of-two group sizes, each non-increasing, largest groups first."""
    if world < 1:
        raise ValueError(f"world must be positive, got {world}")
    powers = [1 << k for k in range(world.bit_length()) if 1 << k <= world][::-1]
    out: list[tuple[int, ...]] = []

    def extend(rest: int, start: int, prefix: tuple[int, ...]) -> None:
        if rest == 0:
            out.append(prefix)
            return
        for i in range(start, len(powers)):
            if powers[i] <= rest:
                extend(rest - powers[i], i, (*prefix, powers[i]))

    extend(world, 0, ())
    return tuple(out)


def smallest_group(world: int) -> int:
    """The fewest ranks a group of ``world`` has: 1 up to :data:`MAX_GROUPS` ranks, else the least power of two
    that keeps the groups to :data:`MAX_GROUPS` (2 at 64 ranks: data parallelism then runs on pairs of ranks)."""
    g = 1
    while world > g * MAX_GROUPS:
        g *= 2
    return g


@functools.lru_cache(maxsize=64)
def splits(world: int) -> tuple[tuple[int, ...], ...]:
    """The layouts the solvers choose from: every one of :func:`layouts` up to :data:`MAX_GROUPS` ranks; beyond, those
    of groups of at least :func:`smallest_group` ranks, with what does not divide into such groups (``world`` modulo
    that size, in powers of two) as groups of their own, last: ``33 = 2 + ... + 2 + 1``. Made from the layouts of
    ``world // smallest_group(world)`` ranks (at most :data:`MAX_GROUPS` of them), never from the far more of
    ``world`` (billions at 1,024 ranks)."""
    least = smallest_group(world)
    rest = world % least
    tail = tuple(1 << k for k in reversed(range(rest.bit_length())) if rest >> k & 1)  # its binary digits
    return tuple(tuple(g * least for g in sizes) + tail for sizes in layouts(world // least))


def _idle(idle: IdleCost | None, g: int) -> float:
    return 0.0 if idle is None else idle(g)


def _group_time(
    cost: GroupCost, lengths: Sequence[int], members: Sequence[int], g: int, idle: IdleCost | None = None
) -> float | None:
    if not members:
        return _idle(idle, g)
    return cost(tuple(lengths[i] for i in members), g)


def _finish(sizes: tuple[int, ...], members: list[list[int]], times: list[float]) -> Assignment:
    return Assignment(sizes, tuple(tuple(sorted(m)) for m in members), tuple(times))


def _evaluated(
    lengths: Sequence[int],
    sizes: tuple[int, ...],
    members: list[list[int]],
    cost: GroupCost,
    idle: IdleCost | None = None,
) -> Assignment | None:
    """The assignment ``members`` with every group's time, ``None`` if some group does not fit."""
    times = [_group_time(cost, lengths, m, g, idle) for m, g in zip(members, sizes)]
    if any(t is None for t in times):
        return None
    return _finish(sizes, members, times)  # type: ignore[arg-type]


def _faster(best: Assignment | None, found: Assignment | None) -> Assignment | None:
    """``found`` if it is strictly faster than ``best`` (ties keep the first), else ``best``."""
    if found is not None and (best is None or found.time < best.time):
        return found
    return best


def brute_force(
    lengths: Sequence[int], world: int, cost: GroupCost, all_busy: bool = False, idle: IdleCost | None = None
) -> Assignment | None:
    """The optimum by enumerating every layout and every map of sequences to its groups (small instances)."""
    best: Assignment | None = None
    for sizes in layouts(world):
        for owner in itertools.product(range(len(sizes)), repeat=len(lengths)):
            members: list[list[int]] = [[] for _ in sizes]
            for i, j in enumerate(owner):
                members[j].append(i)
            if all_busy and not all(members):
                continue
            best = _faster(best, _evaluated(lengths, sizes, members, cost, idle))
    return best


def _exact_layout(
    lengths: Sequence[int],
    sizes: tuple[int, ...],
    cost: GroupCost,
    bound: float,
    all_busy: bool = False,
    idle: IdleCost | None = None,
) -> Assignment | None:
    """The best assignment to the groups ``sizes`` faster than ``bound`` (branch and bound), or ``None``."""
    if all_busy and len(sizes) > len(lengths):
        return None
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    members: list[list[int]] = [[] for _ in sizes]
    times = [_idle(idle, g) for g in sizes]  # a group idles until it gets a sequence
    best: list[Assignment | None] = [None]
    limit = [bound]

    def place(k: int) -> None:
        if all_busy and sum(not m for m in members) > len(order) - k:  # too few sequences left for the empty groups
            return
        if k == len(order):
            found = _finish(sizes, members, times)
            if found.time < limit[0]:
                best[0], limit[0] = found, found.time
            return
        i = order[k]
        tried_empty: set[int] = set()
        for j, g in enumerate(sizes):
            if not members[j]:
                if g in tried_empty:  # empty groups of one size are interchangeable
                    continue
                tried_empty.add(g)
            members[j].append(i)
            t = _group_time(cost, lengths, members[j], g)
            if t is not None and t < limit[0]:  # monotone cost: completions only add time
                old, times[j] = times[j], t
                place(k + 1)
                times[j] = old
            members[j].pop()

    place(0)
    return best[0]


def assign_exact(
    lengths: Sequence[int], world: int, cost: GroupCost, all_busy: bool = False, idle: IdleCost | None = None
) -> Assignment | None:
    """The optimal layout and assignment for the cost (``None`` if no assignment fits); see the module docstring.

    ``all_busy``: only assignments that give every group at least one sequence (no idle ranks). ``idle``: the
    seconds of an idle group (free without it).
    """
    best: Assignment | None = None
    for sizes in splits(world):
        found = _exact_layout(lengths, sizes, cost, math.inf if best is None else best.time, all_busy, idle)
        if found is not None:
            best = found
    return best


def _improve(
    lengths: Sequence[int],
    sizes: tuple[int, ...],
    members: list[list[int]],
    cost: GroupCost,
    idle: IdleCost | None = None,
) -> None:
    """Moves and swaps of single sequences out of the slowest group while it gets faster (in place)."""

    def time_of(j: int, m: list[int]) -> float:
        t = _group_time(cost, lengths, m, sizes[j], idle)
        return math.inf if t is None else t

    times = [time_of(j, m) for j, m in enumerate(members)]
    improved = True
    while improved:
        improved = False
        slow = max(range(len(sizes)), key=lambda j: (times[j], -j))
        for i in list(members[slow]):
            for j in range(len(sizes)):
                if j == slow:
                    continue
                swaps = [([*members[j][:x], i, *members[j][x + 1 :]], y) for x, y in enumerate(members[j])]
                candidates: list[tuple[list[int], int | None]] = [([*members[j], i], None), *swaps]
                for new_j, back in candidates:
                    new_slow = [x for x in members[slow] if x != i] + ([] if back is None else [back])
                    t_slow, t_j = time_of(slow, new_slow), time_of(j, new_j)
                    if max(t_slow, t_j) < times[slow]:
                        members[slow], members[j] = new_slow, new_j
                        times[slow], times[j] = t_slow, t_j
                        improved = True
                        break
                if improved:
                    break
            if improved:
                break


def assign_greedy(
    lengths: Sequence[int], world: int, cost: GroupCost, all_busy: bool = False, idle: IdleCost | None = None
) -> Assignment | None:
    """LPT per layout, then single moves and swaps; the best layout (an approximation, not always optimal).

    ``all_busy``: layouts whose result leaves a group without a sequence are dropped; ``idle`` as in
    :func:`assign_exact`.
    """
    best: Assignment | None = None
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    for sizes in splits(world):
        if all_busy and len(sizes) > len(lengths):
            continue
        members: list[list[int]] = [[] for _ in sizes]
        times = [0.0] * len(sizes)
        feasible = True
        for i in order:
            options = []
            for j, g in enumerate(sizes):
                t = _group_time(cost, lengths, [*members[j], i], g)
                if t is not None:
                    options.append((t, j))
            if not options:
                feasible = False
                break
            t, j = min(options)
            members[j].append(i)
            times[j] = t
        if not feasible:
            continue
        _improve(lengths, sizes, members, cost, idle)
        if all_busy and not all(members):
            continue
        best = _faster(best, _evaluated(lengths, sizes, members, cost, idle))
    return best


def assign(
    lengths: Sequence[int],
    world: int,
    cost: GroupCost,
    exact_up_to: int = EXACT_UP_TO,
    all_busy: bool = False,
    shape: ShapeCost | None = None,
    idle: IdleCost | None = None,
) -> Assignment | None:
    """The split and assignment of a step: with ``shape`` (rows of an ordinary batch, ``cost(lengths, g) ==
    shape(max(lengths), len(lengths), g)``) :func:`assign_rows`, exact for any number of rows; else
    :func:`assign_exact` for up to ``exact_up_to`` units and :func:`assign_greedy` beyond."""
    if shape is not None:
        return assign_rows(lengths, world, shape, all_busy, idle)
    if len(lengths) <= exact_up_to:
        return assign_exact(lengths, world, cost, all_busy, idle)
    return assign_greedy(lengths, world, cost, all_busy, idle)


def _row(
    run: Callable[[int, int], float],
    after: list[float],
    n: int,
    starts: Sequence[int],
    later: int,
    all_busy: bool,
) -> tuple[list[float], list[int]]:
    """One row of :func:`_table`'s programme: for every start ``i``, the fastest time of this group (rows ``[i, end)``
    cost ``run(i, end)``) and the ``later`` groups after it (``after[end]``), and the best ``end``.

    The best end is next to the crossing: the first ``e`` where the group's run costs at least as much as the groups
    after it. With ``starts`` ascending the crossing never moves back (a later start runs shorter, fewer rows: by
    the cost's monotonicity it reaches ``after[e]`` no earlier), so one sweep finds every start's: what a bisection
    per start finds, in about ``3 n`` costs looked up instead of ``n log n``. The last group (``later == 0``) runs
    every row left, whatever its start: its starts are taken from the last, fewer and shorter rows first, so that a
    cost which rules out a shape by one that did not fit (a group of one rank's planner: longer rows, more rows)
    answers the ones before it without a search."""
    best, cut = [math.inf] * (n + 1), [n] * (n + 1)
    first, last = (1, later) if all_busy else (0, 0)  # each later group needs a row
    e = 0
    if later == 0:  # every start's run is the rows left, in any order: the shortest first (see the docstring)
        starts = list(starts)[::-1]
    for i in starts:
        lo, hi = (n if later == 0 else i + first), n - last  # the last group takes every row left
        if lo > hi:
            continue
        if e < lo:
            e = lo  # else the previous start's crossing
        while e < hi and run(i, e) < after[e]:
            e += 1
        for end in (e - 1, e) if e > lo else (e,):
            t, a = run(i, end), after[end]
            if a > t:
                t = a
            if t < best[i]:
                best[i], cut[i] = t, end
    return best, cut


Table = tuple[list[float], list[int], list[int]]
"""The programme's row of a multiset of group sizes (:func:`_table`): per start ``i``, the fastest time of those
groups on the rows ``i..``, where the run of the group on the longest of them ends, and that group's size."""


def _runner(
    ordered: Sequence[int],
    g: int,
    cost: ShapeCost,
    all_busy: bool,
    memo: dict[int, dict[int, float]],
    idle: IdleCost | None,
) -> Callable[[int, int], float]:
    """Rows ``[i, end)`` of ``ordered`` on ``g`` ranks (an empty run idles), their costs kept in ``memo`` per group
    size under ``longest row * (n + 1) + rows`` (one to one for ``n`` rows: the shape the cost reads)."""
    held = memo.setdefault(g, {})
    empty = math.inf if all_busy else _idle(idle, g)
    stride = len(ordered) + 1

    def run(i: int, end: int) -> float:
        if end == i:
            return empty
        key = ordered[i] * stride + end - i
        t = held.get(key)
        if t is None:
            found = cost(ordered[i], end - i, g)
            t = held[key] = math.inf if found is None else found
        return t

    return run


def _table(
    groups: tuple[int, ...],
    ordered: Sequence[int],
    cost: ShapeCost,
    all_busy: bool,
    tables: dict[tuple[int, ...], Table],
    memo: dict[int, dict[int, float]],
    idle: IdleCost | None,
    least: int = 1,
    first: bool = False,
) -> Table:
    """The programme's row of the multiset ``groups`` (sizes, largest first) on the rows ``ordered`` (lengths,
    longest first): for every start, the best over which size takes the next run, that run found by :func:`_row`
    against the row of the groups left. Rows are kept in ``tables``: what is left of one layout is left of many.
    Groups smaller than ``least`` (what of a world past 32 ranks does not divide into its smallest groups,
    :func:`splits`) take the last runs, largest first: each would double the multisets. ``first``: the start ``0``
    only (a whole layout, never what is left of another; not kept). A tie keeps the larger size (the first in
    ``groups``), on every rank alike."""
    n = len(ordered)
    if not groups:
        best = [math.inf] * (n + 1)
        best[n] = 0.0
        return best, [n] * (n + 1), [0] * (n + 1)
    if not first and groups in tables:
        return tables[groups]
    best, cut, pick = [math.inf] * (n + 1), [n] * (n + 1), [0] * (n + 1)
    sizes = [g for g in dict.fromkeys(groups) if g >= least] or [groups[0]]  # every distinct size once, largest first
    for g in sizes:
        k = groups.index(g)
        rest = groups[:k] + groups[k + 1 :]
        after = _table(rest, ordered, cost, all_busy, tables, memo, idle, least)[0]
        run = _runner(ordered, g, cost, all_busy, memo, idle)
        row, ends = _row(run, after, n, [0] if first else range(n + 1), len(rest), all_busy)
        for i, t in enumerate(row):
            if t < best[i]:
                best[i], cut[i], pick[i] = t, ends[i], g
    if not first:
        tables[groups] = best, cut, pick
    return best, cut, pick


def _capped(idle: IdleCost, cost: ShapeCost, shortest: int) -> IdleCost:
    """``idle`` held to the cost of the ``shortest`` row alone on ``g`` ranks (the sweep of :func:`_row` is exact only
    when an idle group is no dearer than a one-row run), once per group size."""
    held: dict[int, float] = {}

    def capped(g: int) -> float:
        if g not in held:
            alone = cost(shortest, 1, g)
            held[g] = idle(g) if alone is None else min(idle(g), alone)
        return held[g]

    return capped


def assign_rows(
    lengths: Sequence[int], world: int, cost: ShapeCost, all_busy: bool = False, idle: IdleCost | None = None
) -> Assignment | None:
    """The optimal layout and assignment of the rows ``lengths`` for a cost of a group's longest row and number
    of rows (see the module docstring); ``None`` if no assignment fits. ``all_busy`` and ``idle`` as in
    :func:`assign_exact` (an idle group must cost no more than the same group with one row)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ordered = [lengths[i] for i in order]
    best: Assignment | None = None
    tables: dict[tuple[int, ...], Table] = {}
    memo: dict[int, dict[int, float]] = {}
    least = smallest_group(world)
    if idle is not None and ordered:
        idle = _capped(idle, cost, ordered[-1])
    for sizes in splits(world):
        if all_busy and len(sizes) > len(lengths):
            continue
        time, cut, pick = _table(sizes, ordered, cost, all_busy, tables, memo, idle, least, first=True)
        if time[0] == math.inf or (best is not None and time[0] >= best.time):
            continue
        members: list[list[int]] = [[] for _ in sizes]
        times = [_idle(idle, g) for g in sizes]
        free = list(range(len(sizes)))  # the layout's groups not yet given a run, largest first
        left, i = sizes, 0
        while left:  # the runs in order of length, each the choice the programme kept for the groups left
            if left != sizes:
                _, cut, pick = _table(left, ordered, cost, all_busy, tables, memo, idle, least)
            g, end = pick[i], cut[i]
            slot = next(x for x in free if sizes[x] == g)
            free.remove(slot)
            members[slot] = order[i:end]
            if end > i:
                times[slot] = _runner(ordered, g, cost, all_busy, memo, idle)(i, end)  # priced by the programme
            k = left.index(g)
            left, i = left[:k] + left[k + 1 :], end
        best = _finish(sizes, members, times)
    return best


def sequential_cost(seq_cost: Callable[[int, int], float | None]) -> GroupCost:
    """A group cost that trains its sequences one after another: ``sum_i seq_cost(s_i, g)``, ``None`` if any is.

    ``seq_cost(s, g)`` is, e.g., the planner's predicted step time for one sequence of ``s`` tokens on a group
    of ``g`` ranks (``None`` when no plan fits the budget); memory is then per sequence.
    """

    @functools.lru_cache(maxsize=65536)
    def one(s: int, g: int) -> float | None:
        return seq_cost(s, g)

    def cost(lengths: tuple[int, ...], g: int) -> float | None:
        total = 0.0
        for s in lengths:
            t = one(s, g)
            if t is None:
                return None
            total += t
        return total

    return cost


__all__ = [
    "EXACT_UP_TO",
    "MAX_GROUPS",
    "Assignment",
    "GroupCost",
    "IdleCost",
    "ShapeCost",
    "assign",
    "assign_exact",
    "assign_greedy",
    "assign_rows",
    "brute_force",
    "layouts",
    "sequential_cost",
    "smallest_group",
    "splits",
]
