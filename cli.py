"""Command line of lightning_paradyse.

    python cli.py fit --config configs/cpu_2proc.yaml         # train (also: validate, test, predict)
    python cli.py check --world-size 3 --seq-len 101 --plan random --seed 7
    python cli.py profile --help                              # calibrate the cost model on this machine
    python cli.py plan --help                                 # the planner's choices for lengths and a budget

``fit`` / ``validate`` / ``test`` / ``predict`` are Lightning's ``LightningCLI`` over
:class:`~lightning_paradyse.lightning.language_model.LanguageModel`
and :class:`~lightning_paradyse.data.datamodule.CorpusDataModule`; the strategy is chosen in the config
(``trainer.strategy: paradyse`` or ``class_path: lightning_paradyse.ParaDySeStrategy`` with ``init_args``), and
``--help`` shows every option with its docstring. ``predict`` writes each held-out document's log-likelihood and
perplexity to ``<trainer.default_root_dir>/predictions/predictions.jsonl``
(:class:`~lightning_paradyse.lightning.prediction_writer.DocumentScoreWriter`; ``--predictions.output_dir`` moves it;
``--ckpt_path`` names the trained weights).

``check`` runs a model for one forward+backward single-process and under every mode (or the plan
you name) on N local gloo processes and prints the relative error of the loss and of every gradient
per plan; the exit status is non-zero when a tolerance is exceeded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import jsonargparse
import yaml
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

from lightning_paradyse.data.datamodule import CorpusDataModule
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.lightning.language_model import LanguageModel
from lightning_paradyse.lightning.prediction_writer import DocumentScoreWriter
from lightning_paradyse.models import CONFIGS
from lightning_paradyse.modes.plan import parse_plan
from lightning_paradyse.tools.mode_check import CheckSettings, check_worker, format_report


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


def profile_main(argv: Sequence[str]) -> int:
    """``python cli.py profile``: calibrate the cost model on this machine (see ``--help``)."""
    from lightning_paradyse.tools.cost_cli import profile_main as run

    return run(list(argv))


def plan_main(argv: Sequence[str]) -> int:
    """``python cli.py plan``: the planner's choices for given lengths and budget (see ``--help``)."""
    from lightning_paradyse.tools.cost_cli import plan_main as run

    return run(list(argv))


COMMANDS = {"check": check_main, "profile": profile_main, "plan": plan_main}


def enable_attribute_docstrings() -> None:
    """Show the docstring under each config field in ``--help`` (jsonargparse's attribute docstrings)."""
    if hasattr(jsonargparse, "set_parsing_settings"):  # jsonargparse >= 4.39
        jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    else:
        jsonargparse.set_docstring_parse_options(attribute_docstrings=True)


LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
DESCRIPTION = (
    "Train, validate, test or predict (each held-out document's perplexity) with Lightning and the ParaDySe "
    "strategy. Other commands, each with its --help: "
    "python cli.py check (the parallel modes against one process), python cli.py profile (calibrate the cost model "
    "on this machine), python cli.py plan (the planner's choices for given lengths and budget)."
)


class ParaDySeCLI(LightningCLI):
    """``LightningCLI`` for :class:`LanguageModel` and :class:`CorpusDataModule`: subcommands fit, validate, test,
    predict (its predictions written by a :class:`DocumentScoreWriter`, options under ``predictions``).

    Args:
        args: Command-line arguments (``None``: ``sys.argv``).
        run: Run the subcommand (``False``: parse and instantiate only, no subcommand expected).
        **kwargs: Passed to ``LightningCLI`` (e.g. ``save_config_callback=None``).
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True, **kwargs: Any) -> None:
        enable_attribute_docstrings()
        kwargs.setdefault("parser_kwargs", {"prog": "cli.py", "description": DESCRIPTION})
        super().__init__(LanguageModel, CorpusDataModule, args=None if args is None else list(args), run=run, **kwargs)

    @override
    def add_arguments_to_parser(self, parser: jsonargparse.ArgumentParser) -> None:
        parser.add_lightning_class_args(DocumentScoreWriter, "predictions")  # a callback: it only acts in predict

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name in LIGHTNING_COMMANDS}


def lightning_main(argv: Sequence[str] | None = None) -> int:
    """Run ``fit``/``validate``/``test``/``predict`` through :class:`ParaDySeCLI` (``None``: arguments from
    ``sys.argv``)."""
    ParaDySeCLI(args=argv)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``check``, ``profile`` and ``plan`` go to their functions (:data:`COMMANDS`); anything else (fit, validate, test,
    predict, --help) to the LightningCLI."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return COMMANDS[args[0]](args[1:])
    return lightning_main(argv)


if __name__ == "__main__":
    sys.exit(main())
