"""The step runner: every batch on groups of ranks, a training batch of several sequences or documents on groups of
different sizes.

:class:`GroupRunner` is the collaborator the strategy's per-batch cycle owns
(:class:`~lightning_paradyse.lightning.cycle.StepCycle`). Per batch the cycle calls, in order:

1. :meth:`GroupRunner.decide`: the batch's units (:class:`~lightning_paradyse.groups.units.Units`: rows or
   documents), the split of the ranks into groups and the units of each group
   (:func:`~lightning_paradyse.groups.solver.assign` on :func:`~lightning_paradyse.groups.cost.group_cost`), every
   group's batch cut out and its plan checked, on every rank alike and before any collective; or
   :meth:`GroupRunner.whole`: one group of every rank on the whole batch (a single packed document, evaluation,
   ``groups=False``);
2. :meth:`GroupRunner.agree`: every rank's header, the digest of the step first (one all-gather; after a
   data-parallel step it brings the whole weights too), then :meth:`GroupRunner.enter`: this rank's ``1/g`` shards
   (:func:`~lightning_paradyse.groups.exchange.enter_group`, one all-to-all; none for one group, nor when the
   agreement brought the weights), then the group's layout and plan;
3. the module's step on this rank's tokens of its group's batch (the cycle's ``shard``);
4. :meth:`GroupRunner.finish` after the backward, when no micro-batch is left to accumulate: the gradients back
   onto the ``1/P`` shards with the replicated gradients summed over every rank and every rank's share of the loss
   riding along (:func:`~lightning_paradyse.groups.exchange.exit_group`, one all-to-all; on timed steps, the
   logged ones and a fit's first, every rank's measured group time too, logged against the predictions); for one
   group, the replicated gradients' all-reduce.

**Micro-batches** (gradient accumulation): while micro-batches are left before the optimizer step, the ``1/g``
shards are kept, their gradients accumulating in place (DDP's ``no_sync``). A micro-batch split like the previous
one runs on them without any exchange; a different split first returns the kept gradients (:meth:`flush`), and
the micro-batch that steps returns everything once. So with ``k`` micro-batches of one split a data-parallel step
moves what DDP moves: one weight gather and one gradient reduction per optimizer step, not ``k``. The weights
cannot change between micro-batches (no optimizer step); should something change them in place, the kept
shards are found stale (by the parameters' version counters) and gathered again.

The exchange's real cost is measured once at setup (:meth:`GroupRunner.setup`), and every group size's planner
plans ahead the buckets short batches fall in (:meth:`GroupRunner.warm`): a decision then plans nothing new on the
first steps of a fit.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from lightning_paradyse.cost.dims import dims_from_module
from lightning_paradyse.distributed.comm import (
    Group,
    all_gather_rows,
    collective_device,
    group_size,
    polled,
    synchronize,
)
from lightning_paradyse.distributed.devices import to_device
from lightning_paradyse.groups import solver
from lightning_paradyse.groups.cost import (
    exchange_seconds,
    group_cost,
    group_shape_cost,
    machine_for_groups,
    placeholder_cost,
)
from lightning_paradyse.groups.exchange import (
    GroupSet,
    WholeWeights,
    blocks,
    drop_group,
    enter_group,
    exit_group,
    gather_whole,
    measure_regroup,
    whole_dtype,
)
from lightning_paradyse.groups.solver import Assignment
from lightning_paradyse.groups.units import Units
from lightning_paradyse.modes.plan import Plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.planning.fixed import Planner
from lightning_paradyse.planning.planner import (
    CostPlanner,
    PlanInfeasible,
    group_calibration,
    group_planning,
    make_planner,
)
from lightning_paradyse.runtime import parallel
from lightning_paradyse.runtime.slicing import BatchInfo, describe_batch, find_tokens, on_device


@dataclass(frozen=True)
class GroupStep:
    """One step of this rank on its group (a training step on groups, or any batch on one group of every rank):
    what the cycle configures and runs."""

    assignment: Assignment
    """Group sizes and the units of each group (the same on every rank)."""
    units: Units | None
    """The batch's rows or documents (``None``: the batch is not shared out, one group of every rank)."""
    index: int
    """This rank's group."""
    group: Group
    """Its process group (``None`` for a group of one)."""
    rank: int
    """This rank's rank inside the group."""
    batch: Any
    """The group's batch (its rows or documents; ``None``: the batch the module's step is given)."""
    info: BatchInfo
    """This rank's description of its group's batch (``n_global`` of the whole batch)."""
    plans: tuple[Plan, ...]
    """Every group's plan."""
    shifts: dict[str, tuple[Tensor, int, int]]
    """Per ``[b, s]`` entry of a dict batch: the whole batch's shifted labels cut to this group, their real count
    in the whole batch, and the real count of the labels as given in the whole batch (labels handed to a Hugging
    Face model are shifted over the batch; empty when no module of the model shifts labels)."""
    predicted: tuple[float, ...] = ()
    """Every group's predicted forward and backward (without the exchange)."""
    solve_s: float = 0.0
    """Seconds the decision took."""
    reuse: bool = False
    """Run on the ``1/g`` shards kept from the previous micro-batch (same split, weights unchanged): no exchange."""
    whole: bool = False
    """One group of every rank on the whole batch (a single packed document, evaluation, ``groups=False``): no
    exchange."""
    model_metrics: dict[str, float] = field(default_factory=dict)
    """The cost model's predictions of the plan of one group of every rank (``plan/predicted_time_s``, ...; none
    without a cost model, or with more than one group)."""

    @property
    def size(self) -> int:
        return self.assignment.sizes[self.index]

    @property
    def plan(self) -> Plan:
        """This rank's group's plan."""
        return self.plans[self.index]

    def digest(self, checksum: int) -> int:
        """A signed 64-bit hash of the assignment, the plans and the batch, equal across ranks that agree."""
        text = repr(
            (self.assignment.sizes, self.assignment.groups, tuple(map(str, self.plans)), checksum, self.reuse)
        ).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)


def plan_predictions(planner: Planner, seq_len: int, batch: int) -> dict[str, float]:
    """The cost model's predicted step time and peak memory of the plan ``planner`` chose for ``batch`` sequences of
    ``seq_len`` tokens (cached: nothing is planned again), when it has a cost model."""
    step = getattr(planner, "step", None)
    if step is None:
        return {}
    planned = step(seq_len, batch)
    return {"plan/predicted_time_s": float(planned.time_s), "plan/predicted_peak_mib": planned.peak_bytes / 2**20}


WARM_BUCKETS = 16
"""Setup plans ahead, for every group size, the shapes of up to this many length buckets' worth of tokens
(``plan_bucket`` tokens each: 8,192 by default) as rows of every power-of-two length up to ``plan_bucket``."""

DECISIONS_KEPT = 256
"""The splits of this many distinct batches (their units' lengths) a run keeps (:meth:`GroupRunner._assign`); a
longer tail is searched again."""


def group_sizes(world: int) -> list[int]:
    """The sizes a group of ``world`` ranks can have: those of :func:`~lightning_paradyse.groups.solver.splits` (every
    power of two up to the world up to 32 ranks), and the world itself."""
    return sorted({g for sizes in solver.splits(world) for g in sizes} | {world})


def imbalance(times: Sequence[float]) -> float:
    """Slowest over mean of the groups' times (1.0: perfectly balanced)."""
    busy = [t for t in times if t > 0]
    return max(busy) / (sum(busy) / len(busy)) if busy else 1.0


class GroupRunner:
    """Steps on groups of different sizes for :class:`~lightning_paradyse.lightning.strategy.ParaDySeStrategy` (see the
    module docstring). Holds the per-run state of the feature: the aligned process groups, the planner of every
    group size, the group costs (with their caches of planned shapes) and the step in flight."""

    def __init__(self, plan_bucket: int, on_infeasible: str) -> None:
        self.plan_bucket = plan_bucket
        self.on_infeasible = on_infeasible
        self._world: Group = None
        self._module: nn.Module | None = None
        self._set: GroupSet | None = None
        self._dims: Any = None
        self._planner: Planner | None = None
        self._planners: dict[int, Planner] = {}
        self._runs: dict[tuple[int, Plan], bool] = {}
        self._costs: dict[tuple[bool, bool, bool], Any] = {}
        self._found: OrderedDict[tuple[bool, tuple[int, ...]], Assignment | None] = OrderedDict()
        """The last :data:`DECISIONS_KEPT` splits the solver found, by the batch's units (:meth:`_assign`)."""
        self.exchange_scale = 1.0
        """Measured over predicted seconds of the weight exchange (measured once at setup)."""
        self.step: GroupStep | None = None
        """The grouped step in flight (between :meth:`enter` and :meth:`finish`)."""
        self._started = 0.0
        self.times: tuple[float, ...] = ()
        """Measured seconds of every group's forward and backward (its slowest rank) in the last grouped step."""
        self.kept: tuple[int, ...] | None = None
        """The split whose ``1/g`` shards are kept across micro-batches (their gradients not yet returned)."""
        self._versions: list[tuple[Tensor, int]] = []
        self.exchanges = 0
        """Weight exchanges into groups so far, the shards cut out of weights the agreement brought included
        (micro-batches that reuse kept shards do not count)."""
        self.warmed: tuple[int, float] = (0, 0.0)
        """Shapes planned ahead at setup and the seconds that took (:meth:`warm`)."""
        self._gather_next = False
        """The last training step was data parallel: the next training batch's agreement brings the whole weights
        (:meth:`agree`)."""
        self._whole: WholeWeights | None = None
        self._whole_ok: bool | None = None

    @property
    def ready(self) -> bool:
        """Whether batches may be shared out among groups (:meth:`setup` made the groups)."""
        return self._set is not None

    def bind(self, module: nn.Module, world: Group) -> None:
        """The parallelized module and the world's group (every run, grouped or not)."""
        self._module, self._world, self._whole_ok = module, world, None

    def whole(self, info: BatchInfo, plan: Plan, rank: int, predicted: dict[str, float] | None = None) -> GroupStep:
        """The step of a batch on one group of every rank with ``plan`` (``info``: the batch's description)."""
        p = group_size(self._world)
        found = Assignment((p,), (tuple(range(info.batch)),), (0.0,))
        return GroupStep(
            found, None, 0, self._world, rank, None, info, (plan,), {}, whole=True, model_metrics=predicted or {}
        )

    def setup(
        self, module: nn.Module, world: Group, planner: Planner, measured: float | None = None
    ) -> tuple[float, float] | None:
        """The aligned process groups (``new_group`` is collective: every rank, once, here) and the measured cost of
        the weight exchange (``measured`` seconds of the largest one, e.g. kept with the machine's measurement; else
        measured here), which corrects the cost model's prediction of it: returns ``(measured, predicted)``
        seconds (``None`` without a cost model).

        Raises:
            ValueError: For a model whose dimensions the group cost cannot read (no attention dispatch module, or
                no MLP of either kind: a dispatch module or the block's own code around rewritten linears), before
                any collective.
        """

        self._dims = dims_from_module(module)  # raises (alike on every rank) for a model the cost cannot describe
        self._module, self._world, self._planner = module, world, planner
        p = group_size(world)
        if isinstance(planner, CostPlanner):
            self.warm()  # raises (alike on every rank, before any collective) where a group size cannot be planned
        self._set = GroupSet(world)
        if isinstance(planner, CostPlanner):
            predicted = exchange_seconds(self._dims, planner.model.machine, p, 1)
            if measured is None:
                measured = measure_regroup(module, world)
            if measured is None:  # the whole weights would not fit a GPU beside the model: priced, not measured
                self.exchange_scale = 1.0
                return None
            self.exchange_scale = measured / predicted if predicted > 0 else 1.0
            return measured, predicted
        return None

    def warm(self) -> tuple[int, float]:
        """Every group size's planner plans ahead the buckets of short batches
        (:meth:`~lightning_paradyse.planning.planner.CostPlanner.warm`, up to :data:`WARM_BUCKETS` buckets' worth
        of tokens): the same plans a decision would make on first sight, made here on every rank alike, so that
        the first steps' decisions plan nothing new. Returns (and keeps in :attr:`warmed`) the shapes planned and
        the seconds taken."""
        started, planned = time.perf_counter(), 0
        for g in group_sizes(group_size(self._world)):
            planner = self.planner_for(g)
            if isinstance(planner, CostPlanner):
                planned += planner.warm(WARM_BUCKETS * planner.bucket_tokens)
        self.warmed = (planned, time.perf_counter() - started)
        return self.warmed

    def teardown(self) -> None:
        """Drop the process groups and the model (the strategy destroys the world group next)."""
        if self.kept is not None and self._module is not None:  # a fit stopped between micro-batches
            drop_group(self._module)
        self.kept, self._versions, self._whole, self._gather_next, self._whole_ok = None, [], None, False, None
        self._set, self.step, self._planners, self._runs, self._costs = None, None, {}, {}, {}
        self._found.clear()
        self._world, self._module, self._planner = None, None, None

    def planner_for(self, g: int) -> Planner:
        """The planner of a group of ``g`` ranks (the cost model's machine, collectives for every size; a group of
        one with the profile's constants of one rank where it has them, :attr:`~.cost.model.CostModel.one_rank`,
        larger groups with the world's: :func:`~lightning_paradyse.planning.planner.group_calibration`)."""
        if g not in self._planners:
            planner = self._planner
            if isinstance(planner, CostPlanner):
                assert self._module is not None
                if g == group_size(self._world):
                    self._planners[g] = planner
                else:
                    modes, prefer = group_planning(g, planner.modes, planner.prefer_tp_sp)
                    self._planners[g] = make_planner(
                        self._module,
                        g,
                        planner.budget,
                        machine_for_groups(planner.model.machine, group_size(self._world)),
                        modes,
                        bucket_tokens=self.plan_bucket,
                        recompute=planner.recompute,
                        prefer_tp_sp=prefer,
                        calibration=group_calibration(g, planner.model),
                        compute_bytes=planner.model.dims.compute_bytes,
                    )
            else:  # a fixed plan (or thresholds): the same planner on every group
                assert planner is not None
                self._planners[g] = planner
        return self._planners[g]

    def decide(
        self,
        batch: Any,
        host: Any,
        info: BatchInfo,
        units: Units,
        rank: int,
        causal: bool,
        mean_loss: bool,
        finish_plan: Callable[[Plan], Plan],
    ) -> GroupStep | None:
        """The split of a batch among groups, this rank's part of it, every group's plan checked; ``None`` when no
        split fits the memory budget and ``on_infeasible="skip"``.

        Everything is decided from the batch alone, alike on every rank, before any collective: values are read on
        ``host``, the batch on the host (the group's batch is cut out of ``batch``, on its device). ``finish_plan``
        completes a planned plan (the model's own gradient checkpointing).
        """
        assert self._set is not None and self._module is not None
        started = time.perf_counter()
        p = group_size(self._world)
        packed = self._cost(True, exchange=True) if units.packed else None
        shape = None if units.packed else self._cost(False, exchange=True, shaped=True)

        def rows(s: int, b: int, g: int) -> float | None:  # rows: the cost of a group's longest row and count
            return shape(s, b, g) if self._runs_on(g, s, b) else None  # type: ignore[misc]

        def cost(lengths: tuple[int, ...], g: int) -> float | None:
            if packed is None:
                return rows(max(lengths), len(lengths), g)
            return packed(lengths, g) if self._runs_on(g, sum(lengths), 1) else None

        def solve() -> Assignment | None:
            # rows may leave a group idle (a placeholder step of weight 0, priced as a step); packed documents keep
            # every group busy
            return solver.assign(
                units.lengths,
                p,
                cost,
                all_busy=units.packed,
                shape=None if units.packed else rows,
                idle=None if units.packed else placeholder_cost(rows, units.lengths),
            )

        found = self._assign(units, solve)
        if found is None and self.on_infeasible == "skip":
            return None
        if found is None:
            kind = "documents" if units.packed else "sequences"
            raise ValueError(
                f"no split of the {p} ranks into groups fits the batch of {len(units.lengths)} {kind} "
                f"({info.seq_len} tokens) in the memory budget; use groups=False, a larger memory_budget or shorter "
                f"batches"
            )
        plans, model_metrics = [], {}
        checked: dict[tuple[int, int, int], Plan] = {}  # groups of one shape (data parallelism: often all) planned once
        for g, members in zip(found.sizes, found.groups):  # every group's plan checked on every rank
            s_b = (units.length(members), len(members) if not units.packed else 1) if members else (g, 1)
            group_shape = (g, *s_b)
            if group_shape in checked:
                plans.append(checked[group_shape])
                continue
            planner = self.planner_for(g)
            planned = planner.plan(*s_b)
            plan = checked[group_shape] = finish_plan(planned)
            parallel.check_plan(self._module, plan, g)
            plans.append(plan)
            if g == p and plan == planned:  # one group of every rank: the cost model's numbers of its whole step
                model_metrics = plan_predictions(planner, *s_b)
        index, pg = self._set.mine(found.sizes)
        local_rank = rank - blocks(found.sizes)[index].start
        members, g = found.groups[index], found.sizes[index]
        sub = units.cut(batch, members, idle_tokens=g)  # no members: the idle group's placeholder, a token a rank
        tokens = find_tokens(batch)
        device = tokens.device
        # the cut read on the host: the batch's own where it holds the host batch's tensors (a host run), else the
        # host batch's (a device's would be read there)
        on_host = sub if tokens is find_tokens(host) else units.cut(host, members, idle_tokens=g)
        mine = describe_batch(  # read on the host batch's cut; the step digests the whole batch's checksum
            on_host, g, local_rank, causal, mean_loss=mean_loss, require_targets=False, digest=False
        )
        mine = replace(mine, n_global=info.n_global, checksum=info.checksum, idle=not members)
        mine = on_device(mine, device)
        bare = self._cost(units.packed, exchange=False)  # the groups' compute
        predicted = tuple(
            (bare(tuple(units.lengths[i] for i in m), g) or 0.0) if m else 0.0
            for g, m in zip(found.sizes, found.groups)
        )
        shifted = units.shifted_sources(host, members, g) if parallel.shifts_labels(self._module) else {}
        shifts = {k: (to_device(t, device), n, given) for k, (t, n, given) in shifted.items()}
        reuse = self.kept == found.sizes and not self._stale()
        solve_s = time.perf_counter() - started
        return GroupStep(
            found,
            units,
            index,
            pg,
            local_rank,
            sub,
            mine,
            tuple(plans),
            shifts,
            predicted,
            solve_s,
            reuse,
            model_metrics=model_metrics,
        )

    def _assign(self, units: Units, solve: Callable[[], Assignment | None]) -> Assignment | None:
        """The solver's split of ``units`` (``solve()``), kept for the last :data:`DECISIONS_KEPT` batches' units: the
        costs it reads are made once per run (:meth:`_cost`), so a batch whose units were seen before (fixed-length
        rows: every step) gets the same split without a search."""
        key = (units.packed, units.lengths)
        if key in self._found:
            self._found.move_to_end(key)
            return self._found[key]
        found = self._found[key] = solve()
        if len(self._found) > DECISIONS_KEPT:
            self._found.popitem(last=False)
        return found

    def _cost(self, packed: bool, exchange: bool, shaped: bool = False) -> Any:
        """The group cost (:func:`~lightning_paradyse.groups.cost.group_cost`, or for rows with ``shaped`` its
        :func:`~lightning_paradyse.groups.cost.group_shape_cost`), made once per run: its cache of predicted
        shapes lasts across steps."""
        key = (packed, exchange, shaped)
        if key not in self._costs:
            p = group_size(self._world)
            made: Any
            if shaped:
                made = group_shape_cost(self._dims, p, self.planner_for, self.exchange_scale, exchange=exchange)
            else:
                made = group_cost(self._dims, p, self.planner_for, packed, self.exchange_scale, exchange=exchange)
            self._costs[key] = made
        return self._costs[key]

    def _runs_on(self, g: int, s: int, b: int) -> bool:
        """Whether the plan a group of ``g`` gets for ``b`` sequences of ``s`` tokens can run on ``g`` ranks (a
        fixed plan's mode may need heads divisible by ``g``; the cost planner only plans feasible modes). Cached
        per plan."""

        planner = self.planner_for(g)
        if isinstance(planner, CostPlanner):
            return True
        try:
            plan = planner.plan(s, b)
        except PlanInfeasible:
            return False
        key = (g, plan)
        if key not in self._runs:
            assert self._module is not None
            try:
                parallel.check_plan(self._module, plan, g)
                self._runs[key] = True
            except ValueError:
                self._runs[key] = False
        return self._runs[key]

    @property
    def weights_ride_agreement(self) -> bool:
        """Whether the next training batch's :meth:`agree` brings the whole weights (the last training step was
        data parallel)."""
        return self._gather_next and group_size(self._world) > 1

    def agree(self, header: Sequence[int], training: bool = True) -> list[list[int]]:
        """Every rank's ``header`` (integers: the digest of the step's plans and batch first), in rank order: one
        all-gather over every rank, before any other collective of the step (the caller compares them). Every rank
        must send as many integers.

        After a data-parallel step (groups of one, its gradients returned) the next training batch's all-gather also
        brings every rank the whole weights (:func:`~lightning_paradyse.groups.exchange.gather_whole`: the sizes it
        moves do not depend on the step decided, so ranks that disagree, or skip the batch, still meet in it), which
        :meth:`enter` cuts the step's shards out of: a data-parallel step after another makes one collective besides
        the gradient return, as DDP. Whether it does is known alike on every rank (it follows the last training
        step, which they agreed on; an evaluation batch in between, ``training=False``, agrees on its header alone
        and leaves it). A step on other groups after a data-parallel one has moved more weights than it needed (the
        whole model, not its ``1/g`` rows): the cost of that guess."""
        self._whole = None
        p = group_size(self._world)
        if p == 1:
            return [list(header)]
        mine = torch.tensor(list(header), dtype=torch.int64)  # [k]
        if training and self._gather_next:
            assert self._module is not None
            self._gather_next = False
            every, self._whole = gather_whole(self._module, self._world, mine)  # [k] -> [p, k]
            return every.tolist()  # type: ignore[no-any-return]
        mine = to_device(mine.view(1, -1), collective_device(self._world))  # [k] -> [1, k]
        with polled():  # every rank reaches it together
            every = all_gather_rows(mine, [1] * p, self._world)  # [1, k] -> [p, k]
        return every.tolist()  # type: ignore[no-any-return]

    def enter(self, step: GroupStep) -> None:
        """This rank's ``1/g`` shards (a collective over every rank; none when ``step.reuse``, or when the
        agreement brought the whole weights), then its group's layout and plan."""
        module = self._module
        assert module is not None
        whole, self._whole = self._whole, None
        if step.whole:
            self.flush()  # shards kept from a grouped micro-batch give their gradients back first
        elif not step.reuse:
            self.flush()
            enter_group(module, self._world, step.assignment.sizes, whole)
            self.exchanges += 1
        doc_ids = step.info.doc_ids
        ctx = SeqContext(step.info.layout, step.group, doc_ids, step.info.idle, step.info.host_doc_ids)
        parallel.configure(module, ctx, step.plan)
        self.step = step
        self._started = time.perf_counter()

    def finish(self, accumulating: bool, share: Tensor | None = None, timed: bool = True) -> Tensor | None:
        """After the backward: the ``1/g`` gradients back onto the ``1/P`` shards with the replicated gradients
        summed over every rank and every rank's measured seconds (one all-to-all over every rank), unless micro-batches
        are left to accumulate: the shards are then kept and nothing moves.

        ``share``: this rank's share of the step's loss (a scalar), sent to every rank in the same all-to-all.
        Returns every rank's share in rank order (``[P]`` float64 where the collective ran: not read here), or
        ``None`` when nothing carried it (one group, micro-batches left, a model without shards): the caller then
        sums it itself.

        ``timed``: the step's priced part is timed (:attr:`times`; on a GPU its kernels are waited for before the
        clock is read, and every rank's seconds are read on the host after the return: the two synchronisations a
        step on groups makes besides its agreement). Untimed, nothing here waits for the device and :attr:`times` is
        empty. The cycle times a fit's first steps and the steps the logger logs.
        """
        step, self.step = self.step, None
        module = self._module
        assert module is not None
        self.times = ()
        if step is None or step.whole:  # one group (or a skipped batch): the replicated gradients, when it steps
            if not accumulating:
                self.flush()  # a skipped last micro-batch: the earlier ones' kept shards
                parallel.reduce_replicated_grads(module, self._world)
                if timed:
                    synchronize(next(module.parameters()).device)  # the priced part ends with the gradients summed
            return None
        self.kept = step.assignment.sizes
        if accumulating:  # the weights the kept shards were gathered from (unchanged since: no optimizer step)
            self._versions = [(w, w._version) for w in module.parameters()]
            return None  # the seconds are measured where the gradients return (the micro-batch that steps)
        if timed:
            synchronize(next(module.parameters()).device)  # the step's kernels, not only their launches
        mine = time.perf_counter() - self._started if timed else 0.0
        kept, self.kept, self._versions = self.kept, None, []
        numbers = torch.tensor([mine], dtype=torch.float64)
        if share is not None:  # [2]: seconds, loss share (float64 holds a float32 or bf16 share exactly)
            numbers = torch.cat([to_device(numbers, share.device), share.detach().reshape(1).to(torch.float64)])
        every = exit_group(module, self._world, kept, replicated=True, extra=numbers)  # [P, k] or None: one group
        for _, op in parallel.dispatchers(module):  # the 1/g shards are gone: a later call raises, not misreads
            op.unconfigure()
        self._gather_next = kept == (1,) * len(kept) and self._gathers_whole()
        if every is None:
            if timed:
                self.times = tuple(mine if members else 0.0 for members in step.assignment.groups)
            return None
        if timed:
            per_rank = every[:, 0].tolist()  # every rank's seconds on the host (on a GPU: waits for the return)
            self.times = tuple(  # an idle group's placeholder step counts as no time (as predicted)
                max(per_rank[r] for r in block) if members else 0.0
                for block, members in zip(blocks(step.assignment.sizes), step.assignment.groups)
            )
        return None if share is None else every[:, 1]

    def _gathers_whole(self) -> bool:
        """Whether the agreement may bring the whole weights (the shards in one dtype; read once a run)."""
        if self._whole_ok is None:
            assert self._module is not None
            self._whole_ok = whole_dtype(self._module, self._world) is not None
        return self._whole_ok

    def flush(self) -> None:
        """Return the gradients of the kept ``1/g`` shards to the ``1/P`` shards and drop the shards (a collective
        over every rank; nothing when none are kept). Before a differently split micro-batch, the optimizer
        step, or a batch that does not run on groups."""
        kept, self.kept, self._whole = self.kept, None, None
        if kept is not None:
            assert self._module is not None
            exit_group(self._module, self._world, kept, replicated=False)
            self._versions = []

    def _stale(self) -> bool:
        """Whether a parameter changed in place since the kept shards were gathered from it."""
        return any(w._version != version for w, version in self._versions)


__all__ = ["DECISIONS_KEPT", "WARM_BUCKETS", "GroupRunner", "GroupStep", "group_sizes", "imbalance", "plan_predictions"]
