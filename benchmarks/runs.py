"""The runs: ParaDySe adaptive, groups with one fixed mode, every static mode (the paper's baselines) and
Lightning's built-in strategies.

Every run trains the same LightningModule, :class:`BenchLM` (the package's ``LanguageModel`` plus a
``configure_model`` for Lightning's ``ModelParallelStrategy``), from the same seed, on the same *global batches*,
one per optimizer step (several sequences, padded rows; :mod:`benchmarks.workload`).

How the runs share a global batch (the comparison the tables make):

* **ParaDySe runs** get the whole global batch on every rank:

  * ``paradyse-auto``: ``ParaDySeStrategy(plan="auto")`` with its default ``groups``: per step the ranks are split
    into groups of power-of-two sizes (``p`` groups of one = data parallelism, one group of ``p`` = sequence
    parallelism), the rows dealt to the groups, each group's plan chosen per layer and op on the cost model;
  * ``groups-<mode>``: ``groups=True`` with one fixed mode everywhere (the split and the rows still chosen per
    step, on the FLOP count);
  * ``static-<mode>[+rc]``: ``groups=False`` with one fixed mode (and recomputation): every rank shares every row
    of the batch, each holding ``1/p`` of its tokens (the paper's baselines).

* **Tensor parallel** (``lightning-tp``, ``ModelParallelStrategy(1, p)``): every rank processes the whole global
  batch with ``1/p`` of the heads and of the MLP (Megatron column/row sharding, no sequence parallelism).
* **Data parallel** (``lightning-ddp``: ``DDPStrategy``; ``lightning-fsdp2``: ``ModelParallelStrategy(p, 1)``,
  i.e. ``fully_shard`` per block): rank ``r`` takes rows ``r, r + p, ...`` of the global batch, cut to its longest
  row, and returns ``p / N`` times its sum of token losses (``N`` the real targets of the global batch), so the
  averaged gradients are those of the global mean token loss (:meth:`BenchLM.loss`).
* **Built-ins made to fit** (``lightning-ddp+ac``, ``lightning-fsdp2+ac``): the same with activation checkpointing
  of every block (what a Lightning user switches on when DDP or FSDP2 runs out of memory: each block keeps only
  its input and recomputes the rest in backward), so that the tables have a built-in that stays within the
  budget to compare with.

All runs take the same optimizer steps on the same tokens; tokens/s is the whole job's (the real tokens of every
global batch over the sum of the step times).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from typing_extensions import override

from lightning_paradyse.lightning.language_model import LanguageModel
from lightning_paradyse.models import LlamaConfig
from lightning_paradyse.modes.plan import OpPlan

Family = Literal["paradyse", "groups", "static", "lightning"]
Parallelism = Literal["none", "fsdp2", "tp"]


@dataclass(frozen=True)
class RunSpec:
    """One run of the benchmark."""

    name: str
    """Its name in the tables (``paradyse-auto``, ``static-ring+rc``, ``lightning-ddp``, ...)."""
    family: Family
    """``paradyse`` (adaptive), ``groups`` (groups with one fixed mode), ``static`` (one group, one mode
    everywhere) or ``lightning`` (a built-in strategy)."""
    mode: str | None = None
    """Groups and static runs: the mode of every op of every layer."""
    recompute: bool = False
    """Groups and static runs: recompute every op in backward."""
    builtin: Literal["ddp", "fsdp2", "tp"] | None = None
    """Lightning runs: which built-in strategy."""
    checkpointing: bool = False
    """Lightning runs: activation checkpointing of every block (``+ac``)."""

    @property
    def data_parallel(self) -> bool:
        """Ranks take different sequences (DDP, FSDP2) instead of sharing each one."""
        return self.builtin in ("ddp", "fsdp2")

    @property
    def uses_paradyse(self) -> bool:
        """Runs under :class:`~lightning_paradyse.ParaDySeStrategy`."""
        return self.family != "lightning"

    @property
    def groups(self) -> bool | None:
        """``ParaDySeStrategy(groups=...)``: the default (on with ``plan="auto"``), on, or off."""
        return {"paradyse": None, "groups": True, "static": False}.get(self.family)

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
    for family in ("static", "groups"):
        if name.startswith(f"{family}-"):
            mode = name.removeprefix(f"{family}-")
            spec = RunSpec(name, family, mode.removesuffix("+rc"), mode.endswith("+rc"))  # type: ignore[arg-type]
            spec.plan(1)  # raises for an unknown mode
            return spec
    builtins = {"lightning-ddp": "ddp", "lightning-fsdp2": "fsdp2", "lightning-tp": "tp"}
    base = name.removesuffix("+ac")
    if base in builtins and (base == name or builtins[base] != "tp"):
        return RunSpec(name, "lightning", builtin=builtins[base], checkpointing=name != base)  # type: ignore[arg-type]
    raise ValueError(
        f"unknown run {name!r}: use paradyse-auto, groups-<mode>[+rc] or static-<mode>[+rc] (tp_sp, ulysses, ring, "
        f"metp), lightning-ddp[+ac], lightning-fsdp2[+ac] or lightning-tp"
    )


class BenchLM(LanguageModel):
    """The package's ``LanguageModel`` with sharding for ``ModelParallelStrategy``, the data-parallel loss
    normalisation and CUDA OOM skipping.

    A batch with a ``loss_scale`` (a data-parallel rank's share of a global batch,
    :func:`benchmarks.workload.data_parallel_share`) returns ``loss_scale`` times its *sum* of token losses,
    ``loss_scale = p / N`` with ``N`` the real targets of the global batch: DDP and FSDP2 average the gradients
    over the ``p`` ranks, so one optimizer step follows the gradient of the global batch's mean token loss, as the
    other runs do (a plain per-rank mean would weight a rank's tokens by ``1 / (p n_r)`` instead of ``1 / N``).

    A ``torch.cuda.OutOfMemoryError`` in a step is counted (:attr:`oom_steps`) and the step does not update the
    weights; the run goes on. Best effort: if only some ranks run out of memory in the middle of a collective
    pattern, the others wait in that collective until the process group's timeout.

    Args:
        config: The model.
        lr: AdamW learning rate.
        parallelism: ``fsdp2`` (``fully_shard`` each block and the root over the data-parallel mesh axis),
            ``tp`` (column/row tensor parallelism over the tensor-parallel axis) or ``none``.
        checkpointing: Activation checkpointing of every block (applied before ``fully_shard``).
    """

    def __init__(
        self, config: LlamaConfig, lr: float = 1e-3, parallelism: Parallelism = "none", checkpointing: bool = False
    ) -> None:
        super().__init__(model=config, lr=lr)  # type: ignore[arg-type]
        self.parallelism = parallelism
        self.checkpointing = checkpointing
        self.oom_steps = 0
        """Steps skipped because CUDA ran out of memory (the run goes on)."""
        self._sharded = False

    @override
    def configure_model(self) -> None:
        if self._sharded:
            return
        self._sharded = True
        if self.checkpointing:
            apply_checkpointing(self.model)
        if self.parallelism == "none" or self.device_mesh is None:
            return
        if self.parallelism == "tp":
            apply_tensor_parallel(self.model, self.device_mesh["tensor_parallel"])
        else:
            apply_fsdp2(self.model, self.device_mesh["data_parallel"])

    @override
    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        scale = batch.get("loss_scale")
        if scale is None:
            return super().loss(batch)
        logits = self(batch["input_ids"], batch.get("positions"))  # [b_r, s_r, vocab]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        total = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100, reduction="sum")
        return total * scale.to(total.dtype)

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


class CheckpointedBlock(torch.nn.Module):
    """A block whose forward keeps only its inputs and recomputes the rest in backward (non-reentrant)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    @override
    def forward(self, *args: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, *args, use_reentrant=False)


def apply_checkpointing(model: torch.nn.Module) -> None:
    """Activation checkpointing of every block of the reference Llama."""
    layers = model.layers  # type: ignore[union-attr]
    for i, block in enumerate(layers):  # type: ignore[arg-type]
        layers[i] = CheckpointedBlock(block)  # type: ignore[index]


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
        extra: More ``ParaDySeStrategy`` keyword arguments for the adaptive run (thresholds, profile). The
            ``groups-<mode>`` runs get ``groups=True``, the static runs ``groups=False``, the adaptive run the
            strategy's default (on with ``plan="auto"``).
    """
    if spec.uses_paradyse:
        from lightning_paradyse import ParaDySeStrategy

        kwargs = dict(extra) if spec.family == "paradyse" else {}
        plan = spec.plan(n_layers)
        return ParaDySeStrategy(plan=plan, groups=spec.groups, memory_budget=budget, timeout=600, **kwargs)
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    if spec.builtin == "ddp":
        return DDPStrategy(gradient_as_bucket_view=True, timeout=timedelta(seconds=600))
    dp, tp = (world, 1) if spec.builtin == "fsdp2" else (1, world)
    return ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, timeout=timedelta(seconds=600))


def parallelism(spec: RunSpec) -> Parallelism:
    """What :meth:`BenchLM.configure_model` applies for ``spec``."""
    return "fsdp2" if spec.builtin == "fsdp2" else "tp" if spec.builtin == "tp" else "none"


__all__ = [
    "BenchLM",
    "CheckpointedBlock",
    "RunSpec",
    "apply_checkpointing",
    "apply_fsdp2",
    "apply_tensor_parallel",
    "make_strategy",
    "parallelism",
    "run_spec",
]
