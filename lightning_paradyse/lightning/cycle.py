"""The per-batch cycle of :class:`~lightning_paradyse.lightning.strategy.ParaDySeStrategy`: one object owns every
batch's state.

The strategy runs Lightning's lifecycle and hands each batch to its :class:`StepCycle`, in this order:

1. :meth:`StepCycle.begin` (the strategy's ``on_train_batch_start`` and its evaluation steps): the batch described
   on the host and validated, the ranks split into groups and every group's plan chosen
   (:meth:`~lightning_paradyse.groups.runner.GroupRunner.decide`, or one group of every rank:
   :meth:`~lightning_paradyse.groups.runner.GroupRunner.whole`), every rank's plan and batch agreed (one
   all-gather of a digest, with rank 0's SIGTERM flag for a training batch (:mod:`~.lightning.sigterm`), which after
   a data-parallel step brings the whole weights too), the
   step entered (:meth:`~lightning_paradyse.groups.runner.GroupRunner.enter`); the
   :class:`~lightning_paradyse.lightning.records.StepRecord` the callback logs;
2. :meth:`StepCycle.shard`: the module's step gets this rank's tokens of its group's batch;
3. :meth:`StepCycle.global_output`: the loss the module returns made the global one: in a training step on groups
   every rank's share rides on the gradient return (step 4) and is written into the loss Lightning keeps
   (:func:`reporting_result`); otherwise one all-reduce. What the module's step logged is held while it runs and
   logged with the global loss in place of the step's own (:meth:`StepCycle.logged`; :mod:`~.lightning.step_logs`),
   and the loss tensor the step returned is given the global loss in place once its backward ran
   (:func:`write_global`: a list the module keeps it in reads one process's values);
4. :meth:`StepCycle.after_backward`: the gradients summed where they belong
   (:meth:`~lightning_paradyse.groups.runner.GroupRunner.finish`), and the deferred loss settled.

Every batch takes this one path: a single packed document, validation, test and ``groups=False`` are a step on one
group of every rank. A batch no plan fits (``on_infeasible="skip"``) is marked skipped on every rank alike.

A training step's record predicts its whole time: the cost model's part (scaled by how far such steps' priced part
ran from it), its decision's seconds and the fixed part the cycle measures on the run's steps
(:mod:`~lightning_paradyse.lightning.fixed_cost`; :meth:`StepCycle.stepped` marks the end of a step).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_paradyse.distributed.comm import Group, all_reduce_sum, group_size, synchronize
from lightning_paradyse.distributed.devices import to_device
from lightning_paradyse.groups.runner import GroupRunner, GroupStep, imbalance, plan_predictions
from lightning_paradyse.groups.units import Units
from lightning_paradyse.lightning.fixed_cost import FixedCost
from lightning_paradyse.lightning.options import StrategyOptions
from lightning_paradyse.lightning.records import (
    HISTORY_LIMIT,
    PlanRecord,
    StepRecord,
    batch_digest,
    describe,
    plan_metrics,
)
from lightning_paradyse.lightning.refusals import refuse_joined_documents
from lightning_paradyse.lightning.sigterm import SigtermFlag
from lightning_paradyse.lightning.step_logs import StepLogs
from lightning_paradyse.modes.plan import Plan
from lightning_paradyse.planning.fixed import Planner
from lightning_paradyse.planning.planner import CostPlanner, PlanSkipped
from lightning_paradyse.runtime import exactness, hf_checkpointing, parallel
from lightning_paradyse.runtime.slicing import BatchInfo, describe_batch, find_tokens, on_device, shard_batch, to_host


class GlobalLoss(torch.autograd.Function):
    """Forward: the sum of every rank's ``local`` (all-reduce); backward: the gradient, unchanged.

    Each rank returns ``w_r * local_r``; the sum is the global loss on every rank, and since each
    rank's contribution enters the sum with coefficient 1, the identity backward gives every rank the
    gradient of its own contribution, which the modes' collectives and the replicated-gradient
    all-reduce then combine into the exact gradient of the global loss. (A loss settled later, on the gradient
    return, is this rank's share itself: :meth:`StepCycle.global_loss`.)
    """

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Group) -> Tensor:
        return all_reduce_sum(local, group) if group_size(group) > 1 else local.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def reporting_result(cycle: StepCycle, base: type[ClosureResult] = ClosureResult) -> type[ClosureResult]:
    """Lightning's result of a training step (automatic optimization, ``base``) that hands the loss it keeps (the
    detached copy the batch-end hooks, logs and progress bar read) to ``cycle``, which writes the global loss into it
    once the gradient return has summed every rank's share (:meth:`StepCycle.settle_loss`)."""

    class ReportingResult(base):  # type: ignore[valid-type,misc]
        def _clone_loss(self) -> None:
            super()._clone_loss()
            if self.loss is not None:
                cycle.report(self.loss)

    return ReportingResult


class StepCycle:
    """Every batch's state and its cycle (see the module docstring). Made once per strategy; :meth:`bind` at setup.

    Args:
        options: The strategy's options.
        check_plan: The strategy's check of a plan against its modes and the model (raises naming the layer).
    """

    def __init__(self, options: StrategyOptions, check_plan: Callable[[Plan], None]) -> None:
        self.options = options
        self.check_plan = check_plan
        self.runner = GroupRunner(options.plan_bucket, options.on_infeasible)
        """The groups of a step (the collaborator that owns that feature's per-run state)."""
        self.record: StepRecord | None = None
        """What the last batch ran with (the callback logs it)."""
        self.history: deque[PlanRecord] = deque(maxlen=HISTORY_LIMIT)
        """The plans executed (training, validation, test), in order: the last
        :data:`~lightning_paradyse.lightning.records.HISTORY_LIMIT`."""
        self.plans_executed = 0
        self.skipped_batches = 0
        self.pending: BatchInfo | None = None
        """The batch begun and not yet run: what the module's step is handed (``skip``: no plan fit it)."""
        self.taken: BatchInfo | None = None
        """The batch whose module step runs or ran last (:meth:`take`)."""
        self.skipping = False
        """The last batch begun is skipped (no plan fit it): its step, backward and optimizer step change nothing
        (read by the optimizer step, which Lightning calls before the closure runs the module's step)."""
        self.checkpointed: tuple[int, ...] = ()
        """Layers the model's Hugging Face gradient checkpointing marks (read before every batch)."""
        self.window: tuple[int, str] | None = None
        self.fixed = FixedCost()
        """The fixed part of the training steps and the scale of their priced part (measured; the step record's
        predictions add the one and are scaled by the other)."""
        self.sigterm = SigtermFlag()
        """Rank 0's SIGTERM flag rides the training batches' agreement in place of Lightning's broadcast (installed
        by the strategy for a fit on several ranks)."""
        self.timed = False
        """The training step begun is measured (:meth:`begin`): its priced part, group times and fixed part."""
        self.reports_loss = False
        """Lightning hands this cycle the loss it keeps (:func:`reporting_result` is installed): a training step on
        groups may then settle the global loss on the gradient return."""
        self.logs = StepLogs()
        """What the module's step logs, held until the step's global loss is known (the strategy captures them)."""
        self._share: Tensor | None = None
        self._reported: Tensor | None = None
        self._returned: tuple[Tensor, Tensor | None] | None = None
        """The loss tensor the module's step returned and the global loss to write into it once its backward ran
        (:meth:`logged`; ``None``: a deferred loss, written when it settles)."""
        self._aside: list[tuple[Tensor, Tensor]] | None = None
        """Gradients summed before the backward in flight (:meth:`set_aside`); ``None`` outside one."""
        self._groups_returned = False
        """The step ran on groups and its backward returned their gradients (a second backward would be lost)."""
        self._module: nn.Module | None = None
        self._group: Group = None
        self._rank = 0
        self._planner: Planner | None = None
        self._blocks: list[str] = []
        self._host_batch: tuple[Any, Any, list[tuple[int, int]]] | None = None
        self._last_plan: Plan | None = None
        self._last_groups: Any = None

    def bind(self, module: nn.Module, group: Group, rank: int, planner: Planner, blocks: list[str]) -> None:
        """The parallelized module, the world's group, this rank, the planner and the rewritten blocks (setup)."""
        self._module, self._group, self._rank, self._planner, self._blocks = module, group, rank, planner, blocks
        self.runner.bind(module, group)
        self.logs.bind(module)  # its metrics' calls recorded in its steps

    @property
    def module(self) -> nn.Module:
        if self._module is None:
            raise RuntimeError("ParaDySeStrategy: the step cycle is not set up yet (call through a Trainer)")
        return self._module

    @property
    def plan(self) -> Plan | None:
        """The plan of the step in flight (this rank's group's)."""
        step = self.runner.step
        return None if step is None else step.plan

    # ------------------------------------------------------------------ 1. begin

    def keep_host_batch(self, moved: Any, loader_batch: Any | None) -> None:
        """The batch Lightning moved to the device and the loader's batch it holds the values of (``None``: the
        transfer may change them), with the moved tensors' identities and version counters. Tensors made under
        ``torch.inference_mode`` (Lightning's evaluation and predictions on one device or with NCCL) keep no version
        counter: nothing is kept for them (:meth:`on_host` copies the batch)."""
        versions = None if loader_batch is None else _tensor_versions(moved)
        self._host_batch = None if versions is None else (moved, loader_batch, versions)

    def on_host(self, batch: Any) -> Any:
        """The batch on the host: the loader's batch it was moved from while the batch still holds the tensors that
        were moved, unchanged (no batch-start hook replaced or modified one in place), else a copy (one wait on a
        GPU)."""
        kept, self._host_batch = self._host_batch, None
        if kept is not None and kept[0] is batch and _tensor_versions(batch) == kept[2]:
            return to_host(kept[1])  # the loader's tensors (on the host already: nothing is copied)
        return to_host(batch)

    def inspect(self, batch: Any) -> BatchInfo:
        """Validate a global batch and describe it; raises (identically on every rank) before any collective."""
        info = describe_batch(
            batch,
            group_size(self._group),
            self._rank,
            causal=parallel.is_causal(self.module),
            max_seq_len=self.options.max_seq_len,
            mean_loss=self.options.mean_loss,
        )
        exactness.check_window(info.seq_len, self.window)
        refuse_joined_documents(self.module, info.doc_ids is not None)
        return info

    def begin(
        self,
        batch: Any,
        stage: str,
        check_wanted: Callable[[BatchInfo], bool] | None = None,
        logged: bool = False,
    ) -> StepRecord:
        """Validate, plan, agree, enter (see the module docstring); returns (and keeps in :attr:`record`) what the
        callback logs. ``check_wanted``: whether the step check
        (:meth:`~lightning_paradyse.lightning.step_check.StepCheck.wants`) may run on a batch so described; a plain
        batch it wants then runs on one group of every rank, as the check needs. Raises,
        identically on every rank and before any collective of the step, for a bad batch, a plan that cannot run, or
        ranks that disagree (the agreement's all-gather only); Lightning's ``SIGTERMException`` after that
        all-gather when rank 0 received SIGTERM.

        A training step is measured (:attr:`timed`: its priced part, group times and fixed part) when the logger logs
        it (``logged``) or the fixed part's estimate has not settled (a fit's first steps, :attr:`FixedCost.settled`);
        the same steps on every rank. On a GPU a timed step first waits for the device (the previous step's kernels,
        which an untimed step does not wait for; the wait is no part of the step) and again at its priced part's end
        (:meth:`after_backward`)."""
        training = stage == "train"
        self.skipping, self._groups_returned = False, False
        self.timed = training and (logged or not self.fixed.settled)
        if training:
            self.fixed.begin()
            if self.timed:
                waiting = time.perf_counter()
                synchronize(next(self.module.parameters()).device)
                self.fixed.waited(time.perf_counter() - waiting)
        else:
            self.fixed.interrupt()  # the next training step counts from its own start, not this batch's
        self.checkpointed = hf_checkpointing.checkpointed_layers(self.module, self._blocks)
        host = self.on_host(batch)
        info = self.inspect(host)  # described on the host (its tensors there)
        checked = check_wanted is not None and info.doc_ids is None and check_wanted(info)
        grouped = self.runner.ready and stage == "train" and not checked
        units = Units.of(info, host) if grouped else None
        self.runner.times = ()
        deciding = time.perf_counter()
        if units is not None:
            step = self.runner.decide(
                batch,
                host,
                info,
                units,
                self._rank,
                parallel.is_causal(self.module),
                self.options.mean_loss,
                self.finish_plan,
            )
            reason = "no split of the ranks into groups fits the memory budget"
        else:
            step, reason = self._whole(on_device(info, find_tokens(batch).device))
        decided = time.perf_counter() - deciding
        if training:
            self.fixed.decided(decided)
        if step is None:  # decided alike on every rank, which the digest checks
            self.agree(batch_digest(info.seq_len, info.batch, info.checksum), training)
            self.runner.flush()
            return self._keep(self._skip(info, reason, stage))
        if training and self.runner.weights_ride_agreement:
            self.fixed.enter()  # the agreement brings the weights: the priced exchange starts with it
        self.agree(step.digest(info.checksum), training)
        if training:
            self.fixed.enter()  # the priced part: the exchange in, forward, backward, the gradient return
        self.runner.enter(step)
        self.pending = step.info
        self.history.append(PlanRecord(stage, step.info.seq_len, step.info.batch, step.plan))
        self.plans_executed += 1
        return self._keep(self._record(stage, info, step, decided))

    def finish_plan(self, plan: Plan) -> Plan:
        """``plan`` with both ops of every layer the model's Hugging Face gradient checkpointing marks recomputed."""
        return hf_checkpointing.with_recompute(plan, self.checkpointed)

    def _whole(self, info: BatchInfo) -> tuple[GroupStep | None, str]:
        """The step on one group of every rank: the planner's plan for the whole batch (``None``: skipped)."""
        assert self._planner is not None, "the strategy makes its planner in setup"
        try:
            planned = self._planner.plan(info.seq_len, info.batch)
        except PlanSkipped as skipped:
            return None, str(skipped)
        plan = self.finish_plan(planned)
        self.check_plan(plan)
        predicted = plan_predictions(self._planner, info.seq_len, info.batch) if plan == planned else {}
        return self.runner.whole(info, plan, self._rank, predicted), ""

    def agree(self, digest: int, training: bool = True) -> None:
        """Raise on every rank unless every rank holds the same ``digest`` (of plan and batch): one all-gather
        (:meth:`~lightning_paradyse.groups.runner.GroupRunner.agree`: for a training batch after a data-parallel
        step it brings the whole weights too). A training batch's carries rank 0's SIGTERM flag as well
        (:mod:`~lightning_paradyse.lightning.sigterm`): every rank raises Lightning's ``SIGTERMException`` when it
        is set."""
        carried = training and self.sigterm.carried
        every = self.runner.agree([digest, self.sigterm.flag()] if carried else [digest], training)
        if carried:
            self.sigterm.check(every[0][1])
        digests = [header[0] for header in every]
        if len(set(digests)) != 1:
            raise RuntimeError(
                f"the ranks disagree on the plan or the batch (digest per rank: {digests}); every rank must see the "
                f"same batches (same data and seed, no per-rank sampler) and the planner must be deterministic"
            )

    def _skip(self, info: BatchInfo, reason: str, stage: str) -> StepRecord:
        """No plan fits this batch: its step is skipped on every rank (the planner decided alike everywhere)."""
        self.skipped_batches += 1
        rank_zero_warn(
            f"[paradyse] skipping a batch of length {info.seq_len} ({self.skipped_batches} so far): {reason}"
        )
        self.pending, self.skipping = replace(info, skip=True), True
        return StepRecord(stage, info.seq_len, info.batch, None)

    def _keep(self, record: StepRecord) -> StepRecord:
        self.record = record
        return record

    def _record(self, stage: str, info: BatchInfo, step: GroupStep, decided: float) -> StepRecord:
        """What the callback logs of a step: the plan's numbers, the groups', and a line when they change. A
        training step's predicted time is its priced part times the measured scale of such steps, plus its unpriced
        part: the measured estimate and its own ``decided`` seconds (:mod:`~.lightning.fixed_cost`)."""
        modes = self.options.modes
        training = stage == "train"
        # seconds of the priced part (none without a cost model: a fixed plan's groups are priced in FLOPs), and the
        # kind of step its measured scale is kept for: the split, how it was priced (the planner's bucket for one
        # group of every rank, the real lengths on groups) and whether it reuses kept shards (no exchange in)
        priced = step.model_metrics.get("plan/predicted_time_s") if step.whole else None
        if not step.whole and isinstance(self._planner, CostPlanner):
            priced = step.assignment.time
        kind = (step.assignment.sizes, step.whole, step.reuse)
        fixed = self.fixed.seconds + decided if training else 0.0
        scale = self.fixed.scale(kind) if training and priced is not None else 1.0
        metrics = plan_metrics(step.plan, modes, stage) | _scaled_plus_fixed(step.model_metrics, scale, fixed)
        if training:
            metrics["plan/predicted_fixed_s"] = fixed
            metrics["plan/predicted_scale"] = scale
            if priced is not None:
                self.fixed.predicted(kind, float(priced))
        if step.whole:
            line = None
            if step.plan != self._last_plan:
                line, self._last_plan = (
                    f"[paradyse] {stage} length {info.seq_len}: plan {describe(step.plan)}",
                    step.plan,
                )
            return StepRecord(stage, step.info.seq_len, step.info.batch, step.plan, metrics, line)
        found = step.assignment
        predicted = (  # the slowest group's seconds; without a cost model its FLOPs per rank (no seconds to add to)
            {"groups/predicted_time_s": float(found.time) * scale + fixed}
            if priced is not None
            else {"groups/predicted_flops": float(found.time)}
        )
        metrics |= predicted | {
            "groups/count": float(len(found.sizes)),
            "groups/own_size": float(step.size),
            "groups/largest_size": float(found.sizes[0]),
            "groups/predicted_imbalance": imbalance([t for t, m in zip(found.times, found.groups) if m]),
            "groups/solve_s": step.solve_s,
            "groups/idle": float(sum(not members for members in found.groups)),
        }
        line, key = None, (found.sizes, step.plans)
        if key != self._last_groups:
            sizes = "+".join(map(str, found.sizes))
            idle = sum(not members for members in found.groups)
            sizes += f" ({idle} idle)" if idle else ""
            line = f"[paradyse] {stage} length {info.seq_len}: groups {sizes}, rank 0's plan {describe(step.plans[0])}"
            self._last_groups = key
        return StepRecord(stage, step.info.seq_len, step.info.batch, step.plan, metrics, line, found.sizes)

    # ------------------------------------------------------------------ 2. the module's step on this rank's tokens

    def take(self, hook: str) -> BatchInfo:
        """The batch begun for the module's ``hook`` (once); kept as :attr:`taken` while the module's step runs."""
        info, self.pending = self.pending, None
        self.taken = info
        if info is None:
            raise RuntimeError(
                f"ParaDySeStrategy.{hook}: the batch was not configured (ParaDySeStrategy.begin_batch runs before "
                f"every batch, from the strategy's on_train_batch_start and its evaluation steps)"
            )
        return info

    def shard(
        self, info: BatchInfo, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The module's step arguments with the batch replaced by this rank's tokens of its group's batch (the
        labels a Hugging Face model is handed are shifted over the whole batch)."""
        step = self.runner.step
        if info.skip or step is None or not (args or "batch" in kwargs):
            return args, kwargs
        given = args[0] if args else kwargs["batch"]
        local, sources = shard_batch(given if step.batch is None else step.batch, info, step.rank)
        self.logs.filled = info.fill_target  # a metric counting the targets then counts one more (told once)
        if step.shifts:  # labels are shifted over the whole batch, not the group's units
            sources = tuple(
                replace(
                    src,
                    shifted=step.shifts[src.key][0],
                    n_items=step.shifts[src.key][1],
                    n_given=step.shifts[src.key][2],
                )
                if src.key in step.shifts
                else src
                for src in sources
            )
        parallel.set_step_sources(self.module, sources, info.padding, local)
        if args:
            return (local, *args[1:]), kwargs
        return args, {**kwargs, "batch": local}

    # ------------------------------------------------------------------ 3. the global loss

    def global_output(self, output: Any, info: BatchInfo, defer: bool = False) -> Any:
        """Replace the local loss of a step's output (a tensor or a dict with ``loss``) by the global loss.

        ``defer`` (a training step of automatic optimization that steps): when the step runs on groups, its loss is
        this rank's share until the gradient return sums every rank's (:meth:`settle_loss`): no collective of its own.
        """
        if isinstance(output, Tensor):
            return self.global_loss(output, info, defer)
        if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
            return {**output, "loss": self.global_loss(output["loss"], info, defer)}
        return output

    def share(self, local: Tensor, info: BatchInfo) -> Tensor:
        """``local * w_r``: this rank's part of the global loss. A mean loss is weighed by this rank's share of the
        batch's real targets; a summed one, or a Hugging Face model's (handed the global count of labels, it returns
        its share already), by 1; an idle group's placeholder by 0."""
        consumed = bool(parallel.step_state(self.module).labels_consumed)
        weight = 1.0 if consumed or not self.options.mean_loss else info.n_local / info.n_global
        if info.idle:  # a placeholder step: weighed by 0 (its loss may be a mean over no target: NaN * 0 is not 0)
            return (local * 0.0).nan_to_num(0.0, 0.0, 0.0)
        return local * weight

    def manual_share(self, loss: Tensor) -> Tensor:
        """What a manual optimization step's ``manual_backward(loss)`` backs: ``loss``, computed on this rank's
        tokens, weighed as its part of the global loss (:meth:`share`), so that the ranks' gradients sum to the
        global loss's (any loss: a mean over the tokens, or one every rank computes alike, e.g. of the weights, whose
        weights sum to 1 over the ranks). Outside a step, ``loss`` as it is."""
        info = self.taken
        if info is None or info.skip:
            return loss
        if self._groups_returned:  # every rank alike (the same step code), before the backward's collectives
            raise RuntimeError(
                "a second manual_backward in one training step on groups: the first returned the groups' gradients "
                "and dropped their weights, so this backward's would be lost. Back the sum of the losses once, or "
                "train with ParaDySeStrategy(groups=False): every step on one group of every rank"
            )
        return self.share(loss, info)

    def set_aside(self) -> None:
        """Before a backward: the replicated parameters' gradients it finds, already summed over the ranks (an
        earlier step's that no ``zero_grad`` cleared, an earlier ``manual_backward``'s), set aside until the gradient
        return after it has summed the new ones (:meth:`put_back`), so that they are not summed again (they were counted
        once per rank until 2026-11-30 in automatic optimization). So are the experts' shards of a mixture of experts:
        the return leaves an expert the new tokens did not visit without a gradient, which must not drop an earlier
        one. Inside a window of accumulated micro-batches (:meth:`after_backward` waits for its last), only its first
        backward sets aside: the later ones find this window's own unsummed gradients."""
        if self._aside is not None:
            return
        self._aside = []
        for w in itertools.chain(parallel.replicated_parameters(self.module), parallel.opaque_parameters(self.module)):
            if w.grad is not None:
                self._aside.append((w, w.grad))
                w.grad = None

    def put_back(self) -> None:
        """After a gradient return: the gradients :meth:`set_aside` kept added to the new sums (``earlier + new``, as
        one process's backward accumulates)."""
        aside, self._aside = self._aside, None
        for w, grad in aside or ():
            w.grad = grad if w.grad is None else grad + w.grad

    def global_loss(self, local: Tensor, info: BatchInfo, defer: bool = False) -> Tensor:
        """``GlobalLoss(local * w_r)``: the exact single-process loss on every rank; deferred, this rank's share
        ``local * w_r`` itself, whose global value :meth:`settle_loss` writes into the loss Lightning keeps once the
        gradient return has summed every rank's."""
        share = self.share(local, info)
        step = self.runner.step
        deferred = defer and self.reports_loss and step is not None and not step.whole
        self._share, self._reported = (share.detach(), None) if deferred else (None, None)
        if deferred:  # this rank's share: Lightning backs it, the gradient return sums the global loss
            return share
        return GlobalLoss.apply(share, self._group)  # type: ignore[no-any-return]  # over every rank

    def logged(self, output: Any, result: Any, backward: bool = False) -> None:
        """Log what the module's step logged (:attr:`logs`) with the global loss in place of the step's own loss:
        now, from ``result`` (the step's output made global), or once the gradient return settles it (a deferred
        loss).

        The loss tensor the step returned is then given the global loss too, in place (:func:`write_global`), so that
        a reference the module kept to it (``self.outs.append(loss)``, averaged at the epoch's end) reads what one
        process's does: at once, or with ``backward`` (a training step of automatic optimization, whose backward of
        ``result`` may still read it) after the backward (:meth:`after_backward`), or when a deferred loss settles."""
        local = step_loss(output)
        self._returned = None
        if local is None:
            self.logs.check_output(output, getattr(self.module, "_current_fx_name", None))
        if self._share is not None:
            self.logs.hold(local)
            self._returned = None if local is None else (local, None)  # the global loss is written when settled
            return
        total = step_loss(result)
        self.logs.replay(local, total)
        if backward:
            self._returned = None if local is None or total is None else (local, total.detach())
        else:  # no backward of ``result`` to come
            write_global(local, total)

    @property
    def deferred_share(self) -> Tensor | None:
        """This rank's share of the step's loss while the gradient return has yet to make it global (a training step
        on groups), else ``None``."""
        return self._share

    def report(self, kept: Tensor) -> None:
        """The loss Lightning keeps of the step (:func:`reporting_result`): the global loss is written into it."""
        if self._share is not None:
            self._reported = kept

    def settle_loss(self, shares: Tensor | None) -> None:
        """The deferred loss: every rank's share summed in rank order (``shares``, ``[P]`` float64 where the return
        ran; ``None``: nothing carried them, one all-reduce instead) and written into the loss Lightning keeps, on
        the device (nothing read on the host)."""
        share, reported, self._share, self._reported = self._share, self._reported, None, None
        if share is None:
            return
        if shares is None:
            total = all_reduce_sum(share, self._group)
        else:
            every = shares.to(share.dtype)  # [P] in the loss's dtype, as an all-reduce of it would add
            total = every[0]
            for i in range(1, every.shape[0]):  # in rank order on every rank
                total = total + every[i]
        if reported is not None:  # queued onto the loss's device (a blocking copy would wait for the GPU)
            reported.copy_(to_device(total.reshape(reported.shape), reported.device))
        self.logs.replay(None, total)  # what the step logged, its loss as the global one
        returned, self._returned = self._returned, None
        if returned is not None:
            write_global(returned[0], total)

    # ------------------------------------------------------------------ 4. after the backward

    def after_backward(self, accumulating: bool) -> None:
        """The gradients summed where they belong (:meth:`~.groups.runner.GroupRunner.finish`), unless micro-batches
        are left to accumulate; a deferred loss settled (its shares ride on the same return). A timed step
        (:meth:`begin`) measures its priced part and group times there; an untimed one adds nothing to the fixed
        part's estimate."""
        step = self.runner.step
        self._groups_returned = step is not None and not step.whole and not accumulating
        self.settle_loss(self.runner.finish(accumulating, self._share, self.timed))
        returned, self._returned = self._returned, None
        if returned is not None:  # the backward of the step's loss ran: the tensor it returned may be written
            write_global(*returned)
        if not self.timed:
            self.fixed.exclude()
        self.fixed.leave()

    def stepped(self) -> None:
        """The optimizer stepped (the strategy's ``optimizer_step``): the end of a training step."""
        self.fixed.stepped()

    def after_step(self, output: Any, accumulating: bool) -> None:
        """A grouped step whose module returned no loss (no backward hands its shards back) ends here."""
        step = self.runner.step
        if step is not None and not step.whole and step_loss(output) is None:
            self.runner.finish(accumulating, timed=self.timed)
            if not accumulating:
                self.put_back()

    def teardown(self) -> None:
        """Drop every reference to the process groups and the batch (the strategy destroys the world group next)."""
        self.pending, self.taken, self._host_batch, self._group = None, None, None, None
        self._share, self._reported, self._returned, self._aside = None, None, None, None
        self.logs.reset()
        self.fixed.reset()
        self.sigterm.restore()
        self.runner.teardown()


def _scaled_plus_fixed(model_metrics: dict[str, float], scale: float, fixed: float) -> dict[str, float]:
    """The cost model's numbers of a whole step with its time corrected by the measured ``scale`` of its priced
    part and the step's measured fixed part added."""
    if "plan/predicted_time_s" not in model_metrics:
        return model_metrics
    return {**model_metrics, "plan/predicted_time_s": model_metrics["plan/predicted_time_s"] * scale + fixed}


def write_global(local: Tensor | None, total: Tensor | None) -> None:
    """Write the global loss ``total`` into ``local``, the one-number loss tensor the module's step returned, in
    place (queued on its device; nothing read on the host): a reference the module kept to it then reads the value one
    process's loss has. Left as it is where torch refuses to write into it (a view of a leaf that requires grad)."""
    if local is None or total is None or local.numel() != 1 or not local.is_floating_point():
        return
    with torch.no_grad(), contextlib.suppress(RuntimeError):
        local.copy_(to_device(total.detach().reshape(local.shape), local.device))


def step_loss(output: Any) -> torch.Tensor | None:
    """The loss of a step's output (a tensor, or a mapping with ``loss``)."""
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else None
    return loss if isinstance(loss, torch.Tensor) else None


def _tensor_versions(batch: Any) -> list[tuple[int, int]] | None:
    """Every tensor of a batch as ``(id, version counter)``: a tensor replaced or changed in place differs. ``None``
    where a tensor is an inference tensor (it has no version counter)."""
    tensors: list[Tensor] = []
    apply_to_collection(batch, Tensor, tensors.append)
    if any(t.is_inference() for t in tensors):
        return None
    return [(id(t), t._version) for t in tensors]


__all__ = ["GlobalLoss", "StepCycle", "reporting_result", "step_loss"]
