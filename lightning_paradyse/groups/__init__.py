"""Groups of different sizes in one step: data parallelism and sequence parallelism chosen together per batch.

A training batch of several sequences (rows, padded or not) or documents (a packed batch) need not be split over
every rank: the world of ``P`` ranks is cut into aligned power-of-two groups (``P`` groups of one is plain data
parallelism, one group of ``P`` is full sequence parallelism, ``4 + 2 + 1 + 1`` anything between), each group
trains its own share of the units under its own per-layer, per-op plan, and the step takes as long as its
slowest group (FlexSP; Megatron's dynamic context parallelism). One name per idea:

* :mod:`~lightning_paradyse.groups.units`: the *units* of a batch (rows or documents) and cutting a group's batch;
* :mod:`~lightning_paradyse.groups.solver`: the *split* (group sizes) and the *assignment* of units to groups;
* :mod:`~lightning_paradyse.groups.cost`: what a group costs on the cost model;
* :mod:`~lightning_paradyse.groups.exchange`: the *weight exchange* that gives every rank its group's shards;
* :mod:`~lightning_paradyse.groups.runner`: the *step runner* the strategy owns (:class:`GroupRunner`).
"""

from lightning_paradyse.groups.cost import (
    attention_crossover,
    exchange_seconds,
    flop_weights,
    group_cost,
    machine_for_groups,
    packed_cost,
    rows_cost,
)
from lightning_paradyse.groups.exchange import GroupSet, blocks, check_sizes, enter_group, exit_group, measure_regroup
from lightning_paradyse.groups.runner import GroupRunner, GroupStep, imbalance
from lightning_paradyse.groups.solver import Assignment, assign, assign_rows, layouts
from lightning_paradyse.groups.units import Units

__all__ = [
    "Assignment",
    "GroupRunner",
    "GroupSet",
    "GroupStep",
    "Units",
    "assign",
    "assign_rows",
    "attention_crossover",
    "blocks",
    "check_sizes",
    "enter_group",
    "exchange_seconds",
    "exit_group",
    "flop_weights",
    "group_cost",
    "imbalance",
    "layouts",
    "machine_for_groups",
    "measure_regroup",
    "packed_cost",
    "rows_cost",
]
