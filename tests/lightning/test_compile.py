"""``compile=True``: rewritten blocks compiled with ``torch.compile(dynamic=True)`` give the eager results.

Two gloo processes; the first block is compiled once and run at two sequence lengths (the sequence
dimension is dynamic) under a mixed plan (its attention in ``tp_sp``, its MLP in ``metp``); loss and every
gradient must equal the eager run's (fp32, the mode-test tolerances). Compilation on CPU costs tens of seconds and
is not faster there: this checks correctness only.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_paradyse.lightning.strategy import compile_blocks
from lightning_paradyse.models import build_model
from lightning_paradyse.modes.plan import parse_plan
from lightning_paradyse.runtime.parallel import parallelize
from lightning_paradyse.tools.mode_check import TOLERANCES, grad_errors, parallel_step
from tests.support.dist import run_distributed

PLAN = [{"attention": "tp_sp", "mlp": "metp"}, {"attention": "ring", "mlp": "ulysses", "recompute": True}]


def _worker(rank: int, world: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    plain = build_model("llama-tiny-mha")
    eager = copy.deepcopy(plain)
    parallelize(eager, dist.group.WORLD)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, ["layers.0"])
    plan = parse_plan(PLAN, 2)
    out = []
    for seq_len in (37, 64):
        tokens = torch.randint(0, 128, (1, seq_len + 1))
        ref_loss, ref_grads = parallel_step(eager, tokens[:, :-1], tokens[:, 1:], plan, dist.group.WORLD)
        loss, grads = parallel_step(compiled, tokens[:, :-1], tokens[:, 1:], plan, dist.group.WORLD)
        errors = grad_errors(grads, ref_grads)
        out.append((f"{seq_len}/{plan}", float(abs(loss - ref_loss) / ref_loss), max(errors.values())))
    return out


@pytest.mark.slow
def test_compiled_blocks_match_eager() -> None:
    loss_tol, grad_tol = TOLERANCES[torch.float32]
    results = run_distributed(_worker, 2, timeout=500)[0]
    assert len(results) == 2
    bad = [r for r in results if r[1] > loss_tol or r[2] > grad_tol]
    assert not bad, bad
