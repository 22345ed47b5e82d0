"""Measuring a machine for the cost model: the calibration run (:mod:`~.profile`, :mod:`~.measure`,
:mod:`~.calibrate`), the setup-time measurement (:mod:`~.quick`, cached per machine), live and peak tensor memory
(:mod:`~.tracker`)."""
