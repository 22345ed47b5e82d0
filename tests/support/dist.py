"""The spawned-gloo test harness (re-exported from the package, where ``cli.py check`` uses it too)."""

from lightning_paradyse.spawn import run_distributed

__all__ = ["run_distributed"]
