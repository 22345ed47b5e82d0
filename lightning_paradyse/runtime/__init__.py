"""The parallelized model at run time: rewrite and configure it (:mod:`~.parallel`: state, hooks, gradients,
state dicts), each rank's slice of a batch (:mod:`~.slicing`), checkpoints in the plain model's form
(:mod:`~.checkpoint`), Hugging Face gradient checkpointing onto the plan (:mod:`~.hf_checkpointing`), and the
guards (:mod:`~.guards`: optimizers, whole-model clipping, replica checks, per-rank random streams)."""
