"""Measuring a training step: wall time, peak memory per rank, bytes communicated, planner time, matmul rate.

* **Time**: :class:`StepRecorder` (a Lightning callback, first in the list) reads the clock at
  ``on_train_batch_start`` and ``on_train_batch_end``: the planner, forward, backward, gradient
  synchronisation and the optimizer step are inside; data loading is not. CUDA is synchronised at both ends.
* **Memory**: the cost model's :class:`~lightning_paradyse.calibration.tracker.MemoryTracker` (live tensor storage on
  CPU, allocator statistics on CUDA), or :class:`FallbackTracker` when the package has none. The tracker
  counts what is allocated during the step and what lives across steps (parameters, gradients, optimizer
  state, the local shards of DTensors included) from the step's start until it is freed (Lightning frees the
  previous step's gradients after the forward), so the peak is absolute. (The fallback cannot see those
  frees: it adds what lives across steps to its peak, over-counting a backward by the gradients' size.)
* **Communication**: :class:`CollectiveCounter` sees every collective at the dispatcher (``c10d`` and
  ``_c10d_functional`` ops: Lightning's DDP reducer, FSDP2, DTensor and ParaDySe's own calls alike) and counts
  the bytes each rank sends with the conventions of :class:`lightning_paradyse.distributed.comm.CommCounter` (the
  bandwidth-optimal algorithm's volume); ParaDySe runs also report the package's ``CommCounter``.
* **Groups**: for a ParaDySe step on groups the strategy's step record gives the split (group sizes), the
  decision's seconds (``groups/solve_s``: split, assignment and every group's plan), the predicted time, and the
  measured imbalance of the groups (slowest over mean, :func:`lightning_paradyse.groups.imbalance`).
* Memory and communication are instrumented in a separate pass: both are Python dispatch modes, whose
  per-op cost would distort the timed passes (by up to several times for modes with many small ops).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from typing_extensions import override

try:
    from lightning_paradyse.calibration.tracker import MemoryTracker as PackageTracker
except ImportError:  # the cost model is not installed in this version of the package
    PackageTracker = None  # type: ignore[assignment,misc]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2, tensor parallel), the tensor itself otherwise."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def _storage(t: torch.Tensor) -> Any:
    try:
        return _local(t).untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class FallbackTracker(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while active (a DTensor counts its local shard).

    Used when :mod:`lightning_paradyse.calibration.tracker` cannot be imported; same contract as its
    ``MemoryTracker`` (``peak`` relative to entry, ``reset_peak``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(s) for s in map(_storage, _tensors((args, kwargs))) if s is not None}
        for tensor in _tensors(out):
            storage = _storage(tensor)
            if storage is None or id(storage) in inputs or id(storage) in self._alive:
                continue
            self._alive.add(id(storage))
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        if key in self._alive:
            self._alive.discard(key)
            self.live -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.live


def _tensors(values: Any) -> list[torch.Tensor]:
    return [v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)]


def make_tracker(device: torch.device, resident: list[torch.Tensor]) -> tuple[Any, bool]:
    """The package's ``MemoryTracker`` when importable, else :class:`FallbackTracker` (CPU only); and whether
    its peak already counts ``resident`` (alive at the start, until freed during the step)."""
    if PackageTracker is not None:
        try:
            return PackageTracker(device, resident=[_local(t) for t in resident]), True
        except TypeError:  # an older package: its tracker counts only what the step allocates
            return PackageTracker(device), False
    return FallbackTracker(), False


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = _storage(t)
        if storage is not None and storage.nbytes() > 0:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_tensors(module: torch.nn.Module, optimizers: Iterable[Any]) -> list[torch.Tensor]:
    """What lives across steps: parameters, their gradients, buffers, optimizer state."""
    out: list[torch.Tensor] = [*module.parameters(), *module.buffers()]
    out += [p.grad for p in module.parameters() if p.grad is not None]
    for opt in optimizers:
        inner = getattr(opt, "_optimizer", opt)
        for state in inner.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _group_size(group: Any) -> int:
    size = getattr(group, "size", None)
    if callable(size):
        return int(size())
    return dist.get_world_size() if dist.is_initialized() else 1


def _bytes(values: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(values))


def collective_bytes(name: str, args: tuple[Any, ...], p: int) -> float:
    """Bytes one rank sends for the collective ``name`` with ``args`` on ``p`` ranks (CommCounter conventions)."""
    if p <= 1:
        return 0.0
    share = (p - 1) / p
    if name in ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced"):
        return 2 * share * _bytes(args[0])
    if name in ("allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_", "_allgather_base_"):
        return (p - 1) * _bytes(args[1])
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        return (p - 1) * _bytes(args[0])
    if name in ("reduce_scatter_", "reduce_scatter_tensor_coalesced_", "_reduce_scatter_base_"):
        return share * _bytes(args[1])
    if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single"):
        return share * _bytes(args[0])
    if name in ("alltoall_base_", "alltoall_"):
        return share * _bytes(args[1])
    if name in ("broadcast_", "broadcast", "reduce_"):
        return share * _bytes(args[0])
    if name == "send":
        return float(_bytes(args[0]))
    return 0.0


class CollectiveCounter(TorchDispatchMode):
    """Bytes this rank sends through ``torch.distributed`` while active, seen at the dispatcher."""

    NAMESPACES = ("c10d", "_c10d_functional")

    def __init__(self) -> None:
        super().__init__()
        self.total = 0.0
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in self.NAMESPACES:
            name = func._overloadpacket.__name__
            self.total += collective_bytes(name, tuple(args), _group_size(_find_group(args)))
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _find_group(args: Any) -> Any:
    for value in args:
        if isinstance(value, torch.ScriptObject) and hasattr(value, "size"):
            return value
        if isinstance(value, str) and value:  # functional collectives name their group
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group

                return _resolve_process_group(value)  # type: ignore[arg-type]
            except (RuntimeError, ValueError, KeyError):
                return None
    return None


class TimedPlanner:
    """Wraps a planner and records the seconds each ``plan`` call takes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds: list[float] = []

    def plan(self, seq_len: int, batch: int) -> Any:
        start = time.perf_counter()
        try:
            return self.inner.plan(seq_len, batch)
        finally:
            self.seconds.append(time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepRecorder(pl.Callback):
    """Records every training step of a fit: rows and length of this rank's batch, seconds, the decision's
    seconds, the group split and, when ``instrumented``, the absolute peak bytes and the bytes sent.

    A step's seconds run from the end of the previous step (after the device synchronised and after this callback
    recorded it: its own bookkeeping, e.g. the plan's cost evaluated for the record, and the progress bar are no
    run's time) to its own end, so that Lightning's loop between two steps counts (its fetch of the batch, its
    per-step check for SIGTERM, the hooks after this callback's), as a user's throughput does; the fit's first step,
    a step after a validation and every step of an instrumented pass (whose tracking starts in the batch-start hook)
    from its batch-start hook.

    Args:
        instrumented: Track memory and communication (slower steps: use for the measurement pass only).
        on_step: Called after every recorded step (progress bars).
        warmup: Leading steps not recorded (one-time costs: first collectives, optimizer state, caches).
        switcher: ParaDySe runs: the ``ParaDySeSwitcher`` (after this callback), whose history gives each
            step's plan; a step without a new plan was skipped by the strategy (no plan fits the budget).
    """

    def __init__(self, instrumented: bool, on_step: Any = None, warmup: int = 0, switcher: Any = None) -> None:
        self.instrumented = instrumented
        self.on_step = on_step
        self.warmup = warmup
        self.switcher = switcher
        self.steps: list[dict[str, Any]] = []
        self.gathered: list[list[dict[str, Any]]] = []
        self._planner: TimedPlanner | None = None
        self._modes: list[Any] = []
        self._start = 0.0
        self._last_end: float | None = None
        self._resident = 0
        self._ooms = 0
        self._plans = 0
        self._planned = 0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_end = None
        planner = getattr(trainer.strategy, "planner", None)
        if planner is not None:
            self._planner = TimedPlanner(planner)
            trainer.strategy.planner = self._planner  # type: ignore[attr-defined]

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        device = trainer.strategy.root_device
        self._ooms = int(getattr(pl_module, "oom_steps", 0))
        self._plans = self.switcher.plans_executed if self.switcher is not None else 0
        self._planned = len(self._planner.seconds) if self._planner is not None else 0
        if self.instrumented and idx >= self.warmup:
            state = state_tensors(pl_module, trainer.optimizers)
            tracker, absolute = make_tracker(device, state)
            self._resident = 0 if absolute else resident_bytes(state)
            del state
            self._modes = [tracker, CollectiveCounter(), _comm_counter()]
            for mode in self._modes:
                mode.__enter__()
        if not self.instrumented and self._last_end is not None:  # the loop since the last step counts too
            self._start = self._last_end  # (synchronised there: nothing to wait for here that a user would not)
        else:
            _sync(device)
            self._start = time.perf_counter()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_end = None  # the next training step counts from its own start

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        _sync(trainer.strategy.root_device)
        end = time.perf_counter()
        try:
            self._record(trainer, pl_module, batch, idx, end - self._start)
        finally:  # the next step counts from here: this hook's own bookkeeping is no run's time
            self._last_end = time.perf_counter()

    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int, seconds: float) -> None:
        """Keep the step (unless a warm-up one) with its plan, groups and, when instrumented, memory and bytes."""
        if idx < self.warmup:
            return
        rows, length = (int(n) for n in batch["input_ids"].shape[:2])
        step: dict[str, Any] = {"rows": rows, "len": length, "seconds": seconds}
        calls = self._planner.seconds[self._planned :] if self._planner is not None else []
        step["plan_s"] = sum(calls) if calls else None  # None: the planner was not asked (e.g. a step on groups)
        step["cuda_oom"] = int(getattr(pl_module, "oom_steps", 0)) > self._ooms
        step.update(self._plan_of_step(length, rows))
        step.update(self._groups_of_step(trainer, step))
        if self.instrumented:
            for mode in reversed(self._modes):
                mode.__exit__(None, None, None)
            tracker, counter, package_counter = self._modes
            step["peak"] = self._resident + int(tracker.peak)
            step["comm"] = counter.total
            step["comm_calls"] = counter.calls
            step["comm_pkg"] = package_counter.total if package_counter is not None else None
            self._modes = []
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step()

    def _plan_of_step(self, length: int, rows: int) -> dict[str, Any]:
        """The step's plan (``[[attention, mlp], ...]`` per layer; on groups: this rank's group's), whether it was
        skipped, and the cost model's predicted time and peak when the planner has them."""
        if self.switcher is None:
            return {"plan": None, "skipped": False}
        last = self.switcher.last_plan
        if self.switcher.plans_executed == self._plans or last is None:
            return {"plan": None, "skipped": True}
        plan = last.plan
        out: dict[str, Any] = {"plan": [[str(x.attention), str(x.mlp)] for x in plan.layers], "skipped": False}
        cost = getattr(getattr(self._planner, "model", None), "plan_cost", None)
        if cost is not None and last.seq_len == length and last.batch == rows:  # one group: the whole batch
            seconds, peak = cost(plan, length, rows)  # at this exact length (the planner plans per length bucket)
            out.update(pred_time_s=float(seconds), pred_peak=int(peak))
        return out

    def _groups_of_step(self, trainer: pl.Trainer, step: dict[str, Any]) -> dict[str, Any]:
        """ParaDySe runs: the group split of the step (``[p]``: one group of every rank), the decision's seconds
        (on groups: ``groups/solve_s``; else the planner's), the predicted time of a step on groups when the cost
        model predicts it (as logged, and with its priced part unscaled: ``pred_unscaled_s``), and the measured
        imbalance of the groups."""
        if self.switcher is None or step["skipped"]:
            return {}
        record = getattr(trainer.strategy, "step_record", None)
        world = trainer.world_size
        if record is None or not record.split:
            return {"split": [world], "decide_s": step["plan_s"]}
        out: dict[str, Any] = {"split": list(record.split), "decide_s": record.metrics.get("groups/solve_s")}
        if getattr(self._planner, "model", None) is not None:  # the cost model's seconds (else a FLOP count)
            predicted = record.metrics.get("groups/predicted_time_s")
            out["pred_time_s"] = predicted
            fixed, scale = record.metrics.get("plan/predicted_fixed_s"), record.metrics.get("plan/predicted_scale")
            if predicted is not None and fixed is not None and scale:  # the cost model's priced part uncorrected
                out["pred_unscaled_s"] = (predicted - fixed) / scale + fixed
        times = getattr(trainer.strategy, "group_times", ())
        if times:
            from lightning_paradyse.groups.runner import imbalance

            out["imbalance"] = imbalance(times)
        return out

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank's steps, on every rank (while the process group still exists)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            box: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(box, self.steps)
            self.gathered = box
        else:
            self.gathered = [self.steps]


class _NullContext:
    total = 0.0

    def __enter__(self) -> _NullContext:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _comm_counter() -> Any:
    try:
        from lightning_paradyse.distributed.comm import CommCounter
    except ImportError:
        return _NullContext()
    return CommCounter()


def matmul_rate(device: torch.device, size: int = 1024, windows: int = 3, seconds: float = 0.5) -> float:
    """FLOP/s of float32 ``size x size`` matrix products on this process (its threads, its device): the best of
    ``windows`` measurements of ``seconds`` each (the machine's rate, not its momentary load)."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    for _ in range(2):
        a @ b
    _sync(device)
    best = 0.0
    for _ in range(windows):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(16 if device.type == "cuda" else 1):
                a @ b
                count += 1
            _sync(device)
        best = max(best, 2.0 * size**3 * count / (time.perf_counter() - start))
    return best


__all__ = [
    "CollectiveCounter",
    "FallbackTracker",
    "StepRecorder",
    "TimedPlanner",
    "collective_bytes",
    "make_tracker",
    "matmul_rate",
    "resident_bytes",
    "state_tensors",
]
