"""Host synchronisations a GPU run would make, counted on the host.

On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``torch.equal``,
``.cpu()``), a blocking copy between the host and the GPU (``copy_`` either way, ``.to("cpu")``) and
``torch.cuda.synchronize`` wait for every kernel queued before them. On the host the same calls cost nothing, and
nothing tells the tensors a GPU run would keep on the GPU from those it makes on the host. :class:`DeviceValues`
follows them: the tensors it is told of (:meth:`DeviceValues.hold`: the parameters, the optimizer's state, the batch
Lightning moved), every tensor made on a ``torch.device`` object (:data:`FACTORIES`), every tensor an op makes from
one of them (a collective's output buffer too: every tensor an op is handed is then held) and every tensor handed to
a collective (NCCL's are the GPU's). What the package makes on the host and moves onto the device (a header, an
index) is otherwise followed from the first op that combines it with a followed tensor: on the host a move onto the
device cannot be told from a copy kept on the host (both name the one device there).

It records (:attr:`DeviceValues.sites`, with the frames that led there) each read of a held tensor's value, each
blocking copy between a held and a host tensor, each ``.to("cpu")`` or ``.cpu()`` of a held tensor that does not
pass ``non_blocking=True``, and each call of the package's :func:`~lightning_paradyse.distributed.comm.synchronize`;
not gloo's own copies inside a collective, nor the reads of a function named a host branch
(:attr:`DeviceValues.host_branches`). A GPU's own count (CUDA's synchronisation debug mode) is the authority; this
one runs on every machine, so a new synchronisation is caught where no GPU is.
"""

from __future__ import annotations

import os
import sys
import traceback
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.support.copies import call_sites

READS = frozenset({"_local_scalar_dense", "equal", "is_nonzero"})
"""Ops that hand a tensor's value to the host."""
METHODS = ("tolist", "numpy", "cpu", "__array__")
"""Tensor methods that copy values to the host outside the dispatcher."""
FACTORIES = ("zeros", "ones", "empty", "full", "arange", "eye", "rand", "randn", "randint", "linspace")
"""Functions that make a tensor: one made on a ``torch.device`` object (a tensor's or a group's device, where a GPU
run makes it on the GPU) is followed; one made on the string ``"cpu"`` or on no device named is the host's."""


class DeviceValues(TorchDispatchMode):
    """While entered: :attr:`sites` of every host synchronisation a GPU run would make (see the module docstring)."""

    def __init__(self, host_branches: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.host_branches = host_branches
        """Functions (``"models/llama.py:resolve_positions"``: a package file and a function in it) whose reads are
        their host branch: on a GPU they take another, which reads nothing (on the host both name the one device)."""
        self.sites: list[str] = []
        self._held: dict[int, weakref.ref[torch.Tensor]] = {}
        self._queued: dict[int, weakref.ref[torch.Tensor]] = {}
        """Tensors moved by ``Tensor.to(device, non_blocking=True)``: on the device or on the host (on the host the
        two cannot be told apart), not followed; a copy from one into a followed tensor is not counted."""
        self._saved: dict[str, Any] = {}
        self._factories: dict[str, Any] = {}
        self._synchronize: list[tuple[Any, Any]] = []

    def hold(self, *tensors: Any) -> None:
        """Follow these tensors (any nesting of collections) as a GPU run's device tensors."""
        _add(self._held, tensors)

    def held(self, t: Any) -> bool:
        return _has(self._held, t)

    def _sync(self, what: str) -> None:
        frames = traceback.extract_stack()
        if any(f"{'/'.join(f.filename.split(os.sep)[-2:])}:{f.name}" in self.host_branches for f in frames):
            return
        self.sites.append(f"{what}: {call_sites()}")

    def __enter__(self) -> DeviceValues:
        for name in METHODS:
            self._saved[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._read(name, original))
        self._saved["to"] = to = torch.Tensor.to

        def moved(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            targets = [*args, kwargs.get("device")]
            host = any(a == "cpu" for a in targets if isinstance(a, str))
            out = to(t, *args, **kwargs)
            if host and self.held(t):
                if not kwargs.get("non_blocking", False):
                    self._sync("Tensor.to('cpu')")
                return self._host_copy(out, t)
            if not host and kwargs.get("non_blocking", False):
                _add(self._queued, out)
            return out

        torch.Tensor.to = moved  # type: ignore[method-assign]
        for name in FACTORIES:
            self._factories[name] = original = getattr(torch, name)
            setattr(torch, name, self._made(original))
        for module in [m for name, m in sys.modules.items() if name.startswith("lightning_paradyse")]:
            original = getattr(module, "synchronize", None)
            if original is not None and getattr(original, "__module__", "") == "lightning_paradyse.distributed.comm":
                self._synchronize.append((module, original))
                module.synchronize = self._synchronized(original)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        for name, original in self._factories.items():
            setattr(torch, name, original)
        self._factories = {}
        for module, original in self._synchronize:
            module.synchronize = original
        self._saved, self._synchronize = {}, []

    def _read(self, name: str, original: Any) -> Any:
        def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.held(tensor):
                return original(tensor, *args, **kwargs)
            self._sync(f"Tensor.{name}")
            out = original(tensor, *args, **kwargs)
            return self._host_copy(out, tensor) if name == "cpu" else out

        return method

    def _host_copy(self, out: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """What a copy of ``source`` to the host gives: on the host the tensor itself, then a copy not followed."""
        if out is not source:
            return out
        copy = out.clone()
        self._held.pop(id(copy), None)
        return copy

    def _made(self, original: Any) -> Any:
        def factory(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if isinstance(kwargs.get("device"), torch.device):  # made where a tensor or a group lives
                self.hold(out)
            return out

        return factory

    def _synchronized(self, original: Any) -> Any:
        def synchronize(device: torch.device) -> None:
            self._sync("synchronize")
            original(device)

        return synchronize

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        if name == "copy_":  # a copy between the host and the device blocks unless it is queued
            if _in_collective():  # gloo's own copies of what it received (device work under NCCL)
                return out
            queued = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            source_on_device = self.held(args[1]) or _has(self._queued, args[1])
            if self.held(args[0]) != source_on_device and not queued:
                self._sync("copy_")
            return out
        if func.namespace in ("c10d", "_c10d_functional"):  # NCCL's tensors are the GPU's, whatever made them
            self.hold(given, out)
        elif any(self.held(t) for t in given):
            if name in READS:
                self._sync(name)
            self.hold(given, out)  # what the op made, and what it wrote into (a collective's output buffer)
        return out


def _add(where: dict[int, weakref.ref[torch.Tensor]], tensors: Any) -> None:
    """Every tensor of ``tensors`` (any nesting) into ``where``, by identity, forgotten when it is freed."""
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor):
            key = id(t)
            where[key] = weakref.ref(t, lambda _, key=key: where.pop(key, None))  # type: ignore[misc]


def _has(where: dict[int, weakref.ref[torch.Tensor]], t: Any) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    ref = where.get(id(t))
    return ref is not None and ref() is t


def _in_collective() -> bool:
    """Whether torch's collectives are on the stack (what gloo copies there, NCCL does on the device)."""
    return any(
        frame.filename.endswith(("distributed_c10d.py", "_functional_collectives.py"))
        for frame in traceback.extract_stack()
    )
