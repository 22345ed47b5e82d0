"""Checkpoints in the plain model's format, both ways: what a single-process Lightning run saves and loads.

A parallelised model holds each projection weight as a 1/p shard, its rewritten blocks list their parameters in
another order than the plain blocks (an MLP's ``up`` before its ``gate``), and tied parameters (an LM head
sharing the token embedding) appear once in ``named_parameters`` but under every name in ``state_dict``. So
that any run can resume from our checkpoints, and we from any plain one, they hold exactly what the plain model
would have saved:

* the model state dict: every key of the plain model's ``state_dict()``, tied names included, in its order
  (:meth:`PlainModel.state_dict`, from :func:`lightning_paradyse.runtime.parallel.consolidated`);
* each optimizer's state in the format of ``Optimizer.state_dict()``: parameters numbered in the order an
  optimizer built by the same ``configure_optimizers`` over the plain module lists them (within each param
  group, the plain module's parameter order), every state tensor of a sharded parameter that is shaped like
  the shard gathered into the full tensor of the plain parameter
  (:func:`~lightning_paradyse.runtime.parallel.gather_param_like`; pieces of one packed plain parameter, such as q/k/v
  of an ``in_proj_weight``, concatenated in order). Other state (the ``step`` counter, the state of
  replicated parameters) is stored as it is.

On load every state tensor shaped like the plain parameter is cut into this rank's shard again
(:func:`~lightning_paradyse.runtime.parallel.shard_param_like`, as
:func:`~lightning_paradyse.runtime.parallel.load_consolidated`
does for the weights), whatever the number of processes or the plan that saved it. The format of earlier
versions (``paradyse-consolidated-optimizer-v1``, keyed by plain parameter name) is still read.

What the plain model looks like (parameter order, shapes, state dict keys, tied names) is recorded once, before
the rewrite, in a :class:`PlainModel` the strategy keeps. Every function here that takes a group is a collective
over it (all ranks call it, in the same order).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_paradyse.distributed.comm import Group, all_gather_rows, collective_device, group_size, no_counting
from lightning_paradyse.graph.dispatch import ShardSource, join_pieces
from lightning_paradyse.runtime import parallel

LEGACY_FORMAT = "paradyse-consolidated-optimizer-v1"
"""Marker of the optimizer state of earlier versions (``state_dict["format"]``), keyed by plain parameter name."""

Target = tuple[str, parallel.ShardRef | None]
"""(plain parameter name, shard reference or ``None`` for a replicated parameter)."""


@dataclass(frozen=True)
class PlainModel:
    """What checkpoints need to know about the plain (unparallelised) model, recorded before the rewrite."""

    positions: Mapping[str, int]
    """Parameter name -> its index in ``named_parameters()`` (a tied parameter under its first name)."""
    shapes: Mapping[str, torch.Size]
    """Shape of each parameter of :attr:`positions`."""
    state_keys: tuple[str, ...]
    """The keys of ``state_dict()``, in order."""
    aliases: Mapping[str, str]
    """Every other name of a tied parameter -> its name in :attr:`positions`."""

    @classmethod
    def record(cls, module: nn.Module) -> PlainModel:
        """Record ``module`` (call before it is parallelised)."""
        named = list(module.named_parameters())
        return cls(
            positions={n: i for i, (n, _) in enumerate(named)},
            shapes={n: p.shape for n, p in named},
            state_keys=tuple(module.state_dict(keep_vars=True)),
            aliases=parallel.tied_aliases(module),
        )

    def position(self, name: str) -> int:
        """Index of parameter ``name`` in the plain model's parameter order."""
        if name not in self.positions:
            raise ValueError(f"{name!r} is not a parameter of the plain model")
        return self.positions[name]

    def state_dict(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``state`` (a consolidated state dict) with the plain model's keys in its order (tied names filled in)."""
        out: dict[str, Tensor] = {}
        for key in self.state_keys:
            source = key if key in state else self.aliases.get(key, key)
            if source not in state:
                raise KeyError(f"the consolidated state dict lacks {key!r}, a key of the plain model's state dict")
            out[key] = state[source]
        return out


def recorded(plain: PlainModel | None) -> PlainModel:
    """``plain``, or an error saying why the optimizer state cannot be converted without it."""
    if plain is None:
        raise RuntimeError(
            "the plain model was not recorded: this ParaDySeStrategy did not parallelise the module itself (it was "
            "rewritten by another one); save and resume checkpoints with the strategy that set the module up"
        )
    return plain


# ---------------------------------------------------------------------------------------------- names and order


def plain_targets(module: nn.Module, plain: PlainModel) -> dict[str, Target]:
    """Each parameter's name in the parallelised ``module`` -> its plain name and, when sharded, its shard."""
    shards = parallel.shard_sources(module)
    replicated = parallel.replicated_sources(module)
    out: dict[str, Target] = {}
    for name, _ in module.named_parameters():
        ref = shards.get(name)
        target = ref.plain if ref is not None else replicated.get(name, name)
        out[name] = (plain.aliases.get(target, target), ref)
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


def plain_order(
    optimizer: Optimizer, names: list[str], targets: Mapping[str, Target], plain: PlainModel, module: nn.Module
) -> list[list[str]]:
    """Per param group, the plain parameters a plain optimizer would list, in the order it would list them.

    The optimizer's own order is kept (a ``configure_optimizers`` may list parameters in any order), except inside
    one rewritten op: its pieces (``q, k, v, o`` of a dispatch module and the sub-modules it adopted) sit together
    in the parallel module and are put in the plain module's order (an MLP's ``gate`` before ``up``, ``q_norm``
    before ``k_norm``), as iterating the plain module lists them.
    """
    order: list[list[str]] = []
    seen: set[str] = set()
    at = 0
    for group in optimizer.param_groups:
        mine = names[at : at + len(group["params"])]
        at += len(group["params"])
        ordered = plain_names(mine, targets, plain, module)
        twice = seen.intersection(ordered)
        if twice:
            raise ValueError(
                f"pieces of the plain parameter(s) {sorted(twice)} are in different optimizer param groups; "
                f"put every parameter of one plain weight in the same group"
            )
        seen.update(ordered)
        order.append(ordered)
    return order


def plain_names(names: Sequence[str], targets: Mapping[str, Target], plain: PlainModel, module: nn.Module) -> list[str]:
    """The plain parameters behind the parallelised ``module``'s parameters ``names`` (a list a plain optimizer
    would hold), each once, in the order :func:`plain_order` explains; a name that is no parameter of ``module`` is
    kept as it is."""
    ops = {path for path, _ in parallel.dispatchers(module)}
    ordered: list[str] = []
    for _, run in itertools.groupby(names, key=lambda n: _op_of(n, ops)):
        pieces = dict.fromkeys(targets[n][0] if n in targets else n for n in run)  # pieces of one plain weight: once
        ordered += sorted(pieces, key=plain.position) if len(pieces) > 1 else list(pieces)
    return list(dict.fromkeys(ordered))


def parallel_names(names: Sequence[str], targets: Mapping[str, Target]) -> list[str]:
    """The inverse of :func:`plain_names`: the parallelised module's parameters behind the plain parameters ``names``
    (every shard of each, in the module's order); a name that is no plain parameter is kept as it is."""
    behind: dict[str, list[str]] = {}
    for name, (target, _) in targets.items():
        behind.setdefault(target, []).append(name)
    return [mine for name in names for mine in behind.get(name, [name])]


def _op_of(name: str, ops: set[str]) -> str:
    """The rewritten op a parameter belongs to (its own shards, or a sub-module of the block it adopted: Qwen3's
    ``q_norm`` and ``k_norm``, which it lists in the order its code calls them), or the parameter itself (its own
    run)."""
    parts = name.split(".")
    return next((op for i in range(len(parts) - 1, 0, -1) if (op := ".".join(parts[:i])) in ops), name)


def _params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


# ---------------------------------------------------------------------------------------------- saving


def consolidate_optimizer_state(
    optimizer: Optimizer, module: nn.Module, plain: PlainModel, group: Group, host: bool = False
) -> dict[str, Any]:
    """What ``optimizer.state_dict()`` of the plain model's optimizer would be (collective; the same on every rank).
    ``host``: every tensor on the host, each gathered piece moved there as soon as it is gathered.

    Returns:
        ``{"state": {index: {key: value}}, "param_groups": [{..., "params": [index, ...]}]}`` with full tensors,
        indices numbered in :func:`plain_order`.
    """
    saved = optimizer.state_dict()
    targets = plain_targets(module, plain)
    names = parameter_names(optimizer, module)
    order = plain_order(optimizer, names, targets, plain, module)
    index = {name: i for i, name in enumerate(n for names_ in order for n in names_)}
    _check_state_everywhere(saved["state"], names, targets, group)
    entries: dict[str, dict[str, Any]] = {}  # plain name -> key -> value, or the gathered pieces
    for i, (name, param) in enumerate(zip(names, _params(optimizer))):  # the same order on every rank
        entry = saved["state"].get(i)
        if entry is None:
            continue
        target, ref = targets[name]
        out = entries.setdefault(target, {})
        for key, value in entry.items():
            if ref is not None and _shard_shaped(value, param, key, target):
                full = parallel.gather_param_like(value, ref, group)
                out.setdefault(key, _Pieces()).append((ref.source, full.cpu() if host else full))
            else:
                out.setdefault(key, value.cpu() if host and isinstance(value, Tensor) else value)
    state = {index[t]: {k: v.join() if isinstance(v, _Pieces) else v for k, v in e.items()} for t, e in entries.items()}
    groups = [_plain_group(g, [index[n] for n in names_], names_) for g, names_ in zip(saved["param_groups"], order)]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def _plain_group(group: Mapping[str, Any], params: list[int], names: list[str]) -> dict[str, Any]:
    """A param group of the plain optimizer's state dict: its parameters' indices, and its ``param_names`` (an
    optimizer built from ``named_parameters()``) the plain names, in the same order."""
    out = {**group, "params": params}
    if "param_names" in group:
        out["param_names"] = list(names)
    return out


def _check_state_everywhere(
    state: Mapping[int, Any], names: list[str], targets: Mapping[str, Target], group: Group
) -> None:
    """Every rank holds optimizer state for the same sharded parameters, each of which the consolidation gathers in
    a collective: one all-gather of the flags, so that a rank without one raises, naming it, on every rank, where
    the gathers would hang or mix up their messages."""
    sharded = [i for i, name in enumerate(names) if targets[name][1] is not None]
    p = group_size(group)
    if p == 1 or not sharded:
        return
    flags = torch.tensor([float(i in state) for i in sharded], dtype=torch.float64, device=collective_device(group))
    with no_counting():  # control flags, not mode traffic
        every = all_gather_rows(flags, [len(sharded)] * p, group).view(p, -1).cpu()  # [n] -> [p, n]
    split = [i for i, column in zip(sharded, every.t()) if 0 < float(column.sum()) < p]
    if split:
        name = names[split[0]]
        holders = [r for r in range(p) if float(every[r, sharded.index(split[0])]) > 0]
        raise RuntimeError(
            f"the optimizer holds state for the shard of {targets[name][0]} on ranks {holders} only (and for "
            f"{len(split) - 1} more such parameters): the checkpoint cannot be consolidated. A step that leaves a "
            f"parameter without a gradient must do so on every rank (manual optimization: set gradients to None "
            f"alike everywhere); otherwise this is a bug of ParaDySeStrategy, please report it"
        )


class _Pieces(list[tuple[ShardSource, Tensor]]):
    """Gathered pieces of one plain parameter's state tensor, with where each comes from."""

    def join(self) -> Tensor:
        return join_pieces(list(self))


def _shard_shaped(value: Any, param: Tensor, key: str, target: str) -> bool:
    """Whether a sharded parameter's state ``value`` is shaped like it (else it must be a scalar: kept as is)."""
    if not isinstance(value, Tensor) or value.dim() == 0:
        return False
    if value.shape != param.shape:
        raise ValueError(
            f"the optimizer state {key!r} of {target} has shape {tuple(value.shape)}, neither the shard's "
            f"{tuple(param.shape)} nor a scalar: it cannot be consolidated exactly (use an optimizer whose state "
            f"is element-wise, such as Adam, AdamW or SGD)"
        )
    return True


# ---------------------------------------------------------------------------------------------- loading


def load_optimizer_state(
    optimizer: Optimizer, module: nn.Module, plain: PlainModel, saved: Mapping[str, Any], group: Group
) -> None:
    """Load a plain optimizer state dict (a single-process run's, or ours) into the shards (collective)."""
    if saved.get("format") == LEGACY_FORMAT:
        saved = _from_legacy(saved, plain)
    targets = plain_targets(module, plain)
    names = parameter_names(optimizer, module)
    order = plain_order(optimizer, names, targets, plain, module)
    _check_groups(saved, order)
    index = {name: i for i, name in enumerate(n for names_ in order for n in names_)}
    state: dict[int, dict[str, Any]] = {}
    for i, (name, param) in enumerate(zip(names, _params(optimizer))):  # the same order on every rank
        target, ref = targets[name]
        entry = saved["state"].get(index[target])
        if entry is not None:
            shape = plain.shapes[target]
            state[i] = {k: _local(v, ref, shape, param, group, f"{k!r} of {target}") for k, v in entry.items()}
    groups, at = [], 0
    for current, stored in zip(optimizer.param_groups, saved["param_groups"]):
        kept = {k: v for k, v in stored.items() if k != "param_names"}  # the plain names: this optimizer keeps its own
        groups.append({**kept, "params": list(range(at, at + len(current["params"])))})
        at += len(current["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _from_legacy(saved: Mapping[str, Any], plain: PlainModel) -> dict[str, Any]:
    """A ``paradyse-consolidated-optimizer-v1`` state (keyed by plain name) in the plain format."""
    state: dict[int, Any] = {}
    groups, at = [], 0
    for stored in saved["param_groups"]:
        names = sorted(stored["params"], key=plain.position)
        state.update({at + i: saved["state"][n] for i, n in enumerate(names) if n in saved["state"]})
        groups.append({**stored, "params": list(range(at, at + len(names)))})
        at += len(names)
    return {"state": state, "param_groups": groups}


def _check_groups(saved: Mapping[str, Any], order: list[list[str]]) -> None:
    stored = [len(g["params"]) for g in saved["param_groups"]]
    current = [len(names) for names in order]
    if stored != current:
        raise ValueError(
            f"the checkpoint's optimizer state does not match the optimizer: its param groups hold {stored} "
            f"parameters, the plain model's optimizer would hold {current}; resume with the same model and "
            f"configure_optimizers"
        )


def _local(value: Any, ref: parallel.ShardRef | None, shape: torch.Size, param: Tensor, group: Group, what: str) -> Any:
    """This rank's part of a plain state value: for a sharded parameter, the shard of a tensor shaped like it; a scalar
    of its own (the pieces of one fused plain weight, q, k and v of GPT-2's ``c_attn``, must not share the ``step``
    tensor Adam increments in place: it would count each step once per piece)."""
    if not isinstance(value, Tensor):
        return value
    if value.dim() == 0:
        return value.clone()
    if ref is None:
        return value
    if value.shape != shape:
        raise ValueError(
            f"the checkpoint's optimizer state {what} has shape {tuple(value.shape)}, neither the plain parameter's "
            f"{tuple(shape)} nor a scalar; resume with the same model and configure_optimizers"
        )
    shard = parallel.shard_param_like(value, ref, group).to(param.device)  # cut where it lies; only the shard moves
    if shard.shape != param.shape:
        raise ValueError(
            f"optimizer state shard {tuple(shard.shape)} does not match the parameter {tuple(param.shape)}"
        )
    return shard.clone()


__all__ = [
    "LEGACY_FORMAT",
    "PlainModel",
    "consolidate_optimizer_state",
    "load_optimizer_state",
    "parallel_names",
    "parameter_names",
    "plain_names",
    "plain_order",
    "plain_targets",
    "recorded",
]
