"""A finished spawn fit leaves no process group behind, so its workers exit cleanly.

``dist.destroy_process_group`` only unregisters a group; a gloo group that something still refers to lives on with
its worker threads until the interpreter finalizes, and a worker still holding the last collective's work then
aborts the process (``terminate called without an active exception``) after a finished fit. The strategy's teardown
drops every reference of its own first; ``benchmarks/exit_check.py`` checks in each worker that the group is gone
(exit status 2 if not, 1 for an abnormal exit). And the script launcher's rank 0 stops the workers of a failed fit
that outlive it (:func:`~lightning_paradyse.lightning.launch.stop_workers`).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.lightning.launch import refuse_parameter_hooks, stop_workers
from lightning_paradyse.models import build_model
from tests.support.lightning import quiet_trainer
from tests.support.processes import run_at_once

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
@pytest.mark.parametrize("plan", ["metp"])  # the plan of the report (every plan keeps the group alike)
def test_spawn_fit_releases_process_group(plan: str) -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/exit_check.py", "--fits", "1", "--plan", plan, "--check-release"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.dist
def test_a_stalled_rank_does_not_outlive_the_run(tmp_path: Path) -> None:
    """Rank 1 sleeps inside its step; rank 0's collective times out and every process of the run ends, under
    ``spawn`` and ``popen`` (both checks run at once: each mostly waits out its timeout).

    Under ``popen`` rank 0 launched rank 1 itself and stops it (before: it slept on after the run had failed);
    under ``spawn`` the launcher stops the workers (its SIGTERM ends the stall here: with Lightning's handler the
    sleeping rank would wait for torch's SIGKILL, 30 s on, which this test would only wait out). The collective
    timeout leaves ``popen``'s workers time to start (it also bounds the rendezvous; 25 s: each imports Lightning, about
    7 s alone on a 2-core machine, more beside the spawn run).
    """
    commands = {}
    for start_method, timeout in (("spawn", 5), ("popen", 25)):
        args = ["--start-method", start_method, "--stall-rank", "1", "--timeout", str(timeout), "--grace", "20"]
        args += ["--sigterm-ends-stall"] if start_method == "spawn" else []
        commands[start_method] = [sys.executable, "benchmarks/stall_check.py", *args]
    for method, (code, output) in run_at_once(commands, tmp_path, ROOT, 200).items():
        assert code == 0, f"{method}: {output[-8000:]}"
        assert "processes of the run left 20 s after the fit: 0" in output, f"{method}: {output[-8000:]}"


def test_stop_workers_kills_only_the_ones_still_running() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    procs = [sleeper, quick]
    killed = stop_workers(procs, grace=2.0)
    assert killed == [sleeper.pid] and procs == []  # emptied: Lightning's process observer watches this list
    assert sleeper.wait(timeout=10) == -signal.SIGKILL and quick.wait(timeout=10) == 0


class _HookedEmbeddingLM(pl.LightningModule):
    """A gradient hook on the embedding (not sharded), registered in ``__init__``: lost when the module is pickled."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build_model("llama-tiny")
        self.model.tok_emb.weight.register_hook(_zero)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch).mean()


def _zero(grad: torch.Tensor) -> torch.Tensor:
    return grad * 0


def test_the_spawn_launcher_refuses_a_parameter_hook_it_would_drop() -> None:
    """PyTorch does not pickle a parameter's hooks: the spawn launcher refuses one in the launching process, before any
    worker starts, naming the fixes (``refuse_parameter_hooks``); ``fork`` keeps the module as it is."""
    with pytest.raises(ValueError, match=r"tok_emb\.weight .*'spawn' launcher pickles.*configure_model"):
        refuse_parameter_hooks(_HookedEmbeddingLM(), "spawn")
    trainer = quiet_trainer(2, ParaDySeStrategy(timeout=60), [], max_steps=1)
    with pytest.raises(ValueError, match=r"gradient hook is registered on model\.tok_emb\.weight"):
        trainer.fit(_HookedEmbeddingLM(), train_dataloaders=DataLoader([torch.zeros(2, 16, dtype=torch.long)]))
