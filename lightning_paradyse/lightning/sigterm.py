"""Lightning's SIGTERM check, carried by the step's agreement instead of collectives of its own.

Lightning tells the ranks of a fit about SIGTERM with two broadcasts from rank 0: its training loop broadcasts
rank 0's "received SIGTERM" flag before every training batch (``_broadcast_sigterm_tensor``: a collective, and on a
GPU a host synchronisation, per step), and its SIGTERM handler broadcasts a 1 from whichever rank the signal reaches
(``_sigterm_notifier_fn``), to pair with the others' next per-step broadcast. That pairing holds only where the
others' next collective is that broadcast; a signal that reaches rank 0 in the middle of a step meets whatever
collective the others run next.

Under :class:`~lightning_paradyse.lightning.strategy.ParaDySeStrategy` every training batch already meets in one
all-gather before any other collective of its step (the agreement on its plan and batch,
:meth:`~lightning_paradyse.lightning.cycle.StepCycle.agree`), so the flag rides there. :class:`SigtermFlag`, for a
fit on several ranks, on this trainer only, from setup to teardown:

* replaces the loop's per-step broadcast with nothing;
* replaces the handler with one that does what Lightning's does (logs it, stops the launcher's processes the first
  time) except the broadcast, and keeps the signal pending, without a collective, for the next agreement;
* raises Lightning's :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` on every rank, after the same
  all-gather, when rank 0's flag is set (pending, or ``trainer.received_sigterm`` set by other code), and marks
  ``trainer.received_sigterm`` on a rank whose signal was pending.

So a fit that receives SIGTERM stops at the start of its next training batch on every rank together, before the
batch's step runs. Where Lightning differs:

* Lightning raises before fetching that batch; here the strategy's batch-start hook raises, after the callbacks'
  and the module's ``on_train_batch_start`` of that batch (their ``on_train_batch_end`` does not run).
* A rank that received the signal does not raise on its own at the end of the batch it was in (Lightning's own
  check there reads ``trainer.received_sigterm``, which the pending signal leaves unset): it would leave the others
  waiting in the next agreement.
* A signal during the fit's last training batch, or during validation, is acted on at the next training batch, if
  any; otherwise the fit ends normally and ``trainer.received_sigterm`` is set at teardown.
* A training batch the loader yields as ``None`` reaches no strategy hook: the flag is read at the next one.

Where Lightning has neither method by these names (another version), nothing is replaced and its own broadcasts
run.
"""

from __future__ import annotations

import logging
from types import FrameType
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

_BROADCAST = "_broadcast_sigterm_tensor"
"""The training loop's per-step broadcast of rank 0's flag."""
_NOTIFIER = "_sigterm_notifier_fn"
"""The signal connector's SIGTERM handler (read when Lightning registers its handlers, after the strategy's setup)."""


def _carried() -> None:
    """The loop's broadcast while the flag rides the step's agreement: nothing to do here."""


class SigtermFlag:
    """Rank 0's SIGTERM flag on the step's agreement (see the module docstring). One per strategy; per fit state."""

    def __init__(self) -> None:
        self._loop: Any = None
        self._connector: Any = None
        self._pending = False

    @property
    def carried(self) -> bool:
        """Whether the agreement carries the flag (Lightning's broadcasts are replaced)."""
        return self._loop is not None

    def install(self, trainer: Any) -> bool:
        """Replace the broadcasts of ``trainer`` (a fit on several ranks; before Lightning registers its signal
        handlers); returns whether it did."""
        self.restore()
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        connector = getattr(trainer, "_signal_connector", None)
        if not (
            callable(getattr(type(loop), _BROADCAST, None)) and callable(getattr(type(connector), _NOTIFIER, None))
        ):
            return False
        setattr(loop, _BROADCAST, _carried)  # instance attributes: this trainer's only
        setattr(connector, _NOTIFIER, self._notifier(connector, trainer))
        self._loop, self._connector, self._pending = loop, connector, False
        return True

    def _notifier(self, connector: Any, trainer: Any) -> Any:
        """Lightning's SIGTERM handler without its broadcast: the signal kept pending for the next agreement (after
        :meth:`restore`, during the fit's teardown, Lightning's flag is set directly)."""

        def notified(signum: int, frame: FrameType | None) -> None:
            log.info(f"[rank {trainer.local_rank}] Received SIGTERM: {signum}")
            first = not (self._pending or connector.received_sigterm)
            if first and trainer.strategy.launcher is not None:
                trainer.strategy.launcher.kill(signum)  # as Lightning: the processes the launcher started
            if self._connector is connector:
                self._pending = True
            else:
                connector.received_sigterm = True

        return notified

    def flag(self) -> int:
        """This rank's flag (1: a SIGTERM is pending, or the trainer says it received one), sent with the
        agreement."""
        return int(self._pending or bool(getattr(self._connector, "received_sigterm", False)))

    def check(self, rank_zero_flag: int) -> None:
        """Raise :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` when rank 0's flag is set (called on
        every rank with the same value, after the agreement)."""
        if rank_zero_flag:
            if self._pending:
                self._connector.received_sigterm = True
            raise SIGTERMException()

    def restore(self) -> None:
        """Lightning's own broadcasts again (teardown); a pending signal becomes ``trainer.received_sigterm``."""
        loop, connector = self._loop, self._connector
        if loop is not None and vars(loop).get(_BROADCAST) is _carried:
            delattr(loop, _BROADCAST)
        if connector is not None:
            vars(connector).pop(_NOTIFIER, None)
            if self._pending:
                connector.received_sigterm = True
        self._loop, self._connector, self._pending = None, None, False


__all__ = ["SigtermFlag"]
