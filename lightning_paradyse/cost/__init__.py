"""Analytic cost models (no measurement, no Lightning): what a plan costs in time and memory.

* :mod:`~lightning_paradyse.cost.dims`: the model's dimensions (from a config or a parallelized module).
* :mod:`~lightning_paradyse.cost.memory`: bytes saved for backward and transient peaks per mode and op.
* :mod:`~lightning_paradyse.cost.traffic` and :mod:`~lightning_paradyse.cost.time`: collectives per
  phase (summing to :mod:`lightning_paradyse.modes.volume`), FLOPs, rates, alpha-beta, overlap.
* :mod:`~lightning_paradyse.cost.model`: :class:`~lightning_paradyse.cost.model.CostModel`, the per-op costs and
  the step timeline.
* :mod:`~lightning_paradyse.cost.cluster`: cluster description files (a machine described, not measured).

Measuring a machine is :mod:`lightning_paradyse.calibration`; planning on the model is
:mod:`lightning_paradyse.planning`.
"""
