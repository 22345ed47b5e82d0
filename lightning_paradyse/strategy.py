"""ParaDySeStrategy: a Lightning strategy that runs every batch in the parallel mode its length calls for.

All processes form one sequence-parallel group (gloo on CPU, NCCL on CUDA) and see the *same* global
batch. For every batch the strategy

1. in one call, :meth:`ParaDySeStrategy.begin_batch` (from its ``on_train_batch_start`` hook and its evaluation
   steps), validates the batch, asks the planner for a plan, checks that every rank holds the same plan and
   batch, and configures the rewritten blocks with the batch's layout and plan; it leaves a
   :class:`~lightning_paradyse.step.StepRecord` that the :class:`~lightning_paradyse.callbacks.ParaDySeSwitcher`
   callback (added when absent) logs;
2. slices every tensor of the batch whose first two dims are ``[b, s]`` of the token tensor along the
   sequence with :meth:`SeqLayout.shard` — lengths need not be padded to a multiple of the group size:
   the layout's chunks differ by at most one token;
3. turns the loss the LightningModule returns into the *global* loss: ``GlobalLoss(local * w_r)``,
   an all-reduce (SUM) forward and an identity backward, with ``w_r = n_r / N`` (real target tokens on
   this rank over real target tokens in the batch) for a mean loss, so the loss is the single-process
   loss and the gradients are exact;
4. after backward, sums the gradients of replicated parameters over the group.

Batch conventions (those of common language-model data; :mod:`lightning_paradyse.slicing`): the tokens
are the batch itself, the first tensor of a tuple/list, or a dict entry named in ``TOKEN_KEYS``; the
targets a dict entry named in ``TARGET_KEYS`` or the last tensor of a tuple/list of two or more (``-100``
marks no target).
``labels`` means the Hugging Face convention (the model shifts them). A Hugging Face model called with
``labels=`` (or ``shift_labels=``) a tensor of the batch is handed this rank's slice of the labels shifted over
the whole sequence and the global count (:func:`lightning_paradyse.parallel.set_step_sources`).

Checkpoints hold the *plain* model's state dict (it loads into the unparallelised model) and full,
consolidated optimizer state, so a run can resume with another plan, mode set or number of processes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
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
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_paradyse import comm, guards, hf_checkpointing, parallel
from lightning_paradyse.checkpoint import PlainModel, consolidate_optimizer_state, load_optimizer_state, recorded
from lightning_paradyse.comm import Group, all_gather_rows, all_reduce_sum, collective_device, group_size
from lightning_paradyse.devices import (
    broadcast_module,
    check_local_gpus,
    check_profile_device,
    expand_devices,
    gpu_budget,
    gpu_free_bytes,
    resolve_backend,
)
from lightning_paradyse.groups.runner import GroupRunner, imbalance
from lightning_paradyse.groups.units import Units
from lightning_paradyse.guards import ClipInterception, check_optimizers, rank_rng
from lightning_paradyse.plan import Plan, parse_plan, uniform_plan
from lightning_paradyse.policy import (
    FixedPlanner,
    Planner,
    PlanSpec,
    ThresholdPolicy,
    parse_memory_budget,
    validate_modes,
    validate_plan_spec,
)
from lightning_paradyse.slicing import BatchInfo, describe_batch, find_tokens, on_device, shard_batch, to_host
from lightning_paradyse.spec import SeqContext
from lightning_paradyse.step import (
    HISTORY_LIMIT,
    PlanRecord,
    StepRecord,
    batch_digest,
    describe,
    plan_digest,
    plan_metrics,
)
from lightning_paradyse.summary import summarize_whole_model

START_METHODS = ("spawn", "fork", "forkserver", "popen")
_PLAIN_MODELS: weakref.WeakKeyDictionary[torch.nn.Module, PlainModel] = weakref.WeakKeyDictionary()
"""Parallelized LightningModules -> what their plain checkpoints hold (recorded once, before the rewrite)."""
UNLIMITED_BYTES = 2**62
"""The memory budget when none is given: the planner then picks the fastest plan."""


class GlobalLoss(torch.autograd.Function):
    """Forward: the sum of every rank's ``local`` (all-reduce); backward: the gradient, unchanged.

    Each rank returns ``w_r * local_r``; the sum is the global loss on every rank, and since each
    rank's contribution enters the sum with coefficient 1, the identity backward gives every rank the
    gradient of its own contribution, which the modes' collectives and the replicated-gradient
    all-reduce then combine into the exact gradient of the global loss.
    """

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Group) -> Tensor:
        return local.clone() if group_size(group) == 1 else all_reduce_sum(local, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _SpawnLauncher(_MultiProcessingLauncher):
    """The spawn launcher: the module made picklable first (Hugging Face gradient checkpointing); rank 0's
    *consolidated* weights handed back (the local shards would not load)."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        module = self._strategy.lightning_module
        if module is not None:  # spawn and forkserver pickle it into every worker
            hf_checkpointing.prepare_for_launch(module)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        strategy = self._strategy
        assert isinstance(strategy, ParaDySeStrategy)
        if strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING and strategy.final_state_dict is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(strategy.final_state_dict, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))


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
            length-threshold policy (:class:`~lightning_paradyse.policy.ThresholdPolicy`) instead of the planner.
        memory_budget: Per-rank memory budget in bytes or as a string such as ``"4GiB"``, for the planner
            (default: 90% of the GPU's memory on CUDA, none on CPU).
        profile: Path of a cost profile (``python cli.py profile``) or a cluster file. With ``plan="auto"`` the
            exact planner picks, per batch, the fastest plan within ``memory_budget`` on its cost model: the
            profile's calibrated one, or without a profile one whose kernel rates and collectives are measured
            during setup (a second or two; uncalibrated per-op overheads, see
            :mod:`lightning_paradyse.cost.quick`).
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
            ``plan="auto"``, off with a fixed plan. A single sequence, validation and test use one group of every
            rank.
        elementwise_optimizers: Class names of optimizers the user vouches update every entry from that entry's
            gradient and state alone (as AdamW does), beyond PyTorch's own element-wise ones; others are refused
            (:func:`~lightning_paradyse.guards.check_optimizers`).
        check_replicas_every: Compare the replicated parameters across ranks after the first three optimizer steps,
            then every this many steps and at every checkpoint (0: never); a difference raises, naming the likely
            cause (:func:`~lightning_paradyse.guards.check_replicas`).
        check_step: On the first training batch, compare the module's step on the first ``8p`` tokens sharded over
            the ranks with the same step on the whole prefix, and stop if they differ: the step computes across the
            tokens of its slice (e.g. shifts targets itself). Costs two forward passes on the prefix, once, with every
            weight gathered on every rank for the second.
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
            as :class:`~lightning_paradyse.models.st.SpatialTemporalTransformer`). With 2, batches ``[b, T, S]``
            are split along the frames, the ``dsp`` mode (dimension switching) is added to ``modes``, and
            ``plan="auto"`` picks per block between switching and the sequence modes
            (:class:`~lightning_paradyse.cost.grid.GridPlanner`).

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
        * Not yet supported: ``trainer.predict``.

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
        self.grad_reduce_dtype = _validate_choice("grad_reduce_dtype", grad_reduce_dtype, ("float32", "param"))
        self.ranks_per_device = int(_validate_positive("ranks_per_device", ranks_per_device) or 1)
        self.process_group_backend = process_group_backend
        if process_group_backend is not None:  # a bad name, or NCCL asked to share a GPU: refused here already
            resolve_backend([torch.device("cuda", 0)] * self.ranks_per_device, process_group_backend)
        super().__init__()
        if axes not in (1, 2):
            raise ValueError(f"axes={axes!r}: use 1 (language models, [b, s, h]) or 2 (a grid, [b, T, S, h])")
        if axes == 2 and groups:
            raise ValueError("groups=True works on language-model batches ([b, s]); use it with axes=1")
        self.axes = axes
        self.modes = validate_modes(modes)
        if axes == 2 and "dsp" not in self.modes:
            self.modes = (*self.modes, "dsp")
        self.plan_spec: PlanSpec = validate_plan_spec(plan, self.modes)
        self.thresholds = None if thresholds is None else _validate_thresholds(thresholds)
        self.memory_budget = parse_memory_budget(memory_budget)
        self.profile = _validate_profile(profile)
        self.on_infeasible = _validate_choice("on_infeasible", on_infeasible, ("error", "skip"))
        self.plan_bucket = int(_validate_positive("plan_bucket", plan_bucket) or 512)
        self.skipped_batches = 0
        """Batches skipped because no plan fit the memory budget (``on_infeasible="skip"``)."""
        self.compile = _validate_flag("compile", compile)
        self.blocks = _validate_blocks(blocks)
        self.max_seq_len = _validate_positive("max_seq_len", max_seq_len)
        self.start_method = _validate_choice("start_method", start_method, START_METHODS)
        self.timeout = _validate_timeout(timeout)
        self.loss_reduction = _validate_choice("loss_reduction", loss_reduction, ("mean", "sum"))
        self._groups_asked = groups is True
        if groups is None:
            groups = plan == "auto" and axes == 1
        self.groups = _validate_flag("groups", groups)
        self._runner = GroupRunner(self.plan_bucket, self.on_infeasible)
        """Steps on groups of different sizes (the collaborator that owns that feature's state)."""
        self.elementwise_optimizers = _validate_names("elementwise_optimizers", elementwise_optimizers)
        self.check_replicas_every = _validate_every("check_replicas_every", check_replicas_every)
        self.check_step = _validate_flag("check_step", check_step)
        self._step_checks_left = 8
        """Batches on which the one-time step check may still run (it waits for a batch whose first tokens have a
        real target)."""
        self._plan: Plan | None = None
        self._last_plan: Plan | None = None
        self._last_groups: Any = None
        self._exchange_s: float | None = None
        """Measured seconds of the largest weight exchange, kept with the machine measured at setup (or ``None``)."""
        self.step_record: StepRecord | None = None
        """What the last batch ran with (the callback logs it)."""
        self.history: deque[PlanRecord] = deque(maxlen=HISTORY_LIMIT)
        """The plans executed (training, validation, test), in order: the last :data:`~.step.HISTORY_LIMIT`."""
        self.plans_executed = 0
        """Plans executed so far (every batch that ran, whatever ``history`` still holds)."""
        self._optimizer_steps = 0
        self._sharded_ids: set[int] = set()
        self._window: tuple[int, str] | None = None
        self._checkpointed: tuple[int, ...] = ()
        """Layers the model's Hugging Face gradient checkpointing marks: the plan recomputes both of their ops
        (:mod:`~lightning_paradyse.hf_checkpointing`), read at setup and before every batch."""
        """The model's smallest sliding attention window (tokens, where), read before the rewrite."""
        self._clip: ClipInterception | None = None
        self._plain_model: PlainModel | None = None
        """What the plain model's checkpoints hold (parameter order, state dict keys, tied names), recorded once
        before the rewrite."""
        self.num_nodes = 1
        self.planner: Planner | None = None
        self.final_state_dict: dict[str, Tensor] | None = None
        self._group: Group = None
        self._block_names: list[str] = []
        self._pending: BatchInfo | None = None
        self._host_batch: tuple[Any, Any] | None = None
        """The last batch moved to the device and the loader's batch it was moved from."""
        self._trainer: pl.Trainer | None = None

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
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally or self.num_processes * self.num_nodes == 1:
            return
        if self.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _SpawnLauncher(self, start_method=self.start_method)  # type: ignore[arg-type]

    def set_world_ranks(self) -> None:
        """Global rank and world size from the node rank and the local rank."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        """Select the device, then create the process group of the whole world (with a timeout)."""
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._check_profile_device()  # on every rank, before the process group exists
        if self.world_size == 1:
            self._group = None
            return
        assert self.cluster_environment is not None and self.parallel_devices is not None
        backend = resolve_backend(self.parallel_devices, self.process_group_backend)  # on every rank, before any
        check_local_gpus(self.parallel_devices, backend)  # collective: NCCL refused where ranks would share a GPU
        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=self.timeout)}
        if backend == "nccl":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        self._group = dist.group.WORLD

    def _check_profile_device(self) -> None:
        """A cost profile measured on another device type than this run's is refused."""
        if self.profile is None or not _is_profile_file(self.profile):
            return
        from lightning_paradyse.cost.profile import load_profile

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
    def setup(self, trainer: pl.Trainer) -> None:
        """Parallelise the model once where it was built (the host, usually), then move what this rank holds to its
        device; add the switcher, then set up optimizers and precision."""
        assert self.accelerator is not None
        self._trainer = trainer
        self.accelerator.setup(trainer)
        comm.GRAD_REDUCE_DTYPE = torch.float32 if self.grad_reduce_dtype == "float32" else None
        self.precision_plugin.convert_module(self._module)
        self._parallelize()  # rank 0's weights broadcast bucket by bucket, then each rank keeps its shards
        self.model_to_device()  # only the shards and the replicated parameters reach the GPU
        self.planner = self._make_planner()
        if self.groups and group_size(self._group) > 1:
            try:
                exchange = self._runner.setup(self._module, self._group, self.planner, self._exchange_s)
            except ValueError as err:  # raised alike on every rank, before any collective
                if self._groups_asked:
                    raise ValueError(f"ParaDySeStrategy(groups=True) cannot run this model: {err}") from None
                rank_zero_info(f"[paradyse] groups: off for this model ({err}); every batch runs on one group")
                exchange = None
            if exchange is not None:
                rank_zero_info(
                    f"[paradyse] groups: exchanging the weights takes {exchange[0] * 1e3:.1f} ms (predicted "
                    f"{exchange[1] * 1e3:.1f} ms); the group cost uses the measurement"
                )
        _ensure_switcher(trainer)
        summarize_whole_model(trainer.callbacks)  # type: ignore[attr-defined]  # whole parameter counts, not shards
        _keep_user_samplers(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            check_optimizers(self.optimizers, self.elementwise_optimizers)
        self._sharded_ids = parallel.sharded_parameter_ids(self._module)
        self._clip = self._clip or ClipInterception(self._sharded, self._process_group, self._sharded_grads)
        self._clip.start()  # clip_grad_norm_ on shards: the whole model's norm (Lightning's clipping and the user's)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

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
        found = names if names is not None else [n for n, _ in parallel.find_blocks(module, self.blocks)]
        self._checkpointed = hf_checkpointing.checkpointed_layers(module, found)  # refusals before any collective
        if names is None:
            guards.check_rotary(module)  # before any collective: the same model on every rank
            if self.plan_spec != "auto":  # a plan of the wrong length fails before any collective
                self._fixed_plan(len(found))
            broadcast_module(module, self._group)
            _PLAIN_MODELS[module] = PlainModel.record(module)  # parameter order, state dict keys, tied names
            names = parallel.parallelize(module, self._group, blocks=self.blocks, axes=self.axes)
            if self.compile:
                compile_blocks(module, names)
        # what the modes do not apply stays refused: chunked attention, and windows no rewritten layer carries
        windows = parallel.attention_windows(module)
        self._window = guards.attention_window(module, windows_applied=any(w is not None for w in windows))
        self._plain_model = _PLAIN_MODELS.get(module)  # a module fitted before (e.g. then tested by a new Trainer)
        self._block_names = list(names)
        if self.plan_spec != "auto":
            self.check_plan(self._fixed_plan(parallel.n_layers(module)))

    def _fixed_plan(self, n_layers: int) -> Plan:
        assert self.plan_spec != "auto"
        try:
            return parse_plan(self.plan_spec, n_layers)  # type: ignore[arg-type]
        except ValueError as err:
            raise ValueError(f"ParaDySeStrategy(plan={self.plan_spec!r}): {err}") from None

    def _make_planner(self) -> Planner:
        n = parallel.n_layers(self._module)
        if self.plan_spec != "auto":
            return FixedPlanner(self._fixed_plan(n))
        if self.axes == 2:
            return self._grid_planner()
        if self.profile is None and self.thresholds is not None:
            return ThresholdPolicy(n, self.modes, self.thresholds, check=self.check_plan)
        from lightning_paradyse.cost.planner import make_planner

        source: Any = self.profile
        if source is None:  # measure this machine now (every rank, then agreed: the same model everywhere)
            from lightning_paradyse.cost.dims import dims_from_module
            from lightning_paradyse.cost.quick import cached_quick_machine

            dtype = next(self._module.parameters()).dtype
            dims = dims_from_module(self._module)
            p = group_size(self._group)
            extra = self._measure_exchange if self.groups and p > 1 else None
            source, extras, _ = cached_quick_machine(dims, p, self._group, self.root_device, dtype, extra)
            self._exchange_s = extras.get("exchange_s")
            rank_zero_info(f"[paradyse] cost model: {source.name}; run `python cli.py profile` for a calibrated one")
        return make_planner(  # type: ignore[no-any-return]
            self._module,
            group_size(self._group),
            self._budget_bytes(),
            source,
            self.modes,
            on_infeasible="skip" if self.on_infeasible == "skip" else "raise",
            bucket_tokens=self.plan_bucket,
            recompute=(True,) if len(self._checkpointed) == n else (False, True),  # every layer checkpointed by HF
            prefer_tp_sp=0.25 if self.profile is None else 0.0,  # the quick model leaves per-op overheads out
        )

    def _measure_exchange(self, machine: Any) -> dict[str, float]:
        """The measured seconds of the largest weight exchange (kept with the measured machine); nothing where the
        whole weights would not fit a GPU (the group cost then prices it)."""
        from lightning_paradyse.groups.exchange import measure_regroup

        seconds = measure_regroup(self._module, self._group)
        return {} if seconds is None else {"exchange_s": seconds}

    def _grid_planner(self) -> Planner:
        """Grid models: per block, dimension switching or a sequence mode, whichever moves fewer bytes."""
        from lightning_paradyse.cost.grid import GridPlanner
        from lightning_paradyse.graph.dispatch import AttentionDispatch

        p = group_size(self._group)
        ops = [op for _, op in parallel.dispatchers(self._module) if isinstance(op, AttentionDispatch)]
        axes = [int(op.attend_axis or 1) for op in ops]
        kv_ratio = ops[0].spec.n_kv_heads / ops[0].spec.n_heads
        feasible = [m for m in self.modes if all(op.infeasible(m, p) is None for op in ops)]
        planner = GridPlanner(axes, p, kv_ratio, feasible)
        self.check_plan(planner.plan(1, 1))
        if self.memory_budget is not None:
            rank_zero_warn(
                "[paradyse] axes=2: the grid planner minimises communication and has no memory model; "
                "memory_budget is not applied (give a fixed plan, e.g. with recompute, to save memory)"
            )
        return planner

    def _budget_bytes(self) -> int:
        """``memory_budget``; else on a GPU what it leaves to tensors (:func:`~.devices.gpu_budget`: the CUDA
        context, communicators and other processes, a fragmentation margin, a cluster file's ``reserve_gib``), the
        same on every rank (the least); else no limit."""
        if self.memory_budget is not None:
            return self.memory_budget
        if self.root_device.type != "cuda":
            return UNLIMITED_BYTES
        reserve = 0
        if self.profile is not None and not _is_profile_file(self.profile):
            from lightning_paradyse.cost.cluster import GiB, load_cluster

            reserve = int(load_cluster(self.profile).reserve_gib * GiB)
        assert self.parallel_devices is not None
        share = self.parallel_devices.count(self.root_device)  # ranks on this GPU
        mine = torch.tensor([float(gpu_budget(self.root_device, reserve, share))], device=self.root_device)
        if group_size(self._group) > 1:  # ranks sharing a GPU or GPUs of one node: the tightest counts everywhere
            every = all_gather_rows(mine.to(collective_device(self._group)), [1] * group_size(self._group), self._group)
            return int(every.min())
        return int(mine)

    def skip(self, info: BatchInfo, reason: str) -> None:
        """No plan fits this batch: its step is skipped on every rank (the planner decided alike everywhere)."""
        self.skipped_batches += 1
        rank_zero_warn(
            f"[paradyse] skipping a batch of length {info.seq_len} ({self.skipped_batches} so far): {reason}"
        )
        self._pending = replace(info, skip=True)

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

    # ------------------------------------------------------------------ per batch

    def inspect_batch(self, batch: Any) -> BatchInfo:
        """Validate a global batch and describe it; raises (identically on every rank) before any collective."""
        info = describe_batch(
            batch,
            group_size(self._group),
            self.global_rank,
            causal=parallel.is_causal(self._module),
            max_seq_len=self.max_seq_len,
            mean_loss=self.loss_reduction == "mean",
        )
        guards.check_window(info.seq_len, self._window)
        return info

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch as Lightning does, keeping the loader's batch: :meth:`begin_batch` describes the batch
        (checksum, target counts, padding) from it on the host, without reading the device."""
        moved = super().batch_to_device(batch, device, dataloader_idx)
        self._host_batch = (moved, batch) if self._transfer_is_a_copy() else None
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

    def _on_host(self, batch: Any) -> Any:
        """The batch on the host: the loader's batch it was moved from, else a copy (one wait on a GPU)."""
        kept, self._host_batch = self._host_batch, None
        if kept is not None and kept[0] is batch:
            return to_host(kept[1])  # the loader's tensors (on the host already: nothing is copied)
        return to_host(batch)

    def begin_batch(self, batch: Any, stage: str) -> StepRecord:
        """The one call per batch: validate it, plan it, verify that every rank holds the same plan and batch,
        configure the model; returns (and keeps in :attr:`step_record`) what the callback logs.

        The batch is described on the host (:meth:`_on_host`): no value of a GPU batch is read one by one.

        Raises (identically on every rank, before any collective of the step): for a bad batch, a plan that
        cannot run, or ranks that disagree.
        """
        self._checkpointed = hf_checkpointing.checkpointed_layers(self._module, self._block_names)
        host = self._on_host(batch)
        info = self.inspect_batch(host)  # the host batch's description (its tensors on the host)
        units = self._grouped_units(info, stage)
        if units is not None:
            record = self._begin_groups(batch, host, info, units, stage)
        else:
            self._runner.flush()  # shards kept from a grouped micro-batch give their gradients back first
            record = self._begin_plan(on_device(info, find_tokens(batch).device), stage)
        self.step_record = record
        return record

    @property
    def group_times(self) -> tuple[float, ...]:
        """Measured seconds of every group's forward and backward in the last grouped step (``()``: not grouped, or a
        micro-batch that accumulates: the seconds travel with the returned gradients)."""
        return self._runner.times

    def _grouped_units(self, info: BatchInfo, stage: str) -> Units | None:
        """The units (rows or documents) a training batch shares out among groups; ``None``: one group of every
        rank (a single sequence, evaluation, ``groups=False``, or the first batches while the one-time step check
        of :meth:`_check_step` is pending, which runs on the whole group)."""
        self._runner.times = ()
        if not self._runner.ready or stage != "train":
            return None
        module = self.lightning_module
        checking = self.check_step and self._step_checks_left > 0 and info.doc_ids is None
        if checking and module is not None and module.automatic_optimization:
            return None
        return Units.of(info)

    def _begin_groups(self, batch: Any, host: Any, info: BatchInfo, units: Units, stage: str) -> StepRecord:
        """A training batch on groups of different sizes: split, verify, enter; the record to log."""
        step = self._runner.decide(
            batch,
            host,
            info,
            units,
            self.global_rank,
            parallel.is_causal(self._module),
            self.loss_reduction == "mean",
            self.with_checkpointing,
        )
        if step is None:  # decided alike on every rank, which the digest checks
            self.verify_ranks(batch_digest(info.seq_len, info.batch, info.checksum))
            self.skip(info, "no split of the ranks into groups fits the memory budget")
            return StepRecord(stage, info.seq_len, info.batch, None)
        self.verify_ranks(step.digest(info.checksum))
        self._runner.enter(step)
        self._pending, self._plan = step.info, step.plan
        self.record_plan(PlanRecord(stage, step.info.seq_len, step.info.batch, step.plan))
        found = step.assignment
        metrics = plan_metrics(step.plan, self.modes, stage) | {
            "groups/count": float(len(found.sizes)),
            "groups/own_size": float(step.size),
            "groups/largest_size": float(found.sizes[0]),
            "groups/predicted_time_s": float(found.time),
            "groups/predicted_imbalance": imbalance(found.times),
            "groups/solve_s": step.solve_s,
        }
        line, key = None, (found.sizes, step.plans)
        if key != self._last_groups:
            sizes = "+".join(map(str, found.sizes))
            line = f"[paradyse] {stage} length {info.seq_len}: groups {sizes}, rank 0's plan {describe(step.plans[0])}"
            self._last_groups = key
        return StepRecord(stage, step.info.seq_len, step.info.batch, step.plan, metrics, line, found.sizes)

    def _begin_plan(self, info: BatchInfo, stage: str) -> StepRecord:
        from lightning_paradyse.cost.planner import PlanSkipped

        planner = self.planner
        assert planner is not None, "the strategy creates its planner in setup"
        try:
            planned = planner.plan(info.seq_len, info.batch)
        except PlanSkipped as skipped:  # decided alike on every rank, which the digest checks
            self.verify_ranks(batch_digest(info.seq_len, info.batch, info.checksum))
            self.skip(info, str(skipped))
            return StepRecord(stage, info.seq_len, info.batch, None)
        plan = self.with_checkpointing(planned)
        self.check_plan(plan)
        self.verify_ranks(plan_digest(plan, info.seq_len, info.batch, info.checksum))
        self.activate(info, plan)
        self.record_plan(PlanRecord(stage, info.seq_len, info.batch, plan))
        predicted = _predictions(planner, info.seq_len, info.batch) if plan == planned else {}  # of the plan run
        metrics = plan_metrics(plan, self.modes, stage) | predicted
        line = None
        if plan != self._last_plan:
            line, self._last_plan = f"[paradyse] {stage} length {info.seq_len}: plan {describe(plan)}", plan
        return StepRecord(stage, info.seq_len, info.batch, plan, metrics, line)

    def with_checkpointing(self, plan: Plan) -> Plan:
        """``plan`` with both ops of every layer the model's Hugging Face gradient checkpointing marks recomputed."""
        return hf_checkpointing.with_recompute(plan, self._checkpointed)

    def record_plan(self, record: PlanRecord) -> None:
        """Keep the plan a batch runs with (``history``, ``plans_executed``)."""
        self.history.append(record)
        self.plans_executed += 1

    def verify_ranks(self, digest: int) -> None:
        """Raise on every rank unless every rank holds the same ``digest`` (of plan and batch): one all-gather."""
        if self.world_size == 1:
            return
        mine = torch.tensor([digest], dtype=torch.int64, device=self.root_device)
        every = self.all_gather(mine).reshape(-1).tolist()
        if len(set(every)) != 1:
            raise RuntimeError(
                f"the ranks disagree on the plan or the batch (digest per rank: {every}); every rank must see the "
                f"same batches (same data and seed, no per-rank sampler) and the planner must be deterministic"
            )

    def activate(self, info: BatchInfo, plan: Plan) -> None:
        """Configure the blocks for the batch (layout, plan, HF labels); the next step consumes it."""
        module = self._module
        parallel.configure(module, SeqContext(info.layout, self._group, info.doc_ids), plan)
        self._pending, self._plan = info, plan

    def _take_pending(self, hook: str) -> BatchInfo:
        info, self._pending = self._pending, None
        if info is None:
            raise RuntimeError(
                f"ParaDySeStrategy.{hook}: the batch was not configured (ParaDySeStrategy.begin_batch runs before "
                f"every batch, from the strategy's on_train_batch_start and its evaluation steps)"
            )
        return info

    def _shard_step(
        self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[BatchInfo, tuple[Any, ...], dict[str, Any]]:
        info = self._take_pending(hook)
        if info.skip:
            return info, args, kwargs
        step = self._runner.step
        rank = self.global_rank if step is None else step.rank
        if args or "batch" in kwargs:
            given = args[0] if args else kwargs["batch"]
            local, sources = shard_batch(given if step is None else step.batch, info, rank)
            if step is not None:  # labels are shifted over the whole batch, not the group's units
                shifts = step.shifts
                sources = tuple(
                    replace(src, shifted=shifts[src.key][0], n_items=shifts[src.key][1]) if src.key in shifts else src
                    for src in sources
                )
            parallel.set_step_sources(self._module, sources, info.padding)
            if args:
                args = (local, *args[1:])
            else:
                kwargs = {**kwargs, "batch": local}
        return info, args, kwargs

    def _global(self, output: Any, info: BatchInfo) -> Any:
        """Replace the local loss of a step's output (a tensor or a dict with ``loss``) by the global loss."""
        if isinstance(output, Tensor):
            return self.global_loss(output, info)
        if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
            return {**output, "loss": self.global_loss(output["loss"], info)}
        return output

    def global_loss(self, local: Tensor, info: BatchInfo) -> Tensor:
        """``GlobalLoss(local * w_r)``: the exact single-process loss on every rank."""
        consumed = bool(parallel.step_state(self._module).labels_consumed)
        weight = 1.0 if consumed or self.loss_reduction == "sum" else info.n_local / info.n_global
        return GlobalLoss.apply(local * weight, self._group)  # type: ignore[no-any-return]  # over every rank

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._clip is not None:
            self._clip.stop()
        launcher = self._launcher
        procs = launcher.procs if isinstance(launcher, _SubprocessScriptLauncher) else None
        if procs:  # the script launcher's rank 0: no worker it started may outlive the failed run
            killed = guards.stop_workers(procs)
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
        if self._step_unchecked():
            self._check_step(args, kwargs)
        info, args, kwargs = self._shard_step("training_step", args, kwargs)
        if info.skip:
            return self._skipped_loss()
        with self._rank_rng():  # dropout masks independent across ranks
            output = super().training_step(*args, **kwargs)
        if self._runner.step is not None and guards.step_loss(output) is None:  # no backward hands shards back
            self._runner.finish(self._accumulating())
        return self._global(output, info)  # type: ignore[no-any-return]

    def _step_unchecked(self) -> bool:
        pending, module = self._pending, self.lightning_module
        if not self.check_step or self._step_checks_left <= 0 or self.world_size == 1 or pending is None:
            return False
        plain_batch = pending.doc_ids is None and self.axes == 1 and self._runner.step is None
        return plain_batch and not pending.skip and module is not None and module.automatic_optimization

    def _check_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Once, on the first batch: the module's step on the batch's first tokens, sharded over the ranks and
        whole on every rank (a group of one holding every weight), must give the same loss; otherwise the step
        computes across the tokens of its slice and the run stops on every rank (:func:`guards.check_step_losses`).
        The extra calls leave no trace (:func:`guards.side_effects_undone`)."""
        from lightning_paradyse.groups.exchange import drop_group, enter_group

        info, plan, module, trainer = self._pending, self._plan, self._module, self._trainer
        assert info is not None and plan is not None and trainer is not None
        self._step_checks_left -= 1
        batch = args[0] if args else kwargs.get("batch")
        p = group_size(self._group)
        prefix = guards.prefix_batch(batch, info.batch, info.seq_len, min(info.seq_len, 8 * p))
        causal, mean = parallel.is_causal(module), self.loss_reduction == "mean"
        rest = (args[1:], {k: v for k, v in kwargs.items() if k != "batch"})
        try:
            sharded_info = self.inspect_batch(prefix)
            whole_info = describe_batch(prefix, 1, 0, causal=causal, mean_loss=mean)
        except ValueError:  # e.g. no real target among the first tokens: try the next batch
            if self._step_checks_left == 0:
                rank_zero_warn("[paradyse] check_step: no batch had a real target among its first tokens; not checked")
            return
        if not self._whole_weights_fit():
            self._step_checks_left = 0
            return
        with torch.no_grad(), guards.side_effects_undone(trainer, module, self.root_device):
            self.activate(sharded_info, plan)
            _, a, k = self._shard_step("training_step", (prefix, *rest[0]), rest[1])
            local = guards.step_loss(super().training_step(*a, **k))
            sharded = None if local is None else float(self.global_loss(local, sharded_info))
            enter_group(module, self._group, [1] * p)  # every weight on every rank: the whole step, p times
            try:
                parallel.configure(module, SeqContext(whole_info.layout, None), uniform_plan("tp_sp", len(plan)))
                piece, sources = shard_batch(prefix, whole_info, 0)
                parallel.set_step_sources(module, sources, whole_info.padding)
                whole = guards.step_loss(super().training_step(piece, *rest[0], **rest[1]))
            finally:
                drop_group(module)
        self.activate(info, plan)
        self._step_checks_left = 0
        if sharded is not None and whole is not None:
            guards.check_step_losses(sharded, float(whole), guards.step_check_tolerance(whole.dtype, trainer.precision))

    def _whole_weights_fit(self) -> bool:
        """Whether every rank can hold every weight for the check (CUDA: twice the whole weights free on every
        rank, agreed by one all-reduce; CPU: yes). Warns and says no otherwise."""
        if self.root_device.type != "cuda":
            return True
        from lightning_paradyse.summary import whole_sizes

        module = self._module
        item = next(module.parameters()).element_size()
        need = 2 * item * sum(whole_sizes(module).values())
        free = torch.tensor([float(gpu_free_bytes(self.root_device) >= need)], device=collective_device(self._group))
        fits = float(all_reduce_sum(free, self._group)) == float(self.world_size)  # [1] summed over the group
        if not fits:
            rank_zero_warn("[paradyse] check_step: the whole weights do not fit on every rank; the step is not checked")
        return fits

    def _sharded(self) -> set[int]:
        return self._sharded_ids

    def _sharded_grads(self) -> set[int]:
        """Ids of the sharded parameters' current gradients (for ``get_total_norm`` on gradients)."""
        params = self.lightning_module.parameters() if self.lightning_module is not None else iter(())
        return {id(p.grad) for p in params if id(p) in self._sharded_ids and p.grad is not None}

    def _process_group(self) -> Group:
        return self._group

    def _rank_rng(self) -> Any:
        trainer = self._trainer
        if self.world_size == 1 or trainer is None:
            return contextlib.nullcontext()
        step = int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)
        return rank_rng(torch.initial_seed(), self.global_rank, step, self.root_device)

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

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The optimizer step, skipped when the batch was skipped and no gradient is left to apply.

        With gradient accumulation the micro-batches before a skipped one still count: their gradients are
        applied as usual.
        """
        pending = self._pending
        if pending is not None and pending.skip:
            loss = closure()  # the skipped training step (a zero loss) and its backward, as Lightning expects
            if all(p.grad is None for group in optimizer.param_groups for p in group["params"]):
                return loss
            return super().optimizer_step(optimizer, lambda: loss, model, **kwargs)  # earlier micro-batches' grads
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._optimizer_steps += 1
        if guards.replica_check_due(self._optimizer_steps, self.check_replicas_every):
            guards.check_replicas(self._module, self._group, f"after optimizer step {self._optimizer_steps}")
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The module's validation step on this rank's tokens, with the global loss."""
        self.begin_batch(args[0] if args else kwargs.get("batch"), "validate")
        info, args, kwargs = self._shard_step("validation_step", args, kwargs)
        if info.skip:
            return None  # type: ignore[return-value]  # Lightning skips the optimizer step of a None loss
        return self._global(super().validation_step(*args, **kwargs), info)  # type: ignore[no-any-return]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The module's test step on this rank's tokens, with the global loss."""
        self.begin_batch(args[0] if args else kwargs.get("batch"), "test")
        info, args, kwargs = self._shard_step("test_step", args, kwargs)
        if info.skip:
            return None  # type: ignore[return-value]  # Lightning skips the optimizer step of a None loss
        return self._global(super().test_step(*args, **kwargs), info)  # type: ignore[no-any-return]

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("ParaDySeStrategy does not support trainer.predict yet; use a single device")

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """Sum the replicated parameters' gradients over the group once the last micro-batch is done.

        With gradient accumulation (automatic optimization) the sum waits for the micro-batch that steps, as
        DDP's ``no_sync`` does; with manual optimization it follows every backward.
        """
        if self._runner.step is not None:
            self._runner.finish(self._accumulating())
        elif not self._accumulating():
            self._runner.flush()  # a skipped last micro-batch: the earlier ones' kept shards
            parallel.reduce_replicated_grads(self._module, self._group)

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
        return all_gather_rows(tensor.detach().unsqueeze(0), [1] * p, group)  # [...] -> [p, ...]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The plain model's state dict, every key in its order (consolidated on every rank; rank 0 writes it)."""
        module = self._module
        if _parallelized_blocks(module) is None:  # e.g. the spawn launcher's parent process: a plain module
            return module.state_dict()
        self._require_group("save a checkpoint")
        if self.check_replicas_every:
            guards.check_replicas(module, self._group, "at a checkpoint")
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
        plain = recorded(self._plain_model)
        return consolidate_optimizer_state(optimizer, self._module, plain, self._group, host=True)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load plain optimizer states (a single-process run's, or ours from any process count or plan)."""
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
        self._keep_final_state()
        super().teardown()
        self._pending = None
        comm.GRAD_REDUCE_DTYPE = torch.float32  # the process-wide default again (set from the option at setup)
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
            parallel.step_state(module).ctx = None
            for _, op in parallel.dispatchers(module):
                op.ctx = None
        world = None if self._group is None else weakref.ref(self._group)
        self._group = None
        self._runner.teardown()  # the groups' process groups
        gc.collect()  # e.g. a step's autograd graph (its nodes keep the group) left in a reference cycle
        if _distributed_is_initialized():
            dist.destroy_process_group()
        if world is not None and world() is not None:
            rank_zero_warn(
                "[paradyse] the process group is still referenced after teardown (kept by your code?): its gloo "
                "threads live until the interpreter exits, which can then abort (terminate called without an "
                "active exception)"
            )

    def _keep_final_state(self) -> None:
        trainer = self._trainer
        if not isinstance(self._launcher, _SpawnLauncher) or trainer is None or not self._block_names:
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


def _predictions(planner: Any, seq_len: int, batch: int) -> dict[str, float]:
    """The cost model's predicted step time and peak memory of the plan, when the planner has them."""
    step = getattr(planner, "step", None)
    if step is None:
        return {}
    planned = step(seq_len, batch)  # cached: the plan just chosen
    return {"plan/predicted_time_s": float(planned.time_s), "plan/predicted_peak_mib": planned.peak_bytes / 2**20}


def _ensure_switcher(trainer: pl.Trainer) -> None:
    """Put a :class:`ParaDySeSwitcher` first among the callbacks unless the user added one."""
    from lightning_paradyse.callbacks import ParaDySeSwitcher

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


def _is_profile_file(path: str) -> bool:
    """A cost profile (JSON with a calibration), not a cluster file."""
    return path.endswith(".json") and '"calibration"' in Path(path).read_text()


def _validate_choice(option: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"ParaDySeStrategy({option}={value!r}): choose one of {list(choices)}")
    return value


def _validate_every(option: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ParaDySeStrategy({option}={value!r}): expected a number of steps >= 0 (0: never)")
    return value


def _validate_names(option: str, value: Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"ParaDySeStrategy({option}={value!r}): expected a list of class names, e.g. ['Lion']")
    return tuple(value)


def _validate_flag(option: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"ParaDySeStrategy({option}={value!r}): expected true or false")
    return value


def _validate_positive(option: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"ParaDySeStrategy({option}={value!r}): expected a positive integer or None")
    return value


def _validate_timeout(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"ParaDySeStrategy(timeout={value!r}): expected a positive number of seconds")
    return float(value)


def _validate_thresholds(value: Sequence[int]) -> tuple[int, int]:
    ok = isinstance(value, Sequence) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)
    if not ok or value[0] > value[1]:
        raise ValueError(
            f"ParaDySeStrategy(thresholds={value!r}): expected two lengths (short_max, middle_max) "
            f"with 0 < short_max <= middle_max, e.g. (256, 1024)"
        )
    return int(value[0]), int(value[1])


def _validate_profile(value: str | None) -> str | None:
    if value is not None and not Path(value).is_file():
        raise ValueError(f"ParaDySeStrategy(profile={value!r}): no such file; give the path of a saved cost profile")
    return value


def _validate_blocks(value: str | None) -> str | None:
    if value is not None and (not isinstance(value, str) or not value or any(not p for p in value.split("."))):
        raise ValueError(f"ParaDySeStrategy(blocks={value!r}): expected a dotted path such as 'model.layers'")
    return value


if "paradyse" not in StrategyRegistry:
    ParaDySeStrategy.register_strategies(StrategyRegistry)
