"""The cost model and the exact planner, apart from any Lightning code.

* :mod:`~lightning_paradyse.cost.dims`: the model's dimensions (from a config or a parallelized module).
* :mod:`~lightning_paradyse.cost.memory`: bytes saved for backward and transient peaks per mode and op.
* :mod:`~lightning_paradyse.cost.traffic` and :mod:`~lightning_paradyse.cost.time`: collectives per
  phase (summing to :mod:`lightning_paradyse.volume`), FLOPs, rates, alpha-beta, overlap.
* :mod:`~lightning_paradyse.cost.model`: :class:`CostModel`, the per-op costs and the step timeline.
* :mod:`~lightning_paradyse.cost.search` and :mod:`~lightning_paradyse.cost.planner`: the exact
  Pareto dynamic programme and :class:`CostPlanner` (``plan(seq_len, batch) -> Plan``).
* :mod:`~lightning_paradyse.cost.tracker`: :class:`MemoryTracker` (live/peak tensor bytes, CPU and CUDA).
* :mod:`~lightning_paradyse.cost.profile`, :mod:`~lightning_paradyse.cost.measure`,
  :mod:`~lightning_paradyse.cost.calibrate`: the calibration run; :mod:`~lightning_paradyse.cost.cluster`:
  cluster description files; :mod:`~lightning_paradyse.cost.cli`: ``cli.py profile`` / ``cli.py plan``.
"""

from lightning_paradyse.cost.cluster import Cluster, load_cluster
from lightning_paradyse.cost.dims import ModelDims, dims_from_config, dims_from_module
from lightning_paradyse.cost.model import CostModel, OpCalibration, OpCost
from lightning_paradyse.cost.planner import CostPlanner, PlanInfeasible, PlannedStep, PlanSkipped, make_planner
from lightning_paradyse.cost.profile import Profile, ProfileSettings, load_profile, run_profile
from lightning_paradyse.cost.tracker import MemoryTracker

__all__ = [
    "Cluster",
    "CostModel",
    "CostPlanner",
    "MemoryTracker",
    "ModelDims",
    "OpCalibration",
    "OpCost",
    "PlanInfeasible",
    "PlanSkipped",
    "PlannedStep",
    "Profile",
    "ProfileSettings",
    "dims_from_config",
    "dims_from_module",
    "load_cluster",
    "load_profile",
    "make_planner",
    "run_profile",
]
