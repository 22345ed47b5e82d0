"""Apply the unified layout to a model and run it per batch: the API the strategy is built on.

The model never knows it is parallel. In one documented order:

1. :func:`parallelize` (once, at setup): find the transformer blocks (:func:`find_blocks`), rewrite
   each in place (:func:`~lightning_paradyse.graph.rewrite.rewrite_block`: trace, find roles,
   verify, install dispatch modules holding 1/p shards), and install forward pre-hooks that give
   the model the global positions of its local tokens (and, for Hugging Face models trained with
   ``labels``, the globally shifted labels and the global token count).
2. :func:`configure` (every batch): the batch's layout and plan, a table look-up on every dispatch
   module; :func:`set_step_sources`: the batch's tensors and their slices (labels are traced back to them).
3. forward / backward on the local tokens, then :func:`reduce_replicated_grads` (norms, embeddings,
   head and the output biases are replicated; their gradients are summed over the group).

:func:`consolidated` / :func:`load_consolidated` convert between the shards and the plain model's
state dict, so checkpoints load into the unparallelized model.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection
from torch.nn.utils import parametrize

from lightning_paradyse.distributed.comm import (
    Group,
    all_gather_rows,
    all_reduce_sum,
    collective_device,
    group_rank,
    group_size,
    no_counting,
)
from lightning_paradyse.distributed.devices import to_device
from lightning_paradyse.graph.dispatch import (
    AttentionDispatch,
    OpaqueDispatch,
    OpDispatch,
    ShardSource,
    cut_piece,
    join_pieces,
)
from lightning_paradyse.graph.passes import RoleError
from lightning_paradyse.graph.rewrite import rewrite_block
from lightning_paradyse.modes.dsp import GridState
from lightning_paradyse.modes.plan import Plan
from lightning_paradyse.modes.specs import SeqContext, row_sizes, shard_rows
from lightning_paradyse.runtime.hf_outputs import refuse_attention_weights
from lightning_paradyse.runtime.hf_positions import (
    Numbering,
    own_positions,
    packed_documents,
    same_documents,
    watch_packing,
)
from lightning_paradyse.runtime.hf_token_dropout import dropped_embeddings, dropping_modules
from lightning_paradyse.runtime.output_leaves import OutputLeaves
from lightning_paradyse.runtime.plain_view import Parts, Shadows
from lightning_paradyse.runtime.slicing import (
    IGNORE_INDEX,
    PAD_MASK_KEYS,
    TOKEN_KEYS,
    BatchInfo,
    BatchSource,
    check_padding_targets,
    shard_batch,
)
from lightning_paradyse.runtime.streams import CallStreams


@dataclass
class StepState:
    """What the forward pre-hooks read during one step: owned by the registry, never by the user's modules."""

    ctx: SeqContext | None = None
    sources: tuple[BatchSource, ...] = ()
    """Every tensor of the batch that was sliced along the sequence, with its slice (for tracing labels back)."""
    batch: Any = None
    """The batch the step was handed (its slices, and the tensors not sliced: a count the data loader gives)."""
    padding: torch.Tensor | None = None
    """Right padding of the batch, ``[b, s]`` (see :func:`lightning_paradyse.runtime.slicing.find_padding`)."""
    labels_consumed: bool = False
    """Whether a model consumed ``labels`` through the hook this step (its loss is then a global sum share)."""
    shifts_labels: bool = False
    """Whether a module of the model shifts the ``labels`` it is given (the labels hook is installed): only then does
    a step need the batch's labels shifted over the whole batch."""
    blocks: list[str] = field(default_factory=list)
    grid: GridState | None = None
    """Grid models (``axes=2``): which grid dimension is sharded now (see :mod:`lightning_paradyse.modes.dsp`)."""
    masked_lengths: tuple[int, ...] | None = None
    """A whole run's predictions (``p = 1``) of a right-padded batch: each row's real tokens. A call of the model given
    the batch's ``attention_mask`` then masks the padding keys as that mask does
    (:attr:`~lightning_paradyse.modes.specs.SeqContext.real_lengths`); a call without it attends them, as one process's
    causal attention does. Set per batch after :func:`configure` (:func:`predict_padding`), which clears it."""
    plain_parts: Parts = field(default_factory=dict)
    """The replaced sub-modules' skeletons by path (:mod:`~lightning_paradyse.runtime.plain_view`): carried by a deep
    copy of the model with its hooks, as the rest of the state."""
    plain: Any = None
    """What checkpoints need to know about the plain model (a ``PlainModel``, recorded by the strategy before the
    rewrite); carried by a deep copy too."""
    streams: CallStreams = field(default_factory=CallStreams)
    """Which random stream the model's calls draw from (:mod:`~lightning_paradyse.runtime.streams`)."""
    call_documents: int | None = None
    """The module (its ``id``) whose call runs now with the packed documents its ``position_ids`` mark
    (:func:`_apply_documents`); emptied by :func:`configure`."""
    packing: tuple[int, Any] | None = None
    """The module (its ``id``) whose call is watched for packed documents now, and the function that stops watching
    (:func:`_watch_documents`); stopped by :func:`configure` too."""
    whole_runs: list[int] = field(default_factory=list)
    """The module (its ``id``) whose call runs on whole sequences now: a model holding blocks ``blocks=`` leaves whole
    (:func:`_whole_in`; emptied by :func:`configure`)."""
    leaves: OutputLeaves | None = None
    """Set while the step check differentiates the step's loss by the model's outputs
    (:mod:`~lightning_paradyse.runtime.output_leaves`); ``None`` otherwise (the model's calls are left alone)."""


class _StepHook:
    """A hook of ours: ``fn(state, *hook_args)`` with the step state it was made with.

    The user's modules carry no attribute of ours; the hooks (registered through the public hook API) hold the
    state, so a deep copy of a parallelized module copies the hooks with one new state of its own.
    """

    def __init__(self, state: StepState, fn: Any) -> None:
        self.state, self.fn = state, fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(self.state, *args)


_REGISTRY: weakref.WeakKeyDictionary[nn.Module, StepState] = weakref.WeakKeyDictionary()
"""Parallelized modules -> their step state (found once through their hooks, then looked up here)."""


def _find_state(module: nn.Module) -> StepState | None:
    state = _REGISTRY.get(module)
    if state is not None:
        return state
    hooks = (h for m in module.modules() for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values())
    state = next((h.state for h in hooks if isinstance(h, _StepHook)), None)
    if state is not None:
        _REGISTRY[module] = state
    return state


def step_state(module: nn.Module) -> StepState:
    """The :class:`StepState` of a parallelized module."""
    state = _find_state(module)
    if state is None:
        raise RuntimeError(
            "the module has not been parallelized (call lightning_paradyse.runtime.parallel.parallelize)"
        )
    return state


def shifts_labels(module: nn.Module) -> bool:
    """Whether a module of the parallelized ``module`` shifts the ``labels`` it is given (a Hugging Face causal LM),
    known from setup: a step cut from a larger batch hands it labels shifted over that batch."""
    return step_state(module).shifts_labels


def is_parallelized(module: nn.Module) -> bool:
    """Whether :func:`parallelize` rewrote ``module`` (or the module it was deep-copied from)."""
    return _find_state(module) is not None


def run_documents(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """``model(ids, positions)`` over a packed row (``[1, s]``; ``positions`` and ``doc_ids`` ``[s]``) whose documents
    attend only within themselves: one call over the row where the strategy rewrote the model (its attention keeps
    the documents apart), else one call per document, so that one process trains what the strategy trains. A
    LightningModule of one's own over packed batches calls its model so and says it does
    (``keeps_documents_apart = True``), as ``LanguageModel`` does."""
    if is_parallelized(model):
        return model(ids, positions)  # type: ignore[no-any-return]
    sizes = torch.unique_consecutive(doc_ids, return_counts=True)[1].tolist()  # the documents' lengths
    parts = zip(ids.split(sizes, dim=1), positions.split(sizes))  # [1, s] -> [1, s_i] each
    return torch.cat([model(t, pos) for t, pos in parts], dim=1)  # [1, s_i, ...] -> [1, s, ...]


# --------------------------------------------------------------------------------------------------
# Finding and rewriting the blocks
# --------------------------------------------------------------------------------------------------


def check_unshared_blocks(found: Sequence[tuple[str, nn.Module]]) -> None:
    """Refuse blocks that share a parameter (ALBERT's cross-layer sharing, one MLP module in two blocks): each block's
    ops are sharded on their own, so the shared weight would become one per block, trained apart. Raises alike on
    every rank, before any collective."""
    owner: dict[int, str] = {}
    for name, block in found:
        for key, p in block.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), f"{name}.{key}")
            if not first.startswith(f"{name}."):
                raise ValueError(
                    f"{name}.{key} is {first}: transformer blocks that share weights (cross-layer sharing) are not "
                    f"supported by ParaDySeStrategy, which shards each block's ops on their own; give each block its "
                    f"own weights, or train this model without ParaDySeStrategy"
                )


def _looks_like_block(module: nn.Module) -> bool:
    mods = list(module.modules())
    if any(isinstance(m, nn.MultiheadAttention) for m in mods):
        return True
    projections = sum(isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D" for m in mods)  # GPT-2's Conv1D
    return projections >= 4 and any("attn" in n.lower() or "attention" in n.lower() for n, _ in module.named_modules())


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
    outer = _block_lists(module)
    if not outer:
        raise ValueError(
            f"no list of transformer blocks found in {type(module).__name__}; pass blocks='path.to.layers'"
        )
    if len(outer) > 1:
        names = ", ".join(n for n, _ in outer)
        raise ValueError(f"several lists of transformer blocks found ({names}); choose one with blocks='...'")
    name, found = outer[0]
    return [(f"{name}.{i}", b) for i, b in enumerate(found)]


def _block_lists(module: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every outermost ``nn.ModuleList`` whose children all look like transformer blocks, as ``(name, list)``."""
    candidates = [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and all(_looks_like_block(b) for b in m)
    ]
    return [(n, m) for n, m in candidates if not any(n.startswith(o + ".") for o, _ in candidates if o != n)]


def _whole_blocks(module: nn.Module, blocks: str, state: StepState) -> None:
    """The transformer blocks ``blocks=`` leaves whole (a distillation teacher, a frozen reference model) run on whole
    sequences: the outermost module called that holds such a list (``teacher``, or ``teacher.model`` called on its
    own) is handed the whole batch tensors its call's per-token arguments are slices of, and its per-token outputs
    are cut back to this rank's tokens (:func:`_whole_in`, :func:`_whole_out`), so it computes what one process's
    does, at ``p`` times one rank's share of its compute and memory. It must be frozen and called without ``labels=``
    (:func:`_refuse_in_whole_run`). A block called otherwise in a step on a slice of every sequence raises, naming why
    (:func:`_whole_block_hook`)."""
    for name, found in _block_lists(module):
        if name == blocks or name.startswith(blocks + ".") or blocks.startswith(name + "."):
            continue
        owner_path = name.rsplit(".", 1)[0] if "." in name else ""
        while owner_path and not blocks.startswith(owner_path + "."):  # owners that do not run the parallel blocks
            owner = module.get_submodule(owner_path)
            owner.register_forward_pre_hook(_StepHook(state, _whole_in(name, blocks)), with_kwargs=True)
            owner.register_forward_hook(_StepHook(state, _whole_out))
            owner_path = owner_path.rsplit(".", 1)[0] if "." in owner_path else ""
        for i, block in enumerate(found):
            block.register_forward_pre_hook(_StepHook(state, _whole_block_hook(f"{name}.{i}", blocks)))


def _whole_error(name: str, blocks: str, p: int, why: str) -> ValueError:
    return ValueError(
        f"{name} ParaDySeStrategy leaves whole (blocks={blocks!r} names the blocks it "
        f"parallelizes), {why}, in a step that runs on a slice of every sequence ({p} ranks): its attention would see "
        f"this rank's tokens only, not one process's. Call the model that holds it with the batch's own tensors "
        f"(input_ids=batch['input_ids'], attention_mask=batch['attention_mask']): it then runs on the whole sequences "
        f"on every rank; or compute its outputs outside the steps (precomputed into the batch)"
    )


def _whole_in(name: str, blocks: str) -> Any:
    def hook(
        state: StepState, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        ctx = state.ctx
        if ctx is None or state.whole_runs:  # outside a step, or a call inside a whole run: already whole
            return None
        _refuse_in_whole_run(name, blocks, mod, args, kwargs)
        if ctx.p == 1:
            return None
        local = ctx.layout.local_len(ctx.rank)

        def whole(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != local:
                return value
            source = _trace(value, state.sources)  # [b, s_r, ...] -> the batch's [b, s, ...]
            if source is None:
                raise _whole_error(
                    f"{name} holds transformer blocks",
                    blocks,
                    ctx.p,
                    f"called through {type(mod).__name__} with a per-token "
                    f"{tuple(value.shape)} tensor that is not one of the batch's",
                )
            return source.whole

        args, kwargs = tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}
        state.whole_runs.append(id(mod))
        return args, kwargs

    return hook


def _refuse_in_whole_run(name: str, blocks: str, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """What a model run whole cannot give exactly, refused in every step (alike on every rank): its own loss
    (``labels=``: the whole batch's mean on a step that slices every sequence, but the rank's own rows' on a step on
    groups, so a value logged of it would change meaning with the plan; probe 11) and a gradient into its weights
    (each rank backs its whole run from its own tokens' outputs: probe 11 measured 6e-8 off one process after four
    AdamW steps, where the frozen model is exact)."""
    if _Call(mod, args, kwargs).get("labels") is not None:
        raise ValueError(
            f"{type(mod).__name__} (holding {name}, which blocks={blocks!r} leaves whole) was called with labels=: its "
            f"own loss would be the whole batch's on some steps and this rank's rows' on others (steps on groups); "
            f"compute what you need from its logits per token in the step (e.g. its cross-entropy averaged over the "
            f"rank's real targets, as the step's loss is)"
        )
    if torch.is_grad_enabled() and any(w.requires_grad for w in mod.parameters()):
        raise ValueError(
            f"{type(mod).__name__} (holding {name}, which blocks={blocks!r} leaves whole) has trainable weights in a "
            f"step under gradient: ParaDySeStrategy runs such a second model whole on every rank and trains only the "
            f"blocks it parallelizes exactly; freeze it (requires_grad_(False)) or call it under torch.no_grad(), or "
            f"train it as the parallelized model (blocks=...) in a run of its own"
        )


def _whole_out(state: StepState, mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """A whole run's per-token outputs, ``[b, s, ...] -> [b, s_r, ...]`` (this rank's tokens, as a slice of a batch);
    the rest (a cache, a count) as returned."""
    ctx = state.ctx
    if ctx is None or ctx.p == 1 or not state.whole_runs or state.whole_runs[-1] != id(mod):
        return None
    state.whole_runs.pop()
    s, rank = ctx.layout.seq_len, ctx.rank

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ctx.layout.shard(value, rank) if value.dim() >= 2 and value.shape[1] == s else value
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(cut(v) for v in value)
        return value

    if isinstance(output, Mapping):  # transformers' ModelOutput: set item by item (keeps its class)
        for key in list(output.keys()):
            output[key] = cut(output[key])  # type: ignore[index]
        return output
    return cut(output)


def _whole_block_hook(name: str, blocks: str) -> Any:
    def hook(state: StepState, mod: nn.Module, args: tuple[Any, ...]) -> None:
        ctx = state.ctx
        if ctx is not None and ctx.p > 1 and not state.whole_runs:
            what = f"{name} ({type(mod).__name__}) is a transformer block"
            raise _whole_error(what, blocks, ctx.p, "called on this rank's slice")

    return hook


def parallelize(module: nn.Module, group: Group, blocks: str | None = None, axes: int = 1) -> list[str]:
    """Rewrite every transformer block of ``module`` in place (see the module docstring).

    ``axes``: sequence axes of the hidden states between blocks: 1 for ``[b, s, h]`` (language models), 2 for a
    grid ``[b, T, S, h]`` whose blocks attend along one axis each (frames x patches); the batch is then split
    along ``T`` and the ``dsp`` mode can move the shard between the axes (:func:`_install_grid_hooks`).

    Returns the block names. Raises ``ValueError`` naming the block and the missing role when a block
    cannot be understood; nothing is ever run unparallelized silently.
    """
    if is_parallelized(module):
        raise RuntimeError("the module is already parallelized")
    if axes not in (1, 2):
        raise ValueError(f"axes={axes!r}: 1 (a sequence, [b, s, h]) or 2 (a grid, [b, T, S, h]) are supported")
    found = find_blocks(module, blocks)
    check_unshared_blocks(found)
    _refuse_prompt_learning(module)
    forget_walks()  # the walks before the rewrite found no dispatch modules where there are about to be some
    state = StepState(blocks=[n for n, _ in found], grid=GridState() if axes == 2 else None)
    rope = _rotary_embedding(module)
    shadows = Shadows()  # the replaced sub-modules' structure, for code that sorts parameters by it
    for name, block in found:  # every block before any is rewritten: alike on every rank, nothing changed yet
        _refuse_parametrized(name, block)
    for layer, (name, block) in enumerate(found):
        shadows.before(block)
        hooked = [(f"{name}.{n}", p) for n, p in block.named_parameters() if gradient_hooks(p)]  # held: ids stay
        try:
            ops = rewrite_block(block, name, layer, group, axes, rope)
        except RoleError as err:
            raise ValueError(str(err)) from None
        _refuse_lost_hooks(hooked, block)  # alike on every rank (the same module)
        shadows.after(name, [op.core_path for op in ops])
        for op in ops:
            op.grid = state.grid
    state.plain_parts = shadows.finish(module)
    forget_walks()
    if any(isinstance(op, OpaqueDispatch) for _, op in dispatchers(module)):
        _refuse_router_loss(module)
    module.register_forward_pre_hook(_StepHook(state, _anchor))
    _install_hooks(module, [n for n, _ in found], state)
    if blocks is not None:
        _whole_blocks(module, blocks, state)
    _REGISTRY[module] = state
    if state.grid is not None:
        _install_grid_hooks([b for _, b in found], state)
    return state.blocks


def _refuse_parametrized(name: str, block: nn.Module) -> None:
    """Refuse a block holding a parametrized module (``torch.nn.utils.parametrizations.weight_norm``,
    ``spectral_norm``, ``orthogonal``: its weight computed from others on every call): the rewrite shards the block's
    projections as plain weights and cannot keep the parametrization (it crashed inside the rewrite until 2026-12-02,
    probe 19)."""
    found = [f"{name}.{path}" if path else name for path, m in block.named_modules() if parametrize.is_parametrized(m)]
    if found:
        raise ValueError(
            f"{found[0]} is parametrized (torch.nn.utils.parametrize: weight_norm, spectral_norm, orthogonal, ...): "
            "ParaDySeStrategy shards a block's projections as plain weights and cannot keep the parametrization. "
            "Remove it from the blocks (outside them, on an embedding or the head, it trains as in one process), or "
            "train without ParaDySeStrategy"
        )


def gradient_hooks(param: nn.Parameter) -> bool:
    """Whether ``param`` holds hooks of its own on its gradient (``register_hook``,
    ``register_post_accumulate_grad_hook``)."""
    return bool(getattr(param, "_backward_hooks", None)) or bool(getattr(param, "_post_accumulate_grad_hooks", None))


def _refuse_lost_hooks(hooked: list[tuple[str, nn.Parameter]], block: nn.Module) -> None:
    """Refuse a gradient hook on a parameter the rewrite replaced by its shard (``hooked``: the block's parameters
    with hooks before, by name): the hook stays on the plain parameter, which no longer trains, and the shard's
    gradient would pass unchanged."""
    kept = {id(p) for p in block.parameters()}  # the hooked parameters are alive: no id of theirs was reused
    lost = [name for name, param in hooked if id(param) not in kept]
    if lost:
        raise ValueError(
            f"a gradient hook is registered on {', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''} (register_hook "
            f"or register_post_accumulate_grad_hook): ParaDySeStrategy replaces this weight by its shard, which does "
            f"not carry the hook, so it would train unchanged. Freeze the weight with requires_grad_(False) before "
            f"the fit, or change its gradient in on_before_optimizer_step (the gradients are the whole model's there)"
        )


ROUTER_LOSS_REFUSAL = (
    "the mixture-of-experts auxiliary (load-balancing) loss is computed from every token's router logits at once: "
    "on a slice of the sequence it is another loss, and ParaDySeStrategy does not make it global yet; train with "
    "output_router_logits=False (the model config's default), or without ParaDySeStrategy"
)


def _refuse_prompt_learning(module: nn.Module) -> None:
    """Refuse PEFT's prompt learning (prompt tuning, prefix tuning, P-tuning), at setup alike on every rank: it
    prepends learned virtual tokens to every row, or learned keys and values to every attention, where each rank holds
    a slice of every row (until 2026-11-30 it was refused at its first call, over labels it had passed itself)."""
    for sub in module.modules():
        configs = getattr(sub, "peft_config", None)
        if isinstance(configs, Mapping) and any(getattr(c, "is_prompt_learning", False) for c in configs.values()):
            kinds = sorted({str(getattr(c, "peft_type", "prompt learning")) for c in configs.values()})
            raise ValueError(
                f"{type(sub).__name__}: PEFT prompt learning ({', '.join(kinds)}) is not supported under "
                f"ParaDySeStrategy: it prepends learned virtual tokens to every row (or keys and values to every "
                f"attention), and each rank holds a slice of every row; adapt the model with LoRA (LoraConfig), which "
                f"trains as in one process, or train prompt learning with Lightning's DDP or FSDP strategy"
            )


def _refuse_router_loss(module: nn.Module) -> None:
    """Refuse the MoE auxiliary loss: at setup when a config asks for it, at run time when a call does."""
    for sub in module.modules():
        if getattr(getattr(sub, "config", None), "output_router_logits", False):
            raise ValueError(f"{type(sub).__name__}: config.output_router_logits=True: {ROUTER_LOSS_REFUSAL}")

    def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _Call(mod, args, kwargs).get("output_router_logits"):  # the same call on every rank: all raise here
            raise ValueError(f"{type(mod).__name__} called with output_router_logits=True: {ROUTER_LOSS_REFUSAL}")

    for sub in module.modules():
        if _accepts(sub.forward, "output_router_logits"):
            sub.register_forward_pre_hook(hook, with_kwargs=True)


def _rotary_embedding(module: nn.Module) -> Any:
    """The model's own rotary embedding (a module with ``inv_freq``, or a ``...RotaryEmbedding`` with a table of
    positions as GPT-J's, called with ``position_ids``, as Hugging Face models have), as ``rope(x, position_ids,
    block)`` for the blocks' example inputs; ``None`` if there is none."""
    for rope in module.modules():
        has_freq = any(n.endswith("inv_freq") for n, _ in rope.named_buffers(recurse=False))
        if (has_freq or type(rope).__name__.endswith("RotaryEmbedding")) and _accepts(rope.forward, "position_ids"):
            return functools.partial(_call_rope, rope)
    return None


def _call_rope(rope: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, block: nn.Module) -> Any:
    kwargs = {}
    if "layer_type" in inspect.signature(rope.forward).parameters:  # one rotary per layer type (Gemma 3)
        kinds = [
            str(getattr(m, attr))
            for m in block.modules()
            for attr in ("layer_type", "attention_type")
            if isinstance(getattr(m, attr, None), str)
        ]
        if kinds:
            kwargs["layer_type"] = kinds[0]
    device = next((b.device for b in rope.buffers()), x.device)  # the model's device; x is on the host copy's
    with torch.no_grad():
        out = rope(x.to(device), position_ids.to(device), **kwargs)
    return tuple(t.to(x.device) for t in out) if isinstance(out, (tuple, list)) else out.to(x.device)


def _install_grid_hooks(found: list[nn.Module], state: StepState) -> None:
    """Dimension switching: before a block whose attention runs ``dsp`` along the sharded grid axis, one
    all-to-all moves the shard to the other axis; after the last block the shard returns to the frames
    (dim 1), the layout the batch was split in. The hooks close over the step state, so every rank switches at
    the same blocks.
    """
    for i, block in enumerate(found):
        block.register_forward_pre_hook(_StepHook(state, _grid_before(first=i == 0)))
    found[-1].register_forward_hook(_StepHook(state, _grid_after))


def _anchor(state: StepState, mod: nn.Module, args: tuple[Any, ...]) -> None:
    """The hook that marks the parallelized module itself (it changes nothing)."""


def _grid_before(first: bool) -> Any:
    def hook(state: StepState, block: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        grid, ctx = state.grid, state.ctx
        attn = next(m for m in block.modules() if isinstance(m, AttentionDispatch))
        if grid is None or ctx is None:
            raise attn.unconfigured()  # between steps, or before the first
        switch = attn.op_plan is not None and attn.op_plan.mode == "dsp" and attn.attend_axis == grid.sharded
        return (grid.enter(args[0], switch, first, ctx.p, ctx.group), *args[1:])

    return hook


def _grid_after(state: StepState, block: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    grid, ctx = state.grid, state.ctx
    assert grid is not None and ctx is not None
    return grid.leave(out, ctx.p, ctx.group)


def feasible_modes(module: nn.Module, p: int, modes: list[str]) -> list[tuple[list[str], list[str]]]:
    """Per layer, the modes among ``modes`` that can run its attention and its MLP on ``p`` ranks."""
    out: list[tuple[list[str], list[str]]] = [(list(modes), list(modes)) for _ in range(n_layers(module))]
    for _, op in dispatchers(module):
        allowed = out[op.layer][0 if isinstance(op, AttentionDispatch) else 1]
        allowed[:] = [m for m in allowed if op.infeasible(m, p) is None]
    return out


def check_modes_feasible(module: nn.Module, p: int, modes: list[str]) -> None:
    """Raise, naming the layer, the op and each mode's reason, where no mode of ``modes`` can run an op on ``p``
    ranks (the same on every rank: no collective)."""
    for _, op in dispatchers(module):
        reasons = {mode: op.infeasible(mode, p) for mode in modes}
        if all(reason is not None for reason in reasons.values()):
            kind = "attention" if isinstance(op, AttentionDispatch) else "MLP"
            why = "; ".join(f"{mode}: {reason}" for mode, reason in reasons.items())
            raise ValueError(
                f"no mode of ParaDySeStrategy(modes={list(modes)}) can run layer {op.layer}'s {kind} on {p} ranks "
                f"({why}); allow another mode"
            )


def _accepts(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or (any(p.kind is p.VAR_KEYWORD for p in params.values()) and name == "shift_labels")


def _install_hooks(module: nn.Module, block_names: list[str], state: StepState) -> None:
    """Positions for the module that owns the blocks (or its nearest ancestor accepting them); labels for HF.

    The hooks close over the step state (nothing is stored on the user's modules).
    """
    owner_path = block_names[0].rsplit(".", 2)[0] if block_names[0].count(".") >= 2 else ""
    chain = [owner_path]
    while chain[-1]:
        chain.append(chain[-1].rsplit(".", 1)[0] if "." in chain[-1] else "")
    for path in reversed(chain):  # the outermost owner, before its other hooks: a cache is refused before any reads
        owner = module.get_submodule(path) if path else module
        if _parameters(owner.forward) & set(CACHE_ARGS):
            owner.register_forward_pre_hook(_cache_hook, with_kwargs=True, prepend=True)
            break
    owners = [module.get_submodule(path) if path else module for path in chain]
    _install_call_refusals(owners, state)
    for path in chain:
        owner = module.get_submodule(path) if path else module
        arg = next((a for a in ("positions", "position_ids") if _accepts(owner.forward, a)), None)
        if arg is not None:
            hook = _position_hook(arg, own_positions(owner))
            owner.register_forward_pre_hook(_StepHook(state, hook), with_kwargs=True)
            owner.register_forward_hook(_StepHook(state, _documents_out), always_call=True)
            break
    for sub in dropping_modules(module):  # ESM's embeddings: their token dropout counted over the whole row
        sub.register_forward_pre_hook(_StepHook(state, _token_dropout_hook), with_kwargs=True)
    for path in chain:
        owner = module.get_submodule(path) if path else module
        if _accepts(owner.forward, "labels") and _shifts_labels(owner):
            owner.register_forward_pre_hook(_StepHook(state, _labels_hook), with_kwargs=True)
            state.shifts_labels = True
    for path in chain:
        owner = module.get_submodule(path) if path else module
        if "attention_mask" in _parameters(owner.forward):
            owner.register_forward_pre_hook(_StepHook(state, _mask_hook), with_kwargs=True)
            break
    _install_call_streams(owners, state)
    _install_output_leaves(owners, state)  # last: its pre-hook is then the first to run


def _install_output_leaves(owners: list[nn.Module], state: StepState) -> None:
    """The hooks that hand the step check the model's outputs as leaves (:mod:`~.runtime.output_leaves`): nothing
    happens in them unless the check set :attr:`StepState.leaves`. The pre-hook first of all, the hook last and also
    after a raise."""
    for owner in owners:
        owner.register_forward_pre_hook(_StepHook(state, _leaves_in), prepend=True)
        owner.register_forward_hook(_StepHook(state, _leaves_out), always_call=True)


def _leaves_in(state: StepState, mod: nn.Module, args: tuple[Any, ...]) -> None:
    if state.leaves is not None:
        state.leaves.enter()


def _leaves_out(state: StepState, mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return None if state.leaves is None else state.leaves.exit(output)


def _install_call_streams(owners: list[nn.Module], state: StepState) -> None:
    """Each call of an owner of the blocks draws from this rank's stream in a training step (the outermost where they
    nest; :mod:`~lightning_paradyse.runtime.streams`): the pre-hook first of all, the hook also after a raise."""
    for owner in owners:
        owner.register_forward_pre_hook(_StepHook(state, _streams_in), prepend=True)
        owner.register_forward_hook(_StepHook(state, _streams_out), always_call=True)


def _streams_in(state: StepState, mod: nn.Module, args: tuple[Any, ...]) -> None:
    state.streams.enter()


def _streams_out(state: StepState, mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    state.streams.exit()


def call_streams(module: nn.Module) -> CallStreams:
    """The random streams of ``module``'s model calls (a parallelized module)."""
    return step_state(module).streams


def _install_call_refusals(owners: list[nn.Module], state: StepState) -> None:
    """Refusals of what a call of an owner of the blocks asks for that no rank holds: the attention weights (asked by
    keyword or through the model's config) and ``logits_to_keep``."""
    for owner in owners:
        owner.register_forward_pre_hook(_StepHook(state, _unsliced_input_hook), with_kwargs=True)
        if "output_attentions" in _parameters(owner.forward) or hasattr(owner, "config"):
            owner.register_forward_pre_hook(refuse_attention_weights, with_kwargs=True, prepend=True)
        if "logits_to_keep" in _parameters(owner.forward):
            owner.register_forward_pre_hook(_StepHook(state, _logits_to_keep_hook), with_kwargs=True)


def _unsliced_input_hook(state: StepState, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a call of the model on a ``[batch, seq]`` tensor of the batch that the strategy did not slice, given as
    its tokens (the first argument where the forward names it as tokens, :data:`TOKEN_KEYS`, or one of those by
    keyword): one of another length or other rows than the batch's tokens (a second loader's batch, a second task's
    sequences). Each rank would run the whole of it as if it were its slice, a model no process trains (silently so
    where its length happens to be a slice's). Another first argument (a per-row condition a forward takes before
    its tokens) is left alone. Alike on every rank: the same batch and code, tested by identity, with no read; on
    steps on groups too, whose rows keep every column where the batch holds such a tensor
    (:meth:`~lightning_paradyse.groups.units.Units.of`), so that no group slices it where another does not (but for
    a packed batch's groups, or an idle group's placeholder, whose length it would have to match)."""
    if state.ctx is None or not state.sources:
        return
    if args:
        names = _positional_names(mod.forward)
        given = args[0] if names and names[0] in TOKEN_KEYS else None
    else:
        given = next((kwargs[k] for k in TOKEN_KEYS if k in kwargs), None)
    if not isinstance(given, torch.Tensor) or given.dim() < 2 or any(given is s.local for s in state.sources):
        return
    if _in_batch(given, state):
        raise ValueError(
            f"the model was called with a tensor of the batch of shape {tuple(given.shape)} as its tokens that the "
            f"strategy did not slice: ParaDySeStrategy slices along the sequence only the [batch, seq] tensors of the "
            f"token tensor's shape (the batch's first of {TOKEN_KEYS} in a dict, its first tensor in a tuple or list, "
            f"the batch itself), and would run one of other rows or another length on every rank as if it were that "
            f"rank's slice. A batch holding sequences "
            f"of two lengths (several loaders' batches, as Lightning's CombinedLoader yields them; two tasks) is not "
            f"supported: train on one loader (join datasets with torch.utils.data.ConcatDataset), or pad the sequences "
            f"to one length in the collator and stack them as rows of one batch"
        )


CACHE_REFUSAL = (
    "decoding with a key/value cache (model.generate(), or a cache passed to a call) is not supported under "
    "ParaDySeStrategy: each rank holds a slice of the sequence and of the weights, and the rewritten attention keeps "
    "no cache; generate in one plain process from a checkpoint of this run (LightningModule.load_from_checkpoint), "
    "or call the model on the step's batch without a cache"
)


CACHE_ARGS = ("past_key_values", "cache")
"""The names of a Hugging Face model's key/value cache argument (``cache`` in recent ``transformers``)."""


def _cache_hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a call with a key/value cache (Hugging Face's ``generate`` passes one from its first call): the same
    call on every rank, so every rank raises here, before any collective of the call."""
    call = _Call(mod, args, kwargs)
    given = next((name for name in CACHE_ARGS if _is_cache(call.get(name))), None)
    if given is not None:
        raise ValueError(f"{type(mod).__name__} called with {given}=: {CACHE_REFUSAL}")


def _logits_to_keep_hook(state: StepState, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse ``logits_to_keep=`` (the last positions, or chosen ones, of the sequence the model is handed) in a step
    on a slice of every sequence, where that sequence is this rank's slice; the same call on every rank."""
    ctx, kept = state.ctx, _Call(mod, args, kwargs).get("logits_to_keep")
    if ctx is None or ctx.p == 1 or kept is None or (isinstance(kept, int) and kept == 0):
        return
    raise ValueError(
        f"{type(mod).__name__} called with logits_to_keep={kept if isinstance(kept, int) else 'a tensor'}: it keeps "
        f"positions of the sequence the model is handed, which under ParaDySeStrategy is this rank's slice of every "
        f"row ({ctx.p} ranks), not the row's; compute every position's logits (logits_to_keep=0, the default) and "
        f"select the positions through the targets (-100 elsewhere), or train with a strategy that keeps rows whole"
    )


def _is_cache(value: Any) -> bool:
    """Whether a call's cache argument holds a cache (not ``None``, nor a flag of a model's own by that name)."""
    return value is not None and not isinstance(value, bool)


def _shifts_labels(owner: nn.Module) -> bool:
    """Whether ``owner`` shifts the ``labels`` it is given (a causal LM: ``shift_labels=`` in its signature, or a
    Hugging Face ``...ForCausalLM`` / ``...LMHeadModel``). A masked-LM or classification head takes ``labels`` as
    they are, with ``**kwargs`` that would swallow ``shift_labels``: its loss is a mean over this rank's targets,
    which the strategy weighs by the rank's share of the targets."""
    if "shift_labels" in _parameters(owner.forward):
        return True
    name = type(owner).__name__
    return _accepts(owner.forward, "shift_labels") and (name.endswith("ForCausalLM") or name.endswith("LMHeadModel"))


def _parameters(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _mask_hook(
    state: StepState, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Refuse an ``attention_mask`` the modes would not honour, on every rank before the model runs.

    The modes apply the attention pattern themselves (causal or not, sliding windows, packed documents); a mask the
    model is given may only say what they already do: all ones, or the batch's own mask with the right padding of a
    causal model the strategy validated (:func:`~lightning_paradyse.runtime.slicing.find_padding`). A 4D mask, a dict of
    masks or any other 2D mask would change the attention in one process and not here.
    """
    ctx = state.ctx
    mask = _Call(mod, args, kwargs).get("attention_mask")
    if state.masked_lengths is not None:  # predictions: padding keys masked where this call's mask masks them (the
        masks = isinstance(mask, torch.Tensor) and not bool(mask.bool().all())  # batch's own: validated below)
        _mask_padding_keys(mod, state.masked_lengths if masks else None)
    if ctx is None or mask is None:
        return args, kwargs
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        problem = "a dict of masks" if isinstance(mask, dict) else f"a {getattr(mask, 'dim', lambda: '?')()}D mask"
        ok = False
    else:
        source = _trace(mask, state.sources)  # the batch's own mask, whose right padding the strategy validated
        ok = bool(mask.bool().all()) or (
            state.padding is not None and source is not None and source.key in PAD_MASK_KEYS
        )
        problem = "a 2D mask that is not the batch's attention_mask"
        if source is not None and source.key.startswith("#"):  # a tuple's or list's tensor: no name says "mask"
            problem = f"a 2D mask from a tuple or list batch ({source.key}), not a batch's named attention_mask"
    if state.sources and not _agree(ok, ctx, _device_of(args, kwargs, mod)):
        ok = False
    if not ok:
        raise ValueError(
            f"{type(mod).__name__} was called with attention_mask= {problem}: the parallel modes apply the attention "
            f"pattern themselves (causal or bidirectional, sliding windows, packed documents by doc_ids) and would "
            f"not apply this mask; pass the batch's own attention_mask (right padding of causal models is honoured; "
            f"the strategy finds it by its name, so a batch that holds one is a dict with 'attention_mask') or none, "
            f"and pack documents with doc_ids instead of block-diagonal masks"
        )
    return args, kwargs


def _mask_padding_keys(mod: nn.Module, lengths: tuple[int, ...] | None) -> None:
    """Every dispatch module under ``mod`` told each row's real tokens (``None``: attend the padding keys too). A row
    of padding alone has no key in a masked run: refused."""
    if lengths is not None and 0 in lengths:
        raise ValueError(
            f"trainer.predict: row {lengths.index(0)} of the batch is padding alone (attention_mask all 0), which a "
            f"masked run's attention has no key for; drop empty rows from the predictions' batches"
        )
    for _, op in dispatchers(mod):
        if op.ctx is not None and op.op_plan is not None:
            op.configure(dataclasses.replace(op.ctx, real_lengths=lengths), op.op_plan)


class _Call:
    """A module call's arguments bound to its ``forward`` signature: read and replace them by name."""

    def __init__(self, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = list(args), dict(kwargs)
        self.index = {name: i for i, name in enumerate(_positional_names(mod.forward)) if i < len(args)}

    def get(self, name: str) -> Any:
        """The argument ``name`` (``None`` when absent or passed as ``None``: the same to the model)."""
        if name in self.index:
            return self.args[self.index[name]]
        return self.kwargs.get(name)

    def set(self, name: str, value: Any) -> None:
        if name in self.index:
            self.args[self.index[name]] = value
        else:
            self.kwargs[name] = value

    def result(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tuple(self.args), self.kwargs


def _positional_names(forward: Any) -> tuple[str, ...]:
    """The names a call of ``forward`` (a module's bound ``forward``) may pass positionally: read from its signature
    once per function (:func:`_method_positional_names`), not on every step."""
    func = getattr(forward, "__func__", None)
    if func is None:  # not a bound method (rare): read every time
        return _signature_positional(forward)
    return _method_positional_names(func)


@functools.lru_cache(maxsize=1024)
def _method_positional_names(func: Any) -> tuple[str, ...]:
    """:func:`_positional_names` of a method's function: its positional parameters after ``self``."""
    return _signature_positional(func)[1:]


def _signature_positional(fn: Any) -> tuple[str, ...]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _agree(ok: bool, ctx: SeqContext, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank of the group (one 4-byte all-reduce, not counted as mode traffic)."""
    if ctx.p == 1:
        return ok
    flag = to_device(torch.tensor([0.0 if ok else 1.0]), device)
    with no_counting():
        return float(all_reduce_sum(flag, ctx.group)) == 0.0  # [1] summed over the group


def _position_hook(arg: str, numbering: Numbering | None) -> Any:
    """Give the model the global positions of its local tokens when the call gives none (``None`` = absent).

    Positions the call does give must be the layout's own or a slice of the batch (packed positions); anything
    else (e.g. ``arange`` of the local length) would train another model, so it is refused on every rank.

    ``numbering``: the model numbers its tokens itself from their ids
    (:func:`~lightning_paradyse.runtime.hf_positions.own_positions`, RoBERTa's family): the hook numbers the whole
    batch's ids so and hands each rank its tokens' numbers. A call given the batch's ``position_ids`` is watched for
    packed documents (:func:`_watch_documents`).
    """

    def hook(
        state: StepState, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ctx = state.ctx
        if ctx is None:
            return args, kwargs
        call = _Call(mod, args, kwargs)
        given = call.get(arg)
        device = _device_of(args, kwargs, mod)
        if given is None:
            positions = ctx.positions(device)  # [s_r] global positions of the local tokens
            if numbering is not None and arg == "position_ids":
                call.set(arg, _numbered(state, mod, call, numbering, positions, device))
            else:
                call.set(arg, positions if arg == "positions" else positions[None])  # position_ids: [1, s_r]
            return call.result()
        if not state.sources:  # the library used directly (no batch registered): the caller owns its positions
            return args, kwargs
        n = len(state.sources)
        source = _identical(given, state.sources)  # the batch's own slice: alike on every rank, no read
        if source is None:  # else by values, the same batch tensor (or the layout's positions) on every rank
            found = _trace_named(given, state.sources, POSITION_KEYS) if isinstance(given, torch.Tensor) else None
            own = found is None and isinstance(given, torch.Tensor) and _same_values(given, ctx.positions(device))
            choice = _agreed_choice(_index(found, state.sources) if found else n if own else n + 1, n + 2, ctx, device)
            source = state.sources[choice] if choice is not None and choice < n else None
            if choice is None or choice == n + 1:
                raise ValueError(
                    f"the model was called with {arg}= that are neither the global positions of this rank's tokens "
                    f"nor a tensor of the batch; leave {arg} out (or None) and ParaDySeStrategy gives the model the "
                    f"global positions, or put per-token positions in the batch (e.g. batch['{arg}'])"
                )
        if source is not None and arg == "position_ids":
            _watch_documents(state, mod, source)
        return args, kwargs

    return hook


POSITION_KEYS = ("position_ids", "positions")
"""The batch keys a model's positions are traced to first (:func:`_trace_named`)."""
TOKEN_ID_KEYS = ("input_ids",)
"""The batch keys a model's token ids are traced to first."""


def _trace_named(value: torch.Tensor, sources: tuple[BatchSource, ...], keys: tuple[str, ...]) -> BatchSource | None:
    """:func:`_trace` that, where ``value`` is no batch tensor itself, takes a batch tensor of equal values named
    ``keys`` before any other: two batch tensors (the ids and the labels) may hold equal values on one rank's slice
    and differ on another's, and every rank must find the same one."""
    same = _identical(value, sources)
    if same is not None:
        return same
    named = next((src for src in sources if src.key in keys and _is_slice(value, src)), None)
    return named if named is not None else _trace(value, sources)


def _identical(value: Any, sources: tuple[BatchSource, ...]) -> BatchSource | None:
    """The batch tensor whose slice ``value`` is itself (the same object: alike on every rank, nothing read)."""
    return next((src for src in sources if value is src.local), None)


def _index(source: BatchSource, sources: tuple[BatchSource, ...]) -> int:
    return next(i for i, src in enumerate(sources) if src is source)


def _agreed_choice(choice: int, n: int, ctx: SeqContext, device: torch.device) -> int | None:
    """``choice`` (one of ``n``) where every rank of the group made it, else ``None`` on every rank (one all-reduce
    of ``n`` numbers): a batch tensor matched by values may be another one on another rank's slice."""
    if ctx.p == 1:
        return choice
    votes = torch.zeros(n, dtype=torch.float64)
    votes[choice] = 1.0
    with no_counting():
        total = all_reduce_sum(to_device(votes, device), ctx.group).cpu()  # [n] summed over the group
    agreed = int(total.argmax())
    return agreed if float(total[agreed]) == ctx.p else None


def _agreed_trace(
    value: Any, sources: tuple[BatchSource, ...], keys: tuple[str, ...], ctx: SeqContext, device: torch.device
) -> BatchSource | None:
    """:func:`_trace_named` the same on every rank: the batch tensor ``value`` is, else the one of equal values that
    every rank finds (``None`` on every rank where they differ or none is)."""
    same = _identical(value, sources)
    if same is not None:
        return same
    found = _trace_named(value, sources, keys) if isinstance(value, torch.Tensor) else None
    choice = _agreed_choice(_index(found, sources) if found else len(sources), len(sources) + 1, ctx, device)
    return sources[choice] if choice is not None and choice < len(sources) else None


def _numbered(
    state: StepState,
    mod: nn.Module,
    call: _Call,
    numbering: Numbering,
    positions: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """The model's own numbering of this rank's tokens (:func:`_position_hook`): ``[b, s_r]`` from the whole batch's
    token ids, or ``[1, s_r]`` for a row given as embeddings. Token ids that are no tensor of the batch are refused
    on every rank (their numbering runs over the whole row, which no rank holds)."""
    ctx = state.ctx
    assert ctx is not None
    ids = call.get("input_ids")
    if ids is None:
        return (positions + numbering.embeds_start)[None]  # [1, s_r]
    source = _agreed_trace(ids, state.sources, TOKEN_ID_KEYS, ctx, device) if state.sources else None
    whole = source.whole if source is not None else (ids if ctx.p == 1 else None)
    if not _agree(whole is not None and whole.dim() == 2, ctx, device):
        raise ValueError(
            f"{type(mod).__name__} numbers its tokens from their ids over the whole row (position padding_idx + 1 "
            f"onwards, as RoBERTa does) and was called with input_ids that are not a tensor of the batch, so no rank "
            f"can number its slice of them; pass the batch's own input_ids, or put position_ids in the batch and "
            f"pass them"
        )
    assert whole is not None
    numbers = numbering.of_ids(whole)  # [b, s]: the model's own numbering of the whole rows
    return numbers.index_select(1, positions.to(numbers.device)).to(device)  # [b, s] -> [b, s_r]


def _watch_documents(state: StepState, mod: nn.Module, source: BatchSource) -> None:
    """A call given the batch's ``position_ids``: if the model's masks keep the packed documents they mark apart
    (``transformers.masking_utils`` asks for them: :func:`~lightning_paradyse.runtime.hf_positions.watch_packing`),
    the modes keep the same documents apart for this call (:func:`_apply_documents`); :func:`_documents_out` stops
    watching and undoes it after the call."""
    _stop_watching(state)
    state.packing = (id(mod), watch_packing(lambda asked: _apply_documents(state, mod, source, asked)))


def _apply_documents(state: StepState, mod: nn.Module, source: BatchSource, asked: torch.Tensor) -> None:
    """The documents Hugging Face's masks keep apart (positions that restart over the whole batch) applied by every
    dispatch module under ``mod`` for this call. Decided from the whole batch: alike on every rank, so what cannot be
    done is refused on every rank, while the model builds its masks, before any collective of the call. ``asked``:
    the ``position_ids`` the masks read, which must be the call's (the batch's)."""
    ctx = state.ctx
    if ctx is None or state.call_documents is not None:  # a model that builds several masks asks more than once
        return
    name = type(mod).__name__
    if asked is not source.local and not _agree(_is_slice(asked, source), ctx, asked.device):
        raise ValueError(
            f"{name}'s masks read packed documents from other position_ids than the batch's it was called with (a "
            f"model that derives its own, as multimodal rotary models do), which ParaDySeStrategy cannot number over "
            f"the whole row; give the model an attention_mask, or pack with doc_ids in the batch"
        )
    docs = packed_documents(source.whole)  # [b, s] document ids, or None: no position restarts (one read)
    if docs is None:
        return
    if docs.shape[0] != 1:
        raise ValueError(
            f"{name} was called with position_ids that restart in a batch of {docs.shape[0]} rows (packed documents, "
            f"which its masks keep apart in every row): ParaDySeStrategy keeps the documents of one packed row "
            f"apart; pack the documents of a batch into one row (batch size 1), as DataCollatorWithFlattening does"
        )
    if ctx.doc_ids is not None:
        if not same_documents(ctx.doc_ids, docs[0]):
            raise ValueError(
                f"{name} was called with position_ids whose restarts (packed documents, which its masks keep apart) "
                f"are not the batch's doc_ids: make the positions restart where doc_ids change, or leave one of them "
                f"out"
            )
        return
    packed = dataclasses.replace(ctx, doc_ids=docs[0].to(source.local.device), host_doc_ids=docs[0].cpu())  # [s]
    for _, op in dispatchers(mod):
        if op.op_plan is not None:
            op.configure(packed, op.op_plan)
    state.call_documents = id(mod)


def _token_dropout_hook(
    state: StepState, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """ESM's token dropout (:mod:`~lightning_paradyse.runtime.hf_token_dropout`) with the share of mask tokens of the
    whole row: the slice's embeddings made so are handed to the module as ``inputs_embeds`` and its ``input_ids``
    left out (its own dropout, which would count the slice's share, then skipped; the positions the strategy gave
    kept). Checked alike on every rank, before the blocks' collectives."""
    ctx = state.ctx
    call = _Call(mod, args, kwargs)
    ids, mask = call.get("input_ids"), call.get("attention_mask")
    if ctx is None or ctx.p == 1 or state.whole_runs or not mod.token_dropout or not isinstance(ids, torch.Tensor):
        return args, kwargs  # one rank's whole rows (a group of one, a model left whole): the module's own is exact
    if call.get("inputs_embeds") is not None:
        return args, kwargs
    sources, device = state.sources, ids.device
    source = _agreed_trace(ids, sources, TOKEN_ID_KEYS, ctx, device) if sources else None
    mask_source = _agreed_trace(mask, sources, PAD_MASK_KEYS, ctx, device) if sources and mask is not None else None
    ok = call.get("position_ids") is not None and source is not None  # alike on every rank
    if mask is not None and mask_source is None:  # a mask of ones on every rank (any other is refused before)
        ok = _agree(ok and isinstance(mask, torch.Tensor) and bool(mask.bool().all()), ctx, device)
    if not ok:
        raise ValueError(
            f"{type(mod).__name__} drops mask tokens (token_dropout) and scales each row's embeddings by its share of "
            f"them, which a rank's slice cannot count, and was called with input_ids or an attention_mask that are not "
            f"tensors of the batch, or without position_ids: pass the batch's own input_ids (and attention_mask), "
            f"or set token_dropout=False in the model's config"
        )
    assert source is not None and (mask is None or isinstance(mask, torch.Tensor))
    whole = source.whole  # [b, s] the rows' ids
    if mask is None:
        tokens: torch.Tensor | int = whole.shape[1]
    else:  # the whole rows' mask in the call's dtype (its sum's dtype sets the share's): the batch's, or ones
        whole_mask = mask_source.whole.to(mask.dtype) if mask_source is not None else mask.new_ones(whole.shape)
        tokens = whole_mask.sum(-1)  # [b, s] -> [b]
    call.set("inputs_embeds", dropped_embeddings(mod, ids, whole, tokens))  # [b, s_r, h]
    call.set("input_ids", None)
    return call.result()


def _stop_watching(state: StepState) -> None:
    if state.packing is not None:
        state.packing[1]()  # transformers' own function back
        state.packing = None


def _documents_out(state: StepState, mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    """After a call watched for packed documents (:func:`_watch_documents`): transformers' own function back, and the
    step's own layout again where the call applied documents."""
    if state.packing is not None and state.packing[0] == id(mod):
        _stop_watching(state)
    if state.call_documents != id(mod):
        return
    state.call_documents = None
    if state.ctx is not None:
        for _, op in dispatchers(mod):
            if op.op_plan is not None:
                op.configure(state.ctx, op.op_plan)


def _same_values(value: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether ``value`` (``[s_r]``, ``[1, s_r]`` or ``[b, s_r]``) holds ``positions`` in every row."""
    if value.dim() == 0 or value.shape[-1] != positions.numel() or value.is_floating_point():
        return False
    rows = value.reshape(-1, positions.numel())  # [..., s_r] -> [rows, s_r]
    return bool(torch.equal(rows, positions.expand(rows.shape[0], -1)))


def _is_slice(value: torch.Tensor, src: BatchSource) -> bool:
    """Whether ``value`` is this rank's slice of the batch tensor ``src`` (the same object, or equal values)."""
    return value is src.local or (value.shape == src.local.shape and torch.equal(value, src.local.to(value.dtype)))


def _trace(value: torch.Tensor, sources: tuple[BatchSource, ...]) -> BatchSource | None:
    """The batch tensor whose slice ``value`` is, else ``None``: the slice itself first (known without reading a
    value; on a GPU each comparison of values waits for it), then one of equal values."""
    same = _identical(value, sources)
    return same if same is not None else next((src for src in sources if _is_slice(value, src)), None)


def _labels_hook(
    state: StepState, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Hugging Face models: labels shifted over the whole sequence, and the global count of real labels.

    ``labels=`` (any tensor of the batch, e.g. the batch's ``labels`` or ``input_ids``) becomes
    ``shift_labels=`` this rank's slice of the globally shifted labels; ``shift_labels=`` a tensor of the batch is
    kept. Either way ``num_items_in_batch`` is the global count, so the model's loss is this rank's share of the
    single-process loss. Labels that cannot be traced back to the batch are refused on every rank.
    """
    ctx = state.ctx
    call = _Call(mod, args, kwargs)
    labels, shift = call.get("labels"), call.get("shift_labels")
    if ctx is None or (labels is None and shift is None):
        return args, kwargs
    ignored = call.get("ignore_index")
    if ignored is not None and int(ignored) != IGNORE_INDEX:  # a keyword of the call: alike on every rank
        raise ValueError(
            f"the model was called with ignore_index={int(ignored)}: ParaDySeStrategy counts and pads the labels it "
            f"shifts over the whole sequence with -100, the index it ignores; set the labels to ignore to -100 in "
            f"the data (labels[labels == {int(ignored)}] = -100) and leave ignore_index out"
        )
    given = shift if shift is not None else labels
    name = "shift_labels" if shift is not None else "labels"
    candidates = [s for s in state.sources if s.whole.dim() >= 2]
    # the slice itself where the step passes it (the same on every rank: the same code), else equal values: on a
    # group's rows a tuple's labels may equal its input_ids, whose whole-batch count differs
    same = isinstance(given, torch.Tensor) and any(given is s.local for s in candidates)
    found = [
        1.0 if isinstance(given, torch.Tensor) and (given is s.local if same else _is_slice(given, s)) else 0.0
        for s in candidates
    ]
    wanted = call.get("num_items_in_batch")
    counted = wanted is None or _in_batch(wanted, state)  # None, or a count the data loader put in the batch
    if not counted:  # a count made in the step: of the slice it is handed, as one process's is of the batch
        mine = next((c for c, f in zip(candidates, found) if f), None)  # the batch tensor this rank's labels slice
        found.extend(_counts_slice(wanted, given, mine, ctx) if mine is not None else (0.0, 0.0))
    agreed, tally = _agreed_source(found, candidates, ctx, _device_of(args, kwargs, mod))
    if agreed is None and isinstance(given, torch.Tensor) and given.dim() >= 2 and _in_batch(given, state):
        raise ValueError(  # alike on every rank: a tensor of the batch the strategy did not slice (every rank's own)
            f"the model was called with {name}= a tensor of the batch of {given.shape[1]} positions, where the batch's "
            f"tokens have {ctx.layout.seq_len}: ParaDySeStrategy slices the [batch, seq] tensors of the tokens' length "
            f"only, and hands the others on whole. A batch holding sequences of two lengths (chosen and rejected "
            f"answers, two tasks) is not supported: pad them to one length in the collator and stack them as rows "
            f"of one batch (rows 2i and 2i + 1, say), with one input_ids, attention_mask and labels"
        )
    if agreed is None:
        raise ValueError(
            f"the model was called with {name}= that is not a tensor of the batch (ParaDySeStrategy hands each "
            f"rank a slice of the sequence and must shift labels over the whole sequence): pass {name}=batch[...] "
            f"(e.g. labels=batch['input_ids'] or batch['labels']), or put the labels in the batch"
        )
    as_given, as_shifted = (tally[-2] == ctx.p, tally[-1] == ctx.p) if not counted else (False, False)
    if not counted and not (as_given or as_shifted):
        raise ValueError(
            "the model was called with num_items_in_batch= made in the step that is not the count of the labels "
            "it is handed (ParaDySeStrategy hands each rank a slice of the sequence, so a count made in the step "
            "is the slice's, and is then taken as the whole batch's): put the count in the batch (the data "
            "loader's count over the batches you accumulate, a tensor the strategy passes on whole), or leave "
            "num_items_in_batch out (each batch's own count)"
        )
    whole = agreed.whole if shift is not None else agreed.shifted_whole()  # [b, s] shifted globally
    if state.padding is not None:
        check_padding_targets(state.padding, whole, name)
    items = agreed.items(whole) if shift is None else int((whole != IGNORE_INDEX).sum())
    if as_given and not as_shifted:  # the step counted the labels as given: the whole batch's, counted alike
        items = agreed.given_items()
    local = to_device(ctx.layout.shard(whole, ctx.rank), given.device)  # [b, s] -> [b, s_r]
    call.set("shift_labels", local)
    if wanted is None or not counted:  # none, or the slice's: the whole batch's count
        call.set("num_items_in_batch", to_device(torch.tensor(max(items, 1)), local.device))
    state.labels_consumed = True  # the model's loss: this rank's share of a sum over the batch's labels
    return call.result()


def _in_batch(value: Any, state: StepState) -> bool:
    """Whether ``value`` is a tensor of the batch the step was handed that was not sliced (a count the data loader
    gives: the same on every rank, as the batch's digest holds)."""
    if not isinstance(value, torch.Tensor) or any(value is src.local for src in state.sources):
        return False
    found: list[bool] = []
    apply_to_collection(state.batch, torch.Tensor, lambda t: found.append(t is value))
    return any(found)


def _counts_slice(wanted: Any, given: torch.Tensor, source: BatchSource, ctx: SeqContext) -> tuple[float, float]:
    """Whether a ``num_items_in_batch`` made in the step is the count of the labels this rank is handed (``given``,
    the slice of ``source``), as given and as the model shifts them over the whole sequence (1.0 each where it is)."""
    value = float(wanted)  # one read of the count the step made
    as_given = value == int((given != IGNORE_INDEX).sum())
    shifted = ctx.layout.shard(source.shifted_whole(), ctx.rank)  # [b, s] -> [b, s_r]
    return float(as_given), float(value == int((shifted != IGNORE_INDEX).sum()))


def _agreed_source(
    found: list[float], candidates: list[BatchSource], ctx: SeqContext, device: torch.device
) -> tuple[BatchSource | None, list[float]]:
    """The candidate every rank traced its labels to (one small all-reduce of ``found``, whose entries after the
    candidates' are further votes), or ``None``; and the votes summed over the ranks."""
    if not candidates:
        return None, found
    votes = to_device(torch.tensor(found), device)
    if ctx.p > 1:
        with no_counting():
            votes = all_reduce_sum(votes, ctx.group)  # [n] ranks that voted for each entry
    tally = votes.tolist()
    return next((c for c, v in zip(candidates, tally) if v == ctx.p), None), tally


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any], mod: nn.Module) -> torch.device:
    """The device of the call's first tensor, else of the module's first parameter (else the CPU)."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return next((p.device for p in mod.parameters()), torch.device("cpu"))


# --------------------------------------------------------------------------------------------------
# Per batch
# --------------------------------------------------------------------------------------------------


_OPS: weakref.WeakKeyDictionary[nn.Module, list[tuple[str, OpDispatch]]] = weakref.WeakKeyDictionary()
"""Modules -> their dispatch modules: found by one walk, then read on every step (a rewritten model's structure
is fixed; :func:`parallelize` forgets what it found before)."""


_REPLICATED: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Parameter, ...]] = weakref.WeakKeyDictionary()
"""Modules -> their replicated parameters (:func:`replicated_parameters`), found by one walk like :data:`_OPS`."""


_FITTING: weakref.WeakKeyDictionary[nn.Module, set[tuple[Plan, int]]] = weakref.WeakKeyDictionary()
"""Modules -> the ``(plan, group size)`` pairs :func:`check_plan` found to fit (forgotten with the walks)."""


_CAUSAL: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
"""Modules -> :func:`is_causal` (forgotten with the walks)."""


def forget_walks() -> None:
    """Forget what the walks found (:func:`dispatchers`, :func:`replicated_parameters`, the plans
    :func:`check_plan` passed): after a rewrite, and when a fit sets a model up (its parameters may have been
    replaced since the last fit)."""
    _OPS.clear()
    _REPLICATED.clear()
    _FITTING.clear()
    _CAUSAL.clear()


def dispatchers(module: nn.Module) -> list[tuple[str, OpDispatch]]:
    """Every dispatch module with its name, in model order (the module walked once, then remembered)."""
    found = _OPS.get(module)
    if found is None:
        found = [(n, m) for n, m in module.named_modules() if isinstance(m, OpDispatch)]
        _OPS[module] = found
    return found


def n_layers(module: nn.Module) -> int:
    """Number of rewritten blocks."""
    return len(step_state(module).blocks)


def attention_windows(module: nn.Module) -> list[int | None]:
    """Per layer, the causal sliding window the modes apply to its attention (``None``: global)."""
    return [op.spec.window for _, op in dispatchers(module) if isinstance(op, AttentionDispatch)]


def is_causal(module: nn.Module) -> bool:
    """Whether any block is (or may be, when decided per call) causal: the balanced layout is then used (the
    rewritten blocks' roles: found once, with the walks)."""
    known = _CAUSAL.get(module)
    if known is None:
        attn = [m for _, m in dispatchers(module) if isinstance(m, AttentionDispatch)]
        known = _CAUSAL[module] = any(m.roles.causal is None or m.roles.causal for m in attn)
    return known


def check_plan(module: nn.Module, plan: Plan, p: int) -> None:
    """Raise a ``ValueError`` (before any collective) if ``plan`` does not fit the model or the group.

    A plan that fits is remembered per module and group size (:data:`_FITTING`): the answer depends on the
    rewritten model's structure alone, so the checks of a step (its groups' plans, then :func:`configure`) walk
    the dispatch modules once per new plan, not every step."""
    known = _FITTING.get(module)
    if known is not None and (plan, p) in known:
        return
    layers = n_layers(module)
    if len(plan) != layers:
        raise ValueError(f"the plan has {len(plan)} layers but the model has {layers} blocks")
    for _, op in dispatchers(module):
        layer = plan.layers[op.layer]
        mode = layer.attention.mode if isinstance(op, AttentionDispatch) else layer.mlp.mode
        reason = op.infeasible(mode, p)
        if reason:
            raise ValueError(f"layer {op.layer}: {reason}; choose another mode for this layer")
    _FITTING.setdefault(module, set()).add((plan, p))


def configure(module: nn.Module, ctx: SeqContext, plan: Plan) -> None:
    """Set the batch's layout and plan on every dispatch module (after :func:`check_plan`)."""
    check_plan(module, plan, ctx.p)
    state = step_state(module)
    state.ctx, state.sources, state.padding, state.labels_consumed = ctx, (), None, False
    state.masked_lengths, state.batch, state.whole_runs, state.call_documents = None, None, [], None
    _stop_watching(state)
    if state.grid is not None:
        if ctx.layout.balanced or ctx.doc_ids is not None:
            raise ValueError(
                "a grid model (axes=2) splits its frames in contiguous chunks and takes no packed documents: use "
                "bidirectional attention (no causal mask) and one sequence of frames per batch row"
            )
        state.grid.reset(ctx.layout.seq_len)
    for _, op in dispatchers(module):
        layer = plan.layers[op.layer]
        op.configure(ctx, layer.attention if isinstance(op, AttentionDispatch) else layer.mlp)


def configure_whole(module: nn.Module, batch: Any, info: BatchInfo, plan: Plan) -> Any:
    """A whole run on this rank (a group of one holding every weight): ``info``'s layout for one rank and ``plan``
    configured, the batch's sources set; returns the batch as one process holds it."""
    configure(module, SeqContext(info.layout, None, info.doc_ids, False, info.host_doc_ids), plan)
    whole, sources = shard_batch(batch, info, 0)  # the whole batch: [b, s, ...] as given
    set_step_sources(module, sources, info.padding, whole)
    return whole


def predict_padding(module: nn.Module, lengths: tuple[int, ...] | None) -> None:
    """A whole run's right-padded rows (:attr:`StepState.masked_lengths`), after :func:`configure`."""
    step_state(module).masked_lengths = lengths


def unconfigure(module: nn.Module) -> None:
    """End a step: no layout or plan on the hooks and dispatch modules until the next :func:`configure`, so that a
    call of the model between steps raises, naming why, instead of running on the last step's layout."""
    step_state(module).ctx = None
    for _, op in dispatchers(module):
        op.unconfigure()


def set_step_sources(
    module: nn.Module, sources: tuple[BatchSource, ...], padding: torch.Tensor | None = None, batch: Any = None
) -> None:
    """The batch tensors the step was handed and their global originals (labels are traced back to them), the
    batch's right padding, and the batch the step was handed."""
    state = step_state(module)
    state.sources, state.padding, state.labels_consumed, state.batch = sources, padding, False, batch


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
    """Parameters every rank holds whole (their gradients are summed over the group); the module walked once, then
    remembered (read on every step)."""
    found = _REPLICATED.get(module)
    if found is None:
        sharded = set(shard_sources(module))
        found = tuple(p for n, p in module.named_parameters() if n not in sharded)
        _REPLICATED[module] = found
    return iter(found)


@dataclass(frozen=True)
class ReplicatedGrads:
    """This rank's gradients of the replicated parameters as one flat message (what the group sums).

    ``message`` is ``[numel + n]``: every gradient flattened in ``reduce_dtype`` (bf16 summed in float32; a gradient
    missing on this rank, e.g. an idle group's, as zeros), then one presence flag per parameter. Every rank builds
    the same-sized message whatever gradients it holds; :meth:`apply` takes the sum of every rank's.
    """

    params: tuple[nn.Parameter, ...]
    message: torch.Tensor
    own: tuple[bool, ...] = ()
    """This rank's presence flags, on the host (the message's last ``n`` values)."""

    @staticmethod
    def of(module: nn.Module, params: tuple[nn.Parameter, ...] | None = None) -> ReplicatedGrads:
        """The message of ``module``'s replicated parameters that require a gradient (``params``: those, listed by
        the caller)."""
        if params is None:
            params = tuple(w for w in replicated_parameters(module) if w.requires_grad)
        if not params:
            return ReplicatedGrads((), torch.zeros(0))
        dtype = functools.reduce(torch.promote_types, {w.dtype for w in params}, torch.float32)  # bf16 sums in fp32
        own = tuple(w.grad is not None for w in params)
        with torch.no_grad():
            present = to_device(torch.tensor(own, dtype=dtype), params[0].device)  # [n]
            grads = [
                w.grad.reshape(-1).to(dtype) if w.grad is not None else w.new_zeros(w.numel(), dtype=dtype)
                for w in params
            ]
            return ReplicatedGrads(params, torch.cat([*grads, present]), own)  # [numel + n]

    def apply(self, total: torch.Tensor) -> None:
        """Set every gradient to its part of ``total`` (the sum of every rank's message); one missing on every rank
        stays ``None``. When this rank holds every gradient, so does the sum; only a rank that lacks one reads the
        summed presence flags on the host (a synchronisation on a GPU: an idle group's rank, an unused parameter)."""
        at = 0
        seen: Sequence[float] = self.own
        if not all(self.own):
            seen = total[-len(self.params) :].tolist()
        for w, present in zip(self.params, seen):
            n = w.numel()
            if present:  # a view of the sum (its own dtype's: a half-precision gradient is rounded into a copy)
                part = total[at : at + n].view(w.shape)  # [numel + n] -> the parameter's shape
                w.grad = part if part.dtype == w.dtype else part.to(w.dtype)
            at += n


def _opaque_ops(module: nn.Module) -> list[OpaqueDispatch]:
    """Every mixture of experts run whole (:class:`~.graph.dispatch.OpaqueDispatch`) in ``module``."""
    return [op for _, op in dispatchers(module) if isinstance(op, OpaqueDispatch)]


def settle_opaque_grads(module: nn.Module, group: Group) -> None:
    """The shards of a mixture of experts that no rank's tokens used lose their (zero) gradient
    (:meth:`~.graph.dispatch.OpaqueDispatch.settle`): every such op's flags in one small all-reduce and one read on
    the host, nothing for other models."""
    ops = _opaque_ops(module)
    if not ops:
        return
    flags = [op.used_flags() for op in ops]
    used = torch.cat(flags)  # [sum of n_params]
    if group_size(group) > 1:
        device = next(p for op in ops for p in op.parameters()).device
        with no_counting():  # control flags, not mode traffic
            used = all_reduce_sum(to_device(used, device), group)  # [sum of n_params], summed over the group
    counts = used.tolist()
    start = 0
    for op, own in zip(ops, flags):
        op.settle(counts[start : start + own.numel()])
        start += own.numel()


def opaque_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """The shards of every mixture of experts run whole: after each backward, those no rank's tokens used lose their
    gradient (:func:`settle_opaque_grads`)."""
    for op in _opaque_ops(module):
        yield from op.parameters()


def reduce_replicated_grads(module: nn.Module, group: Group) -> None:
    """Sum the gradients of replicated parameters over the group, in one coalesced all-reduce.

    A gradient missing on some ranks (a rank that ran no forward, e.g. an idle group of
    :mod:`lightning_paradyse.groups`) counts as zero there; one missing on every rank stays ``None``. Every
    rank sends the same-sized message, whatever gradients it holds. First, the shards of a mixture of experts that
    no rank's tokens used lose their (zero) gradient (:func:`settle_opaque_grads`).
    """
    settle_opaque_grads(module, group)
    if group_size(group) == 1:
        return
    grads = ReplicatedGrads.of(module)
    if grads.params:
        with torch.no_grad():
            grads.apply(all_reduce_sum(grads.message, group))  # [numel + n] summed over the group


def gather_param_like(value: torch.Tensor, ref: ShardRef, group: Group) -> torch.Tensor:
    """The whole piece behind a shard (in the plain parameter's row view, :func:`~.dispatch.cut_piece`), from every
    rank's ``value`` shaped like the shard; :func:`~.dispatch.join_pieces` makes the plain parameter of them."""
    return all_gather_rows(value, row_sizes(ref.source.rows, group_size(group)), group)  # [rows/p, k] -> [rows, k]


def shard_param_like(plain: torch.Tensor, ref: ShardRef, group: Group) -> torch.Tensor:
    """This rank's shard of a plain parameter (or a tensor shaped like it): the inverse of :func:`gather_param_like`."""
    return shard_rows(cut_piece(plain, ref.source), group_size(group), group_rank(group))


def _value(param: torch.Tensor, grads: bool) -> torch.Tensor | None:
    return param.grad if grads else param.detach()


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Every second (third, ...) name of a shared parameter -> the name ``named_parameters`` keeps (the first).

    Tied weights (an LM head sharing the token embedding) are one parameter under two names: ``state_dict``
    lists both, ``named_parameters`` only the first.
    """
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            out[name] = first[id(param)]
        else:
            first[id(param)] = name
    return out


def consolidated(module: nn.Module, group: Group, grads: bool = False, host: bool = False) -> dict[str, torch.Tensor]:
    """The plain model's state dict (or gradients) from a parallelized module, on every rank.

    Names are relative to ``module``; the result loads into the unparallelized module with
    ``load_state_dict``: buffers and every name of a tied parameter are included when ``grads`` is false
    (gradients are keyed like ``named_parameters``, tied parameters once). ``host``: every tensor on the host, each
    gathered piece moved there as soon as it is gathered (a GPU holds one gathered parameter at a time: checkpoints).
    """
    values = {name: _value(param, grads) for name, param in module.named_parameters()}
    out = consolidated_like(module, {n: v for n, v in values.items() if v is not None}, group, host=host)
    if not grads:
        shards, replicated = shard_sources(module), replicated_sources(module)
        place = (lambda t: t.cpu()) if host else (lambda t: t)
        for alias, name in tied_aliases(module).items():
            key = shards[name].plain if name in shards else replicated.get(name, name)
            if key in out:
                out[replicated.get(alias, alias)] = out[key]
        persistent = set(module.state_dict(keep_vars=True))
        out.update({n: place(b.detach()) for n, b in module.named_buffers() if n in persistent})
    return out


def consolidated_like(
    module: nn.Module, tensors: Mapping[str, torch.Tensor], group: Group, host: bool = False
) -> dict[str, torch.Tensor]:
    """Tensors shaped like this rank's parameters (keyed as ``module.named_parameters()`` names them: a running
    average the module keeps) as the plain model's: whole, under its names, on every rank (a collective per shard:
    every rank passes the same keys). Keys that name no parameter are refused. ``host``: each gathered piece moved to
    the host as soon as it is gathered (a GPU holds one at a time), as :func:`consolidated` does."""
    names = [name for name, _ in module.named_parameters()]
    unknown = sorted(set(tensors) - set(names))
    if unknown:
        raise KeyError(
            f"{unknown[:3]} name no parameter of the module: pass tensors keyed as the module's named_parameters() "
            "names them in the fit (each shaped like that parameter)"
        )
    shards, replicated = shard_sources(module), replicated_sources(module)
    pieces: dict[str, list[tuple[ShardSource, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    place = (lambda t: t.cpu()) if host else (lambda t: t)
    for name in names:  # the module's order on every rank: the gathers pair
        if name not in tensors:
            continue
        ref = shards.get(name)
        if ref is None:
            out[replicated.get(name, name)] = place(tensors[name])
        else:
            piece = place(gather_param_like(tensors[name], ref, group))
            pieces.setdefault(ref.plain, []).append((ref.source, piece))
    for plain, parts in pieces.items():
        out[plain] = join_pieces(parts)
    return out


def sharded_like(module: nn.Module, tensors: Mapping[str, torch.Tensor], group: Group) -> dict[str, torch.Tensor]:
    """The inverse of :func:`consolidated_like`: tensors shaped like the plain model's parameters, under its names,
    as this rank's (keyed as ``module.named_parameters()`` names them; nothing moves between ranks), each where its
    parameter is. A parameter whose plain tensor is absent is left out."""
    shards, replicated = shard_sources(module), replicated_sources(module)
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        ref = shards.get(name)
        plain = ref.plain if ref is not None else replicated.get(name, name)
        if plain in tensors:
            mine = tensors[plain] if ref is None else shard_param_like(tensors[plain], ref, group)
            out[name] = mine.to(param.device, copy=True)
    return out


def load_consolidated(module: nn.Module, state: dict[str, torch.Tensor], group: Group, strict: bool = True) -> None:
    """Load a plain state dict (as :func:`consolidated` returns) into the shards of a parallelized module.

    A tied parameter is read under its first name, or under another of its names when the first is absent;
    its other names count as used (a plain checkpoint lists every name, an older one of ours only the first).
    """
    shards, replicated = shard_sources(module), replicated_sources(module)
    names: dict[str, list[str]] = {}  # first name -> every name of the parameter, plain
    for alias, name in tied_aliases(module).items():
        names.setdefault(name, [name]).append(replicated.get(alias, alias))
    used: set[str] = set()
    missing: list[str] = []
    with torch.no_grad():
        for name, param in module.named_parameters():
            ref = shards.get(name)
            wanted = ref.plain if ref is not None else replicated.get(name, name)
            keys = [wanted, *names.get(name, [name])[1:]]
            key = next((k for k in keys if k in state), None)
            if key is None:
                missing.append(wanted)
                continue
            if ref is not None:
                param.copy_(shard_param_like(state[key], ref, group))
            else:
                param.copy_(state[key])
            used.update(keys)
        for name, buf in module.named_buffers():
            if name in state:
                buf.copy_(state[name])
                used.add(name)
    unexpected = sorted(set(state) - used)
    if strict and (missing or unexpected):
        raise KeyError(f"state dict does not match the model: missing {sorted(set(missing))}, unexpected {unexpected}")


# --------------------------------------------------------------------------------------------------
# Whole-model quantities over the shards
# --------------------------------------------------------------------------------------------------


def sharded_parameter_ids(module: nn.Module) -> set[int]:
    """``id`` of every parameter held as a 1/p shard (the others are replicated)."""
    shards = shard_sources(module)
    return {id(p) for n, p in module.named_parameters() if n in shards}


def grad_norm(
    parameters: Iterator[torch.Tensor] | list[torch.Tensor], sharded: set[int], group: Group, norm_type: float = 2.0
) -> torch.Tensor:
    """The norm of the *whole* model's gradients, the same on every rank (a collective over the group).

    Shards contribute their part (summed over the group); replicated parameters, whose gradients every rank holds
    whole after :func:`reduce_replicated_grads`, count once.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]
    return tensor_norm(grads, [id(p) in sharded for p in params], group, norm_type)


def tensor_norm(tensors: list[torch.Tensor], shard: list[bool], group: Group, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole tensors of which ``tensors`` hold this rank's part (a collective over the group).

    ``shard[i]``: ``tensors[i]`` is one rank's piece of a tensor split over the group (its part summed over the
    group); otherwise every rank holds it whole and it counts once.
    """
    if not tensors:
        return torch.tensor(0.0)
    if norm_type == float("inf"):
        per = torch.stack([t.detach().abs().max().to(tensors[0].dtype) for t in tensors])  # [n]
        shard_max = torch.stack([v for v, s in zip(per, shard) if s]).max() if any(shard) else per.new_zeros(())
        rest = torch.stack([v for v, s in zip(per, shard) if not s]).max() if not all(shard) else per.new_zeros(())
        if group_size(group) > 1:
            every = all_gather_rows(shard_max.reshape(1), [1] * group_size(group), group)  # [1] -> [p]
            shard_max = every.max()
        return torch.maximum(shard_max, rest)
    powers = torch.stack([torch.linalg.vector_norm(t.detach(), norm_type) ** norm_type for t in tensors])  # [n]
    flags = torch.tensor([float(s) for s in shard], dtype=powers.dtype, device=powers.device)
    shard_part = (powers * flags).sum()
    if group_size(group) > 1:
        shard_part = all_reduce_sum(shard_part.reshape(1), group)[0]  # [1] summed over the group
    return (shard_part + (powers * (1 - flags)).sum()) ** (1.0 / norm_type)


def clip_grad_norm(
    parameters: Iterator[torch.Tensor] | list[torch.Tensor],
    max_norm: float,
    sharded: set[int],
    group: Group,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model: the global norm, the same coefficient everywhere."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, sharded, group, float(norm_type))
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite: it cannot be clipped")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        assert p.grad is not None
        p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
    return total


DIGEST_CHUNK = 1 << 22
"""Elements squared at a time by :func:`replica_digest` (a transient of 16-32 MiB, whatever the parameter)."""


def replica_digest(module: nn.Module) -> torch.Tensor:
    """``[n, 2]`` float64: sum and sum of squares of every replicated parameter (equal on every rank when they
    received the same updates). Sums accumulate in float64 without a float64 copy of the parameter; squares are
    taken a chunk at a time."""
    params = [p.detach() for p in replicated_parameters(module)]
    if not params:
        return torch.zeros(0, 2, dtype=torch.float64)
    rows = []
    for p in params:
        flat = p.reshape(-1)
        wide = torch.promote_types(p.dtype, torch.float32)  # bf16 squared in float32; float64 stays float64
        squares = sum(c.to(wide).square().sum(dtype=torch.float64) for c in flat.split(DIGEST_CHUNK))
        rows.append(torch.stack([flat.sum(dtype=torch.float64), torch.as_tensor(squares, device=p.device)]))
    return torch.stack(rows)  # [n, 2] on the parameters' device


def replicas_differ(module: nn.Module, group: Group) -> list[str]:
    """Names of replicated parameters that differ between ranks (a collective: one small all-gather)."""
    p = group_size(group)
    if p == 1:
        return []
    digest = replica_digest(module)
    every = all_gather_rows(digest.to(collective_device(group))[None], [1] * p, group).cpu()  # [n, 2] -> [p, n, 2]
    names = [n for n, _ in _replicated_named(module)]
    differ = (every != every[:1]).any(dim=2).any(dim=0)  # [n]
    return [name for name, bad in zip(names, differ.tolist()) if bad]


def _replicated_named(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    sharded = set(shard_sources(module))
    return [(n, p) for n, p in module.named_parameters() if n not in sharded]
