"""Processes and collectives: the unified layout (:mod:`~.layout`), every collective with explicit groups
(:mod:`~.comm`), devices, backends and the GPU budget (:mod:`~.devices`), the spawned-process harness
(:mod:`~.spawn`)."""
