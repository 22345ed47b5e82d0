"""Multi-variant op modules: they own an op's 1/p shards and run it in the mode the plan names.

The rewrite (:mod:`lightning_paradyse.graph.rewrite`) replaces the sub-module that computes a block's
attention (``attn``, ``self_attn``, an ``nn.MultiheadAttention``) by an :class:`AttentionDispatch`
and the one that computes its MLP by an :class:`MlpDispatch` (or, when the block computes the MLP
inline, its two linears by :class:`ColumnDispatch` / :class:`RowDispatch`). The block's own code —
norms, residual additions — keeps running unchanged on the local tokens of the unified layout.

Each dispatch module holds one variant per mode (the mode's resharding collectives are inside the
mode), all reading the same shard parameters; :meth:`configure` selects the variant for the next
call, which is a table look-up: no weight moves.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_paradyse.distributed.comm import (
    Group,
    gather_seq,
    gather_weight,
    group_rank,
    group_size,
    no_counting,
    scatter_seq,
)
from lightning_paradyse.distributed.devices import to_device
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.graph.adapters import LoraParts, base_layer, lora_parts, switch_for
from lightning_paradyse.graph.program import Program
from lightning_paradyse.graph.roles import (
    AttentionRoles,
    MlpRoles,
    is_conv1d,
    no_activation,
    out_features,
    projection_weight,
)
from lightning_paradyse.graph.trace import ArgRef
from lightning_paradyse.modes import GRID_MODES, get_mode
from lightning_paradyse.modes.base import Autocast, add_bias
from lightning_paradyse.modes.dsp import GridState
from lightning_paradyse.modes.plan import OpPlan
from lightning_paradyse.modes.specs import (
    Adapter,
    AttnSpec,
    AttnWeights,
    MlpSpec,
    MlpWeights,
    SeqContext,
    row_sizes,
    shard_rows,
)
from lightning_paradyse.modes.zero3 import zero3_linear, zero3_linear_t


class SliceLengthError(ValueError):
    """A dispatch module handed a tensor whose second dimension is not this rank's slice of the sequence."""


@dataclass(frozen=True)
class ShardSource:
    """Where a shard parameter comes from in the plain block.

    The plain parameter's *row view* is the parameter, or its transpose when ``transposed``; the piece is some of
    its rows (:func:`cut_piece`); the shard is this rank's 1/p of the piece's rows."""

    name: str
    """Name of the plain parameter, relative to the block (e.g. ``self_attn.in_proj_weight``)."""
    transposed: bool
    """The row view is the plain parameter transposed: row-parallel ``o`` / ``down`` of an ``nn.Linear``, or
    column-parallel q/k/v/up of a ``Conv1D`` (whose weight is stored ``[in, out]``)."""
    rows: int
    """Rows of the piece this shard is 1/p of."""
    offset: int = 0
    """First row of the piece inside the row view (q/k/v packed in one ``in_proj_weight``)."""
    index: tuple[int, ...] | None = None
    """The rows of the row view that make the piece, in its order, when they are not ``offset .. offset + rows``
    (a part of a fused projection: GPT-NeoX interleaves q, k and v head by head)."""

    def row_index(self) -> torch.Tensor:
        if self.index is not None:
            return torch.tensor(self.index)
        return torch.arange(self.offset, self.offset + self.rows)


def cut_piece(plain: torch.Tensor, source: ShardSource) -> torch.Tensor:
    """The piece of a plain parameter (or of a tensor shaped like it) a shard is 1/p of, in its row view."""
    view = plain.t() if source.transposed else plain
    if source.index is None:
        return view.narrow(0, source.offset, source.rows)
    return view.index_select(0, to_device(source.row_index(), view.device))  # [rows_total, k] -> [rows, k]


def join_pieces(parts: list[tuple[ShardSource, torch.Tensor]]) -> torch.Tensor:
    """The plain parameter from all of its pieces (the inverse of :func:`cut_piece` over every piece)."""
    total = sum(src.rows for src, _ in parts)
    first = parts[0][1]
    view = first.new_empty((total, *first.shape[1:]))
    seen = torch.zeros(total, dtype=torch.bool)
    for src, piece in parts:
        index = src.row_index()
        view.index_copy_(0, to_device(index, view.device), piece)  # [rows, k] into [rows_total, k]
        seen[index] = True
    if not bool(seen.all()) or len({src.transposed for src, _ in parts}) != 1:
        raise ValueError(f"the pieces of {parts[0][0].name} do not make the whole parameter")
    return view.t().contiguous() if parts[0][0].transposed else view


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    value = getattr(module, name, None)
    return value if isinstance(value, torch.Tensor) else None


class OpDispatch(nn.Module):
    """Common part of the dispatch modules: shard parameters, their sources, the configured variant."""

    def __init__(self, core_path: str, layer: int) -> None:
        super().__init__()
        self.core_path = core_path
        """Path of the replaced sub-module inside the block."""
        self.layer = layer
        """Index of the block in the model (the plan's layer index)."""
        self.sources: dict[str, ShardSource] = {}
        self.replicated_sources: dict[str, str] = {}
        self.ctx: SeqContext | None = None
        self.op_plan: OpPlan | None = None
        self.grid: GridState | None = None
        """Set for models whose hidden states are a grid (``axes=2``): the step's grid sharding."""
        self.group_shards: dict[str, torch.Tensor] | None = None
        """While a step runs on a group smaller than the shard group: this rank's shards for that group,
        read instead of the parameters of the same name (see :mod:`lightning_paradyse.groups`)."""
        self.adapter_params: dict[str, tuple[str, str, str, float]] = {}
        """LoRA adapters by projection name (``q``, ``o_t``, ``up``, ...): the names of the parameters holding their
        ``A`` and ``B`` (laid out as :class:`~.specs.Adapter` says; the parts of one fused projection share its
        whole ``A``), of their switch's sub-module (:func:`~lightning_paradyse.graph.adapters.switch_for`), and their
        ``scale``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or "sources" not in self.__dict__:
                raise
            held = ", ".join(s.name for s in self.__dict__["sources"].values()) or "none"
            raise AttributeError(
                f"{type(self).__name__} has no attribute {name!r}: ParaDySeStrategy rewrote the module at "
                f"{self.__dict__['core_path']!r} of layer {self.__dict__['layer']} into this one, which holds this "
                f"rank's shards of its weights under other names (of {held}). To read whole weights, save a "
                "checkpoint (trainer.save_checkpoint gathers them under the model's own names) and load it in one "
                "plain process, or reach them before the fit starts"
            ) from None

    def add_shard(self, name: str, plain: torch.Tensor | None, source: ShardSource, group: Group) -> None:
        """Register this rank's rows of the piece ``source`` cuts from the plain parameter as parameter ``name``."""
        if plain is None:
            self.register_parameter(name, None)
            return
        piece = cut_piece(plain.detach(), source)
        shard = shard_rows(piece, group_size(group), group_rank(group)).contiguous()
        self.register_parameter(name, nn.Parameter(shard, requires_grad=plain.requires_grad))
        self.sources[name] = source

    def add_projection(
        self, name: str, bias_name: str, module: nn.Module, path: str, rows: tuple[int, ...] | None, group: Group
    ) -> int:
        """A column-parallel projection (q/k/v/up/gate; ``rows``: its part of a fused one): weight and bias shards,
        and a LoRA layer's adapter (``B`` sharded with the weight's rows, ``A`` whole). Returns its output
        features."""
        conv = is_conv1d(module)
        n = out_features(module) if rows is None else len(rows)
        parts, base = lora_parts(module), base_layer(module)
        at = path if parts is None else f"{path}.base_layer"
        src = ShardSource(f"{at}.weight", conv, n, index=rows)
        self.add_shard(name, _tensor(base, "weight"), src, group)
        self.add_shard(bias_name, _tensor(base, "bias"), replace(src, name=f"{at}.bias", transposed=False), group)
        if parts is not None:
            b_src = ShardSource(f"{path}.lora_B.{parts.adapter}.weight", False, n, index=rows)  # B [out, r]: rows
            self.add_shard(f"{name}_lora_b", parts.b, b_src, group)
            a = self._replicated_once(f"{name}_lora_a", parts.a, f"{path}.lora_A.{parts.adapter}.weight")
            self.adapter_params[name] = (a, f"{name}_lora_b", self._switch(module, path, parts), parts.scale)
        return n

    def add_row_projection(self, name: str, bias_name: str, module: nn.Module, path: str, group: Group) -> None:
        """A row-parallel projection (o/down): the transposed weight's shards, the bias replicated; a LoRA layer's
        ``A`` transposed sharded with the weight's input features, its ``B`` whole."""
        rows = int(projection_weight(module).shape[1])
        parts, base = lora_parts(module), base_layer(module)
        at = path if parts is None else f"{path}.base_layer"
        src = ShardSource(f"{at}.weight", not is_conv1d(module), rows)
        self.add_shard(name, _tensor(base, "weight"), src, group)
        self.add_replicated(bias_name, _tensor(base, "bias"), f"{at}.bias")
        if parts is not None:
            a_src = ShardSource(f"{path}.lora_A.{parts.adapter}.weight", True, rows)  # A [r, in] -> A_t [in, r]
            self.add_shard(f"{name}_lora_a", parts.a, a_src, group)
            b = self._replicated_once(f"{name}_lora_b", parts.b, f"{path}.lora_B.{parts.adapter}.weight")
            self.adapter_params[name] = (f"{name}_lora_a", b, self._switch(module, path, parts), parts.scale)

    def _replicated_once(self, name: str, value: torch.Tensor, source: str) -> str:
        """A replicated parameter registered once per plain parameter (the parts of a fused projection share its
        adapter's ``A``: one parameter, whose gradient sums the parts'); returns its name."""
        held = next((n for n, src in self.replicated_sources.items() if src == source), None)
        if held is None:
            self.add_replicated(name, value, source)
        return held or name

    def _switch(self, layer: nn.Module, path: str, parts: LoraParts) -> str:
        """The name of the switch of the LoRA layer at ``path`` (one per layer: a fused projection's parts share
        it)."""
        name = "lora_switch_" + path.replace(".", "_")
        if name not in self._modules:
            self.add_module(name, switch_for(layer, parts))
        return name

    def adapters(self) -> dict[str, Adapter]:
        """The LoRA adapters whose branch runs now (their switch on: peft's ``disable_adapter()`` turns it off)."""
        out = {}
        for name, (a, b, switch, scale) in self.adapter_params.items():
            if self._modules[switch].adapted:  # type: ignore[union-attr]
                out[name] = Adapter(self.req(a), self.req(b), scale)
        return out

    def adopt(self, core: nn.Module, path: str) -> None:
        """Keep ``core``'s sub-module at ``path`` (relative) under the same path (the block's own code calls it)."""
        parent: nn.Module = self
        *outer, last = path.split(".")
        for name in outer:
            if name not in parent._modules:
                if hasattr(parent, name):
                    raise ValueError(f"{self.core_path}.{path}: {name} clashes with the dispatch's own attributes")
                parent.add_module(name, nn.Module())
            child = parent._modules[name]
            assert child is not None
            parent = child
        if hasattr(parent, last) and parent._modules.get(last) is not core.get_submodule(path):
            raise ValueError(f"{self.core_path}.{path}: a sub-module of this name clashes with the dispatch's own")
        parent.add_module(last, core.get_submodule(path))

    def run_tail(self, tail: Program | None, refs: tuple[ArgRef, ...], y: torch.Tensor, args: Any, kwargs: Any) -> Any:
        """The block's code after the op's last projection, on this call's output tokens."""
        if tail is None:
            return y
        return tail.run((y,), [r.get(args, kwargs) for r in refs], self)[0]

    def add_replicated(self, name: str, value: torch.Tensor | None, source: str) -> None:
        if value is None:
            self.register_parameter(name, None)
            return
        self.register_parameter(name, nn.Parameter(value.detach().clone(), requires_grad=value.requires_grad))
        self.replicated_sources[name] = source

    def opt(self, name: str) -> torch.Tensor | None:
        if self.group_shards and name in self.group_shards:
            return self.group_shards[name]
        return self._parameters.get(name)

    def req(self, name: str) -> torch.Tensor:
        value = self.opt(name)
        assert value is not None, name
        return value

    def configure(self, ctx: SeqContext, op_plan: OpPlan) -> None:
        """Select the variant (mode, recompute) and the layout for the next call."""
        self.__dict__.update(ctx=ctx, op_plan=op_plan)  # plain attributes: what nn.Module's __setattr__ ends in

    def unconfigure(self) -> None:
        """No variant until the strategy configures the next step: the step ended (a step on groups also returned
        its gradients and dropped its ``1/g`` shards), so a call now could only be wrong (it raises
        :meth:`unconfigured`)."""
        self.__dict__.update(ctx=None, op_plan=None)

    def unconfigured(self) -> RuntimeError:
        """The error of a call outside a configured step."""
        return RuntimeError(
            f"{self.core_path} (layer {self.layer}) ran outside a step the strategy configured: in a hook or callback "
            "between steps (e.g. on_train_batch_end, on_before_optimizer_step, on_validation_epoch_end), before the "
            "first batch, or after a training step on groups returned its gradients (a second forward in one training "
            "step, as two manual_backward calls in one step make; use ParaDySeStrategy(groups=False) for such steps). "
            "Each rank holds a slice of the weights, so the model runs inside the steps, each rank on its part of "
            "the batch; to use it whole (samples to log, generation), load a checkpoint of this run in one plain "
            "process (LightningModule.load_from_checkpoint)"
        )

    def set_group_shards(self, shards: dict[str, torch.Tensor] | None) -> None:
        """Set :attr:`group_shards` (twice a step on groups; a plain attribute, set without ``nn.Module``'s
        ``__setattr__`` walk)."""
        self.__dict__["group_shards"] = shards

    def infeasible(self, mode: str, p: int) -> str | None:
        raise NotImplementedError

    def _state(self, x: torch.Tensor) -> tuple[SeqContext, OpPlan]:
        if self.ctx is None or self.op_plan is None:
            raise self.unconfigured()
        expected = self.ctx.layout.local_len(self.ctx.rank)
        if x.shape[1] != expected:
            raise SliceLengthError(
                f"layer {self.layer}: the input has {x.shape[1]} tokens where this rank's slice of the batch has "
                f"{expected}: the model was called on a sequence of another length than the batch's (truncated, a "
                f"token or a prompt prepended, positions dropped in the step), or it makes a sequence of its own (a "
                f"vision model's patches, tokens it prepends). Each rank holds a slice of every row, so change the "
                f"sequence where every rank holds the whole batch: in the data (the collator) or in "
                f"on_after_batch_transfer; a model that makes its own sequence trains under another strategy"
            )
        return self.ctx, self.op_plan

    def _run(self, fn: Any, *args: Any) -> torch.Tensor:
        assert self.op_plan is not None
        if self.op_plan.recompute and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)  # type: ignore[no-any-return]
        return fn(*args)  # type: ignore[no-any-return]


class _TokenTable:
    """Per-token positional inputs (positions, rotary cos/sin) of the local tokens, looked up by position.

    Values for tokens of other ranks are all-gathered once per call when a mode needs the whole sequence, integer
    position ids too: whether they are the layout's own positions on every rank (packed documents restart them)
    would take a comparison read on the host and an agreement per layer, where the gather is one tiny collective
    that never waits for the host.
    """

    def __init__(self, values: list[torch.Tensor], dims: tuple[int | None, ...], ctx: SeqContext) -> None:
        self.values, self.dims, self.ctx = values, dims, ctx
        self.full: list[torch.Tensor] | None = None

    def lookup(self, positions: torch.Tensor) -> list[torch.Tensor]:
        """The values at ``positions``: this rank's own tokens, or every token in natural order."""
        if positions.numel() == self.ctx.layout.local_len(self.ctx.rank):
            return self.values
        if self.full is None:  # values that are not per token (dim None) are the same on every rank
            self.full = [v if d is None else self._gather(v, d) for v, d in zip(self.values, self.dims)]
        return [f if d is None else f.index_select(d, positions) for f, d in zip(self.full, self.dims)]

    def _gather(self, value: torch.Tensor, dim: int) -> torch.Tensor:
        layout = self.ctx.layout
        moved = value.detach().movedim(dim, 1) if value.dim() > 1 else value.detach()[None]  # token dim -> 1
        ids = not value.is_floating_point()  # position ids: the layout's metadata, not a mode's traffic
        with torch.no_grad(), no_counting() if ids else contextlib.nullcontext():
            full = gather_seq(moved.contiguous(), layout, self.ctx.group)  # [.., s_r, ..] -> [.., s, ..]
        full = full.index_select(1, layout.natural_index(full.device))  # gathered -> natural order
        return full.movedim(1, dim) if value.dim() > 1 else full[0]


class AttentionDispatch(OpDispatch):
    """Replaces the attention sub-module of a block; runs the attention op in the configured mode."""

    def __init__(self, core: nn.Module, roles: AttentionRoles, layer: int, group: Group) -> None:
        super().__init__(roles.core, layer)
        self.roles = roles
        self.batch_first = True  # nn.TransformerEncoderLayer reads these three to choose its path;
        self.in_proj_bias = None  # without a bias it takes the ordinary path that calls this module
        self._qkv_same_embed_dim = False
        self._add_weights(core, roles, group)
        program = roles.program
        for code in (roles.head, program, roles.tail):  # the norms / rotary / dropout the model's own code calls
            for path in () if code is None else code.modules:
                self.adopt(core, path)
        # the modules of the code between projections and attention, read every call (a plain attribute: they stay
        # registered where adopted)
        self.__dict__["_program_modules"] = tuple(self.get_submodule(n) for n in (program.modules if program else ()))
        h = self.req("o_t").shape[1]
        self.spec = AttnSpec(
            h,
            roles.n_heads,
            roles.n_kv_heads,
            roles.head_dim,
            bool(roles.causal),
            scale=roles.scale,
            window=roles.window,
            mixes_heads=program is not None and program.mixes_heads,
            softcap=roles.softcap,
            adapted=bool(self.adapter_params),
        )
        self.attend_axis: int | None = None
        """Grid models: the grid dimension this attention attends along (1: frames, 2: patches)."""

    def _add_weights(self, core: nn.Module, roles: AttentionRoles, group: Group) -> None:
        pre = roles.core + "."
        if roles.kind == "mha":
            assert isinstance(core, nn.MultiheadAttention)
            h = core.embed_dim
            for i, name in enumerate(("q", "k", "v")):
                src = ShardSource(f"{pre}in_proj_weight", False, h, offset=i * h)
                self.add_shard(name, core.in_proj_weight, src, group)
                bias_src = ShardSource(f"{pre}in_proj_bias", False, h, offset=i * h)
                self.add_shard(f"{name}_bias", core.in_proj_bias, bias_src, group)
            self.add_row_projection("o_t", "o_bias", core.out_proj, f"{pre}out_proj", group)
            return
        for name, rows in zip(("q", "k", "v"), roles.rows):
            path = getattr(roles, name)
            self.add_projection(name, f"{name}_bias", core.get_submodule(path[len(pre) :]), path, rows, group)
        self.add_row_projection("o_t", "o_bias", core.get_submodule(roles.o[len(pre) :]), roles.o, group)

    def weights(self) -> AttnWeights:
        o = self.opt
        return AttnWeights(
            self.req("q"),
            self.req("k"),
            self.req("v"),
            self.req("o_t"),
            o("q_bias"),
            o("k_bias"),
            o("v_bias"),
            o("o_bias"),
            adapters=self.adapters(),
        )

    def infeasible(self, mode: str, p: int) -> str | None:
        if mode in GRID_MODES and self.attend_axis is None:
            return f"{mode} needs a model whose hidden states are a grid of sequence axes (parallelize with axes=2)"
        return get_mode(mode).attention_infeasible(self.spec, p)

    def _grid_call(self, x: torch.Tensor) -> tuple[SeqContext, Any]:
        """Grid models: the context and the mode of this call. The attended sequences are whole here unless
        the attended axis is the sharded one; then a sequence mode runs with a layout along that axis."""
        grid, ctx, op = self.grid, self.ctx, self.op_plan
        if ctx is None or op is None or grid is None:
            raise self.unconfigured()
        if self.attend_axis != grid.sharded or ctx.p == 1:
            return ctx, GRID_MODES["dsp"]
        if op.mode in GRID_MODES:
            raise RuntimeError(f"layer {self.layer}: the grid was not switched before a {op.mode} attention")
        layout = SeqLayout(grid.lengths[grid.sharded], ctx.p)
        if x.shape[1] != layout.local_len(ctx.rank):
            raise ValueError(f"layer {self.layer}: the input has {x.shape[1]} tokens, the layout gives {layout}")
        return replace(ctx, layout=layout, doc_ids=None), get_mode(op.mode)

    def _causal(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if self.roles.kind != "mha":
            return bool(self.roles.causal)
        names = (
            "query",
            "key",
            "value",
            "key_padding_mask",
            "need_weights",
            "attn_mask",
            "average_attn_weights",
            "is_causal",
        )
        call = dict(zip(names, args)) | kwargs
        if call.get("key") is not call.get("query") or call.get("value") is not call.get("query"):
            raise ValueError(f"layer {self.layer}: only self-attention (query is key is value) is supported")
        if call.get("key_padding_mask") is not None:
            raise ValueError(f"layer {self.layer}: key_padding_mask is not supported yet; pack without padding")
        mask = call.get("attn_mask")
        if call.get("is_causal"):
            return True
        if mask is None:
            return False
        if not _is_causal_mask(mask):
            raise ValueError(f"layer {self.layer}: only causal or no attention masks are supported")
        return True

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: SeqContext) -> Any:
        """The model's code between projections and attention for this call, on the tokens a mode names."""
        program = self.roles.program
        if program is None:
            return None
        table = _TokenTable([r.get(args, kwargs) for r in self.roles.positions], self.roles.token_dims, ctx)

        def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> Any:
            return program.run((q, k, v), table.lookup(positions), self)

        return prepare

    def _prepare_params(self) -> tuple[torch.Tensor, ...]:
        """The trainable parameters of the modules the head program calls (parameter-less ones skipped)."""
        modules: tuple[nn.Module, ...] = self.__dict__["_program_modules"]
        return tuple(p for m in modules if m._parameters or m._modules for p in m.parameters() if p.requires_grad)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = self.roles.hidden.get(args, kwargs)
        if self.grid is not None:
            ctx, mode = self._grid_call(x)
        else:
            ctx, op = self._state(x)
            mode = get_mode(op.mode)
        spec = replace(
            self.spec,
            causal=self._causal(args, kwargs),
            prepare=self._prepare(args, kwargs, ctx),
            prepare_params=self._prepare_params(),
        )
        w = self.weights()  # read now: a recomputation runs what the forward ran (an adapter switched off in between)
        head, refs = self.roles.head, self.roles.head_values
        y = self._run(lambda inp: mode.attention(self.run_tail(head, refs, inp, args, kwargs), w, spec, ctx), x)
        y = self.run_tail(self.roles.tail, self.roles.tail_values, y, args, kwargs)
        if self.roles.output_item is None:
            return y
        return tuple(y if i == self.roles.output_item else None for i in range(self.roles.output_len))


def _is_causal_mask(mask: torch.Tensor) -> bool:
    t = mask.shape[-1]
    future = torch.ones(t, t, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, future))
    blocked = torch.isinf(mask) & (mask < 0)
    return bool(torch.equal(blocked, future) and torch.all(mask[~future] == 0))


class MlpDispatch(OpDispatch):
    """Replaces the MLP sub-module of a block; runs the MLP op in the configured mode."""

    def __init__(self, core: nn.Module, roles: MlpRoles, layer: int, group: Group) -> None:
        assert roles.core is not None
        super().__init__(roles.core, layer)
        pre = roles.core + "."
        up, down = core.get_submodule(roles.up[len(pre) :]), core.get_submodule(roles.down[len(pre) :])
        f = self.add_projection("up", "up_bias", up, roles.up, roles.rows[0], group)
        if roles.gate is not None:
            gate = core.get_submodule(roles.gate[len(pre) :])
            self.add_projection("gate", "gate_bias", gate, roles.gate, roles.rows[1], group)
        else:
            self.register_parameter("gate", None)
            self.register_parameter("gate_bias", None)
        self.add_row_projection("down_t", "down_bias", down, roles.down, group)
        self.roles = roles
        for path in () if roles.tail is None else roles.tail.modules:  # the model's code after the down projection
            self.adopt(core, path)
        self.act = roles.act
        self.spec = MlpSpec(
            int(projection_weight(up).shape[1]),
            f,
            roles.act,
            gated=roles.gate is not None,
            adapted=bool(self.adapter_params),
        )

    def weights(self) -> MlpWeights:
        o = self.opt
        return MlpWeights(
            self.req("up"),
            self.req("down_t"),
            o("gate"),
            o("up_bias"),
            o("gate_bias"),
            o("down_bias"),
            adapters=self.adapters(),
        )

    def infeasible(self, mode: str, p: int) -> str | None:
        if mode in GRID_MODES and self.grid is None:
            return f"{mode} needs a model whose hidden states are a grid of sequence axes (parallelize with axes=2)"
        if self.grid is not None and mode in _SEQUENCE_MLP_MODES:
            return f"{mode} runs its MLP on a one-dimensional sequence layout; use dsp, ulysses or ring for this model"
        return get_mode(mode).mlp_infeasible(self.spec, p)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.grid is not None:  # token-wise on the local grid, whichever axis is sharded
            if self.ctx is None or self.op_plan is None:
                raise self.unconfigured()
            ctx, op = self.ctx, self.op_plan
        else:
            ctx, op = self._state(x)
        mode, w = get_mode(op.mode), self.weights()  # read now: a recomputation runs what the forward ran
        y = self._run(lambda inp: mode.mlp(inp, w, self.spec, ctx), x)
        return self.run_tail(self.roles.tail, self.roles.tail_values, y, (x, *args), kwargs)  # type: ignore[no-any-return]


class OpaqueDispatch(OpDispatch):
    """An MLP the passes cannot split (a mixture of experts: Mixtral, Qwen3-MoE, OLMoE), run whole on each rank's
    own tokens.

    Every parameter of the module is held as 1/p of its first dimension (ZeRO-3: for experts stored ``[E, 2f, h]``,
    a share of the experts) and gathered for the call (forward all-gather, backward reduce-scatter, the gradient
    lands on the shard); the module's own code runs on the gathered parameters with ``torch.func.functional_call``.
    The module must act on each token alone (probed at setup): then it gives every token what one process gives
    it. The modes that keep a rank's tokens local (``ulysses``, ``ring``) run it; ``tp_sp`` and ``metp`` split the
    MLP's weights by features, which an opaque module does not allow.
    """

    def __init__(self, core: nn.Module, path: str, layer: int, group: Group) -> None:
        super().__init__(path, layer)
        self.template = [core]  # not a sub-module: its parameters live here as shards (train/eval: see train())
        self.names: dict[str, str] = {}
        """The module's parameter name -> this module's shard parameter."""
        self.shapes: dict[str, torch.Size] = {}
        """The module's parameter name -> its whole shape (its first dimension is sharded)."""
        self.visited: set[str] = set()
        """Parameters whose gathered tensor received a gradient on this rank since the last :meth:`used_flags`
        (an expert no token visited receives none, as in one process)."""
        if len({p.dtype for p in core.parameters()}) > 1:
            raise ValueError(f"{path}: parameters of different dtypes are gathered as one; give them one dtype")
        for i, (name, param) in enumerate(core.named_parameters()):
            if param.dim() == 0:
                raise ValueError(f"{path}.{name}: a scalar parameter cannot be sharded; it is not supported")
            shard = f"p{i}_{name.replace('.', '_')}"
            self.add_shard(shard, param, ShardSource(f"{path}.{name}", False, int(param.shape[0])), group)
            self.names[name], self.shapes[name] = shard, param.shape
        for name, buf in core.named_buffers():
            self.register_buffer(f"b_{name.replace('.', '_')}", buf, persistent=False)
        self.buffers_of = {name: f"b_{name.replace('.', '_')}" for name, _ in core.named_buffers()}
        self.spec = _opaque_spec(core)
        for param in core.parameters():  # the template's own copies are never used: free them
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def infeasible(self, mode: str, p: int) -> str | None:
        if mode in ("ulysses", "ring"):
            return None
        return (
            f"{mode} splits the MLP by features; this MLP ({type(self.template[0]).__name__}) is a module the rewrite "
            f"runs whole on each rank's tokens (mixture of experts): use ulysses or ring for it"
        )

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        ctx, _ = self._state(x)
        return self._run(lambda inp: self._call(inp, ctx, args, kwargs), x)

    def train(self, mode: bool = True) -> OpaqueDispatch:
        super().train(mode)
        self.template[0].train(mode)  # router noise and dropout follow the model's mode
        return self

    def _call(self, x: torch.Tensor, ctx: SeqContext, args: Any, kwargs: Any) -> Any:
        return torch.func.functional_call(self.template[0], self.gathered(ctx), (x, *args), kwargs, strict=True)

    def gathered(self, ctx: SeqContext) -> dict[str, torch.Tensor]:
        """Every parameter whole, from one all-gather of this rank's shards laid end to end (one collective whose
        backward, one reduce-scatter, runs on every rank whichever experts its tokens visit)."""
        p = group_size(ctx.group)
        per_row = {name: shape[1:].numel() for name, shape in self.shapes.items()}
        counts = [[row_sizes(shape[0], p)[r] * per_row[n] for n, shape in self.shapes.items()] for r in range(p)]
        flat = torch.cat([self.req(shard).reshape(-1) for shard in self.names.values()])  # this rank's shards [N_r]
        whole = gather_weight(flat[:, None], [sum(c) for c in counts], ctx.group)[:, 0]  # [N_r, 1] -> [N], by rank
        by_rank = [piece.split(c) for piece, c in zip(whole.split([sum(c) for c in counts]), counts)]
        params = {
            name: torch.cat([by_rank[r][i] for r in range(p)]).view(shape)  # ranks' rows in order -> whole
            for i, (name, shape) in enumerate(self.shapes.items())
        }
        for name, tensor in params.items():
            if tensor.requires_grad and not ctx.idle:  # a placeholder's tokens use no expert
                tensor.register_hook(self._visit(name))
        params.update({name: getattr(self, local) for name, local in self.buffers_of.items()})
        return params

    def _visit(self, name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self.visited.add(name)

        return hook

    def used_flags(self) -> torch.Tensor:
        """``[n_params]`` float32 flags on the host, 1 for a parameter whose gathered tensor received a gradient on
        this rank since the last call (which forgets them); summed over the ranks they tell which shards to
        :meth:`settle`."""
        used = torch.tensor([name in self.visited for name in self.names], dtype=torch.float32)
        self.visited.clear()
        return used

    def settle(self, counts: list[float]) -> None:
        """After the backward (of the last micro-batch): the shards of parameters no rank's tokens used (a count of
        0 in ``counts``, :meth:`used_flags` summed over the group) get no gradient (``None``), as an expert no token
        visits gets none in one process (an optimizer then skips it: no weight decay, no moment update)."""
        for name, count in zip(self.names, counts):
            if count == 0:
                self.req(self.names[name]).grad = None


def _opaque_spec(core: nn.Module) -> MlpSpec:
    """What the cost model prices an opaque MLP as: a gated MLP with the experts a token visits (``top_k`` of
    ``num_experts`` when the module says so) at the width that gives their parameter count."""

    def attr(name: str, default: int) -> int:
        return next((int(v) for m in core.modules() if isinstance(v := getattr(m, name, None), int) and v > 0), default)

    total = sum(p.numel() for p in core.parameters())
    hidden = attr("hidden_dim", attr("hidden_size", max(1, round((total / 3) ** 0.5))))
    experts = attr("num_experts", 1)
    ffn = max(1, total * attr("top_k", experts) // (experts * 3 * hidden))
    return MlpSpec(hidden, ffn, no_activation, gated=True)


_SPLIT_MODES = ("tp_sp", "ulysses", "ring")
_SEQUENCE_MLP_MODES = ("tp_sp", "metp")
"""Modes whose MLP needs the one-dimensional sequence layout (they gather or scatter along dim 1)."""


def _no_inline_adapter(linear: nn.Module, path: str) -> None:
    if lora_parts(linear) is not None:
        raise ValueError(
            f"{path} carries a LoRA adapter on an MLP the block computes inline (nn.TransformerEncoderLayer): its "
            f"projections are rewritten one by one, without adapters; put adapters on the attention only "
            f"(LoraConfig(target_modules=[...])), or train this model with Lightning's DDP or FSDP strategy"
        )


class ColumnDispatch(OpDispatch):
    """The up projection of an MLP the block computes inline (e.g. ``nn.TransformerEncoderLayer.linear1``).

    ``tp_sp``: gather the sequence, then the column shard (the activation runs on ``[b, s, f/p]``);
    ``ulysses``/``ring``: ZeRO-3 gathered weight on the local tokens. ``metp`` needs to own the whole
    MLP and is infeasible here.
    """

    def __init__(self, linear: nn.Module, path: str, layer: int, group: Group) -> None:
        super().__init__(path, layer)
        _no_inline_adapter(linear, path)
        self.rows = self.add_projection("weight", "bias", linear, path, None, group)

    def infeasible(self, mode: str, p: int) -> str | None:
        if mode not in _SPLIT_MODES:
            return f"{mode} needs the MLP in a sub-module of its own; this block computes it inline"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx, op = self._state(x)
        return self._run(lambda inp: self._compute(inp, ctx, op.mode), x)

    def _compute(self, x: torch.Tensor, ctx: SeqContext, mode: str) -> torch.Tensor:
        weight = self.req("weight")
        if mode == "tp_sp":
            xc = x.to(Autocast.current(x).compute_dtype(x, weight))  # gathered in the matmul's dtype
            xg = gather_seq(xc, ctx.layout, ctx.group)  # [b, s_r, h] -> [b, s, h] (gathered order)
            return F.linear(xg, weight, self.opt("bias"))  # -> [b, s, f/p]
        return zero3_linear(x, weight, self.rows, ctx.group, self.opt("bias"))  # [b, s_r, h] -> [b, s_r, f]


class RowDispatch(OpDispatch):
    """The down projection matching a :class:`ColumnDispatch`."""

    def __init__(self, linear: nn.Module, path: str, layer: int, group: Group) -> None:
        super().__init__(path, layer)
        _no_inline_adapter(linear, path)
        self.rows = int(projection_weight(linear).shape[1])
        self.add_row_projection("weight_t", "bias", linear, path, group)

    def infeasible(self, mode: str, p: int) -> str | None:
        return None if mode in _SPLIT_MODES else f"{mode} needs the MLP in a sub-module of its own"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx is None or self.op_plan is None:
            raise self.unconfigured()
        ctx, op = self.ctx, self.op_plan
        return self._run(lambda inp: self._compute(inp, ctx, op.mode), x)

    def _compute(self, x: torch.Tensor, ctx: SeqContext, mode: str) -> torch.Tensor:
        if mode == "tp_sp":
            partial = x @ self.req("weight_t")  # [b, s, f/p] -> [b, s, h], a partial sum
            y = scatter_seq(partial, ctx.layout, ctx.group)  # -> [b, s_r, h]
        else:
            y = zero3_linear_t(x, self.req("weight_t"), self.rows, ctx.group)  # [b, s_r, f] -> [b, s_r, h]
        return add_bias(y, self.opt("bias"))
