"""The Lightning side: the strategy (:mod:`~.strategy`, the lifecycle) and its collaborators: the options
(:mod:`~.options`), the per-batch cycle (:mod:`~.cycle`), the step check (:mod:`~.step_check`), the
launchers (:mod:`~.launch`), what a batch ran with (:mod:`~.records`), the switcher callback (:mod:`~.callbacks`),
the whole-model summary (:mod:`~.summary`), the picture of a fit (:mod:`~.plot`), and the command line's
LightningModule (:mod:`~.language_model`) and prediction writer (:mod:`~.prediction_writer`)."""
