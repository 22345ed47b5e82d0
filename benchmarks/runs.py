"""The runs: ParaDySe adaptive, every static mode (the paper's baselines) and Lightning's built-in strategies.

Every run trains the same LightningModule, :class:`BenchLM` (the package's ``LanguageModel`` plus a
``configure_model`` for Lightning's ``ModelParallelStrategy``), from the same seed, on the same trace.

How the runs share the work (the comparison the tables make):

* **ParaDySe runs** (``paradyse-auto`` and ``static-*``): all processes form one sequence-parallel group and
  process *every* sequence together, each rank holding ``1/p`` of its tokens.
* **Tensor parallel** (``lightning-tp``, ``ModelParallelStrategy(1, p)``): every rank also processes every
  sequence, whole, with ``1/p`` of the heads and of the MLP (Megatron column/row sharding, no sequence
  parallelism).
* **Data parallel** (``lightning-ddp``: ``DDPStrategy``; ``lightning-fsdp2``: ``ModelParallelStrategy(p, 1)``,
  i.e. ``fully_shard`` per block): data parallelism splits the *batch*, not the sequence: rank ``r`` takes
  sequences ``r, r + p, ...`` of the same sorted trace, so one step trains ``p`` (similar) sequences, each
  rank holding a whole sequence.

All of them train the same global token stream once; tokens/s is the whole job's (every token of the trace
over the wall time of all steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from typing_extensions import override

from lightning_paradyse.lit import LanguageModel
from lightning_paradyse.models import LlamaConfig
from lightning_paradyse.plan import OpPlan

Family = Literal["paradyse", "static", "lightning"]
Parallelism = Literal["none", "fsdp2", "tp"]


@dataclass(frozen=True)
class RunSpec:
    """One run of the benchmark."""

    name: str
    """Its name in the tables (``paradyse-auto``, ``static-ring+rc``, ``lightning-ddp``, ...)."""
    family: Family
    """``paradyse`` (adaptive), ``static`` (one mode everywhere) or ``lightning`` (a built-in strategy)."""
    mode: str | None = None
    """Static runs: the mode of every op of every layer."""
    recompute: bool = False
    """Static runs: recompute every op in backward."""
    builtin: Literal["ddp", "fsdp2", "tp"] | None = None
    """Lightning runs: which built-in strategy."""

    @property
    def data_parallel(self) -> bool:
        """Ranks take different sequences (DDP, FSDP2) instead of sharing each one."""
        return self.builtin in ("ddp", "fsdp2")

    @property
    def uses_paradyse(self) -> bool:
        """Runs under :class:`~lightning_paradyse.ParaDySeStrategy`."""
        return self.family != "lightning"

    def plan(self, n_layers: int) -> str | list[dict[str, Any]]:
        """The ``plan`` argument of ``ParaDySeStrategy``: ``"auto"``, or a uniform per-layer list."""
        if self.family == "paradyse":
            return "auto"
        assert self.mode is not None
        OpPlan(self.mode)  # raises for an unknown mode
        return [{"attention": self.mode, "mlp": self.mode, "recompute": self.recompute}] * n_layers


def run_spec(name: str) -> RunSpec:
    """The run called ``name`` (see :data:`benchmarks.settings.ALL_RUNS`)."""
    if name == "paradyse-auto":
        return RunSpec(name, "paradyse")
    if name.startswith("static-"):
        mode = name.removeprefix("static-")
        return RunSpec(name, "static", mode.removesuffix("+rc"), mode.endswith("+rc"))
    builtins = {"lightning-ddp": "ddp", "lightning-fsdp2": "fsdp2", "lightning-tp": "tp"}
    if name in builtins:
        return RunSpec(name, "lightning", builtin=builtins[name])  # type: ignore[arg-type]
    raise ValueError(
        f"unknown run {name!r}: use paradyse-auto, static-<mode>[+rc] (tp_sp, ulysses, ring, metp), "
        f"lightning-ddp, lightning-fsdp2 or lightning-tp"
    )


class BenchLM(LanguageModel):
    """The package's ``LanguageModel`` with sharding for ``ModelParallelStrategy`` and CUDA OOM skipping.

    A ``torch.cuda.OutOfMemoryError`` in a step is counted (:attr:`oom_steps`) and the step does not update the
    weights; the run goes on. Best effort: if only some ranks run out of memory in the middle of a collective
    pattern, the others wait in that collective until the process group's timeout.

    Args:
        config: The model.
        lr: AdamW learning rate.
        parallelism: ``fsdp2`` (``fully_shard`` each block and the root over the data-parallel mesh axis),
            ``tp`` (column/row tensor parallelism over the tensor-parallel axis) or ``none``.
    """

    def __init__(self, config: LlamaConfig, lr: float = 1e-3, parallelism: Parallelism = "none") -> None:
        super().__init__(model=config, lr=lr)  # type: ignore[arg-type]
        self.parallelism = parallelism
        self.oom_steps = 0
        """Steps skipped because CUDA ran out of memory (the run goes on)."""
        self._sharded = False

    @override
    def configure_model(self) -> None:
        if self._sharded or self.parallelism == "none" or self.device_mesh is None:
            return
        if self.parallelism == "tp":
            apply_tensor_parallel(self.model, self.device_mesh["tensor_parallel"])
        else:
            apply_fsdp2(self.model, self.device_mesh["data_parallel"])
        self._sharded = True

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        try:
            return super().training_step(batch, batch_idx)
        except torch.cuda.OutOfMemoryError:
            self._out_of_memory()
            # Lightning refuses a None loss in distributed training: a zero loss on the parameters instead
            # (zero gradients, the same gradient collectives on every rank; the optimizer step is skipped)
            return sum(p.sum() * 0.0 for p in self.parameters() if p.requires_grad)

    @override
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        try:
            super().backward(loss, *args, **kwargs)
        except torch.cuda.OutOfMemoryError:
            self._out_of_memory()

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if getattr(self, "_skip_step", False):
            optimizer.zero_grad(set_to_none=True)  # AdamW skips parameters without gradients
            self._skip_step = False

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if outputs is not None:
            super().on_train_batch_end(outputs, batch, batch_idx)

    def _out_of_memory(self) -> None:
        self.oom_steps += 1
        self._skip_step = True
        torch.cuda.empty_cache()


def apply_tensor_parallel(model: torch.nn.Module, mesh: Any) -> None:
    """Megatron-style tensor parallelism of the reference Llama (what a Lightning user writes by hand)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(),
        "mlp.gate": ColwiseParallel(),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(),
    }
    for block in model.layers:  # type: ignore[union-attr]
        parallelize_module(block, mesh, plan)
        block.attn.n_heads //= tp  # the block's code reshapes with the local head counts
        block.attn.n_kv_heads //= tp


def apply_fsdp2(model: torch.nn.Module, mesh: Any) -> None:
    """``fully_shard`` every block, then the whole model (FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def make_strategy(spec: RunSpec, n_layers: int, budget: int, world: int, extra: dict[str, Any]) -> Any:
    """The Trainer ``strategy`` of ``spec``.

    Args:
        spec: The run.
        n_layers: Blocks of the model (static plans have one entry per layer).
        budget: Per-rank memory budget in bytes (handed to ParaDySe's planner).
        world: Number of processes.
        extra: More ``ParaDySeStrategy`` keyword arguments for the adaptive run (thresholds, profile).
    """
    if spec.uses_paradyse:
        from lightning_paradyse import ParaDySeStrategy

        kwargs = dict(extra) if spec.family == "paradyse" else {}
        return ParaDySeStrategy(plan=spec.plan(n_layers), memory_budget=budget, timeout=600, **kwargs)
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    if spec.builtin == "ddp":
        return DDPStrategy(gradient_as_bucket_view=True, timeout=timedelta(seconds=600))
    dp, tp = (world, 1) if spec.builtin == "fsdp2" else (1, world)
    return ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, timeout=timedelta(seconds=600))


def parallelism(spec: RunSpec) -> Parallelism:
    """What :meth:`BenchLM.configure_model` applies for ``spec``."""
    return "fsdp2" if spec.builtin == "fsdp2" else "tp" if spec.builtin == "tp" else "none"


__all__ = ["BenchLM", "RunSpec", "apply_fsdp2", "apply_tensor_parallel", "make_strategy", "parallelism", "run_spec"]
