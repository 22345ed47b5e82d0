"""Cluster description files: plan for hardware that is not present.

A cluster file (YAML or JSON, see ``configs/clusters/``) gives the GPU count, memory, peak FLOP rate
and achievable efficiencies, and the intra- and inter-node bandwidths and latency. It becomes a
:class:`~lightning_paradyse.cost.time.Machine` whose collectives follow an alpha-beta model from the
bandwidths (the intra-node bandwidth while the group fits in a node, the inter-node one beyond), and
whose ring attention uses flash-style tiles. Nothing is calibrated: per-op constants are the defaults
(a fixed per-op overhead, unit factors), so predictions are only as good as the file's efficiencies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from lightning_paradyse.cost.time import Links, Machine

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
    optimizer_bytes_per_param: float = 12.0
    """Optimizer state per parameter element (Adam with a float32 master copy: 12)."""

    def machine(self) -> Machine:
        """The :class:`Machine` this cluster implies."""
        peak = self.peak_tflops * 1e12
        links = Links(self.gpus_per_node, self.intra_node_gbps * GB, self.inter_node_gbps * GB, self.latency_us * 1e-6)
        return Machine(
            name=self.name,
            gemm_flops=peak * self.matmul_efficiency,
            sdpa_fwd_flops=peak * self.attention_efficiency,
            sdpa_bwd_flops=peak * self.attention_bwd_efficiency,
            tile_fwd_flops=peak * self.attention_efficiency,
            tile_bwd_flops=peak * self.attention_bwd_efficiency,
            overlap=self.overlap,
            links=links,
            flash_tiles=True,
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
