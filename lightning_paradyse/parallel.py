"""Apply the unified layout to a model and run it per batch: the API the strategy is built on.

The model never knows it is parallel. In one documented order:

1. :func:`parallelize` (once, at setup): find the transformer blocks (:func:`find_blocks`), rewrite
   each in place (:func:`~lightning_paradyse.graph.rewrite.rewrite_block`: trace, find roles,
   verify, install dispatch modules holding 1/p shards), and install forward pre-hooks that give
   the model the global positions of its local tokens (and, for Hugging Face models trained with
   ``labels``, the globally shifted labels and the global token count).
2. :func:`configure` (every batch): the batch's layout and plan, a table look-up on every dispatch
   module; :func:`set_step_targets` for label-shifting models.
3. forward / backward on the local tokens, then :func:`reduce_replicated_grads` (norms, embeddings,
   head and the output biases are replicated; their gradients are summed over the group).

:func:`consolidated` / :func:`load_consolidated` convert between the shards and the plain model's
state dict, so checkpoints load into the unparallelized model.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from lightning_paradyse.comm import Group, all_gather_rows, all_reduce_sum, group_rank, group_size, move_shard
from lightning_paradyse.dispatch import AttentionDispatch, GridState, OpDispatch, ShardSource
from lightning_paradyse.graph.passes import RoleError
from lightning_paradyse.graph.rewrite import rewrite_block
from lightning_paradyse.layout import split_sizes
from lightning_paradyse.plan import Plan
from lightning_paradyse.spec import SeqContext, row_sizes, shard_rows

_STATE_ATTR = "_paradyse_state"


@dataclass
class StepState:
    """What the forward pre-hooks read during one step."""

    ctx: SeqContext | None = None
    shift_labels: torch.Tensor | None = None
    """This rank's slice of the globally shifted labels (label-shifting models), or ``None``."""
    num_items: int | None = None
    """Global number of real (non-ignored) shifted labels."""
    labels_consumed: bool = False
    """Whether a model consumed ``labels`` through the hook this step (its loss is then a global sum share)."""
    blocks: list[str] = field(default_factory=list)
    grid: GridState | None = None
    """Grid models (``axes=2``): which grid dimension is sharded now (see :mod:`lightning_paradyse.modes.dsp`)."""


def step_state(module: nn.Module) -> StepState:
    """The :class:`StepState` of a parallelized module."""
    state = getattr(module, _STATE_ATTR, None)
    if not isinstance(state, StepState):
        raise RuntimeError("the module has not been parallelized (call lightning_paradyse.parallel.parallelize)")
    return state


# --------------------------------------------------------------------------------------------------
# Finding and rewriting the blocks
# --------------------------------------------------------------------------------------------------


def _looks_like_block(module: nn.Module) -> bool:
    mods = list(module.modules())
    if any(isinstance(m, nn.MultiheadAttention) for m in mods):
        return True
    return sum(isinstance(m, nn.Linear) for m in mods) >= 4 and any(
        "attn" in n.lower() or "attention" in n.lower() for n, _ in module.named_modules()
    )


def find_blocks(module: nn.Module, blocks: str | None = None) -> list[tuple[str, nn.Module]]:
    """The transformer blocks inside ``module`` as ``(name, block)``, in order.

    With ``blocks`` (a dotted path to an ``nn.ModuleList``) that list; otherwise the one ModuleList
    whose children all look like transformer blocks (an attention and at least four linears).
    """
    if blocks is not None:
        try:
            found = module.get_submodule(blocks)
        except AttributeError:
            raise ValueError(f"blocks={blocks!r}: no such sub-module") from None
        if not isinstance(found, nn.ModuleList) or len(found) == 0:
            raise ValueError(f"blocks={blocks!r} must name a non-empty nn.ModuleList of transformer blocks")
        return [(f"{blocks}.{i}", b) for i, b in enumerate(found)]
    candidates = [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and all(_looks_like_block(b) for b in m)
    ]
    outer = [(n, m) for n, m in candidates if not any(n.startswith(o + ".") for o, _ in candidates if o != n)]
    if not outer:
        raise ValueError(
            f"no list of transformer blocks found in {type(module).__name__}; pass blocks='path.to.layers'"
        )
    if len(outer) > 1:
        names = ", ".join(n for n, _ in outer)
        raise ValueError(f"several lists of transformer blocks found ({names}); choose one with blocks='...'")
    name, found = outer[0]
    return [(f"{name}.{i}", b) for i, b in enumerate(found)]


def parallelize(module: nn.Module, group: Group, blocks: str | None = None, axes: int = 1) -> list[str]:
    """Rewrite every transformer block of ``module`` in place (see the module docstring).

    ``axes``: sequence axes of the hidden states between blocks: 1 for ``[b, s, h]`` (language models), 2 for a
    grid ``[b, T, S, h]`` whose blocks attend along one axis each (frames x patches); the batch is then split
    along ``T`` and the ``dsp`` mode can move the shard between the axes (:func:`_install_grid_hooks`).

    Returns the block names. Raises ``ValueError`` naming the block and the missing role when a block
    cannot be understood; nothing is ever run unparallelized silently.
    """
    if getattr(module, _STATE_ATTR, None) is not None:
        raise RuntimeError("the module is already parallelized")
    if axes not in (1, 2):
        raise ValueError(f"axes={axes!r}: 1 (a sequence, [b, s, h]) or 2 (a grid, [b, T, S, h]) are supported")
    found = find_blocks(module, blocks)
    state = StepState(blocks=[n for n, _ in found], grid=GridState() if axes == 2 else None)
    for layer, (name, block) in enumerate(found):
        try:
            ops = rewrite_block(block, name, layer, group, axes)
        except RoleError as err:
            raise ValueError(str(err)) from None
        for op in ops:
            op.grid = state.grid
    object.__setattr__(module, _STATE_ATTR, state)
    _install_hooks(module, [n for n, _ in found], state)
    if state.grid is not None:
        _install_grid_hooks([b for _, b in found], state)
    return state.blocks


def _install_grid_hooks(found: list[nn.Module], state: StepState) -> None:
    """Dimension switching: before a block whose attention runs ``dsp`` along the sharded grid axis, one
    all-to-all moves the shard to the other axis; after the last block the shard returns to the frames
    (dim 1), the layout the batch was split in.

    The hooks read the step state from the block they are called on (deep copies stay independent), so
    every rank switches at the same blocks.
    """
    for block in found:
        object.__setattr__(block, _STATE_ATTR, state)
        block.register_forward_pre_hook(_grid_before)
    object.__setattr__(found[0], "_paradyse_first_block", True)
    found[-1].register_forward_hook(_grid_after)


def _grid_before(block: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    state = step_state(block)
    grid, ctx = state.grid, state.ctx
    if grid is None or ctx is None:
        raise RuntimeError("the grid model ran before lightning_paradyse.parallel.configure() set its layout and plan")
    attn = next(m for m in block.modules() if isinstance(m, AttentionDispatch))
    x = args[0]
    if getattr(block, "_paradyse_first_block", False):
        grid.lengths[2] = int(x.shape[2])  # [b, T/p, S, h]: the patches are whole at the first block
    if attn.op_plan is not None and attn.op_plan.mode == "dsp" and attn.attend_axis == grid.sharded:
        src, dst = grid.sharded, grid.other()
        x = move_shard(x, src, dst, split_sizes(grid.lengths[src], ctx.p), ctx.group)  # [.., n/p, .., m, ..]
        grid.sharded = dst  # -> [.., n, .., m/p, ..]
    return (x, *args[1:])


def _grid_after(block: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    state = step_state(block)
    grid, ctx = state.grid, state.ctx
    assert grid is not None and ctx is not None
    if grid.sharded == 1:
        return out
    src = grid.sharded
    out = move_shard(out, src, 1, split_sizes(grid.lengths[src], ctx.p), ctx.group)  # back to [b, T/p, S, h]
    grid.sharded = 1
    return out


def feasible_modes(module: nn.Module, p: int, modes: list[str]) -> list[tuple[list[str], list[str]]]:
    """Per layer, the modes among ``modes`` that can run its attention and its MLP on ``p`` ranks."""
    out: list[tuple[list[str], list[str]]] = [(list(modes), list(modes)) for _ in range(n_layers(module))]
    for _, op in dispatchers(module):
        allowed = out[op.layer][0 if isinstance(op, AttentionDispatch) else 1]
        allowed[:] = [m for m in allowed if op.infeasible(m, p) is None]
    return out


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or (any(p.kind is p.VAR_KEYWORD for p in params.values()) and name == "shift_labels")


def _install_hooks(module: nn.Module, block_names: list[str], state: StepState) -> None:
    """Positions for the module that owns the blocks (or its nearest ancestor accepting them); labels for HF.

    The hooks read the step state from the module they are called on, so deep copies stay independent.
    """
    owner_path = block_names[0].rsplit(".", 2)[0] if block_names[0].count(".") >= 2 else ""
    chain = [owner_path]
    while chain[-1]:
        chain.append(chain[-1].rsplit(".", 1)[0] if "." in chain[-1] else "")
    for path in chain:
        owner = module.get_submodule(path) if path else module
        arg = next((a for a in ("positions", "position_ids") if _accepts(owner.forward, a)), None)
        if arg is not None:
            object.__setattr__(owner, _STATE_ATTR, state)
            owner.register_forward_pre_hook(_position_hook(arg), with_kwargs=True)
            break
    for path in chain:
        owner = module.get_submodule(path) if path else module
        if _accepts(owner.forward, "labels") and _accepts(owner.forward, "shift_labels"):
            object.__setattr__(owner, _STATE_ATTR, state)
            owner.register_forward_pre_hook(_labels_hook, with_kwargs=True)


def _position_hook(arg: str) -> Any:
    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ctx = step_state(mod).ctx
        params = list(inspect.signature(mod.forward).parameters)
        given = kwargs.get(arg) is not None or (arg in params and params.index(arg) < len(args))
        if ctx is None or given:
            return args, kwargs
        positions = ctx.positions(_device_of(args, kwargs))  # [s_r] global positions of the local tokens
        kwargs[arg] = positions if arg == "positions" else positions[None]  # position_ids: [1, s_r]
        return args, kwargs

    return hook


def _labels_hook(
    mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    state = step_state(mod)
    if kwargs.get("labels") is None or state.shift_labels is None or "shift_labels" in kwargs:
        return args, kwargs
    kwargs["shift_labels"] = state.shift_labels
    kwargs["num_items_in_batch"] = torch.tensor(max(int(state.num_items or 0), 1))
    state.labels_consumed = True
    return args, kwargs


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


# --------------------------------------------------------------------------------------------------
# Per batch
# --------------------------------------------------------------------------------------------------


def dispatchers(module: nn.Module) -> list[tuple[str, OpDispatch]]:
    """Every dispatch module with its name, in model order."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, OpDispatch)]


def n_layers(module: nn.Module) -> int:
    """Number of rewritten blocks."""
    return len(step_state(module).blocks)


def is_causal(module: nn.Module) -> bool:
    """Whether any block is (or may be, when decided per call) causal: the balanced layout is then used."""
    attn = [m for _, m in dispatchers(module) if isinstance(m, AttentionDispatch)]
    return any(m.roles.causal is None or m.roles.causal for m in attn)


def check_plan(module: nn.Module, plan: Plan, p: int) -> None:
    """Raise a ``ValueError`` (before any collective) if ``plan`` does not fit the model or the group."""
    layers = n_layers(module)
    if len(plan) != layers:
        raise ValueError(f"the plan has {len(plan)} layers but the model has {layers} blocks")
    for _, op in dispatchers(module):
        layer = plan.layers[op.layer]
        mode = layer.attention.mode if isinstance(op, AttentionDispatch) else layer.mlp.mode
        reason = op.infeasible(mode, p)
        if reason:
            raise ValueError(f"layer {op.layer}: {reason}; choose another mode for this layer")


def configure(module: nn.Module, ctx: SeqContext, plan: Plan) -> None:
    """Set the batch's layout and plan on every dispatch module (after :func:`check_plan`)."""
    check_plan(module, plan, ctx.p)
    state = step_state(module)
    state.ctx, state.shift_labels, state.num_items, state.labels_consumed = ctx, None, None, False
    if state.grid is not None:
        if ctx.layout.balanced or ctx.doc_ids is not None:
            raise ValueError(
                "a grid model (axes=2) splits its frames in contiguous chunks and takes no packed documents: use "
                "bidirectional attention (no causal mask) and one sequence of frames per batch row"
            )
        state.grid.sharded, state.grid.lengths = 1, {1: ctx.layout.seq_len}
    for _, op in dispatchers(module):
        layer = plan.layers[op.layer]
        op.configure(ctx, layer.attention if isinstance(op, AttentionDispatch) else layer.mlp)


def set_step_targets(module: nn.Module, shift_labels: torch.Tensor | None, num_items: int | None) -> None:
    """For label-shifting models: this rank's slice of the globally shifted labels and their global count."""
    state = step_state(module)
    state.shift_labels, state.num_items, state.labels_consumed = shift_labels, num_items, False


# --------------------------------------------------------------------------------------------------
# Gradients and state
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardRef:
    """How a sharded parameter relates to the plain model."""

    plain: str
    """Name of the plain parameter in the module."""
    source: ShardSource


def shard_sources(module: nn.Module) -> dict[str, ShardRef]:
    """Every sharded parameter's name in ``module`` -> its plain parameter and piece."""
    out: dict[str, ShardRef] = {}
    for path, op in dispatchers(module):
        block = path[: len(path) - len(op.core_path)]
        for pname, src in op.sources.items():
            out[f"{path}.{pname}"] = ShardRef(block + src.name, src)
    return out


def replicated_sources(module: nn.Module) -> dict[str, str]:
    """Every replicated dispatch parameter (output biases) name in ``module`` -> its plain parameter name."""
    out: dict[str, str] = {}
    for path, op in dispatchers(module):
        block = path[: len(path) - len(op.core_path)]
        for pname, name in op.replicated_sources.items():
            out[f"{path}.{pname}"] = block + name
    return out


def replicated_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters every rank holds whole (their gradients are summed over the group)."""
    sharded = set(shard_sources(module))
    return (p for n, p in module.named_parameters() if n not in sharded)


def reduce_replicated_grads(module: nn.Module, group: Group) -> None:
    """Sum the gradients of replicated parameters over the group, in one coalesced all-reduce.

    A gradient missing on some ranks (a rank that ran no forward, e.g. an idle group of
    :mod:`lightning_paradyse.groups`) counts as zero there; one missing on every rank stays ``None``. Every
    rank sends the same-sized message, whatever gradients it holds.
    """
    params = [w for w in replicated_parameters(module) if w.requires_grad]
    if group_size(group) == 1 or not params:
        return
    with torch.no_grad():
        present = torch.tensor([w.grad is not None for w in params], dtype=params[0].dtype)
        grads = [w.grad.reshape(-1) if w.grad is not None else w.new_zeros(w.numel()) for w in params]
        total = all_reduce_sum(torch.cat([*grads, present]), group)  # one call: gradients, then presence flags
    at = 0
    for w, seen in zip(params, total[-len(params) :].tolist()):
        n = w.numel()
        if seen:
            w.grad = total[at : at + n].view_as(w).clone()
        at += n


def gather_param_like(value: torch.Tensor, ref: ShardRef, group: Group) -> torch.Tensor:
    """The whole (un-transposed) piece behind a shard, from every rank's ``value`` shaped like the shard."""
    full = all_gather_rows(value, row_sizes(ref.source.rows, group_size(group)), group)  # [rows/p, k] -> [rows, k]
    return full.t().contiguous() if ref.source.transposed else full


def shard_param_like(full: torch.Tensor, ref: ShardRef, group: Group) -> torch.Tensor:
    """This rank's shard of a whole (plain-layout) piece: the inverse of :func:`gather_param_like`."""
    data = full.t() if ref.source.transposed else full
    return shard_rows(data, group_size(group), group_rank(group))


def _value(param: torch.Tensor, grads: bool) -> torch.Tensor | None:
    return param.grad if grads else param.detach()


def consolidated(module: nn.Module, group: Group, grads: bool = False) -> dict[str, torch.Tensor]:
    """The plain model's state dict (or gradients) from a parallelized module, on every rank.

    Names are relative to ``module``; the result loads into the unparallelized module with
    ``load_state_dict`` (buffers included when ``grads`` is false).
    """
    out: dict[str, torch.Tensor] = {}
    shards, replicated = shard_sources(module), replicated_sources(module)
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, param in module.named_parameters():
        value = _value(param, grads)
        if name in shards:
            ref = shards[name]
            piece = gather_param_like(value, ref, group) if value is not None else None
            if piece is not None:
                pieces.setdefault(ref.plain, []).append((ref.source.offset, piece))
        elif value is not None:
            out[replicated.get(name, name)] = value
    for plain, parts in pieces.items():
        out[plain] = torch.cat([t for _, t in sorted(parts, key=lambda item: item[0])])
    if not grads:
        persistent = set(module.state_dict(keep_vars=True))
        out.update({n: b.detach() for n, b in module.named_buffers() if n in persistent})
    return out


def load_consolidated(module: nn.Module, state: dict[str, torch.Tensor], group: Group, strict: bool = True) -> None:
    """Load a plain state dict (as :func:`consolidated` returns) into the shards of a parallelized module."""
    shards, replicated = shard_sources(module), replicated_sources(module)
    used: set[str] = set()
    missing: list[str] = []
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name in shards:
                ref = shards[name]
                key = ref.plain
                if key not in state:
                    missing.append(key)
                    continue
                src = ref.source
                piece = state[key] if src.transposed else state[key].narrow(0, src.offset, src.rows)
                param.copy_(shard_param_like(piece, ref, group))
            else:
                key = replicated.get(name, name)
                if key not in state:
                    missing.append(key)
                    continue
                param.copy_(state[key])
            used.add(key)
        for name, buf in module.named_buffers():
            if name in state:
                buf.copy_(state[name])
                used.add(name)
    unexpected = sorted(set(state) - used)
    if strict and (missing or unexpected):
        raise KeyError(f"state dict does not match the model: missing {sorted(set(missing))}, unexpected {unexpected}")
