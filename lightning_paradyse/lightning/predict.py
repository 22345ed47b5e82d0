"""``trainer.predict`` under the strategy: every rank runs each batch whole, as one process does.

A prediction step returns whatever the module makes of the model's output (logits, scores, a label per token); on a
rank of a sequence-parallel group the model's output is a slice of the sequence, in a layout the step knows nothing
of, and could not be joined back. So the predictions run whole: at their start every rank gathers the whole weights
(one collective: :func:`~lightning_paradyse.groups.exchange.enter_group` with groups of one rank), runs each batch
whole on them (every op the plain op on a group of one; no collective per batch), and drops them at the end. Every
rank makes one process's predictions of every batch, at ``p`` times the compute of sharing the batches out as DDP
does, with the whole weights on every rank (refused on a GPU where they do not fit, before the gather). Launched
from a script (``start_method="popen"``, ``torchrun``), ``trainer.predict`` returns them all on every rank; under the
default spawn launcher Lightning returns no predictions (its rule for every spawning strategy): a
``BasePredictionWriter`` then writes them, on rank 0 alone (a warning says so). The padding tokens of right-padded
rows are predicted as one process predicts them: attending only the real keys where the model is given the batch's
``attention_mask``, every earlier key where it is not
(:attr:`~lightning_paradyse.runtime.parallel.StepState.masked_lengths`). Generation with a key/value cache stays refused
(the rewritten attention keeps no cache; :data:`~lightning_paradyse.runtime.parallel.CACHE_REFUSAL`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.callbacks import BasePredictionWriter, Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_paradyse.distributed.comm import Group, group_size
from lightning_paradyse.graph.dispatch import AttentionDispatch
from lightning_paradyse.groups.exchange import drop_group, enter_group
from lightning_paradyse.lightning.cycle import StepCycle
from lightning_paradyse.lightning.refusals import refuse_joined_documents
from lightning_paradyse.lightning.step_check import whole_weights_fit
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan
from lightning_paradyse.runtime import parallel
from lightning_paradyse.runtime.slicing import describe_batch

PREFERRED = ("tp_sp", "ulysses", "metp", "ring", "dsp")
"""The order a whole run picks each op's mode in (on a group of one each computes the plain op)."""
PADDED_ATTENTION = ("tp_sp", "ulysses")
"""The attention modes whose kernel honours a whole run's padding (:func:`~lightning_paradyse.modes.attention.
full_attention`'s ``real_lengths``)."""


class Predictions:
    """The whole weights held for one ``trainer.predict`` (:meth:`start`, :meth:`step` per batch, :meth:`end`)."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        """The plan every batch runs with (``None``: not started)."""

    def start(
        self, module: nn.Module, group: Group, device: torch.device, world: int, callbacks: Sequence[Callback]
    ) -> None:
        """Gather the whole weights on every rank (one collective), after refusing, alike on every rank, a model whose
        whole weights do not fit a GPU; warn where a prediction writer among ``callbacks`` would write them on every
        rank."""
        if parallel.step_state(module).grid is not None:
            raise ValueError(
                "trainer.predict of a grid model (ParaDySeStrategy(axes=2)) is not supported yet: predict in one plain "
                "process from a checkpoint of this run (LightningModule.load_from_checkpoint)"
            )
        plan = whole_run_plan(module)
        if not whole_weights_fit(module, group, device, world, copies=2):  # the gather's buffers, then the weights
            raise RuntimeError(
                "trainer.predict under ParaDySeStrategy runs every batch whole on every rank, and the whole weights do "
                "not fit on every GPU: predict in one plain process from a checkpoint of this run "
                "(LightningModule.load_from_checkpoint), or use trainer.validate / trainer.test, which run sharded"
            )
        enter_group(module, group, [1] * group_size(group))  # every weight on every rank: [rows/P] -> [rows]
        self.plan = plan
        writers = [c for c in callbacks if isinstance(c, BasePredictionWriter) and not getattr(c, "writes_one_copy", 0)]
        if writers and world > 1:  # a writer that declares it writes one copy (DocumentScoreWriter) is not warned
            rank_zero_warn(
                "[paradyse] every rank predicts every batch under ParaDySeStrategy (one process's predictions on each "
                "rank, not a share of them as under DDP): a BasePredictionWriter writes them once per rank; write on "
                "rank 0 alone (if trainer.is_global_zero) to keep one copy"
            )

    def step(self, cycle: StepCycle, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The module's predict step on the whole batch (validated as a training batch is, targets not required)."""
        assert self.plan is not None, "the strategy starts the predictions in on_predict_start"
        module = cycle.module
        batch = args[0] if args else kwargs["batch"]
        causal = parallel.is_causal(module)
        max_len = cycle.options.max_seq_len
        info = describe_batch(cycle.on_host(batch), 1, 0, causal, max_len, require_targets=False, digest=False)
        refuse_joined_documents(module, info.doc_ids is not None)
        whole = parallel.configure_whole(module, batch, info, self.plan)
        parallel.predict_padding(module, real_lengths(info.padding))  # masked where the model is given the mask
        try:
            rest = {k: v for k, v in kwargs.items() if k != "batch"}
            return step(whole, *args[1:], **rest)
        finally:
            parallel.unconfigure(module)  # a call of the model outside a step raises, naming why

    def end(self, module: nn.Module) -> None:
        """Drop the whole weights (no collective)."""
        if self.plan is not None:
            drop_group(module)
            self.plan = None


def real_lengths(padding: torch.Tensor | None) -> tuple[int, ...] | None:
    """Each row's real tokens, from the batch's right padding ``[b, s]`` on the host (``None``: no padding)."""
    if padding is None:
        return None
    return tuple(int(n) for n in (~padding).sum(1).tolist())  # [b, s] -> [b]


def whole_run_plan(module: nn.Module) -> Plan:
    """Per layer, the first mode of :data:`PREFERRED` that each of its attention's and its MLP's dispatch modules
    takes on a group of one (whatever the strategy's ``modes``: on one rank each computes the plain op). The
    attention's is one that honours padding (:attr:`~lightning_paradyse.modes.specs.SeqContext.real_lengths`)."""
    ops: dict[tuple[int, bool], list[Any]] = {}
    for _, op in parallel.dispatchers(module):
        ops.setdefault((op.layer, isinstance(op, AttentionDispatch)), []).append(op)

    def mode(layer: int, attention: bool) -> str:
        found = ops.get((layer, attention), [])
        for m in PADDED_ATTENTION if attention else PREFERRED:
            if not any(op.infeasible(m, 1) for op in found):
                return m
        what = "attention" if attention else "MLP"
        tried = PADDED_ATTENTION if attention else PREFERRED
        raise ValueError(f"trainer.predict: layer {layer}'s {what} takes none of the modes {tried} on one rank")

    layers = range(parallel.n_layers(module))
    return Plan(tuple(LayerPlan(OpPlan(mode(i, True)), OpPlan(mode(i, False))) for i in layers))


__all__ = ["PADDED_ATTENTION", "PREFERRED", "Predictions", "real_lengths", "whole_run_plan"]
