"""The step check: does the module's step compute across the tokens of its slice, or the rows of its batch?

On the first training batch (``ParaDySeStrategy(check_step=True)``; and again on the 10th, 100th, 1,000th, ...:
:data:`AGAIN_EVERY`), the module's step runs twice on ``8p + 1`` of
the batch's tokens, with no gradient and no trace left (:func:`side_effects_undone`): sharded over the ranks as every
step runs, and whole on every rank (a group of one holding every weight). The two losses must agree to the
precision's tolerance; otherwise the step computes across its slice (e.g. shifts the targets itself) and the run
stops on every rank with the fix (:func:`check_step_losses`).

A loss can agree in value and not in its gradient: a term divided by its own value taken without a gradient
(``ce / ce.detach()``) is one on every rank and in one process, while each rank's gradient is scaled by its own
slice's loss. So the training step's two calls also take the gradient of the loss (of this rank's part of the global
loss, in the sharded call) with respect to what the model returned, without a backward through the model: the
model's calls run without a gradient and hand the step leaves (:mod:`~lightning_paradyse.runtime.output_leaves`). At
this rank's tokens the two must agree to the tolerance, in float64 and float32 (:func:`refuse_gradient_gap`; silent
until 2026-12-02, probe 19). A Hugging Face model's loss given ``labels=``, computed inside its call, is not compared.
Every call of the training step's check runs the step's own code with gradients on, as training does (a hook on the
logits' gradient, ``retain_grad``, ``torch.autograd.grad`` in the step raised under ``no_grad`` until 2026-12-02,
probe 20); the model's calls run without.

Position rules further into the sequence than those tokens are seen in the step's code instead: its sharded call
watches what the step does to positions of the sequence outside the model's calls (:class:`SequenceCuts`: an index,
an assignment at positions or a ``narrow`` of a ``[b, s]`` tensor, a scan such as ``cumsum`` along it, positions
made with ``torch.arange(s)``), which is refused naming it (:func:`refuse_sequence_cuts`); a split of the sequence
into chunks longer than the tokens run has the check run again on a chunk and a half (:func:`longer_probe`: a loss
averaged per chunk). A value the step logs summed over the ranks (``sync_dist=True, reduce_fx="sum"``) is compared
summed (:func:`summed_over_ranks`).

The tokens are three runs of the batch's positions side by side: at its start, at its end and between
(:func:`probe_columns`), so that a step that weighs positions unevenly (a loss averaged over every position, those
without a target included; weights that change along the sequence) is seen where the batch's positions differ. After
a batch whose every position has a target, the first batch with a position without one is checked too. And the
losses are compared once more on the same tokens with ids planted in the first row's last real targets (0 and a
Hugging Face config's pad and end-of-sequence ids, and -100 where the data marks targets so: :func:`planted_probe`):
a mean over the targets the step keeps by their ids (``targets.bool()``, a lookup) or a mean of each row's mean
differs there on the first batch, whatever that batch holds (silent until 2026-12-02, probe 17).

What the step logs is compared on the same two calls: the sharded call's logs as the strategy makes them (its loss,
a number equal to it and a metric given it, made global: :class:`~lightning_paradyse.lightning.step_logs.StepLogs`)
against the whole call's. A one-number value that differs (``torch.exp(loss)``, ``loss.clone()``, a count of the
slice's tokens) is this rank's, not what one process logs: the check names it once in a warning with the fix
(:func:`differing_logs`). So is a torchmetrics metric whose value after the sharded call, its states gathered over the
ranks as Lightning's epoch value is, differs from its value after the whole call, each call starting from a reset
metric (:func:`metric_values`: a mean of each row's loss, which a rank computes from its part of the row; a sum of the
global loss, which every rank holds).

Where training steps may run on groups of whole rows (the group runner is set up: ``plan="auto"``), the whole call
is also made on the first half of the probe's rows and on the other half, apart (:func:`rows_runs`), as two groups
run them: their losses combined as the strategy combines groups' (weighed by each part's real targets for a mean,
summed for a summed loss) must equal the whole call's (:func:`check_rows_losses`: a loss divided by the batch's number
of rows is refused), and what the first half logs, its loss left out, is compared with the whole call's (a
``batch_size=`` of the step's rows). A Hugging Face loss given ``labels=`` is left out of the loss comparison: on
groups the strategy hands it the whole batch's count.

``validation_step`` and ``test_step`` are checked alike on their first batch (``StepCheck(training=False)``: their
loss where they return one, and what they log).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings
import zlib
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.modules.batchnorm import _NormBase
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_paradyse.distributed.comm import Group, all_reduce_sum, collective_device, group_rank, group_size
from lightning_paradyse.distributed.devices import gpu_free_bytes
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.groups.exchange import drop_group, enter_group
from lightning_paradyse.groups.units import Units
from lightning_paradyse.lightning.cycle import StepCycle, step_loss
from lightning_paradyse.lightning.metric_calls import (
    aliases,
    compute_groups,
    is_collection,
    is_metric,
    metric_state,
    put_compute_groups,
    put_metric_state,
)
from lightning_paradyse.lightning.step_logs import log_arguments, log_replaced, number_dtype
from lightning_paradyse.lightning.summary import whole_sizes
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan
from lightning_paradyse.runtime import parallel
from lightning_paradyse.runtime.exactness import kept_rng
from lightning_paradyse.runtime.output_leaves import OutputLeaves, collecting, leaf_gradients
from lightning_paradyse.runtime.slicing import (
    IGNORE_INDEX,
    PAD_MASK_KEYS,
    TARGET_KEYS,
    TOKEN_1D_KEYS,
    TOKEN_KEYS,
    BatchInfo,
    describe_batch,
    find_targets,
    find_tokens,
    shifted_labels,
)
from lightning_paradyse.runtime.streams import rng_state, seed_streams, set_rng_state

ATTEMPTS = 8
"""Batches on which the check may still run (it waits for a batch whose tokens it runs have a real target)."""


STEP_CHECK_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
"""Relative difference allowed between the sharded step's loss and the whole step's on the probe (other dtypes:
:data:`LOW_PRECISION_TOLERANCE`)."""
FLOAT32_LOSS_TOLERANCE = 1e-6
"""A float64 step whose loss function ran in float32 (Hugging Face's upcasts the logits to float32 whatever the
model's dtype): its mean over the probe's few tokens rounds to ~1e-7 in another order, where a term averaged over the
slice's own count is off by far more (1e-5 for a 0.1-weighted hidden-state penalty; probe 10)."""
LOSS_AS_LOGGED = 1e-6
"""A value a step logs within this of its loss is the loss as logged (a float32 metric given a float64 loss), which
the strategy makes global: the rows runs (:func:`rows_runs`) leave it out."""
TF32_TOLERANCE = 1e-3
"""float32 with TF32 matmuls (``torch.set_float32_matmul_precision("high")``) rounds to ~1e-3."""
LOW_PRECISION_TOLERANCE = 3e-2
"""bf16/fp16 round to ~1e-2: the check catches only large differences there (run it in float32 to be sure)."""


def probe_batch(batch: Any, b: int, s: int, columns: torch.Tensor) -> Any:
    """The positions ``columns`` (``[m]``, ascending) of every ``[b, s, ...]`` tensor (and ``[s]`` per-token entry)
    of ``batch``, side by side."""

    def cut(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            if t.dim() >= 2 and tuple(t.shape[:2]) == (b, s):
                return t.index_select(1, columns.to(t.device))  # [b, s, ...] -> [b, m, ...]
            if t.dim() == 1 and t.shape[0] == s:
                return t.index_select(0, columns.to(t.device))  # [s] -> [m]
        return t

    if isinstance(batch, dict):
        return {k: cut(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(cut(v) for v in batch)
    return cut(batch)


def rows_with_target(batch: Any, b: int, s: int) -> torch.Tensor | None:
    """``[s]`` on the host: how many rows have a target (not -100) at each position (a Hugging Face ``labels`` tensor
    read as the model shifts it); ``None`` for a batch without ``[b, s]`` targets."""
    key, targets = find_targets(batch)
    if targets is None or targets.dim() < 2 or tuple(targets.shape[:2]) != (b, s):
        return None
    shifted = shifted_labels(targets) if key == "labels" else targets
    return (shifted != IGNORE_INDEX).reshape(b, s, -1).any(-1).sum(0).cpu()  # [b, s, ...] -> [b, s, k] -> [s]


def probe_columns(rows: torch.Tensor | None, b: int, s: int, m: int) -> torch.Tensor:
    """The ``m`` positions the check runs (``[m]``, ascending; ``rows``: :func:`rows_with_target`): three runs of
    consecutive positions, at the batch's start, at its end and between, side by side. A step that weighs positions
    unevenly (a loss averaged over every position, those without a target included, as ``reduction="none"`` then
    ``.mean()`` or a z-loss of every logit; weights that change along the sequence) differs from one process only
    where the positions differ, and the ends of a batch differ most (a prompt, padding, the last token without a
    target). The middle run holds the first position with a target (after a prompt without) or without one
    (padding) where the two others do not hold both and the batch does; else it sits in the middle."""
    if m >= s:
        return torch.arange(s)
    third = m // 3
    head, middle, tail = m - 2 * third, third, third
    ends = torch.cat([torch.arange(head), torch.arange(s - tail, s)])  # [head + tail]
    centre = s // 2 - middle // 2
    if rows is not None:
        seen = rows[ends]  # [head + tail]
        if not bool((seen > 0).any()):  # no target at the ends: the first position with one
            wanted = torch.nonzero(rows > 0).flatten()
        elif not bool((seen < b).any()) and bool((rows < b).any()):  # every end position targeted: the first without
            wanted = torch.nonzero(rows < b).flatten()
        else:
            wanted = torch.zeros(0, dtype=torch.long)
        if wanted.numel() > 0:
            centre = int(wanted[0]) - middle // 2
    start = min(max(centre, head), s - tail - middle)  # between the two ends, overlapping neither
    return torch.cat([torch.arange(head), torch.arange(start, start + middle), torch.arange(s - tail, s)])


def described_columns(columns: torch.Tensor) -> str:
    """``columns`` as runs: ``"0..6, 20..24, 35..39"``."""
    values, runs = columns.tolist(), []
    first = values[0]
    for previous, value in zip(values, [*values[1:], None]):
        if value != previous + 1:
            runs.append(f"{first}..{previous}" if previous != first else f"{first}")
            first = value
    return ", ".join(runs)


def batch_tensors(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a batch with their names as a message gives them: a dict's ``'key'``, a tuple's ``tensor i``."""
    if isinstance(batch, Mapping):
        return [(repr(k), v) for k, v in batch.items() if isinstance(v, torch.Tensor)]
    if isinstance(batch, (list, tuple)):
        return [(f"tensor {i}", v) for i, v in enumerate(batch) if isinstance(v, torch.Tensor)]
    return []


class LossCalls(TorchFunctionMode):
    """The loss functions a step calls (``F.cross_entropy``, ``F.nll_loss``, and the modules that call them), with
    what a mean loss over the ranks cannot honour: an ``ignore_index`` other than -100 (the strategy weighs each
    rank's mean by its targets that are not -100), class weights under ``reduction="mean"`` (a mean normalised by
    the slice's sum of its targets' weights), and, given the ``batch`` the step is handed, a mean the step itself
    computes over targets of the batch other than those the strategy weighs each rank's mean by
    (:func:`~lightning_paradyse.runtime.slicing.find_targets`: a ``tgt`` or ``label_ids`` key, or a tuple
    ``(ids, targets, mask)`` whose last tensor is not the targets). Such a run was exact while every batch held a
    target at every position and trained silently away from one process from the first that did not (probe 16,
    2026-12-02). A loss computed inside a call of the model (``inside_model``: a Hugging Face model handed
    ``labels=``, which the strategy hands the global count) is left to that mechanism.

    And a mean loss that depends on a rule the step applies to the values of the batch's tokens or targets, one that
    sets real class ids apart (``targets != 0`` for a pad id, ``targets > 0``, ``torch.isin(targets, special)``;
    not ``targets != -100``): ``F.cross_entropy(logits[keep], targets[keep])``, targets ``masked_fill``-ed to -100
    by it, ``(ce * mask).sum() / mask.sum()``. Such a mean divides by a count of the rule's, where the strategy weighs
    by the batch's targets that are not -100: exact on batches where the rule sets nothing apart, silently off from
    the first that it does (found 2026-12-02, twenty-ninth session). The rule is seen in the step's code, not in the
    data: what the comparison's result flows into (:attr:`_ruled`) is followed through every call of the check's whole
    call, the model's included, so it is refused on the first batch whatever that batch holds. A rule the step keeps
    on the host (``int((targets != 0).sum())``) is not followed."""

    WATCHED = (F.cross_entropy, F.nll_loss)

    def __init__(
        self, batch: Any = None, inside_model: Callable[[], bool] = lambda: False, vocab: int | None = None
    ) -> None:
        super().__init__()
        self.vocab = vocab
        """The ids there are (:func:`vocabulary`): a rule that sets apart none below it sets no id apart
        (``targets < vocab_size`` in a remap of ids out of range)."""
        self.found: list[str] = []
        self.dtypes: set[torch.dtype] = set()
        """The dtypes the losses were computed in (Hugging Face's upcasts its logits to float32 whatever the
        model's): the step's loss carries that rounding however wide the sum it ends in."""
        self.inside_model = inside_model
        self._named: dict[int, tuple[torch.Tensor, str, torch.Tensor]] = {}
        """``id -> (tensor, name, the batch's tensor whose values it holds)`` for the batch's tensors and what
        :data:`KEEPS_VALUES` made of them."""
        self._weighed: torch.Tensor | None = None
        self._weighed_as = ""
        self._tokens: torch.Tensor | None = None
        """The batch's token tensor: it never holds -100 (it indexes an embedding), so a mean over it as the targets
        (a reconstruction) is weighed right wherever the weighed targets hold none either."""
        self._valued: dict[int, tuple[torch.Tensor, str]] = {}
        """``id -> (tensor, name)``: the batch's tokens and the targets the strategy weighs by, and what
        :data:`KEEPS_TOKENS` or an index made of them: they hold ids, so a comparison of one with a number is a rule on
        ids (not a mask's ``attention_mask == 1``, whose zeros must have -100 targets already)."""
        self._ruled: dict[int, tuple[torch.Tensor, str]] = {}
        """``id -> (tensor, rule)``: what a rule setting real ids apart (``'targets' != 0``) made, and everything
        made from that (the tensors are held: an id is not reused while the check runs)."""
        self._selected: dict[int, tuple[torch.Tensor, str]] = {}
        self._predictions: set[str] = set()
        """The rules :meth:`_predicted` made (comparisons with the model's predictions)."""
        """``id -> (tensor, rule)``: entries a rule's mask selected (``ce[targets != 0]``): a mean of them divides by
        the rule's count."""
        if batch is not None:
            for name, t in batch_tensors(batch):
                self._named[id(t)] = (t, name, t)
            key, self._weighed = find_targets(batch)
            self._tokens = find_tokens(batch)
            for name, t in batch_tensors(batch):
                if t is self._weighed or t is self._tokens:
                    self._valued[id(t)] = (t, name)
            self._weighed_as = (
                "its share of the batch's tokens (the batch holds no tensor under 'targets', 'target', 'y' or 'labels')"
                if self._weighed is None
                else f"its share of the real targets (not -100) in the batch's {key!r}"
                if key is not None
                else "its share of the real targets (not -100) in the batch's last tensor"
            )

    def _source(self, t: Any) -> tuple[str, torch.Tensor] | None:
        """The name of the batch's tensor whose values ``t`` holds, and that tensor, else ``None``."""
        named = self._named.get(id(t)) if isinstance(t, torch.Tensor) else None
        return None if named is None or named[0] is not t else (named[1], named[2])

    def _weighed_otherwise(self, averaged: torch.Tensor) -> bool:
        """Whether a mean over the batch's tensor ``averaged`` as the targets is weighed by other targets than its own:
        every tensor but the weighed targets, except the tokens where the weighed targets hold no -100 (read on the
        host: the check's, once per run)."""
        if averaged is self._weighed:
            return False
        if averaged is self._tokens:
            return self._weighed is not None and bool((self._weighed == IGNORE_INDEX).any())
        return True

    def _rule(self, func: Any, args: Any) -> str | None:
        """The rule ``func`` applies to ids (``"the batch's 'targets' != 0"``) where it compares the values of the
        batch's tokens or targets with numbers and sets some real (non-negative) ids apart, else ``None``."""
        sign = COMPARISONS.get(func)
        if sign is None or len(args) < 2 or not isinstance(args[0], torch.Tensor):
            return None
        predicted = self._predicted(sign, args[0], args[1])
        if predicted is not None:
            return predicted
        valued = self._valued.get(id(args[0]))
        if valued is None or valued[0] is not args[0]:
            return None
        other = args[1]
        if isinstance(other, torch.Tensor):
            if other.numel() > RULE_VALUES or (other.dim() > 0 and sign != "isin"):
                return None  # a comparison with another tensor of values (an accuracy), not a rule
            values = [float(v) for v in other.flatten().tolist()]  # host read: the check's, once per run
        elif isinstance(other, (int, float)) and not isinstance(other, bool):
            values = [float(other)]
        elif isinstance(other, (list, tuple)) and sign == "isin" and len(other) <= RULE_VALUES:
            values = [float(v) for v in other]
        else:
            return None
        vocab = self.vocab if self.vocab is not None else RULE_IDS
        if sign == "isin":
            apart = any(0 <= v < vocab and v == int(v) for v in values)
            shown = f"torch.isin({valued[1]}, {[int(v) if v == int(v) else v for v in values]})"
        elif not math.isfinite(values[0]) or values[0] > RULE_IDS:
            return None  # beyond any vocabulary: it sets no id apart
        else:
            ids = torch.arange(0, min(max(math.ceil(values[0]), 0) + 2, vocab))  # [k]: 0 .. past the number
            apart = bool(
                torch.unique(func(ids, other if not isinstance(other, torch.Tensor) else other.cpu())).numel() > 1
            )
            shown = f"{valued[1]} {sign} {int(values[0]) if values[0] == int(values[0]) else values[0]}"
        return f"the batch's {shown}" if apart else None

    def _ids_named(self, t: Any) -> str | None:
        """The name of the batch's ids ``t`` holds (:attr:`_valued`), else ``None``."""
        valued = self._valued.get(id(t)) if isinstance(t, torch.Tensor) else None
        return None if valued is None or valued[0] is not t else valued[1]

    def _predicted(self, sign: str, a: Any, b: Any) -> str | None:
        """The rule of an entry-by-entry comparison of the batch's ids with a tensor of the same shape that is not the
        batch's (``logits.argmax(-1) != targets``: the targets the model gets wrong), else ``None``. Such a mask
        sets real targets apart by the model's predictions: a mean over what it selects divides by its own count
        (silent until 2026-12-02, probe 20: hard-example mining, ``ce[pred != tg].mean()``); an accuracy logged
        from it is not a loss and is left alone."""
        if sign == "isin" or not isinstance(b, torch.Tensor):
            return None
        for mine, other in ((a, b), (b, a)):
            name = self._ids_named(mine)
            if name is not None and self._ids_named(other) is None and other.shape == mine.shape and other.numel() > 1:
                rule = f"the batch's {name} compared with a tensor of their shape (a prediction, {sign})"
                self._predictions.add(rule)
                return rule
        return None

    def _inherited(self, args: Any, kwargs: dict[str, Any]) -> str | None:
        """The rule a tensor among ``args`` and ``kwargs`` was made by (:attr:`_ruled`), else ``None``."""
        for t in _tensor_leaves((args, kwargs)):
            ruled = self._ruled.get(id(t))
            if ruled is not None and ruled[0] is t:
                return ruled[1]
        return None

    def ruled(self, t: Any) -> str | None:
        """The rule ``t`` depends on (:attr:`_ruled`), else ``None``."""
        return self._inherited((t,), {})

    def _rule_found(self, what: str) -> str:
        return (
            f"{what}, which sets some real ids apart: a mean over what it keeps divides by a count of its own, but "
            f"the strategy weighs each rank's mean loss by {self._weighed_as}, and the two differ on every batch "
            f"where the rule sets an id apart; mark the targets to leave out as -100 in the data (in the collate "
            f"function, targets[targets == pad_id] = -100) and average over all of them (F.cross_entropy's default "
            f"ignores -100), or return a loss summed over the targets kept, divided by the whole batch's count of "
            f"them (a value of the batch), and tell the strategy, ParaDySeStrategy(loss_reduction='sum')"
        )

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rule = None if self.inside_model() else self._rule(func, args)
        inherited = self._inherited(args, kwargs) if rule is None else None
        if func in self.WATCHED:
            self._loss_call(func, args, kwargs)
        elif inherited is not None and not self.inside_model():
            self._counted(func, args)
        out = func(*args, **kwargs)
        self._follow(func, args, out, rule or inherited)
        return out

    def _counted(self, func: Any, args: Any) -> None:
        """Name a division by what a rule made (``x / mask.sum()``) and a mean of what a rule's mask selected
        (``ce[targets != 0].mean()``): a mean over the rule's count, not over the real targets the strategy weighs
        by. Weights a rule makes (``1 + (targets == eos)``) in a mean over every position are not named. A rule of
        the model's predictions (:meth:`_predicted`) is named only where what is divided or averaged carries a
        gradient (a loss): an accuracy a metric computes from the same comparison (``correct / total``) is not."""
        reflected = func in REFLECTED_DIVISIONS
        divisor = args[0] if reflected else args[1] if func in DIVISIONS and len(args) > 1 else None
        rule = self.ruled(divisor) if isinstance(divisor, torch.Tensor) else None
        numerator = args[1] if reflected and len(args) > 1 else args[0] if args else None
        if rule is not None and (rule not in self._predictions or _carries_gradient(numerator)):
            self.found.append(self._rule_found(f"it divides by a count that depends on {rule}"))
        selected = self._selected.get(id(args[0])) if func in MEANS and args else None
        if (
            selected is not None
            and selected[0] is args[0]
            and (selected[1] not in self._predictions or _carries_gradient(args[0]))
        ):
            self.found.append(self._rule_found(f"it averages the entries that {selected[1]} selects"))

    def _loss_call(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """What a call of a watched loss function (:attr:`WATCHED`) does that a mean over the ranks cannot honour."""
        given = inspect.signature(func).bind(*args, **kwargs).arguments
        name, reduction = func.__name__, given.get("reduction", "mean")
        targets_rule = self.ruled(given.get("target"))  # targets selected or set to -100 by a rule
        if targets_rule is not None and reduction == "mean" and not self.inside_model():
            self.found.append(self._rule_found(f"{name}(...) averages over targets that depend on {targets_rule}"))
        source = None if reduction != "mean" or self.inside_model() else self._source(given.get("target"))
        if source is not None and self._weighed_otherwise(source[1]):
            self.found.append(
                f"{name}(...) averages over the targets in the batch's {source[0]}, but the strategy weighs "
                f"each rank's mean loss by {self._weighed_as}; put the targets "
                f"under the key 'targets' (or 'target', 'y', 'labels'; in a tuple batch, last), or return a "
                f"loss summed over the targets, divided by the whole batch's count of them (a value of the "
                f"batch), and tell the strategy, ParaDySeStrategy(loss_reduction='sum')"
            )
        scores = given.get("input")
        if isinstance(scores, torch.Tensor) and scores.is_floating_point():
            self.dtypes.add(scores.dtype)
        ignored = given.get("ignore_index", IGNORE_INDEX)
        if ignored != IGNORE_INDEX and reduction != "sum":
            self.found.append(
                f"{name}(ignore_index={ignored}): the strategy weighs each rank's mean loss by its targets that "
                f"are not -100; set the targets to ignore to -100 in the data (targets[targets == {ignored}] = "
                f"-100) and leave ignore_index out"
            )
        if given.get("weight") is not None and reduction == "mean":
            self.found.append(
                f"{name}(weight=..., reduction='mean'): the mean is normalised by the sum of the targets' class "
                f"weights, which each rank sums over its slice alone; use reduction='sum', divide by the whole "
                f"batch's sum of those weights (computed in the data, a value of the batch) and tell the "
                f"strategy, ParaDySeStrategy(loss_reduction='sum')"
            )

    def _follow(self, func: Any, args: Any, out: Any, made: str | None) -> None:
        """Name ``func``'s result after what it was made from: the batch's targets (:attr:`_named`), the batch's ids
        (:attr:`_valued`), a rule on ids (:attr:`_ruled`: ``made``, which an in-place call writes into its tensor)."""
        if func in KEEPS_VALUES and isinstance(out, torch.Tensor) and args:
            source = self._source(args[0])
            if source is not None:  # targets.view(-1): the batch's targets still
                self._named[id(out)] = (out, source[0], source[1])
        if (func in KEEPS_TOKENS or func is torch.Tensor.__getitem__) and isinstance(out, torch.Tensor) and args:
            valued = self._valued.get(id(args[0]))
            if valued is not None and valued[0] is args[0]:  # targets[:, :-1], targets.flatten(): ids still
                self._valued[id(out)] = (out, valued[1])
        if made is not None:
            for t in _tensor_leaves(out):
                self._ruled[id(t)] = (t, made)
            if args and isinstance(args[0], torch.Tensor) and _in_place(func):  # t[t == 0] = -100: t follows it
                self._ruled[id(args[0])] = (args[0], made)
        selector = self._inherited(args[1:], {}) if func in SELECTIONS and isinstance(out, torch.Tensor) else None
        if selector is not None:  # ce[targets != 0]: the rule's entries
            self._selected[id(out)] = (out, selector)

    def refuse(self, hook: str) -> None:
        """Raise (alike on every rank: the same code on the same probe) where the step called such a loss."""
        if self.found:
            raise ValueError(f"the {hook} computes a loss ParaDySeStrategy cannot make exact: " + "; ".join(self.found))


CUMULATIVE = frozenset(
    {
        torch.cumsum,
        torch.Tensor.cumsum,
        torch.cumprod,
        torch.Tensor.cumprod,
        torch.cummax,
        torch.Tensor.cummax,
        torch.cummin,
        torch.Tensor.cummin,
        torch.logcumsumexp,
        torch.Tensor.logcumsumexp,
    }
)
"""Scans: along the sequence of a rank's slice they start over at its first position."""

KEEPS_TOKENS = frozenset(
    {
        torch.Tensor.clone,
        torch.clone,
        torch.Tensor.detach,
        torch.Tensor.to,
        torch.Tensor.float,
        torch.Tensor.double,
        torch.Tensor.long,
        torch.Tensor.contiguous,
        torch.Tensor.masked_fill,
        torch.Tensor.flatten,
        torch.flatten,
        torch.Tensor.view,
        torch.Tensor.reshape,
        torch.reshape,
    }
)
"""Calls whose result holds the same tokens as their tensor (a copy, a cast, a flattening): named after it."""
KEEPS_VALUES = KEEPS_TOKENS - {torch.Tensor.masked_fill, torch.Tensor.float, torch.Tensor.double}
"""Calls whose result holds the values of their tensor, element for element (a copy, a cast to integers, a
flattening): a loss handed the result averages over that tensor's targets."""

COMPARISONS: dict[Any, str] = {
    **dict.fromkeys((torch.eq, torch.Tensor.eq, torch.Tensor.__eq__), "=="),
    **dict.fromkeys((torch.ne, torch.Tensor.ne, torch.Tensor.__ne__), "!="),
    **dict.fromkeys((torch.gt, torch.Tensor.gt, torch.Tensor.__gt__), ">"),
    **dict.fromkeys((torch.ge, torch.Tensor.ge, torch.Tensor.__ge__), ">="),
    **dict.fromkeys((torch.lt, torch.Tensor.lt, torch.Tensor.__lt__), "<"),
    **dict.fromkeys((torch.le, torch.Tensor.le, torch.Tensor.__le__), "<="),
    torch.isin: "isin",
}
"""Comparisons a step may set ids apart with (``targets != pad_id``), and how a message writes them
(:meth:`LossCalls._rule`; ``0 != targets`` reaches it as ``targets.__ne__(0)``)."""
DIVISIONS = frozenset({torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.__truediv__})
"""Divisions ``a / b`` whose divisor, made by a rule, is a count of the rule's (:meth:`LossCalls._counted`)."""
REFLECTED_DIVISIONS = frozenset({torch.Tensor.__rtruediv__})
"""``b.__rtruediv__(a)`` is ``a / b``: its divisor comes first."""
MEANS = frozenset({torch.mean, torch.Tensor.mean, torch.nanmean, torch.Tensor.nanmean})
"""Means of a tensor's entries."""
SELECTIONS = frozenset({torch.Tensor.__getitem__, torch.masked_select, torch.Tensor.masked_select})
"""Calls that keep the entries a mask selects (``ce[keep]``)."""
RULE_IDS = 1 << 24
"""A number compared with above this sets no id apart (no vocabulary is so large): ``targets < 1e12`` is no rule."""
RULE_VALUES = 64
"""At most this many numbers compared with make a rule (``torch.isin(targets, special_ids)``); a longer tensor is
values of another kind."""


def _carries_gradient(t: Any) -> bool:
    """Whether ``t`` is a tensor that carries a gradient (part of a loss the step backs; the step check's calls run
    the step's own code with gradients on)."""
    return isinstance(t, torch.Tensor) and t.requires_grad


def _tensor_leaves(values: Any) -> list[torch.Tensor]:
    """The tensors in ``values`` (a call's arguments, its result: nested tuples, lists and dicts)."""
    return [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)]


def _in_place(func: Any) -> bool:
    """Whether ``func`` writes into its first tensor (``t[mask] = -100``, ``t.masked_fill_``, ``t.mul_``)."""
    name = getattr(func, "__name__", "")
    return func is torch.Tensor.__setitem__ or (name.endswith("_") and not name.endswith("__"))


class SequenceCuts(TorchFunctionMode):
    """Where the step itself works on positions of the sequence, outside the model's calls: an index, an assignment
    at an index or a ``narrow`` of the second dimension of a tensor of the batch, or of any tensor of its
    ``[b, s]`` (the logits, a clone of the targets): ``ids[:, :512]``, ``targets[:, 1:]``, ``ids[:, 0]``,
    ``x[..., :-1]`` of a ``[b, s]`` tensor, ``t[:, :20] = -100``; a scan along it (``mask.cumsum(1)``: a response
    found after a separator, the last tokens of each row); positions made with ``torch.arange(s)``. On a rank that
    holds a slice of every row each is of the slice, not of the row: a truncation longer than every slice cuts
    nothing on any rank (one process trains on the truncated rows), a shift pairs the slice's positions otherwise
    than one process's, a scan or an ``arange`` starts over at the slice's first position. Watched on the check's
    sharded call (the ranks agree on what they saw: :func:`agree_cuts`); a cut of the whole selection of rows
    (``x[mask]``, ``x[rows]``) is not one."""

    def __init__(self, batch: Mapping[str, torch.Tensor], inside_model: Callable[[], bool]) -> None:
        super().__init__()
        self.watched = dict(batch)  # name -> the step's tensor (held: ids stay theirs)
        self.inside_model = inside_model
        self.found: list[str] = []
        self.aranges: list[str] = []
        """``torch.arange`` of this rank's slice length: of positions where every rank made one of its own length
        (the ranks hold unequal numbers of the check's tokens), else perhaps of another count (:func:`agree_cuts`)."""
        self.sums: list[str] = []
        """Sums of a floating tensor of the batch over the sequence (``weights.sum()``): per-token weights normalised
        by their sum on the slice, named first where the losses then differ (:func:`check_step_losses`)."""
        self._derived: dict[int, tuple[torch.Tensor, str]] = {}  # id -> (a tensor of the batch's tokens, its name)
        self.splits: list[int] = []
        """The chunk sizes of the step's splits along the sequence (``targets.split(1024, dim=1)``, of a batch
        tensor or of a tensor of its ``[b, s]``, such as the logits): not a cut, but a loss averaged per chunk
        differs from one process's only where a row has more than one chunk (:meth:`StepCheck.run` then runs the
        check again on enough tokens)."""
        self._shapes = {tuple(t.shape[:2]) for t in self.watched.values() if t.dim() >= 2}
        self._lengths = {s for b, s in self._shapes if s != b}  # an arange of the rows' count is not of positions

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.inside_model():
            return func(*args, **kwargs)
        cut = self._cut(func, args, kwargs)
        seen = self.aranges if func is torch.arange else self.found
        if cut is not None and cut not in seen:
            seen.append(cut)
        out = func(*args, **kwargs)
        if func in KEEPS_TOKENS and isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
            name = self._name(args[0], described=False)
            if name is not None:  # targets.clone(): named after the tensor it copies
                self._derived[id(out)] = (out, f"{name}.{func.__name__}()")
        return out

    def _cut(self, func: Any, args: Any, kwargs: dict[str, Any]) -> str | None:
        """What the call does to positions of the sequence, as written, or ``None``."""
        if func is torch.arange:
            end = args[0] if len(args) == 1 else args[1] if len(args) > 1 else kwargs.get("end")
            return f"torch.arange({end})" if type(end) is int and end in self._lengths else None
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        t = args[0]
        name = self._name(t)
        if name is None:
            return None
        if func in (torch.Tensor.sum, torch.sum) and t.is_floating_point():
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            named = self._name(t, described=False)  # the batch's tensor, not one of its shape
            if named is not None and (dim is None or t.dim() == 1 or 1 in _dims(dim, t.dim())):
                self.sums.append(f"{named}.sum()")
            return None
        if func in (torch.Tensor.split, torch.split):
            size = sequence_split(t, args[1:], kwargs, self._shapes)
            if size is not None:
                self.splits.append(size)
            return None
        cut = None
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            cut = sequence_index(t, args[1])
            cut = f"{cut} = ..." if cut is not None and func is torch.Tensor.__setitem__ else cut
        elif func in (torch.Tensor.narrow, torch.narrow):
            cut = sequence_narrow(t, args[1:], kwargs)
        elif func in CUMULATIVE:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            cut = f".{func.__name__}(1)" if dim in (1, 1 - t.dim()) else None
        return None if cut is None else f"{name}{cut}"

    def _name(self, t: torch.Tensor, described: bool = True) -> str | None:
        """The batch's name of ``t`` (or of the tensor it copies: ``targets.clone()``), else with ``described`` a
        description of a tensor of the batch's ``[b, s]`` (the logits), else ``None``."""
        name = next((k for k, w in self.watched.items() if w is t), None)
        derived = self._derived.get(id(t))
        if name is None and derived is not None and derived[0] is t:
            name = derived[1]
        if name is None and described and t.dim() >= 2 and tuple(t.shape[:2]) in self._shapes:
            return f"<a [{t.shape[0]}, {t.shape[1]}{', ...' if t.dim() > 2 else ''}] tensor>"
        return name


@contextlib.contextmanager
def cut_failed(cuts: SequenceCuts, hook: str | None) -> Iterator[None]:
    """An error of the step inside the block after it worked on positions of the sequence (``ids.narrow(1, 0,
    512)`` longer than the slice) is refused naming them (:func:`refuse_sequence_cuts`), the error as its cause."""
    try:
        yield
    except Exception as error:
        if not cuts.found and not cuts.aranges:
            raise
        raise cuts_refusal(cuts.found + cuts.aranges, hook or "step") from error


def _dims(dim: Any, ndim: int) -> set[int]:
    """``dim`` (an int or a sequence of them, perhaps negative) as non-negative dimensions of an ``ndim`` tensor."""
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return {d % ndim for d in dims if isinstance(d, int)}


def sequence_narrow(t: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """``t.narrow(dim, start, length)`` (``args`` after ``t``) as written where it narrows the second dimension (the
    sequence), else ``None``."""
    names = ("dim", "start", "length")
    given = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    if given.get("dim") not in (1, 1 - t.dim()):
        return None
    return f".narrow(1, {given.get('start')}, {given.get('length')})"


def agree_cuts(cuts: SequenceCuts, group: Group) -> tuple[int, list[str] | None]:
    """What every rank's :class:`SequenceCuts` saw, agreed in one all-reduce (a tensor of this rank's ``[b, s]`` may
    match on one rank and not on another): the largest chunk a step split the sequence into (0: none), and the work
    on positions to refuse (``None``: none on any rank): this rank's cuts where a rank saw one, and its
    ``torch.arange`` of the slice's length where every rank made one of its own."""
    agreed = every_ranks([max(cuts.splits, default=0), len(cuts.found), len(cuts.aranges)], group)  # [p, 3]
    cut, positions = bool(agreed[:, 1].sum() > 0), bool((agreed[:, 2] > 0).all())
    refused = cuts.found + (cuts.aranges if positions else [])
    return int(agreed[:, 0].max()), refused if cut or positions else None


def every_ranks(row: list[float], group: Group) -> torch.Tensor:
    """Every rank's ``row`` of numbers, ``[p, k]`` float64 on the host (the same length on every rank): one
    all-reduce of a table whose row ``r`` rank ``r`` fills (host reads: the check's, once per run)."""
    table = torch.zeros(group_size(group), len(row), dtype=torch.float64)
    table[group_rank(group)] = torch.tensor(row, dtype=torch.float64)
    return all_reduce_sum(table.to(collective_device(group)), group).cpu()  # [p, k] -> [p, k]


def refuse_sequence_cuts(found: list[str] | None, hook: str) -> None:
    """Raise where the step worked on positions of the sequence (``found``, as :func:`agree_cuts` agreed: every rank
    raises alike; ``None``: not), naming them and the fix (:func:`cuts_refusal`)."""
    if found is not None:
        raise cuts_refusal(found, hook)


def cuts_refusal(found: list[str], hook: str) -> ValueError:
    """The refusal of a step that worked on positions of the sequence (``found``; none: seen on another rank)."""
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "") or "seen on another rank"
    return ValueError(
        f"the {hook} works on positions of the sequence itself ({shown}). The fix: shift targets in the data (or "
        f"pass labels= to a Hugging Face model, which the strategy shifts over the whole sequence) instead of "
        f"logits[:, :-1] against ids[:, 1:]; change the sequence, or make such masks and weights, where every rank "
        f"holds the whole batch: in the data (the collator) or in on_after_batch_transfer, as tensors of the batch "
        f"the step then uses. Why: each rank holds a slice of every row, so an index, an assignment at positions, a "
        f"scan (cumsum) or positions made with torch.arange are of this rank's slice, not of the row (a truncation "
        f"longer than every slice cuts nothing on any rank, and the run would train on whole rows where one process "
        f"trains on the truncated ones; a shift pairs the slice's positions otherwise than one process's; a prompt "
        f"masked up to a position, a response found after a separator or the last tokens of a row are found in each "
        f"slice anew). ParaDySeStrategy(check_step=False) turns this check off"
    )


def sequence_split(
    t: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], shapes: Collection[Any]
) -> int | None:
    """The chunk size of ``t.split(size, dim)`` (``torch.split(t, size, dim)``: ``args`` after ``t``) where it splits
    the second dimension (the sequence) of a tensor whose ``[b, s]`` is one of ``shapes`` into chunks of one size;
    else ``None``."""
    size = args[0] if args else kwargs.get("split_size", kwargs.get("split_size_or_sections"))
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(size, int) or t.dim() < 2 or dim not in (1, 1 - t.dim()) or tuple(t.shape[:2]) not in shapes:
        return None
    return size


def sequence_index(t: torch.Tensor, index: Any) -> str | None:
    """How ``t[index]`` cuts ``t``'s second dimension (the sequence), as written (``[:, :512]``), or ``None`` where it
    keeps it whole (an index of the rows alone, ``[:, :]``, a mask or index tensor over every dimension at once)."""
    items = list(index) if isinstance(index, tuple) else [index]
    real = [i for i in items if i is not None]  # None adds a dimension and takes none
    if any(i is Ellipsis for i in real):
        k = next(j for j, i in enumerate(real) if i is Ellipsis)
        fill = t.dim() - (len(real) - 1)
        real = real[:k] + [slice(None)] * max(fill, 0) + real[k + 1 :]
    if len(real) < 2 or (isinstance(real[0], torch.Tensor) and real[0].dim() > 1):
        return None
    second = real[1]
    if isinstance(second, slice):
        if second == slice(None):
            return None
        start = "" if second.start is None else str(second.start)
        stop = "" if second.stop is None else str(second.stop)
        step = "" if second.step is None else f":{second.step}"
        return f"[:, {start}:{stop}{step}]"
    if isinstance(second, int):
        return f"[:, {second}]"
    return "[:, <index>]" if isinstance(second, (torch.Tensor, list)) else None


def step_check_tolerance(dtype: torch.dtype, precision: str | None, computed: Collection[torch.dtype] = ()) -> float:
    """The check's relative tolerance: from the loss's dtype, loosened for bf16/fp16 compute (the loss of a
    ``bf16-mixed`` step is float32, its matmuls were not), for TF32 matmuls, and for a float64 loss whose loss
    function ran in float32 (``computed``: :attr:`LossCalls.dtypes`; :data:`FLOAT32_LOSS_TOLERANCE`)."""
    text = str(precision or "")
    if "16" in text:
        return LOW_PRECISION_TOLERANCE
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return TF32_TOLERANCE
    if dtype == torch.float64 and torch.float32 in computed:
        return FLOAT32_LOSS_TOLERANCE
    return STEP_CHECK_TOLERANCE.get(dtype, LOW_PRECISION_TOLERANCE)


@contextlib.contextmanager
def side_effects_undone(
    trainer: Any, module: nn.Module, device: torch.device | None = None, training: bool = False
) -> Iterator[KeptState]:
    """Run extra calls of the user's step without trace: its sub-modules in eval mode (no dropout: both calls must
    compute the same function), the module itself and its batch norms in training mode where ``training`` (the
    training step's check: a term the step adds ``if self.training:``, and a ``BatchNorm1d`` over the tokens, whose
    statistics in training are its slice's, are checked too; they were not until 2026-12-02, probe 19), logging off
    (Lightning's barebones switch), the random streams (the host's and ``device``'s,
    :func:`~lightning_paradyse.runtime.exactness.kept_rng`), every torchmetrics state (a metric collection's compute
    groups too: :func:`put_compute_groups`) and the module's own attributes and buffers restored afterwards
    (:func:`kept_attributes`: a list the step appends its loss to, a counter it increments). Yields that snapshot:
    calling it puts the attributes back between the calls too."""
    restore = kept_attributes(module)
    saved = [metric_state(m) for m in module.modules() if is_metric(m)]
    groups = [(c, compute_groups(c)) for c in module.modules() if is_collection(c)]
    barebones = trainer.barebones
    trainer.barebones = True  # self.log() warns and returns
    modes = {m: m.training for m in module.modules()}
    module.eval()
    if training:  # the module, and the norms whose batch statistics training uses: dropout stays off
        for norm in [module, *(m for m in module.modules() if isinstance(m, _NormBase))]:
            norm.training = True
    try:
        with warnings.catch_warnings(), kept_rng(device):
            warnings.simplefilter("ignore")
            yield restore
    finally:
        trainer.barebones = barebones
        for m, training in modes.items():
            m.training = training
        for kept in saved:
            put_metric_state(kept)
        for collection, kept_groups in groups:
            put_compute_groups(collection, kept_groups)
        restore()


_MODULE_INTERNALS = frozenset(vars(nn.Module()))
"""What every ``nn.Module`` keeps in its ``__dict__`` (parameters, buffers, sub-modules, hooks): not the user's."""
KEPT_TENSOR_BYTES = 1 << 16
"""Tensor attributes up to this size are put back if the step rebinds them or changes them in place (an accumulator,
``self.total += loss``); larger ones are left (a copy of each for one check would cost memory)."""
_CONTAINERS = (list, dict, set, deque, OrderedDict, defaultdict)
"""The containers whose content is put back (exactly these types: a subclass may refuse ``clear`` or ``update``, as
a Hugging Face model output does)."""


def kept_attributes(module: nn.Module) -> KeptState:
    """Snapshot what a step commonly changes on ``module`` (its own ``__dict__``, not ``nn.Module``'s, and the
    registered buffers of it and its sub-modules) and return what puts it back after each of the check's extra calls
    (a :class:`KeptState`, callable): the content of every list, dict, set and deque reachable from its attributes
    through such containers and tuples (``self.outs.append(loss)``; in place, so references held elsewhere see it
    too), numbers rebound (``self.n += 1``), small tensors and buffers rebound or changed in place
    (:data:`KEPT_TENSOR_BYTES`: ``self.register_buffer("steps", ...)``, ``self.steps += 1``; buffers were left until
    2026-12-02, probe 19: a counter the step increments was checkpointed with the check's calls counted). Other
    attributes stay as the step left them (a hook registered once and kept in an attribute must not be registered
    again), and so does other objects' own state. What cannot be put back is named in a warning.

    Inference tensors (an evaluation epoch's accumulator made under ``torch.inference_mode``, as Lightning runs
    evaluation on NCCL) keep no version counter: inside inference mode (the evaluation steps' check there) they are
    snapshotted too and always copied back; outside it they cannot change in place and are left (until 2026-11-30
    they were left inside it too, and an evaluation epoch's accumulator kept the check's two extra calls)."""
    return KeptState(module)


_Kept = tuple[torch.Tensor, torch.Tensor, "int | None"]
"""A tensor kept, its copy and its version counter (``None``: an inference tensor, which keeps none)."""


class KeptState:
    """:func:`kept_attributes`' snapshot of ``module``: calling it puts it back (as often as wanted); :meth:`values`
    reads what it holds now."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        attrs = {k: v for k, v in vars(module).items() if k not in _MODULE_INTERNALS}
        self.containers = _containers(attrs.values())
        self.small = {k: _snapshot(v) for k, v in attrs.items() if _kept(v)}
        self.buffers = {  # registered buffers (in the state dict: a counter the step increments is checkpointed)
            (path, owner, name): _snapshot(b)
            for path, owner in module.named_modules()
            for name, b in owner._buffers.items()
            if b is not None and _kept(b)
        }
        self.numbers = {k: v for k, v in attrs.items() if isinstance(v, (bool, int, float))}

    def __call__(self) -> None:
        module, failed = self.module, []
        for k, v in self.numbers.items():
            module.__dict__[k] = v
        for k, kept in self.small.items():
            module.__dict__[k] = kept[0]
            if not _put_back(*kept):
                failed.append(k)
        for (_, owner, name), kept in self.buffers.items():
            owner._buffers[name] = kept[0]
            if not _put_back(*kept):
                failed.append(name)
        for container, content in self.containers:
            if not _changed(container, content):
                continue
            try:
                container.clear()
                if isinstance(container, (dict, set)):
                    container.update(content)
                else:
                    container.extend(content)
            except Exception:  # named below; the step's own error, if any, stays the one raised
                failed.append(type(container).__name__)
        if failed:
            rank_zero_warn(
                f"[paradyse] the step check could not put back what the step changed in {failed}: its two "
                "extra calls of the step may show there; ParaDySeStrategy(check_step=False) skips the check"
            )

    def values(self, loss: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, Any]:
        """What the step keeps across steps, as it is now, by name: the registered buffers of the snapshot still of
        their shape (checkpointed: a counter, a running mean), and the small tensor attributes the step changed in
        place (``self.total += x``: an accumulator). An attribute the step rebinds (``self.aux = term``: what it
        keeps for a hook of the same step) and a number are left out: nothing tells them from state it keeps.
        ``loss``: ``(returned, global)``: a tensor sharing the returned loss's memory reads the global loss (the
        strategy writes it there once the step is over)."""
        now = self.module.__dict__
        out: dict[str, Any] = {}

        def read(value: torch.Tensor) -> torch.Tensor:
            if loss is not None and value.numel() == 1 and value.data_ptr() == loss[0].data_ptr():
                return loss[1].detach().reshape(value.shape).clone()
            return value.detach().clone()

        for k, (tensor, _, _) in self.small.items():
            if now.get(k) is tensor:
                out[k] = read(tensor)
        for (path, owner, name), (tensor, _, _) in self.buffers.items():
            value = owner._buffers.get(name)
            if isinstance(value, torch.Tensor) and value.shape == tensor.shape:
                out[f"{path}.{name}" if path else name] = read(value)
        return out


def _kept(v: Any) -> bool:
    """Whether ``v`` is a tensor the snapshot keeps: small, and not an inference tensor outside inference mode
    (which cannot change there)."""
    return (
        isinstance(v, torch.Tensor)
        and (torch.is_inference_mode_enabled() or not v.is_inference())
        and v.numel() * v.element_size() <= KEPT_TENSOR_BYTES
    )


def _snapshot(v: torch.Tensor) -> _Kept:
    return v, v.detach().clone(), None if v.is_inference() else v._version


def _put_back(tensor: torch.Tensor, saved: torch.Tensor, version: int | None) -> bool:
    """Copy ``saved`` back into ``tensor`` where it changed in place (always for an inference tensor, which keeps no
    version counter); ``False`` where that failed."""
    if version is not None and tensor._version == version:
        return True
    try:
        with torch.no_grad():
            tensor.copy_(saved)
    except RuntimeError:
        return False
    return True


def _containers(values: Any) -> list[tuple[Any, Any]]:
    """Every container of :data:`_CONTAINERS` reachable from ``values`` through such containers and tuples, each with
    a shallow copy of its content (once each, cycles followed once)."""
    out: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    stack = list(values)
    while stack:
        value = stack.pop()
        if id(value) in seen or not (type(value) in _CONTAINERS or type(value) is tuple):
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            out.append((value, dict(value)))
            stack.extend(value.values())
        elif isinstance(value, tuple):  # immutable itself, but may hold containers
            stack.extend(value)
        else:
            out.append((value, list(value)))
            stack.extend(value)
    return out


def _changed(container: Any, content: Any) -> bool:
    """Whether ``container`` no longer holds exactly ``content`` (the same objects; for a dict, under the same keys)."""
    if len(container) != len(content):
        return True
    if isinstance(container, dict):
        return any(k not in container or container[k] is not v for k, v in content.items())
    if isinstance(container, set):
        return {id(x) for x in container} != {id(x) for x in content}
    return any(a is not b for a, b in zip(container, content))


RESEED = 0x5EED
"""The seed of the whole call run again to tell whether the step draws random numbers (:func:`loss_redrawn`)."""


_MISSING = object()


def _held_objects(module: pl.LightningModule) -> tuple[list[Any], list[Any]]:
    """The optimizers and learning-rate schedulers a manual step may step: Lightning's (``module.optimizers()``, the
    optimizers they wrap, ``module.lr_schedulers()``) and those the module keeps as its own attributes (a scheduler
    made in ``on_train_start``), in lists, tuples and dicts of them too."""
    found = module.optimizers()
    optimizers: list[Any] = list(found) if isinstance(found, list) else [found]
    optimizers += [getattr(o, "optimizer", None) for o in optimizers]
    scheduled = module.lr_schedulers()
    schedulers: list[Any] = [] if scheduled is None else list(scheduled) if isinstance(scheduled, list) else [scheduled]
    for value in vars(module).values():
        for item in (
            value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        ):
            if isinstance(item, torch.optim.Optimizer):
                optimizers.append(item)
            elif isinstance(item, torch.optim.lr_scheduler.LRScheduler):
                schedulers.append(item)
    unique = lambda xs: list({id(x): x for x in xs if x is not None}.values())  # noqa: E731
    return unique(optimizers), unique(schedulers)


@contextlib.contextmanager
def manual_steps_held(module: pl.LightningModule) -> Iterator[list[torch.Tensor]]:
    """Inside, a manual optimization step (``automatic_optimization = False``) runs without trace: its
    ``manual_backward(loss)`` records ``loss`` in the list yielded and backs nothing, its optimizers' ``step`` calls
    the closure it is given and nothing more, their ``zero_grad``, its schedulers' ``step`` (Lightning's and those
    the module keeps) and ``clip_gradients`` do nothing, and every parameter's gradient (a ``clip_grad_norm_`` or
    ``self.zero_grad()`` of the step's own, while gradients accumulate) and every optimizer's hyperparameters are put
    back afterwards; ``loss.backward()`` raises, naming ``manual_backward``. So the check compares what the step
    backs (until 2026-12-02 it skipped such steps, and a loss it refuses trained silently otherwise there: probe 17,
    7e-2 to 1.5e-1)."""
    backed: list[torch.Tensor] = []

    def held_step(closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        return None if closure is None else closure()

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    def direct_backward(*args: Any, **kwargs: Any) -> None:
        raise ValueError(
            "the training_step calls loss.backward() under manual optimization: ParaDySeStrategy weighs each rank's "
            "loss and sums the gradients over the ranks in its backward, which Lightning calls from "
            "self.manual_backward(loss); call that instead (Lightning's documented manual optimization)"
        )

    optimizers, schedulers = _held_objects(module)
    patched: list[tuple[Any, str, Any]] = [
        (module, "manual_backward", lambda loss, *args, **kwargs: backed.append(loss)),
        (module, "clip_gradients", nothing),
        (torch.Tensor, "backward", direct_backward),
        *[(s, "step", nothing) for s in schedulers],
        *[(o, name, held_step if name == "step" else nothing) for o in optimizers for name in ("step", "zero_grad")],
    ]
    saved = [(obj, name, vars(obj).get(name, _MISSING)) for obj, name, _ in patched]
    grads = [(q, q.grad, None if q.grad is None else q.grad.clone()) for q in module.parameters()]
    settings = [(g, {k: v for k, v in g.items() if k != "params"}) for o in optimizers for g in o.param_groups]
    for obj, name, replacement in patched:  # an attribute of the object's shadows its class's method
        setattr(obj, name, replacement)
    try:
        yield backed
    finally:
        for obj, name, before in reversed(saved):  # a scheduler's own wrapper of ``optimizer.step`` kept
            if before is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, before)
        for q, grad, values in grads:
            q.grad = grad
            if grad is not None and values is not None:
                grad.copy_(values)
        for group, kept in settings:
            group.update(kept)


def backed_loss(step_fn: Callable[..., Any], module: pl.LightningModule) -> Callable[..., Any]:
    """``step_fn`` (a manual optimization step) as a step that returns the sum of the losses it backs
    (:func:`manual_steps_held`), ``None`` where it backs none."""

    def step(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        with manual_steps_held(module) as backed:
            step_fn(*args, **kwargs)
        return None if not backed else functools.reduce(torch.add, backed)

    return step


def loss_redrawn(
    step_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> float | None:
    """The whole call's loss once more, the host's and ``device``'s random streams seeded afresh (the caller keeps
    and restores them): another value than the first call's says the step draws random numbers (the module is in eval
    mode: no dropout)."""
    seed_streams(RESEED, device)
    loss = step_loss(step_fn(*args, **kwargs))
    return None if loss is None else float(loss)


def check_step_losses(
    sharded: float,
    whole: float,
    tol: float,
    hook: str = "training_step",
    where: str = "a batch's first tokens",
    consumed: bool = False,
    redrawn: float | None = None,
    chunk: int | None = None,
    weights_sum: str | None = None,
    planted: str | None = None,
) -> None:
    """Raise when the sharded step's loss on the probe (``where``) differs from the whole step's (the same on every
    rank). ``consumed``: a Hugging Face model was handed ``labels=`` in the sharded step (its loss is this rank's share
    of the global mean), named first among the causes. ``redrawn``: the whole step's loss with its random streams
    seeded afresh (:func:`loss_redrawn`); where it differs from ``whole`` the step draws random numbers, named
    alone. ``planted``: how ids were planted in the probe (:func:`planted_probe`), whose causes come first."""
    if abs(sharded - whole) <= tol * max(abs(whole), 1e-12):
        return
    where += f", {planted}" if planted else ""
    if math.isnan(sharded) and math.isnan(whole):
        raise ValueError(
            f"the {hook}'s loss is nan on {where}, both when each rank runs its slice and when one process runs them "
            f"all: a mean over no real target, though the batch has real targets there, so the step itself masks "
            f"them (a prompt masked or a response found in the step). Make such masks where every rank holds the "
            f"whole batch: in the data (the collator) or in on_after_batch_transfer, as tensors of the batch the step "
            f"then uses. ParaDySeStrategy(check_step=False) turns this check off"
        )
    if redrawn is not None and abs(redrawn - whole) > tol * max(abs(whole), 1e-12):
        raise ValueError(
            f"the {hook} draws random numbers: its loss on {where} is {whole:.10g}, and {redrawn:.10g} when the "
            f"random streams are seeded afresh (dropout is off in this check). Under ParaDySeStrategy each rank runs "
            f"its slice of the batch: a tensor drawn in the slice's shape (a masking drawn with torch.rand(ids.shape), "
            f"noise added with torch.randn_like) holds other numbers at the batch's positions than one process draws "
            f"for the batch (here {sharded:.10g}). Draw them where every rank holds the whole batch: in the data (a "
            f"collator, the Dataset) or in on_before_batch_transfer / on_after_batch_transfer, which every rank runs "
            f"alike on its copy of the batch from the same random streams; or, to train with such draws (their "
            f"statistics, not one process's values; every rank draws the same numbers for its slice), turn this "
            f"check off: ParaDySeStrategy(check_step=False)"
        )
    weights = (
        f"per-token weights normalised by their sum on the slice ({weights_sum or '(ce * w).sum() / w.sum()'}: "
        f"divide by the whole batch's sum of them, a 0-dim tensor the data loader puts in the batch, and tell the "
        f"strategy the loss is a sum, ParaDySeStrategy(loss_reduction='sum')), "
    )
    chunked = (
        f"a loss averaged per chunk of the sequence (the step splits it into chunks of {chunk} tokens: each rank "
        f"splits its slice, so its chunks are not one process's; sum the chunks' losses, reduction='sum', and "
        f"divide by the count of real targets, targets != -100), "
        if chunk is not None
        else ""
    )
    lead = (PLANTED_CAUSES if planted else "") + chunked + (weights if weights_sum else "")  # what it was seen doing
    mixed = (
        "a Hugging Face model's loss given labels= (this rank's share of the whole batch's mean, which the "
        "strategy sums over the ranks) combined with a term of the step's own, such as a distillation or "
        "auxiliary term averaged over this rank's tokens, or a loss of the step's own returned in its place while "
        "the model is still given labels= (divide that term by the whole batch's count of real "
        "targets, a tensor the data loader puts in the batch, so that it too is a share of one process's value; "
        "or call the model without labels= and average the cross-entropy over the real targets yourself, "
        "targets shifted in the data, so that every term is a mean over this rank's tokens), "
        if consumed
        else ""
    )
    raise ValueError(
        f"the {hook} computes something across the tokens of its slice: on {where} its loss is "
        f"{sharded:.10g} when each rank runs its slice, but {whole:.10g} when one process runs them all. "
        f"Common causes: {lead}{mixed}shifting targets in the step (logits[:, :-1] against ids[:, 1:]; shift "
        f"them in the data, or pass labels= to a Hugging Face model), a loss reduced per sequence or computed from "
        f"one position of each row (a pooled output: the last real token, [CLS], a mean over the sequence; each "
        f"rank holds a slice of every row, so such heads train under a strategy that keeps rows whole), a loss "
        f"averaged over every position, those without a target included (padding, a prompt: reduction='none' "
        f"then .mean(), or a term over all tokens such as a z-loss: average over the real targets, "
        f"targets != -100), {'' if weights_sum else weights}a loss "
        f"summed over the tokens (reduction='sum': tell the strategy, ParaDySeStrategy(loss_reduction='sum')), "
        f"or a term computed from self.parameters(), such as an L2 penalty (each rank holds a slice of every "
        f"weight: use the optimizer's weight_decay, or add the penalty's gradient in on_before_optimizer_step "
        f"under torch.no_grad(), p.grad.add_(p, alpha=2 * l2), which is exact). "
        f"ParaDySeStrategy(check_step=False) turns this check off"
    )


PLANTED_CAUSES = (
    "a mean over the targets the step keeps by their ids (an id treated as padding: targets.bool(), targets != 0, "
    "torch.sign, a lookup table[targets], nonzero(), as a mask or an index; mark padding -100 in the data, the "
    "collate function's targets[targets == pad_id] = -100, and average over every target that is not -100), a mean "
    "over a mask of the batch's own ((ce * m).sum() / m.sum() with m = batch['loss_mask']: set the targets it leaves "
    "out to -100 in the data and average over the real targets; a mask that leaves none out can go), a mean "
    "of each row's mean (((ce * m).sum(1) / m.sum(1)).mean(): each rank holds a slice of every row; average over "
    "the batch's real targets at once, or put the weights each row's targets need in the batch, divided by the "
    "whole batch's count, with loss_reduction='sum'), "
)
"""The causes a difference on a probe with ids planted (:func:`planted_probe`) names first."""
PLANTED = 3
"""Positions of the probe's first row that each planted value takes (:func:`planted_probe`)."""


def model_config(module: nn.Module) -> Any:
    """The first config a module in ``module`` carries (a Hugging Face model's), else ``None``."""
    return next((getattr(m, "config", None) for m in module.modules() if hasattr(m, "config")), None)


def vocabulary(module: nn.Module) -> int | None:
    """How many ids there are: a Hugging Face config's ``vocab_size`` in the module, else its largest embedding's
    rows; ``None`` without either."""
    size = getattr(model_config(module), "vocab_size", None)
    if isinstance(size, int):
        return size
    rows = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    return max(rows) if rows else None


def pad_ids(module: nn.Module) -> tuple[int, ...]:
    """The ids a step may treat as padding, planted by :func:`planted_probe`: 0, and the pad and end-of-sequence ids
    of a Hugging Face model's config in the module (its first)."""
    ids = [0]
    config = model_config(module)
    vocab = getattr(config, "vocab_size", None)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and isinstance(vocab, int) and 0 <= v < vocab and v not in ids:
                ids.append(v)
    return tuple(ids)


UNPLANTED_KEYS = (*TOKEN_KEYS, *TARGET_KEYS, *PAD_MASK_KEYS, *TOKEN_1D_KEYS, "shift_labels", "token_type_ids")
"""Keys of a dict batch's per-token tensors :func:`planted_probe` plants no 0 in (the padding mask must keep its
rules; positions and segments are no weights)."""


def _mirrors(mask: torch.Tensor, targets: torch.Tensor) -> bool:
    """Whether ``mask`` (``[b, m, ...]``) is 0 exactly where ``targets`` are -100 (a ``loss_mask`` the data keeps
    beside them): a mean over it is then a mean over the real targets, as the strategy weighs (read on the host: the
    check's, once per run)."""
    real = (targets != IGNORE_INDEX).reshape(targets.shape[0], targets.shape[1], -1).any(-1)  # [b, m]
    kept = (mask != 0).reshape(mask.shape[0], mask.shape[1], -1).any(-1)  # [b, m]
    return bool((real == kept).all())


def planted_probe(probe: Any, ids: tuple[int, ...], ignore: bool) -> tuple[Any, str | None]:
    """``probe`` with ``ids`` planted (:data:`PLANTED` positions each) in its first row at its last positions that
    have a real target, in the tokens and in the targets the strategy weighs by; where the data marks targets -100
    (``ignore``), -100 in the targets at the positions before those; and 0 before those in a dict batch's other
    per-token tensors (a ``loss_mask``, weights: not :data:`UNPLANTED_KEYS`), or, for one that is 0 exactly where the
    targets are -100 (:func:`_mirrors`), 0 where -100 is planted; with how (for a message), or ``None``
    where the probe has too few such positions. A step that keeps targets by their ids (a pad id as ``tg.bool()``, a
    lookup), by a mask of the batch's own, or averages each row's mean differs from one process only where ids, the
    mask or rows' counts of real targets differ, which the batch the check runs may not show (silent until
    2026-12-02, probe 17): planted, they differ on the first batch. 0 is a real id of every vocabulary, and -100 and a
    mask's 0 are values the data itself uses, so a step that differs here differs on some batch of its own."""
    tokens = find_tokens(probe)
    _, targets = find_targets(probe)
    weighed = targets if targets is not None and targets is not tokens else None
    real = (
        (weighed != IGNORE_INDEX).reshape(weighed.shape[0], weighed.shape[1], -1).any(-1)[0]
        if weighed is not None
        else None
    )
    where = torch.nonzero(real).flatten() if real is not None else torch.arange(tokens.shape[1])  # [k] on the host
    values: list[int] = [*ids, IGNORE_INDEX] if ignore and weighed is not None else list(ids)
    masks = [
        key
        for key, t in (probe.items() if isinstance(probe, dict) else ())
        if isinstance(t, torch.Tensor)
        and key not in UNPLANTED_KEYS
        and t is not tokens
        and t is not targets
        and t.dim() >= 2
        and tuple(t.shape[:2]) == tuple(tokens.shape[:2])
    ]
    mirrors = [key for key in masks if weighed is not None and IGNORE_INDEX in values and _mirrors(probe[key], weighed)]
    masks = [key for key in masks if key not in mirrors]
    blocks = len(values) + bool(masks)
    if where.numel() < PLANTED * blocks + 1:  # one real target left
        return probe, None

    def block(k: int) -> torch.Tensor:  # [PLANTED]: the k-th block of positions from the end
        return where[where.numel() - PLANTED * (k + 1) : where.numel() - PLANTED * k].to(tokens.device)

    made: dict[int, torch.Tensor] = {id(tokens): tokens.clone()}
    if weighed is not None:
        made[id(weighed)] = weighed.clone()
    for k, value in enumerate(values):  # ids in integer tensors only (features or float targets hold no ids)
        if value != IGNORE_INDEX and not tokens.is_floating_point():
            made[id(tokens)][0, block(k)] = value
        if weighed is not None and not weighed.is_floating_point():
            made[id(weighed)][0, block(k)] = value
    for key in masks:  # a mask's or a weight's 0 at positions with a real target
        made[id(probe[key])] = probe[key].clone()
        made[id(probe[key])][0, block(len(values))] = 0
    for key in mirrors:  # a mask that is 0 where the targets are -100: 0 where -100 is planted, as the data has it
        made[id(probe[key])] = probe[key].clone()
        made[id(probe[key])][0, block(values.index(IGNORE_INDEX))] = 0

    planted = tree_map(lambda t: made.get(id(t), t) if isinstance(t, torch.Tensor) else t, probe)
    shown = ", ".join(str(v) for v in ids) + (" and -100 targets" if IGNORE_INDEX in values else "")
    also = f" (and 0 in its {', '.join(repr(k) for k in masks)})" if masks else ""
    return planted, f"with the ids {shown} planted in its first row's last real targets{also}"


def one_number(value: Any) -> float | None:
    """A one-number tensor (read on the host; a boolean is no number) or a Python int as a float; else ``None``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        return float(value.detach())
    return float(value) if type(value) is int else None


LoggedValues = dict[tuple[str | None, str], float]
"""One-number values a step logged, by hook and name (the last call's)."""


@contextlib.contextmanager
def recorded_logs(
    module: pl.LightningModule, summed: list[tuple[str | None, str]] | None = None
) -> Iterator[LoggedValues]:
    """What ``module`` logs inside the block, recorded and not logged: every one-number value (a tensor, read on the
    host, or a Python number) by hook and name, and the ``batch_size`` given with it (under the name followed by
    ``" batch_size"``: Lightning weighs an epoch's mean by it). Other values (a metric, several numbers) are not
    compared. ``log`` is replaced on the instance and put back after (an instance attribute of the user's too).
    ``summed``: where given, the keys of the values logged summed over the ranks (``sync_dist=True,
    reduce_fx="sum"``), in order (:func:`summed_over_ranks`)."""
    out: LoggedValues = {}

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        fx = module._current_fx_name
        number = float(torch.tensor(value, dtype=number_dtype())) if type(value) is float else one_number(value)
        given = log_arguments(name, args, kwargs)
        if number is not None:  # a Python float as Lightning makes it a tensor
            out[(fx, name)] = number
            if summed is not None and given.get("sync_dist") and given.get("reduce_fx", "mean") in ("sum", torch.sum):
                summed.append((fx, name))
        size = given.get("batch_size")
        if isinstance(size, (int, torch.Tensor)) and not isinstance(size, bool):
            out[(fx, f"{name} batch_size")] = float(size)

    with log_replaced(module, record):
        yield out


SUMMED_SLOTS = 16
"""The most values a step logs summed over the ranks that the check compares summed (:func:`summed_over_ranks`)."""


def summed_over_ranks(logs: LoggedValues, summed: list[tuple[str | None, str]], group: Group) -> None:
    """The values the sharded call logged summed over the ranks (``summed``: :func:`recorded_logs`) made their sum
    over the ranks in ``logs``, as Lightning logs them (a count of the slice's tokens summed is one process's count):
    one all-reduce of one size on every rank. Where the ranks logged other such values (their number or names
    differ) or more than :data:`SUMMED_SLOTS`, they stay this rank's."""
    keys = list(dict.fromkeys(summed))  # [k] in the order first logged
    values = [logs[key] for key in keys[:SUMMED_SLOTS]]
    row = [len(keys), zlib.crc32(repr(keys).encode()), *values, *[0.0] * (SUMMED_SLOTS - len(values))]
    agreed = every_ranks(row, group)  # [p, 2 + K]: how many, their names, their values
    alike = bool((agreed[:, :2] == agreed[0, :2]).all())
    if not keys or len(keys) > SUMMED_SLOTS or not alike:
        return
    totals = agreed[:, 2:].sum(0)  # [p, K] -> [K]
    for i, key in enumerate(keys):
        logs[key] = float(totals[i])


class LogDifference(NamedTuple):
    """A value the step logged that differs between the sharded call and the whole one."""

    fx: str | None
    name: str
    sharded: float
    whole: float


def differing_logs(sharded: LoggedValues, whole: LoggedValues, tol: float) -> list[LogDifference]:
    """The values logged under the same hook and name by both calls that differ beyond the relative ``tol`` (two NaNs
    agree), in the sharded call's order."""
    out = []
    for key, value in sharded.items():
        other = whole.get(key)
        if other is None or (math.isnan(value) and math.isnan(other)):
            continue
        if math.isnan(value) or math.isnan(other) or abs(value - other) > tol * max(abs(other), 1e-12):
            out.append(LogDifference(key[0], key[1], value, other))
    return out


def _listed(found: list[LogDifference]) -> str:
    """The first five differences, each with both values, and how many more."""
    shown = ", ".join(f"{d.name!r} ({d.sharded:.6g} on rank 0, {d.whole:.6g} in one process)" for d in found[:5])
    return shown + (f" and {len(found) - 5} more" if len(found) > 5 else "")


def warn_differing_logs(found: list[LogDifference]) -> None:
    """Name, once, the values the step logs as this rank's where one process logs another (see the module
    docstring), with the fix."""
    if not found:
        return
    shown = _listed(found)
    hook = found[0].fx or "training_step"
    end = _BATCH_END.get(hook, "on_train_batch_end")
    rank_zero_warn(
        f"[paradyse] {hook} logs values computed on this rank's part of the batch (a slice of every row, or on a "
        f"step on groups its group's rows), not the values one process logs: {shown} (the step check, on "
        f"a few of a batch's tokens). The loss the step "
        "returns, logged as that tensor or as loss.item(), and a torchmetrics metric given it are made global; a "
        "value derived from the loss (torch.exp(loss), loss.clone()) or from the slice's tokens (a count, a "
        "batch_size= of its rows or targets) is not. Log it from "
        f"{end}, computed from its outputs (the step's global loss) or from the batch it is handed (the whole "
        "batch) (docs/training-step.md)."
    )


def returned_values(output: Any, loss: torch.Tensor | None) -> LoggedValues:
    """The one-number values a step returns beside its loss (a mapping's other entries: tensors read on the host,
    Python numbers), by ``(None, key)``; a tensor of the loss's storage (``loss.detach()``) is left out: the strategy
    writes the global loss into it."""
    out: LoggedValues = {}
    if not isinstance(output, Mapping) or loss is None:  # no loss returned: the strategy warns about that already
        return out
    for key, value in output.items():
        if key == "loss" or (isinstance(value, torch.Tensor) and aliases(value, loss)):
            continue
        number = float(value) if type(value) is float else one_number(value)
        if number is not None:
            out[(None, str(key))] = number
    return out


def warn_differing_returns(found: list[LogDifference], hook: str) -> None:
    """Name, once, the values the step returns beside its loss as this rank's where one process returns another."""
    if not found:
        return
    shown = _listed(found)
    rank_zero_warn(
        f"[paradyse] {hook} returns values beside its loss computed on this rank's slice of the batch, not the values "
        f"one process returns: {shown} (the step check, on a few of a batch's tokens). Only the "
        f"loss (and a view of it, such as loss.detach()) is made global; {_BATCH_END.get(hook, 'on_train_batch_end')} "
        "and the callbacks read the others as this rank's. Compute them there from outputs['loss'] (the global "
        "loss) or from the batch it is handed (the whole batch) (docs/training-step.md)."
    )


def outer_metrics(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The module's torchmetrics metrics that no other metric holds (a wrapper's inner metrics count through it), by
    name, in the module's order (the same on every rank)."""
    found = [(name, m) for name, m in module.named_modules() if is_metric(m)]
    inner = {id(sub) for _, m in found for sub in m.modules() if sub is not m}
    return [(name, m) for name, m in found if id(m) not in inner]


def reset_metrics(module: nn.Module) -> None:
    """Every metric of ``module`` reset (a collection's compute groups linked again where formed): a call made next
    leaves the state its own batch makes (:func:`side_effects_undone` puts the real states back)."""
    found = list(module.modules())
    for m in [m for m in found if is_metric(m)] + [c for c in found if is_collection(c)]:  # collections last: they
        reset: Any = m.reset  # link their groups' states again
        reset()


MetricValues = list[list[torch.Tensor] | None]
"""Per metric of :func:`outer_metrics`: the tensors its ``compute()`` returned (``None``: not updated, or failed)."""


def metric_values(metrics: list[tuple[str, nn.Module]], group: Group | None) -> MetricValues:
    """What each metric's ``compute()`` returns now, as its tensors. With ``group`` (the sharded call's), a metric
    updated on any rank (agreed in one all-reduce) is computed on every rank, synchronised over the ranks as the
    metric itself does (torchmetrics gathers the ranks' states in ``compute``: what Lightning logs at an epoch's end);
    without, each is computed from this rank's state alone (the whole call's: one process's)."""
    updated = [float(m._update_count > 0) for _, m in metrics]  # type: ignore[operator]
    if group is not None and metrics and group_size(group) > 1:
        flags = torch.tensor(updated, dtype=torch.float64, device=collective_device(group))  # [k]
        updated = all_reduce_sum(flags, group).tolist()  # [k] summed over the group
    out: MetricValues = []
    for (_, m), n in zip(metrics, updated):
        if n == 0:
            out.append(None)
            continue
        to_sync = m.__dict__.get("_to_sync")
        if group is None and to_sync is not None:
            m.__dict__["_to_sync"] = False
        compute: Any = m.compute
        try:  # the states are gathered first, on every rank: a compute that fails after it fails alone
            value = compute()
        except Exception:
            value = None
        finally:
            if to_sync is not None:
                m.__dict__["_to_sync"] = to_sync
        out.append(None if value is None else _tensors(value))
    return out


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a metric's value (a tensor, a number, or a mapping or sequence of them), in order."""
    if isinstance(value, torch.Tensor):
        return [value.detach()]
    if isinstance(value, (int, float)):
        return [torch.tensor(float(value), dtype=torch.float64)]
    if isinstance(value, Mapping):
        return [t for key in sorted(value, key=str) for t in _tensors(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def differing_metrics(
    metrics: list[tuple[str, nn.Module]], sharded: MetricValues, whole: MetricValues, precision: str | None
) -> list[str]:
    """The names of the metrics whose value over the ranks after the sharded call differs from one process's after
    the whole call (each tensor to its own dtype's tolerance: torchmetrics keeps float32 states under a float64 run;
    two NaNs agree)."""
    out = []
    for (name, _), a, b in zip(metrics, sharded, whole):
        if a is None or b is None:
            continue
        if len(a) != len(b) or any(not _close(x, y, precision) for x, y in zip(a, b)):
            out.append(name)
    return out


def _close(a: torch.Tensor, b: torch.Tensor, precision: str | None) -> bool:
    if a.shape != b.shape:
        return False
    x, y = a.detach().cpu().double(), b.detach().cpu().double()
    tol = step_check_tolerance(b.dtype, precision) if b.is_floating_point() else 0.0
    same = (x - y).abs() <= tol * torch.maximum(y.abs(), torch.full_like(y, 1e-12))
    return bool((same | (x.isnan() & y.isnan())).all())


def warn_differing_metrics(found: list[str], hook: str) -> None:
    """Name, once, the metrics the step updates with values of this rank's slice that do not add up to one
    process's over the ranks."""
    if not found:
        return
    shown = ", ".join(repr(name) for name in found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    rank_zero_warn(
        f"[paradyse] {hook} updates the metrics {shown} with values that differ from one process's: their value over "
        "the ranks (what Lightning logs at the epoch's end) is not the one process computes (the step check, "
        "on a few of a batch's tokens). Each rank runs its slice of every row: a value per row or "
        "per sequence (an accuracy of a row, a pooled output) is this rank's part of it, a sum of the loss counts "
        "it once per rank, and targets shifted in the step (logits[:, :-1] against labels[:, 1:], as a perplexity "
        "update often does) pair tokens within this rank's slice only, dropping the pairs across its edges. Update "
        "metrics with values per token against targets shifted in the data (the ranks' states then add up to the "
        "whole batch's) or with the loss itself under a mean (docs/training-step.md)."
    )


_BATCH_END = {
    "training_step": "on_train_batch_end",
    "validation_step": "on_validation_batch_end",
    "test_step": "on_test_batch_end",
}
"""The hook after each step, where its outputs hold the global loss."""


class RowsRuns(NamedTuple):
    """The step run whole on two parts of the probe's rows, as groups of whole rows run it (:func:`rows_runs`)."""

    loss: float
    """The two parts' losses combined as the strategy combines groups' (weighed by their real targets for a mean
    loss, summed for a summed one)."""
    logs: LoggedValues
    """What the first part's step logged, its loss left out (the strategy makes a logged loss global); a value logged
    summed over the ranks (``sync_dist=True, reduce_fx="sum"``), the two parts' sum."""
    split: tuple[int, int]
    """The rows of each part."""


def rows_runs(
    module: pl.LightningModule,
    probe: Any,
    info: BatchInfo,
    plan: Plan,
    step_fn: Callable[..., Any],
    rest: tuple[tuple[Any, ...], dict[str, Any]],
    causal: bool,
    mean_loss: bool,
    rewind: Callable[[], None] = lambda: None,
) -> RowsRuns | None:
    """The step on the probe's first ``b // 2`` rows and on the others, each run whole (every weight on this rank,
    ``info``: the probe's own description), as a step on groups runs each group's rows; ``None`` where the probe has
    one row, or a part no real target. Call with the whole weights in place, under ``no_grad``. ``rewind`` puts the
    random streams back before each run (a step's own draws are then the same in every run, as on every group)."""
    b, m = info.batch, info.seq_len
    if b < 2:
        return None
    units = Units(False, (m,) * b, tuple((0, m) for _ in range(b)), b, m)  # rows cut, every column kept
    half = b // 2
    combined, first_logs = 0.0, None
    summed: list[tuple[str | None, str]] = []
    for members in (list(range(half)), list(range(half, b))):
        part = units.cut(probe, members)  # [b, m, ...] -> [b_part, m, ...]
        try:
            part_info = describe_batch(part, 1, 0, causal=causal, mean_loss=mean_loss)
        except ValueError:  # no real target among the part's tokens: nothing to compare
            return None
        piece = parallel.configure_whole(module, part, part_info, plan)
        reset_metrics(module)  # a metric given the part's loss holds it alone, as the strategy makes it global
        rewind()
        with recorded_logs(module, summed if first_logs is None else None) as logs:  # the first part's
            loss = step_loss(step_fn(piece, *rest[0], **rest[1]))
        if loss is None:
            return None
        value = float(loss)
        combined += value * (part_info.n_global / info.n_global if mean_loss else 1.0)  # a mean weighed by targets
        if first_logs is None:  # the loss as logged (a tensor, a number, a float32 metric given it) left out
            near = LOSS_AS_LOGGED * max(abs(value), 1e-12)
            first_logs = {k: v for k, v in logs.items() if abs(v - value) > near or k[1].endswith(" batch_size")}
        else:  # a value logged summed over the ranks: summed over the groups' ranks, so over the parts
            for key in dict.fromkeys(summed):
                if key in first_logs and key in logs:
                    first_logs[key] += logs[key]
    return RowsRuns(combined, first_logs or {}, (half, b - half))


def check_rows_losses(
    combined: float, whole: float, tol: float, hook: str, split: tuple[int, int], planted: str | None = None
) -> None:
    """Raise when the step's loss on two parts of the probe's rows, combined as the strategy combines groups' losses,
    differs from its loss on all of them (the same on every rank). ``planted``: the probe's ids were planted
    (:func:`planted_probe`), how."""
    if abs(combined - whole) > tol * max(abs(whole), 1e-12):
        raise ValueError(
            f"the {hook} computes something across the rows of its batch: on a batch of {sum(split)} rows"
            f"{' (' + planted + ')' if planted else ''} its loss "
            f"is {whole:.10g}, but {combined:.10g} when {split[0]} and {split[1]} of the rows run apart, as steps on "
            f"groups run them (plan='auto' trains batches of several sequences on groups of ranks, each group on "
            f"its own rows). Common causes: {PLANTED_CAUSES if planted else ''}a loss divided by the batch's number "
            f"of rows (targets.shape[0], "
            f"len(batch)): each group divides by its own rows; divide by the whole batch's count, a tensor the data "
            f"loader puts in the batch, or train with ParaDySeStrategy(groups=False), where every rank holds a slice "
            f"of every row; or a term computed over the batch's rows (a contrastive loss between rows, a batch "
            f"statistic), which groups=False keeps too. ParaDySeStrategy(check_step=False) turns this check off"
        )


def check_rows_runs(
    apart: RowsRuns | None,
    whole: torch.Tensor | None,
    consumed: bool,
    whole_logs: LoggedValues,
    found: list[LogDifference],
    tol: float,
    hook: str,
    planted: str | None,
) -> list[LogDifference]:
    """Where the check ran the probe's rows apart (:func:`rows_runs`): raise where their losses combined differ from
    the whole call's (:func:`check_rows_losses`), and return what the first part logs that differs from the whole
    call's logs and is not in ``found`` already. A Hugging Face loss given ``labels=`` divides by the whole batch's
    count on groups (the strategy hands it over), by its part's in a whole run (``consumed``): its parts' losses are
    not compared."""
    if apart is None or whole is None:
        return []
    if not consumed:
        check_rows_losses(apart.loss, float(whole), tol, hook, apart.split, planted)
    seen = {(d.fx, d.name) for d in found}
    return [d for d in differing_logs(apart.logs, whole_logs, tol) if (d.fx, d.name) not in seen]


AGAIN_EVERY = 10
"""After its first batch the training step is checked again at its 10th, 100th, 1,000th, ... batch (the first plain
batch from there): a step that changes after its first batches (a warm-up on another loss, draws that start later)
is seen there, not before."""


class StepCheck:
    """The check's state (batches left) and its run. ``enabled``: ``ParaDySeStrategy(check_step=...)``.
    ``training``: it checks the training step (else an evaluation step: ``validation_step``, ``test_step``, whose first
    batch is checked alike, its loss if it returns one and what it logs)."""

    def __init__(self, enabled: bool, training: bool = True) -> None:
        self.left = ATTEMPTS if enabled else 0
        self.training = training
        self.until_untargeted = False
        self.ran = False
        """The last run of the check compared the two calls (it may stop short: no real target among its tokens)."""
        """The check ran on a batch whose every position has a target: it runs once more, on the first batch with
        a position that has none (where a loss averaged over every position stops being one process's)."""
        self.again: int | None = AGAIN_EVERY if enabled and training else None
        """The training batch (Lightning's count of batches begun, from 1) from which the check runs again
        (:data:`AGAIN_EVERY`); ``None``: never."""

    def wants(self, info: BatchInfo, batch: int | None = None) -> bool:
        """Whether the check would run on a batch so described, the ``batch``-th of the fit (its step then runs on one
        group of every rank)."""
        if self.left > 0:
            return True
        if self.again is not None and batch is not None and batch >= self.again:
            return True
        return self.until_untargeted and (info.padding is not None or info.n_global < info.batch * info.seq_len)

    def due(
        self, cycle: StepCycle, module: pl.LightningModule, world: int, axes: int, batch: int | None = None
    ) -> bool:
        """Whether the batch begun (the ``batch``-th) is checked: a plain batch (no documents, one group, not
        skipped), on several ranks (a manual optimization step too: what it backs, :func:`backed_loss`), while
        attempts are left (or the first such batch with a position without a target, after a check on a batch
        without one; or the first from :attr:`again`)."""
        pending, step = cycle.pending, cycle.runner.step
        if world == 1 or pending is None or step is None or not step.whole or not self.wants(pending, batch):
            return False
        return pending.doc_ids is None and axes == 1 and not pending.skip

    def run(
        self,
        cycle: StepCycle,
        trainer: pl.Trainer,
        group: Group,
        device: torch.device,
        step_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        batch_index: int | None = None,
    ) -> None:
        """The check itself (see the module docstring); ``step_fn`` is the module's step, on the fit's
        ``batch_index``-th batch. It runs ``8p + 1`` of the batch's tokens; a step that splits the sequence into
        chunks longer than that is checked again on more (:func:`longer_probe`)."""
        longer = self._run(cycle, trainer, group, device, step_fn, args, kwargs, batch_index)
        if longer is not None:
            self._run(cycle, trainer, group, device, step_fn, args, kwargs, batch_index, longer)
        if self.ran:  # and once more with ids planted in the tokens (:func:`planted_probe`)
            self._run(cycle, trainer, group, device, step_fn, args, kwargs, batch_index, plant=True)

    def _again_after(self, batch_index: int | None) -> None:
        """The next batch to check again after the ``batch_index``-th: the next power of :data:`AGAIN_EVERY`."""
        while self.again is not None and batch_index is not None and self.again <= batch_index:
            self.again *= AGAIN_EVERY

    def _probe(
        self, module: nn.Module, batch: Any, info: BatchInfo, m: int, plant: bool
    ) -> tuple[Any, torch.Tensor, str | None]:
        """The ``m`` tokens of ``batch`` the check runs (:func:`probe_columns`), their columns, and, with ``plant``,
        the ids planted in them and how (:func:`planted_probe`; no tokens, ``None``, where too few positions have a
        target)."""
        rows = rows_with_target(batch, info.batch, info.seq_len)  # [s] (host reads: once a fit)
        columns = probe_columns(rows, info.batch, info.seq_len, m)
        self.until_untargeted = rows is not None and bool((rows == info.batch).all())
        probe = probe_batch(batch, info.batch, info.seq_len, columns)
        if not plant:
            return probe, columns, None
        uses_ignore = rows is not None and bool((rows < info.batch).any())  # the data marks targets -100
        probe, planted = planted_probe(probe, pad_ids(module), uses_ignore)
        return (None if planted is None else probe), columns, planted

    def _run(
        self,
        cycle: StepCycle,
        trainer: pl.Trainer,
        group: Group,
        device: torch.device,
        step_fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        batch_index: int | None,
        probe_len: int | None = None,
        plant: bool = False,
    ) -> int | None:
        """One run of the check on ``probe_len`` of the batch's tokens (default ``8p + 1``); returns how many to run
        again on (:func:`longer_probe`), or ``None``. ``plant``: with ids planted in the tokens
        (:func:`planted_probe`), only the losses compared (what the step logs was compared on the run before)."""
        self.ran = False
        module = cycle.module
        assert isinstance(module, pl.LightningModule), "the strategy checks its LightningModule's step"
        if self.training and not module.automatic_optimization:  # what its manual_backward backs, compared
            step_fn = backed_loss(step_fn, module)
        info, step = cycle.pending, cycle.runner.step
        assert info is not None and step is not None
        plan, rank = step.plan, step.rank
        self.left = max(self.left - 1, 0)
        if self.training:
            cycle.fixed.exclude()  # the check's forward passes are no part of this step's costs
        batch = args[0] if args else kwargs.get("batch")
        p = group_size(group)
        # 8p + 1 tokens: the ranks hold unequal numbers of them, so a value the ranks average (the mean of their
        # losses gathered with self.all_gather) differs from one process's as it does on most real batches
        m = min(info.seq_len, 8 * p + 1) if probe_len is None else probe_len
        probe, columns, planted = self._probe(module, batch, info, m, plant)
        if probe is None:  # too few positions with a target to plant ids in
            return None
        rest = (args[1:], {k: v for k, v in kwargs.items() if k != "batch"})
        try:
            sharded_info = cycle.inspect(probe)
            causal = parallel.is_causal(module)
            whole_info = describe_batch(probe, 1, 0, causal=causal, mean_loss=cycle.options.mean_loss)
        except ValueError:  # e.g. no real target among the tokens: try the next batch
            if self.left == 0:
                rank_zero_warn(
                    "[paradyse] check_step: no batch had a real target among the tokens it runs; not checked"
                )
            return None
        if not whole_weights_fit(module, group, device, trainer.world_size, copies=2):
            rank_zero_warn("[paradyse] check_step: the whole weights do not fit on every rank; the step is not checked")
            self.left, self.again = 0, None
            return None
        metrics = outer_metrics(module)  # their values compared too: computed from the check's calls alone
        with torch.no_grad(), side_effects_undone(trainer, module, device, self.training) as kept:
            streams = rng_state(device)  # every call below starts from them: a draw of the step's is the same in each
            rewind = functools.partial(_afresh, kept, streams, device)  # and from the module's state: a counter too

            reset_metrics(module)
            cycle.runner.enter(cycle.runner.whole(sharded_info, plan, rank))
            a, k = cycle.shard(sharded_info, (probe, *rest[0]), rest[1])
            sliced = {src.key: src.local for src in parallel.step_state(module).sources}
            calls = parallel.call_streams(module)  # its stack is not empty inside a call of the model
            cuts = SequenceCuts(sliced, lambda: bool(calls.saved))  # inside a call of the model: not the step's
            summed: list[tuple[str | None, str]] = []
            state = parallel.step_state(module)
            graded = self.training and probe_len is None and not plant  # its gradient by the model's outputs too
            sharded_leaves, whole_leaves = OutputLeaves(), OutputLeaves()
            # a training step's own code runs with gradients on, as in training (a hook on its logits, retain_grad,
            # torch.autograd.grad in the step; they raised under no_grad until 2026-12-02, probe 20)
            leafed = functools.partial(_with_leaves, step_fn, state) if self.training else step_fn
            with recorded_logs(module, summed) as sharded_logs, cycle.logs.trial():  # as the strategy logs them
                with (
                    cycle.logs.capture(module),
                    cuts,
                    cut_failed(cuts, module._current_fx_name),
                    collecting(state, sharded_leaves, self.training),
                ):
                    output = step_fn(*a, **k)
                    local = step_loss(output)
                    share = None if local is None else cycle.share(local, sharded_info)  # its part of the loss
                sharded_grads = leaf_gradients(share, sharded_leaves) if graded else None  # [b, s_r, ...] per output
                sharded_returns = returned_values(output, local)
                total = None if local is None else cycle.global_loss(local, sharded_info)
                cycle.logs.replay(local, total)
            # what the step keeps across steps, after its call on the slice (a reference to the loss it returned holds
            # the global loss once a step is over)
            sharded_state = kept.values(_pair(local, total))
            consumed = parallel.step_state(module).labels_consumed  # the sharded call's; the whole call resets it
            sharded = None if total is None else float(total)
            sharded_metrics = metric_values(metrics, group)  # over the ranks, as Lightning logs them
            reset_metrics(module)
            enter_group(module, group, [1] * p)  # every weight on every rank: the whole step, p times
            try:
                run = whole_plan(plan)
                piece = parallel.configure_whole(module, probe, whole_info, run)  # as one process
                rewind()
                whole_losses = LossCalls(piece, lambda: bool(calls.saved), vocabulary(module))  # the step's own means
                with (
                    recorded_logs(module) as whole_logs,  # logged as one process logs them
                    whole_losses as losses,
                    collecting(state, whole_leaves, self.training),
                ):
                    output = step_fn(piece, *rest[0], **rest[1])
                    whole = step_loss(output)
                whole_grads = leaf_gradients(whole, whole_leaves) if graded else None  # [b, m, ...] per output
                whole_returns = returned_values(output, whole)
                whole_state = kept.values()
                whole_metrics = metric_values(metrics, None)  # one process's
                redrawn = None
                if sharded is not None and whole is not None and sharded != float(whole):  # does the step draw?
                    piece = parallel.configure_whole(module, probe, whole_info, run)
                    kept()
                    redrawn = loss_redrawn(leafed, (piece, *rest[0]), rest[1], device)
                apart = None
                if self.training and cycle.runner.ready and whole is not None:  # steps may run on groups of rows
                    mean = cycle.options.mean_loss
                    apart = rows_runs(module, probe, whole_info, run, leafed, rest, causal, mean, rewind)
            finally:
                drop_group(module)
        cycle.runner.enter(step)  # the batch's own step again
        cycle.pending = info
        self.left = 0
        self._again_after(batch_index)
        dtype = whole.dtype if whole is not None else torch.get_default_dtype()
        tol = step_check_tolerance(dtype, trainer.precision, losses.dtypes)
        hook = module._current_fx_name or ("training_step" if self.training else "evaluation step")
        chunk, cut = agree_cuts(cuts, group)  # before any refusal: every rank raises alike
        summed_over_ranks(sharded_logs, summed, group)
        refuse_sequence_cuts(cut, hook)  # first: a step working across the slice is what to fix before its loss
        if cycle.options.mean_loss:
            losses.refuse(hook)
        kept_apart = differing_state(sharded_state, whole_state, tol, group)  # agreed: every rank raises alike
        if sharded is not None and whole is not None:
            where = f"the tokens {described_columns(columns)} of a batch of {info.seq_len}"
            weights_sum = next(iter(cuts.sums), None)  # a floating tensor of the batch summed: weights normalised
            check_step_losses(
                sharded, float(whole), tol, hook, where, consumed, redrawn, chunk or None, weights_sum, planted
            )
        where = f"the tokens {described_columns(columns)} of a batch of {info.seq_len}"
        grads = (sharded_grads, whole_grads)
        refuse_gradient_gap(graded, grads, sharded_info.layout, group, tol, hook, where, consumed)
        refuse_differing_state(kept_apart, hook)
        found = differing_logs(sharded_logs, whole_logs, tol)
        found += check_rows_runs(apart, whole, consumed, whole_logs, found, tol, hook, planted)
        self.ran = True
        if planted is not None:  # what the step logs is compared on the batch's own tokens, not on planted ones
            return None
        warn_differing_logs(found)
        warn_differing_returns(differing_logs(sharded_returns, whole_returns, tol), hook)
        warn_differing_metrics(differing_metrics(metrics, sharded_metrics, whole_metrics, trainer.precision), hook)
        return longer_probe(chunk, m, info.seq_len) if probe_len is None else None


GRADIENT_TOLERANCE_LIMIT = 1e-4
"""The losses' gradients by the model's outputs are compared where the step check's tolerance is at most this
(float64 and float32); in TF32 and half precision the outputs' rounding between modes is of the order of the
tolerance."""


def gradient_gap(
    sharded: list[torch.Tensor | None] | None,
    whole: list[torch.Tensor | None] | None,
    layout: SeqLayout,
    group: Group,
) -> float | None:
    """How far the gradient of this rank's part of the global loss by the model's outputs (``sharded``: ``[b, s_r,
    ...]`` per output, :func:`~lightning_paradyse.runtime.output_leaves.leaf_gradients`) is from one process's at
    this rank's tokens (``whole``: ``[b, m, ...]``, cut by ``layout``), relative to the largest entry of one process's;
    the largest over the ranks, agreed in one all-reduce (every rank calls it). ``None`` where there is nothing to
    compare on some rank (no loss with a gradient, outputs of other shapes)."""
    rank = group_rank(group)
    err, scale, compared = 0.0, 0.0, 0
    if sharded is not None and whole is not None and len(sharded) == len(whole):
        for gs, gw in zip(sharded, whole):
            if gw is None or (gs is not None and gs.dim() != gw.dim()) or gw.dim() < 2:
                continue
            if gw.shape[1] != layout.seq_len or layout.local_len(rank) == layout.seq_len:
                continue  # not one entry per token of the probe
            part = layout.shard(gw.detach().double(), rank, dim=1)  # [b, m, ...] -> [b, s_r, ...]
            if gs is None:
                gs = torch.zeros_like(part)  # the step did not use this rank's output
            if gs.shape != part.shape:
                continue
            if part.numel():
                err = max(err, float((gs.detach().double() - part).abs().max()))
                scale = max(scale, float(gw.detach().abs().max()))
            compared += 1
    agreed = every_ranks([1.0 if compared else 0.0, err, scale], group)  # [p, 3]
    if bool((agreed[:, 0] == 0).any()):
        return None
    return float(agreed[:, 1].max()) / max(float(agreed[:, 2].max()), 1e-300)


def refuse_gradient_gap(
    graded: bool,
    grads: tuple[list[torch.Tensor | None] | None, list[torch.Tensor | None] | None],
    layout: SeqLayout,
    group: Group,
    tol: float,
    hook: str,
    where: str,
    consumed: bool = False,
) -> None:
    """Where the check took them (``graded``: alike on every rank), raise alike on every rank when the gradients of
    the losses by the model's outputs (``grads``: the sharded call's and the whole call's) are further apart than
    ``tol`` (:func:`gradient_gap`, agreed) though the values agreed. Not compared: a Hugging Face model's loss given
    ``labels=`` (``consumed``; computed inside the call, it has no gradient there) and tolerances above
    :data:`GRADIENT_TOLERANCE_LIMIT`."""
    if not graded:
        return
    sharded = None if consumed or tol > GRADIENT_TOLERANCE_LIMIT else grads[0]
    gap = gradient_gap(sharded, grads[1], layout, group)
    if gap is None or gap <= tol:
        return
    raise ValueError(
        f"the {hook}'s loss equals one process's on {where}, but its gradient does not (by the model's outputs, "
        f"{gap:.3g} of its largest entry apart): the step scales a term by a value it takes from its slice without a "
        f"gradient, such as the term's own value (ce / ce.detach(), a loss normalised by its magnitude), or a "
        f"weight from a mean over the tokens (.detach(), .item(), torch.no_grad()). Each rank then scales its "
        f"gradient by its own slice's value, where one process scales by the whole batch's. Take such values from "
        f"the whole batch (computed in the data, a value of the batch), or leave the term unscaled. "
        f"ParaDySeStrategy(check_step=False) turns this check off"
    )


def _with_leaves(step_fn: Callable[..., Any], state: Any, *args: Any, **kwargs: Any) -> Any:
    """``step_fn`` called as a training step runs: its own code with gradients on, the model's calls without, their
    outputs leaves (:mod:`~lightning_paradyse.runtime.output_leaves`; none kept)."""
    with collecting(state, OutputLeaves()):
        return step_fn(*args, **kwargs)


def _afresh(kept: KeptState, streams: Any, device: torch.device) -> None:
    """Before another of the check's calls: the module's state put back (:func:`kept_attributes`; a counter the step
    advances reads the same in every call) and the random streams."""
    kept()
    set_rng_state(streams, device)


def _pair(local: torch.Tensor | None, total: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    return None if local is None or total is None else (local, total)


def differing_state(sharded: dict[str, Any], whole: dict[str, Any], tol: float, group: Group) -> list[str] | None:
    """The names whose value after the sharded call (:meth:`KeptState.values`) differs from the value after the whole
    call (a counter of the slice's tokens, a running mean of the rank's own loss), on this rank; ``[]`` where only
    another rank found one; ``None`` where none did (one all-reduce over ``group``: every rank answers alike)."""
    found = []
    for name, mine in sharded.items():
        theirs = whole.get(name, _MISSING)
        if theirs is _MISSING:
            continue
        if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
            a, b = mine.double().cpu(), theirs.double().cpu()
            if a.shape != b.shape or not torch.allclose(a, b, rtol=tol, atol=0.0, equal_nan=True):
                found.append(name)
        elif mine != theirs:
            found.append(name)
    flag = torch.tensor([1.0 if found else 0.0], dtype=torch.float64, device=collective_device(group))
    if group_size(group) > 1 and float(all_reduce_sum(flag, group)) == 0.0:  # [1] summed over the ranks
        return None
    return found if found or group_size(group) > 1 else None


def refuse_differing_state(found: list[str] | None, hook: str) -> None:
    """Raise (on every rank: ``found`` is agreed, :func:`differing_state`) naming what the step keeps across steps from
    the tokens of its slice."""
    if found is None:
        return
    what = ", ".join(f"self.{name}" for name in found) or "state it keeps (on another rank)"
    raise ValueError(
        f"the {hook} keeps {what} from the tokens of its slice: after its call on this rank's slice of the check's "
        "tokens it holds another value than after one process's call on them all (a count of the slice's tokens, a "
        "running mean of this rank's own loss; a buffer is checkpointed too). Compute it in on_train_batch_end, which "
        "sees the whole batch and the global loss (outputs['loss']), or in the data; "
        "ParaDySeStrategy(check_step=False) skips the check (docs/training-step.md)."
    )


def longer_probe(size: int, m: int, s: int) -> int | None:
    """How many of a batch of ``s`` positions the check runs again where the step split the sequence into chunks of
    ``size`` (the largest the ranks saw: :func:`agree_cuts`) so long that the ``m`` tokens it ran held at most two
    per row, perhaps of equal counts of targets: a loss averaged per chunk then equals one process's there, but not
    on the batch, whose last chunk is shorter. ``1.5 size + 1`` tokens hold a chunk and half of one, where every
    rank's slice holds one; ``None`` where the batch's rows hold one chunk."""
    longer = min(s, size + size // 2 + 1)
    if size == 0 or size >= s or m > 2 * size + 1 or longer == m:
        return None
    return longer


def whole_plan(plan: Plan) -> Plan:
    """The plan of the whole run: the step's own modes on a group of one, where each computes the plain op (so each
    op keeps a mode it takes: a mixture of experts run whole takes no ``tp_sp``), without recomputation (the check
    keeps no gradient)."""
    return Plan(tuple(LayerPlan(OpPlan(layer.attention.mode), OpPlan(layer.mlp.mode)) for layer in plan.layers))


def whole_weights_fit(module: torch.nn.Module, group: Group, device: torch.device, world: int, copies: int) -> bool:
    """Whether every rank can hold ``copies`` times every weight (CUDA: that much free on every rank, agreed by one
    all-reduce; CPU: yes)."""
    if device.type != "cuda":
        return True
    item = next(module.parameters()).element_size()
    need = copies * item * sum(whole_sizes(module).values())
    free = torch.tensor([float(gpu_free_bytes(device) >= need)], device=collective_device(group))
    return float(all_reduce_sum(free, group)) == float(world)  # [1] summed over the group


__all__ = [
    "AGAIN_EVERY",
    "ATTEMPTS",
    "LOSS_AS_LOGGED",
    "LOW_PRECISION_TOLERANCE",
    "STEP_CHECK_TOLERANCE",
    "SUMMED_SLOTS",
    "TF32_TOLERANCE",
    "UNPLANTED_KEYS",
    "KeptState",
    "LogDifference",
    "LoggedValues",
    "LossCalls",
    "RowsRuns",
    "StepCheck",
    "agree_cuts",
    "backed_loss",
    "check_rows_losses",
    "check_rows_runs",
    "check_step_losses",
    "cuts_refusal",
    "described_columns",
    "differing_logs",
    "differing_metrics",
    "differing_state",
    "every_ranks",
    "longer_probe",
    "manual_steps_held",
    "metric_values",
    "model_config",
    "outer_metrics",
    "pad_ids",
    "planted_probe",
    "probe_batch",
    "probe_columns",
    "recorded_logs",
    "refuse_differing_state",
    "reset_metrics",
    "rows_runs",
    "rows_with_target",
    "sequence_index",
    "sequence_narrow",
    "sequence_split",
    "side_effects_undone",
    "step_check_tolerance",
    "summed_over_ranks",
    "vocabulary",
    "warn_differing_logs",
    "warn_differing_metrics",
    "whole_plan",
    "whole_weights_fit",
]
