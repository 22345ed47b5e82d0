"""Apply the unified layout to a model: sharded blocks that run any mode per op.

The model never knows it is parallel. :func:`parallelize` swaps each transformer block of a model
for a :class:`ParallelBlock` that holds the block's norms (replicated) and one 1/p row shard of each
projection (the unified layout of DESIGN.md), and runs each op in the mode its plan names. Nothing
else of the model changes: embeddings, final norm and head stay replicated and run on local tokens.

Until the graph rewriting of the strategy finds the roles in a traced block, the roles are read
from the block by an explicit adapter, :func:`block_roles`, which understands blocks shaped like the
package's reference models (``attn_norm``, ``attn.{q,k,v,o}``, ``mlp_norm``, ``mlp.{up,gate,down}``).
The modes themselves depend on none of this: they see only :mod:`~lightning_paradyse.spec` values.

Order of application (one place, documented): shard the block weights (``parallelize``), then per
batch set the layout and the plan (``configure``), run forward/backward, then reduce the gradients
of replicated parameters over the group (``reduce_replicated_grads``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from lightning_paradyse.comm import Group, all_gather_rows, all_reduce_sum, group_rank, group_size
from lightning_paradyse.modes import get_mode
from lightning_paradyse.plan import OPS, LayerPlan, OpPlan, Plan
from lightning_paradyse.spec import (
    AttnSpec,
    AttnWeights,
    MlpSpec,
    MlpWeights,
    SeqContext,
    row_sizes,
    shard_rows,
)


@dataclass(frozen=True)
class ShardSource:
    """Where a sharded parameter of a :class:`ParallelBlock` comes from in the plain block."""

    name: str
    """Name of the parameter in the plain block, e.g. ``attn.o.weight``."""
    transposed: bool
    """The shard is of the transposed weight (row-parallel ``o``/``down``)."""


@dataclass
class BlockRoles:
    """The roles of one transformer block, found by :func:`block_roles`."""

    attn_norm: nn.Module
    mlp_norm: nn.Module
    linears: dict[str, nn.Linear]
    """``q, k, v, o, up, down`` and optionally ``gate``."""
    paths: dict[str, str]
    """Dotted path of each role inside the block."""
    attn: AttnSpec
    mlp: MlpSpec


_LINEAR_PATHS = {"q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.o", "up": "mlp.up", "down": "mlp.down"}


def _find(block: nn.Module, path: str) -> Any:
    obj: Any = block
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def block_roles(block: nn.Module, name: str = "block") -> BlockRoles:
    """Read the roles of a reference-style block; a ``ValueError`` names the block and missing role."""
    missing = [p for p in ("attn_norm", "mlp_norm", "attn", "mlp") if _find(block, p) is None]
    missing += [path for path in _LINEAR_PATHS.values() if not isinstance(_find(block, path), nn.Linear)]
    if missing:
        raise ValueError(
            f"cannot parallelize {name} ({type(block).__name__}): missing role(s) {', '.join(missing)}. "
            f"Blocks need attn_norm, attn.q/k/v/o (nn.Linear), mlp_norm and mlp.up/down (nn.Linear)."
        )
    attn: Any = block.attn
    mlp: Any = block.mlp
    linears = {role: _find(block, path) for role, path in _LINEAR_PATHS.items()}
    paths = dict(_LINEAR_PATHS, attn_norm="attn_norm", mlp_norm="mlp_norm")
    if isinstance(getattr(mlp, "gate", None), nn.Linear):
        linears["gate"], paths["gate"] = mlp.gate, "mlp.gate"
    attn_spec = AttnSpec(
        hidden=linears["q"].in_features,
        n_heads=int(attn.n_heads),
        n_kv_heads=int(attn.n_kv_heads),
        head_dim=int(attn.head_dim),
        causal=bool(attn.causal),
        rotary=getattr(attn, "rotary", None),
    )
    mlp_spec = MlpSpec(
        hidden=linears["up"].in_features,
        ffn=linears["up"].out_features,
        act=mlp.act,
        gated="gate" in linears and bool(getattr(mlp, "gated", True)),
    )
    return BlockRoles(block.attn_norm, block.mlp_norm, linears, paths, attn_spec, mlp_spec)  # type: ignore[arg-type]


# (parameter name in ParallelBlock, role, weight or bias, sharded by rows, transposed)
_SHARDS = (
    ("q", "q", "weight", False),
    ("k", "k", "weight", False),
    ("v", "v", "weight", False),
    ("o_t", "o", "weight", True),
    ("up", "up", "weight", False),
    ("gate", "gate", "weight", False),
    ("down_t", "down", "weight", True),
    ("bq", "q", "bias", False),
    ("bk", "k", "bias", False),
    ("bv", "v", "bias", False),
    ("b_up", "up", "bias", False),
    ("b_gate", "gate", "bias", False),
)
_REPLICATED_BIASES = (("bo", "o"), ("b_down", "down"))


class ParallelBlock(nn.Module):
    """A transformer block on the unified layout: replicated norms, 1/p projection shards.

    Call :meth:`configure` with the batch's :class:`SeqContext` and this layer's plan before forward.
    ``forward(x, *args)`` has the plain block's signature; extra arguments (positions) are ignored
    because global positions come from the layout.
    """

    def __init__(self, block: nn.Module, group: Group, name: str = "block") -> None:
        super().__init__()
        roles = block_roles(block, name)
        p, rank = group_size(group), group_rank(group)
        self.attn_spec, self.mlp_spec = roles.attn, roles.mlp
        self.attn_norm, self.mlp_norm = roles.attn_norm, roles.mlp_norm
        self.sources: dict[str, ShardSource] = {}
        self.replicated_sources: dict[str, str] = {}
        for pname, role, kind, transposed in _SHARDS:
            tensor = getattr(roles.linears.get(role), kind, None)
            if tensor is None:
                self.register_parameter(pname, None)
                continue
            data = tensor.detach().t() if transposed else tensor.detach()
            self.register_parameter(pname, nn.Parameter(shard_rows(data, p, rank)))
            self.sources[pname] = ShardSource(f"{roles.paths[role]}.{kind}", transposed)
        for pname, role in _REPLICATED_BIASES:
            bias = roles.linears[role].bias
            self.register_parameter(pname, None if bias is None else nn.Parameter(bias.detach().clone()))
            if bias is not None:
                self.replicated_sources[pname] = f"{roles.paths[role]}.bias"
        for norm in ("attn_norm", "mlp_norm"):
            for pname, _ in getattr(self, norm).named_parameters():
                self.replicated_sources[f"{norm}.{pname}"] = f"{roles.paths[norm]}.{pname}"
        self.ctx: SeqContext | None = None
        self.plan: LayerPlan | None = None

    def configure(self, ctx: SeqContext, plan: LayerPlan) -> None:
        """Set the layout and this layer's plan for the next forward (a table look-up, no data moves)."""
        self.ctx, self.plan = ctx, plan

    def infeasible(self, plan: LayerPlan, p: int) -> str | None:
        """Why ``plan`` cannot run this block on ``p`` ranks, or ``None``."""
        attn = get_mode(plan.attention.mode).attention_infeasible(self.attn_spec, p)
        mlp = get_mode(plan.mlp.mode).mlp_infeasible(self.mlp_spec, p)
        return attn or mlp

    def _opt(self, name: str) -> torch.Tensor | None:
        return self._parameters.get(name)

    def _req(self, name: str) -> torch.Tensor:
        param = self._parameters.get(name)
        assert param is not None, name
        return param

    def attn_weights(self) -> AttnWeights:
        """This rank's attention shards (the parameters themselves)."""
        o = self._opt
        return AttnWeights(
            self._req("q"), self._req("k"), self._req("v"), self._req("o_t"), o("bq"), o("bk"), o("bv"), o("bo")
        )

    def mlp_weights(self) -> MlpWeights:
        """This rank's MLP shards (the parameters themselves)."""
        o = self._opt
        return MlpWeights(self._req("up"), self._req("down_t"), o("gate"), o("b_up"), o("b_gate"), o("b_down"))

    def _attention(self, x: torch.Tensor, ctx: SeqContext, mode: str) -> torch.Tensor:
        return get_mode(mode).attention(self.attn_norm(x), self.attn_weights(), self.attn_spec, ctx)

    def _mlp(self, x: torch.Tensor, ctx: SeqContext, mode: str) -> torch.Tensor:
        return get_mode(mode).mlp(self.mlp_norm(x), self.mlp_weights(), self.mlp_spec, ctx)

    def _run(self, op: str, x: torch.Tensor, ctx: SeqContext, op_plan: OpPlan) -> torch.Tensor:
        fn = self._attention if op == "attention" else self._mlp
        if op_plan.recompute and torch.is_grad_enabled():
            return checkpoint(fn, x, ctx, op_plan.mode, use_reentrant=False)  # type: ignore[no-any-return]
        return fn(x, ctx, op_plan.mode)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``[b, s_r, h] -> [b, s_r, h]`` with the configured plan."""
        if self.ctx is None or self.plan is None:
            raise RuntimeError("ParallelBlock.configure(ctx, plan) must be called before forward")
        expected = self.ctx.layout.local_len(self.ctx.rank)
        if x.shape[1] != expected:
            raise ValueError(f"block input has {x.shape[1]} tokens but this rank's layout holds {expected}")
        for op in OPS:
            x = x + self._run(op, x, self.ctx, self.plan.op(op))
        return x


def _block_list(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no `layers` ModuleList of transformer blocks; the explicit adapter "
            f"needs one (automatic discovery comes with the strategy's graph rewriting)"
        )
    return layers


def parallelize(model: nn.Module, group: Group) -> nn.Module:
    """Replace every block of ``model.layers`` by a :class:`ParallelBlock` (in place); return ``model``."""
    layers = _block_list(model)
    for i, block in enumerate(layers):
        if not isinstance(block, ParallelBlock):
            layers[i] = ParallelBlock(block, group, name=f"layers.{i}")
    return model


def parallel_blocks(model: nn.Module) -> list[ParallelBlock]:
    """The :class:`ParallelBlock` s of a parallelized model, in order."""
    return [b for b in _block_list(model) if isinstance(b, ParallelBlock)]


def check_plan(model: nn.Module, plan: Plan, p: int) -> None:
    """Raise a ``ValueError`` (before any collective) if ``plan`` does not fit the model or the group."""
    blocks = parallel_blocks(model)
    if len(plan) != len(blocks):
        raise ValueError(f"the plan has {len(plan)} layers but the model has {len(blocks)} blocks")
    for i, (block, layer) in enumerate(zip(blocks, plan.layers)):
        reason = block.infeasible(layer, p)
        if reason:
            raise ValueError(f"layer {i}: {reason}; choose another mode for this layer")


def configure(model: nn.Module, ctx: SeqContext, plan: Plan) -> None:
    """Set the batch's layout and plan on every block (after :func:`check_plan`)."""
    check_plan(model, plan, ctx.p)
    for block, layer in zip(parallel_blocks(model), plan.layers):
        block.configure(ctx, layer)


def _sharded_ids(model: nn.Module) -> set[int]:
    return {id(b.get_parameter(name)) for b in parallel_blocks(model) for name in b.sources}


def replicated_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters every rank holds whole (their gradients are summed over the group)."""
    sharded = _sharded_ids(model)
    return (p for p in model.parameters() if id(p) not in sharded)


def reduce_replicated_grads(model: nn.Module, group: Group) -> None:
    """Sum the gradients of replicated parameters over the group, in one coalesced all-reduce."""
    params = [p for p in replicated_parameters(model) if p.grad is not None]
    if group_size(group) == 1 or not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    total = all_reduce_sum(flat, group)
    at = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(total[at : at + n].view_as(p))  # type: ignore[union-attr]
        at += n


def consolidated(model: nn.Module, group: Group, grads: bool = False) -> dict[str, torch.Tensor]:
    """The plain model's state dict (or its gradients) from a parallelized model, on every rank.

    Shards are all-gathered and un-transposed, names are the plain block's, so the result loads into
    the unparallelized model with ``load_state_dict``.
    """
    out: dict[str, torch.Tensor] = {}
    block_ids = {id(b): i for i, b in enumerate(_block_list(model))}
    prefix = {b: f"layers.{block_ids[id(b)]}." for b in parallel_blocks(model)}
    handled: set[int] = set()
    for block, pre in prefix.items():
        p = group_size(group)
        for pname, src in block.sources.items():
            param = block.get_parameter(pname)
            value = param.grad if grads else param.detach()
            if value is None:
                continue
            full = all_gather_rows(value, row_sizes(_full_rows(block, pname, p, group), p), group)
            out[pre + src.name] = full.t().contiguous() if src.transposed else full
            handled.add(id(param))
        for pname, orig in block.replicated_sources.items():
            param = block.get_parameter(pname)
            value = param.grad if grads else param.detach()
            if value is not None:
                out[pre + orig] = value
            handled.add(id(param))
    for name, param in model.named_parameters():
        if id(param) not in handled:
            value = param.grad if grads else param.detach()
            if value is not None:
                out[name] = value
    return out


def _full_rows(block: ParallelBlock, pname: str, p: int, group: Group) -> int:
    """Rows of the whole weight behind a shard (known from the specs)."""
    a, m = block.attn_spec, block.mlp_spec
    rows = {
        "q": a.q_rows,
        "bq": a.q_rows,
        "o_t": a.q_rows,
        "k": a.kv_rows,
        "v": a.kv_rows,
        "bk": a.kv_rows,
        "bv": a.kv_rows,
    }
    return rows.get(pname, m.ffn)
