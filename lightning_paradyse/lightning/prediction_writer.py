"""``python cli.py predict``'s output: each document's log-likelihood under the model, one JSON line per document.

:meth:`~lightning_paradyse.lightning.language_model.LanguageModel.predict_step` returns each token's log-probability
of its target, ``[b, s]`` (0 where the target is ``-100``). :class:`DocumentScoreWriter` sums it per document (a row,
or each document of a packed row, by the batch's ``doc_ids``) and appends one line per document to
``<output_dir>/predictions.jsonl``::

    {"dataloader": 0, "batch": 3, "row": 1, "document": 0, "tokens": 412, "logprob": -1203.5,
     "nll": 2.921, "perplexity": 18.56}

``tokens`` counts the real targets, ``logprob`` is their summed log-probability, ``nll = -logprob / tokens`` (nats
per token) and ``perplexity = exp(nll)`` (``null`` beyond a float64): what a perplexity filter of a corpus reads. A
document without a target writes no line. The numbers are written as Python prints them (``repr``), so a float64
run's values read back exactly.

Who writes: under :class:`~lightning_paradyse.lightning.strategy.ParaDySeStrategy` every rank predicts every batch
whole (:mod:`~lightning_paradyse.lightning.predict`), so rank 0 alone writes ``predictions.jsonl``; under a strategy
that shares the batches out (DDP), each rank writes its own share to ``predictions.rank<r>.jsonl`` (one process:
``predictions.jsonl``). Every ``trainer.predict`` starts its file afresh.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor
from typing_extensions import override

from lightning_paradyse.lightning.strategy import ParaDySeStrategy
from lightning_paradyse.runtime.slicing import IGNORE_INDEX

FILENAME = "predictions.jsonl"


class DocumentScoreWriter(BasePredictionWriter):
    """Each document's summed log-probability, token count, mean negative log-likelihood and perplexity, as JSON
    lines (module docstring), from a predict step that returns each token's log-probability of its target ``[b, s]``
    and a batch holding ``targets`` ``[b, s]`` (``-100``: no target) and, for packed rows, ``doc_ids`` ``[s]``.

    Args:
        output_dir: The folder of ``predictions.jsonl`` (``None``: ``<trainer.default_root_dir>/predictions``).
    """

    writes_one_copy = True
    """Writes once under ParaDySeStrategy, where every rank holds every prediction (the strategy's warning about
    prediction writers is not for it)."""

    def __init__(self, output_dir: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = output_dir
        self.path: str | None = None
        """The file this rank writes during ``trainer.predict`` (``None``: this rank writes nothing)."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "predict":
            return
        whole = isinstance(trainer.strategy, ParaDySeStrategy)  # every rank holds every batch's predictions
        if whole and trainer.global_rank != 0:
            self.path = None
            return
        folder = self.output_dir or os.path.join(trainer.default_root_dir, "predictions")
        name = FILENAME if whole or trainer.world_size == 1 else f"predictions.rank{trainer.global_rank}.jsonl"
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, name)
        with open(self.path, "w", encoding="utf-8"):
            pass  # a fresh file for this trainer.predict

    @override
    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.path is None:
            return
        if not isinstance(prediction, Tensor) or not isinstance(batch, Mapping) or "targets" not in batch:
            raise TypeError(
                "DocumentScoreWriter needs a predict step that returns each token's log-probability of its target "
                "[b, s] and batches holding 'targets' [b, s] (LanguageModel's); write other predictions with a "
                "BasePredictionWriter of your own"
            )
        doc_ids = batch.get("doc_ids")
        with open(self.path, "a", encoding="utf-8") as out:
            for line in document_scores(prediction, batch["targets"], doc_ids):
                out.write(json.dumps({"dataloader": dataloader_idx, "batch": batch_idx, **line}) + "\n")


def document_scores(logprob: Tensor, targets: Tensor, doc_ids: Tensor | None = None) -> Iterator[dict[str, Any]]:
    """Per document with a real target, in row then document order: ``row``, ``document`` (its index in a packed
    row, by ``doc_ids`` ``[s]``; 0 otherwise), ``tokens``, ``logprob`` (the sum), ``nll`` and ``perplexity``.

    ``logprob``: ``[b, s]`` each token's log-probability of its target; ``targets``: ``[b, s]`` (``-100``: none)."""
    if logprob.shape != targets.shape:
        raise ValueError(
            f"DocumentScoreWriter: the predictions' shape {tuple(logprob.shape)} is not the targets' "
            f"{tuple(targets.shape)}: the predict step must return one log-probability per token"
        )
    values = logprob.detach().to("cpu", torch.float64)  # [b, s]: summed in float64 on the host
    real = targets.detach().cpu() != IGNORE_INDEX  # [b, s]
    docs = None if doc_ids is None else doc_ids.detach().cpu().reshape(-1)  # [s]
    for row in range(values.shape[0]):
        ids = torch.zeros(values.shape[1], dtype=torch.int64) if docs is None else docs  # [s]
        for document in torch.unique(ids).tolist():
            keep = real[row] & (ids == document)  # [s]
            tokens = int(keep.sum())
            if tokens == 0:
                continue
            total = float(values[row][keep].sum())
            nll = -total / tokens
            yield {
                "row": row,
                "document": int(document),
                "tokens": tokens,
                "logprob": total,
                "nll": nll,
                "perplexity": math.exp(nll) if nll < 700 else None,  # None: beyond a float64
            }


__all__ = ["FILENAME", "DocumentScoreWriter", "document_scores"]
