"""One command that proves the project on a GPU: ``python benchmarks/gpu_check.py`` (aimed at under 10 minutes on
one H100 or H200); it prints one table last.

Rows (each passes or fails on its own; ``--only NAME,...`` runs some):

* ``exact-p2``, ``exact-p4``, ``exact-shared``: the float64 exactness cases of ``tests/exact`` (every mode, mixed
  plans, groups, packed documents, windows, Hugging Face Llama, the CLI module) with 2 and 4 ranks sharing the GPU
  over gloo, against one plain Lightning process on the same GPU (``PARADYSE_TEST_ACCELERATOR=gpu``), tolerance
  1e-9; ``exact-shared``: ``Trainer(devices=1, strategy=ParaDySeStrategy(ranks_per_device=2))`` as a user starts it.
* ``families-p2``: Hugging Face families (Qwen3, Gemma 2, Mixtral, GPT-2, ...) in float64 on the GPU at p = 2
  (``PARADYSE_TEST_DEVICE=cuda``); ``moe-defaults``: Mixtral and Qwen3-MoE with the default grouped-GEMM experts.
* ``bf16``: bf16-mixed and bf16-true in every mode and on groups, within bf16's measured noise of one process.
* ``main-job``, ``hf-yaml``: the README's main job and the Hugging Face YAML on one GPU (``cli.py fit``), their two
  ranks sharing it.
* ``memory-<mode>``: a Hugging Face Llama (hidden 1024, 8 layers, 8,192 tokens, bf16-mixed) on 2 ranks sharing the
  GPU, the planner held to one mode: peak CUDA memory of setup and of saving a checkpoint against the steady
  training peak (each <= 1.25x), and the planner's predicted peak against the measured one (within 5%).
* ``profile``: ``cli.py profile --device cuda --quick`` on 2 ranks sharing the GPU.
* ``host-syncs``: a data-parallel step the logger does not log synchronises the host once, at its agreement, and
  once more where its ranks share the GPU over gloo (gloo stages the return's device tensors through the host;
  ``tests/lightning/test_cycle.py``, a GPU test).
* ``quick-p8-cpu``: the quick preset at 8 processes on the machine's CPU cores (``CUDA_VISIBLE_DEVICES=""
  benchmarks/run.py --quick --devices 8 --repeats 1``): its adaptive/DDP ratio, which issue 24 asks at 8
  processes on at least 8 cores (only the GPU machine has them; a few minutes: it runs only when ``--only`` names
  it).
* ``step-p8-cpu``: ``benchmarks/step_overhead.py --devices 8`` there too (a minute; only when ``--only`` names it):
  a data-parallel step's wall time against DDP's and the part before the loss, where the weight gather is.

``--device cpu`` runs the same rows on the host (a dry run of this script: memory rows report no CUDA peak).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_paradyse import ParaDySeStrategy, ParaDySeSwitcher  # noqa: E402
from lightning_paradyse.lightning.language_model import LanguageModel  # noqa: E402

SETUP_LIMIT = 1.25
"""Setup and checkpoint peaks per rank, at most this many times the steady training peak."""
MEMORY_ERROR = 0.05
"""Predicted peak memory within this share of the measured one."""


@dataclass
class Row:
    name: str
    ok: bool
    measured: str
    limit: str
    seconds: float


LOG_DIR: Path | None = None
"""Where each row's whole output is written (``--log-dir``), as ``<row>.log``."""


def _log(name: str, text: str) -> None:
    if LOG_DIR is not None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        (LOG_DIR / f"{name}.log").write_text(text)


def _run(cmd: list[str], cwd: str | Path, timeout: float, env: dict[str, str] | None = None) -> tuple[str, bool]:
    """``cmd``'s stdout and stderr, and whether it exited 0 (``env``: added to this process's environment)."""
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        partial = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (err.stdout, err.stderr)]
        return "".join(partial) + f"\ntimed out after {timeout:.0f} s", False
    return proc.stdout + proc.stderr, proc.returncode == 0


def _pytest(name: str, targets: list[str], env: dict[str, str], timeout: float) -> Row:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--maxfail=3", "-rfE", *targets]
    out, ok = _run(cmd, ROOT, timeout, env)
    _log(name, out)
    counts = re.findall(r"(\d+) (passed|failed|errors?|skipped)", out)
    lines = out.strip().splitlines()
    summary = ", ".join(f"{n} {what}" for n, what in counts) or (lines[-1][:80] if lines else "no output")
    if not ok:
        print(f"--- {name} ---\n{out[-6000:]}", flush=True)
    return Row(name, ok, summary, "all pass", time.perf_counter() - start)


def _cli(name: str, config: str, accelerator: str, extra: list[str], timeout: float) -> Row:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(ROOT / config)]
        cmd += [f"--trainer.accelerator={accelerator}", "--trainer.devices=1", f"--trainer.default_root_dir={tmp}"]
        cmd += ["--trainer.strategy.init_args.profile=null", "--trainer.max_steps=20"]  # a CPU profile: refused
        cmd += ["--trainer.strategy.init_args.ranks_per_device=2", *extra]  # the configs' 2 ranks, on the one device
        out, ok = _run(cmd, tmp, timeout)
    _log(name, out)
    loss = re.findall(r"final loss ([0-9.]+)", out)
    if not ok:
        print(f"--- {name} ---\n{out[-6000:]}", flush=True)
    return Row(name, ok, f"final loss {loss[-1]}" if loss else "no final loss", "trains", time.perf_counter() - start)


# --------------------------------------------------------------------------------------------------
# Memory: setup, steady training and checkpoint peaks per rank; predicted against measured
# --------------------------------------------------------------------------------------------------

MEMORY_MODEL = {
    "class": "LlamaConfig",
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "attn_implementation": "sdpa",
}


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """``steps`` batches of ``rows`` random token windows of one length (targets shifted in the data)."""

    def __init__(self, length: int, steps: int, vocab: int, rows: int = 1) -> None:
        self.length, self.steps, self.vocab, self.rows = length, steps, vocab, rows

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shape = (self.rows, self.length + 1)
        window = torch.randint(0, self.vocab, shape, generator=torch.Generator().manual_seed(i))
        return {"input_ids": window[:, :-1], "targets": window[:, 1:]}


def _on_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _peak() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if _on_gpu() else None


def _reset() -> None:
    if _on_gpu():
        torch.cuda.reset_peak_memory_stats()


class MemoryProbe(pl.Callback):
    """Peak MiB of setup, of every training step (after the first) and of saving a checkpoint, on every rank; the
    planner's predicted peak of every step. Each rank writes ``rank<r>.json`` into ``out``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.record: dict[str, Any] = {"steps": [], "predicted": []}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _reset()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record["setup"] = _peak()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        switcher = next(c for c in trainer.callbacks if isinstance(c, ParaDySeSwitcher))  # type: ignore[attr-defined]
        self.record["steps"].append(switcher.metrics.get("plan/measured_peak_mib"))
        self.record["predicted"].append(switcher.metrics.get("plan/predicted_peak_mib"))
        record = trainer.strategy.step_record  # type: ignore[attr-defined]
        self.record.setdefault("plans", []).append(str(record.plan))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _reset()
        trainer.save_checkpoint(os.path.join(self.out, "last.ckpt"))
        self.record["checkpoint"] = _peak()
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))


def _memory_fit(mode: str, accelerator: str, length: int, out: str) -> None:
    pl.seed_everything(0, verbose=False)
    module = LanguageModel(
        hf_config=MEMORY_MODEL
        if accelerator == "gpu"
        else {
            **MEMORY_MODEL,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 128,
        }
    )
    data = DataLoader(Tokens(length, 4, module.vocab_size), batch_size=None)
    strategy = ParaDySeStrategy(plan="auto", modes=[mode], groups=False, ranks_per_device=2, check_step=False)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        precision="bf16-mixed" if accelerator == "gpu" else "32-true",
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[MemoryProbe(out)],
    )
    trainer.fit(module, data)


def _memory(mode: str, accelerator: str) -> Row:
    start = time.perf_counter()
    length = 8192 if accelerator == "gpu" else 256
    with tempfile.TemporaryDirectory() as out:
        try:
            _memory_fit(mode, accelerator, length, out)
            ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        except Exception as err:  # a failed fit is a failed row, with its reason
            print(f"--- memory-{mode} ---\n{type(err).__name__}: {err}", flush=True)
            return Row(f"memory-{mode}", False, f"{type(err).__name__}", "runs", time.perf_counter() - start)
    if len(ranks) != 2:
        return Row(f"memory-{mode}", False, f"{len(ranks)} rank record(s)", "2 ranks", time.perf_counter() - start)
    if ranks[0]["setup"] is None:
        return Row(f"memory-{mode}", True, "no CUDA peak (host)", "n/a", time.perf_counter() - start)
    worst_ratio, worst_err, worst_pair = 0.0, 0.0, (0.0, 0.0)
    for r in ranks:
        steady = max(x for x in r["steps"][1:] if x is not None)
        worst_ratio = max(worst_ratio, r["setup"] / steady, r["checkpoint"] / steady)
        pairs = [(p, m) for p, m in zip(r["predicted"][1:], r["steps"][1:]) if p is not None and m is not None]
        for p, m in pairs:
            if abs(p - m) / m >= worst_err:
                worst_err, worst_pair = abs(p - m) / m, (p, m)
    ok = worst_ratio <= SETUP_LIMIT and worst_err <= MEMORY_ERROR
    predicted = f"predicted {worst_pair[0]:.0f} MiB against {worst_pair[1]:.0f} ({worst_err * 100:.1f}% off)"
    if worst_pair == (0.0, 0.0):
        predicted, ok = "no predicted and measured peaks", False
    measured = f"setup/ckpt {worst_ratio:.2f}x steady, {predicted}, {ranks[0]['plans'][-1].split(' | ')[0]}"
    limit = f"<= {SETUP_LIMIT}x, <= {MEMORY_ERROR * 100:.0f}%"
    return Row(f"memory-{mode}", ok, measured, limit, time.perf_counter() - start)


def _profile(device: str, timeout: float) -> Row:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "profile.json")
        cmd = [sys.executable, str(ROOT / "cli.py"), "profile", "--quick", "-p", "2", "--device", device, "--out", out]
        text, ok = _run([*cmd, "--no-progress"], ROOT, timeout)
        _log("profile", text)
        meta = json.loads(Path(out).read_text())["meta"] if ok else {}
    if not ok:
        print(f"--- profile ---\n{text[-6000:]}", flush=True)
    machine = next((line for line in text.splitlines() if line.startswith("machine:")), "no machine line")
    measured = f"{meta.get('device', '?')}: {machine.removeprefix('machine: ')[:60]}"
    return Row("profile", ok, measured, "runs", time.perf_counter() - start)


def _quick_cpu(devices: int, timeout: float) -> Row:
    """The quick preset at ``devices`` processes on the host's cores (the GPU hidden), one timed pass: the adaptive
    run's ratio to DDP (a row that fails only when the run does; the ratio is what it measures)."""
    start = time.perf_counter()
    if (os.cpu_count() or 1) < devices:
        return Row(f"quick-p{devices}-cpu", False, f"{os.cpu_count()} cores", f">= {devices} cores", 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--devices", str(devices)]
        cmd += ["--repeats", "1", "--no-plots", "--out", str(Path(tmp) / "quick.json")]
        out, ok = _run(cmd, ROOT, timeout, {"CUDA_VISIBLE_DEVICES": ""})
    _log(f"quick-p{devices}-cpu", out)
    ratio = re.findall(r"adaptive/DDP ([0-9.]+x)", out)
    if not ok:
        print(f"--- quick-p{devices}-cpu ---\n{out[-6000:]}", flush=True)
    measured = f"adaptive/DDP {ratio[-1]}" if ratio else "no ratio"
    return Row(f"quick-p{devices}-cpu", ok, measured, "runs (>= 1.0x asked)", time.perf_counter() - start)


def _step_cpu(devices: int, timeout: float) -> Row:
    """``benchmarks/step_overhead.py`` at ``devices`` processes on the host's cores (the GPU hidden): a
    data-parallel step's wall time against DDP's and its part before the loss (the decision and the weight gather,
    one all-to-all where every rank has a core), both runs', and the wall time of our step's begin and gradient return
    (``--functions``: every function's in the log). A row that fails only when the script does."""
    name, start = f"step-p{devices}-cpu", time.perf_counter()
    if (os.cpu_count() or 1) < devices:
        return Row(name, False, f"{os.cpu_count()} cores", f">= {devices} cores", 0.0)
    script = str(ROOT / "benchmarks" / "step_overhead.py")
    cmd = [sys.executable, script, "--devices", str(devices), "--repeats", "1", "--functions"]
    out, ok = _run(cmd, ROOT, timeout, {"CUDA_VISIBLE_DEVICES": ""})
    _log(name, out)
    ratio = re.findall(r"DDP / ours \(median wall step\): ([0-9.]+x)", out)
    parts = re.findall(r"^\s+(paradyse|ddp)\s+([0-9.]+)\s+[0-9.]+\s", out, re.MULTILINE)  # the parts: to the loss
    ours = dict(re.findall(r"^\s+(StepCycle\.\w+)\s+paradyse\s+[0-9.]+\s+([0-9.]+)\s", out, re.MULTILINE))  # wall
    if not ok:
        print(f"--- {name} ---\n{out[-6000:]}", flush=True)
    loss = ", ".join(f"{run} {ms} ms" for run, ms in parts[:2])
    measured = f"DDP/ours {ratio[-1]}; to the loss {loss}" if ratio else "no ratio"
    if "StepCycle.begin" in ours and "StepCycle.after_backward" in ours:
        measured += f"; our begin {ours['StepCycle.begin']} ms, return {ours['StepCycle.after_backward']} ms"
    return Row(name, ok, measured, "runs (the step's parts)", time.perf_counter() - start)


EXACT = "tests/exact/test_exact.py::"
FAMILIES = "tests/graph/test_families.py::"
PYTEST_ROWS: dict[str, tuple[list[str], float]] = {
    "exact-p2": ([EXACT + "test_two_processes_equal_plain_lightning"], 400),
    "exact-p4": ([EXACT + "test_four_processes_on_groups_equal_plain_lightning"], 400),
    "exact-shared": ([EXACT + "test_ranks_sharing_one_device_equal_plain_lightning"], 200),
    "families-p2": ([FAMILIES + "test_hugging_face_families_match_single_process_in_float64"], 400),
    "moe-defaults": (["tests/graph/test_families.py", "-k", "default_grouped_gemm"], 200),
    "bf16": (["tests/lightning/test_bf16.py"], 400),
    "host-syncs": (["tests/lightning/test_cycle.py", "-k", "synchronises_the_host"], 200),
}
"""Rows that run tests of the suite on the device: targets and the time limit (seconds)."""
CLI_ROWS = {"main-job": "configs/cpu_2proc.yaml", "hf-yaml": "configs/hf_llama_cpu.yaml"}
OPT_IN = {"quick-p8-cpu", "step-p8-cpu"}
"""Rows that run only when ``--only`` names them (CPU benchmarks of a few minutes, not checks of the GPU path)."""
MEMORY_MODES = ("tp_sp", "ulysses", "ring", "metp")


def rows(device: str, only: list[str] | None) -> list[Row]:
    """Every row (or those ``only`` names, in its order)."""
    accelerator = "gpu" if device == "cuda" else "cpu"
    env = {"PARADYSE_TEST_ACCELERATOR": accelerator, "PARADYSE_TEST_DEVICE": device}
    names = [*PYTEST_ROWS, *CLI_ROWS, *(f"memory-{m}" for m in MEMORY_MODES), "profile", *sorted(OPT_IN)]
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        raise SystemExit(f"unknown row(s) {unknown}; the rows are {names}")
    out = []
    for name in only if only is not None else [n for n in names if n not in OPT_IN]:
        print(f"[gpu_check] {name} ...", flush=True)
        if name in PYTEST_ROWS:
            out.append(_pytest(name, PYTEST_ROWS[name][0], env, PYTEST_ROWS[name][1]))
        elif name in CLI_ROWS:
            out.append(_cli(name, CLI_ROWS[name], accelerator, [], 300))
        elif name.startswith("memory-"):
            out.append(_memory(name.removeprefix("memory-"), accelerator))
        elif name == "quick-p8-cpu":
            out.append(_quick_cpu(8, 560))
        elif name == "step-p8-cpu":
            out.append(_step_cpu(8, 240))
        else:
            out.append(_profile(device, 400))
        r = out[-1]
        print(f"[gpu_check] {r.name}: {'pass' if r.ok else 'FAIL'}, {r.measured} ({r.seconds:.0f} s)", flush=True)
    return out


def table(results: list[Row], device: str) -> str:
    name = torch.cuda.get_device_name(0) if device == "cuda" else "host CPU"
    lines = [f"gpu_check on {name} (torch {torch.__version__})", "", "| row | result | measured | limit | s |"]
    lines.append("|---|---|---|---|---|")
    for r in results:
        lines.append(f"| {r.name} | {'pass' if r.ok else 'FAIL'} | {r.measured} | {r.limit} | {r.seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default=None, help="comma-separated rows, run in that order (default: every row)")
    parser.add_argument("--log-dir", type=Path, default=None, help="write each row's whole output to <row>.log here")
    args = parser.parse_args(argv)
    global LOG_DIR
    LOG_DIR = args.log_dir
    results = rows(args.device, None if args.only is None else args.only.split(","))
    print(table(results, args.device))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
