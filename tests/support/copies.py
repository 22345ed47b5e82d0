"""Blocking copies onto a device, counted on any machine.

A copy onto a GPU that blocks (``t.to(device)``, ``torch.tensor(values, device=device)``) waits for every kernel
queued before it: a host synchronisation. On the host the same calls cost nothing and name a CPU device, so
:class:`BlockingCopies` counts the calls themselves: a blocking ``Tensor.to`` whose target is a ``torch.device``
object (the device of a tensor, of a group: where a GPU run puts a GPU) or a CUDA device by name, and every
``torch.tensor(..., device=...)`` with a device that is not the string ``"cpu"`` (a copy meant for the host, as the
optimizers make). ``Tensor.cuda()`` and ``copy_`` are not counted. Each is recorded with the frames that led to it
(:func:`call_sites`)."""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

import lightning_paradyse

PACKAGE = os.path.dirname(lightning_paradyse.__file__) + os.sep
DEVICE_NAMES = ("cuda", *(f"cuda:{i}" for i in range(8)))
"""Accelerator devices named by a string (``"cpu"`` is the host: a copy meant for it is not counted here)."""


def call_sites(depth: int = 4) -> str:
    """The innermost ``depth`` frames of the package that led here (innermost first), followed by the innermost
    frames outside it when the innermost package frame is a test's entry (the call came from Lightning or torch)."""
    stack = traceback.extract_stack()[:-2]
    ours = [f for f in stack if f.filename.startswith(PACKAGE)]
    if ours and not ours[-1].filename.endswith("spawn.py"):
        picked = ours[::-1][:depth]
    else:
        picked = [f for f in stack[::-1] if not f.filename.startswith(PACKAGE)][:depth]
    return " <- ".join(f"{'/'.join(f.filename.split(os.sep)[-2:])}:{f.lineno}" for f in picked)


class BlockingCopies:
    """While entered: :attr:`sites` of every blocking copy onto a device (see the module docstring)."""

    def __init__(self) -> None:
        self.sites: list[str] = []
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> BlockingCopies:
        to, tensor = torch.Tensor.to, torch.tensor
        self._saved = (to, tensor)

        def counted_to(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            targets = [*args, kwargs.get("device")]
            named = any(isinstance(a, torch.device) or (isinstance(a, str) and a in DEVICE_NAMES) for a in targets)
            if not kwargs.get("non_blocking", False) and named:
                self.sites.append(call_sites())
            return to(t, *args, **kwargs)

        def counted_tensor(*args: Any, **kwargs: Any) -> Any:
            device = kwargs.get("device")
            if device is not None and device != "cpu":
                self.sites.append(call_sites())
            return tensor(*args, **kwargs)

        torch.Tensor.to = counted_to  # type: ignore[method-assign]
        torch.tensor = counted_tensor
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._saved is not None
        torch.Tensor.to, torch.tensor = self._saved  # type: ignore[method-assign]
