"""The dispatch modules read nothing on the host per layer.

A read of a tensor's value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``torch.equal``) waits for a GPU
to finish everything queued before it. Two processes run one step (forward and backward) of the package's Llama
under every mode, with one layer and with three, and count the value reads under a dispatch mode: the same count
whatever the layers (on the host the reads are free, but each would be a host synchronisation per layer on a GPU).
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
from lightning_paradyse.runtime.parallel import configure, is_causal, parallelize

READS = ("_local_scalar_dense", "equal", "is_nonzero")
"""The ops that hand a tensor's value to the host."""


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._overloadpacket.__name__ in READS:
            self.reads[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _reads(rank: int, world: int, layers: tuple[int, ...]) -> dict[tuple[str, int], dict[str, int]]:
    group = dist.group.WORLD
    out = {}
    for n in layers:
        torch.manual_seed(0)
        model = build_model(dataclasses.replace(CONFIGS["llama-tiny"], n_layers=n))
        parallelize(model, group)
        ctx = SeqContext(SeqLayout.for_sequence(64, world, is_causal(model)), group)
        tokens = torch.randint(0, 128, (2, 65), generator=torch.Generator().manual_seed(1))
        local, targets = ctx.layout.shard(tokens[:, :-1], rank), ctx.layout.shard(tokens[:, 1:], rank)
        for mode in MODES:
            configure(model, ctx, uniform_plan(mode, n))
            with HostReads() as counter:
                lm_loss_sum(model, local, targets, ctx.positions()).backward()
            out[(mode, n)] = dict(counter.reads)
    return out


@pytest.mark.dist
def test_a_step_reads_nothing_on_the_host_per_layer() -> None:
    per_rank = run_distributed(_reads, 2, (1, 3), timeout=120)
    for reads in per_rank:
        for mode in MODES:
            assert reads[(mode, 3)] == reads[(mode, 1)], (mode, reads[(mode, 1)], reads[(mode, 3)])
