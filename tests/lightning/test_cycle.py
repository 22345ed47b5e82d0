"""The fixed cost of a step: what a data-parallel step adds to DDP's, counted (never timed).

Two processes train the command line's LightningModule on batches of many short rows; the groups' solver is made
to split every step into groups of one (data parallelism, as the planner does for such batches). During one
training step, from the end of the validation before it to its last callback hook (the switcher's before it), a
dispatch mode counts every collective (the package's and Lightning's, its check for SIGTERM included). On a GPU
(ranks sharing it, marked ``gpu``) CUDA's synchronisation debug mode also counts the step's host synchronisations
(from its first callback hook). On the host a read of a tensor value is free and nothing tells the tensors a GPU
would hold apart: there the tensors a GPU run keeps on the GPU are followed instead
(:class:`~tests.support.device_values.DeviceValues`, Lightning's move of the batch made a copy as onto a GPU), and
the same synchronisations are counted on every machine, for the step and for the evaluation batch before it. A
second run counts a ``tp_sp`` step of both ranks on packed documents alike (:func:`packed`).
"""

from __future__ import annotations

import functools
import io
import os
import warnings
from collections import Counter
from types import MappingProxyType
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_paradyse import ParaDySeStrategy, ParaDySeSwitcher
from lightning_paradyse.distributed import comm
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.groups.solver import Assignment
from lightning_paradyse.lightning.cycle import step_loss
from lightning_paradyse.lightning.language_model import LanguageModel
from tests.support.copies import BlockingCopies, call_sites
from tests.support.device_values import DeviceValues
from tests.support.dist import free_ports
from tests.support.lightning import ACCELERATOR, quiet_trainer, strategy_environment

COUNTED_STEP = 3
"""The step counted: after the step check (step 0), the first exchange's caches, a data-parallel step
(step 2) and a validation batch. The logger logs the step after it (``log_every_n_steps``): there the strategy
measures the step's priced part and group times, which a GPU waits for (:data:`TIMED_STEP`)."""
TIMED_STEP = COUNTED_STEP + 1
"""A step the logger logs, followed alike (its synchronisations only)."""


HOST_BRANCHES = ("models/llama.py:resolve_positions",)
"""Code that reads values only when they are on the host (the positions' range, asserted on a GPU instead)."""


class Collectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            self.calls[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class Count(pl.Callback):
    def __init__(self) -> None:
        self.collectives: Counter[str] = Counter()
        self.copies: list[str] = []
        """Where each blocking copy onto a device was asked for (:class:`~tests.support.copies.BlockingCopies`)."""
        self._copies: BlockingCopies | None = None
        self.syncs = 0
        self.sync_sites: list[str] = []
        """Where each synchronisation was asked for: the package's frames that led to it."""
        self.device_syncs: list[str] = []
        """The host synchronisations a GPU run would make, followed on the host
        (:class:`~tests.support.device_values.DeviceValues`)."""
        self.eval_syncs: list[str] = []
        """The same for the evaluation batch before the counted step."""
        self.timed_syncs: list[str] = []
        """The same for the step after it, one the logger logs (:data:`TIMED_STEP`)."""
        self.backend = ""
        """The world's backend during the counted step (gloo where ranks share a GPU, NCCL on GPUs of their own)."""
        self.gather_at_once = False
        """Whether the counted step's weight gather was an all-to-all (gloo's host tensors, every rank on a core)."""
        self._values: DeviceValues | None = None
        self.validated: list[int] = []
        """The optimizer steps done when each validation batch ended."""
        self._mode: Collectives | None = None
        self._warnings: Any = None

    def _seen(self, message: Any, *args: Any, **kwargs: Any) -> None:
        """A warning during the counted step: a synchronisation's is recorded with the frames that led to it."""
        if "synchroniz" in str(message):
            self.sync_sites.append(call_sites())

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if i == COUNTED_STEP:
            if trainer.strategy.root_device.type == "cuda":
                torch.cuda.synchronize()
                self._warnings = warnings.catch_warnings()
                self._warnings.__enter__()
                warnings.simplefilter("always")
                warnings.showwarning = self._seen
                torch.cuda.set_sync_debug_mode("warn")
            self._copies = BlockingCopies().__enter__()
        if i in (COUNTED_STEP, TIMED_STEP):
            optimizer = trainer.optimizers[0]
            state = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]  # a host step count
            self._follow(pl_module, state, batch)

    def _follow(self, pl_module: pl.LightningModule, *device: Any) -> None:
        """Count what would synchronise a GPU from here: the module's tensors and ``device`` on the GPU, the loader's
        batch on the host."""
        self._values = DeviceValues(host_branches=HOST_BRANCHES)
        self._values.hold(list(pl_module.parameters()), list(pl_module.buffers()), device)
        self._values.host(LOADER_BATCH)
        self._values.__enter__()

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any
    ) -> None:
        if trainer.global_step == COUNTED_STEP:  # the evaluation batch before the counted step, followed alike
            self._follow(pl_module, batch)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.validated.append(trainer.global_step)
        if self._values is not None:
            self._values.__exit__(None, None, None)
            self.eval_syncs, self._values = self._values.sites, None

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == COUNTED_STEP and self._mode is None:  # Lightning's collectives before the step too
            self._mode = Collectives()
            self._mode.__enter__()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._values is not None:  # entered after the collectives' mode: left first
            self._values.__exit__(None, None, None)
            if args[-1] == TIMED_STEP:
                self.timed_syncs, self._values = self._values.sites, None
            else:
                self.device_syncs, self._values = self._values.sites, None
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.collectives, self._mode = self._mode.calls, None
            self.backend = str(torch.distributed.get_backend())
            self.gather_at_once = comm.GATHER_AT_ONCE
        if self._copies is not None:
            self._copies.__exit__(None, None, None)
            self.copies, self._copies = self._copies.sites, None
        if self._warnings is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(None, None, None)
            self.syncs = len(self.sync_sites)
            self._warnings = None


def rows(steps: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 128, (16, 33), generator=gen)  # 16 rows of 32 tokens
        out.append({"input_ids": x[:, :-1], "targets": x[:, 1:]})
    return out


def packed(steps: int) -> list[dict[str, torch.Tensor]]:
    """Batches of three documents packed in one row of 64 tokens (their positions restart, attention stays inside)."""
    gen = torch.Generator().manual_seed(0)
    sizes = (20, 24, 20)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])  # [64]
    positions = torch.cat([torch.arange(n) for n in sizes])  # [64]
    out = []
    for _ in range(steps):
        x = torch.randint(0, 128, (1, 65), generator=gen)
        out.append({"input_ids": x[:, :-1], "targets": x[:, 1:], "positions": positions, "doc_ids": doc_ids})
    return out


def data_parallel(lengths: Any, world: int, cost: Any, **kwargs: Any) -> Assignment:
    """Every step on groups of one, rows dealt round robin."""
    members = [list(range(r, len(lengths), world)) for r in range(world)]
    times = tuple(float(cost(tuple(lengths[i] for i in m), 1)) for m in members)
    return Assignment((1,) * world, tuple(tuple(m) for m in members), times)


LOADER_BATCH: list[Any] = []
"""The batch the loader gave for the last batch moved (:func:`_moved_as_onto_a_device`)."""


def _moved_as_onto_a_device() -> None:
    """Lightning's move of a batch makes new tensors, as onto a GPU (on the host it hands the loader's back): the
    step then tells the batch it runs on from the loader's, as a GPU run does."""
    from lightning.pytorch.strategies import Strategy

    move = Strategy.batch_to_device

    def copied(self: Strategy, batch: Any, *args: Any, **kwargs: Any) -> Any:
        LOADER_BATCH[:] = [batch]  # the host's (the step describes the batch from it)
        return apply_to_collection(move(self, batch, *args, **kwargs), torch.Tensor, torch.clone)

    Strategy.batch_to_device = copied  # type: ignore[method-assign]


def worker(rank: int, world: int, ports: tuple[int, ...], packing: bool) -> bytes:
    """Counts a data-parallel step of 16 rows, or (``packing``) a ``tp_sp`` step of both ranks on packed documents."""
    import lightning_paradyse.groups.solver as solver

    strategy_environment(rank, world)
    os.environ["MASTER_PORT"] = str(ports[0])
    solver.assign = data_parallel  # type: ignore[assignment]
    _moved_as_onto_a_device()
    pl.seed_everything(0, verbose=False)
    count = Count()
    batches = packed if packing else rows
    trainer = quiet_trainer(
        world,
        ParaDySeStrategy(timeout=60, plan="tp_sp", groups=False) if packing else ParaDySeStrategy(timeout=60),
        [ParaDySeSwitcher(), count],  # the switcher's batch-end hook inside the counted window (it runs first)
        max_steps=TIMED_STEP + 1,
        val_check_interval=COUNTED_STEP,  # a validation batch between step 2 and the counted step
        log_every_n_steps=TIMED_STEP + 1,  # the optimizer step that ends TIMED_STEP: global step TIMED_STEP + 1
        limit_val_batches=1,
        num_sanity_val_steps=1,  # the one-time check of the validation step runs there, before the counted batch
    )
    loader = DataLoader(batches(TIMED_STEP + 1), batch_size=None)
    trainer.fit(LanguageModel("llama-tiny"), loader, DataLoader(batches(1), batch_size=None))
    assert trainer.strategy.step_record.split == (() if packing else (1,) * world)  # type: ignore[attr-defined]
    assert count.validated == [0, COUNTED_STEP], count.validated  # the sanity check's, then before the counted step
    buffer = io.BytesIO()
    record = {
        "collectives": dict(count.collectives),
        "syncs": count.syncs,
        "sync_sites": count.sync_sites,
        "copies": count.copies,
        "device_syncs": count.device_syncs,
        "eval_syncs": count.eval_syncs,
        "timed_syncs": count.timed_syncs,
        "backend": count.backend,
        "gather_at_once": count.gather_at_once,
    }
    torch.save(record, buffer)
    return buffer.getvalue()


@functools.cache
def counted_step(packing: bool = False) -> dict[str, Any]:
    """One run of :func:`worker` (the tests that read it share it)."""
    raw = run_distributed(worker, 2, free_ports(1), packing, timeout=240)
    counted = [torch.load(io.BytesIO(r), weights_only=False) for r in raw]
    assert all(run == counted[0] for run in counted), counted
    return counted[0]  # type: ignore[no-any-return]


def test_a_data_parallel_step_makes_the_two_halves_of_ddps_all_reduce_and_nothing_else() -> None:
    collectives = counted_step()["collectives"]
    # after a data-parallel step (and a validation batch, which agrees on its digest alone and leaves the weights
    # to the next training batch): the weights in, riding with the batch digest (plan and batch agreed in the same
    # all-gather, before any other collective of the step, rank 0's SIGTERM flag with them in place of Lightning's
    # broadcast), and the gradients out (the shards', the replicated ones', the group times and every rank's share
    # of the loss riding along): DDP's all-reduce in two halves. The weights' all-gather is an all-to-all on gloo's
    # host tensors where every rank has a core (comm.all_gather_rows(at_once=True)).
    at_once = ACCELERATOR != "gpu" and comm.host_spin_seconds(torch.device("cpu"), 2) > 0  # a core a rank here
    assert counted_step()["gather_at_once"] == at_once
    expected = {"alltoall_base_": 2} if at_once else {"_allgather_base_": 1, "alltoall_base_": 1}
    assert collectives == expected, collectives


@pytest.mark.gpu
@pytest.mark.skipif(ACCELERATOR != "gpu" or not torch.cuda.is_available(), reason="PARADYSE_TEST_ACCELERATOR=gpu")
def test_a_data_parallel_step_synchronises_the_host_once() -> None:
    # the digest's agreement (on a step the logger does not log: nothing is timed); where the ranks share the GPU
    # over gloo, gloo stages the return's device tensors through the host inside the all-to-all: once more
    counted = counted_step()
    print(f"host synchronisations of the step ({counted['backend']}):", *counted["sync_sites"], sep="\n  ")
    assert counted["syncs"] <= 1 + (counted["backend"] == "gloo"), counted["sync_sites"]


def test_a_data_parallel_step_would_synchronise_a_gpu_once() -> None:
    # the GPU's own count (above) followed on the host: the digest's agreement; the returned gradients' presence
    # flags are read only by a rank that lacks a gradient, the loss's shares are summed on the device
    sites = counted_step()["device_syncs"]
    print("host synchronisations a GPU run would make:", *sites, sep="\n  ")  # shown whole if it fails
    assert len(sites) == 1, sites


def test_a_data_parallel_step_the_logger_logs_would_synchronise_a_gpu_four_times() -> None:
    # the measurement made on the steps the logger logs: the previous step's kernels before the step starts, the
    # agreement, the group time (the step's kernels before the clock is read) and every rank's seconds after the return
    sites = counted_step()["timed_syncs"]
    print("host synchronisations a GPU run would make:", *sites, sep="\n  ")
    first = [site.split(" <- ")[0] for site in sites]  # where each was asked for
    assert len(sites) == 4 and sum("groups/runner.py" in f for f in first) == 2, sites
    assert sum("lightning/cycle.py" in f for f in first) == 1, sites


def test_an_evaluation_batch_would_synchronise_a_gpu_once() -> None:
    # its digest's agreement (the plan and the batch agreed before its collectives; no gradient comes back)
    sites = counted_step()["eval_syncs"]
    print("host synchronisations a GPU run would make:", *sites, sep="\n  ")
    assert len(sites) == 1, sites


def test_a_step_on_packed_documents_would_synchronise_a_gpu_at_most_twice_and_never_per_layer() -> None:
    # a sequence-parallel step (tp_sp on both ranks): the digest's agreement and the batch's positions agreed (given
    # by the batch: one flag summed over the ranks); the documents' spans are read on the host once (every attention
    # layer asks for them)
    sites = counted_step(packing=True)["device_syncs"]
    print("host synchronisations a GPU run would make:", *sites, sep="\n  ")
    assert len(sites) <= 2 and not any(": modes/" in site for site in sites), sites


def test_a_data_parallel_step_copies_nothing_onto_the_device_blocking() -> None:
    # on a GPU each would be a host synchronisation (it waits for every kernel queued before it); counted on any
    # machine from the calls themselves
    assert counted_step()["copies"] == []


def test_the_batch_is_described_from_the_loaders_copy_only_while_no_hook_changed_it() -> None:
    """The loader's batch stands for the moved one (no copy, no device read) until a batch-start hook replaces a
    tensor of the moved batch or changes one in place: the cycle then describes the batch the step runs on."""
    from lightning_paradyse.lightning.cycle import StepCycle
    from lightning_paradyse.lightning.options import StrategyOptions

    cycle = StepCycle(StrategyOptions.of(), lambda plan: None)
    loader = {"input_ids": torch.ones(1, 4, dtype=torch.long), "targets": torch.ones(1, 4, dtype=torch.long)}
    moved = {k: v.clone() for k, v in loader.items()}  # what a transfer to a device gives
    cycle.keep_host_batch(moved, loader)
    assert cycle.on_host(moved)["targets"] is loader["targets"]
    cycle.keep_host_batch(moved, loader)
    moved["targets"][:, :2] = -100  # e.g. an on_train_batch_start that masks a prompt in place
    assert cycle.on_host(moved)["targets"].tolist() == [[-100, -100, 1, 1]]
    cycle.keep_host_batch(moved, loader)
    moved["targets"] = torch.zeros(1, 4, dtype=torch.long)  # or replaces an entry
    assert cycle.on_host(moved)["targets"].tolist() == [[0, 0, 0, 0]]
    cycle.keep_host_batch(moved, None)  # a transfer hook of the module's own: never the loader's copy
    assert cycle.on_host(moved) is not loader


def test_a_grouped_steps_record_without_a_cost_model_logs_flops_not_seconds() -> None:
    """A fixed plan's groups are priced in FLOPs per rank: the record logs that count under its own name, never as
    seconds beside the measured ones (nor plus the fixed part's seconds)."""
    from lightning_paradyse.groups.runner import GroupStep
    from lightning_paradyse.lightning.cycle import StepCycle
    from lightning_paradyse.lightning.options import StrategyOptions
    from lightning_paradyse.modes.plan import uniform_plan
    from lightning_paradyse.runtime.slicing import describe_batch

    cycle = StepCycle(StrategyOptions.of(), lambda plan: None)
    cycle._planner = object()  # type: ignore[assignment]  # any planner without a cost model
    batch = rows(1)[0]
    info = describe_batch(batch, 2, 0, True)
    plan = uniform_plan("tp_sp", 2)
    found = Assignment((1, 1), ((0, 2, 4), (1, 3, 5)), (3.0e9, 2.5e9))
    step = GroupStep(found, None, 0, None, 0, batch, info, (plan, plan), {})
    metrics = cycle._record("train", info, step, 0.0).metrics
    assert metrics["groups/predicted_flops"] == found.time
    assert "groups/predicted_time_s" not in metrics and "plan/predicted_time_s" not in metrics


def test_the_loss_of_a_steps_output() -> None:
    """A tensor, or the ``loss`` of any mapping (Lightning accepts any ``Mapping`` as a step's output)."""
    loss = torch.tensor(1.5)
    assert step_loss(loss) is loss
    assert step_loss({"loss": loss, "other": 1}) is loss
    assert step_loss(MappingProxyType({"loss": loss})) is loss
    assert step_loss(None) is None and step_loss({"acc": loss}) is None and step_loss({"loss": 1.5}) is None
