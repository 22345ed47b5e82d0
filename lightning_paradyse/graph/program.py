"""The block's own code between the q/k/v projections and the attention call, replayed in every mode.

The traced graph (:mod:`lightning_paradyse.graph.trace`) holds every op from each projection's output to the
attention's q/k/v inputs: the reshape into heads, per-head norms (Qwen3, Gemma 3), norms over all heads
(OLMo 2), rotary embeddings, full or partial (Phi-2), scalings. :func:`extract` turns that piece of the graph
into a :class:`HeadProgram`; a mode projects *its* tokens and heads (every token and ``n/p`` heads in
``tp_sp``, ``s/p`` tokens and every head in ``ring``) and runs the program on them with the positional inputs
(rotary ``cos``/``sin``, position ids) of those tokens, instead of a re-implementation of the block's code.

Reshapes follow the call's shapes (the example's batch, token and head dimensions become the call's). Two
float64 probes (:func:`probe`) decide what the program may be given: a subset of the tokens (required: every
mode holds some of the tokens) and a subset of the heads, with the parameters it reads perturbed (a program
that mixes heads runs only where a rank holds every head of its tokens; the modes that split heads are
infeasible for the op, with the reason).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_map

from lightning_paradyse.graph.trace import ArgRef, BlockTrace, ModuleCall

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
class HeadProgram:
    """``run(q, k, v, values)``: projections ``[b, t, heads*d]`` -> attention inputs ``[b, heads, t, d]``."""

    steps: tuple[Step, ...]
    n_values: int
    """Positional inputs after q, k, v."""
    outputs: tuple[int, int, int]
    """Slots of the attention's q, k, v inputs."""
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

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        values: Sequence[Any],
        owner: nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replay on this call's projections; ``owner`` holds the modules and parameters (by relative path)."""
        env: list[Any] = [q, k, v, *values]

        def fill(value: Any) -> Any:
            if isinstance(value, _Slot):
                return env[value.index]
            return q.dtype if value is self.dtype else value

        for step in self.steps:
            if step.kind == "module":
                out = owner.get_submodule(step.target)(*_map(fill, step.args), **_map(fill, step.kwargs or {}))
            elif step.kind == "param":
                out = _attr(owner, step.target)
            elif step.kind == "const":
                const = self.constants[step.target]
                out = const.to(q.device, q.dtype if const.dtype is self.dtype else const.dtype)
            else:
                args = _map(fill, step.args)
                if step.shapes is not None:
                    args = (args[0], _call_shape(*step.shapes, tuple(args[0].shape), self.heads))
                out = step.target(*args, **_map(fill, step.kwargs or {}))
            env.append(out)
        a, b, c = (env[i] for i in self.outputs)
        return a, b, c


def _attr(owner: nn.Module, path: str) -> torch.Tensor:
    module, _, name = path.rpartition(".")
    value = getattr(owner.get_submodule(module) if module else owner, name)
    assert isinstance(value, torch.Tensor), path
    return value


def _map(fn: Callable[[Any], Any], tree: Any) -> Any:
    return tree_map(fn, tree, is_leaf=lambda x: isinstance(x, _Slot))


def _call_shape(
    example_in: tuple[int, ...], example_out: tuple[int, ...], actual_in: tuple[int, ...], heads: tuple[int, int]
) -> tuple[int, ...]:
    """The shape a reshape of ``actual_in`` means, given what it did to the example (``example_in -> example_out``).

    Leading and trailing dimensions the reshape keeps are the call's; of those it splits or merges, the example's
    head count becomes ``-1`` (the call holds its own number of heads), the rest (the head width) stay.
    """
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
    return (*actual_in[:k], *middle, *actual_in[len(actual_in) - m :])


def _attention_input(node: fx.Node, shape: tuple[int, ...]) -> fx.Node:
    """The last node before the attention call with the attention's own ``[b, heads, t, d]`` shape (walking back
    over a grouped-query repeat of the key/value heads, which the modes do themselves)."""
    at: Any = node
    while isinstance(at, fx.Node):
        if tuple(at.meta.get("shape") or ()) == shape:
            return at
        at = next(iter(at.all_input_nodes), None)
    raise ProgramError(f"the attention's input {node.name} is not of shape {list(shape)} ([b, heads, t, d]) anywhere")


@dataclass(frozen=True)
class Extracted:
    program: HeadProgram | None
    """``None`` when the code is a plain split into heads (nothing to replay)."""
    positions: tuple[ArgRef, ...]
    """Where the positional inputs in the attention module's call, in the program's value order."""
    token_dims: tuple[int | None, ...]
    """The token dimension of each positional input (``None``: not per token, passed as it is)."""


def extract(
    trace: BlockTrace,
    core: str,
    call: ModuleCall,
    projections: tuple[fx.Node, fx.Node, fx.Node],
    attention: tuple[fx.Node, fx.Node, fx.Node],
    hidden: fx.Node,
    heads: tuple[int, int],
    head_dim: int,
) -> Extracted:
    """The program from the ``projections`` (q, k, v linears) to the ``attention`` call's q, k, v inputs."""
    b, t = hidden.meta["shape"][0], hidden.meta["shape"][1]
    ends = tuple(
        _attention_input(node, (b, n, t, head_dim)) for node, n in zip(attention, (heads[0], heads[1], heads[1]))
    )
    order = {n: i for i, n in enumerate(trace.graph.nodes)}
    slots: dict[fx.Node, int] = {node: i for i, node in enumerate(projections)}
    refs = call.refs()
    values: list[fx.Node] = []
    needed: set[fx.Node] = set()
    todo = list(ends)
    while todo:
        node = todo.pop()
        if node in needed or node in slots:
            continue
        if node is hidden:
            raise ProgramError("the attention's q, k or v reads the module's input other than through its projection")
        if node in refs and node.op != "get_attr":
            if node not in values:
                values.append(node)
            continue
        if node.op == "placeholder" or (node.op != "get_attr" and core not in node.meta.get("stack", ())):
            raise ProgramError(f"the attention's inputs depend on {node.name}, which is not an argument of {core}")
        needed.add(node)
        todo.extend(node.all_input_nodes)
    values.sort(key=order.__getitem__)
    for i, node in enumerate(values):
        slots[node] = 3 + i
    steps: list[Step] = []
    modules: set[str] = set()
    pre = core + "." if core else ""
    for node in sorted(needed, key=order.__getitem__):
        slots[node] = 3 + len(values) + len(steps)
        steps.append(_step(trace, node, slots, pre, modules))
    program = HeadProgram(
        tuple(steps),
        len(values),
        (slots[ends[0]], slots[ends[1]], slots[ends[2]]),
        heads,
        {s.target: trace.constants[s.target] for s in steps if s.kind == "const"},
        tuple(sorted(modules)),
        dtype=next(trace.block.parameters()).dtype,
    )
    dims = tuple(_token_dim(node, t) for node in values)
    return Extracted(None if _plain_split(steps) else program, tuple(refs[n] for n in values), dims)


def _step(trace: BlockTrace, node: fx.Node, slots: dict[fx.Node, int], pre: str, modules: set[str]) -> Step:
    def ref(value: Any) -> Any:
        return _Slot(slots[value]) if isinstance(value, fx.Node) else value

    if node.op == "get_attr":
        name = str(node.target)
        if name in trace.constants:
            return Step("const", name)
        if not name.startswith(pre):
            raise ProgramError(f"the attention's inputs read {name}, a parameter outside {pre[:-1]}")
        modules.add(name[len(pre) :].split(".")[0])
        return Step("param", name[len(pre) :])
    args = tuple(tree_map(ref, node.args))
    kwargs = dict(tree_map(ref, dict(node.kwargs)))
    if node.op == "call_module":
        path = str(node.target)
        if not path.startswith(pre):
            raise ProgramError(f"the attention's inputs pass through {path}, a module outside {pre[:-1]}")
        modules.add(path[len(pre) :].split(".")[0])
        return Step("module", path[len(pre) :], args, kwargs)
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


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= 1e-9 * max(float(b.abs().max()), 1e-30)


def probe(
    program: HeadProgram,
    owner: nn.Module,
    projections: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    values: Sequence[Any],
    dims: tuple[int | None, ...],
) -> HeadProgram:
    """Run the float64 probes of the module docstring on the example; ``owner`` is a float64 copy of the attention
    module. Returns the program with :attr:`HeadProgram.mixes_heads` set; raises :class:`ProgramError` when the
    program does not act on each token alone."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in program.modules:  # parameters that differ per element: a head cannot pass for another
            for p in owner.get_submodule(name).parameters():
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        q, k, v = projections
        full = program.run(q, k, v, values, owner)
        idx = torch.tensor(PROBE_TOKENS)
        some = [x if d is None else x.index_select(d, idx) for x, d in zip(values, dims)]
        try:
            part = program.run(q[:, idx], k[:, idx], v[:, idx], some, owner)
            local = all(_close(a, f[:, :, idx]) for a, f in zip(part, full))
        except Exception as err:  # a shape fixed to the example's token count, say
            raise ProgramError(f"it cannot run on a part of the tokens ({type(err).__name__}: {err})") from None
        if not local:
            raise ProgramError("it mixes tokens (a token's result depends on other tokens)")
        n, n_kv = program.heads
        if n < 2:
            return program
        d = q.shape[-1] // n
        hq, hkv = n // 2, n_kv // 2 if n_kv >= 2 else 0
        try:
            part = program.run(q[..., hq * d :], k[..., hkv * d :], v[..., hkv * d :], values, owner)
            local = all(_close(a, f[:, h:]) for a, f, h in zip(part, full, (hq, hkv, hkv)))
        except Exception:  # e.g. a norm over every head's features
            local = False
    return program if local else replace(program, mixes_heads=True)
