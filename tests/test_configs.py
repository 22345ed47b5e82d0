"""Every YAML under configs/ parses through cli.py's LightningCLI (``run=False``), and its strategy options validate.

Configs for accelerators this machine lacks (``gpu_8x.yaml`` on CPU) are parsed and type-checked by jsonargparse
and their ParaDySeStrategy is built from the parsed ``init_args``, but the Trainer, the model and the data are not
instantiated. CPU configs are instantiated completely. ``save_config_callback=None`` keeps the CLI from writing a
``config.yaml`` anywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

from cli import ParaDySeCLI, main
from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.data.datamodule import CorpusDataModule
from lightning_paradyse.lightning.language_model import LanguageModel
from lightning_paradyse.models import CONFIGS

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"
YAMLS = sorted(CONFIG_DIR.glob("*.yaml"))


class ParseOnlyCLI(ParaDySeCLI):
    """Parses and type-checks a config without instantiating the Trainer, the model or the data."""

    @override
    def instantiate_classes(self) -> None:
        self.config_init = self.config


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _available(accelerator: str) -> bool:
    return accelerator in ("cpu", "auto") or (accelerator in ("gpu", "cuda") and torch.cuda.is_available())


def _strategy(config: Any) -> ParaDySeStrategy:
    spec = config.trainer.strategy
    assert spec.class_path in (
        "lightning_paradyse.ParaDySeStrategy",
        "lightning_paradyse.lightning.strategy.ParaDySeStrategy",
    )
    return ParaDySeStrategy(**dict(spec.init_args))


def test_there_are_configs() -> None:
    assert {"cpu_2proc.yaml", "gpu_8x.yaml"} <= {p.name for p in YAMLS}


@pytest.mark.parametrize("path", YAMLS, ids=[p.name for p in YAMLS])
def test_config_parses(path: Path) -> None:
    config = ParseOnlyCLI(args=["--config", str(path)], run=False, save_config_callback=None).config
    strategy = _strategy(config)  # every option validates
    assert strategy.plan_spec is not None and config.model.model in CONFIGS
    if config.model.hf_config is not None and not _has_transformers():
        return
    CorpusDataModule(**dict(config.data))  # cheap: validates the data options (the corpus loads lazily)
    if not _available(config.trainer.accelerator):
        return
    cli = ParaDySeCLI(args=["--config", str(path)], run=False, save_config_callback=None)
    assert isinstance(cli.trainer.strategy, ParaDySeStrategy) and isinstance(cli.model, LanguageModel)
    assert cli.trainer.num_devices == config.trainer.devices


def test_gpu_config_asks_for_what_it_should() -> None:
    config = ParseOnlyCLI(args=["--config", str(CONFIG_DIR / "gpu_8x.yaml")], run=False).config
    strategy = _strategy(config)
    assert (config.trainer.accelerator, config.trainer.devices, config.trainer.precision) == ("gpu", 8, "bf16-mixed")
    assert strategy.compile and strategy.start_method == "popen" and strategy.memory_budget == 70 * 2**30


def test_registered_name_and_command_line_overrides() -> None:
    args = ["--config", str(CONFIG_DIR / "cpu_2proc.yaml"), "--trainer.strategy=paradyse", "--trainer.devices=1"]
    cli = ParaDySeCLI(args=args, run=False, save_config_callback=None)
    assert isinstance(cli.trainer.strategy, ParaDySeStrategy)
    args = ["--config", str(CONFIG_DIR / "cpu_2proc.yaml"), "--trainer.strategy.init_args.plan=ring"]
    cli = ParaDySeCLI(args=args, run=False, save_config_callback=None)
    assert isinstance(cli.trainer.strategy, ParaDySeStrategy) and cli.trainer.strategy.plan_spec == "ring"


def test_bad_strategy_option_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--config", str(CONFIG_DIR / "cpu_2proc.yaml"), "--trainer.strategy.init_args.plan=zigzag"]
    with pytest.raises((SystemExit, ValueError)) as info:  # exit from the command line, ValueError with run=False
        ParaDySeCLI(args=args, run=False, save_config_callback=None)
    assert "plan='zigzag': unknown parallel mode 'zigzag'" in str(info.value) + capsys.readouterr().err


def test_check_command_still_dispatches(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--world-size", "1", "--seq-len", "8", "--plan", "ring"]) == 0
    assert "all within tolerance" in capsys.readouterr().out
    assert issubclass(ParaDySeCLI, LightningCLI) and set(ParaDySeCLI.subcommands()) == {
        "fit",
        "validate",
        "test",
        "predict",
    }


def test_hf_config_builds_the_hugging_face_model_from_its_fields() -> None:
    pytest.importorskip("transformers")
    cli = ParaDySeCLI(args=["--config", str(CONFIG_DIR / "hf_llama_cpu.yaml")], run=False, save_config_callback=None)
    model = cli.model.model
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 96
    assert model.config._attn_implementation == "sdpa" and cli.model.vocab_size == 128
    with pytest.raises(ValueError, match="'class' must name a config class of transformers"):
        LanguageModel(hf_config={"class": "NoSuchConfig"})


@pytest.mark.dist
def test_hf_config_trains_on_two_processes(tmp_path: Path) -> None:
    """``python cli.py fit --config configs/hf_llama_cpu.yaml``, 3 steps: a Hugging Face model from YAML."""
    pytest.importorskip("transformers")
    cmd = [sys.executable, str(ROOT / "cli.py"), "fit", "--config", str(CONFIG_DIR / "hf_llama_cpu.yaml")]
    cmd += ["--trainer.max_steps=3", "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}"]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "[paradyse] train length" in output and "final loss" in output, output[-4000:]
