"""The machine ``plan="auto"`` measures at setup without a profile (``calibration/quick.py``): its per-op overheads,
kept with it, and what they decide."""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist

from lightning_paradyse.calibration.profile import ONE_RANK_MODES
from lightning_paradyse.calibration.quick import (
    RECOMPUTE_OVERHEAD,
    Overheads,
    cached_quick_machine,
    overhead_config,
    quick_machine,
    quick_overheads,
)
from lightning_paradyse.cost.dims import ModelDims, dims_from_config
from lightning_paradyse.cost.time import AlphaBeta, Machine
from lightning_paradyse.groups.cost import exchange_seconds, group_shape_cost, machine_for_groups
from lightning_paradyse.models import GPTConfig, LlamaConfig
from lightning_paradyse.planning.planner import group_calibration, group_planning, make_planner
from tests.support.dist import run_distributed

PRESET = LlamaConfig(vocab_size=128, n_layers=2, hidden=64, n_heads=8, n_kv_heads=2, ffn=128, max_seq_len=4096)
"""The quick benchmark's model."""
CPU = torch.device("cpu")


def test_the_overheads_are_measured_on_one_block_of_the_models_heads_capped_in_width() -> None:
    small = overhead_config(dims_from_config(PRESET), 2)
    assert isinstance(small, LlamaConfig) and small.n_layers == 1 and small.max_seq_len == 32
    assert (small.n_heads, small.n_kv_heads, small.hidden, small.ffn) == (8, 2, 64, 128)
    wide = ModelDims(hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn=11008, n_layers=32, vocab=32000)
    capped = overhead_config(wide, 4)
    assert isinstance(capped, LlamaConfig)
    assert (capped.n_heads, capped.n_kv_heads, capped.hidden, capped.ffn) == (32, 8, 1024, 4096)
    gpt = overhead_config(ModelDims(768, 12, 12, 64, 3072, 12, 50257, gated=False, causal=True, norm="layer"), 2)
    assert isinstance(gpt, GPTConfig) and gpt.causal and (gpt.hidden, gpt.ffn) == (384, 1536)


def _measure(rank: int, world: int, folder: str) -> dict[str, object]:
    os.environ["PARADYSE_CACHE_DIR"] = folder
    dims = dims_from_config(PRESET)
    machine = quick_machine(dims, world, dist.group.WORLD, CPU, torch.float32)
    state, py = torch.get_rng_state(), random.getstate()
    overheads = quick_overheads(dims, machine, world, dist.group.WORLD, CPU, torch.float32)
    kept = torch.equal(torch.get_rng_state(), state) and random.getstate() == py
    first = cached_quick_machine(dims, world, dist.group.WORLD, CPU, torch.float32, lambda m: {"exchange_s": 0.5})
    again = cached_quick_machine(dims, world, dist.group.WORLD, CPU, torch.float32)
    return {
        "overheads": overheads.to_dict(),
        "rng_kept": kept,
        "cached": (first.cached, again.cached),
        "same": again.overheads == first.overheads and again.extras == {"exchange_s": 0.5},
    }


def test_every_modes_overhead_is_measured_alike_on_every_rank_and_kept_with_the_machine(tmp_path: object) -> None:
    """On 2 processes: every mode the model's ops can run in has its overhead (and its recomputed variant's, priced
    from it), the modes a group of one plans theirs on a rank alone, the same numbers on both ranks; the process's
    random streams are left as they were; a second run reads them back from the cache with the machine."""
    results = run_distributed(_measure, 2, str(tmp_path), timeout=300)
    assert results[0]["overheads"] == results[1]["overheads"]
    overheads = Overheads.from_dict(results[0]["overheads"])  # type: ignore[arg-type]
    for mode in ("tp_sp", "ulysses", "ring", "metp"):
        for op in ("attention", "mlp"):
            assert overheads.world[f"{mode}/{op}"] >= 0.0
            assert overheads.world[f"{mode}/{op}/rc"] == RECOMPUTE_OVERHEAD * overheads.world[f"{mode}/{op}"]
    assert overheads.world["tp_sp/attention"] > 0.0  # two processes meeting: never free
    assert set(overheads.one_rank) == {
        f"{m}/{o}{r}" for m in ONE_RANK_MODES for o in ("attention", "mlp") for r in ("", "/rc")
    }
    assert all(r["rng_kept"] for r in results)
    assert all(r["cached"] == (False, True) and r["same"] for r in results)


def _cpu_machine() -> Machine:
    """The quick machine as measured on two CPU processes (2 cores, gloo) on 2026-12-02, at scalar rates."""
    measured = {
        "all_gather": (0.00032, 1.63e9),
        "all_reduce": (0.000304, 1.15e9),
        "all_to_all": (0.000204, 1.38e9),
        "broadcast": (0.000207, 1.28e9),
        "reduce": (0.000355, 1.05e9),
        "reduce_scatter": (0.000341, 4.65e8),
        "ring": (0.000112, 1.21e9),
    }
    return Machine(
        "measured at setup (2 ranks, cpu)",
        gemm_flops=1.24e11,
        sdpa_fwd_flops=2.40e10,
        sdpa_bwd_flops=3.25e10,
        tile_fwd_flops=3.29e10,
        tile_bwd_flops=3.86e10,
        overlap=0.5,
        flash_tiles=True,
        collectives={kind: {2: AlphaBeta(*ab)} for kind, ab in measured.items()},
    )


MEASURED_MS = Overheads(  # the same session's overheads (ms; without recomputation)
    world={
        "tp_sp/attention": 3.016,
        "tp_sp/mlp": 1.13,
        "metp/attention": 17.233,
        "metp/mlp": 2.186,
        "ulysses/attention": 4.129,
        "ulysses/mlp": 2.495,
        "ring/attention": 10.802,
        "ring/mlp": 2.768,
    },
    one_rank={"tp_sp/attention": 0.969, "tp_sp/mlp": 0.412, "metp/attention": 1.641, "metp/mlp": 0.753},
)


def _split_of_short_rows(overheads: Overheads | None, exchange_s: float) -> tuple[int, ...]:
    """The split of 8 rows of 48 tokens on 2 ranks by the strategy's group cost (the planners made as the runner
    makes them on the quick machine, with ``overheads`` as choose_planner gives them; the exchange measured
    ``exchange_s``)."""
    calibration: dict[str, object] = {}
    if overheads is not None:

        def seconds(ms: dict[str, float]) -> dict[str, float]:
            return {k: v * 1e-3 for k, v in ms.items()} | {
                f"{k}/rc": RECOMPUTE_OVERHEAD * v * 1e-3 for k, v in ms.items()
            }

        calibration = {
            "calibration": Overheads.calibration(seconds(dict(overheads.world))),
            "one_rank": Overheads.calibration(seconds(dict(overheads.one_rank))),
        }
    top = make_planner(PRESET, 2, 2**40, _cpu_machine(), prefer_tp_sp=0.25, **calibration)  # type: ignore[arg-type]
    machine = machine_for_groups(top.model.machine, 2)
    planners = {2: top}
    modes, prefer = group_planning(1, top.modes)
    one = group_calibration(1, top.model)
    planners[1] = make_planner(PRESET, 1, 2**40, machine, modes, prefer_tp_sp=prefer, calibration=one)
    dims = dims_from_config(PRESET)
    scale = exchange_s / exchange_seconds(dims, machine, 2, 1)
    shape = group_shape_cost(dims, 2, planners.__getitem__, scale)
    one_group, data_parallel = shape(48, 8, 2), shape(48, 4, 1)
    assert one_group is not None and data_parallel is not None
    return (1, 1) if data_parallel < one_group else (2,)


def test_short_rows_go_data_parallel_even_where_the_exchange_was_measured_slow() -> None:
    """8 rows of 48 tokens on two CPU processes ran in 8.5 ms data parallel and in 31 ms on one group of both
    (``benchmarks/step_overhead.py``, 2026-12-02). Priced with the per-op overheads the setup measures, data
    parallelism wins by far, also where the weight exchange was measured 6.7 ms (a busy moment; it takes 1.4-1.7).
    Without them the one group was priced at its FLOPs and latencies alone, 5.2 ms, and that measurement sent every
    such batch there."""
    assert _split_of_short_rows(MEASURED_MS, exchange_s=1.4e-3) == (1, 1)
    assert _split_of_short_rows(MEASURED_MS, exchange_s=6.7e-3) == (1, 1)
    assert _split_of_short_rows(None, exchange_s=6.7e-3) == (2,)  # the fault: priced without them
