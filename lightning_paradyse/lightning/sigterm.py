"""Lightning's SIGTERM check, carried by the step's agreement instead of a collective of its own.

Before every training batch, Lightning's training loop broadcasts rank 0's "received SIGTERM" flag from rank 0
(``_broadcast_sigterm_tensor``): one collective, and on a GPU one host synchronisation, per step, beside the step's
own. Under :class:`~lightning_paradyse.lightning.strategy.ParaDySeStrategy` every training batch already meets in
one all-gather before any other collective of its step (the agreement on its plan and batch,
:meth:`~lightning_paradyse.lightning.cycle.StepCycle.agree`), so the flag rides there: :class:`SigtermFlag`
replaces the loop's broadcast, on this trainer's loop only, from setup to teardown.

The outcome is Lightning's: when rank 0 received SIGTERM, every rank raises
:class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` before the batch's step runs (all of them after the
same all-gather, so no barrier is needed), and the fit stops as Lightning stops it. The one difference is where:
during the strategy's ``on_train_batch_start``, after the callbacks' and the module's hooks of that batch, where
Lightning raises before fetching it. Where Lightning has no such method (another version), nothing is replaced and
its own broadcast runs.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

_METHOD = "_broadcast_sigterm_tensor"


def _carried() -> None:
    """The loop's broadcast while the flag rides the step's agreement: nothing to do here."""


class SigtermFlag:
    """Rank 0's SIGTERM flag on the step's agreement (see the module docstring). One per strategy; per fit state."""

    def __init__(self) -> None:
        self._loop: Any = None
        self._trainer: Any = None

    @property
    def carried(self) -> bool:
        """Whether the agreement carries the flag (the loop's broadcast is replaced)."""
        return self._loop is not None

    def install(self, trainer: Any) -> bool:
        """Replace the broadcast of ``trainer``'s training loop (a fit on several ranks); returns whether it did."""
        self.restore()
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if loop is None or not callable(getattr(type(loop), _METHOD, None)):
            return False
        setattr(loop, _METHOD, _carried)  # an instance attribute: this trainer's loop only
        self._loop, self._trainer = loop, trainer
        return True

    def flag(self) -> int:
        """This rank's flag (1: the trainer received SIGTERM), sent with the agreement."""
        return int(bool(getattr(self._trainer, "received_sigterm", False)))

    def check(self, rank_zero_flag: int) -> None:
        """Raise :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException` when rank 0 received SIGTERM
        (called on every rank with the same value, after the agreement)."""
        if rank_zero_flag:
            raise SIGTERMException()

    def restore(self) -> None:
        """The loop's own broadcast again (teardown)."""
        if self._loop is not None and vars(self._loop).get(_METHOD) is _carried:
            delattr(self._loop, _METHOD)
        self._loop, self._trainer = None, None


__all__ = ["SigtermFlag"]
