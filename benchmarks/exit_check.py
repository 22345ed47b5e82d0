"""Run many short 2-process fits in a row and count the ones whose workers exit abnormally.

Each fit is a fresh ``Trainer(devices=2, accelerator="cpu", strategy=ParaDySeStrategy(plan=...))`` with the default
``start_method="spawn"``: the launcher spawns two new worker processes, trains a few steps of ``llama-tiny`` and
joins them. A fit is *abnormal* when ``trainer.fit`` raises (for instance ``ProcessExitedException: process 1
terminated with signal SIGABRT`` after the last step) or when a worker writes ``terminate called`` to stderr.

The abort is a race at interpreter exit: a gloo group still alive then (``dist.destroy_process_group`` only
unregisters it; anything still referring to it keeps it and its worker threads) has a worker that must take the GIL
to free the last collective's tensors, and Python ends that thread inside C++ (``std::terminate``). Its rate depends
on the machine's load, so two more signals are given:

* ``--check-release``: every worker checks, after the strategy's teardown, that its process group is really gone
  (deterministic: the race's precondition). The check (a garbage collection, a line to stderr) gives the gloo
  workers time to finish while Python still runs, so it hides the abort itself: count aborts without it;
* ``--starve`` emulates a loaded machine (see :func:`starve_background_threads`), which makes the race frequent.

Usage::

    python benchmarks/exit_check.py --fits 100                 # the ParaDySe strategy, plan metp
    python benchmarks/exit_check.py --fits 20 --starve         # the same, under the stress
    python benchmarks/exit_check.py --fits 2 --check-release   # is the process group gone after teardown?
    python benchmarks/exit_check.py --fits 20 --plan ring      # another fixed plan (or "auto", or JSON)
    python benchmarks/exit_check.py --fits 20 --strategy ddp_spawn   # Lightning's own, for comparison

Prints one line per fit (``ok`` or what went wrong) and a summary ``abnormal: K / N``. Exit status: 1 when a fit
was abnormal, else 2 when a process group outlived teardown, else 0. Each fit's worker stderr is captured at the
file-descriptor level (``--keep-logs DIR`` keeps the logs of abnormal fits). Two training processes at a time; prefix
with ``nice -n 10`` on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_paradyse import ParaDySeStrategy  # noqa: E402
from lightning_paradyse.models import build_model  # noqa: E402

MARKERS = ("terminate called", "Fatal Python error", "Segmentation fault", "Aborted", "core dumped")
"""Text in a worker's stderr that means the process died abnormally (even if the fit itself returned)."""
LEAK = "process group outlived teardown"
"""What a worker of :class:`ReleaseCheck` writes to stderr when its process group is still alive after teardown."""


class ReleaseCheck(ParaDySeStrategy):
    """The strategy, reporting from each worker whether its process group is really gone after teardown.

    ``dist.destroy_process_group`` only unregisters a group: while a reference is left, the gloo group and its
    worker threads live on until the interpreter finalizes, and a worker still holding the last collective's work
    then aborts the process (the race this script counts). A group that outlived teardown is that race's
    precondition, reported whatever the timing: the deterministic half of the check.
    """

    def setup_environment(self) -> None:
        super().setup_environment()
        world = dist.group.WORLD if dist.is_initialized() else None
        self._world_ref = None if world is None else weakref.ref(world)

    def teardown(self) -> None:
        super().teardown()
        ref = getattr(self, "_world_ref", None)
        gc.collect()
        if ref is not None and ref() is not None:
            threads = len(os.listdir("/proc/self/task"))
            print(f"[exit_check] rank {self.global_rank}: {LEAK} ({threads} threads)", file=sys.stderr, flush=True)


def starve_background_threads() -> None:
    """Stress: emulate a busy machine for this process's background threads (gloo's workers among them).

    Every thread of the process is pinned to one CPU and every thread but the calling (main) one gets
    ``SCHED_IDLE``: it runs only while the main thread blocks (in a collective's wait, on I/O, in a join).
    A gloo worker that has just completed the main thread's last collective then still holds that work when
    the main thread goes on without blocking, as a worker descheduled on a loaded machine does; whatever it
    does afterwards happens at the main thread's next blocking call, or never.
    """
    cpu = int(os.environ.get("LOCAL_RANK", "0")) % (os.cpu_count() or 1)
    main = threading.get_native_id()
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, {cpu})
            if tid != main:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


class TinyLM(pl.LightningModule):
    """An ordinary LightningModule: mean token cross-entropy of a reference model, no parallel code."""

    def __init__(self, model: str = "llama-tiny", starve: bool = False) -> None:
        super().__init__()
        self.model = build_model(model)
        self.starve = starve

    def setup(self, stage: str) -> None:
        if self.starve:  # in every worker, once the strategy made its process group (and gloo its threads)
            starve_background_threads()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        tokens, targets = batch
        logits = self.model(tokens)  # [b, s_r, vocab] on this rank's tokens
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class LengthData(Dataset[Any]):
    """Item ``i`` is a whole batch of 2 sequences of ``lengths[i]`` tokens (targets shifted by one)."""

    def __init__(self, lengths: tuple[int, ...]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Any:
        gen = torch.Generator().manual_seed(i)
        window = torch.randint(0, 128, (2, self.lengths[i] + 1), generator=gen)
        return window[:, :-1], window[:, 1:].clone()


@contextlib.contextmanager
def captured_stderr(path: str) -> Iterator[None]:
    """Send file descriptor 2 (this process's and the spawned workers') to ``path`` for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def parse_plan(text: str) -> Any:
    """A mode name / ``auto``, or a JSON list with one entry per layer."""
    return json.loads(text) if text.lstrip().startswith("[") else text


def one_fit(args: argparse.Namespace) -> None:
    pl.seed_everything(0, verbose=False)
    if args.strategy == "paradyse":
        cls = ReleaseCheck if args.check_release else ParaDySeStrategy
        strategy: Any = cls(plan=parse_plan(args.plan), timeout=60)
    else:
        strategy = args.strategy
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    lengths = tuple(args.lengths[i % len(args.lengths)] for i in range(args.steps))
    trainer.fit(TinyLM(args.model, args.starve), DataLoader(LengthData(lengths), batch_size=None))
    if not trainer.state.finished:
        raise RuntimeError(f"trainer state {trainer.state.status} after fit")


def classify(error: BaseException | None, log: str) -> str | None:
    """``None`` for a clean fit, else a short description of what went wrong."""
    found = [m for m in MARKERS if m in log]
    if error is None and not found:
        return None
    parts = []
    if error is not None:
        parts.append(f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
    if found:
        parts.append("stderr: " + ", ".join(found))
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fits", type=int, default=20, help="number of fits (default 20)")
    parser.add_argument("--plan", default="metp", help='fixed plan: a mode, "auto", or a JSON list (default metp)')
    parser.add_argument("--strategy", default="paradyse", help='"paradyse" (default) or a Lightning name (ddp_spawn)')
    parser.add_argument("--model", default="llama-tiny", help="model config name (default llama-tiny)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per fit (default 3)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 90, 150], help="sequence lengths cycled")
    parser.add_argument(
        "--starve",
        action="store_true",
        help="stress: pin each worker to one CPU and run its background threads (gloo's) at SCHED_IDLE, as on a "
        "loaded machine (see starve_background_threads)",
    )
    parser.add_argument(
        "--check-release",
        action="store_true",
        help="check in the workers that the process group is gone after teardown (ReleaseCheck; hides the race)",
    )
    parser.add_argument("--keep-logs", default=None, help="directory for the worker stderr of abnormal fits")
    parser.add_argument("--verbose", action="store_true", help="print every fit's captured stderr tail")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")  # inherited by the spawned workers: a stack on SIGABRT
    warnings.filterwarnings("ignore")
    if args.keep_logs:
        os.makedirs(args.keep_logs, exist_ok=True)

    kinds: Counter[str] = Counter()
    abnormal = leaks = 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.fits):
            log_path = os.path.join(tmp, f"fit{i}.log")
            error: BaseException | None = None
            t0 = time.monotonic()
            with captured_stderr(log_path):
                try:
                    one_fit(args)
                except Exception as err:  # a dead worker surfaces as an exception of the launcher
                    error = err
                    traceback.print_exc()
            log = Path(log_path).read_text(errors="replace")
            problem = classify(error, log)
            leaked = log.count(LEAK)
            if leaked:
                leaks += 1
            took = time.monotonic() - t0
            note = f"; {LEAK} on {leaked} rank(s)" if leaked else ""
            if problem is None:
                print(f"fit {i + 1:4d}/{args.fits}: ok ({took:.1f} s){note}", flush=True)
            else:
                abnormal += 1
                kinds[problem] += 1
                print(f"fit {i + 1:4d}/{args.fits}: ABNORMAL ({took:.1f} s): {problem}{note}", flush=True)
                if args.keep_logs:
                    Path(args.keep_logs, f"fit{i + 1}.log").write_text(log)
            if args.verbose or (problem is not None and not args.keep_logs):
                tail = "\n".join(log.strip().splitlines()[-25:])
                if tail:
                    print("    | " + tail.replace("\n", "\n    | "), flush=True)
    print(
        f"abnormal: {abnormal} / {args.fits} fits (strategy={args.strategy}, plan={args.plan}, model={args.model}, "
        f"steps={args.steps}) in {time.monotonic() - start:.0f} s"
    )
    if args.strategy == "paradyse" and args.check_release:
        print(f"{LEAK} (in at least one worker): {leaks} / {args.fits} fits")
    for kind, count in kinds.most_common():
        print(f"  {count:4d}  {kind}")
    return 1 if abnormal else 2 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
