"""Every planner: what plan a batch runs with.

* :mod:`~lightning_paradyse.planning.fixed`: the planner protocol, a fixed plan, the length-threshold policy, the
  options' parsers (modes, plans, memory budgets);
* :mod:`~lightning_paradyse.cost.search` and :mod:`~lightning_paradyse.planning.planner`: the exact Pareto
  dynamic programme on the cost model and :class:`~lightning_paradyse.planning.planner.CostPlanner`
  (``plan(seq_len, batch) -> Plan``);
* :mod:`~lightning_paradyse.planning.grid`: dimension switching or a sequence mode per block of a grid model;
* :mod:`~lightning_paradyse.planning.choose`: the run's planner, chosen from the strategy's options.
"""
