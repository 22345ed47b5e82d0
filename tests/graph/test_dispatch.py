"""The dispatch modules read nothing on the host per layer.

A read of a tensor's value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``torch.equal``, ``.tolist()``,
``.cpu()``) waits for a GPU to finish everything queued before it, and so does a blocking copy onto it. Two
processes run one step (forward, backward and the replicated gradients' reduction) of the package's Llama and of
Hugging Face models (Llama; Mixtral, a mixture of experts whose unused experts are settled after the backward) under
every mode a layer can run, with one layer and with three, and count the value reads and the blocking copies: the
layers add only those the model's own code makes in one process (Mixtral's router reads which experts its tokens
chose; on the host the reads are free, but each would be a host synchronisation per layer on a GPU).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.models import CONFIGS, build_model, lm_loss_sum
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.plan import uniform_plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime.parallel import (
    configure,
    feasible_modes,
    is_causal,
    parallelize,
    reduce_replicated_grads,
    set_step_sources,
)
from lightning_paradyse.runtime.slicing import BatchSource
from tests.support.copies import BlockingCopies
from tests.support.families import hf_family, hf_llama

READS = ("_local_scalar_dense", "equal", "is_nonzero")
"""The ops that hand a tensor's value to the host."""
METHODS = ("tolist", "cpu", "numpy")
"""Tensor methods that copy values to the host outside the dispatcher (on a GPU tensor, a synchronisation)."""


class HostReads(TorchDispatchMode):
    """Counts the value reads (:data:`READS`), host copies (:data:`METHODS`) and blocking copies onto a device
    (``blocking_copy``: :class:`~tests.support.copies.BlockingCopies`) while it is entered."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()
        self._saved: dict[str, Any] = {}
        self._copies = BlockingCopies()

    def __enter__(self) -> HostReads:
        for name in METHODS:
            self._saved[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counted(name, original))
        self._copies.__enter__()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._copies.__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        if self._copies.sites:
            self.reads["blocking_copy"] = len(self._copies.sites)

    def _counted(self, name: str, original: Any) -> Any:
        def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.reads[name] += 1
            return original(tensor, *args, **kwargs)

        return method

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._overloadpacket.__name__ in READS:
            self.reads[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _model(kind: str, n: int) -> torch.nn.Module:
    if kind == "llama":
        return build_model(dataclasses.replace(CONFIGS["llama-tiny"], n_layers=n))
    return hf_llama(n_layers=n) if kind == "hf-llama" else hf_family(kind, n_layers=n)


def _reads(rank: int, world: int, kinds: tuple[str, ...], layers: tuple[int, ...]) -> dict[Any, dict[str, int]]:
    group = dist.group.WORLD
    out = {}
    for kind in kinds:
        for n in layers:
            torch.manual_seed(0)
            model = _model(kind, n)
            hf = kind != "llama"
            ids = torch.randint(0, 128, (2, 65), generator=torch.Generator().manual_seed(1))
            tokens, targets = (ids[:, :-1], ids[:, :-1]) if hf else (ids[:, :-1], ids[:, 1:])
            with HostReads() as counter:  # the model's own reads, in one process
                if hf:
                    model(input_ids=tokens, labels=tokens).loss.backward()
                else:
                    lm_loss_sum(model, tokens, targets, torch.arange(tokens.shape[1])).backward()
            out[(kind, "plain", n)] = dict(counter.reads)
            model.zero_grad(set_to_none=True)
            parallelize(model, group)
            layout = SeqLayout.for_sequence(tokens.shape[1], world, is_causal(model))
            ctx = SeqContext(layout, group)
            local, local_targets = layout.shard(tokens, rank), layout.shard(targets, rank)
            attn, mlp = feasible_modes(model, world, list(MODES))[0]
            for mode in [m for m in MODES if m in attn and m in mlp]:
                configure(model, ctx, uniform_plan(mode, n))
                with HostReads() as counter:
                    if hf:  # the batch the step slices: the labels are traced back to it
                        set_step_sources(model, (BatchSource("input_ids", local, tokens),))
                        loss = model(input_ids=local, labels=local).loss
                    else:
                        loss = lm_loss_sum(model, local, local_targets, ctx.positions())
                    loss.backward()
                    reduce_replicated_grads(model, group)
                out[(kind, mode, n)] = dict(counter.reads)
    return out


@pytest.mark.dist
def test_a_step_reads_nothing_on_the_host_per_layer() -> None:
    kinds = ("llama", "hf-llama", "mixtral")
    per_rank = run_distributed(_reads, 2, kinds, (1, 3), timeout=180)
    for reads in per_rank:
        assert {(kind, mode) for kind, mode, _ in reads} >= {("mixtral", "ulysses"), ("hf-llama", "tp_sp")}
        for kind, mode, n in reads:
            if n == 3 and mode != "plain":  # no more than the model's own code reads in one process
                more = _added(reads, kind, mode) - _added(reads, kind, "plain")
                assert not more, (kind, mode, more, reads)


def _added(reads: dict[Any, dict[str, int]], kind: str, mode: str) -> Counter[str]:
    """The reads two more layers add."""
    more = Counter(reads[(kind, mode, 3)])
    more.subtract(reads[(kind, mode, 1)])
    return +more
