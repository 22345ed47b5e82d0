"""Command line of lightning_paradyse.

    python cli.py check --world-size 3 --seq-len 101 --plan random --seed 7

``check`` runs a model for one forward+backward single-process and under every mode (or the plan
you name) on N local gloo processes and prints the relative error of the loss and of every gradient
per plan; the exit status is non-zero when a tolerance is exceeded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from lightning_paradyse.check import CheckSettings, check_worker, format_report
from lightning_paradyse.layout import SeqLayout
from lightning_paradyse.models import CONFIGS
from lightning_paradyse.plan import parse_plan
from lightning_paradyse.spawn import run_distributed


def _plan_arg(text: str) -> str | list[Any]:
    """``all``, ``random``, a mode name, or a YAML/JSON per-layer list."""
    if text.lstrip().startswith("["):
        value = yaml.safe_load(text)
        if not isinstance(value, list):
            raise argparse.ArgumentTypeError(f"--plan: expected a list, got {text!r}")
        return value
    return text


def check_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cli.py check",
        description="Check every parallel mode (or a plan) against a single-process reference.",
    )
    parser.add_argument("--world-size", type=int, default=2, help="number of local gloo processes (default 2)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence; need not divide by p")
    parser.add_argument("--batch", type=int, default=1, help="sequences per batch")
    parser.add_argument("--model", default="llama-tiny", choices=sorted(CONFIGS), help="model config")
    parser.add_argument(
        "--plan",
        type=_plan_arg,
        default="all",
        help="all (every mode + random mixed plans), random, a mode name, or a per-layer list such as "
        "'[ring, {attention: ulysses, mlp: metp, recompute: true}]'",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, data and random plans")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--random-plans", type=int, default=3, help="random mixed plans to draw")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a hung run is killed")
    return parser


def check_main(argv: Sequence[str]) -> int:
    args = check_parser().parse_args(argv)
    settings = CheckSettings(
        model=args.model,
        seq_len=args.seq_len,
        batch=args.batch,
        plan=args.plan,
        seed=args.seed,
        dtype=args.dtype,
        random_plans=args.random_plans,
    )
    try:  # validate everything before any process starts
        if args.world_size < 1:
            raise ValueError(f"--world-size must be at least 1, got {args.world_size}")
        SeqLayout(args.seq_len, args.world_size)
        if args.seq_len > CONFIGS[args.model].max_seq_len:
            raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len")
        if args.plan not in ("all", "random"):
            parse_plan(args.plan, CONFIGS[args.model].n_layers)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.world_size == 1:
        results = check_worker(0, 1, settings)
    else:
        results = run_distributed(check_worker, args.world_size, settings, timeout=args.timeout)[0]
    report, ok = format_report(results, settings, args.world_size)
    print(report)
    print("all within tolerance" if ok else "TOLERANCE EXCEEDED")
    return 0 if ok else 1


COMMANDS = {"check": check_main}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python cli.py {{{','.join(COMMANDS)}}} [options]  (try: python cli.py check --help)")
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
