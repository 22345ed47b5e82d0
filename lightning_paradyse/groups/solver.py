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

* :func:`layouts` enumerates the splits of ``P`` into powers of two (10 for ``P = 8``, 1,828 for ``P = 64``).
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
  longest row. Per layout and order of its group sizes, a dynamic programme over the sorted rows finds the
  runs, each group's run next to where its cost crosses the best of the groups after it (its cost grows with its
  run, theirs shrinks), found for every start in one sweep (the crossing never moves back as the start moves on):
  ``O(k n)`` cost lookups for ``k`` groups and ``n`` rows.
* :func:`brute_force`: every layout and every map of sequences to groups; the reference of the tests.

Ties are broken deterministically (time, then layouts in :func:`layouts` order, then the first assignment
found), so every rank reaches the same answer.
"""

from __future__ import annotations

import collections
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
    for sizes in layouts(world):
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
    for sizes in layouts(world):
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


@functools.lru_cache(maxsize=256)
def _orders(sizes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Every distinct order of the group sizes ``sizes``, largest first in each position (the same on every rank),
    made once per layout: a multiset's distinct orders are built position by position (``(1,) * 8`` has one, not
    the 40,320 permutations of its places). Their number grows fast past 16 ranks (millions for one layout of 32):
    the rows solver is meant for the group sizes of a node or two."""
    counts = sorted(collections.Counter(sizes).items(), reverse=True)  # [(size, count)], largest size first
    out: list[tuple[int, ...]] = []

    def extend(prefix: tuple[int, ...]) -> None:
        if len(prefix) == len(sizes):
            out.append(prefix)
            return
        for k, (g, left) in enumerate(counts):
            if left:
                counts[k] = (g, left - 1)
                extend((*prefix, g))
                counts[k] = (g, left)

    extend(())
    return tuple(out)


def _row(
    run: Callable[[int, int], float],
    after: list[float],
    n: int,
    starts: Sequence[int],
    later: int,
    all_busy: bool,
) -> tuple[list[float], list[int]]:
    """One row of :func:`_runs`' programme: for every start ``i``, the fastest time of this group (rows ``[i, end)``
    cost ``run(i, end)``) and the ``later`` groups after it (``after[end]``), and the best ``end``.

    The best end is next to the crossing: the first ``e`` where the group's run costs at least as much as the groups
    after it. With ``starts`` ascending the crossing never moves back (a later start runs shorter, fewer rows: by
    the cost's monotonicity it reaches ``after[e]`` no earlier), so one sweep finds every start's: what a bisection
    per start finds, in about ``3 n`` costs looked up instead of ``n log n``."""
    best, cut = [math.inf] * (n + 1), [n] * (n + 1)
    first, last = (1, later) if all_busy else (0, 0)  # each later group needs a row
    e = 0
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


Tables = dict[tuple[int, ...], tuple[list[float], list[int]]]
"""Per suffix of a sequence of group sizes, the rows ``best`` and ``cut`` of :func:`_runs`' programme: they depend on
the suffix alone (the groups after it), so every sequence of one decision that ends alike shares them."""


def _runs(
    ordered: Sequence[int],
    sizes: tuple[int, ...],
    cost: ShapeCost,
    all_busy: bool,
    tables: Tables | None = None,
    memo: dict[int, dict[int, float]] | None = None,
    idle: IdleCost | None = None,
) -> tuple[float, list[int]] | None:
    """The fastest split of the rows ``ordered`` (lengths, longest first) into consecutive runs, run ``j`` to a
    group of ``sizes[j]`` ranks: ``(time, run starts)``, or ``None`` if no split fits. ``tables`` and ``memo`` carry
    the programme's rows per suffix of ``sizes`` and the costs of runs from one call to the next: the same rows only
    (a run's cost is kept per group size under ``longest row * (n + 1) + rows``, one to one for ``n`` rows)."""
    n, k = len(ordered), len(sizes)
    inf = math.inf
    tables = {} if tables is None else tables
    memo = {} if memo is None else memo
    stride = n + 1

    def runner(g: int) -> Callable[[int, int], float]:
        """Rows ``[i, end)`` on ``g`` ranks (an empty run idles), their costs kept per group size."""
        held = memo.setdefault(g, {})
        empty = inf if all_busy else _idle(idle, g)

        def run(i: int, end: int) -> float:
            if end == i:
                return empty
            key = ordered[i] * stride + end - i  # (longest row, rows): the shape the cost reads
            t = held.get(key)
            if t is None:
                found = cost(ordered[i], end - i, g)
                t = held[key] = inf if found is None else found
            return t

        return run

    # best[j][i]: the fastest time of groups j.. on rows i..; cut[j][i]: where group j's run ends
    best: list[list[float]] = [[inf] * (n + 1) for _ in range(k + 1)]
    cut: list[list[int]] = [[n] * (n + 1) for _ in range(k + 1)]
    best[k][n] = 0.0
    for j in range(k - 1, -1, -1):
        suffix = sizes[j:]
        if j > 0 and suffix in tables:  # the groups j.. of another sequence that ends alike
            best[j], cut[j] = tables[suffix]
            continue
        starts = [0] if j == 0 else range(n + 1)
        best[j], cut[j] = _row(runner(sizes[j]), best[j + 1], n, starts, k - j - 1, all_busy)
        if j > 0:
            tables[suffix] = (best[j], cut[j])
    if best[0][0] == inf:
        return None
    starts, i = [], 0
    for j in range(k):
        starts.append(i)
        i = cut[j][i]
    return best[0][0], starts


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
    tables: Tables = {}
    memo: dict[int, dict[int, float]] = {}
    if idle is not None and ordered:
        idle = _capped(idle, cost, ordered[-1])
    for sizes in layouts(world):
        if all_busy and len(sizes) > len(lengths):
            continue
        for sequence in _orders(sizes):
            found = _runs(ordered, sequence, cost, all_busy, tables, memo, idle)
            if found is None or (best is not None and found[0] >= best.time):
                continue
            starts = [*found[1], len(ordered)]
            members: list[list[int]] = [[] for _ in sizes]
            times = [_idle(idle, g) for g in sizes]
            free = list(range(len(sizes)))  # the layout's groups not yet given a run, largest first
            for j, g in enumerate(sequence):
                slot = next(x for x in free if sizes[x] == g)
                free.remove(slot)
                members[slot] = order[starts[j] : starts[j + 1]]
                if members[slot]:
                    t = cost(ordered[starts[j]], len(members[slot]), g)
                    assert t is not None
                    times[slot] = t
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
]
