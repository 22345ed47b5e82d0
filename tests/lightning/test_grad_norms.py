"""Lightning's ``grad_norm`` under the strategy (lightning/grad_norms.py).

Against one plain process in float64 on 2 ranks: the ``lightning-grad-norm-*`` cases of ``tests/exact`` (the whole
module, a layer with the infinity norm, a Hugging Face model with tied embeddings; planned ``auto`` and fixed) and
``lora-grad-norm``. Here, in one process: what is bound where and put back, and the norms a fit sees.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import lightning.pytorch as pl
import lightning.pytorch.utilities as pl_utilities
import lightning.pytorch.utilities.grads as pl_grads
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.lightning import grad_norms
from lightning_paradyse.lightning.grad_norms import GradNormInterception
from lightning_paradyse.models import build_model
from tests.support.lightning import quiet_trainer

ORIGINAL = pl_grads.grad_norm


class NormsLM(pl.LightningModule):
    """Logs nothing; keeps what ``grad_norm`` (bound at this file's top, as users import it) returned each step."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build_model("llama-tiny")
        self.seen: list[tuple[dict[str, Tensor], float]] = []

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self.model(batch["input_ids"])  # [b, s, vocab]
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        whole = torch.cat([g.flatten() for g in grads]).double()  # one rank: its shards are the whole weights
        direct = float(torch.linalg.vector_norm(whole))
        self.seen.append((grad_norm(self, norm_type=2), direct))

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _batches() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 64, (2, 33), generator=g) for _ in range(2)]
    data = [{"input_ids": r[:, :-1], "targets": r[:, 1:]} for r in rows]
    return DataLoader(data, batch_size=None)


def test_a_fit_sees_the_plain_names_and_lightning_gets_its_function_back() -> None:
    """In a fit the user's top-level ``grad_norm`` lists the plain model's parameters (``attn.q.weight``, in its
    order) and the total of the whole gradients; after it every binding is Lightning's own again."""
    plain_names = [n for n, _ in build_model("llama-tiny").named_parameters()]
    module = NormsLM()
    pl.seed_everything(0, verbose=False)
    trainer = quiet_trainer(1, ParaDySeStrategy(plan="tp_sp", timeout=60), [], max_steps=2)
    trainer.fit(module, train_dataloaders=_batches())
    assert len(module.seen) == 2
    for norms, direct in module.seen:
        assert list(norms) == [f"grad_2.0_norm/model.{n}" for n in plain_names] + ["grad_2.0_norm_total"]
        assert float(norms["grad_2.0_norm_total"]) == pytest.approx(direct, rel=1e-6)
    assert grad_norm is ORIGINAL and pl_utilities.grad_norm is ORIGINAL and pl_grads.grad_norm is ORIGINAL
    assert globals()["grad_norm"] is ORIGINAL


def test_start_binds_every_reference_and_stop_puts_them_back() -> None:
    """Every name bound to Lightning's function in a loaded module is replaced, the interception's own reference is
    not, and a name rebound since the start is left alone (this file's own ``ORIGINAL`` is replaced too: a local
    reference is not)."""
    original = ORIGINAL
    user = types.ModuleType("a_users_helpers")
    user.grad_norm = ORIGINAL  # type: ignore[attr-defined]
    user.norms = ORIGINAL  # type: ignore[attr-defined]
    user.other = ORIGINAL  # type: ignore[attr-defined]
    sys.modules[user.__name__] = user
    interception = GradNormInterception(lambda: None, lambda: None, lambda: None, set)
    try:
        interception.start()
        assert user.grad_norm == interception.grad_norm and user.norms == interception.grad_norm  # type: ignore[attr-defined]
        assert pl_utilities.grad_norm == interception.grad_norm and pl_grads.grad_norm == interception.grad_norm
        assert grad_norms._ORIGINAL is original and interception.grad_norm == ORIGINAL
        user.other = len  # type: ignore[attr-defined]
    finally:
        interception.stop()
        del sys.modules[user.__name__]
    assert user.grad_norm is ORIGINAL and user.norms is ORIGINAL and user.other is len  # type: ignore[attr-defined]
    assert pl_utilities.grad_norm is ORIGINAL and pl_grads.grad_norm is ORIGINAL


def test_a_module_without_shards_gets_lightnings_own_norms() -> None:
    layer = nn.Linear(3, 2)
    layer(torch.ones(4, 3)).sum().backward()
    interception = GradNormInterception(lambda: layer, lambda: None, lambda: None, set)
    ours, theirs = interception.grad_norm(layer, "inf"), ORIGINAL(layer, "inf")
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with pytest.raises(ValueError, match="must be a positive number"):
        interception.grad_norm(layer, 0)


def test_start_binds_the_globals_of_the_users_classes_functions() -> None:
    """A script the spawn launcher runs again in a worker (as ``__mp_main__``, through ``runpy``) is no loaded
    module: its functions' globals are a dictionary of their own, reached through the LightningModule's class."""
    script: dict[str, Any] = {"__name__": "__mp_main__", "grad_norm": ORIGINAL}
    exec("def on_before_optimizer_step(self, optimizer):\n    return grad_norm(self, 2)\n", script)
    user = type("ScriptLM", (pl.LightningModule,), {"on_before_optimizer_step": script["on_before_optimizer_step"]})
    interception = GradNormInterception(lambda: None, lambda: None, lambda: None, set)
    try:
        interception.start([user()])
        assert script["grad_norm"] == interception.grad_norm
    finally:
        interception.stop()
    assert script["grad_norm"] is pl_grads.grad_norm
