"""ParaDySeStrategy: a Lightning strategy that runs every batch in the parallel mode its length calls for.

All processes form one sequence-parallel group (gloo on CPU, NCCL on CUDA) and see the *same* global
batch. The strategy runs Lightning's lifecycle (processes, devices, setup, the step hooks, checkpoints,
teardown); each hook delegates to a collaborator in a few lines:

* :class:`~lightning_paradyse.lightning.options.StrategyOptions`: every option, checked in ``__init__``;
* :class:`~lightning_paradyse.lightning.cycle.StepCycle`: every batch's state and its one path (describe and validate
  the batch, split the ranks into groups or keep one group of all of them, plan, agree on one digest, enter; this
  rank's tokens for the module's step; the global loss; the gradients after backward), and the
  :class:`~lightning_paradyse.lightning.records.StepRecord` the
  :class:`~lightning_paradyse.lightning.callbacks.ParaDySeSwitcher`
  callback (added when absent) logs;
* :class:`~lightning_paradyse.lightning.step_check.StepCheck`: the check that the module's step does not
  compute across the tokens of its slice;
* :mod:`~lightning_paradyse.lightning.launch`: how the processes start;
* :mod:`~lightning_paradyse.lightning.refusals`: what it refuses outside a step (callbacks it cannot run, an
  ``all_gather`` of tensors whose shapes differ, a gradient changed in a way PyTorch refuses on its gradients), and
  :mod:`~lightning_paradyse.lightning.finetuning`: Lightning's finetuning callbacks through checkpoints;
* the planner of the run (made at setup: fixed, thresholds, the cost model's, or the grid's).

Every rank's slice of a batch is cut with :meth:`SeqLayout.shard` (lengths need not be padded to a multiple of
the group size: the layout's chunks differ by at most one token), and the loss the LightningModule returns
becomes the *global* loss (``GlobalLoss(local * w_r)``, with ``w_r = n_r / N`` for a mean loss), so the loss is
the single-process loss and the gradients are exact.

Batch conventions (those of common language-model data; :mod:`lightning_paradyse.runtime.slicing`): the tokens
are the batch itself, the first tensor of a tuple/list, or a dict entry named in ``TOKEN_KEYS``; the
targets a dict entry named in ``TARGET_KEYS`` or the last tensor of a tuple/list of two or more (``-100``
marks no target).
``labels`` means the Hugging Face convention (the model shifts them). A Hugging Face model called with
``labels=`` (or ``shift_labels=``) a tensor of the batch is handed this rank's slice of the labels shifted over
the whole sequence and the global count (:func:`lightning_paradyse.runtime.parallel.set_step_sources`).

Checkpoints hold the *plain* model's state dict (it loads into the unparallelised model) and full,
consolidated optimizer state, so a run can resume with another plan, mode set or number of processes.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.init import _EmptyInit
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_paradyse.calibration.profile import is_profile_file, load_profile
from lightning_paradyse.distributed import comm
from lightning_paradyse.distributed.comm import Group, all_gather_rows, all_reduce_sum, group_size
from lightning_paradyse.distributed.devices import (
    broadcast_module,
    check_local_gpus,
    check_profile_device,
    expand_devices,
    resolve_backend,
)
from lightning_paradyse.distributed.rendezvous import call_store, needs_own_store
from lightning_paradyse.groups.exchange import measure_regroup
from lightning_paradyse.groups.solver import MAX_GROUPS, smallest_group
from lightning_paradyse.lightning import collection, finetuning, optimizer_settings
from lightning_paradyse.lightning.callbacks import ParaDySeSwitcher, logs_step
from lightning_paradyse.lightning.cycle import StepCycle, reporting_result
from lightning_paradyse.lightning.grad_norms import GradNormInterception
from lightning_paradyse.lightning.grad_scaler import agree_scaler
from lightning_paradyse.lightning.launch import SpawnLauncher, make_launcher, stop_workers
from lightning_paradyse.lightning.options import StrategyOptions
from lightning_paradyse.lightning.predict import Predictions
from lightning_paradyse.lightning.records import StepRecord
from lightning_paradyse.lightning.refusals import (
    backing_the_loss,
    check_gathered_shapes,
    explain_grad_view_error,
    overrides_backward,
    refuse_averaged_models,
    refuse_callbacks,
    refuse_encoder_decoders,
    refuse_neftune,
    refuse_pooling_heads,
)
from lightning_paradyse.lightning.step_check import StepCheck
from lightning_paradyse.lightning.summary import summarize_whole_model
from lightning_paradyse.modes.plan import Plan
from lightning_paradyse.planning.choose import choose_planner, fixed_plan
from lightning_paradyse.planning.fixed import Planner, PlanSpec
from lightning_paradyse.runtime import exactness, hf_checkpointing, parallel
from lightning_paradyse.runtime.checkpoint import (
    PlainModel,
    consolidate_optimizer_state,
    load_optimizer_state,
    recorded,
)
from lightning_paradyse.runtime.exactness import (
    ClipInterception,
    check_optimizers,
    kept_rng,
    set_host_rng_state,
)
from lightning_paradyse.runtime.hf_outputs import register_output_capture
from lightning_paradyse.runtime.slicing import BatchInfo


class ParaDySeStrategy(ParallelStrategy):
    """Sequence-parallel training that switches the parallel mode per batch, per layer and per op.

    Every process of the run belongs to one group that shares each sequence; all of them see the same
    batches (``num_replicas=1``). The LightningModule stays unmodified: it computes its usual loss on
    the local tokens it is given, and the strategy makes the returned loss the global one.

    Args:
        modes: The modes the planner may use (default: all four, ``tp_sp``, ``ulysses``, ``ring``, ``metp``).
        plan: ``"auto"`` (the planner chooses per batch), a single mode name, or a list with one entry per
            layer, each a mode name or a mapping such as ``{attention: ring, mlp: metp, recompute: true}``.
        thresholds: ``(short_max, middle_max)``: with ``plan="auto"`` and no ``profile``, use the simple
            length-threshold policy (:class:`~lightning_paradyse.planning.fixed.ThresholdPolicy`) instead of the
            planner (otherwise not used, with a warning naming the option that overrides them).
        memory_budget: Per-rank memory budget in bytes or as a string such as ``"4GiB"``, for the planner (default on
            CUDA: what the GPU leaves to this rank's tensors, less 5% for the allocator's fragmentation,
            :func:`~lightning_paradyse.distributed.devices.gpu_budget`; none on CPU).
        profile: Path of a cost profile (``python cli.py profile``) or a cluster file. With ``plan="auto"`` the
            exact planner picks, per batch, the fastest plan within ``memory_budget`` on its cost model: the
            profile's calibrated one, or without a profile one whose kernel rates, collectives and per-op
            overheads are measured during setup, once per machine and model shape (a few seconds; see
            :mod:`lightning_paradyse.calibration.quick`).
        compile: Wrap each rewritten block with ``torch.compile(dynamic=True)`` (eager by default).
        blocks: Dotted path of the block list inside the LightningModule (e.g. ``"model.layers"``);
            found automatically when ``None``.
        max_seq_len: Longest global sequence allowed; a longer batch raises before any collective.
        start_method: ``"spawn"`` (default, notebooks and tests), ``"fork"``, ``"forkserver"``, or ``"popen"``
            (re-run the script per process, as the command line does).
        timeout: Seconds before a collective of the process group times out.
        plan_bucket: The planner plans once per bucket of this many tokens (at the bucket's longest length) and
            caches the plan.
        on_infeasible: ``"error"`` (default) when no plan fits the memory budget, or ``"skip"`` the batch with a
            warning (counted in ``skipped_batches``).
        loss_reduction: ``"mean"`` if the module's loss is a mean over its local real tokens (rescaled by
            ``n_r / N``), ``"sum"`` if it is already a sum over them.
        groups: Train each training batch of several sequences (rows, padded on the right or not) or documents
            (a packed batch, ``doc_ids``) on groups of different power-of-two sizes at once
            (:mod:`lightning_paradyse.groups`):
            per step the ranks are split into groups (``P`` groups of one is data parallelism, one group of ``P``
            sequence parallelism) and the sequences assigned to them so that the slowest group is fastest on the
            cost model, attention counted per document; each group runs its own plan. ``None`` (default): on with
            ``plan="auto"``, off with a fixed plan. A single packed document, validation and test use one group of
            every rank; a batch of fewer rows than groups may leave groups idle (they run a placeholder weighed by
            0).
        elementwise_optimizers: Class names of optimizers the user vouches update every entry from that entry's
            gradient and state alone (as AdamW does), beyond PyTorch's own element-wise ones; others are refused
            (:func:`~lightning_paradyse.runtime.exactness.check_optimizers`).
        check_replicas_every: Compare the replicated parameters across ranks after the first three optimizer steps,
            then every this many steps and at every checkpoint (0: never); a difference raises, naming the likely
            cause (:func:`~lightning_paradyse.runtime.exactness.check_replicas`).
        check_step: On the first training batch (and the 10th, 100th, ...), compare the module's step on ``8p + 1``
            of its tokens (its start, its end and between: :func:`~lightning_paradyse.lightning.step_check.
            probe_columns`) sharded over the
            ranks with the same step on those tokens whole, and stop if they differ: the step computes across the
            tokens of its slice (e.g. shifts targets itself); a loss ignoring another index than -100, or class weights
            under a mean, are refused there too. Where steps may run on groups of rows (``plan="auto"``), the whole
            step also runs on two halves of the rows, apart: a loss divided by the batch's rows is refused. Costs two
            forward passes on those tokens (four with groups), on the first batch (once more on the first batch with
            a position without a target, after a batch without one), and again at the 10th, 100th, 1,000th, ...
            training batch (a step that changes later), with every weight gathered on every rank each time.
        process_group_backend: ``"nccl"`` or ``"gloo"``; default NCCL on GPUs each held by one rank, gloo on the host
            and where ranks share a GPU. NCCL with two ranks on one GPU is refused (it refuses them itself).
        grad_reduce_dtype: ``"float32"`` (default): weight gradients in bf16 (``precision="bf16-true"``) are summed over
            ranks (and over groups) in float32 and rounded once after the sum: each rank's part is still rounded by
            its own GEMM, where one process rounds the whole sum once; ``"param"``: summed in their own dtype (half
            the traffic of those reductions, one more rounding per partial sum).
        ranks_per_device: Ranks started per device (default 1). Above 1, ranks share each GPU over gloo: every mode,
            mixed plans and groups run on CUDA at p = 2, 4 on one GPU, for tests and checks (not for speed).
        axes: Sequence axes of the hidden states between blocks: 1 for language models (``[b, s, h]``), 2 for
            models over a grid of frames x patches (``[b, T, S, h]``, blocks attending along one axis each, such
            as :class:`~lightning_paradyse.models.spatial_temporal.SpatialTemporalTransformer`). With 2, batches
            ``[b, T, S]`` are split along the frames, the ``dsp`` mode (dimension switching) is added to ``modes``, and
            ``plan="auto"`` picks per block between switching and the sequence modes
            (:class:`~lightning_paradyse.planning.grid.GridPlanner`).

    Raises:
        ValueError: For a bad option, naming the option, the value and the fix.

    Notes:
        * Every rank of the group sees the same global batch: Lightning's distributed-sampler injection is
          turned off and the data's own order is used (seed it alike on every rank, e.g. ``seed_everything``);
          :meth:`begin_batch` checks every batch that all ranks hold the same one.
        * The process group is destroyed when the Trainer finishes: save checkpoints while it runs
          (``ModelCheckpoint``, or ``trainer.save_checkpoint`` in a hook).
        * Norm clipping (``gradient_clip_algorithm="norm"``, or ``torch.nn.utils.clip_grad_norm_`` in a hook) uses the
          whole model's gradient norm; optimizers that read whole tensors (Adafactor, Muon, LAMB) are refused.
        * ``trainer.predict`` runs every batch whole on every rank (:mod:`~lightning_paradyse.lightning.predict`).

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=ParaDySeStrategy(plan="auto"))
    """

    strategy_name = "paradyse"

    def __init__(
        self,
        modes: Sequence[str] | None = None,
        plan: str | list[str | dict[str, Any]] = "auto",
        thresholds: tuple[int, int] | None = None,
        memory_budget: int | str | None = None,
        profile: str | None = None,
        compile: bool = False,
        blocks: str | None = None,
        max_seq_len: int | None = None,
        start_method: Literal["spawn", "fork", "forkserver", "popen"] = "spawn",
        timeout: float = 1800.0,
        loss_reduction: Literal["mean", "sum"] = "mean",
        on_infeasible: Literal["error", "skip"] = "error",
        plan_bucket: int = 512,
        groups: bool | None = None,
        axes: int = 1,
        elementwise_optimizers: Sequence[str] = (),
        check_replicas_every: int = 50,
        check_step: bool = True,
        process_group_backend: Literal["nccl", "gloo"] | None = None,
        ranks_per_device: int = 1,
        grad_reduce_dtype: Literal["float32", "param"] = "float32",
    ) -> None:
        self.options = StrategyOptions.of(
            modes=modes,
            plan=plan,
            thresholds=thresholds,
            memory_budget=memory_budget,
            profile=profile,
            compile=compile,
            blocks=blocks,
            max_seq_len=max_seq_len,
            start_method=start_method,
            timeout=timeout,
            loss_reduction=loss_reduction,
            on_infeasible=on_infeasible,
            plan_bucket=plan_bucket,
            groups=groups,
            axes=axes,
            elementwise_optimizers=elementwise_optimizers,
            check_replicas_every=check_replicas_every,
            check_step=check_step,
            process_group_backend=process_group_backend,
            ranks_per_device=ranks_per_device,
            grad_reduce_dtype=grad_reduce_dtype,
        )
        """Every option, checked (:class:`~lightning_paradyse.lightning.options.StrategyOptions`)."""
        super().__init__()
        self.cycle = StepCycle(self.options, self.check_plan)
        """The per-batch cycle: every batch's state (:class:`~lightning_paradyse.lightning.cycle.StepCycle`)."""
        self._step_check = StepCheck(self.options.check_step)
        self._eval_checks = {s: StepCheck(self.options.check_step, training=False) for s in ("validate", "test")}
        """The check of the evaluation steps (their first batch): their loss and what they log."""
        self._predictions = Predictions()  # the whole weights while trainer.predict runs
        self.planner: Planner | None = None
        self.final_state_dict: dict[str, Tensor] | None = None
        """Rank 0's consolidated weights at the end of a spawned fit (handed back to the launching process)."""
        self.launched_from: dict[str, Any] | None = None
        """The launching process's host random streams and default dtype, carried into the workers the spawn
        launcher starts (:meth:`setup_environment` sets them)."""
        self.num_nodes = 1
        self._exchange_s: float | None = None
        """Measured seconds of the largest weight exchange, kept with the machine measured at setup (or ``None``)."""
        self._optimizer_steps = 0
        self._hooks_read_backed_loss = False
        """Whether the module or a callback overrides ``on_before_backward`` (set at each setup: :meth:`_shown`)."""
        self._sharded_ids: set[int] = set()
        self._clip: ClipInterception | None = None
        self._grad_norms: GradNormInterception | None = None
        self._result_cls: type[ClosureResult] | None = None
        self._frozen = False  # the objects alive after the setup's collection kept out of later ones (collection.py)
        self._failed = False  # the fit ends with an exception (whose traceback's frames may still hold the group)
        self._plain_model: PlainModel | None = None
        """What the plain model's checkpoints hold (parameter order, state dict keys, tied names), recorded once
        before the rewrite."""
        self._group: Group = None
        self._block_names: list[str] = []
        self._trainer: pl.Trainer | None = None

    # ------------------------------------------------------------------ options and what the cycle records

    @property
    def modes(self) -> tuple[str, ...]:
        return self.options.modes

    @property
    def plan_spec(self) -> PlanSpec:
        """The ``plan`` option (``"auto"``, a mode, or one entry per layer)."""
        return self.options.plan

    @property
    def memory_budget(self) -> int | None:
        return self.options.memory_budget

    @property
    def profile(self) -> str | None:
        return self.options.profile

    @property
    def compile(self) -> bool:
        return self.options.compile

    @property
    def start_method(self) -> str:
        return self.options.start_method

    @property
    def groups(self) -> bool:
        return self.options.groups

    @property
    def ranks_per_device(self) -> int:
        return self.options.ranks_per_device

    @ranks_per_device.setter
    def ranks_per_device(self, value: int) -> None:  # before the Trainer asks for the devices
        self.options = replace(self.options, ranks_per_device=value)

    @property
    def step_record(self) -> StepRecord | None:
        """What the last batch ran with (the callback logs it)."""
        return self.cycle.record

    @property
    def history(self) -> Any:
        """The plans executed (training, validation, test), in order: the last
        :data:`~lightning_paradyse.lightning.records.HISTORY_LIMIT`."""
        return self.cycle.history

    @property
    def plans_executed(self) -> int:
        """Plans executed so far (every batch that ran, whatever ``history`` still holds)."""
        return self.cycle.plans_executed

    @property
    def skipped_batches(self) -> int:
        """Batches skipped because no plan fit the memory budget (``on_infeasible="skip"``)."""
        return self.cycle.skipped_batches

    @property
    def group_times(self) -> tuple[float, ...]:
        """Measured seconds of every group's forward and backward in the last grouped step (``()``: one group, or a
        micro-batch that accumulates: the seconds travel with the returned gradients)."""
        return self.cycle.runner.times

    # ------------------------------------------------------------------ processes and devices

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property  # type: ignore[override]
    def parallel_devices(self) -> list[torch.device] | None:
        """The device of every local rank: each device Lightning gives, ``ranks_per_device`` times."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        # set once, with the devices Lightning chose (the host's ``devices`` times, or the GPUs)
        self._parallel_devices: list[torch.device] | None = (
            None if devices is None else expand_devices(devices, self.ranks_per_device)
        )

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def plain_model(self) -> PlainModel | None:
        """What the checkpoints know of the module before the rewrite (its parameters' order and names)."""
        return self._plain_model

    @property
    def group(self) -> Group:
        """The process group that shares each sequence (``None`` for a single process)."""
        return self._group

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to inject a sampler built from :attr:`distributed_sampler_kwargs`."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One replica: every rank of the group iterates over the same global batches."""
        return {"num_replicas": 1, "rank": 0}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints hold plain weights: they are loaded into the model after it is parallelised."""
        return True

    @property
    def block_names(self) -> list[str]:
        """Names of the rewritten blocks inside the LightningModule (after setup)."""
        return list(self._block_names)

    @override
    def _configure_launcher(self) -> None:
        self._launcher = make_launcher(self, self.options.start_method)  # :mod:`~lightning_paradyse.lightning.launch`

    def set_world_ranks(self) -> None:
        """Global rank and world size from the node rank and the local rank."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        """Select the device, then create the process group of the whole world (with a timeout).

        No rank is re-seeded as Lightning's DDP re-seeds each from ``seed_everything``'s seed: every rank draws on
        from the host streams of the process that called ``fit`` (a worker the spawn launcher started gets them
        from it, ``launched_from``, with its default dtype; a script or ``torchrun`` re-runs the same code), so
        ``configure_model``, a shuffling sampler and a loader's workers draw what one process draws, after whatever
        ``__init__`` drew. (A started worker's GPU stream is seeded with that process's seed, as
        ``torch.manual_seed`` or ``seed_everything`` seeds a GPU.)"""
        super().setup_environment()
        carried, self.launched_from = self.launched_from, None
        if carried is not None:  # a worker the spawn launcher started
            set_host_rng_state(carried["rng"])
            torch.set_default_dtype(carried["default_dtype"])  # e.g. float64: what the loader's workers draw
            if self.root_device.type == "cuda":
                torch.cuda.manual_seed_all(torch.initial_seed())  # the carried state's seed (restored with it)
        self.set_world_ranks()
        self._check_profile_device()  # on every rank, before the process group exists
        if self.world_size == 1:
            self._group = None
            return
        assert self.cluster_environment is not None and self.parallel_devices is not None
        backend = resolve_backend(
            self.parallel_devices, self.options.process_group_backend
        )  # on every rank, before any
        check_local_gpus(self.parallel_devices, backend)  # collective: NCCL refused where ranks would share a GPU
        timeout = timedelta(seconds=self.options.timeout)
        kwargs: dict[str, Any] = {"timeout": timeout}
        if backend == "nccl":
            kwargs["device_id"] = self.root_device
        env = self.cluster_environment
        if needs_own_store() and not dist.is_initialized():  # one store per process: a later call never meets
            # this call's store as rank 0 closes it (distributed/rendezvous.py)
            kwargs["store"] = call_store(env.main_address, env.main_port, self.global_rank, self.world_size, timeout)
        _init_dist_connection(env, backend, **kwargs)
        self._group = dist.group.WORLD

    def _check_profile_device(self) -> None:
        """A cost profile measured on another device type than this run's is refused."""
        if self.profile is None or not is_profile_file(self.profile):
            return

        measured_on = str(load_profile(self.profile).meta.get("device", "cpu"))  # profiles before GPUs: the host
        check_profile_device(measured_on, self.root_device, self.profile)

    # ------------------------------------------------------------------ model set-up

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Any:
        """Modules built in ``configure_model`` (or under ``trainer.init_module()``) are built on the host: setup
        moves only this rank's shards and the replicated parameters to the GPU."""
        with _EmptyInit(enabled=bool(empty_init)), torch.device("cpu"), self.precision_plugin.tensor_init_context():
            yield

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Every rank's loader workers seeded as one process's: with ``seed_everything(workers=True)`` Lightning
        seeds each worker from the rank too, so the ranks' workers would draw apart (random masking or augmentation
        in the loader) and hold different batches; rank 0's seeding, what one process does, on every rank instead."""
        if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(dataloader, "worker_init_fn", False) is None:
            dataloader.worker_init_fn = functools.partial(pl_worker_init_function, rank=0)  # type: ignore[attr-defined]
        return dataloader

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Parallelise the model once where it was built (the host, usually), then move what this rank holds to its
        device; add the switcher, then set up optimizers and precision."""
        assert self.accelerator is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if trainer.state.fn != TrainerFn.PREDICTING:  # every rank alike, before any broadcast (predictions run whole)
            refuse_pooling_heads(self._module)
            refuse_encoder_decoders(self._module)
        register_output_capture(self._module)  # a model unpickled in a spawned worker: its hidden states recorded
        if fitting:  # they act in a fit only
            refuse_callbacks(trainer.callbacks)  # type: ignore[attr-defined]
            refuse_neftune(self._module)
            if _parallelized_blocks(self._module) is None:  # one built on the rewritten model pairs shards alike
                refuse_averaged_models(self._module)
        self._trainer = trainer
        self.accelerator.setup(trainer)
        comm.GRAD_REDUCE_DTYPE = torch.float32 if self.options.grad_reduce_dtype == "float32" else None
        comm.HOST_SPIN_S = comm.host_spin_seconds(self.root_device, self.num_processes)  # reset at teardown
        self.precision_plugin.convert_module(self._module)
        _keep_user_samplers(trainer)  # before anything sets the loaders up (a configure_optimizers may)
        with kept_rng(self.root_device):  # what the set-up draws (probes, measurements) leaves the user's streams
            self._setup_parallel(fitting)
        if fitting:  # the weight gather of data-parallel training steps; agreed: the ranks' collectives must match
            comm.GATHER_AT_ONCE = comm.gather_at_once(self._group)
        _ensure_switcher(trainer)
        self._result_cls = _report_loss(trainer, self.cycle)
        self.cycle.reports_loss = self._result_cls is not None
        summarize_whole_model(trainer.callbacks)  # type: ignore[attr-defined]  # whole parameter counts, not shards
        if fitting:
            plain_model = recorded(self._plain_model)
            plain = optimizer_settings.viewed_settings(self._module, plain_model, self.root_device)  # one process's
            self.setup_optimizers(trainer)
            check_optimizers(self.optimizers, self.options.elementwise_optimizers)
            ids = optimizer_settings.plain_ids(self._module, plain_model)
            optimizer_settings.check_settings(self.optimizers, ids, plain)
            if group_size(self._group) > 1:  # rank 0's SIGTERM flag rides each training batch's agreement
                self.cycle.sigterm.install(trainer)
        self._hooks_read_backed_loss = any(
            is_overridden("on_before_backward", owner)
            for owner in [self.lightning_module, *getattr(trainer, "callbacks", [])]
        )
        self._sharded_ids = parallel.sharded_parameter_ids(self._module)
        self._clip = self._clip or ClipInterception(self._sharded, self._process_group, self._sharded_grads)
        self._clip.start()  # clip_grad_norm_ on shards: the whole model's norm (Lightning's clipping and the user's)
        self._grad_norms = self._grad_norms or GradNormInterception(
            self._root_module, self._plain_structure, self._process_group, self._sharded
        )
        self._grad_norms.start([self._module, *trainer.callbacks])  # type: ignore[attr-defined]  # Lightning's grad_norm
        self.setup_precision_plugin()
        if fitting:
            agree_scaler(self.precision_plugin, self._group)  # 16-mixed: every rank skips an overflowing step
            _optimizers_to_device(self.optimizers, self.root_device)
        # the setup's objects (rewritten graphs, plans made ahead) met by one full collection here, on every rank at
        # once: left to Python, it came in one rank's first steps (200 ms on a 2-core machine) while the others
        # waited for that rank in the step's next collective; the survivors then frozen: later collections, Python's
        # and the teardown's, scan only what the fit makes
        gc.collect()
        self._frozen = self._frozen or collection.freeze()

    def _setup_parallel(self, fitting: bool) -> None:
        """Parallelise the model (rank 0's weights broadcast bucket by bucket, then each rank keeps its shards), move
        what this rank holds to its device, make the planner and, with groups and for a fit (only training batches
        run on groups), the group runner (its exchange measured, batch shapes planned ahead)."""
        self._parallelize()
        self.model_to_device()  # only the shards and the replicated parameters reach the GPU
        parallel.forget_walks()  # a model fitted before may hold other parameters now
        self.planner = self._make_planner()
        self.cycle.bind(self._module, self._group, self.global_rank, self.planner, self._block_names)
        if not (fitting and self.groups and group_size(self._group) > 1):
            return
        try:
            exchange = self.cycle.runner.setup(self._module, self._group, self.planner, self._exchange_s)
        except ValueError as err:  # raised alike on every rank, before any collective
            if self.options.groups_asked:
                raise ValueError(f"ParaDySeStrategy(groups=True) cannot run this model: {err}") from None
            rank_zero_info(f"[paradyse] groups: off for this model ({err}); every batch runs on one group")
            exchange = None
        if exchange is not None:
            rank_zero_info(
                f"[paradyse] groups: exchanging the weights takes {exchange[0] * 1e3:.1f} ms (predicted "
                f"{exchange[1] * 1e3:.1f} ms); the group cost uses the measurement"
            )
        planned, seconds = self.cycle.runner.warmed
        if planned:
            rank_zero_info(f"[paradyse] groups: {planned} batch shapes planned ahead in {seconds:.2f} s")
        world = group_size(self._group)
        least = smallest_group(world)
        if least > 1:
            rest = f"; the {world % least} ranks left over in smaller groups" if world % least else ""
            rank_zero_info(
                f"[paradyse] groups: at most {MAX_GROUPS} groups of at least {least} ranks a step on {world} "
                f"ranks (data parallelism runs on groups of {least}){rest}"
            )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @property
    def _module(self) -> pl.LightningModule:
        if self.lightning_module is None:
            raise RuntimeError("ParaDySeStrategy has no LightningModule yet (call through a Trainer)")
        return self.lightning_module

    def _parallelize(self) -> None:
        """Broadcast rank 0's weights, rewrite the blocks, check a fixed plan (once per module)."""
        module = self._module
        names = _parallelized_blocks(module)
        plain_blocks = parallel.find_blocks(module, self.options.blocks) if names is None else []
        found = names if names is not None else [n for n, _ in plain_blocks]
        self.cycle.checkpointed = hf_checkpointing.checkpointed_layers(module, found)  # refusals before any collective
        if names is None:
            exactness.check_rotary(module)  # before any collective: the same model on every rank
            parallel.check_unshared_blocks(plain_blocks)
            if self.plan_spec != "auto":  # a plan of the wrong length fails before any collective
                fixed_plan(self.options, len(found))
            broadcast_module(module, self._group)
            plain = PlainModel.record(module)  # parameter order, state dict keys, tied names
            names = parallel.parallelize(module, self._group, blocks=self.options.blocks, axes=self.options.axes)
            parallel.step_state(module).plain = plain
            if self.compile:
                compile_blocks(module, names)
        # what the modes do not apply stays refused: chunked attention, and windows no rewritten layer carries
        windows = parallel.attention_windows(module)
        self.cycle.window = exactness.attention_window(module, windows_applied=any(w is not None for w in windows))
        self._plain_model = parallel.step_state(module).plain  # also of a module fitted before, or its deep copy
        self._block_names = list(names)
        if self.plan_spec != "auto":
            self.check_plan(fixed_plan(self.options, parallel.n_layers(module)))

    def _make_planner(self) -> Planner:
        """The run's planner (:func:`~lightning_paradyse.planning.choose.choose_planner`)."""
        assert self.parallel_devices is not None
        devices, module = self.parallel_devices, self._module
        chosen = choose_planner(
            module,
            self.options,
            self._group,
            self.root_device,
            devices,
            self.cycle.checkpointed,
            self.check_plan,
            lambda: measure_regroup(module, self._group),  # None where the whole weights would not fit a GPU
            autocast_dtype(self.precision_plugin, next(module.parameters()).dtype),
        )
        self._exchange_s = chosen.exchange_s
        return chosen.planner

    def check_plan(self, plan: Plan) -> None:
        """Raise a ``ValueError`` naming the layer and the reason if ``plan`` cannot run (no collective)."""
        outside = sorted({op.mode for layer in plan.layers for op in (layer.attention, layer.mlp)} - set(self.modes))
        if outside:
            raise ValueError(f"the plan uses mode(s) {outside} outside ParaDySeStrategy(modes={list(self.modes)})")
        try:
            parallel.check_plan(self._module, plan, group_size(self._group))
        except ValueError as err:
            raise ValueError(
                f"ParaDySeStrategy(plan={self.plan_spec!r}) cannot run on {group_size(self._group)} processes: {err}"
            ) from None

    # ------------------------------------------------------------------ per batch: the cycle does the work

    def inspect_batch(self, batch: Any) -> BatchInfo:
        """Validate a global batch and describe it; raises (identically on every rank) before any collective."""
        return self.cycle.inspect(batch)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch as Lightning does, keeping the loader's batch: the cycle describes the batch (checksum,
        target counts, padding) from it on the host, without reading the device."""
        moved = super().batch_to_device(batch, device, dataloader_idx)
        self.cycle.keep_host_batch(moved, batch if self._transfer_is_a_copy() else None)
        return moved

    def _transfer_is_a_copy(self) -> bool:
        """Whether the moved batch holds the loader's values (no ``transfer_batch_to_device`` or
        ``on_after_batch_transfer`` of the module or its datamodule changes them)."""
        module, trainer = self.lightning_module, self._trainer
        if module is None:
            return False
        owners: list[Any] = [module]
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        if datamodule is not None:
            owners.append(datamodule)
        hooks = ("transfer_batch_to_device", "on_after_batch_transfer")
        return not any(is_overridden(hook, owner) for owner in owners for hook in hooks)

    def begin_batch(self, batch: Any, stage: str) -> StepRecord:
        """The one call per batch (:meth:`~lightning_paradyse.lightning.cycle.StepCycle.begin`): validate, plan, agree,
        enter; returns (and keeps in :attr:`step_record`) what the callback logs."""
        check = functools.partial(self._step_check.wants, batch=self._batch_index())  # a checked batch: one group
        return self.cycle.begin(batch, stage, check_wanted=check, logged=stage == "train" and self._logged())

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        if self._clip is not None:
            self._clip.stop()
        if self._grad_norms is not None:
            self._grad_norms.stop()
        launcher = self._launcher
        procs = launcher.procs if isinstance(launcher, _SubprocessScriptLauncher) else None
        if procs:  # the script launcher's rank 0: no worker it started may outlive the failed run
            killed = stop_workers(procs)
            if killed:
                rank_zero_warn(
                    f"rank 0 failed ({type(exception).__name__}); stopped {len(killed)} other rank(s) still running "
                    f"5 s later (processes {killed})"
                )
        super().on_exception(exception)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Plan the training batch (after the callbacks' and the module's hooks, before its step)."""
        self.begin_batch(batch, "train")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The module's step on this rank's tokens, with the global loss."""
        cycle, module = self.cycle, self._module
        index = self._batch_index()
        if self._step_check.due(cycle, module, self.world_size, self.options.axes, index):
            assert self._trainer is not None
            self._step_check.run(
                cycle, self._trainer, self._group, self.root_device, super().training_step, args, kwargs, index
            )
        info = cycle.take("training_step")
        if info.skip:
            return self._skipped_loss()
        args, kwargs = cycle.shard(info, args, kwargs)
        with self._call_streams(), cycle.logs.capture(module):  # the model's calls: dropout independent across ranks
            output = super().training_step(*args, **kwargs)
        cycle.after_step(output, self._accumulating())
        result = cycle.global_output(output, info, defer=self._steps_now())
        cycle.logged(output, result, backward=module.automatic_optimization)  # its loss as the global one
        if not module.automatic_optimization:  # its backwards ran in the step: it ends here
            parallel.unconfigure(module)
        return result

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The module's validation step on this rank's tokens, with the global loss."""
        return self._evaluation_step("validate", super().validation_step, args, kwargs)  # type: ignore[no-any-return]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The module's test step on this rank's tokens, with the global loss."""
        return self._evaluation_step("test", super().test_step, args, kwargs)  # type: ignore[no-any-return]

    def _evaluation_step(self, stage: str, step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.begin_batch(args[0] if args else kwargs.get("batch"), stage)
        check = self._eval_checks[stage]
        if check.due(self.cycle, self._module, self.world_size, self.options.axes):
            assert self._trainer is not None
            check.run(self.cycle, self._trainer, self._group, self.root_device, step, args, kwargs)
        info = self.cycle.take(f"{stage}_step")
        if info.skip:
            return None  # Lightning skips the optimizer step of a None loss
        args, kwargs = self.cycle.shard(info, args, kwargs)
        with self.cycle.logs.capture(self._module):
            output = step(*args, **kwargs)
        result = self.cycle.global_output(output, info)
        self.cycle.logged(output, result)  # what the step logged, its loss as the global one
        parallel.unconfigure(self._module)  # a call of the model after it (an epoch-end hook) raises, naming why
        return result

    @override
    def on_predict_start(self) -> None:
        """The whole weights on every rank for the predictions (:mod:`~lightning_paradyse.lightning.predict`)."""
        assert self._trainer is not None
        callbacks = self._trainer.callbacks  # type: ignore[attr-defined]
        self._predictions.start(self._module, self._group, self.root_device, self.world_size, callbacks)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's predict step on the whole batch, as one process runs it."""
        return self._predictions.step(self.cycle, super().predict_step, args, kwargs)

    @override
    def on_predict_end(self) -> None:
        """The whole weights dropped (no collective)."""
        self._predictions.end(self._module)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward; with manual optimization (the step's ``manual_backward``) of the loss weighed as
        this rank's part of the global loss (:meth:`~lightning_paradyse.lightning.cycle.StepCycle.manual_share`): the
        step computed it on this rank's tokens. Automatic optimization backs the global loss
        the step's output was made (:meth:`training_step`), and accumulates as DDP's ``no_sync`` does."""
        module = self.lightning_module
        if module is None or module.automatic_optimization:
            return self._backward(closure_loss, optimizer, *args, **kwargs)
        share = self.cycle.manual_share(closure_loss)  # the loss itself outside a step
        return self._backward(share, optimizer, *args, share=share is not closure_loss, **kwargs)

    def _backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, share: bool = False, **kwargs: Any
    ) -> Tensor:
        """Lightning's ``Strategy.backward`` with the gradients summed over the group between the backward and the
        ``on_after_backward`` hooks (:meth:`~lightning_paradyse.lightning.cycle.StepCycle.after_backward`), which then
        read and change the gradients one process holds, as under DDP, whose backward sums them (the hooks ran before
        the sum until 2026-11-30: a ``clip_grad_norm_`` there clipped this rank's partial gradients).

        With gradient accumulation (automatic optimization) the sum waits for the micro-batch that steps, as
        DDP's ``no_sync`` does; with manual optimization it follows every backward. Gradients summed already (an
        earlier step's no ``zero_grad`` cleared, an earlier ``manual_backward``'s) are kept apart from the sum and
        added back before the hooks (:meth:`~lightning_paradyse.lightning.cycle.StepCycle.set_aside`), which read the
        gradients one process holds then. ``on_before_backward`` is handed a tensor of the global loss's value where
        ``closure_loss`` is this rank's share of it (``share``: a manual optimization step's, or a step on groups',
        :meth:`_shown`)."""
        module = self.lightning_module
        assert module is not None
        accumulating = self._accumulating()
        shown = self._shown(closure_loss, share or self.cycle.deferred_share is not None)
        self.pre_backward(shown)
        closure_loss = self.precision_plugin.pre_backward(shown, module)  # the on_before_backward hooks
        self.cycle.set_aside()
        with backing_the_loss(closure_loss) if overrides_backward(module) else contextlib.nullcontext():
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        self.cycle.after_backward(accumulating)
        if not accumulating:
            self.cycle.put_back()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)  # the on_after_backward hooks
        self.post_backward(closure_loss)
        return closure_loss

    def _shown(self, loss: Tensor, share: bool) -> Tensor:
        """What ``on_before_backward`` (the module's and its callbacks') is handed for ``loss``: where ``loss`` is this
        rank's share of the global loss (``share``: a manual optimization step backs each rank's share of what it
        backs; a step on groups backs its share, whose global value the gradient return sums after the backward), a
        tensor of the global loss's value whose gradient is the share's, ``total + (loss - loss.detach())``: what
        the hooks read, log or keep (``loss.item()`` in a list, a spike counter) is one process's, and the backward
        is the share's. Until 2026-12-02 the hooks were handed the share (probe 20). The global loss is one
        all-reduce of the shares (in rank order), made only where a hook is overridden; otherwise ``loss``."""
        if not share or not self._hooks_read_backed_loss:
            return loss
        total = all_reduce_sum(loss.detach(), self._group)  # [] -> []: every rank's share, summed
        return total + (loss - loss.detach())  # the value total's, exactly; the gradient loss's

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """A step of automatic optimization ends here (:func:`~lightning_paradyse.runtime.parallel.unconfigure`): a
        call of the model after it raises, naming why, instead of running on this step's layout."""
        module = self.lightning_module
        if module is not None and module.automatic_optimization:
            parallel.unconfigure(module)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The optimizer step, skipped when the batch was skipped and no gradient is left to apply.

        With gradient accumulation the micro-batches before a skipped one still count: their gradients are
        applied as usual.
        """
        if self.cycle.skipping:
            loss = closure()  # the skipped training step (a zero loss) and its backward, as Lightning expects
            if all(p.grad is None for group in optimizer.param_groups for p in group["params"]):
                return loss
            return super().optimizer_step(optimizer, lambda: loss, model, **kwargs)  # earlier micro-batches' grads
        try:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        except RuntimeError as err:
            explain_grad_view_error(err)
            raise
        self.cycle.stepped()
        self._optimizer_steps += 1
        if exactness.replica_check_due(self._optimizer_steps, self.options.check_replicas_every):
            exactness.check_replicas(self._module, self._group, f"after optimizer step {self._optimizer_steps}")
            self.cycle.fixed.interrupt()  # the check is no part of the next step's fixed cost
        return output

    def _sharded(self) -> set[int]:
        return self._sharded_ids

    def _sharded_grads(self) -> set[int]:
        """Ids of the sharded parameters' current gradients (for ``get_total_norm`` on gradients)."""
        params = self.lightning_module.parameters() if self.lightning_module is not None else iter(())
        return {id(p.grad) for p in params if id(p) in self._sharded_ids and p.grad is not None}

    def _process_group(self) -> Group:
        return self._group

    def _root_module(self) -> nn.Module | None:
        return self.lightning_module

    def _plain_structure(self) -> PlainModel | None:
        return self._plain_model

    def _batch_index(self) -> int:
        """Lightning's count of the fit's training batches begun (the current one included; 0 outside a fit)."""
        trainer = self._trainer
        return 0 if trainer is None else int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)

    def _call_streams(self) -> Any:
        """The model's calls draw from this rank's stream in the step; the step's own code from the process's
        (:mod:`~lightning_paradyse.runtime.streams`)."""
        if self.world_size == 1 or self._trainer is None:
            return contextlib.nullcontext()
        streams = parallel.call_streams(self._module)
        return streams.step_of(torch.initial_seed(), self.global_rank, self._batch_index(), self.root_device)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` by the norm of the whole model's gradients (the shards' parts summed
        over the group, replicated parameters once): what one process computes. Returns the total norm."""
        params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
        return parallel.clip_grad_norm(params, float(max_norm), self._sharded_ids, self._group, norm_type)

    def _skipped_loss(self) -> dict[str, Any] | None:
        """The output of a skipped batch: ``{"loss": zero, "skipped": True}``, the zero depending on no parameter.

        Lightning refuses a ``None`` loss with more than one process, so automatic optimization gets a zero
        leaf: its backward leaves every gradient as it was (``None`` after the closure's ``zero_grad``) and
        :meth:`optimizer_step` then leaves the weights alone. ``skipped`` tells batch-end hooks not to log the
        zero as a loss. Manual optimization gets ``None``.
        """
        module = self.lightning_module
        if module is not None and module.automatic_optimization:
            return {"loss": torch.zeros((), device=self.root_device, requires_grad=True), "skipped": True}
        return None

    def _steps_now(self) -> bool:
        """This training step's loss goes through Lightning's automatic optimization, undivided, straight into the
        optimizer step (no micro-batch left): its global value can be settled on the gradient return."""
        trainer = self._trainer
        if trainer is None or not self._module.automatic_optimization or trainer.accumulate_grad_batches != 1:
            return False
        return not self._accumulating()

    def _logged(self) -> bool:
        """Whether the callback logs this training step (the global step it ends with a multiple of
        ``log_every_n_steps``; every step without a Trainer): such a step is measured, which on a GPU waits for the
        device twice (its kernels before the clock is read, every rank's seconds after the return)."""
        trainer = self._trainer
        if trainer is None:
            return True
        return logs_step(trainer, trainer.global_step + 1)  # the step this one ends with

    def _accumulating(self) -> bool:
        trainer = self._trainer
        if trainer is None or not self._module.automatic_optimization or trainer.state.fn != TrainerFn.FITTING:
            return False
        return bool(trainer.fit_loop.epoch_loop._should_accumulate())

    # ------------------------------------------------------------------ collectives

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Every rank's ``tensor`` stacked, ``[world, ...]`` (unchanged when there is no process group)."""
        if sync_grads or not _distributed_is_initialized():
            return super().all_gather(tensor, group, sync_grads)
        group = group if group is not None else dist.group.WORLD
        p = group_size(group)
        check_gathered_shapes(tensor, group, p)
        return all_gather_rows(tensor.detach().unsqueeze(0), [1] * p, group)  # [...] -> [p, ...]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """``tensor`` reduced over the ranks, into a copy: Lightning's DDP reduces in place, and the tensor may be (a
        view of) the step's loss, whose value the strategy reads after the step (``strategy.reduce(loss.detach())``
        would have made it the mean of the ranks' own losses)."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor.clone(), group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The plain model's state dict, every key in its order (consolidated on every rank; rank 0 writes it)."""
        module = self._module
        if _parallelized_blocks(module) is None:  # e.g. the spawn launcher's parent process: a plain module
            return module.state_dict()
        self._require_group("save a checkpoint")
        self.cycle.fixed.interrupt()  # the consolidation is no part of the next step's fixed cost
        if self.options.check_replicas_every:
            exactness.check_replicas(module, self._group, "at a checkpoint")
        state = parallel.consolidated(module, self._group, host=True)  # gathered through host memory, piece by piece
        plain: PlainModel | None = self._plain_model
        return state if plain is None else plain.state_dict(state)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a plain state dict (a single-process run's, or ours) into the shards."""
        parallel.load_consolidated(self._module, checkpoint["state_dict"], self._group, strict=strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The state the plain model's optimizer would save (full tensors, plain order), the same on every rank."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if _parallelized_blocks(self._module) is None:
            return optimizer.state_dict()
        self._require_group("save a checkpoint")
        self.cycle.fixed.interrupt()  # the consolidation is no part of the next step's fixed cost
        plain = recorded(self._plain_model)
        return consolidate_optimizer_state(optimizer, self._module, plain, self._group, host=True)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write the checkpoint (rank 0), finetuning callbacks' param groups by plain names
        (:mod:`~lightning_paradyse.lightning.finetuning`)."""
        if _parallelized_blocks(self._module) is not None and self._plain_model is not None:
            checkpoint = finetuning.to_plain(checkpoint, self._module, self._plain_model)
        elif isinstance(self._launcher, SpawnLauncher) and self._launcher._already_fit:  # the launching process
            rank_zero_warn(
                f"[paradyse] trainer.save_checkpoint in the process that launched the workers (start_method="
                f"{self.options.start_method!r}) "
                "after a fit saves the fit's final weights, but no optimizer state and step counters at 0: the workers "
                "held those (as under Lightning's ddp_spawn), and resuming from this file restarts the optimizer. Save "
                "checkpoints during the fit (ModelCheckpoint, or trainer.save_checkpoint in on_train_end), or launch "
                "with start_method='popen'"
            )
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint, finetuning callbacks' param groups by the rewritten model's names."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if _parallelized_blocks(self._module) is not None and self._plain_model is not None:
            checkpoint = finetuning.to_parallel(checkpoint, self._module, self._plain_model)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load plain optimizer states (a single-process run's, or ours from any process count or plan), after the
        param groups a finetuning callback restored from the checkpoint
        (:func:`~lightning_paradyse.lightning.finetuning.restore_groups`)."""
        if self._trainer is not None:
            finetuning.restore_groups(self._trainer, self._module)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            plain = recorded(self._plain_model)
            load_optimizer_state(optimizer, self._module, plain, state, self._group)
            _optimizers_to_device([optimizer], self.root_device)

    def _require_group(self, action: str) -> None:
        if self._group is None and self.world_size > 1:
            raise RuntimeError(
                f"cannot {action} now: the process group was destroyed when the Trainer finished. Save checkpoints "
                f"while it runs (ModelCheckpoint, or trainer.save_checkpoint in a hook such as on_train_end)"
            )

    # ------------------------------------------------------------------ teardown

    @override
    def teardown(self) -> None:
        """Keep the final weights for the spawn launcher, then destroy the process group."""
        if self._clip is not None:
            self._clip.stop()  # first: torch's own clip_grad_norm_ back whatever happens next
        if self._grad_norms is not None:
            self._grad_norms.stop()  # and Lightning's grad_norm
        self.cycle.sigterm.restore()  # Lightning's SIGTERM broadcasts back whatever happens next
        if self.lightning_module is not None:
            self._predictions.end(self.lightning_module)  # predictions that raised keep no whole weights after them
        self._keep_final_state()
        if self._trainer is not None and self._result_cls is not None:
            _loop_of(self._trainer).output_result_cls = self._result_cls  # the fit loop's own result class again
        self.cycle.reports_loss, self._result_cls = False, None
        super().teardown()
        comm.GRAD_REDUCE_DTYPE = torch.float32  # the process-wide default again (set from the option at setup)
        comm.HOST_SPIN_S, comm.GATHER_AT_ONCE = 0.0, False
        self._destroy_group()

    def _destroy_group(self) -> None:
        """Destroy the process group *now*: gone, its threads joined, before this process can exit.

        ``dist.destroy_process_group`` only unregisters a group; a gloo group stays alive, with its worker threads,
        while anything refers to it (the batch contexts configured on the blocks do) and is freed only while the
        interpreter finalizes. A worker that has not yet dropped the last collective's work (the final weights'
        all-gather, whose tensors are Python objects) must take the GIL to free it; Python then ends that thread
        inside C++ that cannot unwind and the process aborts after a finished fit ("terminate called without an
        active exception", SIGABRT). So our references go first, then the registry's: the last one dropped, gloo
        joins its workers here (the GIL released), while Python still runs.
        """
        module = self.lightning_module
        if module is not None and parallel.is_parallelized(module):
            parallel.unconfigure(module)
        world = None if self._group is None else weakref.ref(self._group)
        self._group = None
        self.cycle.teardown()  # the groups' process groups
        gc.collect()  # e.g. a step's autograd graph (its nodes keep the group) left in a reference cycle
        collection.thaw(self._frozen)  # after it: that collection scanned only what the fit made
        self._frozen = False
        if _distributed_is_initialized():
            dist.destroy_process_group()
        failed, self._failed = self._failed, False
        if world is not None and world() is not None and not failed:  # else the exception's frames hold it: no news
            rank_zero_warn(
                "[paradyse] the process group is still referenced after teardown (kept by your code?): its gloo "
                "threads live until the interpreter exits, which can then abort (terminate called without an "
                "active exception)"
            )

    def _keep_final_state(self) -> None:
        trainer = self._trainer
        if not isinstance(self._launcher, SpawnLauncher) or trainer is None or not self._block_names:
            return
        if trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING:
            state = parallel.consolidated(self._module, self._group, host=True)
            self.final_state_dict = {k: v.detach().cpu().clone() for k, v in state.items()}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Per-batch, per-layer parallel-mode switching (ParaDySe)"
        )


# ---------------------------------------------------------------------- helpers


def autocast_dtype(precision: Precision, params: torch.dtype = torch.float32) -> torch.dtype | None:
    """The dtype autocast computes in under ``precision`` (``"bf16-mixed"``: bfloat16, ``"16-mixed"``: float16) for
    parameters of dtype ``params``, ``None`` without autocast or where it leaves them alone (float64): what the
    planner prices the modes' matmuls and activations in."""
    if not isinstance(precision, MixedPrecision) or params == torch.float64:
        return None
    return torch.bfloat16 if precision.precision == "bf16-mixed" else torch.float16


def compile_blocks(module: torch.nn.Module, names: Sequence[str]) -> None:
    """``torch.compile(dynamic=True)`` each rewritten block in place (parameter names are unchanged)."""
    for name in names:
        module.get_submodule(name).compile(dynamic=True)


def _parallelized_blocks(module: torch.nn.Module) -> list[str] | None:
    """The rewritten block names of an already parallelised module, else ``None``."""
    try:
        return parallel.step_state(module).blocks
    except RuntimeError:
        return None


def _loop_of(trainer: pl.Trainer) -> Any:
    """The fit loop's automatic optimization (``None`` where Lightning has none by that name)."""
    return getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "automatic_optimization", None)


def _report_loss(trainer: pl.Trainer, cycle: StepCycle) -> type[ClosureResult] | None:
    """Make the class of Lightning's training-step results (automatic optimization) hand ``cycle`` the loss it keeps
    (:func:`~lightning_paradyse.lightning.cycle.reporting_result`); returns the class it replaced, or ``None`` (nothing
    changed) when the fit loop has no such class: each step's loss is then all-reduced as it is made."""
    loop = _loop_of(trainer)
    current = getattr(loop, "output_result_cls", None)
    if not (isinstance(current, type) and issubclass(current, ClosureResult)):
        return None
    loop.output_result_cls = reporting_result(cycle, current)
    return current


def _ensure_switcher(trainer: pl.Trainer) -> None:
    """Put a :class:`ParaDySeSwitcher` first among the callbacks unless the user added one."""

    callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if not any(isinstance(cb, ParaDySeSwitcher) for cb in callbacks):
        callbacks.insert(0, ParaDySeSwitcher())


def _keep_user_samplers(trainer: pl.Trainer) -> None:
    """Every rank of the group must see the same global batch: never inject a distributed sampler.

    Lightning would replace the loaders' samplers (one replica: a reshuffled order, and an error for custom
    batch samplers such as the token-budget sampler); the data's own order, seeded alike on every rank, is
    kept instead, and :meth:`ParaDySeStrategy.begin_batch` checks that every rank holds the same batch.
    """
    trainer._accelerator_connector.use_distributed_sampler = False
