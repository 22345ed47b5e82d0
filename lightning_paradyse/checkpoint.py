"""Consolidated optimizer state: full tensors keyed by the plain model's parameter names.

A parallelised model holds each projection weight as a 1/p shard, and an optimizer such as AdamW
keeps its state (``exp_avg``, ``exp_avg_sq``) on those shards. To make a checkpoint that any run can
resume from — another plan, another mode set, another number of processes — every state tensor of a
sharded parameter that is shaped like the parameter is gathered into the full tensor of the plain
parameter (:func:`lightning_paradyse.parallel.gather_param_like`; pieces of one packed plain
parameter, such as q/k/v of an ``in_proj_weight``, are concatenated in order), and on load each rank
cuts its own shard out of it again (:func:`~lightning_paradyse.parallel.shard_param_like`). Other
state (the ``step`` counter, the state of replicated parameters) is stored as it is. Entries are keyed
by the plain model's parameter names, the names of the consolidated model state dict.

Every function here that takes a group is a collective over it (all ranks call it, in the same order).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_paradyse import parallel
from lightning_paradyse.comm import Group

FORMAT = "paradyse-consolidated-optimizer-v1"
"""Marker of a consolidated optimizer state dict (``state_dict["format"]``)."""

Target = tuple[str, parallel.ShardRef | None]
"""(plain parameter name, shard reference or ``None`` for a replicated parameter)."""


def plain_targets(module: nn.Module) -> dict[str, Target]:
    """Each parameter's name in ``module`` -> its plain name and, when sharded, its shard reference."""
    shards = parallel.shard_sources(module)
    replicated = parallel.replicated_sources(module)
    out: dict[str, Target] = {}
    for name, _ in module.named_parameters():
        ref = shards.get(name)
        out[name] = (ref.plain, ref) if ref is not None else (replicated.get(name, name), None)
    return out


def parameter_names(optimizer: Optimizer, module: nn.Module) -> list[str]:
    """Name in ``module`` of each parameter of ``optimizer``, in the optimizer's (state dict) order."""
    by_id = {id(p): name for name, p in module.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in by_id:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not in the model; "
                    f"create optimizers from the LightningModule's parameters in configure_optimizers"
                )
            names.append(by_id[id(param)])
    return names


def _params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _plain_groups(optimizer: Optimizer, saved: Mapping[str, Any], plain: list[str]) -> list[dict[str, Any]]:
    groups = []
    for g in saved["param_groups"]:
        names = list(dict.fromkeys(plain[i] for i in g["params"]))  # packed pieces share one plain name
        groups.append({**g, "params": names})
    return groups


def consolidate_optimizer_state(optimizer: Optimizer, module: nn.Module, group: Group) -> dict[str, Any]:
    """The optimizer's state as full plain tensors keyed by plain parameter name (collective).

    Returns:
        ``{"format", "state": {plain: {key: value}}, "param_groups": [{..., "params": [plain, ...]}],
        "gathered": {plain: [key, ...]}}``, the same on every rank.
    """
    saved = optimizer.state_dict()
    targets = plain_targets(module)
    names = parameter_names(optimizer, module)
    plain = [targets[n][0] for n in names]
    state: dict[str, dict[str, Any]] = {}
    pieces: dict[str, dict[str, list[tuple[int, Tensor]]]] = {}
    for index, (name, param) in enumerate(zip(names, _params(optimizer))):
        entry = saved["state"].get(index)
        if entry is None:
            continue
        target, ref = targets[name]
        for key, value in entry.items():
            if ref is not None and isinstance(value, Tensor) and value.shape == param.shape:
                full = parallel.gather_param_like(value, ref, group)
                pieces.setdefault(target, {}).setdefault(key, []).append((ref.source.offset, full))
            else:
                state.setdefault(target, {}).setdefault(key, value)
    for target, by_key in pieces.items():
        for key, parts in by_key.items():
            ordered = [t for _, t in sorted(parts, key=lambda item: item[0])]
            state.setdefault(target, {})[key] = ordered[0] if len(ordered) == 1 else torch.cat(ordered)
    gathered = {target: sorted(by_key) for target, by_key in pieces.items()}
    return {
        "format": FORMAT,
        "state": state,
        "param_groups": _plain_groups(optimizer, saved, plain),
        "gathered": gathered,
    }


def load_optimizer_state(optimizer: Optimizer, module: nn.Module, saved: Mapping[str, Any], group: Group) -> None:
    """Load a state from :func:`consolidate_optimizer_state` (or a plain optimizer state dict) (collective)."""
    if saved.get("format") != FORMAT:
        optimizer.load_state_dict(dict(saved))
        return
    targets = plain_targets(module)
    names = parameter_names(optimizer, module)
    _check_groups(optimizer, saved, [targets[n][0] for n in names])
    state: dict[int, dict[str, Any]] = {}
    for index, (name, param) in enumerate(zip(names, _params(optimizer))):  # same order on every rank
        target, ref = targets[name]
        entry = saved["state"].get(target)
        if entry is None:
            continue
        sharded = set(saved["gathered"].get(target, ()))
        state[index] = {k: _local(v, ref, group, param) if k in sharded else v for k, v in entry.items()}
    groups, at = [], 0
    for current, stored in zip(optimizer.param_groups, saved["param_groups"]):
        groups.append({**stored, "params": list(range(at, at + len(current["params"])))})
        at += len(current["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _check_groups(optimizer: Optimizer, saved: Mapping[str, Any], plain: list[str]) -> None:
    at, mismatch = 0, []
    stored_groups = saved["param_groups"]
    if len(stored_groups) != len(optimizer.param_groups):
        mismatch.append(f"{len(stored_groups)} parameter groups saved, {len(optimizer.param_groups)} now")
    for current, stored in zip(optimizer.param_groups, stored_groups):
        names = set(plain[at : at + len(current["params"])])
        at += len(current["params"])
        mismatch += sorted(names ^ set(stored["params"]))
    if mismatch:
        raise ValueError(
            f"the checkpoint's optimizer state does not match the optimizer (differences: {mismatch[:5]}"
            f"{' ...' if len(mismatch) > 5 else ''}); resume with the same model and configure_optimizers"
        )


def _local(full: Tensor, ref: parallel.ShardRef | None, group: Group, param: Tensor) -> Tensor:
    """This rank's shard of a gathered state tensor (mirrors :func:`parallel.load_consolidated`)."""
    if ref is None:
        raise ValueError("the checkpoint holds gathered optimizer state for a parameter that is not sharded here")
    src = ref.source
    piece = full if src.transposed else full.narrow(0, src.offset, src.rows)
    shard = parallel.shard_param_like(piece.to(param.device), ref, group)
    if shard.shape != param.shape:
        raise ValueError(
            f"optimizer state shard {tuple(shard.shape)} does not match the parameter {tuple(param.shape)}"
        )
    return shard.clone()


__all__ = ["FORMAT", "consolidate_optimizer_state", "load_optimizer_state", "parameter_names", "plain_targets"]
