"""Devices and backends: ranks sharing a GPU over gloo, NCCL refused where it cannot run, the GPU budget, the
bucketed weight broadcast, a profile of another device type refused (before any collective)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.distributed import devices as dev
from lightning_paradyse.distributed.spawn import run_distributed

CUDA0 = torch.device("cuda", 0)


def test_backend_defaults_nccl_on_gpus_gloo_on_the_host_and_where_ranks_share_a_gpu() -> None:
    assert dev.resolve_backend([CUDA0, torch.device("cuda", 1)], None) == "nccl"
    assert dev.resolve_backend([CUDA0, CUDA0], None) == "gloo"
    assert dev.resolve_backend([torch.device("cpu")] * 2, None) == "gloo"
    assert dev.resolve_backend([CUDA0], "gloo") == "gloo"


def test_nccl_with_more_ranks_than_gpus_is_refused_naming_the_way_out() -> None:
    with pytest.raises(ValueError, match=r"4 ranks on 1 GPU\(s\) with NCCL.*process_group_backend='gloo'"):
        dev.resolve_backend([CUDA0] * 4, "nccl")
    with pytest.raises(ValueError, match="needs GPUs"):
        dev.resolve_backend([torch.device("cpu")], "nccl")
    with pytest.raises(ValueError, match="process_group_backend='mpi'"):
        dev.resolve_backend([CUDA0], "mpi")
    with pytest.raises(ValueError, match="NCCL, which refuses two ranks on one GPU"):  # at construction already
        ParaDySeStrategy(ranks_per_device=2, process_group_backend="nccl")
    with pytest.raises(ValueError, match="ranks_per_device"):
        ParaDySeStrategy(ranks_per_device=0)


def test_nccl_refused_where_a_node_has_fewer_gpus_than_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"GPU\(s\) \[1\] but this node has 1"):
        dev.check_local_gpus([CUDA0, torch.device("cuda", 1)], "nccl")
    dev.check_local_gpus([CUDA0, torch.device("cuda", 1)], "gloo")  # gloo: nothing to refuse


def test_each_device_serves_ranks_per_device_ranks() -> None:
    strategy = ParaDySeStrategy(ranks_per_device=3)
    strategy.parallel_devices = [torch.device("cpu")]
    assert strategy.parallel_devices == [torch.device("cpu")] * 3 and strategy.num_processes == 3
    strategy = ParaDySeStrategy(ranks_per_device=2)
    strategy.parallel_devices = [torch.device("cpu")] * 2  # devices=2 on the host: Lightning's list repeats the host
    assert strategy.num_processes == 4
    strategy.parallel_devices = [CUDA0, torch.device("cuda", 1)]
    assert strategy.parallel_devices == [CUDA0, CUDA0, torch.device("cuda", 1), torch.device("cuda", 1)]


def test_gpu_budget_counts_memory_outside_the_allocator_and_the_larger_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 18 * gib)
    outside = 80 * gib - 60 * gib - 18 * gib  # the CUDA context, communicators: 2 GiB
    margin = int(dev.FRAGMENTATION * 80 * gib)
    assert dev.gpu_budget(CUDA0) == 80 * gib - (outside + margin)
    assert dev.gpu_budget(CUDA0, reserve_bytes=10 * gib) == 70 * gib  # a cluster file's reserve, larger
    assert dev.gpu_budget(CUDA0, share=4) == int((80 * gib - margin) / 4)  # four ranks on the GPU: a quarter each


def test_a_profile_of_another_device_type_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"measured on 'cpu' but this run trains on 'cuda'.*--device cuda"):
        dev.check_profile_device("cpu", CUDA0, "p.json")
    dev.check_profile_device("cuda", torch.device("cuda", 3), "p.json")
    shipped = json.loads(Path("configs/profiles/cpu-2proc-llama-tiny.json").read_text())
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({**shipped, "meta": {**shipped.get("meta", {}), "device": "cuda"}}))
    strategy = ParaDySeStrategy(profile=str(path))
    strategy.parallel_devices = [torch.device("cpu")]
    with pytest.raises(ValueError, match=r"measured on 'cuda' but this run trains on 'cpu'"):
        strategy._check_profile_device()  # what setup_environment runs first, on every rank


def _broadcast_worker(rank: int, world: int) -> list[float]:
    torch.manual_seed(rank)  # every rank starts from other weights
    module = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False))
    module.register_buffer("steps", torch.tensor([rank, rank + 1]))
    dev.broadcast_module(module, dist.group.WORLD, bucket_bytes=64)  # many buckets, one tensor larger than one
    return [float(t.detach().double().sum()) for t in (*module.parameters(), *module.buffers())]


@pytest.mark.dist
def test_the_weight_broadcast_gives_every_rank_rank_0s_weights_bucket_by_bucket() -> None:
    results: list[Any] = run_distributed(_broadcast_worker, 2, timeout=120)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False))
    want = [float(t.detach().double().sum()) for t in reference.parameters()] + [1.0]
    assert results[0] == results[1] == want
