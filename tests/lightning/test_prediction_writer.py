"""``DocumentScoreWriter`` (``lightning/prediction_writer.py``): each document's log-likelihood as JSON lines. The
command line's ``predict`` on 2 processes against one is ``tests/exact/test_cli_exact.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_paradyse.data.batching import BatchingConfig, make_dataloader
from lightning_paradyse.data.corpus import write_token_corpus
from lightning_paradyse.lightning.language_model import LanguageModel
from lightning_paradyse.lightning.prediction_writer import DocumentScoreWriter, document_scores


def test_scores_sum_each_documents_real_targets() -> None:
    logprob = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)  # [b, s]
    targets = torch.tensor([[3, 4, -100], [-100, -100, -100]])  # the second row has no target: no line
    (line,) = document_scores(logprob, targets)
    assert line == {"row": 0, "document": 0, "tokens": 2, "logprob": -3.0, "nll": 1.5, "perplexity": math.exp(1.5)}


def test_scores_of_a_packed_row_per_document() -> None:
    logprob = torch.tensor([[-1.0, -3.0, -2.0, -4.0, -6.0]], dtype=torch.float64)  # [1, s]
    targets = torch.tensor([[1, -100, 2, 3, 4]])  # document 0's last token predicts nothing
    doc_ids = torch.tensor([0, 0, 1, 1, 1])  # [s]
    lines = list(document_scores(logprob, targets, doc_ids))
    assert [(d["document"], d["tokens"], d["logprob"]) for d in lines] == [(0, 1, -1.0), (1, 3, -12.0)]
    assert lines[1]["nll"] == 4.0


def test_scores_refuse_predictions_that_are_not_one_per_token() -> None:
    with pytest.raises(ValueError, match="one log-probability per token"):
        list(document_scores(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.int64)))


def test_one_process_writes_every_documents_line(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 128, (n,), generator=gen) for n in (40, 17, 65, 9, 30, 52, 12)]
    corpus = write_token_corpus(tmp_path / "tok", docs, vocab_size=128)
    model = LanguageModel("llama-tiny")
    config = BatchingConfig(max_tokens=128, max_len=64, pack=True, order="natural")
    batches = [b for _, b in zip(range(2), make_dataloader(corpus, config))]  # a loader of its own: one pass each
    writer = DocumentScoreWriter(str(tmp_path / "out"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[writer],
        logger=False,
        enable_progress_bar=False,
        limit_predict_batches=2,
    )
    predictions = trainer.predict(model, make_dataloader(corpus, config))
    lines = [json.loads(line) for line in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    expected = [
        {"dataloader": 0, "batch": i, **d}
        for i, (p, b) in enumerate(zip(predictions, batches))
        for d in document_scores(p, b["targets"], b["doc_ids"])
    ]
    assert lines == expected and len({d["document"] for d in lines}) > 1  # packed: several documents a row
    trainer.predict(model, make_dataloader(corpus, config))  # a second predict starts the file afresh
    assert len((tmp_path / "out" / "predictions.jsonl").read_text().splitlines()) == len(lines)
