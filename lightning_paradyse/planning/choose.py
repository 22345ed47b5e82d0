"""The run's planner, chosen once at setup from the strategy's options: :func:`choose_planner`.

* a fixed plan (``plan=`` a mode or a list): :class:`~lightning_paradyse.planning.fixed.FixedPlanner`;
* a grid model (``axes=2``): :class:`~lightning_paradyse.planning.grid.GridPlanner` (dimension switching or a sequence
  mode per block, whichever moves fewer bytes);
* ``thresholds=`` without a profile: :class:`~lightning_paradyse.planning.fixed.ThresholdPolicy`;
* otherwise the cost model's exact planner (:func:`~lightning_paradyse.planning.planner.make_planner`) on a profile, a
  cluster file, or this machine measured now (:func:`~lightning_paradyse.calibration.quick.cached_quick_machine`: its
  rates, collectives and every mode's per-op overhead, with the largest weight exchange of the groups measured beside
  it), within the memory budget (:func:`budget_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_paradyse.calibration.profile import is_profile_file
from lightning_paradyse.calibration.quick import Overheads, cached_quick_machine
from lightning_paradyse.cost.cluster import GiB, load_cluster
from lightning_paradyse.cost.dims import dims_from_module, dtype_size
from lightning_paradyse.distributed.comm import Group, all_gather_rows, collective_device, group_size
from lightning_paradyse.distributed.devices import gpu_budget
from lightning_paradyse.graph.dispatch import AttentionDispatch
from lightning_paradyse.modes.plan import Plan, parse_plan
from lightning_paradyse.planning.fixed import FixedPlanner, Planner, ThresholdPolicy
from lightning_paradyse.planning.grid import GridPlanner
from lightning_paradyse.planning.planner import make_planner
from lightning_paradyse.runtime import parallel

UNLIMITED_BYTES = 2**62
"""The memory budget when none is given: the planner then picks the fastest plan."""


class PlannerOptions(Protocol):
    """What the choice reads of the strategy's options
    (:class:`~lightning_paradyse.lightning.options.StrategyOptions` has every field)."""

    @property
    def plan(self) -> Any: ...
    @property
    def modes(self) -> tuple[str, ...]: ...
    @property
    def axes(self) -> int: ...
    @property
    def profile(self) -> str | None: ...
    @property
    def thresholds(self) -> tuple[int, int] | None: ...
    @property
    def memory_budget(self) -> int | None: ...
    @property
    def groups(self) -> bool: ...
    @property
    def on_infeasible(self) -> str: ...
    @property
    def plan_bucket(self) -> int: ...


@dataclass(frozen=True)
class ChosenPlanner:
    """The planner, and the measured seconds of the largest weight exchange when it was measured beside the
    machine (``None`` otherwise: the groups measure or price it)."""

    planner: Planner
    exchange_s: float | None = None


def fixed_plan(options: PlannerOptions, n_layers: int) -> Plan:
    """The ``plan`` option for a model of ``n_layers`` blocks (raises naming the option)."""
    assert options.plan != "auto"
    try:
        return parse_plan(options.plan, n_layers)  # type: ignore[arg-type]
    except ValueError as err:
        raise ValueError(f"ParaDySeStrategy(plan={options.plan!r}): {err}") from None


def choose_planner(
    module: nn.Module,
    options: PlannerOptions,
    group: Group,
    device: torch.device,
    devices: list[torch.device],
    checkpointed: tuple[int, ...],
    check_plan: Callable[[Plan], None],
    measure_exchange: Callable[[], float | None] | None = None,
    compute_dtype: torch.dtype | None = None,
) -> ChosenPlanner:
    """The run's planner (see the module docstring), the same on every rank. ``devices``: every local rank's device
    (ranks sharing a GPU share its budget); ``checkpointed``: the layers the model's own gradient checkpointing
    marks (all of them: the planner recomputes every layer); ``measure_exchange``: seconds of the groups' largest
    weight exchange (``None`` where it cannot be measured), measured beside the machine when it is measured;
    ``compute_dtype``: the dtype autocast computes in (``precision="bf16-mixed"``: bfloat16; ``None``: no autocast):
    the machine is measured in it and the memory model keeps the modes' activations in it."""
    n = parallel.n_layers(module)
    if options.plan != "auto":
        return ChosenPlanner(FixedPlanner(fixed_plan(options, n)))
    parallel.check_modes_feasible(module, group_size(group), list(options.modes))  # reasons named, before measuring
    if options.axes == 2:
        return ChosenPlanner(_grid_planner(module, options, group_size(group), check_plan))
    if options.profile is None and options.thresholds is not None:
        return ChosenPlanner(ThresholdPolicy(n, options.modes, options.thresholds, check=check_plan))
    try:  # the cost model's reading of the model, alike on every rank, before any collective
        dims = dims_from_module(module)
    except ValueError as err:
        raise ValueError(
            f"ParaDySeStrategy(plan='auto') plans with the cost model, which cannot describe this model ({err}); "
            "give a fixed plan (plan='tp_sp', or one entry per layer), or thresholds=(short_max, middle_max) and no "
            "profile"
        ) from None
    source: Any = options.profile
    exchange_s = None
    overheads: dict[str, Any] = {}
    p = group_size(group)
    if source is None:  # measure this machine now (every rank, then agreed: the same model everywhere)
        dtype = compute_dtype or next(module.parameters()).dtype  # the matmuls' dtype: autocast's where it is on

        def exchange(machine: Any) -> dict[str, float]:  # the largest weight exchange, kept with the machine
            seconds = None if measure_exchange is None else measure_exchange()
            return {} if seconds is None else {"exchange_s": seconds}

        extra = exchange if options.groups and p > 1 and measure_exchange is not None else None
        measured = cached_quick_machine(dims, p, group, device, dtype, extra)
        source, exchange_s = measured.machine, measured.extras.get("exchange_s")
        overheads = {  # the cost model's per-op constants: every mode's measured overhead
            "calibration": Overheads.calibration(measured.overheads.world),
            "one_rank": Overheads.calibration(measured.overheads.one_rank),
        }
        rank_zero_info(f"[paradyse] cost model: {source.name}; run `python cli.py profile` for a calibrated one")
    planner = make_planner(
        module,
        p,
        budget_bytes(options, group, device, devices),
        source,
        options.modes,
        on_infeasible="skip" if options.on_infeasible == "skip" else "raise",
        bucket_tokens=options.plan_bucket,
        recompute=(True,) if len(checkpointed) == n else (False, True),  # every layer checkpointed by HF
        prefer_tp_sp=0.25 if options.profile is None else 0.0,  # the quick model: overheads of a short sequence only
        compute_bytes=None if compute_dtype is None else dtype_size(compute_dtype),
        **overheads,
    )
    return ChosenPlanner(planner, exchange_s)


def _grid_planner(module: nn.Module, options: PlannerOptions, p: int, check_plan: Callable[[Plan], None]) -> Planner:
    """Grid models: per block, dimension switching or a sequence mode, whichever moves fewer bytes."""
    ops = [op for _, op in parallel.dispatchers(module) if isinstance(op, AttentionDispatch)]
    axes = [int(op.attend_axis or 1) for op in ops]
    kv_ratio = ops[0].spec.n_kv_heads / ops[0].spec.n_heads
    feasible = [m for m in options.modes if all(op.infeasible(m, p) is None for op in ops)]
    planner = GridPlanner(axes, p, kv_ratio, feasible)
    check_plan(planner.plan(1, 1))
    if options.memory_budget is not None:
        rank_zero_warn(
            "[paradyse] axes=2: the grid planner minimises communication and has no memory model; "
            "memory_budget is not applied (give a fixed plan, e.g. with recompute, to save memory)"
        )
    return planner


def budget_bytes(options: PlannerOptions, group: Group, device: torch.device, devices: list[torch.device]) -> int:
    """``memory_budget``; else on a GPU what it leaves to tensors (:func:`~.devices.gpu_budget`: the CUDA context,
    communicators and other processes, a fragmentation margin, a cluster file's ``reserve_gib``), the same on every
    rank (the least); else no limit."""
    if options.memory_budget is not None:
        return options.memory_budget
    if device.type != "cuda":
        return UNLIMITED_BYTES
    reserve = 0
    if options.profile is not None and not is_profile_file(options.profile):
        reserve = int(load_cluster(options.profile).reserve_gib * GiB)
    share = devices.count(device)  # ranks on this GPU
    mine = torch.tensor([float(gpu_budget(device, reserve, share))], device=device)
    p = group_size(group)
    if p > 1:  # ranks sharing a GPU or GPUs of one node: the tightest counts everywhere
        every = all_gather_rows(mine.to(collective_device(group)), [1] * p, group)  # [1] -> [p]
        return int(every.min())
    return int(mine)


__all__ = ["UNLIMITED_BYTES", "ChosenPlanner", "budget_bytes", "choose_planner", "fixed_plan"]
