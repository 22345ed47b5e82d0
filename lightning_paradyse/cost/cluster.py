"""Cluster description files: plan for hardware that is not present.

A cluster file (YAML or JSON, see ``configs/clusters/``) gives the GPU count, memory, peak FLOP rate
and achievable efficiencies, and the intra- and inter-node bandwidths and latency. It becomes a
:class:`~lightning_paradyse.cost.time.Machine` whose collectives follow an alpha-beta model from the
bandwidths (the intra-node bandwidth while the group fits in a node, the inter-node one beyond), and
whose ring attention tiles are priced as they run on a GPU today (float32 score tiles materialised per hop, at
``fp32_share`` of the peak; flash-style tiles once a fused kernel runs them). Nothing is calibrated: per-op
constants are the defaults (a fixed per-op overhead, unit factors), so predictions are only as good as the file's
efficiencies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from lightning_paradyse.cost.time import Links, Machine
from lightning_paradyse.modes.attention import fused_tiles

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Cluster:
    """A cluster of GPUs, as a cluster file describes it."""

    name: str
    """Human-readable description."""
    gpus: int
    """GPUs in the cluster (the default group size ``p``)."""
    gpus_per_node: int
    """GPUs per node (sharing the fast links)."""
    memory_gib: float
    """Memory per GPU (GiB)."""
    peak_tflops: float
    """Dense peak of the training dtype per GPU (TFLOP/s)."""
    intra_node_gbps: float
    """Achievable collective bandwidth per GPU inside a node (GB/s)."""
    inter_node_gbps: float
    """Achievable collective bandwidth per GPU across nodes (GB/s)."""
    reserve_gib: float = 4.0
    """Memory per GPU not available to tensors: CUDA context, communication buffers, fragmentation (GiB)."""
    dtype: str = "bfloat16"
    """Training dtype of activations and weights."""
    matmul_efficiency: float = 0.6
    """Achieved share of the peak in large matrix multiplies."""
    attention_efficiency: float = 0.45
    """Achieved share of the peak in the fused attention forward."""
    attention_bwd_efficiency: float = 0.35
    """Achieved share of the peak in the fused attention backward."""
    latency_us: float = 10.0
    """Latency of one collective hop (microseconds)."""
    overlap: float = 0.9
    """Overlap efficiency of asynchronous transfers with compute."""
    op_overhead_us: float = 30.0
    """Fixed time per op and step (kernel launches), microseconds."""
    fp32_share: float = 1 / 15
    """Share of the peak the ring attention's tiles reach while they run as float32 score tiles on CUDA (no fused
    kernel yet, no tensor cores: an H100 does 67 of its 989 dense bf16 TFLOP/s in float32)."""
    optimizer_bytes_per_param: float = 12.0
    """Optimizer state per parameter element (Adam with a float32 master copy: 12)."""

    def machine(self) -> Machine:
        """The :class:`Machine` this cluster implies."""
        peak = self.peak_tflops * 1e12
        links = Links(self.gpus_per_node, self.intra_node_gbps * GB, self.inter_node_gbps * GB, self.latency_us * 1e-6)
        fused = fused_tiles("cuda")  # what the ring's tiles run on a GPU: priced as they run, time and memory
        return Machine(
            name=self.name,
            gemm_flops=peak * self.matmul_efficiency,
            sdpa_fwd_flops=peak * self.attention_efficiency,
            sdpa_bwd_flops=peak * self.attention_bwd_efficiency,
            tile_fwd_flops=peak * (self.attention_efficiency if fused else self.fp32_share),
            tile_bwd_flops=peak * (self.attention_bwd_efficiency if fused else self.fp32_share),
            overlap=self.overlap,
            links=links,
            flash_tiles=fused,
            op_overhead_s=self.op_overhead_us * 1e-6,
        )

    def budget_bytes(self) -> int:
        """Memory per GPU available to tensors: ``memory_gib - reserve_gib``."""
        return int((self.memory_gib - self.reserve_gib) * GiB)


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster file (YAML or JSON); unknown keys are an error naming the known ones."""
    text = Path(path).read_text()
    data: Any = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a cluster file is a mapping of fields, got {type(data).__name__}")
    known = {f.name for f in fields(Cluster)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown cluster fields {unknown}; known fields: {sorted(known)}")
    try:
        return Cluster(**data)
    except TypeError as err:
        raise ValueError(f"{path}: {err}") from None
