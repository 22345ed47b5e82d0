"""How the strategy's processes start: Lightning's launchers, with what our model and checkpoints need.

* ``spawn`` / ``fork`` / ``forkserver``: :class:`SpawnLauncher`, Lightning's multiprocessing launcher that first makes
  the module picklable (Hugging Face gradient checkpointing) and hands rank 0's *consolidated* weights back (the
  local shards would not load into the launching process's model);
* ``popen``: Lightning's script launcher (each process re-runs the command, as ``torchrun`` does);
* nothing when an external launcher (``torchrun``, SLURM) created the processes, or for one process.

When a fit fails, the script launcher's rank 0 stops the workers it started that outlive it (:func:`stop_workers`).
"""

from __future__ import annotations

import io
import os
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_paradyse.runtime import hf_checkpointing, parallel
from lightning_paradyse.runtime.exactness import host_rng_state, set_host_rng_state


def stop_workers(procs: list[Any], grace: float = 5.0) -> list[int]:
    """Kill the worker processes this (launching) process started that are still running ``grace`` seconds on.

    For the script launcher's rank 0 when its fit fails: the other ranks then either fail too (a refused feature,
    a collective that lost its peer) and exit on their own, or are stalled outside any collective (stuck user code
    or data loading) and would outlive the run. Their own child processes (data loader workers) are not followed.
    ``procs`` is emptied in place once every worker has ended: Lightning's process observer watches the same list
    and would otherwise kill this process too on seeing a worker's non-zero exit, before its error is reported.
    Returns the ids of the processes killed.
    """
    deadline = time.monotonic() + grace
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = []
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed.append(int(proc.pid))
    procs.clear()
    return killed


def refuse_parameter_hooks(module: torch.nn.Module, start_method: str) -> None:
    """Refuse, in the launching process, a gradient hook on a parameter of a module the launcher pickles: PyTorch does
    not pickle a parameter's hooks, so every worker would train without it (silently, until 2026-11-30)."""
    hooked = [name for name, param in module.named_parameters() if parallel.gradient_hooks(param)]
    if hooked:
        raise ValueError(
            f"a gradient hook is registered on {', '.join(hooked[:3])}{' ...' if len(hooked) > 3 else ''} "
            f"(register_hook or register_post_accumulate_grad_hook), and the {start_method!r} launcher pickles the "
            f"module into every worker: PyTorch does not pickle a parameter's hooks, so the workers would train "
            f"without it. Register the hook in configure_model (Lightning calls it in every worker; a hook on a "
            f"projection weight is refused there, as the strategy replaces that weight by its shard), or launch with "
            f"ParaDySeStrategy(start_method='fork') or 'popen'"
        )


class SpawnLauncher(_MultiProcessingLauncher):
    """The spawn launcher: the module made picklable first (Hugging Face gradient checkpointing); this process's
    random streams and default dtype carried into every worker (``launched_from``, any start method: Lightning
    carries the streams for ``spawn`` only, the dtype never); rank 0's *consolidated* weights handed back (the
    strategy keeps them in ``final_state_dict`` at teardown) into this process's module converted as the workers'
    was (``precision="64-true"``: float64, as one process leaves it; Lightning loads them into the module's dtype
    before the fit, float32, rounded), and rank 0's random streams at the end handed back too (a second fit, or the
    draws after the fit, continue from them as one process's do; Lightning leaves this process's where they were, so a
    second fit repeated the first one's shuffled order). Both until 2026-11-30."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        module = self._strategy.lightning_module
        if module is not None and self._start_method != "fork":  # spawn and forkserver pickle it into every worker
            refuse_parameter_hooks(module, self._start_method)
        if module is not None:
            hf_checkpointing.prepare_for_launch(module)
        launching = {"rng": host_rng_state(), "default_dtype": torch.get_default_dtype()}
        self._strategy.launched_from = launching  # type: ignore[attr-defined]  # pickled with the strategy
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            self._strategy.launched_from = None  # type: ignore[attr-defined]

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        strategy: Any = self._strategy
        if strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback else None
        weights_path = None
        final = getattr(strategy, "final_state_dict", None)
        if trainer.state.fn == TrainerFn.FITTING and final is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(final, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))

    @override
    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        buffer = io.BytesIO()  # as bytes: a tensor in the queue would be shared memory the exiting worker takes along
        torch.save(host_rng_state(), buffer)  # rank 0's streams at the end
        return {**super().get_extra_results(trainer), "rng_bytes": buffer.getvalue()}

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        module = trainer.lightning_module
        if module is not None:  # the dtype the workers' module had (64-true: float64), before their weights load
            self._strategy.precision_plugin.convert_module(module)
        super()._recover_results_in_main_process(worker_output, trainer)

    @override
    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if "rng_bytes" in extra:
            set_host_rng_state(torch.load(io.BytesIO(extra["rng_bytes"]), weights_only=False))


def make_launcher(strategy: Any, start_method: str) -> _Launcher | None:
    """The launcher of ``strategy`` for ``start_method`` (``None``: the processes exist already, or one process)."""
    environment = strategy.cluster_environment
    assert environment is not None
    if environment.creates_processes_externally or strategy.num_processes * strategy.num_nodes == 1:
        return None
    if start_method == "popen":
        return _SubprocessScriptLauncher(environment, strategy.num_processes, strategy.num_nodes)
    return SpawnLauncher(strategy, start_method=start_method)  # type: ignore[arg-type]


__all__ = ["SpawnLauncher", "make_launcher", "refuse_parameter_hooks", "stop_workers"]
