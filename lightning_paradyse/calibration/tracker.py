"""Measuring memory: live and peak tensor bytes, on CPU and on CUDA.

CUDA's caching allocator keeps statistics (``torch.cuda.memory_allocated`` / ``max_memory_allocated``);
the CPU allocator keeps none. :class:`MemoryTracker` is the CPU analogue: a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` that sees every ATen call (forward, backward
and activation recomputation alike, since the autograd engine carries the mode into backward),
counts the untyped storage of every tensor an op *creates*, and subtracts it when the storage is
freed (``weakref.finalize`` on the storage object, which PyTorch keeps alive exactly as long as the
storage itself). A storage is counted once however many views share it; an output that shares a
storage with an input (a view, an in-place op, an ``out=`` argument, a collective writing into a
given buffer) is not new memory and is not counted.

What is counted is what ``max_memory_allocated`` counts on CUDA: bytes of live tensor storages.
Allocator rounding, fragmentation and buffers that communication libraries allocate outside
PyTorch (gloo, NCCL) are not included, nor are they in the cost model: leave headroom in a memory budget.

Only storages created while the tracker is active are counted, so ``live`` and ``peak`` are relative
to the moment the tracker was entered, unless ``resident`` tensors are given: their storages count from
the start and stop counting when they are freed during the tracked span (gradients that the training
loop sets to ``None`` before the backward), so ``peak`` is then the absolute peak of everything tracked.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_LIFT = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def _storage_ids(values: Any) -> set[int]:
    ids: set[int] = set()
    for value in tree_flatten(values)[0]:
        if isinstance(value, torch.Tensor):
            try:
                ids.add(id(value.untyped_storage()))
            except (RuntimeError, NotImplementedError):  # tensors without a storage (sparse, nested)
                continue
    return ids


class _StorageCounter(TorchDispatchMode):
    """The dispatch mode behind :class:`MemoryTracker` on CPU (and any non-CUDA device)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        """Bytes of the counted storages that are still alive."""
        self.peak = 0
        """Largest ``live`` since the last reset."""
        self.count = 0
        """Number of storages counted (alive or freed)."""
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # torch.tensor(data) builds the tensor outside ATen and hands it to lift_fresh: a new storage
        inputs = set() if func in _LIFT else _storage_ids((args, kwargs))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor, inputs)
        return out

    def add_resident(self, tensors: list[torch.Tensor]) -> None:
        """Count the storages of ``tensors`` as live now (each once), until they are freed."""
        for tensor in tensors:
            self._add(tensor, set())

    def _add(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(storage)
        if key in inputs or key in self._alive:
            return
        nbytes = storage.nbytes()
        self._alive.add(key)
        self.live += nbytes
        self.count += 1
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        if key in self._alive:
            self._alive.discard(key)
            self.live -= nbytes


def state_tensors(module: torch.nn.Module, optimizers: Iterable[Any] = ()) -> list[torch.Tensor]:
    """What lives across training steps: parameters, buffers, gradients and optimizer state (``resident``)."""
    out: list[torch.Tensor] = [*module.parameters(), *module.buffers()]
    out += [p.grad for p in module.parameters() if p.grad is not None]
    for opt in optimizers:
        for state in getattr(opt, "_optimizer", opt).state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


class MemoryTracker:
    """Live and peak tensor bytes while active, relative to entry; CPU by dispatch, CUDA by the allocator.

    Example::

        with MemoryTracker() as mem:
            y = model(x)
            mem.reset_peak()
            y.sum().backward()
        mem.peak  # largest live bytes during backward, relative to entry
    """

    def __init__(self, device: torch.device | str | None = None, resident: Iterable[torch.Tensor] = ()) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        """Where the tracked tensors live: ``cuda`` uses the allocator's statistics."""
        self.resident = [t for t in resident if isinstance(t, torch.Tensor)]
        """Tensors alive at entry that count (parameters, gradients, optimizer state): see the module docstring.
        On CUDA any ``resident`` makes :attr:`live` and :attr:`peak` absolute (everything allocated)."""
        self._mode: _StorageCounter | None = None
        self._base = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self) -> MemoryTracker:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._base = 0 if self.resident else torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = _StorageCounter()
            self._mode.add_resident(self.resident)
            self._mode.__enter__()
        self.resident = []  # counted; not kept alive by the tracker
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)

    @property
    def live(self) -> int:
        """Bytes allocated since entry and still alive."""
        if self.cuda:
            return int(torch.cuda.memory_allocated(self.device)) - self._base
        assert self._mode is not None, "use MemoryTracker as a context manager"
        return self._mode.live

    @property
    def peak(self) -> int:
        """Largest :attr:`live` since entry or the last :meth:`reset_peak`."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device)) - self._base
        assert self._mode is not None, "use MemoryTracker as a context manager"
        return self._mode.peak

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            assert self._mode is not None, "use MemoryTracker as a context manager"
            self._mode.peak = self._mode.live
