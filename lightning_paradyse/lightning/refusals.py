"""What the strategy refuses outside a step, each on every rank and naming the fix: Lightning callbacks it cannot run
(weight averaging, the learning-rate finder, pruning), an ``AveragedModel`` the module builds before the fit, a Hugging
Face head that pools one position of each row, NEFTune's noise, packed documents (``doc_ids``) that a module does not
say it keeps apart, a ``backward`` override that backs another tensor than the loss, an ``all_gather`` of tensors
whose shapes differ between the ranks, and a hook that changes a gradient in a way PyTorch refuses on the strategy's
gradients (PyTorch's own error, explained)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import lightning.pytorch.callbacks as pl_callbacks
import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from lightning_paradyse.distributed.comm import all_gather_rows, collective_device
from lightning_paradyse.distributed.devices import to_device

AVERAGING_CALLBACKS = tuple(
    c for c in (getattr(pl_callbacks, n, None) for n in ("StochasticWeightAveraging", "WeightAveraging")) if c
)
"""Lightning's weight-averaging callbacks (``EMAWeightAveraging`` is a ``WeightAveraging``)."""


def refuse_callbacks(callbacks: Sequence[Any]) -> None:
    """Lightning's weight-averaging callbacks copy the module when the fit is set up, before the strategy shards it,
    and then average the copy's whole parameters with this rank's shards, pairing them by position (a crash on a
    shape mismatch, or a wrong average where shapes happen to agree): refused, naming the fix. So is the learning-rate
    finder (``Tuner.lr_find``): it ends the fit from inside with an exception of Lightning's own, which the spawned
    workers report as a failure without a message (under ``ddp_spawn`` too). So is ``ModelPruning``: it prunes the
    ``nn.Linear`` layers it finds, and the blocks' projections are rewritten into shards it does not find (silent
    until 2026-12-02, probe 19: one process pruned 51% of those weights, the strategy none)."""
    finders = [type(c).__name__ for c in callbacks if isinstance(c, pl_callbacks.LearningRateFinder)]
    if finders:
        raise ValueError(
            f"{finders[0]} (Tuner.lr_find) is not supported with ParaDySeStrategy: it ends the fit from inside, which "
            "the strategy's worker processes cannot report; find the learning rate with a plain Trainer(devices=1) "
            "on the same module (the strategy changes no result of a step), then set it for the fit"
        )
    pruning = [type(c).__name__ for c in callbacks if isinstance(c, pl_callbacks.ModelPruning)]
    if pruning:
        raise ValueError(
            f"{pruning[0]} prunes the module's nn.Linear and nn.Conv layers with torch.nn.utils.prune, which "
            "ParaDySeStrategy has rewritten inside the blocks: the blocks' projections would not be pruned (their "
            "shards are no such layers) while one process prunes them. Remove the callback, or prune with a plain "
            "Trainer (the strategy's checkpoints hold the single-process model's state dict)"
        )
    found = [type(c).__name__ for c in callbacks if isinstance(c, AVERAGING_CALLBACKS)]
    if found:
        raise ValueError(
            f"{found[0]} averages a copy of the whole module made before ParaDySeStrategy shards it, which it cannot "
            f"pair with the shards this rank trains; remove the callback and average the plain weights our "
            f"checkpoints hold (their state dict is the single-process model's), or keep a running average inside "
            f"the LightningModule over self.named_parameters() (each rank averages its own shards) and save it whole "
            f"with lightning_paradyse.gather_like_params in on_save_checkpoint (shard_like_params to load it)"
        )


def refuse_averaged_models(module: nn.Module) -> None:
    """A ``torch.optim.swa_utils.AveragedModel`` the module builds in ``__init__`` (an EMA of ``self.model``) holds a
    whole copy of the model made before the strategy shards it; its ``update_parameters`` then pairs those whole
    weights with this rank's shards (a crash on a shape mismatch): refused at the fit's setup, naming the fix."""
    found = [name for name, sub in module.named_modules() if isinstance(sub, AveragedModel)]
    if found:
        raise ValueError(
            f"{type(module).__name__}.{found[0]} is an AveragedModel made before ParaDySeStrategy shards the model: "
            f"its whole copy cannot be paired with the shards this rank trains. Keep the running average over "
            f"self.named_parameters() in the LightningModule instead (a dict of tensors updated under torch.no_grad(), "
            f"each rank averaging its own shards; made in on_fit_start) and save it whole with "
            f"lightning_paradyse.gather_like_params in on_save_checkpoint (shard_like_params to load it)"
        )


POOLING_HEADS = (
    "ForSequenceClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
    "ForNextSentencePrediction",
    "DoubleHeadsModel",
)
"""The endings of Hugging Face model classes whose head reads one position of each row (the last real token, or the
first) or scores the positions against each other (answer spans): across the tokens of the sequence."""


def refuse_pooling_heads(module: nn.Module) -> None:
    """A Hugging Face model whose head pools one position of each row (sequence classification, multiple choice, next
    sentence prediction) or compares the positions of a row (question answering's span start and end) computes across
    the sequence, which the strategy splits over the ranks: refused when the fit, validation or test is set up (a
    rank would pool the last real token of its own slice: logged metrics off, silently, where the step returns no
    loss). Predictions run each batch whole on every rank: ``trainer.predict`` is left to run."""
    found = [
        (name, type(sub).__name__)
        for name, sub in module.named_modules()
        if type(sub).__module__.startswith("transformers.") and type(sub).__name__.endswith(POOLING_HEADS)
    ]
    if found:
        name, cls = found[0]
        raise ValueError(
            f"{type(module).__name__}.{name} is a {cls}: its head reads one position of each row (or compares a row's "
            f"positions), and ParaDySeStrategy hands each rank a slice of every row's sequence, so no rank holds what "
            f"the head reads. Train it with a strategy that keeps each row whole (DDP, FSDP); ParaDySeStrategy trains "
            f"losses over the tokens (a causal or masked language model, token classification). trainer.predict "
            f"with ParaDySeStrategy runs each batch whole and is exact"
        )


def refuse_encoder_decoders(module: nn.Module) -> None:
    """An encoder-decoder (a module holding an ``encoder`` and a ``decoder``: a Hugging Face model whose
    ``config.is_encoder_decoder``, such as T5 or BART, or PyTorch's ``nn.Transformer``) runs two sequences of their
    own lengths, and its decoder's cross-attention reads the encoder's whole output: under the strategy each rank
    holds a slice of both, so no rank holds what the cross-attention reads. Refused when the fit, validation or test
    is set up, whichever blocks are named and whether or not it trains (a frozen one in a validation, or beside a
    trainable head, would run its encoder on whole sequences and hand the decoder this rank's slice of its output).
    An encoder or a decoder alone (``BartModel.get_encoder()``, ``T5EncoderModel``, ``BartForCausalLM``) is left to
    the rewrite. Predictions run each batch whole on every rank: ``trainer.predict`` is left to run (exact for BART
    with its decoder's blocks named; T5's blocks cannot be read)."""
    found = [
        (name, type(sub).__name__)
        for name, sub in module.named_modules()
        if (
            isinstance(sub, nn.Transformer)
            or getattr(getattr(sub, "config", None), "is_encoder_decoder", False) is True
        )
        and isinstance(getattr(sub, "encoder", None), nn.Module)
        and isinstance(getattr(sub, "decoder", None), nn.Module)
    ]
    if found:
        name, cls = found[0]
        where = f"{type(module).__name__}.{name}" if name else type(module).__name__
        raise ValueError(
            f"{where} is an encoder-decoder ({cls}): its decoder's cross-attention reads the encoder's whole output, "
            f"and ParaDySeStrategy hands each rank a slice of every sequence, so no rank holds it. Train it with a "
            f"strategy that keeps each sequence whole (DDP, FSDP); ParaDySeStrategy trains decoder-only and "
            f"encoder-only transformers"
        )


def refuse_neftune(module: nn.Module) -> None:
    """NEFTune (``transformers``' ``activate_neftune``, the noise behind ``neftune_noise_alpha``) scales the noise it
    adds to the embeddings by ``alpha / sqrt(length * hidden)`` of the tensor its hook is handed: under the strategy a
    rank's slice, so the noise is ``sqrt(p)`` times one process's (silently). Refused at the fit's setup."""
    found = [
        name
        for name, sub in module.named_modules()
        if sub.__dict__.get("neftune_noise_alpha") is not None
        or any(getattr(hook, "__name__", "") == "neftune_post_forward_hook" for hook in sub._forward_hooks.values())
    ]
    if found:
        raise ValueError(
            f"{type(module).__name__}.{found[0]} adds NEFTune noise (neftune_noise_alpha): its scale follows the "
            f"length of the sequence the embedding is handed, which under ParaDySeStrategy is this rank's slice, so "
            f"the noise would be sqrt(p) times one process's. Turn NEFTune off for this strategy (transformers' "
            f"deactivate_neftune, or the trainer's neftune_noise_alpha=None)"
        )


_GRAD_VIEW_ERRORS = (
    "A view was created in no_grad mode and is being modified inplace",
    "a leaf Variable that requires grad is being used in an in-place operation",
)
"""PyTorch's errors for a gradient that is a view of a shared buffer changed in place with an operand that requires a
gradient, in grad mode."""


KEEPS_DOCUMENTS_APART = "keeps_documents_apart"
"""The LightningModule attribute that says its step keeps a packed batch's documents apart in one process as the
strategy does (:class:`~lightning_paradyse.lightning.language_model.LanguageModel` sets it)."""


def refuse_joined_documents(module: nn.Module, packed: bool) -> None:
    """A batch with ``doc_ids`` (``packed``) has the strategy's attention keep its documents apart; one process runs
    the module's model over the whole row, documents attending to each other, unless the step runs each document on
    its own there (as ``LanguageModel.logits`` does). Which the step does cannot be read from it, so a module that
    does not say so (``keeps_documents_apart = True``) is refused, naming both fixes (silent until 2026-12-02: 2e-1
    off one process after four steps, probe 17). Raised alike on every rank, before any collective: the batch is the
    same on every rank."""
    if packed and getattr(module, KEEPS_DOCUMENTS_APART, False) is not True:
        raise ValueError(
            f"the batch holds 'doc_ids': ParaDySeStrategy keeps its packed documents apart in attention, but "
            f"{type(module).__name__} does not say that one process does too; run alone, the model attends across the "
            f"documents of the row unless the step runs each document on its own when the model is not parallelized "
            f"(lightning_paradyse.runtime.parallel.run_documents(model, ids, positions, doc_ids) does, as "
            f"LanguageModel.logits does). If it does, say so: set `{KEEPS_DOCUMENTS_APART} = True` on the "
            f"LightningModule; if the documents should "
            f"attend to each other, leave 'doc_ids' out of the batch (or name the key otherwise). See "
            f"docs/training-step.md"
        )


def explain_grad_view_error(err: RuntimeError) -> None:
    """Raise, in place of PyTorch's ``err``, what it means when a hook before the optimizer step raised it (Lightning's
    ``_after_closure`` runs the module's and the callbacks' ``on_before_optimizer_step``); else return."""
    frames, tb = [], err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    if "_after_closure" not in frames or not any(text in str(err) for text in _GRAD_VIEW_ERRORS):
        return
    raise RuntimeError(
        "a hook before the optimizer step changed a gradient in place, in grad mode, with an operand that requires a "
        "gradient (such as p.grad.add_(p, alpha=wd) in on_before_optimizer_step): under ParaDySeStrategy the "
        "gradients are views of one buffer (as DDP's with gradient_as_bucket_view=True and FSDP2's are), which "
        "PyTorch refuses to change that way. Change them under torch.no_grad() (with torch.no_grad(): "
        "p.grad.add_(p, alpha=wd)), which is exact, or use the optimizer's weight_decay"
    ) from err


GATHERED_DIMS = 8
"""Dimensions of a tensor :meth:`ParaDySeStrategy.all_gather` compares over the ranks before gathering it."""


def check_gathered_shapes(tensor: Tensor, group: Any, p: int) -> None:
    """Raise on every rank, before the gather, when the ranks' tensors differ in shape (gloo aborts the processes,
    NCCL hangs): one small all-gather of every rank's shape."""
    dims = list(tensor.shape)[:GATHERED_DIMS]
    header = torch.tensor([tensor.dim(), *dims, *[-1] * (GATHERED_DIMS - len(dims))], dtype=torch.int64)  # [1 + D]
    every = all_gather_rows(to_device(header.view(1, -1), collective_device(group)), [1] * p, group)  # -> [p, 1 + D]
    shapes = [tuple(row[1 : 1 + min(row[0], GATHERED_DIMS)]) for row in every.tolist()]
    if len(set(shapes)) > 1:
        raise ValueError(
            f"all_gather of tensors whose shapes differ between the ranks ({shapes}, rank by rank): under "
            "ParaDySeStrategy each rank holds a slice of every sequence (its own tokens), so values kept per token "
            "differ in length between the ranks. Keep them in a torchmetrics metric (its state is summed over the "
            "ranks when computed: each token counts once), or gather tensors of one shape (e.g. per-batch sums)"
        )


def overrides_backward(module: Any) -> bool:
    """Whether the LightningModule has its own ``backward`` (Lightning's hook, called with the loss to back)."""
    return isinstance(module, pl.LightningModule) and type(module).backward is not pl.LightningModule.backward


@contextlib.contextmanager
def backing_the_loss(loss: Tensor) -> Iterator[None]:
    """Inside a LightningModule's own ``backward`` hook: ``Tensor.backward`` of a tensor other than ``loss`` (the loss
    the strategy weighed, handed to the hook) or one made from it alone (``(loss * 2).backward()``) raises, naming the
    fix. The strategy weighs the loss the step returns into this rank's part of the global loss; a term the hook adds
    (``(loss + 1e-2 * self.aux).backward()``) is this rank's own mean, counted once per rank (silent until 2026-12-02,
    probe 19: 4.8e-2 in the weights)."""
    original = torch.Tensor.backward

    def checked(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        if not _made_from(tensor, loss):
            raise ValueError(
                "the LightningModule's backward hook backs another tensor than the loss it is handed (a term added "
                "there is this rank's own, which ParaDySeStrategy cannot weigh into the global loss): add the term to "
                "the loss the training_step returns, as a mean over the real targets, and back the loss as given"
            )
        return original(tensor, *args, **kwargs)

    torch.Tensor.backward = checked  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.backward = original  # type: ignore[method-assign]


def _made_from(tensor: Tensor, loss: Tensor, depth: int = 16) -> bool:
    """Whether ``tensor`` is ``loss`` or made from it alone by ops on it (each node of its graph down to ``loss``'s
    has one input that needs a gradient: a scaling, a cast, a view)."""
    if tensor is loss:
        return True
    node, target = tensor.grad_fn, loss.grad_fn
    for _ in range(depth):
        if node is None or target is None:
            return False
        if node is target:
            return True
        inputs = [fn for fn, _ in node.next_functions if fn is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


__all__ = [
    "AVERAGING_CALLBACKS",
    "GATHERED_DIMS",
    "backing_the_loss",
    "check_gathered_shapes",
    "explain_grad_view_error",
    "overrides_backward",
    "refuse_callbacks",
]
