"""Host synchronisations a GPU run would make, counted on the host.

On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``torch.equal``,
``.cpu()``, an op whose output's size depends on the values such as ``nonzero``), a blocking copy between the host
and the GPU (``copy_`` either way, ``.to("cpu")``) and ``torch.cuda.synchronize`` wait for every kernel queued before
them. On the host the same calls cost nothing, and nothing tells the tensors a GPU run would keep on the GPU from
those it keeps on the host. :class:`DeviceValues` tells them apart by where they come from:

* on the device (*held*): the tensors it is told of (:meth:`DeviceValues.hold`: the parameters, the optimizer's
  state, the batch Lightning moved), every tensor made on a ``torch.device`` object (:data:`FACTORIES`: a tensor's or
  a group's device) and every tensor handed to a collective (NCCL's are the GPU's);
* on the host: the tensors it is told of (:meth:`DeviceValues.host`: the loader's batch);
* *queued*: a tensor moved by ``Tensor.to(torch.device, non_blocking=True)`` (how the package moves what it makes
  on the host: a header, an index, the documents of a batch), on the device unless an op combines it with a host
  tensor (then it was moved to the host's device: the rows a host batch is cut by).

What an op makes (and what it writes into) is held when one of its tensors is, else on the host when one is, else
queued when one is. It records (:attr:`DeviceValues.sites`, with the frames that led there) each read of a held or
queued tensor's value, each blocking copy between the device and the host, each ``.to("cpu")`` or ``.cpu()`` of a
device tensor without ``non_blocking=True``, and each call of the package's
:func:`~lightning_paradyse.distributed.comm.synchronize`; not gloo's own copies inside a collective, nor any in a
function named a host branch (:attr:`DeviceValues.host_branches`). A GPU's own count (CUDA's synchronisation debug
mode) is the authority; this one runs on every machine, so a new synchronisation is caught where no GPU is.
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

READS = frozenset({"_local_scalar_dense", "equal", "is_nonzero", "nonzero", "masked_select", "_unique2"})
"""Ops that hand a tensor's values to the host, or whose output's size depends on them."""
METHODS = ("tolist", "numpy", "cpu")
"""Tensor methods that copy values to the host outside the dispatcher."""
FACTORIES = ("zeros", "ones", "empty", "full", "arange", "eye", "rand", "randn", "randint", "linspace")
"""Functions that make a tensor: one made on a ``torch.device`` object (a tensor's or a group's device, where a GPU
run makes it on the GPU) is held; one made on the string ``"cpu"`` or on no device named is the host's."""

_Tags = dict[int, "weakref.ref[torch.Tensor]"]


class DeviceValues(TorchDispatchMode):
    """While entered: :attr:`sites` of every host synchronisation a GPU run would make (see the module docstring)."""

    def __init__(self, host_branches: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.host_branches = host_branches
        """Functions (``"models/llama.py:resolve_positions"``: a package file and a function in it) that synchronise
        only on their host branch: on a GPU they take another (on the host both name the one device)."""
        self.sites: list[str] = []
        self._held: _Tags = {}
        self._host: _Tags = {}
        self._queued: _Tags = {}
        self._saved: dict[str, Any] = {}
        self._factories: dict[str, Any] = {}
        self._synchronize: list[tuple[Any, Any]] = []

    def hold(self, *tensors: Any) -> None:
        """Follow these tensors (any nesting of collections) as a GPU run's device tensors."""
        _add(self._held, tensors)

    def host(self, *tensors: Any) -> None:
        """These tensors (any nesting) are the host's in a GPU run too."""
        _add(self._host, tensors)

    def held(self, t: Any) -> bool:
        """Whether ``t`` is one of the device's tensors."""
        return _has(self._held, t)

    def _on_device(self, t: Any) -> bool:
        """Held, or queued onto the device (see the module docstring)."""
        return _has(self._held, t) or _has(self._queued, t)

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
            out = to(t, *args, **kwargs)
            queued = kwargs.get("non_blocking", False)
            if any(a == "cpu" for a in targets if isinstance(a, str)):  # a copy to the host
                if not self._on_device(t):
                    return out
                if not queued:
                    self._sync("Tensor.to('cpu')")
                return self._host_copy(out, t)
            onto_device = queued and any(isinstance(a, torch.device) for a in targets)
            if not onto_device or self.held(t):
                return out
            copy = out.clone() if out is t else out  # on the host the tensor itself: a copy stands for the device's
            self._host.pop(id(copy), None)
            _add(self._queued, copy)
            return copy

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
        for module, original in self._synchronize:
            module.synchronize = original
        self._saved, self._factories, self._synchronize = {}, {}, []

    def _read(self, name: str, original: Any) -> Any:
        def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self._on_device(tensor):
                return original(tensor, *args, **kwargs)
            self._sync(f"Tensor.{name}")
            out = original(tensor, *args, **kwargs)
            return self._host_copy(out, tensor) if name == "cpu" else out

        return method

    def _host_copy(self, out: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """What a copy of ``source`` to the host gives (on the host: the tensor itself, or one the op made from a
        device tensor): a tensor of the host's."""
        copy = out.clone() if out is source else out
        for tags in (self._held, self._queued):
            tags.pop(id(copy), None)
        self.host(copy)
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
        if func.namespace in ("c10d", "_c10d_functional"):  # NCCL's tensors are the GPU's, whatever made them
            self.hold(given, out)
            return out
        if name == "copy_":  # a copy between the host and the device blocks unless it is queued
            queued = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if self._on_device(args[0]) != self._on_device(args[1]) and not queued and not _in_collective():
                self._sync("copy_")  # (gloo copies what it received inside a collective: device work under NCCL)
            return out
        made = [out, *_written(func, args, kwargs)]
        if any(self.held(t) for t in given):
            if name in READS:
                self._sync(name)
            self.hold(made)
        elif any(_has(self._host, t) for t in given):
            self.host(made)  # a queued tensor combined with a host one was moved to the host
        elif any(_has(self._queued, t) for t in given):
            if name in READS:
                self._sync(name)
            _add(self._queued, made)
        return out


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an op writes into (its schema's mutable arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


def _in_collective() -> bool:
    """Whether torch's collectives, or the package's wait for one (``comm._settle``: gloo finishes a collective
    inside its wait), are on the stack."""
    return any(
        frame.filename.endswith(("distributed_c10d.py", "_functional_collectives.py"))
        or (frame.name == "_settle" and frame.filename.endswith(os.path.join("distributed", "comm.py")))
        for frame in traceback.extract_stack()
    )


def _add(where: _Tags, tensors: Any) -> None:
    """Every tensor of ``tensors`` (any nesting) into ``where``, by identity, forgotten when it is freed."""
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor):
            key = id(t)
            where[key] = weakref.ref(t, lambda _, key=key: where.pop(key, None))  # type: ignore[misc]


def _has(where: _Tags, t: Any) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    ref = where.get(id(t))
    return ref is not None and ref() is t
