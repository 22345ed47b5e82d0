"""Benchmarks of ParaDySe against every static mode and against Lightning's own strategies.

Run ``python benchmarks/run.py`` (``--quick`` for a smoke run, ``--help`` for the options). Every run trains the
same global batches, one per optimizer step (several sequences under a token budget, padded rows); it prints the
adaptive run's ratios per trace last (``adaptive/best-static``, ``adaptive/DDP``, ...). The modules:

* :mod:`benchmarks.settings`: what is run (model, traces, batch token budget, runs, memory budget, repetitions),
  as dataclasses;
* :mod:`benchmarks.runs`: the runs (ParaDySe adaptive with groups, groups with one fixed mode, each static mode,
  DDP, FSDP2, TP), their strategies and the data-parallel loss normalisation;
* :mod:`benchmarks.workload`: the length traces, their global batches and what each rank of each run gets;
* :mod:`benchmarks.instrument`: step timing, peak memory, bytes communicated, decision time, group split, matmul
  rate;
* :mod:`benchmarks.worker`: what every spawned process does (Trainers for each run, the length search);
* :mod:`benchmarks.report`: the numbers per run, the adaptive run's regret against a per-step oracle, the JSON
  file and the Markdown tables;
* :mod:`benchmarks.plots`: the PNG plots (needs the optional ``bench`` extra, matplotlib).

Separate scripts: ``benchmarks/cost_model.py`` (cost-model accuracy and planner time), ``benchmarks/groups.py``
(groups of different sizes vs one group, 4 processes) and ``benchmarks/dsp.py`` (dimension switching vs the
sequence modes on the spatial-temporal model).
"""
