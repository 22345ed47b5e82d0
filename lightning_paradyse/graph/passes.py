"""Role-finding passes over a traced block (:mod:`lightning_paradyse.graph.trace`).

Each pass is a pure function of a :class:`BlockTrace` and returns a frozen description of what it
found, or raises :class:`RoleError` naming what is missing. What they match:

* :func:`find_attention`: the one attention call (``scaled_dot_product_attention``, or an
  ``nn.MultiheadAttention``); walking back from its q/k/v inputs to the ``nn.Linear`` that produced
  each, and forward from its output to the output projection; the block's own code between the
  projections and the attention (norms, rotary embeddings: a :class:`~.program.Program`) and its
  positional inputs; the sub-module that computes the whole op (the deepest module enclosing all of
  it) and where its input and positional arguments sit in its call.
* :func:`find_mlp`: the remaining two (``up -> act -> down``) or three (gated ``down(act(gate) * up)``)
  linears, the activation, and the sub-module computing the MLP, or ``None`` when the block computes
  it inline (``nn.TransformerEncoderLayer``), in which case the two linears are rewritten one by one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from lightning_paradyse.graph.program import (
    Extracted,
    FusedStart,
    ProgramError,
    extract,
    extract_tail,
    fused_start,
    piece_rows,
    split_pieces,
)
from lightning_paradyse.graph.roles import AttentionRoles, MlpRoles, is_projection, no_activation, out_features
from lightning_paradyse.graph.trace import ArgRef, BlockTrace, ModuleCall, _getitem


class RoleError(ValueError):
    """A block whose roles cannot be identified (the message names the block and the role)."""


def _is_linear(trace: BlockTrace, node: fx.Node) -> bool:
    return node.op == "call_module" and is_projection(trace.module(str(node.target)))


def _ancestors(node: fx.Node, stop: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """Nodes ``node`` depends on, not walking past nodes where ``stop`` holds (those are included).

    Item ``i`` of a module returning a tuple (a rotary module's ``(q, k)``) depends on that module and,
    through it, only on the module's ``i``-th argument, so q's history does not reach k's projection.
    """
    seen: set[fx.Node] = set()
    todo: list[tuple[fx.Node, int | None]] = [(node, None)]
    if node.target is _getitem and isinstance(node.args[0], fx.Node):
        seen.add(node.args[0])
        todo = [(node.args[0], int(node.args[1]))]  # type: ignore[arg-type]
    while todo:
        n, item = todo.pop()
        inputs = n.all_input_nodes
        arg = n.args[item] if item is not None and n.op == "call_module" and item < len(n.args) else None
        if isinstance(arg, fx.Node):
            inputs = [arg]
        for a in inputs:
            if a in seen:
                continue
            seen.add(a)
            if stop(a):
                continue
            if a.target is _getitem and isinstance(a.args[0], fx.Node):
                src = a.args[0]
                seen.add(src)
                if not stop(src):
                    todo.append((src, int(a.args[1])))  # type: ignore[arg-type]
            else:
                todo.append((a, None))
    return seen


def _source_linear(trace: BlockTrace, node: fx.Node, role: str) -> fx.Node:
    found = [a for a in _ancestors(node, lambda n: _is_linear(trace, n)) if _is_linear(trace, a)]
    if len(found) != 1:
        raise RoleError(f"the attention's {role} input comes from {len(found)} projections, expected 1")
    return found[0]


def _common_core(trace: BlockTrace, nodes: Iterable[fx.Node]) -> str:
    stacks = [n.meta["stack"] for n in nodes]
    common = stacks[0]
    for s in stacks[1:]:
        k = 0
        while k < min(len(common), len(s)) and common[k] == s[k]:
            k += 1
        common = common[:k]
    return common[-1] if common else ""


def _find_ref(call: ModuleCall, node: fx.Node) -> ArgRef | None:
    return call.refs().get(node)


def _sdpa_arg(node: fx.Node, i: int, name: str) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name)


def _check_sdpa(node: fx.Node, head_dim: int) -> tuple[bool, float | None]:
    """``(is_causal, scale)`` of the attention call (``scale`` ``None`` for the default ``1/sqrt(head_dim)``)."""
    if _sdpa_arg(node, 3, "attn_mask") is not None:
        raise RoleError("attention with an explicit mask (padding or custom masks) is not supported yet")
    if float(_sdpa_arg(node, 4, "dropout_p") or 0.0) > 0:  # type: ignore[arg-type]
        raise RoleError("attention dropout is not supported by the parallel modes; set it to 0")
    scale = node.kwargs.get("scale")  # keyword-only in torch
    if scale is not None and not isinstance(scale, (int, float)):
        raise RoleError("the attention scale is computed at run time; a constant scale is supported")
    if scale is not None and math.isclose(float(scale), head_dim**-0.5, rel_tol=1e-12):
        scale = None
    return bool(_sdpa_arg(node, 5, "is_causal")), None if scale is None else float(scale)


@dataclass(frozen=True)
class _Eager:
    """An attention written out (Hugging Face's eager attention): ``softmax(f(q @ k^T)) @ v`` with ``f`` a scale and
    optionally a soft-cap ``c * tanh(x / c)``."""

    out: fx.Node
    """The ``probabilities @ v`` matmul, ``[b, n, t, d]``: stands for the attention call."""
    q: fx.Node
    """The query ``[b, n, t, d]`` (first operand of ``q @ k^T``)."""
    k: fx.Node
    """The key before its transpose (a grouped-query repeat of it included)."""
    v: fx.Node
    """The value (second operand of ``probabilities @ v``)."""
    scale: float
    """The factor on ``q @ k^T`` inside the soft-cap (the whole factor without one)."""
    softcap: float | None
    """The soft-cap ``c`` of ``c * tanh(x / c)``, ``None`` without a ``tanh``."""


SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax)
_MATMUL = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
_CASTS = (torch.Tensor.to, torch.Tensor.float, torch.Tensor.type_as, torch.Tensor.type)
_SCALE_OPS = {
    torch.mul: 1,
    torch.Tensor.mul: 1,
    torch.Tensor.__mul__: 1,
    torch.Tensor.__rmul__: 1,
    torch.div: -1,
    torch.Tensor.div: -1,
    torch.Tensor.__truediv__: -1,
}


def _score_side(node: fx.Node) -> tuple[fx.Node, list[tuple[float, bool]], bool] | None:
    """Walking back from a softmax's input to ``q @ k^T``: ``(matmul, [(factor, inside the tanh)], tanh seen)``."""
    x, factors, tanh_seen = node.args[0], [], False
    while isinstance(x, fx.Node) and x.target not in _MATMUL:
        if x.target in _CASTS:
            x = x.args[0]
        elif x.target in (torch.tanh, torch.Tensor.tanh) and not tanh_seen:
            tanh_seen, x = True, x.args[0]
        elif x.target in _SCALE_OPS and len(x.args) == 2 and isinstance(x.args[1], (int, float)):
            factors.append((float(x.args[1]) ** _SCALE_OPS[x.target], tanh_seen))  # walking back: past it = inside
            x = x.args[0]
        elif x.target in (torch.add, torch.Tensor.add, torch.Tensor.__add__):
            raise RoleError("its attention adds a mask to the scores when traced: custom score masks are not supported")
        else:
            return None
    return (x, factors, tanh_seen) if isinstance(x, fx.Node) else None


def _probability_side(trace: BlockTrace, node: fx.Node) -> fx.Node | None:
    """Walking forward from a softmax over casts and dropout at 0 to ``probabilities @ v``."""
    y = node
    while len(y.users) == 1:
        user = next(iter(y.users))
        module = trace.module(str(user.target)) if user.op == "call_module" else None
        given = user.kwargs.get("p", user.args[1] if len(user.args) > 1 else 0.5)
        p = module.p if isinstance(module, nn.Dropout) else given
        if (user.target is F.dropout or isinstance(module, nn.Dropout)) and float(p) > 0:  # type: ignore[arg-type]
            raise RoleError("attention dropout is not supported by the parallel modes; set it to 0")
        if user.target in _CASTS or user.target is F.dropout or isinstance(module, nn.Dropout):
            y = user
        elif user.target in _MATMUL and user.args[0] is y and isinstance(user.args[1], fx.Node):
            return user
        else:
            return None
    return None


def _eager(trace: BlockTrace, node: fx.Node) -> _Eager | None:
    """The eager attention whose softmax is ``node``, or ``None`` when ``node`` is another softmax."""
    if node.op != "call_function" or node.target not in SOFTMAX:
        return None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    scores = _score_side(node)
    if scores is None or dim not in (-1, 3):
        return None
    m1, factors, tanh_seen = scores
    q, kt = m1.args[0], m1.args[1]
    if not (isinstance(kt, fx.Node) and kt.target in (torch.Tensor.transpose, torch.transpose)):
        return None
    out = _probability_side(trace, node)
    before = [f for f, inside in factors if inside or not tanh_seen]  # the tanh's argument (all: no tanh)
    after = [f for f, inside in factors if not inside and tanh_seen]
    if out is None:
        return None
    scale = float(torch.tensor(before, dtype=torch.float64).prod())
    softcap = float(torch.tensor(after, dtype=torch.float64).prod()) if tanh_seen else None
    if softcap is not None:
        scale *= softcap  # c * tanh(a qk) = c * tanh((a c) qk / c)
    return _Eager(out, q, kt.args[0], out.args[1], scale, softcap)  # type: ignore[arg-type]


def _attention_node(trace: BlockTrace) -> fx.Node | _Eager:
    calls: list[fx.Node | _Eager] = [
        n
        for n in trace.nodes()
        if (n.op == "call_function" and n.target is F.scaled_dot_product_attention)
        or (n.op == "call_module" and isinstance(trace.module(str(n.target)), nn.MultiheadAttention))
    ]
    calls += [e for e in (_eager(trace, n) for n in trace.nodes()) if e is not None]
    if len(calls) != 1:
        raise RoleError(
            f"found {len(calls)} attention calls (scaled_dot_product_attention, MultiheadAttention or an eager "
            f"softmax(q @ k^T) @ v), expected exactly 1"
        )
    return calls[0]


def _mha_roles(trace: BlockTrace, node: fx.Node) -> AttentionRoles:
    path = str(node.target)
    mha = trace.module(path)
    assert isinstance(mha, nn.MultiheadAttention)
    if not mha.batch_first:
        raise RoleError(f"{path}: nn.MultiheadAttention must use batch_first=True (tokens on dim 1)")
    if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
        raise RoleError(f"{path}: only plain self-attention MultiheadAttention is supported")
    if mha.dropout > 0:
        raise RoleError(f"{path}: attention dropout is not supported by the parallel modes; set dropout=0")
    d = mha.embed_dim // mha.num_heads
    return AttentionRoles(
        core=path,
        kind="mha",
        q=path,
        k=path,
        v=path,
        o=f"{path}.out_proj",
        n_heads=mha.num_heads,
        n_kv_heads=mha.num_heads,
        head_dim=d,
        causal=None,
        hidden=ArgRef(index=0),
        output_item=0,
        output_len=2,
    )


def find_attention(trace: BlockTrace) -> AttentionRoles:
    """The attention op of the block (see the module docstring)."""
    found = _attention_node(trace)
    if isinstance(found, fx.Node) and found.op == "call_module":
        return _mha_roles(trace, found)
    if isinstance(found, _Eager):
        node, (q_in, k_in, v_in) = found.out, (found.q, found.k, found.v)
    else:
        node = found
        q_in, k_in, v_in = (_sdpa_arg(node, i, name) for i, name in enumerate(("query", "key", "value")))
    lins = [_source_linear(trace, n, r) for n, r in ((q_in, "query"), (k_in, "key"), (v_in, "value"))]
    q_lin, k_lin, v_lin = lins
    outs = [u for u in _descendants(node) if _is_linear(trace, u)]
    if not outs:
        raise RoleError("no output projection (nn.Linear) after the attention")
    o_lin = min(outs, key=lambda n: _distance(node, n))
    core = _common_core(trace, [*lins, o_lin, node])
    call = trace.call_of(core) if core else None
    if call is None:
        raise RoleError("the attention is not computed by a sub-module of its own")
    hidden_node = q_lin.args[0]
    if not isinstance(hidden_node, fx.Node):
        raise RoleError(f"{core}: the q projection's input is not traced")
    if k_lin.args[0] is not hidden_node or v_lin.args[0] is not hidden_node:
        raise RoleError(f"{core}: q, k and v must project one input, the sub-module's or its norm's")
    hidden, head = _input_and_head(trace, core, call, hidden_node)
    head_dim = int(node.meta["shape"][-1])
    if isinstance(found, _Eager):
        flags = {f for m in trace.module(core).modules() if isinstance(f := getattr(m, "is_causal", None), bool)}
        if len(flags) != 1:
            raise RoleError(f"{core}: its attention is written out (eager) and no single is_causal flag says how")
        causal: bool | None = flags.pop()
        scale = None if math.isclose(found.scale, head_dim**-0.5, rel_tol=1e-12) else found.scale
    else:
        causal, scale = _check_sdpa(node, head_dim)
    out_item, out_len, out_node = _output_ref(call, o_lin, core)
    mods = {r: str(n.target) for r, n in (("q", q_lin), ("k", k_lin), ("v", v_lin), ("o", o_lin))}
    try:
        starts = _starts(trace, lins, (q_in, k_in, v_in), head_dim)
        heads = tuple(
            s.heads if isinstance(s, FusedStart) else out_features(trace.module(mods[r])) // head_dim
            for s, r in zip(starts[:2], "qk")
        )
        code = extract(trace, core, call, starts, (q_in, k_in, v_in), hidden_node, heads, head_dim)  # type: ignore[arg-type]
        tail = None if out_node is o_lin else extract_tail(trace, core, call, o_lin, out_node)
    except ProgramError as err:
        raise RoleError(f"{core}: {err}") from None
    window = sliding_window(trace.module(core))
    if window is not None and not causal:
        raise RoleError(f"{core}: a sliding window on bidirectional attention is not supported yet")
    rows = tuple(s.rows if isinstance(s, FusedStart) else None for s in starts)
    return AttentionRoles(
        core=core,
        kind="linear",
        window=window,
        **mods,
        n_heads=heads[0],
        n_kv_heads=heads[1],
        head_dim=head_dim,
        causal=causal,
        scale=scale,
        hidden=hidden,
        program=code.program,
        positions=code.positions,
        token_dims=code.token_dims,
        output_item=out_item,
        output_len=out_len,
        rows=rows,  # type: ignore[arg-type]
        tail=None if tail is None else tail.program,
        tail_values=() if tail is None else tail.positions,
        tail_token_dims=() if tail is None else tail.token_dims,
        head=None if head is None else head.program,
        head_values=() if head is None else head.positions,
        head_token_dims=() if head is None else head.token_dims,
        softcap=found.softcap if isinstance(found, _Eager) else None,
    )


def _input_and_head(
    trace: BlockTrace, core: str, call: ModuleCall, hidden_node: fx.Node
) -> tuple[ArgRef, Extracted | None]:
    """Where the projections' input ``hidden_node`` sits in the core's call, or the argument the core's own code
    turns into it and that code (the head: ESM's attention normalises its input itself)."""
    hidden = _find_ref(call, hidden_node)
    if hidden is not None:
        return hidden, None
    start = _head_start(trace, call, hidden_node)
    found = None if start is None else _find_ref(call, start)
    if start is None or found is None:
        raise RoleError(f"{core}: q, k and v must project the sub-module's input or a norm of it")
    try:
        return found, extract_tail(trace, core, call, start, hidden_node)
    except ProgramError as err:
        raise RoleError(f"{core}: the code before its projections: {err}") from None


def _head_start(trace: BlockTrace, call: ModuleCall, hidden: fx.Node) -> fx.Node | None:
    """The argument of the attention sub-module's call that its own code turns into the projections' input
    ``hidden`` (a norm of it: :attr:`~.roles.AttentionRoles.head`): the one argument of ``hidden``'s shape that
    ``hidden`` is computed from, else ``None``."""
    refs, shape = call.refs(), hidden.meta.get("shape")
    found: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    todo = [hidden]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in refs and node.op != "get_attr":
            if node.meta.get("shape") == shape:
                found.add(node)
            continue
        todo.extend(node.all_input_nodes)
    return found.pop() if len(found) == 1 else None


def _starts(
    trace: BlockTrace, lins: list[fx.Node], inputs: tuple[fx.Node, fx.Node, fx.Node], head_dim: int
) -> tuple[fx.Node | FusedStart, ...]:
    """Where q, k and v start: their own projection, or their part of a projection they share."""
    out: list[fx.Node | FusedStart] = []
    for lin, inp in zip(lins, inputs):
        out.append(fused_start(lin, inp, head_dim) if lins.count(lin) > 1 else lin)
    fused = [s for s in out if isinstance(s, FusedStart)]
    if len({s.node for s in fused}) != len(fused) or any(
        set(a.rows) & set(b.rows) for i, a in enumerate(fused) for b in fused[i + 1 :]
    ):
        raise ProgramError("the parts of its fused q/k/v projection overlap")
    for lin in {lin for lin in lins if lins.count(lin) > 1}:
        rows = {r for s, part in zip(out, lins) if part is lin and isinstance(s, FusedStart) for r in s.rows}
        if rows != set(range(int(lin.meta["shape"][-1]))):
            raise ProgramError(f"q, k and v use only some of {lin.target}'s outputs (the rest would not be trained)")
    return tuple(out)


def _tokens(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def sliding_window(attention: nn.Module) -> int | None:
    """The causal sliding window of an attention module, by Hugging Face's rules: its own ``sliding_window`` when
    it has one (set per layer type: Qwen2, Qwen3, Gemma 2/3), else its config's when the config has no layer types
    and does not switch windows off (Mistral, Mixtral, Phi-3, StarCoder2 pass ``config.sliding_window``)."""
    if hasattr(attention, "sliding_window"):
        return _tokens(attention.sliding_window)
    config = getattr(attention, "config", None)
    if config is None or getattr(config, "layer_types", None) or not getattr(config, "use_sliding_window", True):
        return None
    return _tokens(getattr(config, "sliding_window", None))


def _output_ref(call: ModuleCall, node: fx.Node, core: str) -> tuple[int | None, int, fx.Node]:
    """``(item, length, returned node)``: where the op's module returns what its last projection ``node`` leads
    to (the projection itself, or the end of a tail)."""

    def leads(value: Any) -> bool:
        return isinstance(value, fx.Node) and (value is node or node in _ancestors(value, lambda n: n is node))

    if leads(call.output):
        return None, 1, call.output
    if isinstance(call.output, (tuple, list)):
        items = [i for i, v in enumerate(call.output) if leads(v)]
        if len(items) == 1:
            return items[0], len(call.output), call.output[items[0]]
    raise RoleError(f"{core} does not return one value computed from its output projection")


def _descendants(node: fx.Node) -> list[fx.Node]:
    seen: list[fx.Node] = []
    todo = list(node.users)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.append(n)
            todo.extend(n.users)
    return seen


def _distance(a: fx.Node, b: fx.Node) -> int:
    order = {n: i for i, n in enumerate(a.graph.nodes)}
    return order[b] - order[a]


# --------------------------------------------------------------------------------------------------
# MLP
# --------------------------------------------------------------------------------------------------


_DROPOUT = (nn.Dropout,)


def _activation(trace: BlockTrace, start: fx.Node, end: fx.Node) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise activation on the path from ``start``'s output to ``end``."""
    path = _ancestors(end, lambda n: n is start) & set(_descendants(start))
    for n in sorted(path, key=lambda n: _distance(start, n)):
        if n.op == "call_module":
            module = trace.module(str(n.target))
            if isinstance(module, (_DROPOUT, nn.Linear)):
                continue
            return module
        if n.op == "call_function" and callable(n.target) and n.target not in _MUL_OPS:
            if n.kwargs:
                return functools.partial(n.target, **n.kwargs)
            return n.target  # type: ignore[return-value]
    raise RoleError("no activation between the MLP projections")


_MUL_OPS = (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__)


def find_mlp(trace: BlockTrace, attention: AttentionRoles) -> MlpRoles:
    """The MLP op of the block: two or three linears outside the attention (see the module docstring)."""
    taken = {attention.q, attention.k, attention.v, attention.o}
    linears = [
        n
        for n in trace.nodes("call_module")
        if _is_linear(trace, n) and str(n.target) not in taken and not str(n.target).startswith(attention.core + ".")
    ]
    moe = expert_core(trace, attention)
    if moe is not None:
        return MlpRoles(core=moe, up="", down="", gate=None, act=no_activation, opaque=True)
    if len(linears) not in (2, 3):
        raise RoleError(f"expected 2 or 3 MLP projections (nn.Linear) outside the attention, found {len(linears)}")
    down = next((n for n in linears if any(a in _ancestors(n, lambda _: False) for a in linears if a is not n)), None)
    if down is None:
        raise RoleError("no MLP down projection consuming the other projections")
    ins = [n for n in linears if n is not down]
    if len({id(n.args[0]) for n in ins}) != 1:
        raise RoleError("the MLP's input projections do not read the same input")
    rows: tuple[tuple[int, ...] | None, tuple[int, ...] | None] = (None, None)
    pieces = split_pieces(ins[0]) if len(ins) == 1 else []
    if len(pieces) == 2:  # one projection cut into gate and up (Phi-3's gate_up_proj)
        gate_piece = next((n for n in pieces if _activation_follows(trace, n, down)), None)
        if gate_piece is None:
            raise RoleError("cannot tell the gate from the up part of the fused gate/up projection")
        up_piece = next(n for n in pieces if n is not gate_piece)
        try:
            rows = (piece_rows(ins[0], up_piece), piece_rows(ins[0], gate_piece))
        except ProgramError as err:
            raise RoleError(f"the fused gate/up projection: {err}") from None
        if set(rows[0]) | set(rows[1]) != set(range(int(ins[0].meta["shape"][-1]))) or set(rows[0]) & set(rows[1]):
            raise RoleError(f"the fused gate/up projection {ins[0].target} is not cut into two disjoint halves")
        up, gate = ins[0], ins[0]
        act = _activation(trace, gate_piece, down)
    elif len(ins) == 1:
        up, gate = ins[0], None
        act = _activation(trace, up, down)
    else:
        gate = next((n for n in ins if _activation_follows(trace, n, down)), None)
        if gate is None:
            raise RoleError("cannot tell the gate from the up projection in the gated MLP")
        up = next(n for n in ins if n is not gate)
        act = _activation(trace, gate, down)
    core = _common_core(trace, linears)
    call = trace.call_of(core) if core else None
    tail = None
    if call is not None:
        tail = _check_mlp_core(trace, core, call, ins[0], down)
    return MlpRoles(
        core=core or None,
        up=str(up.target),
        down=str(down.target),
        gate=None if gate is None else str(gate.target),
        act=act,
        rows=rows,
        tail=None if tail is None else tail.program,
        tail_values=() if tail is None else tail.positions,
        tail_token_dims=() if tail is None else tail.token_dims,
    )


def expert_core(trace: BlockTrace, attention: AttentionRoles) -> str | None:
    """The sub-module holding a block's experts and their router (Mixtral's ``mlp``: ``mlp.gate``,
    ``mlp.experts``), or ``None`` when the block has no module named for experts."""
    names = [
        n
        for n, m in trace.block.named_modules()
        if "expert" in n.rsplit(".", 1)[-1].lower()
        and next(m.parameters(), None) is not None
        and not n.startswith(attention.core + ".")
    ]
    if not names:
        return None
    core = min(names, key=len).rpartition(".")[0]
    if not core:
        raise RoleError("its experts are direct children of the block; the rewrite needs them in an MoE module")
    call = trace.call_of(core)
    if call is None or not call.args or not isinstance(call.args[0], fx.Node) or len(call.args[0].meta["shape"]) != 3:
        raise RoleError(f"{core}: a mixture of experts must be called with the hidden states [b, t, h] first")
    module = trace.module(core)
    kept = sorted(set(module.state_dict()) - {n for n, _ in module.named_parameters()})
    if kept:
        raise RoleError(f"{core}: an MoE module with persistent buffers ({', '.join(kept)}) is not supported yet")
    return core


def _activation_follows(trace: BlockTrace, lin: fx.Node, down: fx.Node) -> bool:
    path = _ancestors(down, lambda n: n is lin) - {lin}
    first = [u for u in lin.users if u in path or u is down]
    return any(
        u.target not in _MUL_OPS
        and u is not down
        and (u.op != "call_module" or not isinstance(trace.module(str(u.target)), _DROPOUT))
        for u in first
    )


def _check_mlp_core(trace: BlockTrace, core: str, call: ModuleCall, first: fx.Node, down: fx.Node) -> Extracted | None:
    """The MLP module's tail (code after its down projection), after checking how the module is called."""
    if _find_ref(call, first.args[0]) is None:  # type: ignore[arg-type]
        raise RoleError(f"{core} must take the MLP input as an argument")
    _, _, out = _output_ref(call, down, core)
    try:
        tail = None if out is down else extract_tail(trace, core, call, down, out)
    except ProgramError as err:
        raise RoleError(f"{core}: after the down projection: {err}") from None
    kept = set() if tail is None or tail.program is None else set(tail.program.modules)
    for name, module in trace.module(core).named_modules():
        if isinstance(module, _DROPOUT) and module.p > 0 and name not in kept:
            raise RoleError(
                f"{core}.{name}: dropout inside the MLP is not supported by the parallel modes; set it to 0"
            )
    return tail
