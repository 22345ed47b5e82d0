"""Rewrite one transformer block in place into its multi-variant form.

The order is fixed and each step is a small function:

1. :func:`example_inputs`: build inputs for the block from its signature (hidden states, positions,
   position ids, rotary ``(cos, sin)``); a required argument it cannot build is an error naming it.
2. :func:`~lightning_paradyse.graph.trace.trace_block`: run the block once and record its data flow.
3. :func:`~lightning_paradyse.graph.passes.find_attention` / :func:`~.find_mlp`: find the roles.
   :func:`probe_program`: what the block's own code between the projections and the attention may be given
   (:func:`~lightning_paradyse.graph.program.probe`).
Steps 2-4 run on a copy of the block on the host, in float64 (float32 where its kernels have no float64), made
tensor by tensor (:func:`host_copy`): a GPU never holds a second copy, and nothing made during the checks meets the
block's device (the replayed code's constants move to it on first use, :meth:`~.program.Program.constant`).

4. :func:`verify`: on a copy, install the dispatch modules for a group of one and check that
   every mode reproduces the block's own output on the example (a block we misunderstood is
   rejected here, never run wrongly).
5. :func:`install`: replace the attention and MLP sub-modules by dispatch modules holding this rank's
   1/p shards (the unified layout). The old full weights are dropped.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from lightning_paradyse.distributed.comm import Group
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.graph.adapters import lora_parts
from lightning_paradyse.graph.dispatch import (
    AttentionDispatch,
    ColumnDispatch,
    MlpDispatch,
    OpaqueDispatch,
    OpDispatch,
    RowDispatch,
    SliceLengthError,
)
from lightning_paradyse.graph.passes import SOFTMAX, RoleError, find_attention, find_mlp
from lightning_paradyse.graph.program import PROBE_TOKENS, ProgramError, probe, probe_tail, tolerance
from lightning_paradyse.graph.roles import AttentionRoles, MlpRoles, is_projection, projection_weight
from lightning_paradyse.graph.trace import trace_block
from lightning_paradyse.modes import GRID_MODES, MODES
from lightning_paradyse.modes.dsp import GridState
from lightning_paradyse.modes.plan import OpPlan
from lightning_paradyse.modes.specs import SeqContext

EXAMPLE_LEN = 7
"""Tokens in the example input: a size no other dimension of the tiny example has."""
EXAMPLE_GRID = (7, 5)
"""Frames and patches of the example input of a grid model (``axes=2``): ``[1, 7, 5, h]``."""

BIAS_ARGS = ("alibi", "position_bias", "attention_bias")
"""Required block arguments that carry an attention bias (refused by name: :func:`example_inputs`)."""
UNREAD = (
    "The families the rewrite reads are listed in docs/graph-rewriting.md; where no setting named above helps, "
    "a model it cannot read trains under another strategy (e.g. strategy='ddp' or 'fsdp')"
)
"""The end of every refusal of a block the rewrite cannot read."""


def _hidden_size(block: nn.Module) -> int:
    for module in block.modules():
        if isinstance(module, nn.MultiheadAttention):
            return int(module.embed_dim)
        if is_projection(module):  # nn.Linear, or transformers' Conv1D (GPT-2)
            return int(projection_weight(module).shape[1])
    raise RoleError("no nn.Linear, Conv1D or nn.MultiheadAttention inside")


def _head_dim(block: nn.Module, hidden: int) -> int:
    for module in block.modules():
        head_dim = getattr(module, "head_dim", None)
        if isinstance(head_dim, int):
            return head_dim
        head_size = getattr(module, "head_size", None)  # GPT-NeoX
        if isinstance(head_size, int):
            return head_size
        for name in ("num_heads", "n_heads", "num_attention_heads"):
            if isinstance(getattr(module, name, None), int):
                return hidden // int(getattr(module, name))
    raise RoleError("cannot tell the head size (no head_dim / num_heads attribute) to build rotary inputs")


def _cos_sin(t: int, d: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(t, dtype=torch.float64), inv)  # [t, d/2]
    emb = torch.cat([ang, ang], dim=-1)[None]  # [1, t, d]
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


Rope = Callable[[torch.Tensor, torch.Tensor, nn.Module], Any]
"""``rope(x, position_ids, block) -> (cos, sin)``: the model's own rotary embedding for ``block``."""


def example_inputs(
    block: nn.Module, name: str, axes: int = 1, rope: Rope | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Example ``(args, kwargs)`` for ``block``'s forward (see the module docstring); ``axes=2``: a grid.

    ``rope``: the model's rotary embedding, which gives ``position_embeddings`` of the width the block expects
    (partial rotary: Phi-2, StableLM); without it, full-width ``cos``/``sin``."""
    param = next(block.parameters())
    dtype, device = param.dtype, param.device
    hidden, t = _hidden_size(block), EXAMPLE_LEN
    params = list(inspect.signature(block.forward).parameters.values())
    shape = (1, *EXAMPLE_GRID, hidden) if axes == 2 else (1, t, hidden)
    args: tuple[Any, ...] = (torch.randn(*shape, dtype=dtype, device=device),)
    kwargs: dict[str, Any] = {}
    for p in params[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name == "positions":
            kwargs[p.name] = torch.arange(t, device=device)
        elif p.name == "position_ids":
            kwargs[p.name] = torch.arange(t, device=device)[None]
        elif p.name == "position_embeddings" and rope is not None:
            kwargs[p.name] = rope(args[0], torch.arange(t, device=device)[None], block)
        elif p.name == "position_embeddings":
            kwargs[p.name] = _cos_sin(t, _head_dim(block, hidden), dtype, device)
        elif p.default is inspect.Parameter.empty and p.name in BIAS_ARGS:
            raise RoleError(
                f"its forward requires an attention-bias argument ({p.name!r}: ALiBi, as Bloom's and MPT's blocks "
                f"take, and Falcon's even where its config uses rotary positions), which the parallel modes do not "
                f"apply"
            )
        elif p.default is inspect.Parameter.empty:
            raise RoleError(f"cannot build an example for the required argument {p.name!r} of {name}'s forward")
    return args, kwargs


def find_roles(
    block: nn.Module, name: str, axes: int = 1, rope: Rope | None = None
) -> tuple[AttentionRoles, MlpRoles, Any]:
    """Trace ``block`` on example inputs and find its attention and MLP roles."""
    args, kwargs = example_inputs(block, name, axes, rope)
    trace = trace_block(block, args, kwargs)
    attention = find_attention(trace)
    return attention, find_mlp(trace, attention), (args, kwargs)


def install(block: nn.Module, attention: AttentionRoles, mlp: MlpRoles, layer: int, group: Group) -> list[OpDispatch]:
    """Replace the op sub-modules of ``block`` by dispatch modules holding this rank's shards (in the block's
    training mode: their tails' dropout follows it)."""
    ops = _install(block, attention, mlp, layer, group)
    for op in ops:
        op.train(block.training)
    return ops


def _install(block: nn.Module, attention: AttentionRoles, mlp: MlpRoles, layer: int, group: Group) -> list[OpDispatch]:
    attn = AttentionDispatch(block.get_submodule(attention.core), attention, layer, group)
    block.set_submodule(attention.core, attn)
    if mlp.opaque:
        assert mlp.core is not None
        moe = OpaqueDispatch(block.get_submodule(mlp.core), mlp.core, layer, group)
        block.set_submodule(mlp.core, moe)
        return [attn, moe]
    if mlp.core is not None:
        mlp_mod = MlpDispatch(block.get_submodule(mlp.core), mlp, layer, group)
        block.set_submodule(mlp.core, mlp_mod)
        return [attn, mlp_mod]
    up, down = block.get_submodule(mlp.up), block.get_submodule(mlp.down)
    if mlp.gate is not None:
        raise RoleError("a gated MLP computed inline by the block is not supported; put it in a sub-module")
    col, row = ColumnDispatch(up, mlp.up, layer, group), RowDispatch(down, mlp.down, layer, group)
    block.set_submodule(mlp.up, col)
    block.set_submodule(mlp.down, row)
    return [attn, col, row]


def host_copy(block: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``block`` on the CPU with its floating-point tensors in ``dtype``, made tensor by tensor: nothing is
    copied on the block's own device (a GPU holds the block once; the trace, probes and verify run on the host)."""
    memo: dict[int, Any] = {}
    for t in (*block.parameters(), *block.buffers()):
        host = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype, copy=True)
        memo[id(t)] = nn.Parameter(host, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else host
    return copy.deepcopy(block, memo)


def _dtype_of(block: nn.Module) -> torch.dtype:
    return next(p.dtype for p in block.parameters() if p.is_floating_point())


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _eval_copy(block: nn.Module) -> nn.Module:
    """A copy in eval mode (dropout off: the probes and the verify compare deterministic runs); ``block`` is the
    host copy the roles were found on."""
    return copy.deepcopy(block).eval()


def _run_capturing(reference: nn.Module, example: Any, paths: dict[str, str]) -> dict[str, Any]:
    """Run ``reference`` on the example; ``{key: (args, kwargs)}`` of the call of each ``paths[key]`` module whose
    key starts with ``call``, ``{key: output}`` of the others."""
    seen: dict[str, Any] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, out: Any = None) -> None:
            seen.setdefault(name, out if out is not None else (args, kwargs))

        return hook

    handles = []
    dtype = _dtype_of(reference)
    for key, path in paths.items():
        module = reference.get_submodule(path)
        if key.startswith("call"):
            handles.append(module.register_forward_pre_hook(keep(key), with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(keep(key), with_kwargs=True))
    try:
        with torch.no_grad():
            reference(*_cast(example[0], dtype), **_cast(example[1], dtype))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def probe_program(block: nn.Module, attention: AttentionRoles, mlp: MlpRoles, example: Any) -> AttentionRoles:
    """The roles with the probed program (:func:`~lightning_paradyse.graph.program.probe`), on a copy of ``block``
    (the host copy the roles were found on); the tails are checked to act on each token alone."""
    reference = _eval_copy(block)
    paths = {"call": attention.core, "o": attention.o}
    if attention.program is not None:
        paths.update({role: getattr(attention, role) for role in ("q", "k", "v")})
    if mlp.core is not None and (mlp.tail is not None or mlp.opaque):
        paths.update({"call_mlp": mlp.core} if mlp.opaque else {"call_mlp": mlp.core, "down": mlp.down})
    seen = _run_capturing(reference, example, paths)
    if mlp.opaque:
        assert mlp.core is not None
        _probe_opaque(reference.get_submodule(mlp.core), mlp.core, *seen["call_mlp"])
    args, kwargs = seen["call"]
    try:
        if attention.head is not None:  # the core's code before its projections, on its input
            values = [ref.get(args, kwargs) for ref in attention.head_values]
            core = reference.get_submodule(attention.core)
            probe_tail(attention.head, core, attention.hidden.get(args, kwargs), values, attention.head_token_dims)
        if attention.tail is not None:
            values = [ref.get(args, kwargs) for ref in attention.tail_values]
            core = reference.get_submodule(attention.core)
            probe_tail(attention.tail, core, seen["o"], values, attention.tail_token_dims)
        if mlp.core is not None and mlp.tail is not None:
            m_args, m_kwargs = seen["call_mlp"]
            values = [ref.get(m_args, m_kwargs) for ref in mlp.tail_values]
            probe_tail(mlp.tail, reference.get_submodule(mlp.core), seen["down"], values, mlp.tail_token_dims)
    except ProgramError as err:
        raise RoleError(f"the code before the projections or after the output projection: {err}") from None
    if attention.program is None:
        return attention
    values = [ref.get(args, kwargs) for ref in attention.positions]
    owner = copy.deepcopy(reference.get_submodule(attention.core))  # its parameters are perturbed
    projections = tuple(_part(seen[r], rows) for r, rows in zip("qkv", attention.rows))
    try:
        program = probe(attention.program, owner, projections, values, attention.token_dims)  # type: ignore[arg-type]
    except ProgramError as err:
        raise RoleError(f"{attention.core}: the code between the projections and the attention: {err}") from None
    return dataclasses.replace(attention, program=program)


def _probe_opaque(module: nn.Module, path: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """An MLP run whole on each rank's tokens must give a part of the tokens what it gives them among all (a
    mixture of experts with a capacity limit or a batch-level router would not)."""
    idx = torch.tensor(PROBE_TOKENS, device=args[0].device)

    def first(out: Any) -> torch.Tensor:
        value = out[0] if isinstance(out, (tuple, list)) else out
        assert isinstance(value, torch.Tensor)
        return value

    with torch.no_grad():
        full = first(module(*args, **kwargs))
        part = first(module(args[0][:, idx], *args[1:], **kwargs))  # [b, t, h] -> [b, 4, h]
    err = float((part - full[:, idx]).abs().max() / full.abs().max().clamp_min(1e-30))
    if not err <= tolerance(full.dtype):
        raise RoleError(
            f"{path} ({type(module).__name__}) is run whole on each rank's tokens, but a token's result depends on "
            f"the other tokens of the call (relative error {err:.1e}): it cannot be parallelized over the sequence"
        )


def _part(output: torch.Tensor, rows: tuple[int, ...] | None) -> torch.Tensor:
    """A projection's output, or its part's features of a fused projection's output."""
    if rows is None:
        return output
    return output.index_select(-1, torch.tensor(rows, device=output.device))  # [b, t, F] -> [b, t, rows]


def attend_axis(block: nn.Module, attention: AttentionRoles, example: Any) -> int:
    """The grid dimension (1: frames, 2: patches) ``block``'s attention attends along, read off one run."""
    seen: list[int] = []

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append(int(attention.hidden.get(args, kwargs).shape[1]))

    handle = block.get_submodule(attention.core).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            block(*example[0], **example[1])
    finally:
        handle.remove()
    lengths = {EXAMPLE_GRID[0]: 1, EXAMPLE_GRID[1]: 2}
    if len(seen) != 1 or seen[0] not in lengths:
        raise RoleError(f"its attention does not attend along one axis of the grid (sequence lengths {seen})")
    return lengths[seen[0]]


class _Float64Softmax(TorchFunctionMode):
    """A softmax asked for in float32 on float64 scores stays float64 (Hugging Face's eager attention upcasts to
    float32 whatever the model's dtype; the modes compute in the model's dtype): the verify compares at 1e-9."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in SOFTMAX and kwargs.get("dtype") == torch.float32 and args[0].dtype == torch.float64:
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def _causal_mask(block: nn.Module, attention: AttentionRoles, axes: int) -> dict[str, torch.Tensor]:
    """``{"attention_mask": ...}``, the additive causal mask a Hugging Face model hands its layers, for a causal block
    that takes one (an eager attention applies only the mask it is given); else nothing."""
    if attention.kind != "linear" or not attention.causal or axes != 1:
        return {}
    if "attention_mask" not in inspect.signature(block.forward).parameters:
        return {}
    t, dtype = EXAMPLE_LEN, _dtype_of(block)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    mask = torch.zeros(t, t, dtype=dtype).masked_fill(future, torch.finfo(dtype).min)
    return {"attention_mask": mask[None, None]}  # [1, 1, t, t] (on the host, as the block copy it is handed to)


def verify(block: nn.Module, name: str, attention: AttentionRoles, mlp: MlpRoles, example: Any, axes: int = 1) -> None:
    """Check on a copy of the host copy ``block`` (float64, or float32 for kernels without float64) that every
    feasible mode reproduces the block (group of one)."""
    args, kwargs = example
    reference = _eval_copy(block)
    dtype = _dtype_of(reference)
    args64, kwargs64 = _cast(args, dtype), {**_cast(kwargs, dtype), **_causal_mask(block, attention, axes)}
    with torch.no_grad(), _Float64Softmax():
        expected = reference(*args64, **kwargs64)
    # the block ran without the mask its model builds for a window: compare without it (the windowed kernels are
    # checked against the models' own masks in the family tests)
    ops = install(reference, dataclasses.replace(attention, window=None), mlp, 0, None)
    ctx = SeqContext(SeqLayout(EXAMPLE_GRID[0] if axes == 2 else EXAMPLE_LEN, 1), None)
    if axes == 2:
        grid = GridState(1, {1: EXAMPLE_GRID[0], 2: EXAMPLE_GRID[1]})
        for op in ops:
            op.grid = grid
    for mode in GRID_MODES if axes == 2 else MODES:
        for op in ops:
            op.configure(ctx, OpPlan(mode) if op.infeasible(mode, 1) is None else OpPlan("tp_sp"))
        with torch.no_grad():
            got = reference(*args64, **kwargs64)
        got_t, exp_t = (v[0] if isinstance(v, (tuple, list)) else v for v in (got, expected))
        err = float((got_t - exp_t).abs().max() / exp_t.abs().max().clamp_min(1e-30))
        if not math.isfinite(err) or err > tolerance(dtype):
            raise RoleError(
                f"{name}: the rewritten block does not reproduce the original under {mode} (relative error "
                f"{err:.2e}); roles found: attention={attention}, mlp={mlp}"
            )


def _casts_to(value: Any, dtype: torch.dtype) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_casts_to(v, dtype) for v in value)
    if isinstance(value, dict):
        return any(_casts_to(v, dtype) for v in value.values())
    return value == dtype if isinstance(value, torch.dtype) else False


def refuse_hidden_casts(attention: AttentionRoles, mlp: MlpRoles, traced: torch.dtype) -> None:
    """A block traced in float32 (its kernels have no float64) cannot tell a cast to float32 in its replayed code
    from a cast to the call's dtype (the programs read the traced dtype as the latter): refused, never guessed."""
    if traced == torch.float64:
        return
    for program in (attention.head, attention.program, attention.tail, mlp.tail):
        if program is None:
            continue
        steps = any(_casts_to((step.args, step.kwargs or {}), traced) for step in program.steps)
        if steps or any(c.dtype == traced for c in program.constants.values()):
            raise RoleError(
                f"its kernels have no float64, so it was traced in {traced}, and its code around the attention casts "
                f"to {traced}, which such a trace cannot tell from the call's own dtype; build the model with kernels "
                f"that run in float64 (e.g. transformers' experts_implementation='eager')"
            )


def _own_activation(mlp: MlpRoles, copy64: nn.Module, block: nn.Module) -> MlpRoles:
    """The roles with an activation module of ``copy64`` replaced by the same module of ``block``."""
    if not isinstance(mlp.act, nn.Module):
        return mlp
    path = next(n for n, m in copy64.named_modules() if m is mlp.act)
    return dataclasses.replace(mlp, act=block.get_submodule(path))


def refuse_adapters(block: nn.Module, name: str) -> None:
    """PEFT layers inside the block the modes do not compute (:func:`~lightning_paradyse.graph.adapters.lora_parts`:
    LoRA with dropout, DoRA, a bias on ``B``, several adapters, other PEFT methods): refused by name with the fix, where
    the role passes would only see a query made of two projections. LoRA on the projections runs in the modes."""
    for path, sub in block.named_modules():
        try:
            lora_parts(sub)
        except ValueError as err:
            raise RoleError(f"cannot parallelize block {name} ({type(block).__name__}): {path} is {err}") from None


def rewrite_block(
    block: nn.Module, name: str, layer: int, group: Group, axes: int = 1, rope: Rope | None = None
) -> list[OpDispatch]:
    """Trace, find roles, verify and install the dispatch modules into ``block`` (in place).

    ``axes=2``: the block takes grid hidden states ``[b, T, S, h]``; its attention's axis is recorded on the
    attention dispatch (``attend_axis``) and the grid mode is verified. ``rope``: the model's rotary embedding
    (:func:`example_inputs`).
    """
    refuse_adapters(block, name)
    stage = "tracing it on example inputs"
    try:
        # traced on a host copy in float64 (a dtype the code casts to on purpose stands out; a GPU never holds a
        # second copy) and in training mode (attention dropout shows in the attention call)
        traced = host_copy(block, torch.float64).train()
        try:
            attention, mlp, example = find_roles(traced, name, axes, rope)
        except RoleError:
            raise
        except Exception:  # kernels without float64 (grouped GEMMs of MoE layers): traced in float32
            traced = host_copy(block, torch.float32).train()
            attention, mlp, example = find_roles(traced, name, axes, rope)
        mlp = _own_activation(mlp, traced, block)
        stage = "probing its code around the projections"
        attention = probe_program(traced, attention, mlp, example)
        refuse_hidden_casts(attention, mlp, _dtype_of(traced))
        stage = "finding the axis its attention runs along"
        axis = attend_axis(traced, attention, example) if axes == 2 else None
        stage = "checking the rewritten block against the original (float64, float32 for MoE grouped GEMMs)"
        verify(traced, name, attention, mlp, example, axes)
        stage = "installing the dispatch modules"
        ops = install(block, attention, mlp, layer, group)  # program constants follow the block (Program.constant)
        for op in ops:
            if isinstance(op, AttentionDispatch):
                op.attend_axis = axis
        return ops
    except RoleError as err:
        raise RoleError(f"cannot parallelize block {name} ({type(block).__name__}): {err}. {UNREAD}") from None
    except Exception as err:  # anything else the block's own code raised on our inputs: name it, never raw
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        if isinstance(err, SliceLengthError):  # the block's own code reshaped the tokens between its parts
            first = (
                "a part of the block was handed a tensor whose second dimension is not the block's tokens (the "
                "block reshapes them, as OPT's flattens [b, s, h] into [b * s, h] around its MLP)"
            )
        raise RoleError(
            f"cannot parallelize block {name} ({type(block).__name__}): {type(err).__name__} while {stage}: "
            f"{first}. The rewrite reads blocks whose attention is q/k/v/o linears around one scaled-dot-product "
            f"attention call (Hugging Face: build the model with attn_implementation='sdpa'); name the block list "
            f"with ParaDySeStrategy(blocks=...) if these are not the transformer blocks. {UNREAD}"
        ) from err
