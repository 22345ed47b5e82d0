"""The cost model's pieces without processes: collectives against volume.py, memory and time formulas.

* The collective inventory (kind, calls, overlap) sums to ``volume.op_traffic`` byte for byte, for every
  mode, op and phase, several models (GQA with kv heads dividing p or not, MHA with biases), dtypes and
  group sizes, so the time model's communication terms rest on the measured-exact volumes.
* Memory formulas: the saved bytes under recomputation do not depend on the mode; everything grows
  with the length; flash tiles remove the ring's quadratic transient; parameter bytes match a real
  parallelized module.
* Time: modelled op time grows with the length, a cluster's group beyond one node uses the inter-node
  bandwidth, and a plan's predicted cost is what the planner's tables say.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_paradyse.cost.cluster import load_cluster
from lightning_paradyse.cost.dims import ModelDims, dims_from_config
from lightning_paradyse.cost.memory import param_bytes, segment_memory
from lightning_paradyse.cost.model import CostModel
from lightning_paradyse.cost.search import evaluate
from lightning_paradyse.cost.time import op_time, ring_pairs
from lightning_paradyse.cost.traffic import PHASES, op_collectives, phase_bytes
from lightning_paradyse.models import CONFIGS, build_model
from lightning_paradyse.modes import MODES, get_mode
from lightning_paradyse.parallel import parallelize
from lightning_paradyse.plan import OPS, random_plan
from lightning_paradyse.volume import op_traffic

CLUSTER = load_cluster(sorted((Path(__file__).resolve().parents[1] / "configs" / "clusters").glob("*.yaml"))[0])
MODELS = ["llama-tiny", "llama-tiny-mha", "llama-tiny-mqa", "gpt-tiny", "llama-70b"]


def _feasible(mode: str, op: str, dims: ModelDims, p: int) -> bool:
    m = get_mode(mode)
    reason = m.attention_infeasible(dims.attn_spec(), p) if op == "attention" else m.mlp_infeasible(dims.mlp_spec(), p)
    return reason is None


@pytest.mark.parametrize("name", MODELS)
def test_collectives_sum_to_the_exact_volume(name: str) -> None:
    checked = 0
    for dtype_bytes in (2, 4):
        dims = dims_from_config(CONFIGS[name], dtype_bytes)
        for p in (1, 2, 3, 4, 8):
            for mode in MODES:
                for op in OPS:
                    if not _feasible(mode, op, dims, p):
                        continue
                    for s, b in ((1000, 1), (4099, 2)):
                        traffic = op_traffic(
                            mode,
                            op,
                            seq_len=s,
                            batch=b,
                            p=p,
                            attn=dims.attn_spec(),
                            mlp=dims.mlp_spec(),
                            dtype_bytes=dtype_bytes,
                            biases=dims.biases,
                        )
                        colls = op_collectives(mode, op, s, b, p, dims)
                        for phase in PHASES:
                            want = getattr(traffic, phase).total
                            assert phase_bytes(colls[phase]) == pytest.approx(want, rel=1e-12, abs=1e-6)
                            checked += 1
    assert checked > 100


def test_recomputation_saves_the_same_whatever_the_mode() -> None:
    dims = dims_from_config(CONFIGS["llama-7b"], 2)
    for op in OPS:
        saved = {segment_memory(m, op, True, 32768, 1, 8, dims).saved.total for m in MODES}
        assert len(saved) == 1
        plain = [segment_memory(m, op, False, 32768, 1, 8, dims).saved.total for m in MODES]
        assert min(plain) >= saved.pop()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("op", OPS)
def test_memory_and_time_grow_with_the_length(mode: str, op: str) -> None:
    dims = dims_from_config(CONFIGS["llama-7b"], 2)
    machine = CLUSTER.machine()
    for rc in (False, True):
        mems = [segment_memory(mode, op, rc, s, 1, 8, dims) for s in (1024, 8192, 65536)]
        for a, b in itertools.pairwise(mems):
            assert a.saved.total < b.saved.total and a.fwd.total < b.fwd.total and a.bwd.total < b.bwd.total
        times = [op_time(mode, op, rc, s, 1, 8, dims, machine).total() for s in (1024, 8192, 65536)]
        assert times == sorted(times) and times[0] > 0


def test_flash_tiles_remove_the_quadratic_ring_transient() -> None:
    dims = dims_from_config(CONFIGS["llama-7b"], 2)
    for mode in ("ring", "metp"):
        eager = segment_memory(mode, "attention", False, 131072, 1, 8, dims)
        flash = segment_memory(mode, "attention", False, 131072, 1, 8, dims, flash=True)
        assert flash.fwd.total < eager.fwd.total and flash.saved == eager.saved


def test_ring_pairs_are_balanced_and_half_causal() -> None:
    assert ring_pairs(4096, 4, causal=False) == 4096 * 1024
    causal = ring_pairs(4096, 4, causal=True)  # head-tail layout: every rank the same, diagonals whole
    assert 4096 * 4096 / 2 / 4 <= causal <= 4096 * 4096 / 2 / 4 + 2 * 512 * 512


def test_parameter_bytes_match_a_parallelized_module() -> None:
    for name in ("llama-tiny", "gpt-tiny"):
        config = CONFIGS[name]
        module = build_model(config)
        parallelize(module, None)
        actual = sum(p.numel() * p.element_size() for p in module.parameters())
        assert param_bytes(1, dims_from_config(config, 4)) == actual == config.num_params() * 4


def test_inter_node_groups_use_the_slower_links() -> None:
    machine = dataclasses.replace(CLUSTER, gpus=16).machine()
    inside, across = machine.collective("all_to_all", 8), machine.collective("all_to_all", 16)
    assert inside.beta == CLUSTER.intra_node_gbps * 1e9 and across.beta == CLUSTER.inter_node_gbps * 1e9


def test_plan_cost_is_the_planner_accounting() -> None:
    dims = dims_from_config(dataclasses.replace(CONFIGS["llama-tiny"], n_layers=4), 4)
    model = CostModel(dims, 2, CLUSTER.machine())
    plan = random_plan(4, list(MODES), seed=3)
    problem = model.problem(3000, 2)
    index = {(c.mode, c.recompute): i for i, c in enumerate(problem.choices)}
    seq = [index[(layer.op(op).mode, layer.op(op).recompute)] for layer in plan.layers for op in OPS]
    assert model.plan_cost(plan, 3000, 2) == pytest.approx(evaluate(problem, seq))
    time, peak = model.plan_cost(plan, 3000, 2)
    assert peak > model.static_bytes() > 0 and time > 0
    assert torch.tensor(problem.saved).min() > 0


def test_quick_machine_measures_every_kernel_the_model_needs() -> None:
    """``plan="auto"`` without a profile: rates measured in-process become an exact planner's cost model."""
    from lightning_paradyse.cost.planner import make_planner
    from lightning_paradyse.cost.quick import QUICK_LENGTHS, quick_machine

    dims = dims_from_config(CONFIGS["llama-tiny"], 4)
    machine = quick_machine(dims, 1, None, torch.device("cpu"), torch.float32)
    assert {"gemm", "sdpa_fwd", "sdpa_bwd", "tile_fwd", "tile_bwd", "tile_diag_fwd", "tile_diag_bwd"} <= set(
        machine.curves
    )
    assert all(len(curve) == len(QUICK_LENGTHS) and all(r > 0 for _, r in curve) for curve in machine.curves.values())
    assert machine.collectives == {}  # one rank: nothing to measure
    planner = make_planner(dims, 1, 2**40, machine)
    assert planner.plan(512, 1).layers[0].attention.mode in MODES


def test_diagonal_ring_tiles_are_timed_at_their_own_rate() -> None:
    """Head-tail layout on 2 ranks: each rank computes 5 tiles of s/4 tokens a side, 2 of them on the diagonal."""
    from lightning_paradyse.cost.time import Machine, Work, attn_seconds, ring_tile_pairs

    side = 2048 // 4
    assert ring_tile_pairs(2048, 2, causal=True) == (5 * side * side, 2 * side * side)
    assert ring_tile_pairs(2048, 2, causal=False)[1] == 0
    curves = {"tile_fwd": ((side, 8e9),), "tile_diag_fwd": ((side, 2e9),)}
    machine = Machine("test", 1e12, 1e10, 1e10, 8e9, 8e9, curves=curves)
    work = Work(0.0, attn=5e9, kernel="tile", attn_size=side, attn_diag=2e9)
    assert attn_seconds(machine, work, backward=False) == pytest.approx(3e9 / 8e9 + 2e9 / 2e9)
    plain = dataclasses.replace(machine, curves={"tile_fwd": ((side, 8e9),)})  # no diagonal curve: one rate
    assert attn_seconds(plain, work, backward=False) == pytest.approx(5e9 / 8e9)
    metp = Work(0.0, attn=5e9, kernel="gtile", attn_size=side, attn_diag=2e9)  # no group curve: the all-head ones
    assert attn_seconds(machine, metp, backward=False) == pytest.approx(3e9 / 8e9 + 2e9 / 2e9)


def test_timings_are_medians_over_repetitions_and_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """One slow or one lucky run moves neither a measurement nor a merged round; the minimum would."""
    from lightning_paradyse.cost import measure
    from lightning_paradyse.cost.profile import merge_rounds

    durations = iter([9.0, 0.010, 0.50, 0.012, 0.001, 0.011])  # a warm-up, then 5 timed runs
    clock = {"now": 0.0, "next": 0.0}

    def perf_counter() -> float:  # start, stop, start, stop, ...: each stop advances by the next duration
        clock["now"], clock["next"] = clock["now"] + clock["next"], 0.0
        return clock["now"]

    def run() -> None:
        clock["next"] = next(durations)

    monkeypatch.setattr(measure.time, "perf_counter", perf_counter)
    assert measure.timed(run, reps=1) == pytest.approx(0.011)  # at least MIN_REPS runs, the middle one

    def one_round(t: float, rate: float) -> dict[str, object]:
        rows = [{"mode": "tp_sp", "seq_len": 128, "time_s": t, "peak": 7}]
        curves = {"gemm": [(64.0, rate)]}
        return {
            "kernels": curves,
            "collectives": {"ring": [(8.0, t)]},
            "overlap": rate / 10,
            **dict.fromkeys(("segments", "fit_steps", "steps"), rows),
        }

    merged = merge_rounds([one_round(t, r) for t, r in ((0.020, 3.0), (0.001, 9.0), (0.021, 2.0))])
    assert merged["steps"][0]["time_s"] == 0.020 and merged["steps"][0]["peak"] == 7
    assert merged["kernels"]["gemm"] == [(64.0, 3.0)] and merged["collectives"]["ring"] == [(8.0, 0.020)]
    assert merged["overlap"] == pytest.approx(0.3)


def _tp_sp_segment_memory(rank: int, world: int, lengths: tuple[int, ...]) -> dict[tuple[str, bool, int], Any]:
    from lightning_paradyse.cost.measure import memory_of, segment_fn
    from lightning_paradyse.layout import SeqLayout
    from lightning_paradyse.spec import SeqContext

    torch.manual_seed(0)
    model = build_model(CONFIGS["llama-tiny"])
    parallelize(model, torch.distributed.group.WORLD)
    out = {}
    for s in lengths:
        ctx = SeqContext(SeqLayout.for_sequence(s, world, True), torch.distributed.group.WORLD)
        for op in OPS:
            for rc in (False, True):
                x0 = torch.randn(1, ctx.layout.local_len(rank), CONFIGS["llama-tiny"].hidden)
                runs = [memory_of(model, segment_fn(model, op, "tp_sp", rc, ctx), x0) for _ in range(4)]
                out[(op, rc, s)] = [min(r[i] for r in runs) for i in range(3)]  # gloo's late releases only add
    return out


def test_uneven_sequence_split_transient_is_modelled() -> None:
    """257 tokens on 2 ranks (129 + 128): the padded gather/reduce-scatter buffer is a transient the even split
    (256) does not have. What it adds to every measured peak is at most what the formulas add (the planner's
    budget must hold at odd lengths too), and it is one ``[p * max_r, h]`` buffer and the padded input, not a
    padded piece per rank and their concatenation besides. Peaks are the least of 4 runs: gloo may release a
    collective's buffers after the call returns (at a random moment), which only adds."""
    from tests.support.dist import run_distributed

    per_rank = run_distributed(_tp_sp_segment_memory, 2, (256, 257), timeout=120)
    dims = dims_from_config(CONFIGS["llama-tiny"], 4)
    pad = 2 * 129 * dims.hidden * 4
    for op in OPS:
        for rc in (False, True):
            even, odd = (segment_memory("tp_sp", op, rc, s, 1, 2, dims, True) for s in (256, 257))
            for i, name in ((1, "fwd"), (2, "bwd")):
                grown = max(r[(op, rc, 257)][i] for r in per_rank) - max(r[(op, rc, 256)][i] for r in per_rank)
                modelled = getattr(odd, name).total - getattr(even, name).total
                assert grown <= modelled + 0.01 * pad, (op, rc, name, grown, modelled)
                assert grown <= 1.5 * pad + 0.01 * pad, (op, rc, name, grown)
