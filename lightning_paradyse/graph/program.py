"""The block's own code between the q/k/v projections and the attention call, replayed in every mode.

The traced graph (:mod:`lightning_paradyse.graph.trace`) holds every op from each projection's output to the
attention's q/k/v inputs: the reshape into heads, per-head norms (Qwen3, Gemma 3), norms over all heads
(OLMo 2), rotary embeddings, full or partial (Phi-2), scalings. :func:`extract` turns that piece of the graph
into a :class:`Program`; a mode projects *its* tokens and heads (every token and ``n/p`` heads in
``tp_sp``, ``s/p`` tokens and every head in ``ring``) and runs the program on them with the positional inputs
(rotary ``cos``/``sin``, position ids) of those tokens, instead of a re-implementation of the block's code.

Reshapes follow the call's shapes (the example's batch, token and head dimensions become the call's). Two
float64 probes (:func:`probe`) decide what the program may be given: a subset of the tokens (required: every
mode holds some of the tokens) and a subset of the heads, with the parameters it reads perturbed (a program
that mixes heads runs only where a rank holds every head of its tokens; the modes that split heads are
infeasible for the op, with the reason).

Two more pieces of the block's code are replayed the same way:

* **fused projections** (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``, GPT-NeoX's per-head interleaved
  ``query_key_value``, fused gate/up): the ops that cut the fused output into q, k and v are replayed once at
  setup on the features' indices (:func:`replay_index`), which gives each part's rows of the fused weight; each
  part becomes a projection of its own and the program starts where the block's part is split into heads;
* **tails** (:func:`extract_tail`): what the op's module computes after its last projection (dropout, a residual
  and a post-norm as in BERT), run on the op's output tokens.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import tree_map

from lightning_paradyse.graph.trace import ArgRef, BlockTrace, ModuleCall, _getitem

_RESHAPES = (torch.Tensor.view, torch.Tensor.reshape, torch.reshape)


@dataclass(frozen=True)
class _Slot:
    """A value computed earlier in the program (inputs first: q, k, v, then the positional inputs)."""

    index: int


@dataclass(frozen=True)
class Step:
    """One op of the program."""

    kind: str
    """``function`` (a torch function), ``module`` (a sub-module of the attention, by relative path) or
    ``param`` (a parameter or buffer of the attention, by relative path) or ``const`` (a traced constant)."""
    target: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None
    shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """For a reshape: the example's input and output shapes, to map the call's shape onto."""


class ProgramError(ValueError):
    """The code between the projections and the attention cannot be replayed (the message says why)."""


@dataclass(frozen=True)
class Program:
    """A piece of the block's own code, replayed on what a mode holds: ``run(inputs, values) -> outputs``.

    The head program maps the q, k, v projections ``[b, t, heads*d]`` to the attention inputs ``[b, heads, t, d]``;
    a tail maps the output projection ``[b, t, h]`` to what the op's module returns (dropout, a residual and a
    post-norm: BERT, StarCoder2, GPT-2)."""

    steps: tuple[Step, ...]
    n_values: int
    """Inputs of the op's call after the program's own inputs (rotary ``cos``/``sin``, position ids, a residual)."""
    outputs: tuple[int, ...]
    """Slots of the program's results (the attention's q, k, v inputs; the tail's one output)."""
    heads: tuple[int, int]
    """Query and key/value heads of the example (a reshape's head count becomes the call's)."""
    constants: dict[str, torch.Tensor]
    modules: tuple[str, ...]
    """Top-level children of the attention module the program calls or reads (kept by the dispatch)."""
    mixes_heads: bool = False
    """Whether the program needs every head of a token at once (see the module docstring)."""
    dtype: torch.dtype = torch.float64
    """The dtype the block was traced in (float64 when its kernels allow): in the program it stands for the dtype
    of the call's projections (a cast back to the input's dtype, as OLMo 2's rotary does); any other dtype (a
    float32 upcast) stays what it is."""

    n_inputs: int = 3
    """The program's own inputs (slots ``0 .. n_inputs - 1``): q, k, v; or the output projection."""

    def __post_init__(self) -> None:
        # every step's arguments as fillers, made once (a plain attribute: no field, pickled with the program)
        binds = tuple((_Fill(step.args, self.dtype), _Fill(step.kwargs or {}, self.dtype)) for step in self.steps)
        object.__setattr__(self, "_binds", binds)
        object.__setattr__(self, "_compiled", _compile(self))  # made here, never inside a torch.compile trace

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and copied without its compiled form (:meth:`__setstate__` makes it again)."""
        state = dict(self.__dict__)
        state.pop("_compiled", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_compiled", _compile(self))

    def run(self, inputs: Sequence[torch.Tensor], values: Sequence[Any], owner: nn.Module) -> tuple[Any, ...]:
        """Replay on this call's ``inputs``; ``owner`` holds the modules and parameters (by relative path).

        Runs the program compiled into one Python function (:func:`_compile`: the same calls on the same
        arguments, without filling each step's arguments in from a list); a program whose arguments
        :meth:`_Source.expr` cannot write, or a call with other numbers of inputs or values, is interpreted
        (:meth:`interpret`)."""
        compiled: Callable[..., tuple[Any, ...]] | None = self.__dict__["_compiled"]
        if compiled is None or len(inputs) != self.n_inputs or len(values) != self.n_values:
            return self.interpret(inputs, values, owner)
        return compiled(self, inputs, values, owner)

    def constant(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The traced constant ``name`` where ``like`` (the call's first input) is, in its dtype when it was traced in
        the program's (:attr:`dtype`)."""
        const = self.constants[name]
        if const.device != like.device:  # moved once to where the block runs (it may move after install)
            const = self.constants[name] = const.to(like.device)
        return const.to(dtype=like.dtype if const.dtype is self.dtype else const.dtype)

    def interpret(self, inputs: Sequence[torch.Tensor], values: Sequence[Any], owner: nn.Module) -> tuple[Any, ...]:
        """:meth:`run`, step by step."""
        q = inputs[0]
        dtype = q.dtype
        env: list[Any] = [*inputs, *values]
        binds: tuple[tuple[_Fill, _Fill], ...] = self.__dict__["_binds"]
        for step, (bind_args, bind_kwargs) in zip(self.steps, binds):
            if step.kind == "dropout":  # functional dropout: trained as the owner is (HF passes self.training)
                kwargs = {**bind_kwargs.fill(env, dtype), "training": owner.training}
                out = step.target(*bind_args.fill(env, dtype), **kwargs)
            elif step.kind == "module":
                out = owner.get_submodule(step.target)(*bind_args.fill(env, dtype), **bind_kwargs.fill(env, dtype))
            elif step.kind == "param":
                out = _attr(owner, step.target)
            elif step.kind == "const":
                out = self.constant(step.target, q)
            else:
                args = bind_args.fill(env, dtype)
                if step.shapes is not None:
                    args = (args[0], _call_shape(*step.shapes, tuple(args[0].shape), self.heads))
                out = step.target(*args, **bind_kwargs.fill(env, dtype))
            env.append(out)
        return tuple(env[i] for i in self.outputs)


class _Fill:
    """A step's arguments (a tuple, list or dict) filled in for one call: every slot by the value computed there,
    the traced dtype (:attr:`Program.dtype`) by the call's. Where the values are plain leaves the places to fill
    are found once and a call copies the container (a replayed op's arguments, every call); nested ones are walked
    by :func:`_map`."""

    def __init__(self, tree: Any, traced: torch.dtype) -> None:
        self.tree, self.traced = tree, traced
        kind = type(tree)
        items = list(tree.items()) if kind is dict else list(enumerate(tree)) if kind in (tuple, list) else None
        self.flat = items is not None and all(type(v) in _LEAVES for _, v in items)
        self.slots = tuple((i, v.index) for i, v in items or () if type(v) is _Slot) if self.flat else ()
        self.dtypes = tuple(i for i, v in items or () if v is traced) if self.flat else ()

    def fill(self, env: list[Any], dtype: torch.dtype) -> Any:
        """The arguments of this call (``env``: the values so far; ``dtype``: the call's projections')."""
        tree = self.tree
        if not self.flat:
            traced = self.traced
            return _map(lambda v: env[v.index] if isinstance(v, _Slot) else dtype if v is traced else v, tree)
        if not self.slots and not self.dtypes:
            return tree
        out = dict(tree) if type(tree) is dict else list(tree)
        for i, j in self.slots:
            out[i] = env[j]
        for i in self.dtypes:
            out[i] = dtype
        return tuple(out) if type(tree) is tuple else out


def _compile(program: Program) -> Callable[..., tuple[Any, ...]] | None:
    """``program`` as one Python function ``(program, inputs, values, owner) -> outputs`` that makes the calls
    :meth:`Program.interpret` makes, in order, on the same arguments (``None``: a step's arguments hold what
    :meth:`_Source.expr` cannot write, which only the interpreter fills in)."""
    source = _Source(program.dtype, program.heads)
    n_in = program.n_inputs
    lines = ["def run(program, inputs, values, owner):"]
    lines += [f"    v{i} = inputs[{i}]" for i in range(n_in)]
    lines += [f"    v{n_in + i} = values[{i}]" for i in range(program.n_values)]
    lines.append("    dtype = v0.dtype")
    for k, step in enumerate(program.steps):
        call = source.call(step)
        if call is None:
            return None
        lines.append(f"    v{n_in + program.n_values + k} = {call}")
    lines.append("    return (" + "".join(f"v{i}, " for i in program.outputs) + ")")
    code = compile("\n".join(lines), f"<program of {len(program.steps)} steps>", "exec")
    exec(code, source.names)  # code made here, of the traced program's own steps
    return source.names["run"]  # type: ignore[no-any-return]


class _Source:
    """What :func:`_compile` writes: a step's call as an expression, its objects named in :attr:`names` (the
    function's globals). ``v<i>`` is slot ``i``; ``dtype`` the call's projections' (the traced ``dtype`` stands for
    it, as :class:`_Fill` fills it in)."""

    def __init__(self, traced: torch.dtype, heads: tuple[int, int]) -> None:
        self.traced, self.heads = traced, heads
        self.names: dict[str, Any] = {"_attr": _attr}

    def name(self, value: Any) -> str:
        key = f"_k{len(self.names)}"
        self.names[key] = value
        return key

    def expr(self, tree: Any) -> str | None:
        """``tree`` (a step's arguments) as an expression: slots, the traced dtype, the leaves of :data:`_LEAVES`
        (named), in tuples, lists, dicts and fx's immutable lists and dicts; ``None`` for anything else (another
        container, which only pytree walks, or another leaf: the program is then interpreted)."""
        kind = type(tree)
        if kind is _Slot:
            return f"v{tree.index}"
        if tree is self.traced:
            return "dtype"
        if kind in _LEAVES:
            return self.name(tree)
        if kind in (dict, immutable_dict):  # fx's own containers made again as they are (pytree maps them alike)
            items = [(self.name(k), self.expr(v)) for k, v in tree.items()]
            made = "{" + "".join(f"{k}: {v}, " for k, v in items) + "}"
            made = made if kind is dict else f"{self.name(kind)}({made})"
            return None if any(v is None for _, v in items) else made
        if kind in (tuple, list, immutable_list):
            parts = [self.expr(x) for x in tree]
            inner = "".join(f"{p}, " for p in parts)
            made = f"({inner})" if kind is tuple else f"[{inner}]" if kind is list else f"{self.name(kind)}([{inner}])"
            return None if any(p is None for p in parts) else made
        return None

    def call(self, step: Step) -> str | None:
        """The expression of ``step``'s call, as :meth:`Program.interpret` makes it."""
        target = self.name(step.target)
        if step.kind == "param":  # no arguments to fill in
            return f"_attr(owner, {target})"
        if step.kind == "const":
            return f"program.constant({target}, v0)"
        plain = {k: v for k, v in (step.kwargs or {}).items() if not (step.kind == "dropout" and k == "training")}
        args, kwargs = self.expr(tuple(step.args)), self.expr(plain)
        if args is None or kwargs is None:
            return None
        if step.kind == "dropout":  # trained as the owner is (HF passes self.training)
            return f"{target}(*{args}, **{kwargs}, training=owner.training)"
        if step.kind == "module":
            return f"owner.get_submodule({target})(*{args}, **{kwargs})"
        if step.shapes is not None:  # a reshape: the example's shapes mapped onto the call's (:func:`_call_shape`)
            first = self.expr(step.args[0])
            k, middle, m = _shape_template(*step.shapes, self.heads)
            kept = f"*{first}.shape[len({first}.shape) - {m} :]" if m else ""  # as _call_shape slices it
            return f"{target}({first}, (*{first}.shape[:{k}], *{self.name(middle)}, {kept}), **{kwargs})"
        return f"{target}(*{args}, **{kwargs})"


def _attr(owner: nn.Module, path: str) -> torch.Tensor:
    module, _, name = path.rpartition(".")
    value = getattr(owner.get_submodule(module) if module else owner, name)
    assert isinstance(value, torch.Tensor), path
    return value


_LEAVES = frozenset({_Slot, int, float, bool, str, type(None), slice, type(Ellipsis), torch.dtype, torch.device})
"""Types ``pytree`` treats as leaves that the program's arguments hold most (walked without ``pytree``)."""


def _map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` on every leaf of ``tree`` (a slot is a leaf), as ``tree_map``; plain tuples, lists and dicts and the
    common leaves directly (a replayed op's arguments, every call: ``tree_map`` cost ~15 us each), the rest by
    ``tree_map``."""
    kind = type(tree)
    if kind in _LEAVES:
        return fn(tree)
    if kind is tuple:
        return tuple(_map(fn, x) for x in tree)
    if kind is list:
        return [_map(fn, x) for x in tree]
    if kind is dict:
        return {k: _map(fn, v) for k, v in tree.items()}
    return tree_map(fn, tree, is_leaf=lambda x: isinstance(x, _Slot))


@functools.lru_cache(maxsize=4096)
def _call_shape(
    example_in: tuple[int, ...], example_out: tuple[int, ...], actual_in: tuple[int, ...], heads: tuple[int, int]
) -> tuple[int, ...]:
    """The shape a reshape of ``actual_in`` means, given what it did to the example (``example_in -> example_out``).

    Leading and trailing dimensions the reshape keeps are the call's; of those it splits or merges, the example's
    head count becomes ``-1`` (the call holds its own number of heads), the rest (the head width) stay
    (:func:`_shape_template`).
    """
    k, middle, m = _shape_template(example_in, example_out, heads)
    return (*actual_in[:k], *middle, *actual_in[len(actual_in) - m :])


def _shape_template(
    example_in: tuple[int, ...], example_out: tuple[int, ...], heads: tuple[int, int]
) -> tuple[int, tuple[int, ...], int]:
    """What of a call's reshape the example fixes: ``(k, middle, m)``, the call's shape being its input's first ``k``
    dimensions, ``middle``, then its input's last ``m`` (see :func:`_call_shape`)."""
    k = 0
    while k < min(len(example_in), len(example_out)) and example_in[k] == example_out[k]:
        k += 1
    m = 0
    while (
        m < min(len(example_in), len(example_out)) - k
        and example_in[len(example_in) - 1 - m] == example_out[len(example_out) - 1 - m]
    ):
        m += 1
    middle = list(example_out[k : len(example_out) - m])
    free = [i for i, n in enumerate(middle) if n in heads]
    if free:
        middle[free[0]] = -1
    elif len(middle) == 1:
        middle[0] = -1
    return k, tuple(middle), m


def _attention_input(node: fx.Node, shape: tuple[int, ...]) -> fx.Node:
    """The last node before the attention call with the attention's own ``[b, heads, t, d]`` shape (walking back
    over a grouped-query repeat of the key/value heads, which the modes do themselves)."""
    at: Any = node
    while isinstance(at, fx.Node):
        if tuple(at.meta.get("shape") or ()) == shape:
            return at
        at = next(iter(at.all_input_nodes), None)
    raise ProgramError(f"the attention's input {node.name} is not of shape {list(shape)} ([b, heads, t, d]) anywhere")


# ---------------------------------------------------------------------------------------------- fused projections

MOVES: tuple[Any, ...] = (
    *_RESHAPES,
    torch.Tensor.transpose,
    torch.transpose,
    torch.Tensor.permute,
    torch.permute,
    torch.Tensor.contiguous,
    torch.Tensor.split,
    torch.split,
    torch.Tensor.split_with_sizes,
    torch.Tensor.chunk,
    torch.chunk,
    torch.Tensor.unbind,
    torch.unbind,
    torch.Tensor.narrow,
    torch.narrow,
    torch.Tensor.unflatten,
    torch.Tensor.flatten,
    torch.Tensor.unsqueeze,  # GPT-BigCode's multi-query c_attn: [b, t, F] -> [b, 1, t, F], then split
    torch.unsqueeze,
    torch.Tensor.__getitem__,
    _getitem,
)
"""Ops that only move or select elements: a fused projection's output is cut into q, k, v (or gate and up) by them."""


def replay_index(source: fx.Node, target: fx.Node) -> torch.Tensor:
    """``target``'s value when ``source`` holds, at every token, the index of its feature (``0 .. F-1``).

    Every op from ``source`` to ``target`` must only move or select elements (:data:`MOVES`): the result says which
    feature of ``source`` each element of ``target`` is."""
    shape = tuple(source.meta["shape"])
    env: dict[fx.Node, Any] = {source: torch.arange(shape[-1], dtype=torch.float64).expand(shape).contiguous()}
    order = {n: i for i, n in enumerate(source.graph.nodes)}
    todo, chain = [target], set()
    while todo:
        node = todo.pop()
        if node is source or node in chain:
            continue
        if node.op != "call_function" or node.target not in MOVES:
            raise ProgramError(
                f"{node.name} ({getattr(node.target, '__name__', node.target)}) acts on the fused projection "
                f"{source.target} before it is cut into its parts (only reshapes and selections may)"
            )
        if node.target in (torch.Tensor.unsqueeze, torch.unsqueeze) and _unsqueezes_batch(node):
            raise ProgramError(  # traced with one row: [1, b, t, F] could not be told from [b, 1, t, F]
                f"{node.name} (unsqueeze) adds a leading dimension to the fused projection {source.target} before it "
                f"is cut into its parts (only after the batch dimension may)"
            )
        chain.add(node)
        todo.extend(node.all_input_nodes)
    for node in sorted(chain, key=order.__getitem__):
        args = tree_map(lambda v: env[v] if isinstance(v, fx.Node) else v, node.args)
        kwargs = tree_map(lambda v: env[v] if isinstance(v, fx.Node) else v, dict(node.kwargs))
        fn: Any = node.target
        env[node] = fn(*args, **kwargs)
    return env[target]  # type: ignore[no-any-return]


def _unsqueezes_batch(node: fx.Node) -> bool:
    """Whether an ``unsqueeze`` call adds its dimension before its input's first (the batch's)."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    source = node.args[0]
    rank = len(source.meta.get("shape") or ()) if isinstance(source, fx.Node) else 0
    return isinstance(dim, int) and dim % (rank + 1) == 0


@dataclass(frozen=True)
class FusedStart:
    """Where q, k or v starts when its projection is fused with the others' (Phi-3, GPT-NeoX, GPT-2, Falcon)."""

    node: fx.Node
    """The first node holding this part alone, split into heads: ``[b, heads, t, d]`` or ``[b, t, heads, d]``."""
    rows: tuple[int, ...]
    """Rows of the fused weight (output features) of this part, head by head: its own ``[heads * d, in]`` weight."""
    heads: int
    """Heads of this part (query heads for q, key/value heads for k and v)."""
    token_dim: int
    """1 (``[b, t, heads, d]``) or 2 (``[b, heads, t, d]``)."""


def fused_start(projection: fx.Node, attention_input: fx.Node, head_dim: int) -> FusedStart:
    """The part of the fused ``projection`` that becomes ``attention_input`` (see :class:`FusedStart`)."""
    b, t = projection.meta["shape"][0], projection.meta["shape"][1]
    order = {n: i for i, n in enumerate(projection.graph.nodes)}
    on_path = _between(projection, attention_input)
    for node in sorted(on_path, key=order.__getitem__):
        shape = tuple(node.meta.get("shape") or ())
        if len(shape) == 4 and shape[0] == b and shape[3] == head_dim and t in shape[1:3]:
            if shape[1] == shape[2]:
                raise ProgramError(f"cannot tell heads from tokens in {node.name} (shape {list(shape)})")
            token_dim = 1 if shape[1] == t else 2
            index = replay_index(projection, node)  # [b, t, n, d] or [b, n, t, d]: feature indices
            per_token = index.movedim(token_dim, 1)  # -> [b, t, n, d]
            if not bool((per_token == per_token[:1, :1]).all()):
                raise ProgramError(f"the parts of {projection.target} differ between tokens")
            rows = tuple(int(i) for i in per_token[0, 0].reshape(-1).tolist())  # head-major: [n * d]
            return FusedStart(node, rows, int(per_token.shape[2]), token_dim)
    raise ProgramError(f"no split of {projection.target}'s output into heads of width {head_dim} found")


def _between(source: fx.Node, target: fx.Node) -> set[fx.Node]:
    """Nodes on a path from ``source`` to ``target`` (``target`` included, ``source`` not)."""
    down: set[fx.Node] = set()
    todo = [source]
    while todo:
        for user in todo.pop().users:
            if user not in down:
                down.add(user)
                todo.append(user)
    up: set[fx.Node] = set()
    todo = [target]
    while todo:
        node = todo.pop()
        if node in up or node is source:
            continue
        up.add(node)
        todo.extend(node.all_input_nodes)
    return down & up


def split_pieces(projection: fx.Node) -> list[fx.Node]:
    """The parts a fused MLP input projection is cut into right away (``chunk``/``split`` items or slices)."""
    pieces: list[fx.Node] = []
    for user in projection.users:
        if user.op != "call_function":
            continue
        if user.target in (torch.Tensor.chunk, torch.chunk, torch.Tensor.split, torch.split):
            pieces += [g for g in user.users if g.target is _getitem]
        elif user.target is torch.Tensor.__getitem__:
            pieces.append(user)
    return pieces


def piece_rows(projection: fx.Node, piece: fx.Node) -> tuple[int, ...]:
    """The features of ``projection`` that ``piece`` (``[b, t, f]``) holds, in its order."""
    index = replay_index(projection, piece)
    if index.dim() != len(projection.meta["shape"]) or not bool((index == index[:1, :1]).all()):
        raise ProgramError(f"{piece.name} is not a cut of {projection.target}'s features")
    return tuple(int(i) for i in index[0, 0].tolist())


# ---------------------------------------------------------------------------------------------- extraction


@dataclass(frozen=True)
class Extracted:
    program: Program | None
    """``None`` when the code is a plain split into heads (head program) or nothing (tail)."""
    positions: tuple[ArgRef, ...]
    """Where the program's values sit in the op module's call, in the program's value order."""
    token_dims: tuple[int | None, ...]
    """The token dimension of each value (``None``: not per token, passed as it is)."""


def _collect(
    trace: BlockTrace, core: str, call: ModuleCall, stops: set[fx.Node], ends: Sequence[fx.Node], hidden: fx.Node | None
) -> tuple[list[fx.Node], set[fx.Node]]:
    """``(values, nodes)``: the call's arguments the code from ``stops`` to ``ends`` reads, and its own nodes."""
    order = {n: i for i, n in enumerate(trace.graph.nodes)}
    refs = call.refs()
    values: list[fx.Node] = []
    needed: set[fx.Node] = set()
    todo = list(ends)
    while todo:
        node = todo.pop()
        if node in needed or node in stops:
            continue
        if node is hidden:
            raise ProgramError("the attention's q, k or v reads the module's input other than through its projection")
        if node in refs and node.op != "get_attr":
            if node not in values:
                values.append(node)
            continue
        if node.op == "placeholder" or (node.op != "get_attr" and core not in node.meta.get("stack", ())):
            raise ProgramError(f"it depends on {node.name}, which is not an argument of {core}")
        needed.add(node)
        todo.extend(node.all_input_nodes)
    values.sort(key=order.__getitem__)
    return values, needed


def _build(
    trace: BlockTrace,
    core: str,
    values: list[fx.Node],
    needed: set[fx.Node],
    slots: dict[fx.Node, int],
    steps: list[Step],
    n_inputs: int,
    ends: Sequence[fx.Node],
    heads: tuple[int, int],
) -> Program:
    order = {n: i for i, n in enumerate(trace.graph.nodes)}
    modules: set[str] = set()
    pre = core + "." if core else ""
    for node in sorted(needed, key=order.__getitem__):
        slots[node] = n_inputs + len(values) + len(steps)
        steps.append(_step(trace, node, slots, pre, modules))
    return Program(
        tuple(steps),
        len(values),
        tuple(slots[e] for e in ends),
        heads,
        {s.target: trace.constants[s.target] for s in steps if s.kind == "const"},
        tuple(sorted(modules)),
        dtype=next(trace.block.parameters()).dtype,
        n_inputs=n_inputs,
    )


def extract(
    trace: BlockTrace,
    core: str,
    call: ModuleCall,
    starts: tuple[fx.Node | FusedStart, fx.Node | FusedStart, fx.Node | FusedStart],
    attention: tuple[fx.Node, fx.Node, fx.Node],
    hidden: fx.Node,
    heads: tuple[int, int],
    head_dim: int,
) -> Extracted:
    """The program from q, k, v (their projections, or their parts of a fused one) to the attention's inputs.

    A fused part starts with its own projection ``[b, t, heads*d]`` split into heads the way the block's part is
    laid out (:class:`FusedStart`), and goes on with the block's code from there."""
    b, t = hidden.meta["shape"][0], hidden.meta["shape"][1]
    ends = tuple(
        _attention_input(node, (b, n, t, head_dim)) for node, n in zip(attention, (heads[0], heads[1], heads[1]))
    )
    nodes = [s.node if isinstance(s, FusedStart) else s for s in starts]
    values, needed = _collect(trace, core, call, set(nodes), ends, hidden)
    slots = {v: 3 + i for i, v in enumerate(values)}
    steps: list[Step] = []
    for i, (start, node) in enumerate(zip(starts, nodes)):
        if not isinstance(start, FusedStart):
            slots[node] = i
            continue
        n = start.heads
        shapes = ((b, t, n * head_dim), (b, t, n, head_dim))
        steps.append(Step("function", torch.Tensor.view, (_Slot(i),), shapes=shapes))  # [b, t, n*d] -> [b, t, n, d]
        if start.token_dim == 2:  # [b, t, n, d] -> [b, n, t, d]
            steps.append(Step("function", torch.Tensor.transpose, (_Slot(3 + len(values) + len(steps) - 1), 1, 2)))
        slots[node] = 3 + len(values) + len(steps) - 1
    program = _build(trace, core, values, needed, slots, steps, 3, ends, heads)
    dims = tuple(_token_dim(node, t) for node in values)
    refs = call.refs()
    return Extracted(None if _plain_split(list(program.steps)) else program, tuple(refs[n] for n in values), dims)


def extract_tail(trace: BlockTrace, core: str, call: ModuleCall, start: fx.Node, end: fx.Node) -> Extracted:
    """The code from an op's last projection ``start`` to what the op's module returns, ``end`` (dropout, a
    residual and a post-norm); it runs on the tokens the op's output holds."""
    t = start.meta["shape"][1]
    values, needed = _collect(trace, core, call, {start}, (end,), None)
    slots = {start: 0, **{v: 1 + i for i, v in enumerate(values)}}
    program = _build(trace, core, values, needed, slots, [], 1, (end,), (0, 0))
    refs = call.refs()
    return Extracted(program, tuple(refs[n] for n in values), tuple(_token_dim(node, t) for node in values))


def _step(trace: BlockTrace, node: fx.Node, slots: dict[fx.Node, int], pre: str, modules: set[str]) -> Step:
    def ref(value: Any) -> Any:
        return _Slot(slots[value]) if isinstance(value, fx.Node) else value

    if node.op == "get_attr":
        name = str(node.target)
        if name in trace.constants:
            return Step("const", name)
        if not name.startswith(pre):
            raise ProgramError(f"it reads {name}, a parameter outside {pre[:-1]}")
        owner = name[len(pre) :].rpartition(".")[0]
        if not owner:
            raise ProgramError(f"it reads {name}, a parameter of {pre[:-1] or 'the block'} itself")
        modules.add(owner)
        return Step("param", name[len(pre) :])
    args = tuple(tree_map(ref, node.args))
    kwargs = dict(tree_map(ref, dict(node.kwargs)))
    if node.op == "call_module":
        path = str(node.target)
        if not path.startswith(pre):
            raise ProgramError(f"it passes through {path}, a module outside {pre[:-1]}")
        modules.add(path[len(pre) :])
        return Step("module", path[len(pre) :], args, kwargs)
    if node.target is F.dropout:  # (input, p, training, inplace): training follows the owner at run time
        names = ("input", "p", "training", "inplace")
        bound = {**dict(zip(names, args)), **kwargs}
        rest = {k: v for k, v in bound.items() if k not in ("input", "training")}
        return Step("dropout", node.target, (bound["input"],), rest)
    shapes = None
    if node.target in _RESHAPES:
        source = node.args[0]
        assert isinstance(source, fx.Node)
        shapes = (tuple(source.meta["shape"]), tuple(node.meta["shape"]))
        args = args[:1]
        kwargs.pop("shape", None)
    return Step("function", node.target, args, kwargs, shapes)


def _token_dim(node: fx.Node, t: int) -> int | None:
    shape = list(node.meta.get("shape") or ())
    if shape.count(t) > 1:
        raise ProgramError(f"cannot tell the token dimension of the positional input {node.name} (shape {shape})")
    return shape.index(t) if t in shape else None


def _plain_split(steps: list[Step]) -> bool:
    """Whether the program only splits each projection into heads (``view`` then ``transpose``)."""
    plain = (torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.transpose, torch.Tensor.contiguous)
    return all(s.kind == "function" and s.target in plain for s in steps)


PROBE_TOKENS = (1, 2, 4, 6)
"""The example tokens the token probe gives the program: fewer than the example's, not contiguous."""


def tolerance(dtype: torch.dtype) -> float:
    """Relative error the probes and the verify allow: rounding of float64 (1e-9), else of float32 (a block whose
    kernels have no float64, such as grouped GEMMs of mixture-of-experts layers, is checked in float32)."""
    return 1e-9 if dtype == torch.float64 else 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= tolerance(b.dtype) * max(float(b.abs().max()), 1e-30)


def probe(
    program: Program,
    owner: nn.Module,
    projections: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    values: Sequence[Any],
    dims: tuple[int | None, ...],
) -> Program:
    """Run the float64 probes of the module docstring on the example; ``owner`` is a float64 copy of the attention
    module. Returns the program with :attr:`Program.mixes_heads` set; raises :class:`ProgramError` when the
    program does not act on each token alone."""
    with torch.no_grad():
        _perturb(program, owner)  # a head cannot pass for another
        q, k, v = projections
        full = program.run((q, k, v), values, owner)
        _check_tokens(program, owner, (q, k, v), values, dims, full, token_dim=2)
        n, n_kv = program.heads
        if n < 2:
            return program
        d = q.shape[-1] // n
        hq, hkv = n // 2, n_kv // 2 if n_kv >= 2 else 0
        try:
            part = program.run((q[..., hq * d :], k[..., hkv * d :], v[..., hkv * d :]), values, owner)
            local = all(_close(a, f[:, h:]) for a, f, h in zip(part, full, (hq, hkv, hkv)))
        except Exception:  # e.g. a norm over every head's features
            local = False
    return program if local else replace(program, mixes_heads=True)


def _check_tokens(
    program: Program,
    owner: nn.Module,
    inputs: Sequence[torch.Tensor],
    values: Sequence[Any],
    dims: tuple[int | None, ...],
    full: tuple[Any, ...],
    token_dim: int,
) -> None:
    """Raise :class:`ProgramError` unless the program gives a part of the tokens what it gives them among all."""
    idx = torch.tensor(PROBE_TOKENS, device=inputs[0].device)
    some = [x if d is None else x.index_select(d, idx) for x, d in zip(values, dims)]
    try:
        part = program.run([x[:, idx] for x in inputs], some, owner)
        local = all(_close(a, f.index_select(token_dim, idx)) for a, f in zip(part, full))
    except Exception as err:  # a shape fixed to the example's token count, say
        raise ProgramError(f"it cannot run on a part of the tokens ({type(err).__name__}: {err})") from None
    if not local:
        raise ProgramError("it mixes tokens (a token's result depends on other tokens)")


def _perturb(program: Program, owner: nn.Module) -> None:
    """Give the parameters of the modules ``program`` calls values that differ per element (a weight that starts at
    zero or one, say a token-mixing gate, could hide what the module does once trained)."""
    gen = torch.Generator().manual_seed(0)
    for name in program.modules:
        for p in owner.get_submodule(name).parameters():
            p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def probe_tail(
    program: Program, owner: nn.Module, output: torch.Tensor, values: Sequence[Any], dims: tuple[int | None, ...]
) -> None:
    """The token probe for the code before an op's projections or after its last one (in float64, ``owner`` in eval
    mode; a copy of it perturbed): it must act on each token alone."""
    owner = copy.deepcopy(owner)  # its parameters are perturbed
    with torch.no_grad():
        _perturb(program, owner)
        full = program.run((output,), values, owner)
        _check_tokens(program, owner, (output,), values, dims, full, token_dim=1)
