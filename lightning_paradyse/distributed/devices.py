"""Where the ranks run: devices, the process-group backend, the memory a GPU really leaves, moving weights there.

* :func:`expand_devices` / :func:`resolve_backend`: several ranks may share one GPU over gloo (tests and checks on a
  one-GPU machine; gloo runs every collective on CUDA tensors, and :mod:`lightning_paradyse.distributed.comm` stages its
  point-to-point hops through host memory). NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): asking for
  it is an error naming the way out, raised on every rank before any collective.
* :func:`gpu_budget`: the bytes a GPU leaves to tensors, counting what the caching allocator cannot hand out (the
  CUDA context, communicator buffers, other processes), a fragmentation margin and a reserve of the user's.
* :func:`broadcast_module`: rank 0's parameters and buffers on every rank, bucket by bucket through the collective's
  device (a model built on the host never reaches a GPU whole).
* :func:`check_profile_device`: a cost profile measured on one device type is refused for a run on another.
* :func:`to_device` / :func:`index_on`: a small host tensor (an index, a header, a few numbers) onto a GPU without
  a host synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn

from lightning_paradyse.distributed.comm import Group, broadcast_from, collective_device, group_size

BACKENDS = ("nccl", "gloo")
BROADCAST_BUCKET_BYTES = 128 * 2**20
"""Bytes of one bucket of the weight broadcast at setup (a tensor larger than this travels alone)."""
FRAGMENTATION = 0.05
"""Share of a GPU's memory kept free for the caching allocator's fragmentation and kernel workspaces."""


def expand_devices(devices: Sequence[torch.device], ranks_per_device: int) -> list[torch.device]:
    """Every device ``ranks_per_device`` times in a row: the devices of the ranks of one node, local rank order."""
    return [device for device in devices for _ in range(ranks_per_device)]


def resolve_backend(devices: Sequence[torch.device], asked: str | None) -> str:
    """The process-group backend for ranks on ``devices`` (one entry per local rank): ``asked``, else NCCL on GPUs
    each held by one rank, gloo where ranks share a GPU or run on the host.

    Raises:
        ValueError: NCCL for ranks on the host, or for two ranks on one GPU.
    """
    if asked is not None and asked not in BACKENDS:
        raise ValueError(f"ParaDySeStrategy(process_group_backend={asked!r}): use one of {BACKENDS} or None")
    on_gpu = any(d.type == "cuda" for d in devices)
    shared = len(set(devices)) < len(devices)
    if asked == "nccl" and not on_gpu:
        raise ValueError("ParaDySeStrategy(process_group_backend='nccl') needs GPUs; on the host use 'gloo' (default)")
    if asked == "nccl" and shared:
        raise ValueError(
            f"ParaDySeStrategy: {len(devices)} ranks on {len(set(devices))} GPU(s) with NCCL, which refuses two ranks "
            f"on one GPU; run one rank per GPU, or share a GPU over gloo for tests and checks: "
            f"ParaDySeStrategy(ranks_per_device=..., process_group_backend='gloo')"
        )
    if asked is not None:
        return asked
    return "nccl" if on_gpu and not shared else "gloo"


def check_local_gpus(devices: Sequence[torch.device], backend: str) -> None:
    """Refuse NCCL where this node has fewer GPUs than the devices name (a launcher started more ranks than GPUs)."""
    if backend != "nccl" or not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    missing = sorted({d.index or 0 for d in devices if d.type == "cuda" and (d.index or 0) >= count})
    if missing:
        raise ValueError(
            f"ParaDySeStrategy: ranks ask for GPU(s) {missing} but this node has {count}; start one rank per GPU, or "
            f"share GPUs over gloo for tests and checks: ParaDySeStrategy(ranks_per_device=..., "
            f"process_group_backend='gloo')"
        )


def gpu_budget(device: torch.device, reserve_bytes: int = 0, share: int = 1) -> int:
    """Bytes a GPU leaves to this process's tensors: its total memory less what is taken outside the caching
    allocator (the CUDA context, NCCL's buffers, other processes: ``total - free - reserved``), less a
    :data:`FRAGMENTATION` margin, less ``reserve_bytes`` beyond those (a cluster file's ``reserve_gib``: the larger
    of the two reserves counts); with ``share`` ranks on the GPU, at most its ``1/share`` (the others grow too)."""
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)  # context, communicators, other processes
    margin = int(FRAGMENTATION * total)
    return int(min(total - max(outside + margin, reserve_bytes), (total - margin) / share))


def gpu_free_bytes(device: torch.device) -> int:
    """Bytes a GPU can still hand out: what the driver has free plus the caching allocator's free blocks (which
    ``mem_get_info`` counts as used)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _buckets(tensors: Sequence[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def broadcast_module(module: nn.Module, group: Group, bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Rank 0's parameters and buffers on every rank of ``group``, one coalesced broadcast per bucket of one dtype,
    each bucket staged on the collective's device (a GPU for NCCL) and copied back where the tensors live."""
    if group_size(group) == 1:
        return
    device = collective_device(group)
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.numel() > 0]
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        for bucket in _buckets([t for t in tensors if t.dtype == dtype], bucket_bytes):
            flat = torch.cat([t.detach().reshape(-1).to(device) for t in bucket])  # [sum numel] on the device
            flat = broadcast_from(flat, 0, group)
            with torch.no_grad():
                for t, piece in zip(bucket, torch.split(flat, [t.numel() for t in bucket])):
                    t.copy_(piece.view_as(t))


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t``, a host tensor this code made (an index, a header, a few numbers), on ``device`` without waiting.

    A blocking copy onto a GPU synchronises the host with every kernel queued before it (CUDA's synchronisation
    debug mode counts it); this one is queued. From pageable host memory (every tensor this is used for) the queued
    copy has read its source when it returns, so the source may be dropped or changed at once; a pinned source must
    stay unchanged until the copy has run. A tensor already on ``device`` is returned as is."""
    return t.to(device, non_blocking=True)


def index_on(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """``values`` as an int64 index on ``device``, without a host synchronisation (:func:`to_device`);
    ``torch.tensor(values, device=...)`` would copy it blocking."""
    return to_device(torch.tensor(list(values), dtype=torch.long), device)


def check_profile_device(measured_on: str, run_on: torch.device, path: str) -> None:
    """Refuse a cost profile measured on another device type than the run's (a CPU profile for a GPU run)."""
    if measured_on != run_on.type:
        raise ValueError(
            f"ParaDySeStrategy(profile={path!r}): the profile was measured on {measured_on!r} but this run trains on "
            f"{run_on.type!r}: its rates and collectives are another machine's; measure one here "
            f"(`python cli.py profile --device {run_on.type} ...`), or leave profile out to measure at setup"
        )


__all__ = [
    "BACKENDS",
    "broadcast_module",
    "check_local_gpus",
    "check_profile_device",
    "expand_devices",
    "gpu_budget",
    "gpu_free_bytes",
    "index_on",
    "resolve_backend",
    "to_device",
]
