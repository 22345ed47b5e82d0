"""One rank stalls; check that no process of the run outlives the others' collective timeout.

A 2-process fit of ``llama-tiny`` where rank ``--stall-rank`` sleeps inside its ``training_step`` at step 2 (a
stuck data source, a deadlock in user code). The other rank waits in the step's first collective until the
strategy's ``timeout`` ends it with an error; the run must then end as a whole: ``trainer.fit`` raises in the
launching process and every worker is gone, the stalled one included, well before the stall would have ended.

Usage::

    python benchmarks/stall_check.py                           # start_method=spawn, rank 1 stalls
    python benchmarks/stall_check.py --start-method popen --timeout 15   # the script launcher (rank 0 is this process)
    python benchmarks/stall_check.py --start-method popen --timeout 15 --stall-rank 0   # see below
    python benchmarks/stall_check.py --sigterm-ends-stall      # spawn's SIGTERM ends the stall (30 s sooner)

Prints how the fit ended and how long it took, then checks the process table for any process of the run (each
carries a marker in its environment). Exit status 0 when the fit raised and no process of the run is left, else 1
(the leftovers are killed). Under ``popen`` with rank 0 stalled, the failed rank 1 makes Lightning's process
observer kill the whole run, this script's launching process included (exit status 137, nothing reported).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_paradyse import ParaDySeStrategy  # noqa: E402
from lightning_paradyse.models import build_model  # noqa: E402

MARKER = "PARADYSE_STALL_CHECK"
"""Environment variable every process of one run inherits (its value names the run)."""


class StallingLM(pl.LightningModule):
    """Mean token cross-entropy; rank ``stall_rank`` sleeps for ``stall_s`` seconds at step ``stall_step``.

    ``sigterm_ends``: the sleep ends the process on SIGTERM (the default action) instead of running Lightning's
    handler, which lets the rank sleep on: under ``spawn`` torch then kills it only 30 s after its SIGTERM."""

    def __init__(self, stall_rank: int, stall_s: float, stall_step: int = 2, sigterm_ends: bool = False) -> None:
        super().__init__()
        self.model = build_model("llama-tiny")
        self.stall_rank, self.stall_s, self.stall_step = stall_rank, stall_s, stall_step
        self.sigterm_ends = sigterm_ends

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if batch_idx == self.stall_step and self.global_rank == self.stall_rank:
            if self.sigterm_ends:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(self.stall_s)
        tokens, targets = batch
        logits = self.model(tokens)  # [b, s_r, vocab] on this rank's tokens
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batches(n: int) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(0)
    windows = [torch.randint(0, 128, (2, 41), generator=gen) for _ in range(n)]
    return [(w[:, :-1], w[:, 1:].clone()) for w in windows]


def run_processes(marker: str, helpers: bool = False) -> list[int]:
    """Process ids (other than this one) whose environment carries ``MARKER=marker``; without ``helpers``, not
    multiprocessing's resource tracker (it lives as long as the launching process, by design)."""
    found = []
    needle = f"{MARKER}={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if needle in environ and (helpers or b"resource_tracker" not in cmdline):
            found.append(int(entry))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "popen"])
    parser.add_argument("--stall-rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=10.0, help="the strategy's collective timeout (s)")
    parser.add_argument("--stall", type=float, default=300.0, help="how long the stalled rank sleeps (s)")
    parser.add_argument("--grace", type=float, default=20.0, help="seconds after the fit for the workers to go")
    parser.add_argument(
        "--sigterm-ends-stall", action="store_true", help="the stalled rank dies on SIGTERM (see StallingLM)"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    marker = os.environ.setdefault(MARKER, uuid.uuid4().hex)  # inherited by every worker of this run
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ParaDySeStrategy(plan="tp_sp", timeout=args.timeout, start_method=args.start_method),
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    start = time.monotonic()
    outcome = "finished"
    try:
        trainer.fit(
            StallingLM(args.stall_rank, args.stall, sigterm_ends=args.sigterm_ends_stall),
            DataLoader(batches(4), batch_size=None),
        )
    except BaseException as err:  # the expected end: the collective timed out on the rank that waited
        outcome = f"raised {type(err).__name__}: {str(err).strip().splitlines()[0][:160] if str(err).strip() else ''}"
    took = time.monotonic() - start
    if trainer.global_rank != 0:  # a script-launched worker (popen): only the launching process reports
        return 0 if outcome == "finished" else 1  # a failed worker exits non-zero, as it would without the check
    print(f"fit {outcome} after {took:.1f} s (timeout {args.timeout:.0f} s, stall {args.stall:.0f} s)", flush=True)
    deadline = time.monotonic() + args.grace
    left = run_processes(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = run_processes(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    print(f"processes of the run left {args.grace:.0f} s after the fit: {len(left)} {left}", flush=True)
    return 0 if outcome != "finished" and not left else 1


if __name__ == "__main__":
    sys.exit(main())
