"""Benchmark ParaDySe against every static mode and against Lightning's own strategies.

Usage::

    python benchmarks/run.py                     # the full benchmark (about 50 minutes on 2 CPU cores)
    python benchmarks/run.py --quick             # the smoke run (under 3 minutes), into benchmarks/results/quick/

It spawns ``--devices`` processes (gloo on CPU with one thread each; NCCL with one GPU each when CUDA is
available: the same command), trains the same LightningModule under every run on the same global batches of
the same length traces (one optimizer step per global batch of several sequences, see
``benchmarks/workload.py``), writes the JSON file (``--out``), a Markdown report next to it and PNG plots
(``--plots``, needs matplotlib: ``pip install -e ".[bench]"``), and prints the adaptive run's ratios per trace
last (``adaptive/best-static``, ``adaptive/DDP``, ...). See ``benchmarks/__init__.py`` for the modules and
``benchmarks/RESULTS.md`` for the numbers of the full run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.settings import ALL_RUNS, MEASURED, TRACE_KINDS, BenchSettings, TraceSettings

WORKER_MODULES = (
    "torch",
    "torch.distributed",
    "lightning.pytorch",
    "lightning_paradyse.lightning.strategy",
    "lightning_paradyse.calibration.profile",
    "benchmarks.profiling",
    "benchmarks.worker",
)
"""What the benchmark's processes import, once, in the fork server they start from (:func:`~lightning_paradyse.
distributed.spawn.use_forkserver`): the calibration's processes and the runs' are two jobs, and a fresh interpreter
per process spent 5-7 s importing Lightning before each (on 2 cores, 7 s of a 55 s smoke run)."""

RESULTS = Path(__file__).resolve().parent / "results"
QUICK_RESULTS = RESULTS / "quick"
"""Where ``--quick`` writes without ``--out`` (ignored by git: the committed results are the full run's)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model and trace, five runs")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON output (default benchmarks/results/results.json; with --quick "
        "benchmarks/results/quick/results.json, which git ignores: a smoke run leaves the committed results alone)",
    )
    p.add_argument("--plots", type=Path, default=None, help="folder of the PNG plots (default: next to --out)")
    p.add_argument("--no-plots", action="store_true", help="do not draw plots")
    p.add_argument("--devices", type=int, default=None, help="processes (default: GPUs if any, else 2)")
    p.add_argument("--budget", type=str, default=None, help="per-rank memory budget, e.g. 48MiB")
    p.add_argument("--repeats", type=int, default=None, help="timed passes per (trace, run)")
    p.add_argument("--runs", type=str, default=None, help=f"comma-separated runs out of {','.join(ALL_RUNS)}")
    p.add_argument("--traces", type=str, default=None, help=f"comma-separated traces: {','.join(TRACE_KINDS)}")
    p.add_argument("--trace-len", type=int, default=None, help="sequences per trace")
    p.add_argument("--max-len", type=int, default=None, help="longest sequence of every trace")
    p.add_argument("--batch-tokens", type=int, default=None, help="token budget of a global batch (padding counted)")
    p.add_argument("--search-cap", type=int, default=None, help="largest length the length search probes")
    p.add_argument(
        "--profile",
        type=str,
        default=None,
        help="cost profile for the adaptive run; 'measured': none, the machine measured at setup (the default path)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds before the processes are given up")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    """The preset (full or quick) with the command line's overrides."""
    from dataclasses import replace

    from lightning_paradyse.planning.fixed import parse_memory_budget

    base = BenchSettings.quick() if args.quick else BenchSettings.full()
    traces = select_traces(base.traces, args.traces)
    traces = tuple(replace(t, n=args.trace_len or t.n, max_len=args.max_len or t.max_len) for t in traces)
    runs = tuple(r.strip() for r in args.runs.split(",") if r.strip()) if args.runs else None
    search = replace(base.search, cap=args.search_cap) if args.search_cap is not None else None
    devices = args.devices or _default_devices()
    budget = parse_memory_budget(args.budget) if args.budget else None
    # before any process starts, not once per run and probe
    if args.profile and args.profile != MEASURED and not Path(args.profile).is_file():
        raise SystemExit(
            f"run.py: --profile {args.profile}: no such file; give a saved cost profile (a full run writes one to "
            "benchmarks/results/profile.json) or leave --profile out to calibrate one now"
        )
    return base.with_overrides(
        traces=traces,
        runs=runs,
        batch_tokens=args.batch_tokens,
        search=search,
        devices=devices,
        budget=budget,
        repeats=args.repeats,
        profile=args.profile,
        timeout=args.timeout,
    )


def select_traces(preset: tuple[TraceSettings, ...], names: str | None) -> tuple[TraceSettings, ...]:
    """The preset's traces named in ``names`` (comma-separated), in that order; a kind the preset lacks gets
    the first trace's size."""
    if not names:
        return preset
    known: dict[str, TraceSettings] = {t.kind: t for t in preset}
    out = []
    for kind in (k.strip() for k in names.split(",") if k.strip()):
        if kind not in TRACE_KINDS:
            raise SystemExit(f"unknown trace {kind!r}: choose among {', '.join(TRACE_KINDS)}")
        default = TraceSettings(kind, n=preset[0].n, max_len=preset[0].max_len)  # type: ignore[arg-type]
        out.append(known.get(kind, default))
    return tuple(out)


def _default_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def machine() -> dict[str, Any]:
    """A description of this machine and the software (recorded in the results)."""
    import lightning
    import torch

    info: dict[str, Any] = {
        "cpu": _cpu_name(),
        "logical_cpus": os.cpu_count(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def adaptive_profile(settings: BenchSettings, out_dir: Path) -> tuple[str | None, dict[str, Any]]:
    """The cost profile of the adaptive run: ``--profile``, else one made now (``out_dir/profile.json``)."""
    if settings.profile == MEASURED:  # plan="auto" without a profile: the strategy measures the machine at setup
        return MEASURED, {"measured": True}
    if settings.profile:
        return str(Path(settings.profile).resolve()), {"path": Path(settings.profile).name, "given": True}
    from benchmarks.profiling import make_profile

    path = out_dir / "profile.json"
    print(f"calibrating the cost model for the adaptive run ({settings.devices} processes) ...", flush=True)
    try:
        info = make_profile(settings, path)
    except Exception as err:  # the adaptive run then uses the strategy's threshold policy
        print(
            f"warning: the calibration failed ({type(err).__name__}: {err}); the adaptive run uses the threshold policy"
        )
        return None, {"error": f"{type(err).__name__}: {err}"}
    return str(path.resolve()), info


def run_benchmark(settings: BenchSettings, out_dir: Path) -> tuple[dict[str, Any], list[Any]]:
    """Calibrate, build the traces, run every process, aggregate: the report and the traces."""
    from benchmarks.report import aggregate
    from benchmarks.worker import bench_worker
    from benchmarks.workload import build_trace
    from lightning_paradyse.distributed.spawn import run_distributed, use_forkserver

    start = time.perf_counter()
    use_forkserver(WORKER_MODULES)
    profile, profile_info = adaptive_profile(settings, out_dir)
    traces = [build_trace(t, settings.devices, settings.batch_tokens) for t in settings.traces]
    with tempfile.TemporaryDirectory() as store_dir:
        args = (settings, traces, store_dir, profile)
        raw = run_distributed(bench_worker, settings.devices, *args, timeout=settings.timeout)
    wall = time.perf_counter() - start
    report = {
        "meta": {
            "command": command_line(),
            "machine": machine(),
            "wall_s": wall,
            "device": raw[0]["device"],
            "profile": profile_info,
        },
        "settings": asdict(settings),
        "matmul_flops_per_rank": [r["matmul"] for r in raw],
        "matmul_flops_per_rank_start_end": [[r["matmul_start"], r["matmul_end"]] for r in raw],
        "traces": {
            t.name: {
                "lengths": t.lengths,
                "batches": [list(b) for b in t.batches],
                "edges": list(t.edges),
                "labels": t.labels,
            }
            for t in traces
        },
        "runs": aggregate(raw, settings, traces),
    }
    return report, traces


def command_line() -> str:
    """How this invocation was started (relative paths only)."""
    return " ".join(["python", "benchmarks/run.py", *sys.argv[1:]])


def header(report: dict[str, Any]) -> str:
    """The Markdown report's first lines: command, machine, settings."""
    m, s = report["meta"]["machine"], report["settings"]
    model = s["model"]
    rate = sum(report["matmul_flops_per_rank"]) / len(report["matmul_flops_per_rank"]) / 1e9
    return "\n".join(
        [
            f"Command: `{report['meta']['command']}` ({report['meta']['wall_s'] / 60:.1f} minutes).",
            "",
            f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs; {m['os']}; Python {m['python']}, "
            f"torch {m['torch']}, Lightning {m['lightning']}; device {report['meta']['device']}"
            + (f" ({m['cuda']})" if m["cuda"] else "")
            + f"; measured float32 matmul {rate:.1f} GFLOP/s per process.",
            "",
            f"Model: Llama, {model['layers']} layers, hidden {model['hidden']}, {model['heads']} heads "
            f"({model['kv_heads']} kv), SwiGLU {model['ffn']}, vocabulary {model['vocab']}; {s['devices']} processes; "
            f"global batches of at most {s['batch_tokens']:,} tokens (padding counted), one per optimizer step; "
            f"{s['repeats']} timed passes per run (median per step) after one instrumented pass; AdamW.",
        ]
    )


def output_path(args: argparse.Namespace) -> Path:
    """The JSON file to write: ``--out``, else the full run's committed results or, for ``--quick``, a folder git
    ignores."""
    return args.out or (QUICK_RESULTS if args.quick else RESULTS) / "results.json"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the JSON, the Markdown report and the plots."""
    args = parse_args(argv)
    settings = settings_from(args)
    out = output_path(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    report, traces = run_benchmark(settings, out.parent)
    out.write_text(json.dumps(report, indent=1, default=str))
    from benchmarks.report import markdown, ratio_lines

    text = header(report) + "\n\n" + markdown(report, traces)
    if not args.no_plots:
        from benchmarks.plots import write_plots

        paths = write_plots(report, args.plots or out.parent)
        text += "".join(f"\n![{p.stem}]({p.name})\n" for p in paths)
    out.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    for line in ratio_lines(report):  # last: what a smoke run is read for
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
