"""LanguageModel: an ordinary LightningModule around a reference model, for the command line and examples.

It computes the mean token cross-entropy of the tokens it is given (targets are shifted in the data, -100 marks
tokens without a target). Under ``ParaDySeStrategy`` the step sees this rank's slice of the sequence and the strategy
turns the returned loss into the global one; the module logs the loss the step *returned* (``outputs`` of the
batch-end hooks), which is therefore the exact single-process loss on every rank. One thing it asks: whether its
model was rewritten, so that a packed batch's documents attend only within themselves either way (:meth:`logits`).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_paradyse.models import build_model
from lightning_paradyse.runtime import parallel


class LanguageModel(pl.LightningModule):
    """A causal language model trained with mean token cross-entropy and AdamW.

    Args:
        model: Name of a reference model config (see ``lightning_paradyse.models.CONFIGS``).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        hf_config: Instead of ``model``, a Hugging Face causal LM built from its config with random weights (no
            download): ``{"class": "LlamaConfig", "hidden_size": 96, ...}``, the config class of ``transformers``
            and its fields; ``attn_implementation`` (default ``"sdpa"``) is passed to the model.

    Example::

        module = LanguageModel("llama-tiny", lr=3e-3)
        module = LanguageModel(hf_config={"class": "LlamaConfig", "hidden_size": 96, "num_hidden_layers": 2})
    """

    def __init__(
        self,
        model: str = "llama-tiny",
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        hf_config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._hf = hf_config is not None
        self.model: Any = build_model(model) if hf_config is None else build_hf_model(hf_config)
        self.lr = lr
        self.weight_decay = weight_decay
        self.last_loss: float | None = None

    @property
    def vocab_size(self) -> int:
        """Token ids the model accepts."""
        return int(self.model.config.vocab_size)

    @override
    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """Logits ``[b, s, vocab]`` of token ids ``[b, s]`` at ``positions`` ``[s]`` (default ``0..s-1``)."""
        if self._hf:
            if positions is not None:  # packed documents: HF's attention would cross the documents' borders
                raise ValueError(
                    "LanguageModel(hf_config=...) does not train packed batches (documents with their own positions "
                    "in one sequence): set data.pack=false, or use a reference model (model=...)"
                )
            return self.model(input_ids=tokens).logits  # type: ignore[no-any-return]
        return self.model(tokens, positions)  # type: ignore[no-any-return]

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        """Mean cross-entropy over the real targets of the tokens in ``batch`` (packed batches carry positions)."""
        logits = self.logits(batch)  # [b, s, vocab]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 up to float32, float64 kept
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100)

    keeps_documents_apart = True
    """A packed batch's documents attend only within themselves here in one process too (:meth:`logits`): the
    strategy, which keeps them apart, trains it exactly (it refuses ``doc_ids`` for a module that does not say so)."""

    def logits(self, batch: dict[str, Tensor]) -> Tensor:
        """Logits ``[b, s, vocab]`` of ``batch``. A packed batch (``doc_ids``: ``data.pack=true``) is one sequence
        whose documents attend only within themselves: under ``ParaDySeStrategy`` the rewritten attention keeps them
        apart; elsewhere (one device, DDP) each document runs on its own here, which is the same."""
        doc_ids = batch.get("doc_ids")
        if doc_ids is None or self._hf:  # a Hugging Face model refuses packed batches (forward)
            return self(batch["input_ids"], batch.get("positions"))  # type: ignore[no-any-return]
        return parallel.run_documents(self.model, batch["input_ids"], batch["positions"], doc_ids)

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    @override
    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    @override
    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Each token's log-probability of its target, ``[b, s]`` (0 where the target is ``-100``): the scores a
        perplexity filter reads (``python cli.py predict``)."""
        logits = self.logits(batch)  # [b, s, vocab]
        logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
        targets = batch["targets"]  # [b, s]
        picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [b, s, vocab] -> [b, s]
        return torch.where(targets != -100, picked, torch.zeros_like(picked))

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if isinstance(outputs, dict) and outputs.get("skipped"):  # no plan fit the budget: nothing was trained
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.last_loss = float(loss)
        self.log("train_loss", loss, prog_bar=True, batch_size=_batch_size(batch))

    @override
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_loss", outputs, prog_bar=True, batch_size=_batch_size(batch), sync_dist=True)

    @override
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("test_loss", outputs, batch_size=_batch_size(batch), sync_dist=True)

    @override
    def on_train_end(self) -> None:
        if self.last_loss is not None:
            rank_zero_info(f"final loss {self.last_loss:.4f} after {self.trainer.global_step} steps")

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def build_hf_model(spec: dict[str, Any]) -> torch.nn.Module:
    """A ``transformers`` causal LM with random weights from ``{"class": <config class>, **fields}``."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError("LanguageModel(hf_config=...) needs transformers: pip install -e '.[hf]'") from err
    fields = dict(spec)
    name = fields.pop("class", None)
    attn = fields.pop("attn_implementation", "sdpa")
    config_class = getattr(transformers, str(name), None) if name is not None else None
    if not (isinstance(config_class, type) and issubclass(config_class, transformers.PretrainedConfig)):
        raise ValueError(
            f"LanguageModel(hf_config={spec!r}): 'class' must name a config class of transformers, e.g. "
            f"'LlamaConfig', got {name!r}"
        )
    config = config_class(**fields)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)  # type: ignore[no-any-return]


def _batch_size(batch: Any) -> int:
    return int(batch["input_ids"].shape[0]) if isinstance(batch, dict) else 1


__all__ = ["LanguageModel", "build_hf_model"]
