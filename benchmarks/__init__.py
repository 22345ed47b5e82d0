"""Benchmarks of ParaDySe against every static mode and against Lightning's own strategies.

Run ``python benchmarks/run.py`` (``--quick`` for a smoke run, ``--help`` for the options). The modules:

* :mod:`benchmarks.settings`: what is run (model, traces, runs, memory budget, repetitions), as dataclasses;
* :mod:`benchmarks.runs`: the runs (ParaDySe adaptive, each static mode, DDP, FSDP2, TP) and their strategies;
* :mod:`benchmarks.workload`: the length traces and the token sequences every run trains on;
* :mod:`benchmarks.instrument`: step timing, peak memory, bytes communicated, planner time, matmul rate;
* :mod:`benchmarks.worker`: what every spawned process does (Trainers for each run, the length search);
* :mod:`benchmarks.report`: the numbers per run, the JSON file and the Markdown table;
* :mod:`benchmarks.plots`: the PNG plots (needs the optional ``bench`` extra, matplotlib).

Separate scripts: ``benchmarks/cost_model.py`` (cost-model accuracy and planner time), ``benchmarks/groups.py``
(groups of different sizes vs one group, 4 processes) and ``benchmarks/dsp.py`` (dimension switching vs the
sequence modes on the spatial-temporal model).
"""
