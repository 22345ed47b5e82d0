"""The plain model's parameter names, shown to ``configure_optimizers``.

A rewritten op holds its weights under names of its own (``self_attn.q``, ``self_attn.bq``, ``mlp.down_t``), where
the plain model has ``self_attn.q_proj.weight``, ``q_proj.bias``, ``mlp.down_proj.weight``. A
``configure_optimizers`` that builds its parameter groups by name, as Hugging Face's recipe does (no weight decay
for ``"bias"`` and norm parameters), would put a shard in another group than its plain parameter: a silently
different optimizer. While the hook runs (:func:`plain_named_parameters`), ``named_parameters()`` of the module and
of each sub-module names every parameter as the plain model does:

* a parameter of the plain model kept as it is, or a shard of a plain parameter that is one piece: its plain name
  (``model.layers.0.self_attn.q_proj.weight``);
* a piece of a fused plain parameter (q, k and v of GPT-2's ``c_attn``): the plain module's path, the piece, the
  plain parameter's own name (``transformer.h.0.attn.c_attn.q.weight``, ``c_attn.bq.bias``), unique per piece and
  still holding every word a name-based rule looks for.

Only the names change, never the parameters or their order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from lightning_paradyse.runtime.checkpoint import PlainModel, plain_targets


def plain_parameter_names(module: nn.Module, plain: PlainModel) -> dict[str, str]:
    """Each parameter's name in the rewritten ``module`` -> the name :func:`plain_named_parameters` shows."""
    targets = {name: target for name, (target, _) in plain_targets(module, plain).items()}
    pieces: dict[str, int] = {}
    for target in targets.values():
        pieces[target] = pieces.get(target, 0) + 1
    shown = {}
    for name, target in targets.items():
        if pieces[target] == 1:
            shown[name] = target
        else:  # one of several pieces of a fused plain parameter
            owner, _, leaf = target.rpartition(".")
            piece = name.rpartition(".")[2]
            shown[name] = f"{owner}.{piece}.{leaf}" if owner else f"{piece}.{leaf}"
    return shown


@contextlib.contextmanager
def plain_named_parameters(module: nn.Module, plain: PlainModel) -> Iterator[None]:
    """Within the block, ``named_parameters()`` of ``module`` and of its sub-modules shows the plain model's names
    (:func:`plain_parameter_names`; see the module docstring). Calls on modules outside ``module`` are unchanged."""
    shown = plain_parameter_names(module, plain)
    paths = {id(m): path for path, m in module.named_modules(remove_duplicate=False)}
    original = nn.Module.named_parameters

    def named_parameters(
        self: nn.Module, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        base = paths.get(id(self))
        for name, param in original(self, "", recurse, remove_duplicate):
            if base is not None:
                full = f"{base}.{name}" if base else name
                plain_name = shown.get(full, full)
                if not base:
                    name = plain_name
                elif plain_name.startswith(base + "."):
                    name = plain_name[len(base) + 1 :]
            yield (f"{prefix}.{name}" if prefix else name), param

    nn.Module.named_parameters = named_parameters  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.named_parameters = original  # type: ignore[method-assign]


__all__ = ["plain_named_parameters", "plain_parameter_names"]
