"""Hugging Face gradient checkpointing under the strategy: the layers it checkpoints recompute in the plan.

``model.gradient_checkpointing_enable()`` (``activation_checkpointing_enable()`` in newer transformers) does two
things to a Hugging Face model:

* every decoder layer gets ``gradient_checkpointing = True`` and ``_gradient_checkpointing_func``, a partial of
  ``torch.utils.checkpoint.checkpoint``; in training the layer's forward then runs inside that function (with
  ``use_cache=False``);
* the input embeddings get a forward hook that makes their output require grad (``enable_input_require_grads``),
  a function local to that method.

Under :class:`~lightning_paradyse.lightning.strategy.ParaDySeStrategy`:

* **Launch.** The ``spawn`` and ``forkserver`` start methods pickle the LightningModule into every worker, and a
  local function cannot be pickled (``Can't pickle local object 'PreTrainedModel.enable_input_require_grads.
  <locals>.make_inputs_require_grads'``). :func:`prepare_for_launch` replaces that hook, in the launching process,
  by :func:`inputs_require_grad`, a module-level function that does the same, under the same hook id (so HF's
  ``disable_input_require_grads`` still removes it).
* **Steps.** A rewritten layer does not run inside HF's checkpoint: its collectives would run a second time in
  backward, inside a recomputation the planner knows nothing about (its memory and time predictions), with the
  plan's own recomputation nested in it. :func:`checkpointed_layers` (at setup and before every batch) gives such
  a layer :func:`run_directly` as its checkpoint function (HF still drops the cache for it, as in one process)
  and returns the layers HF would checkpoint; :func:`with_recompute` sets the recompute flag of both ops of those
  layers in the batch's plan. Recomputation is exact in every mode, so training equals HF's checkpointing in one
  process (``tests/exact``).
* **Refused** before any collective: a checkpoint function other than torch's ``checkpoint`` (``offload=True``
  keeps the saved activations in host memory, which the plan's recomputation does not do; a function of your own)
  or keywords of it that the plan's recomputation does not honour (:data:`HONOURED_KEYWORDS`).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from lightning_paradyse.modes.plan import LayerPlan, Plan

HF_INPUT_HOOK = "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads"
"""The qualified name of the forward hook ``enable_input_require_grads`` puts on the input embeddings."""
HF_OFFLOAD_FUNCTION = "checkpoint_func"
"""The name of the local checkpoint function Hugging Face builds for ``offload=True``."""
HONOURED_KEYWORDS: dict[str, tuple[Any, ...] | None] = {
    "use_reentrant": None,
    "preserve_rng_state": (True,),
    "determinism_check": None,
    "debug": None,
}
"""Keywords of ``torch.utils.checkpoint.checkpoint`` the plan's recomputation honours: name -> the values it
honours (``None``: any; the result does not depend on it). The plan's recomputation replays the random state."""


def inputs_require_grad(module: nn.Module, args: Any, output: Tensor) -> None:
    """Hugging Face's ``make_inputs_require_grads`` forward hook, as a module-level function (picklable)."""
    output.requires_grad_(True)


def run_directly(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The checkpoint function of a layer the plan recomputes: ``function(*args)``, no checkpoint around it."""
    return function(*args, **kwargs)


def prepare_for_launch(module: nn.Module) -> None:
    """Make a Hugging Face model with gradient checkpointing picklable, in the process that launches the workers.

    Replaces HF's local input hook by :func:`inputs_require_grad` (the same hook id, the same effect) and refuses,
    with the fix, a checkpoint function that can neither be pickled nor mapped onto the plan (``offload=True``).
    Nothing else of the module changes: the launching process keeps HF's checkpointing as it was.
    """
    for sub in module.modules():
        hooks = sub._forward_hooks
        for key, hook in list(hooks.items()):
            if getattr(hook, "__qualname__", None) == HF_INPUT_HOOK:
                hooks[key] = inputs_require_grad
    flagged = [(name, sub) for name, sub in module.named_modules() if getattr(sub, "gradient_checkpointing", False)]
    for name, sub in sorted(flagged, key=lambda item: -len(item[0].split("."))):  # layers before their model
        _check_function(name or type(module).__name__, sub)


_FOUND: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[str, ...], list[tuple[str, nn.Module]], list[nn.Module]]] = (
    weakref.WeakKeyDictionary()
)
"""Per model: the block names last asked for, the modules enclosing them (with their names) and the blocks."""


def checkpointed_layers(module: nn.Module, block_names: Sequence[str]) -> tuple[int, ...]:
    """The indices of the blocks (``block_names``, in order) Hugging Face would checkpoint in training.

    Such a block, and an enclosing module that checkpoints its blocks itself (transformers before 4.48), gets
    :func:`run_directly` as its checkpoint function: the plan recomputes the layer instead
    (:func:`with_recompute`). Raises ``ValueError`` naming the layer and the fix for a checkpoint function the plan
    cannot stand for (identical on every rank: the same model everywhere).
    """
    names = tuple(block_names)
    found = _FOUND.get(module)
    if found is None or found[0] != names:  # the modules looked up once per model (read before every batch)
        enclosing = sorted({".".join(n.split(".")[:depth]) for n in names for depth in range(n.count(".") + 1)})
        found = (names, [(n, module.get_submodule(n)) for n in enclosing], [module.get_submodule(n) for n in names])
        _FOUND[module] = found
    _, around, blocks = found
    flagged = [(name, sub) for name, sub in around if getattr(sub, "gradient_checkpointing", False) is True]
    layers = []
    for index, (name, block) in enumerate(zip(names, blocks)):  # the layers first: a refusal names the layer
        own = getattr(block, "gradient_checkpointing", None)
        if own is True:
            _take(name, block)
        if own is True or (own is None and flagged):
            layers.append(index)
    for name, sub in flagged:
        _take(name or type(module).__name__, sub)
    return tuple(layers)


def with_recompute(plan: Plan, layers: Sequence[int]) -> Plan:
    """``plan`` with both ops of every layer in ``layers`` recomputed (the other layers as they were)."""
    if not layers:
        return plan
    chosen = set(layers)
    return Plan(
        tuple(
            LayerPlan(
                dataclasses.replace(layer.attention, recompute=True), dataclasses.replace(layer.mlp, recompute=True)
            )
            if i in chosen
            else layer
            for i, layer in enumerate(plan.layers)
        )
    )


def _take(name: str, sub: nn.Module) -> None:
    """Check ``sub``'s checkpoint function, then let the plan recompute it instead (:func:`run_directly`)."""
    if getattr(sub, "_gradient_checkpointing_func", None) is run_directly:
        return
    _check_function(name, sub)
    sub._gradient_checkpointing_func = run_directly  # type: ignore[assignment]  # a function, not a submodule


def _check_function(name: str, sub: nn.Module) -> None:
    """Raise ``ValueError`` (the layer, what is refused, the fix) unless the plan's recomputation can stand for
    ``sub``'s checkpoint function: torch's ``checkpoint``, with keywords of :data:`HONOURED_KEYWORDS` only."""
    func = getattr(sub, "_gradient_checkpointing_func", torch_checkpoint)
    if func is run_directly:
        return
    base, args, keywords = (
        (func.func, func.args, dict(func.keywords)) if isinstance(func, functools.partial) else (func, (), {})
    )
    where = f"{name} ({type(sub).__name__}) is set for Hugging Face gradient checkpointing"
    fix = (
        "Call model.gradient_checkpointing_enable() with default arguments (use_reentrant may be either): "
        "ParaDySeStrategy recomputes those layers in its plan (recompute: true), exactly"
    )
    if base is not torch_checkpoint or args:
        qualname = getattr(base, "__qualname__", repr(base))
        if qualname.endswith(f"<locals>.{HF_OFFLOAD_FUNCTION}"):
            what = (
                "with offload=True: the saved activations go to host memory, which the plan's recomputation does not do"
            )
        else:
            what = f"with its own checkpoint function {qualname}: the plan's recomputation cannot stand for it"
        raise ValueError(f"{where} {what}. {fix}")
    for key, value in keywords.items():
        honoured = HONOURED_KEYWORDS.get(key, ())
        if honoured is not None and value not in honoured:
            reason = (
                "the plan's recomputation replays the random state, so random ops in the layer would differ from "
                "one process"
                if key == "preserve_rng_state"
                else "the plan's recomputation does not apply it"
            )
            raise ValueError(f"{where} with {key}={value!r}: {reason}. {fix}")
