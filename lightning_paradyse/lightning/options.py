"""The strategy's options in one typed, validated record: :class:`StrategyOptions`.

``ParaDySeStrategy(**kwargs)`` (and LightningCLI's YAML, which reads the strategy's signature) hands its keyword
arguments to :meth:`StrategyOptions.of`, which checks every one and fills the defaults that depend on others
(``groups``, the grid mode). Every check raises a ``ValueError`` naming the option, the value and the fix, in
``__init__``: before any process exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_paradyse.distributed.devices import resolve_backend
from lightning_paradyse.planning.fixed import PlanSpec, parse_memory_budget, validate_modes, validate_plan_spec

START_METHODS = ("spawn", "fork", "forkserver", "popen")


@dataclass(frozen=True)
class StrategyOptions:
    """What a :class:`~lightning_paradyse.lightning.strategy.ParaDySeStrategy` was asked for, checked (see its
    docstring for the meaning of each option)."""

    modes: tuple[str, ...]
    """The modes the planner may use (``dsp`` added for ``axes=2``)."""
    plan: PlanSpec = "auto"
    thresholds: tuple[int, int] | None = None
    memory_budget: int | None = None
    """Bytes per rank (``None``: the GPU's free memory, or no limit on the host)."""
    profile: str | None = None
    compile: bool = False
    blocks: str | None = None
    max_seq_len: int | None = None
    start_method: Literal["spawn", "fork", "forkserver", "popen"] = "spawn"
    timeout: float = 1800.0
    loss_reduction: Literal["mean", "sum"] = "mean"
    on_infeasible: Literal["error", "skip"] = "error"
    plan_bucket: int = 512
    groups: bool = True
    """Training batches of several sequences run on groups (on by default with ``plan="auto"``)."""
    groups_asked: bool = False
    """``groups=True`` was given: a model groups cannot run is refused instead of running on one group."""
    axes: int = 1
    elementwise_optimizers: tuple[str, ...] = ()
    check_replicas_every: int = 50
    check_step: bool = True
    process_group_backend: Literal["nccl", "gloo"] | None = None
    ranks_per_device: int = 1
    grad_reduce_dtype: Literal["float32", "param"] = "float32"

    @classmethod
    def of(
        cls,
        modes: Sequence[str] | None = None,
        plan: PlanSpec = "auto",
        thresholds: tuple[int, int] | None = None,
        memory_budget: int | str | None = None,
        profile: str | None = None,
        compile: bool = False,
        blocks: str | None = None,
        max_seq_len: int | None = None,
        start_method: str = "spawn",
        timeout: float = 1800.0,
        loss_reduction: str = "mean",
        on_infeasible: str = "error",
        plan_bucket: int = 512,
        groups: bool | None = None,
        axes: int = 1,
        elementwise_optimizers: Sequence[str] = (),
        check_replicas_every: int = 50,
        check_step: bool = True,
        process_group_backend: str | None = None,
        ranks_per_device: int = 1,
        grad_reduce_dtype: str = "float32",
    ) -> StrategyOptions:
        """The options of ``ParaDySeStrategy(...)``, each checked; raises a ``ValueError`` naming the option."""
        grad_reduce_dtype = _choice("grad_reduce_dtype", grad_reduce_dtype, ("float32", "param"))
        ranks_per_device = int(_positive("ranks_per_device", ranks_per_device) or 1)
        if process_group_backend is not None:  # a bad name, or NCCL asked to share a GPU: refused here already
            resolve_backend([torch.device("cuda", 0)] * ranks_per_device, process_group_backend)
        if axes not in (1, 2):
            raise ValueError(f"axes={axes!r}: use 1 (language models, [b, s, h]) or 2 (a grid, [b, T, S, h])")
        if axes == 2 and groups:
            raise ValueError("groups=True works on language-model batches ([b, s]); use it with axes=1")
        allowed = validate_modes(modes)
        if thresholds is not None:
            _warn_unused_thresholds(plan, profile, axes)
        if axes == 2 and "dsp" not in allowed:
            allowed = (*allowed, "dsp")
        return cls(
            modes=allowed,
            plan=validate_plan_spec(plan, allowed),
            thresholds=None if thresholds is None else _thresholds(thresholds),
            memory_budget=parse_memory_budget(memory_budget),
            profile=_profile(profile),
            compile=_flag("compile", compile),
            blocks=_blocks(blocks),
            max_seq_len=_positive("max_seq_len", max_seq_len),
            start_method=_choice("start_method", start_method, START_METHODS),  # type: ignore[arg-type]
            timeout=_timeout(timeout),
            loss_reduction=_choice("loss_reduction", loss_reduction, ("mean", "sum")),  # type: ignore[arg-type]
            on_infeasible=_choice("on_infeasible", on_infeasible, ("error", "skip")),  # type: ignore[arg-type]
            plan_bucket=int(_positive("plan_bucket", plan_bucket) or 512),
            groups=_flag("groups", plan == "auto" and axes == 1 if groups is None else groups),
            groups_asked=groups is True,
            axes=axes,
            elementwise_optimizers=_names("elementwise_optimizers", elementwise_optimizers),
            check_replicas_every=_every("check_replicas_every", check_replicas_every),
            check_step=_flag("check_step", check_step),
            process_group_backend=process_group_backend,  # type: ignore[arg-type]
            ranks_per_device=ranks_per_device,
            grad_reduce_dtype=grad_reduce_dtype,  # type: ignore[arg-type]
        )

    @property
    def mean_loss(self) -> bool:
        """The module's loss is a mean over its local real tokens (rescaled by ``n_r / N``)."""
        return self.loss_reduction == "mean"

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _warn_unused_thresholds(plan: PlanSpec, profile: str | None, axes: int) -> None:
    """``thresholds`` choose the plan only with ``plan="auto"``, no ``profile`` and ``axes=1``: a warning where the
    run's planner is another and the thresholds given go unused."""
    reason = (
        "the plan is fixed"
        if plan != "auto"
        else "a profile is given (the cost model plans)"
        if profile is not None
        else "axes=2 plans on the grid"
        if axes == 2
        else None
    )
    if reason is not None:
        rank_zero_warn(
            f"ParaDySeStrategy(thresholds=...) is unused: {reason}; thresholds choose the plan only with "
            "plan='auto', no profile and axes=1 (drop thresholds, or the option that overrides them)"
        )


def _choice(option: str, value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"ParaDySeStrategy({option}={value!r}): choose one of {list(choices)}")
    return value


def _every(option: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ParaDySeStrategy({option}={value!r}): expected a number of steps >= 0 (0: never)")
    return value


def _names(option: str, value: Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"ParaDySeStrategy({option}={value!r}): expected a list of class names, e.g. ['Lion']")
    return tuple(value)


def _flag(option: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"ParaDySeStrategy({option}={value!r}): expected true or false")
    return value


def _positive(option: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"ParaDySeStrategy({option}={value!r}): expected a positive integer or None")
    return value


def _timeout(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"ParaDySeStrategy(timeout={value!r}): expected a positive number of seconds")
    return float(value)


def _thresholds(value: Sequence[int]) -> tuple[int, int]:
    ok = isinstance(value, Sequence) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)
    if not ok or value[0] > value[1]:
        raise ValueError(
            f"ParaDySeStrategy(thresholds={value!r}): expected two lengths (short_max, middle_max) "
            f"with 0 < short_max <= middle_max, e.g. (256, 1024)"
        )
    return int(value[0]), int(value[1])


def _profile(value: str | None) -> str | None:
    if value is not None and not Path(value).is_file():
        raise ValueError(f"ParaDySeStrategy(profile={value!r}): no such file; give the path of a saved cost profile")
    return value


def _blocks(value: str | None) -> str | None:
    if value is not None and (not isinstance(value, str) or not value or any(not p for p in value.split("."))):
        raise ValueError(f"ParaDySeStrategy(blocks={value!r}): expected a dotted path such as 'model.layers'")
    return value


__all__ = ["START_METHODS", "StrategyOptions"]
