"""Train the tiny reference Llama on 2 CPU processes with the mode library directly (no Lightning).

Shows the library level under the Lightning strategy: parallelize the model once, then for every
batch pick a plan, configure the blocks (a table look-up), run forward/backward on the local
tokens, sum the replicated gradients and step an ordinary optimizer over the shards. The data is
real text found on every machine: the source files of Python's standard library, as bytes.

    python examples/train_library.py --steps 30
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_paradyse.distributed.comm import all_reduce_sum
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.models import build_model, lm_loss_sum
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime.parallel import configure, parallelize, reduce_replicated_grads


def stdlib_bytes(limit: int = 2_000_000) -> torch.Tensor:
    """ASCII bytes of the standard library's source files (non-ASCII bytes clipped to 127)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        total += len(data)
        if total >= limit:
            break
    return torch.cat(chunks).clamp_max(127).long()


def plan_for(seq_len: int, n_layers: int) -> Plan:
    """A simple length-threshold policy: tensor parallel when short, ring + METP when long."""
    if seq_len <= 256:
        layer = LayerPlan(OpPlan("tp_sp"), OpPlan("tp_sp"))
    else:
        layer = LayerPlan(OpPlan("ring"), OpPlan("metp", recompute=True))
    return Plan((layer,) * n_layers)


def train(rank: int, world: int, steps: int, seed: int) -> list[float]:
    torch.manual_seed(seed)
    model = build_model("llama-tiny")
    parallelize(model, dist.group.WORLD)  # rewrites every block in place: 1/p shards, one variant per mode
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = stdlib_bytes()
    gen = torch.Generator().manual_seed(seed)  # the same batches on every rank
    losses = []
    for step in range(steps):
        seq_len = int(torch.randint(64, 513, (1,), generator=gen))  # variable lengths
        start = int(torch.randint(0, len(data) - seq_len - 1, (1,), generator=gen))
        window = data[start : start + seq_len + 1].unsqueeze(0)
        tokens, targets = window[:, :-1], window[:, 1:]
        layout = SeqLayout.for_sequence(seq_len, world, causal=True)
        ctx = SeqContext(layout, dist.group.WORLD)
        plan = plan_for(seq_len, len(model.layers))
        configure(model, ctx, plan)
        loss = lm_loss_sum(model, layout.shard(tokens, rank), layout.shard(targets, rank), ctx.positions())
        loss = loss / targets.numel()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        reduce_replicated_grads(model, dist.group.WORLD)
        optimizer.step()
        total = float(all_reduce_sum(loss.detach(), dist.group.WORLD))
        losses.append(total)
        if rank == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"step {step:3d}  len {seq_len:4d}  plan {plan.layers[0]}  loss {total:.4f}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    losses = run_distributed(train, args.world_size, args.steps, args.seed, timeout=600)[0]
    print(f"final loss {losses[-1]:.4f} (first {losses[0]:.4f})")


if __name__ == "__main__":
    main()
