"""Lightning's SIGTERM check carried by the step's agreement: a fit stops as under DDP, and a real SIGTERM to rank
0 alone in the middle of a step stops every rank before the next step."""

from __future__ import annotations

import functools
import os
import signal
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.lightning.language_model import LanguageModel
from lightning_paradyse.lightning.sigterm import SigtermFlag
from tests.lightning.test_cycle import rows
from tests.support.dist import free_ports
from tests.support.lightning import quiet_trainer, strategy_environment

SIGNALLED = 2
"""The batch at which the signal arrives."""


class Signal(pl.Callback):
    """SIGTERM on every rank at the end of batch :data:`SIGNALLED` - 1, as Lightning's handler marks it
    (``every``: a preempted job; Lightning's own check at the end of the batch stops each rank), or a real SIGTERM to
    rank 0 alone in the middle of that batch (before its backward: where Lightning's handler broadcasts while the
    other ranks' next collective is another). Records the batches started."""

    def __init__(self, every: bool) -> None:
        self.every = every
        self.started: list[int] = []

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.started.append(i)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if not self.every and trainer.global_step == SIGNALLED - 1 and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler, as the strategy installed it, runs now

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.every and trainer.global_step == SIGNALLED:
            trainer._signal_connector.received_sigterm = True


def worker(rank: int, world: int, ports: tuple[int, ...]) -> dict[str, Any]:
    strategy_environment(rank, world)
    out = {}
    runs = (("paradyse", True), ("ddp", True), ("paradyse", False))
    for port, (name, every) in zip(ports, runs):
        os.environ["MASTER_PORT"] = str(port)
        pl.seed_everything(0, verbose=False)
        strategy: Any = (
            ParaDySeStrategy(timeout=60) if name == "paradyse" else DDPStrategy(timeout=timedelta(seconds=60))
        )
        signalled = Signal(every)
        trainer = quiet_trainer(world, strategy, [signalled], max_steps=SIGNALLED + 2)
        try:
            trainer.fit(LanguageModel("llama-tiny"), DataLoader(rows(SIGNALLED + 2), batch_size=None))
            raised = None
        except SIGTERMException as stopped:
            raised = type(stopped).__name__
        loop, connector = trainer.fit_loop.epoch_loop, trainer._signal_connector
        out[f"{name}-{'every' if every else 'rank0'}"] = {
            "raised": raised,
            "steps": trainer.global_step,
            "started": signalled.started,
            "restored": "_broadcast_sigterm_tensor" not in vars(loop) and "_sigterm_notifier_fn" not in vars(connector),
            "received": trainer.received_sigterm,
        }
    return out


def test_a_preempted_job_stops_where_it_stops_under_ddp() -> None:
    # every rank signalled: each raises at the end of that batch (Lightning's own check, untouched)
    for run in counted():
        assert run["paradyse-every"] == run["ddp-every"], run
        assert run["paradyse-every"]["raised"] == "SIGTERMException" and run["paradyse-every"]["steps"] == SIGNALLED


def test_a_sigterm_to_rank_zero_alone_in_a_step_stops_every_rank_before_the_next_step() -> None:
    # the handler keeps it for the next batch's agreement (no collective of its own, no stop of rank 0 alone at the
    # end of the batch): every rank raises there before the step runs
    for rank, run in enumerate(counted()):
        alone = run["paradyse-rank0"]
        assert alone["raised"] == "SIGTERMException" and alone["steps"] == SIGNALLED, run
        assert alone["started"] == list(range(SIGNALLED + 1)), run
        assert alone["received"] == (rank == 0), run  # Lightning's flag where the signal arrived
        assert alone["restored"], run  # Lightning's own broadcasts back after the fit


@functools.cache
def counted() -> list[dict[str, Any]]:
    return run_distributed(worker, 2, free_ports(3), timeout=240)  # type: ignore[no-any-return]


def test_install_leaves_a_loop_without_lightnings_broadcast_alone() -> None:
    flag = SigtermFlag()
    assert not flag.install(object())
    assert not flag.carried and flag.flag() == 0
    flag.restore()  # nothing installed: nothing to do
