"""Trace one transformer block into a ``torch.fx.Graph`` by running it once on example inputs.

Symbolic tracing (``torch.fx.symbolic_trace``) cannot follow the blocks users bring (Hugging Face
decoder layers branch on shapes and take ``**kwargs``; ``nn.TransformerEncoderLayer`` checks its
fast path), so the block is traced by execution instead: every call of a leaf module (``nn.Linear``,
``nn.MultiheadAttention`` and modules without children, such as norms and activations) becomes a
``call_module`` node, every torch function called outside leaf modules (``view``, ``transpose``,
``scaled_dot_product_attention``, ``mul``, ...) a ``call_function`` node, and tensors are followed by
identity, so the graph is the block's real data flow. Each node's ``meta`` holds the output shape
and the stack of enclosing (non-leaf) modules; non-leaf module calls are kept as :class:`ModuleCall`
records so that a pass can find the sub-module that computes an op and how it is called.

The graph is for analysis (the role-finding passes in :mod:`lightning_paradyse.graph.passes`); the
rewritten block keeps running the user's own code.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_paradyse.graph.adapters import is_lora_linear

LEAF_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.MultiheadAttention)
"""Modules traced as one node even when they have children."""


def is_leaf(module: nn.Module) -> bool:
    """Whether ``module`` is recorded as a single ``call_module`` node (a LoRA projection too: one projection)."""
    return isinstance(module, LEAF_TYPES) or next(module.children(), None) is None or is_lora_linear(module)


@dataclass(frozen=True)
class ArgRef:
    """Where a value sits in a call: positional ``index`` or keyword ``name``, optional tuple ``item``."""

    index: int | None = None
    name: str | None = None
    item: int | None = None

    def get(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        value = args[self.index] if self.index is not None and self.index < len(args) else kwargs.get(str(self.name))
        return value if self.item is None or value is None else value[self.item]


@dataclass
class ModuleCall:
    """One call of a non-leaf sub-module: how it was called and what it returned."""

    path: str
    """Qualified name inside the block (``""`` is the block itself)."""
    module: nn.Module
    args: tuple[Any, ...]
    """Positional arguments with tensors replaced by their nodes."""
    kwargs: dict[str, Any]
    """Keyword arguments with tensors replaced by their nodes."""
    output: Any = None
    """The returned value with tensors replaced by their nodes."""

    def refs(self) -> dict[fx.Node, ArgRef]:
        """Every node passed to the call -> where it sits (its first place, tuple members included)."""
        out: dict[fx.Node, ArgRef] = {}
        entries = [(ArgRef(index=i), a) for i, a in enumerate(self.args)]
        entries += [(ArgRef(name=k), v) for k, v in self.kwargs.items()]
        for ref, value in entries:
            if isinstance(value, fx.Node):
                out.setdefault(value, ref)
            elif isinstance(value, (tuple, list)):
                for j, item in enumerate(value):
                    if isinstance(item, fx.Node):
                        out.setdefault(item, ArgRef(ref.index, ref.name, j))
        return out


@dataclass
class BlockTrace:
    """The traced data flow of one block."""

    graph: fx.Graph
    block: nn.Module
    inputs: dict[str, fx.Node]
    """Placeholder node of every tensor input, named ``arg`` or ``arg.i`` for tuple members."""
    calls: list[ModuleCall] = field(default_factory=list)
    example_output: Any = None
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    """The value of every ``get_attr`` node that is not a parameter or buffer of the block (``_const<i>``)."""

    def nodes(self, op: str | None = None) -> Iterator[fx.Node]:
        return (n for n in self.graph.nodes if op is None or n.op == op)

    def module(self, path: str) -> nn.Module:
        return self.block.get_submodule(path) if path else self.block

    def call_of(self, path: str) -> ModuleCall | None:
        """The first recorded call of the non-leaf sub-module at ``path``."""
        return next((c for c in self.calls if c.path == path), None)


class _Recorder(TorchFunctionMode):
    """Records torch functions called outside leaf modules."""

    def __init__(self, tracer: _Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.tracer.leaf_depth == 0:
            self.tracer.record("call_function", func, args, kwargs, out)
        return out


class _Tracer:
    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.graph = fx.Graph()
        self.env: dict[int, fx.Node] = {}
        self.keep: list[Any] = []  # keeps traced tensors alive so their ids stay unique
        self.leaf_depth = 0
        self.stack: list[str] = []
        self.calls: list[ModuleCall] = []
        self.param_names = {id(p): n for n, p in block.named_parameters()}
        self.param_names.update({id(b): n for n, b in block.named_buffers()})
        self.constants: dict[str, torch.Tensor] = {}
        self.paths = {id(m): n for n, m in block.named_modules()}

    def node_of(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        node = self.env.get(id(value))
        if node is None:  # a tensor born outside the traced ops: a parameter or a constant
            name = self.param_names.get(id(value))
            if name is None:
                name = f"_const{len(self.env)}"
                self.constants[name] = value.detach()
            node = self.graph.get_attr(name)
            node.meta["shape"] = tuple(value.shape)
            self.bind(value, node)
        return node

    def bind(self, value: torch.Tensor, node: fx.Node) -> None:
        self.env[id(value)] = node
        self.keep.append(value)

    def to_nodes(self, tree: Any) -> Any:
        return tree_map(self.node_of, tree)

    def record(self, op: str, target: Any, args: Any, kwargs: Any, out: Any) -> None:
        tensors, _ = tree_flatten(out)
        if not any(isinstance(t, torch.Tensor) for t in tensors):
            return
        node = self.graph.create_node(op, target, self.to_nodes(tuple(args)), self.to_nodes(dict(kwargs)))
        node.meta["stack"] = tuple(self.stack)
        if isinstance(out, torch.Tensor):
            node.meta["shape"] = tuple(out.shape)
            self.bind(out, node)
            return
        node.meta["shape"] = None
        for i, t in enumerate(out if isinstance(out, (tuple, list)) else ()):
            if isinstance(t, torch.Tensor):
                item = self.graph.call_function(_getitem, (node, i))
                item.meta.update(stack=tuple(self.stack), shape=tuple(t.shape))
                self.bind(t, item)

    def pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        path = self.paths[id(module)]
        if self.leaf_depth:
            self.leaf_depth += is_leaf(module)
            return
        if is_leaf(module) and module is not self.block:
            self.leaf_depth = 1
            self.pending = (args, kwargs)
            return
        self.calls.append(ModuleCall(path, module, self.to_nodes(tuple(args)), self.to_nodes(dict(kwargs))))
        self.stack.append(path)

    def post_hook(self, module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        path = self.paths[id(module)]
        if self.leaf_depth:
            self.leaf_depth -= is_leaf(module)
            if self.leaf_depth == 0 and is_leaf(module) and module is not self.block:
                self.record("call_module", path, args, kwargs, out)
            return
        self.stack.pop()
        call = next(c for c in reversed(self.calls) if c.path == path and c.output is None)
        call.output = self.to_nodes(out)


def _getitem(value: Any, index: int) -> Any:
    return value[index]


@contextmanager
def _hooks(tracer: _Tracer) -> Iterator[None]:
    handles = []
    for module in tracer.block.modules():
        handles.append(module.register_forward_pre_hook(tracer.pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(tracer.post_hook, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _bind_inputs(
    tracer: _Tracer, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, fx.Node]:
    bound = inspect.signature(block.forward).bind_partial(*args, **kwargs)
    inputs: dict[str, fx.Node] = {}
    for name, value in bound.arguments.items():
        flat = (
            [(name, value)]
            if isinstance(value, torch.Tensor)
            else [(f"{name}.{i}", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
            if isinstance(value, (tuple, list))
            else []
        )
        for key, tensor in flat:
            node = tracer.graph.placeholder(key.replace(".", "_"))
            node.meta["shape"] = tuple(tensor.shape)
            node.meta["input"] = key
            tracer.bind(tensor, node)
            inputs[key] = node
    return inputs


def trace_block(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> BlockTrace:
    """Run ``block(*args, **kwargs)`` once and return its traced data flow."""
    kwargs = kwargs or {}
    tracer = _Tracer(block)
    inputs = _bind_inputs(tracer, block, args, kwargs)
    with _hooks(tracer), _Recorder(tracer), torch.no_grad():
        out = block(*args, **kwargs)
    tracer.graph.output(tracer.to_nodes(out))
    return BlockTrace(tracer.graph, block, inputs, tracer.calls, out, tracer.constants)
