"""lightning_paradyse: per-batch, per-layer parallel-mode switching for variable-length training."""
