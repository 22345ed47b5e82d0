"""What keeps a user's training exact under sharded parameters, or stops it with the reason and the fix.

A parallelised model holds every projection weight as a 1/p shard and the other parameters whole on every rank.
Whatever reads *whole* tensors across that boundary must be made exact or refused:

* **Optimizers** (:func:`check_optimizers`): an element-wise optimizer (SGD, Adam, AdamW, RMSprop, ...) updates
  each entry from that entry's own gradient and state, so it is exact on shards. Optimizers that look at whole
  matrices (Adafactor's factored moments, Muon's orthogonalisation, LAMB's trust ratio, Shampoo's
  preconditioners, L-BFGS's line search) are refused at setup by name; an unknown one is refused unless the user
  vouches that it is element-wise.
* **Gradient-norm clipping** (:class:`ClipInterception`): while the strategy runs, ``torch.nn.utils.clip_grad_norm_``
  called on parameters that include shards (Lightning's ``gradient_clip_algorithm="norm"``, or the user's own call
  in a hook) computes the norm of the *whole* model's gradients, exactly as one process would.
* **Replicas** (:func:`check_replicas`): a cheap digest of the replicated parameters, compared across ranks after
  the first optimizer steps, every ``N`` steps and at every checkpoint, turns any drift into an error naming the
  parameters and the likely cause.
* **Random numbers** (:mod:`~lightning_paradyse.runtime.streams`): the model's calls in a training step draw from
  a per-rank stream, so ranks do not drop the same positions of their chunks; the step's own code draws from the
  process's streams, the same on every rank.
* **Positions and windows** (:func:`check_rotary`, :func:`attention_window`, :func:`check_window`): rotary
  embeddings whose frequencies follow each call's largest position are refused, and a batch longer than a sliding
  or chunked attention window the modes do not apply is refused before any collective.

Every check that can fail raises on every rank alike (its inputs are identical on every rank, or it is a
collective whose result every rank sees).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy
import torch
import torch.nn as nn
from torch.optim import Optimizer

from lightning_paradyse.distributed.comm import Group
from lightning_paradyse.runtime import parallel

ELEMENTWISE_OPTIMIZERS: tuple[type[Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
"""PyTorch optimizers whose update of each entry reads only that entry's gradient and state: exact on shards."""

WHOLE_TENSOR_OPTIMIZERS: dict[str, str] = {
    "Adafactor": "its second moments are factored into row and column means of each whole matrix",
    "Muon": "it orthogonalises each whole matrix update (Newton-Schulz over the full matrix)",
    "LBFGS": "its line search and curvature pairs use dot products over every whole parameter",
    "SparseAdam": "it needs sparse gradients, which sharded projections do not produce",
    "Lamb": "its trust ratio is the norm of each whole parameter over the norm of its whole update",
    "LAMB": "its trust ratio is the norm of each whole parameter over the norm of its whole update",
    "Lars": "its trust ratio is the norm of each whole parameter over the norm of its whole gradient",
    "LARS": "its trust ratio is the norm of each whole parameter over the norm of its whole gradient",
    "Shampoo": "its preconditioners are built from whole gradient matrices",
    "SOAP": "its preconditioners are built from whole gradient matrices",
}
"""Optimizers known to read whole tensors, with the reason (refused by name)."""


def check_optimizers(optimizers: Sequence[Any], allowed: Sequence[str] = ()) -> None:
    """Refuse optimizers that are not element-wise (before any step; the same on every rank).

    Args:
        optimizers: The strategy's optimizers (Lightning wrappers are unwrapped).
        allowed: Class names the user vouches are element-wise (``ParaDySeStrategy(elementwise_optimizers=...)``).

    Raises:
        ValueError: Naming the optimizer, why it cannot run on shards, and the fix.
    """
    for optimizer in optimizers:
        inner = getattr(optimizer, "_optimizer", optimizer)
        cls = type(inner)
        if cls in ELEMENTWISE_OPTIMIZERS or cls.__name__ in allowed or _elementwise_subclass(cls):
            continue
        why = WHOLE_TENSOR_OPTIMIZERS.get(cls.__name__)
        if why is not None:
            raise ValueError(
                f"ParaDySeStrategy cannot train with {cls.__name__}: {why}, and each rank holds only a 1/p shard of "
                f"every projection, so the update would differ from one process's. Use an element-wise optimizer "
                f"(AdamW, Adam, SGD, RMSprop, ...)"
            )
        raise ValueError(
            f"ParaDySeStrategy does not know whether the optimizer {cls.__name__} updates every entry from that "
            f"entry's gradient and state alone (as AdamW does), which sharded parameters need for an exact update. "
            f"If it does, allow it with ParaDySeStrategy(elementwise_optimizers=[{cls.__name__!r}]); optimizers that "
            f"read whole tensors (Adafactor, Muon, LAMB, Shampoo) are not supported"
        )


_BEHAVIOURLESS = frozenset(
    {
        "__init__",
        "__module__",
        "__qualname__",
        "__doc__",
        "__annotations__",
        "__dict__",
        "__weakref__",
        "__firstlineno__",
        "__static_attributes__",
        "__annotate__",
    }
)
"""What a subclass may define and still update as its element-wise base does (:func:`_elementwise_subclass`)."""


def _elementwise_subclass(cls: type) -> bool:
    """Whether ``cls`` subclasses an element-wise optimizer and changes nothing of its update: every class between
    them defines at most ``__init__`` (other defaults, a name of one's own). One that overrides ``step`` or any other
    method may read whole tensors, so it stays unknown (refused until allowed by name); until 2026-12-02 every
    subclass was (probe 19)."""
    base = next((b for b in cls.__mro__ if b in ELEMENTWISE_OPTIMIZERS), None)
    if base is None:
        return False
    for c in cls.__mro__[: cls.__mro__.index(base)]:
        own = set(vars(c)) - _BEHAVIOURLESS
        # torch's first instance of a class wraps the step it finds for its profiler, in that class: the base's
        if own - {"step"} or ("step" in own and _unhooked(vars(c)["step"]) is not _unhooked(base.step)):
            return False
    return True


def _unhooked(step: Any) -> Any:
    """``step`` without the profiler's wrappers torch puts around an optimizer class's step (``hooked``)."""
    while getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


class ClipInterception:
    """While active, gradient norms taken on shards are the whole model's norm.

    Lightning's norm clipping and a user's own call (``torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)`` in
    a hook) both look the function up on ``torch.nn.utils`` at call time, so both get the exact global norm: the
    shards' parts summed over the group, replicated parameters counted once. ``torch.nn.utils.get_total_norm`` on
    gradients is intercepted the same way (so ``get_total_norm`` then ``clip_grads_with_norm_``, which only scales,
    is exact too). Calls without shards run the original functions. A reference taken before the strategy started
    (``from torch.nn.utils import clip_grad_norm_`` at import time) is not intercepted: call
    ``trainer.strategy.clip_grad_norm_`` or Lightning's ``self.clip_gradients`` instead (the replica check turns a
    missed one into an error).
    """

    _ORIGINAL = torch.nn.utils.clip_grad_norm_
    _ORIGINAL_TOTAL = torch.nn.utils.get_total_norm

    def __init__(
        self, sharded: Callable[[], set[int]], group: Callable[[], Group], sharded_grads: Callable[[], set[int]]
    ) -> None:
        """``sharded``: ids of the sharded parameters; ``sharded_grads``: ids of their current gradients."""
        self._sharded, self._group, self._sharded_grads = sharded, group, sharded_grads
        self._active = False
        self._replaced: list[tuple[Any, str, Any]] = []

    def clip(
        self,
        parameters: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` with the whole model's norm when ``parameters`` include shards."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        sharded = self._sharded()
        if not any(id(p) in sharded for p in params):
            return ClipInterception._ORIGINAL(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return parallel.clip_grad_norm(params, float(max_norm), sharded, self._group(), norm_type, error_if_nonfinite)

    def total_norm(
        self, tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
    ) -> torch.Tensor:
        """``torch.nn.utils.get_total_norm`` with the whole model's norm when ``tensors`` include sharded grads."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        sharded = self._sharded_grads()
        shard = [id(t) in sharded for t in tensors]
        if not any(shard):
            return ClipInterception._ORIGINAL_TOTAL(tensors, norm_type, error_if_nonfinite, foreach)
        total = parallel.tensor_norm(tensors, shard, self._group(), float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
        return total

    def start(self) -> None:
        if self._active:
            return
        clip_grad = torch.nn.utils.clip_grad
        targets = [
            (torch.nn.utils, "clip_grad_norm_", self.clip),
            (clip_grad, "clip_grad_norm_", self.clip),
            (torch.nn.utils, "get_total_norm", self.total_norm),
        ]
        self._replaced = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
        for owner, name, ours in targets:
            setattr(owner, name, ours)
        self._active = True

    def stop(self) -> None:
        """Put back what :meth:`start` replaced, where ours is still installed (a later patch is left alone)."""
        if not self._active:
            return
        ours = {"clip_grad_norm_": self.clip, "get_total_norm": self.total_norm}
        for owner, name, before in self._replaced:
            if getattr(owner, name) == ours[name]:
                setattr(owner, name, before)
        self._active = False


def check_replicas(module: nn.Module, group: Group, when: str) -> None:
    """Raise on every rank if replicated parameters differ between ranks (a collective)."""
    differ = parallel.replicas_differ(module, group)
    if differ:
        shown = ", ".join(differ[:5]) + (" ..." if len(differ) > 5 else "")
        raise RuntimeError(
            f"replicated parameters differ between ranks {when} ({shown}): every rank must apply the same update to "
            f"the parameters it holds whole. Likely causes: a gradient clip or an optimizer that reads only this "
            f"rank's shards (e.g. a clip_grad_norm_ imported before training started; use Trainer(gradient_clip_val="
            f"..., gradient_clip_algorithm='norm') or trainer.strategy.clip_grad_norm_), random numbers drawn in the "
            f"update, or parameters changed by hand on one rank"
        )


def replica_check_due(step: int, every: int) -> bool:
    """Whether optimizer step ``step`` (1-based) is checked: the first three, then every ``every`` (0: never)."""
    return every > 0 and (step <= 3 or step % every == 0)


def _cuda_indices(device: torch.device | None) -> list[int]:
    """The GPU whose random stream ``torch.random.fork_rng`` must keep for ``device`` (none on the host)."""
    if device is None or device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def host_rng_state() -> dict[str, Any]:
    """The process's host random streams: torch's, Python's ``random`` and NumPy's (a launcher carries them into its
    workers: :func:`set_host_rng_state`)."""
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": numpy.random.get_state(),
    }


def set_host_rng_state(state: Mapping[str, Any]) -> None:
    """Set the streams :func:`host_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])


@contextlib.contextmanager
def kept_rng(device: torch.device | None) -> Iterator[None]:
    """Random numbers drawn inside (the strategy's own set-up: tracing, probing, measuring) leave the process's
    streams as they were: the host's (:func:`host_rng_state`) and ``device``'s. What the user's code draws next (a
    shuffling sampler's order, a ``DataLoader`` worker's seed) is then what one process draws."""
    host = host_rng_state()
    with torch.random.fork_rng(devices=_cuda_indices(device)):
        try:
            yield
        finally:
            set_host_rng_state(host)


def _call_dependent(rope_type: str) -> bool:
    """Hugging Face rotary types whose frequencies follow each call's largest position (``dynamic`` in any form,
    as ``transformers`` itself tests it, and LongRoPE)."""
    return "dynamic" in rope_type or rope_type == "longrope"


def check_rotary(module: nn.Module) -> None:
    """Refuse rotary embeddings whose frequencies follow each call's positions (raises alike on every rank).

    Hugging Face's dynamic NTK and LongRoPE recompute the frequencies from ``max(position_ids)`` of the call; each
    rank sees only its own positions, so every rank would rotate with other frequencies than one process does.
    """
    for name, sub in module.named_modules():
        rope_type = getattr(sub, "rope_type", None)  # a string, or one per layer type (Gemma 3, ModernBERT)
        types = list(rope_type.values()) if isinstance(rope_type, Mapping) else [rope_type]
        if any(isinstance(t, str) and _call_dependent(t) for t in types):
            raise ValueError(
                f"{name or type(module).__name__} ({type(sub).__name__}) computes its rotary frequencies from each "
                f"call's positions (rope_type={rope_type!r}); under ParaDySeStrategy each rank sees only its own "
                f"positions, so ranks would rotate differently from one process. Use a rope scaling with fixed "
                f"frequencies (default, linear, llama3, yarn)"
            )


def _tokens(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def attention_window(module: nn.Module, windows_applied: bool = False) -> tuple[int, str] | None:
    """The smallest local attention span of the model (tokens, where it was found), or ``None``.

    Sliding windows, read from an attention module's ``sliding_window`` and from Hugging Face configs
    (``sliding_window`` applies when a layer type is ``sliding_attention``, unless ``use_sliding_window`` is false,
    and everywhere for configs with neither, as Mistral's), and chunked attention (``attention_chunk_size``,
    Llama 4): on a sequence within the span neither changes anything. ``windows_applied``: the rewrite found the
    model's sliding windows and every mode applies them, so only chunked attention counts.
    """
    found: list[tuple[int, str]] = []
    for name, sub in module.named_modules():
        window = None if windows_applied else _tokens(getattr(sub, "sliding_window", None))
        if window is not None:
            found.append((window, f"{name}.sliding_window"))
        config = getattr(sub, "config", None)
        layer_types = [str(t) for t in getattr(config, "layer_types", None) or ()]
        window = None if windows_applied else _tokens(getattr(config, "sliding_window", None))
        if window is not None:
            if layer_types:
                applies = any("sliding" in t for t in layer_types)
            else:
                applies = bool(getattr(config, "use_sliding_window", True))
            if applies:
                found.append((window, f"{type(config).__name__}.sliding_window"))
        chunk = _tokens(getattr(config, "attention_chunk_size", None))
        if chunk is not None and (not layer_types or any("chunk" in t for t in layer_types)):
            found.append((chunk, f"{type(config).__name__}.attention_chunk_size"))
    return min(found) if found else None


def check_window(seq_len: int, window: tuple[int, str] | None) -> None:
    """Refuse a batch longer than the model's sliding window (raises alike on every rank, before any collective)."""
    if window is not None and seq_len > window[0]:
        size, where = window
        raise ValueError(
            f"a batch of length {seq_len} is longer than the model's local attention span of {size} tokens "
            f"({where}): ParaDySeStrategy does not apply this span in its modes, so it would train another "
            f"model. Keep sequences within {size} tokens (ParaDySeStrategy(max_seq_len={size}) or the data), or "
            f"build the model without it if it is not wanted"
        )
