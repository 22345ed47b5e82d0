"""The parallelized model at run time: rewrite and configure it (:mod:`~.parallel`: state, hooks, gradients,
state dicts), each rank's slice of a batch (:mod:`~.slicing`), checkpoints in the plain model's form
(:mod:`~.checkpoint`), Hugging Face gradient checkpointing onto the plan (:mod:`~.hf_checkpointing`), the model's
outputs as leaves for the step check's gradient comparison (:mod:`~.output_leaves`), and what
keeps training exact or refuses it (:mod:`~.exactness`: optimizers, whole-model clipping, replica checks, per-rank
random streams, rotary and window refusals)."""
