"""Heterogeneous sequence-parallel groups vs one group: tokens/s on the GitHubCode-like trace.

Usage::

    python benchmarks/groups.py                # 4 gloo processes, about 2 minutes on 2 CPU cores
    python benchmarks/groups.py --steps 4 --warmup 1   # a smoke run (under a minute)

Every run trains the same LightningModule (``llama-tiny`` widened, see ``MODEL``) with
``ParaDySeStrategy`` on the same packed batches: documents with GitHubCode-like lengths (the paper's bucket
shares scaled to ``--max-len``) packed under a token budget. The runs:

* ``groups``: ``groups=True``, the planner splits the ranks per step (sizes 1, 2, 4) and the documents
  among them (cost: the measured machine, attention per document);
* ``adaptive``: one group of every rank, the per-batch adaptive plan;
* one run per static mode (``tp_sp``, ``ulysses``, ``ring``, ``metp``), one group.

Reported per run: real tokens per second over the timed steps (the first ``--warmup`` steps are not
timed), and for ``groups`` the split chosen per step and the predicted vs measured imbalance (slowest
group over the mean). Results go to ``benchmarks/results/groups.{json,md}``. All runs are timed in one
invocation, so their ratios are comparable; absolute times are this machine's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_paradyse import ParaDySeStrategy, ParaDySeSwitcher
from lightning_paradyse.data.batching import BatchingConfig, pack_documents, plan_batches
from lightning_paradyse.data.length_traces import length_trace
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.models import LlamaConfig
from lightning_paradyse.models.llama import Llama
from lightning_paradyse.runtime import parallel

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = LlamaConfig(vocab_size=256, n_layers=4, hidden=128, n_heads=8, n_kv_heads=4, ffn=384, max_seq_len=4096)
"""A small Llama whose steps take long enough on CPU to time (8 heads: every group size up to 8 divides them)."""
STATIC = ("tp_sp", "ulysses", "ring", "metp")


class PackedLM(pl.LightningModule):
    """An ordinary LightningModule for packed batches (positions from the batch), whose documents attend only within
    themselves, in one process too (each runs on its own there: ``keeps_documents_apart``)."""

    keeps_documents_apart = True

    def __init__(self) -> None:
        super().__init__()
        self.model = Llama(MODEL)

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = parallel.run_documents(self.model, batch["input_ids"], batch["positions"], batch["doc_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())  # logits [1, s_r, vocab]

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def batches(steps: int, max_len: int, max_tokens: int, seed: int) -> list[dict[str, Tensor]]:
    """Packed batches of GitHubCode-like documents, ``steps`` of them, shuffled."""
    lengths = length_trace("github", 40 * steps, max_len, seed=seed, min_len=8)
    plan = plan_batches(lengths, BatchingConfig(max_tokens=max_tokens, max_len=max_len, pack=True, order="shuffled"))
    gen = torch.Generator().manual_seed(seed)
    return [
        pack_documents([torch.randint(0, MODEL.vocab_size, (lengths[i],), generator=gen) for i in chunk])
        for chunk in plan[:steps]
    ]


class Timer(pl.Callback):
    """Wall time of every step and the group metrics the switcher logs."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.groups: list[dict[str, float]] = []
        self._start = 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)
        record = getattr(trainer.strategy, "step_record", None)
        metrics = dict(record.metrics) if record is not None else {}
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, ParaDySeSwitcher):  # the measured numbers
                metrics.update(callback.metrics)
        if "groups/count" in metrics:
            keys = ("groups/count", "groups/predicted_imbalance", "groups/measured_imbalance", "groups/solve_s")
            self.groups.append({k.split("/")[1]: float(metrics[k]) for k in keys if k in metrics})


def fit(name: str, data: list[dict[str, Tensor]], devices: int) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    kwargs: dict[str, Any] = {"groups": True} if name == "groups" else {}
    if name in STATIC:
        kwargs["plan"] = name
    timer = Timer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ParaDySeStrategy(timeout=120, **kwargs),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[timer],
        max_steps=len(data),
        log_every_n_steps=1,  # the strategy measures the group times on the steps it logs: every one here
    )
    trainer.fit(PackedLM(), train_dataloaders=DataLoader(data, batch_size=None))
    return {"times": timer.times, "groups": timer.groups}


def worker(rank: int, world: int, runs: list[str], data: list[dict[str, Tensor]], port: int) -> bytes:
    dist.destroy_process_group()  # the strategy makes its own
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    out = {}
    for k, name in enumerate(runs):
        os.environ["MASTER_PORT"] = str(port + k)
        out[name] = fit(name, data, world)
        if rank == 0:
            print(f"[groups benchmark] {name}: {sum(out[name]['times']):.1f} s", file=sys.stderr, flush=True)
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def summarise(results: dict[str, Any], data: list[dict[str, Tensor]], warmup: int) -> dict[str, Any]:
    tokens = sum(int((b["targets"] != -100).sum()) for b in data[warmup:])
    rows = {}
    for name, run in results.items():
        seconds = sum(run["times"][warmup:])
        rows[name] = {"seconds": seconds, "tokens_per_s": tokens / seconds}
        if run["groups"]:
            timed = run["groups"][warmup:]
            rows[name]["splits"] = [int(g["count"]) for g in run["groups"]]
            rows[name]["predicted_imbalance"] = sum(g["predicted_imbalance"] for g in timed) / len(timed)
            rows[name]["measured_imbalance"] = sum(g["measured_imbalance"] for g in timed) / len(timed)
            rows[name]["solve_ms"] = 1e3 * max(g.get("solve_s", 0.0) for g in timed)
    return {"timed_tokens": tokens, "runs": rows}


def markdown(summary: dict[str, Any], args: argparse.Namespace) -> str:
    rows = summary["runs"]
    static = {k: v for k, v in rows.items() if k in STATIC}
    best = max(static, key=lambda k: static[k]["tokens_per_s"]) if static else None
    lines = [
        f"# Heterogeneous groups vs one group ({args.devices} gloo processes, GitHubCode-like trace)",
        "",
        f"`python benchmarks/groups.py --steps {args.steps} --max-len {args.max_len} --max-tokens {args.max_tokens}`: "
        f"{summary['timed_tokens']} real tokens timed over {args.steps - args.warmup} packed steps.",
        "",
        "| run | seconds | tokens/s | vs best static |",
        "|---|---:|---:|---:|",
    ]
    for name, row in rows.items():
        ratio = row["tokens_per_s"] / rows[best]["tokens_per_s"] if best else float("nan")
        lines.append(f"| {name} | {row['seconds']:.2f} | {row['tokens_per_s']:.0f} | {ratio:.2f}x |")
    if "groups" in rows and "predicted_imbalance" in rows["groups"]:
        g = rows["groups"]
        lines += [
            "",
            f"Number of groups per step: {g['splits']}. Imbalance (slowest group / mean), mean over the timed steps: "
            f"predicted {g['predicted_imbalance']:.2f}, measured {g['measured_imbalance']:.2f}. Longest split "
            f"decision (solver, documents cut out, plans checked): {g.get('solve_ms', 0.0):.1f} ms.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=16, help="packed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--max-len", type=int, default=2048, help="longest document")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per packed step")
    p.add_argument("--runs", type=str, default=",".join(("groups", "adaptive", *STATIC)))
    p.add_argument("--out", type=Path, default=RESULTS / "groups.json")
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        p.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    data = batches(args.steps, args.max_len, args.max_tokens, seed=0)
    runs = args.runs.split(",")
    with socket.socket() as sock:  # a free port for the strategy's process groups (one per run from here)
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    raw = run_distributed(worker, args.devices, runs, data, port, timeout=3000)
    results = torch.load(io.BytesIO(raw[0]), weights_only=False)
    summary = summarise(results, data, args.warmup)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": vars(args) | {"out": args.out.name}, **summary}, indent=2))
    report = markdown(summary, args)
    args.out.with_suffix(".md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
