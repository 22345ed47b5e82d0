"""The strategy's steps on groups of different sizes (``ParaDySeStrategy(groups=True)``), as a mixin.

Per packed training batch (:meth:`GroupSteps._begin_groups`, from the strategy's ``begin_batch``, calls these in
order):

1. :meth:`GroupSteps.group_step`: split the ranks and assign the documents
   (:func:`lightning_paradyse.cost.groups.assign` on :func:`lightning_paradyse.groups.planner_cost`), cut
   every group's packed batch out and check its plan, on every rank alike and before any collective;
2. :meth:`GroupSteps.activate_group`: the ``1/g`` shards (:func:`lightning_paradyse.groups.enter_group`), then the
   group's layout and plan;
3. the module's training step on this rank's tokens of its group's batch (the strategy's ``_shard_step``);
4. :meth:`GroupSteps.finish_group_step` after the backward: the measured group times (all-gathered, they teach
   :class:`~lightning_paradyse.groups.StepScales`), the gradients back onto the ``1/P`` shards
   (:func:`lightning_paradyse.groups.exit_group`) and the replicated gradients summed over every rank.

The regroup's real cost is measured once at setup (:meth:`GroupSteps._setup_groups`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_paradyse import parallel
from lightning_paradyse.comm import Group, all_gather_rows, group_size
from lightning_paradyse.groups import StepScales
from lightning_paradyse.plan import Plan
from lightning_paradyse.policy import Planner
from lightning_paradyse.slicing import BatchInfo, describe_batch
from lightning_paradyse.spec import SeqContext
from lightning_paradyse.step import PlanRecord, StepRecord, batch_digest, describe, plan_metrics


class GroupSteps:
    """Grouped training steps for :class:`~lightning_paradyse.strategy.ParaDySeStrategy` (see the module docstring)."""

    # provided by the strategy
    _group: Group
    _pending: BatchInfo | None
    planner: Planner | None
    plan_bucket: int
    loss_reduction: str
    on_infeasible: str

    modes: tuple[str, ...]
    history: deque[PlanRecord]

    if TYPE_CHECKING:  # the strategy's own (declared here for the type checker only: no override at run time)

        def skip(self, info: BatchInfo, reason: str) -> None: ...

        def verify_ranks(self, digest: int) -> None: ...

        def record_plan(self, record: PlanRecord) -> None: ...

        def with_checkpointing(self, plan: Plan) -> Plan: ...

        @property
        def _module(self) -> nn.Module: ...

        @property
        def global_rank(self) -> int: ...

        def _accumulating(self) -> bool: ...

    def _init_groups(self, groups: bool) -> None:
        self.groups = groups
        self._group_set: Any = None
        self._group_dims: Any = None
        self._regroup_scale = 1.0
        self._step_scales = StepScales()
        self._group_planners: dict[int, Planner] = {}
        self._group_step: Any = None
        self._last_groups: Any = None
        self._group_shifts: dict[str, tuple[torch.Tensor, int]] = {}
        """Per batch key of a grouped step: the whole batch's shifted labels cut to this group's documents, and
        their real count in the whole batch (labels handed to a Hugging Face model are shifted over the batch)."""
        self._group_started = 0.0
        self.group_times: tuple[float, ...] = ()
        """Measured seconds of every group's forward and backward (its slowest rank) in the last grouped step."""

    def _setup_groups(self) -> None:
        """The aligned process groups (``new_group`` is collective: every rank, once, here) and the measured
        cost of regrouping the weights, which corrects the cost model's prediction of it."""
        from lightning_paradyse.cost.dims import dims_from_module
        from lightning_paradyse.cost.planner import CostPlanner
        from lightning_paradyse.groups import GroupSet, measure_regroup, regroup_seconds

        p = group_size(self._group)
        self._group_set = GroupSet(self._group)
        self._group_dims = dims_from_module(self._module)  # the group cost's model dimensions, once
        planner = self.planner
        if isinstance(planner, CostPlanner):
            predicted = regroup_seconds(self._group_dims, planner.model.machine, p, 1)
            measured = measure_regroup(self._module, self._group)
            self._regroup_scale = measured / predicted if predicted > 0 else 1.0
            rank_zero_info(
                f"[paradyse] groups: regrouping the weights takes {measured * 1e3:.1f} ms (predicted "
                f"{predicted * 1e3:.1f} ms); the group cost uses the measurement"
            )

    def uses_groups(self, info: BatchInfo, stage: str) -> bool:
        """Whether this batch runs on groups of different sizes (``groups=True``, a packed training batch)."""
        return self._group_set is not None and stage == "train" and info.doc_ids is not None

    def _begin_groups(self, batch: Any, info: BatchInfo, stage: str) -> StepRecord:
        """A packed training batch on groups of different sizes: split, verify, activate; the record to log."""
        from lightning_paradyse.groups import imbalance

        started = time.perf_counter()
        split = self.group_step(batch, info)
        solve_s = time.perf_counter() - started
        if split is None:  # decided alike on every rank, which the digest checks
            self.verify_ranks(batch_digest(info.seq_len, info.batch, info.checksum))
            self.skip(info, "no split of the ranks into groups fits the memory budget")
            return StepRecord(stage, info.seq_len, info.batch, None)
        step, mine, plan = split
        self.verify_ranks(step.digest(info.checksum))
        self.activate_group(step, mine, plan)
        self.record_plan(PlanRecord(stage, mine.seq_len, mine.batch, plan))
        found = step.assignment
        metrics = plan_metrics(plan, self.modes, stage) | {
            "groups/count": float(len(found.sizes)),
            "groups/own_size": float(step.size),
            "groups/predicted_time_s": float(found.time),
            "groups/predicted_imbalance": imbalance(found.times),
            "groups/solve_s": solve_s,
        }
        line, key = None, (found.sizes, plan)
        if key != self._last_groups:
            sizes = "+".join(map(str, found.sizes))
            line = f"[paradyse] {stage} length {info.seq_len}: groups {sizes}, rank 0's plan {describe(plan)}"
            self._last_groups = key
        return StepRecord(stage, mine.seq_len, mine.batch, plan, metrics, line)

    def _planner_for(self, g: int) -> Planner:
        """The planner of a group of ``g`` ranks (the cost model's machine, collectives for every size)."""
        if g not in self._group_planners:
            from lightning_paradyse.cost.planner import CostPlanner, make_planner
            from lightning_paradyse.groups import machine_for_groups

            planner = self.planner
            if isinstance(planner, CostPlanner):
                machine = machine_for_groups(planner.model.machine, group_size(self._group))
                self._group_planners[g] = make_planner(
                    self._module,
                    g,
                    planner.budget,
                    machine,
                    planner.modes,
                    bucket_tokens=self.plan_bucket,
                    recompute=planner.recompute,
                )
            else:  # a fixed plan (or thresholds): the same plan on every group
                assert planner is not None
                self._group_planners[g] = planner
        return self._group_planners[g]

    def group_step(self, batch: Any, info: BatchInfo) -> tuple[Any, BatchInfo, Plan] | None:
        """Split a packed batch among groups: ``(GroupStep, this rank's batch info, its plan)``; ``None`` when no
        split fits the memory budget and ``on_infeasible="skip"``.

        Everything is decided from the batch alone, alike on every rank, and every group's batch and plan are
        checked here, before any collective.
        """
        from lightning_paradyse.cost.groups import assign
        from lightning_paradyse.groups import GroupStep, blocks, planner_cost, select_documents
        from lightning_paradyse.slicing import IGNORE_INDEX, shifted_labels
        from lightning_paradyse.spec import document_bounds

        assert self._group_set is not None
        p = group_size(self._group)
        spans = document_bounds(info.doc_ids, info.seq_len)
        lengths = [b - a for a, b in spans]

        dims = self._group_dims
        cost = planner_cost(dims, p, self._planner_for, self._regroup_scale, self._step_scales.scales)
        found = assign(lengths, p, cost, all_busy=True)
        if found is None and self.on_infeasible == "skip":
            return None
        if found is None:
            raise ValueError(
                f"no split of the {p} ranks into groups fits the packed batch of {len(lengths)} documents "
                f"({info.seq_len} tokens) in the memory budget; use groups=False, a larger memory_budget or shorter "
                f"batches"
            )
        causal, mean = parallel.is_causal(self._module), self.loss_reduction == "mean"
        steps = []
        for g, members in zip(found.sizes, found.groups):  # every group's batch and plan checked on every rank
            sub = select_documents(batch, spans, members)
            sub_info = describe_batch(sub, g, 0, causal=causal, mean_loss=mean)
            plan = self.with_checkpointing(self._planner_for(g).plan(sub_info.seq_len, 1))
            parallel.check_plan(self._module, plan, g)
            steps.append((sub, plan))
        index, pg = self._group_set.mine(found.sizes)
        rank = self.global_rank - blocks(found.sizes)[index].start
        sub, plan = steps[index]
        mine = describe_batch(sub, found.sizes[index], rank, causal=causal, mean_loss=mean)
        mine = replace(mine, n_global=info.n_global, checksum=info.checksum)
        whole = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and tuple(v.shape) == (1, info.seq_len)}
        shifted = {k: shifted_labels(v) for k, v in whole.items()}  # shifted over the whole batch, then cut
        cut = select_documents(shifted, spans, found.groups[index])
        self._group_shifts = {k: (cut[k], int((shifted[k] != IGNORE_INDEX).sum())) for k in shifted}
        bare = planner_cost(dims, p, self._planner_for, regroup=False)  # what the learned correction corrects
        predicted = tuple(bare(tuple(lengths[i] for i in m), g) or 0.0 for g, m in zip(found.sizes, found.groups))
        return GroupStep(found, index, pg, rank, sub, predicted), mine, plan

    def activate_group(self, step: Any, info: BatchInfo, plan: Plan) -> None:
        """This rank's 1/g shards (a collective over every rank), then its group's layout and plan."""
        from lightning_paradyse.groups import enter_group

        module = self._module
        enter_group(module, self._group, step.assignment.sizes)
        parallel.configure(module, SeqContext(info.layout, step.group, info.doc_ids), plan)
        self._pending, self._group_step = info, step
        self._group_started = time.perf_counter()

    def finish_group_step(self) -> None:
        """The 1/g gradients back onto the 1/P shards (a collective over every rank); the replicated gradients
        summed over every rank when no micro-batch is left to accumulate."""
        from lightning_paradyse.groups import blocks, exit_group

        step, self._group_step = self._group_step, None
        if step is None:
            return
        elapsed = torch.tensor([time.perf_counter() - self._group_started], dtype=torch.float64)
        per_rank = all_gather_rows(elapsed, [1] * group_size(self._group), self._group).tolist()  # [1] -> [P]
        self.group_times = tuple(max(per_rank[r] for r in block) for block in blocks(step.assignment.sizes))
        self._step_scales.update(step.assignment.sizes, step.predicted, self.group_times)  # alike on every rank
        exit_group(self._module, self._group, step.assignment.sizes, replicated=False)
        if not self._accumulating():
            parallel.reduce_replicated_grads(self._module, self._group)
