"""Device paths on CUDA (marked ``gpu``; skipped where no GPU is visible, as on CI): the rewrite of a block on a GPU
(traced on a host copy, installed on the GPU), ring hops of ranks sharing the GPU over gloo (staged through host
memory), where the control tensors of an NCCL group live, and a fit whose ranks share the GPU.

``benchmarks/gpu_check.py`` runs the exactness suite itself on the GPU; these are the quick checks of the paths.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_paradyse.distributed import comm
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.plan import uniform_plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime.parallel import configure, parallelize
from tests.support.families import hf_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda", 0)


def test_a_block_on_the_gpu_is_rewritten_on_a_host_copy_and_runs_every_mode_there() -> None:
    """A float64 Hugging Face Llama on the GPU: parallelised (one rank), every mode reproduces it on the GPU, and
    every parameter stays there."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = hf_llama(n_kv_heads=4).double().to(CUDA)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (1, 24), device=CUDA)
    want = reference(input_ids=ids).logits
    parallelize(model, None)
    assert {p.device for p in model.parameters()} == {CUDA}
    for mode in MODES:
        configure(model, SeqContext(SeqLayout.for_sequence(24, 1, True), None), uniform_plan(mode, 2))
        got = model(input_ids=ids).logits
        assert float((got - want).abs().max() / want.abs().max()) < 1e-9, mode


def _ring_worker(rank: int, world: int) -> list[float]:
    torch.cuda.set_device(0)
    x = torch.full((3, 5), float(rank), device=CUDA)
    y = comm.ring_pass(x, dist.group.WORLD)  # gloo on CUDA tensors: staged through host memory
    assert y.device.type == "cuda"
    return y.flatten().tolist()


def test_ring_hops_of_ranks_sharing_the_gpu_over_gloo() -> None:
    results: list[Any] = run_distributed(_ring_worker, 2, timeout=120)
    assert results[0] == [1.0] * 15 and results[1] == [0.0] * 15


def _nccl_worker(rank: int, world: int) -> str:
    device = comm.collective_device(dist.group.WORLD)
    flag = torch.ones(1, device=device)
    return f"{device.type} {float(comm.all_reduce_sum(flag, dist.group.WORLD))}"


def test_control_tensors_of_an_nccl_group_live_on_the_gpu() -> None:
    assert run_distributed(_nccl_worker, 1, timeout=120, backend="nccl") == ["cuda 1.0"]


def test_the_strategy_trains_with_ranks_sharing_the_gpu(tmp_path: Any) -> None:
    """``Trainer(accelerator="gpu", devices=1, strategy=ParaDySeStrategy(ranks_per_device=2))`` fits."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "cli.py",
        "fit",
        "--config",
        "configs/cpu_2proc.yaml",
        "--trainer.accelerator=gpu",
        "--trainer.devices=1",
        "--trainer.strategy.init_args.ranks_per_device=2",
        "--trainer.strategy.init_args.profile=null",
        "--trainer.max_steps=5",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "final loss" in proc.stdout + proc.stderr
