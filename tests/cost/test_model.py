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
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_paradyse.cost.cluster import load_cluster
from lightning_paradyse.cost.dims import ModelDims, dims_from_config
from lightning_paradyse.cost.dims import dims_from_module as dims_module
from lightning_paradyse.cost.memory import param_bytes, segment_memory
from lightning_paradyse.cost.model import CostModel
from lightning_paradyse.cost.search import evaluate
from lightning_paradyse.cost.time import op_time, ring_pairs
from lightning_paradyse.cost.traffic import PHASES, op_collectives, phase_bytes
from lightning_paradyse.models import CONFIGS, build_model
from lightning_paradyse.modes import MODES, get_mode
from lightning_paradyse.modes.plan import OPS, LayerPlan, OpPlan, Plan, random_plan, uniform_plan
from lightning_paradyse.modes.volume import op_traffic
from lightning_paradyse.runtime.parallel import parallelize
from tests.modes.test_volume import MODELS as VOLUME_MODELS
from tests.support.families import EncoderLM

CLUSTER = load_cluster(sorted((Path(__file__).resolve().parents[2] / "configs" / "clusters").glob("*.yaml"))[0])
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


def test_plan_cost_prices_a_mode_only_on_the_op_that_runs_it() -> None:
    """A plan whose mode runs one op and cannot run the other on ``p`` ranks (12 heads, 2 kv heads on 8: ``metp``
    runs the MLP, not the attention) is priced, as the planner's search priced it."""
    dims = dims_from_config(dataclasses.replace(CONFIGS["llama-tiny"], n_layers=2, n_heads=12, n_kv_heads=2), 4)
    model = CostModel(dims, 8, CLUSTER.machine())
    assert "metp" not in model.allowed_modes()[0] and "metp" in model.allowed_modes()[1]
    plan = Plan((LayerPlan(OpPlan("ring"), OpPlan("metp")), LayerPlan(OpPlan("ring", True), OpPlan("metp"))))
    problem = model.problem(1024, 2)
    index = {(c.mode, c.recompute): i for i, c in enumerate(problem.choices)}
    seq = [index[(layer.op(op).mode, layer.op(op).recompute)] for layer in plan.layers for op in OPS]
    assert model.plan_cost(plan, 1024, 2) == pytest.approx(evaluate(problem, seq), rel=1e-12)


def test_quick_machine_measures_every_kernel_the_model_needs() -> None:
    """``plan="auto"`` without a profile: rates measured in-process become an exact planner's cost model."""
    from lightning_paradyse.calibration.quick import QUICK_LENGTHS, quick_machine
    from lightning_paradyse.planning.planner import make_planner

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
    from lightning_paradyse.calibration import measure
    from lightning_paradyse.calibration.profile import merge_rounds

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


def _segment_memory(
    rank: int, world: int, args: tuple[str, tuple[int, ...], tuple[bool, ...], int]
) -> dict[tuple[str, bool, int], list[int]]:
    """``(saved, fwd, bwd)`` bytes of layer 0's segments of llama-tiny in ``mode`` per (op, recompute, length): the
    least of ``reps`` runs (gloo's late releases of a collective's buffers only add)."""
    from lightning_paradyse.calibration.measure import memory_of, segment_fn
    from lightning_paradyse.distributed.layout import SeqLayout
    from lightning_paradyse.modes.specs import SeqContext

    mode, lengths, rcs, reps = args
    torch.manual_seed(0)
    model = build_model(CONFIGS["llama-tiny"])
    parallelize(model, torch.distributed.group.WORLD)
    out = {}
    for s in lengths:
        ctx = SeqContext(SeqLayout.for_sequence(s, world, True), torch.distributed.group.WORLD)
        for op in OPS:
            for rc in rcs:
                x0 = torch.randn(1, ctx.layout.local_len(rank), CONFIGS["llama-tiny"].hidden)
                runs = [memory_of(model, segment_fn(model, op, mode, rc, ctx), x0) for _ in range(reps)]
                out[(op, rc, s)] = [min(r[i] for r in runs) for i in range(3)]
    return out


def test_uneven_sequence_split_transient_is_modelled() -> None:
    """257 tokens on 2 ranks (129 + 128): the padded gather/reduce-scatter buffer is a transient the even split
    (256) does not have. What it adds to every measured peak is at most what the formulas add (the planner's
    budget must hold at odd lengths too), and it is one ``[p * max_r, h]`` buffer and the padded input, not a
    padded piece per rank and their concatenation besides. Peaks are the least of 4 runs: gloo may release a
    collective's buffers after the call returns (at a random moment), which only adds."""
    from tests.support.dist import run_distributed

    per_rank = run_distributed(_segment_memory, 2, ("tp_sp", (256, 257), (False, True), 4), timeout=120)
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


@pytest.mark.parametrize("world", [2, 4])
def test_metp_memory_is_what_the_tracker_measures(world: int) -> None:
    """``metp``'s saved bytes and both transient peaks, per segment, against the tracker on ``world`` processes:
    within 2% (the formulas follow the code's moments: the shards and accumulators alive, the rotation's
    temporaries, the gradients in flight). With 12 query and 2 key/value heads, ``p = 4`` gathers the key/value
    weights (fewer kv heads than ranks), ``p = 2`` broadcasts them. The formulas before these under-counted the
    backward peaks by up to 53% (attention) and 19% (MLP): a plan could exceed the budget by that much of a
    segment's transient."""
    from tests.support.dist import run_distributed

    lengths = (256, 1024)
    per_rank = run_distributed(_segment_memory, world, ("metp", lengths, (False,), 2), timeout=180)
    dims = dims_from_config(CONFIGS["llama-tiny"], 4)
    for op in OPS:
        for s in lengths:
            measured = [max(r[(op, False, s)][i] for r in per_rank) for i in range(3)]  # the fullest rank
            formula = segment_memory("metp", op, False, s, 1, world, dims, True)
            for got, (name, mem) in zip(
                measured, (("saved", formula.saved), ("fwd", formula.fwd), ("bwd", formula.bwd))
            ):
                assert abs(mem.total - got) <= 0.02 * got, (op, s, name, got, mem.total)


def _autocast_saved(rank: int, world: int, length: int) -> dict[tuple[str, str, bool], int]:
    """Saved bytes of layer 0's segments of llama-tiny in every mode under bf16 autocast: the least of 4 runs (gloo
    may release a collective's buffers after the call returns, at a random moment, which only adds)."""
    from lightning_paradyse.calibration.measure import segment_fn
    from lightning_paradyse.calibration.tracker import MemoryTracker
    from lightning_paradyse.distributed.layout import SeqLayout
    from lightning_paradyse.modes.specs import SeqContext

    torch.manual_seed(0)
    model = build_model(CONFIGS["llama-tiny"])
    parallelize(model, torch.distributed.group.WORLD)
    ctx = SeqContext(SeqLayout.for_sequence(length, world, True), torch.distributed.group.WORLD)
    x0 = torch.randn(1, ctx.layout.local_len(rank), CONFIGS["llama-tiny"].hidden)  # the float32 residual stream

    def saved(fn: Any) -> int:
        """Bytes alive after the forward (its input included, its output not), autocast open over the forward and
        closed before the backward, as Lightning's ``bf16-mixed`` runs a step: autocast's cache counts."""
        model.zero_grad(set_to_none=True)
        with MemoryTracker() as mem:
            x = x0.detach().clone().requires_grad_()
            before = mem.live
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = fn(x)
                kept = mem.live - (before - x.untyped_storage().nbytes()) - y.untyped_storage().nbytes()
            y.backward(torch.ones_like(y))
        return kept

    out = {}
    for mode, op, rc in itertools.product(MODES, OPS, (False, True)):
        fn = segment_fn(model, op, mode, rc, ctx)
        out[(mode, op, rc)] = min(saved(fn) for _ in range(4))
    return out


def test_autocast_saved_bytes_are_what_the_tracker_measures() -> None:
    """Under autocast (``bf16-mixed``: float32 parameters, bf16 matmuls) every mode's saved bytes per segment, with
    and without recomputation, within 4% of the tracker at p = 2 (``tp_sp`` attention recomputed is 2% below in
    float32 too; ``ulysses`` attention 3.8% above, on the safe side): the modes' activations in bf16, the norms and
    the residual stream in float32, ``tp_sp``'s autocast casts of its weight shards (kept by autocast's cache until
    the forward ends, recomputed or not), the other modes' own casts of their input per projection. Without the
    compute dtype the formulas priced everything at float32's 4 bytes: up to 65% above (a step's peak 17-39% above,
    on a GPU too)."""
    from tests.support.dist import run_distributed

    per_rank = run_distributed(_autocast_saved, 2, 256, timeout=180)
    dims = dataclasses.replace(dims_from_config(CONFIGS["llama-tiny"], 4), compute_bytes=2)
    for key in per_rank[0]:
        got = max(r[key] for r in per_rank)  # the fullest rank
        formula = segment_memory(*key, 256, 1, 2, dims, True).saved.total
        assert abs(formula - got) <= 0.04 * got, (key, got, formula)


def test_autocast_head_keeps_its_casts_and_float32_logits() -> None:
    """The LM head under autocast: saved bytes exact but for the loss's scalars (the final norm in float32, the
    head's input and weight cast to bf16, the float32 log-probabilities); the forward's peak not below the
    tracker's."""
    from lightning_paradyse.calibration.measure import memory_of
    from lightning_paradyse.cost.memory import head_memory

    torch.manual_seed(0)
    lm: Any = build_model(CONFIGS["llama-tiny"])
    dims = dataclasses.replace(dims_from_config(CONFIGS["llama-tiny"], 4), compute_bytes=2)
    for t in (256, 1024):
        targets = torch.randint(0, dims.vocab, (1, t))

        def head(x: torch.Tensor, targets: torch.Tensor = targets) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = lm.lm_head(lm.norm(x)).float()  # [1, t, vocab]
                return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

        saved, fwd, _ = memory_of(lm, head, torch.randn(1, t, dims.hidden))
        formula = head_memory(t, 1, 1, dims)
        assert abs(formula.saved.total - saved) <= 8, (t, saved, formula.saved)
        assert fwd <= formula.fwd.total <= 1.1 * fwd, (t, fwd, formula.fwd)


def test_the_compute_dtype_reaches_the_planner() -> None:
    """``bf16-mixed`` and ``16-mixed`` compute in 2 bytes, other precisions in the parameters' dtype; the planner's
    dimensions carry it (the strategy passes it at setup, the groups' planners take the world planner's), and
    its activations' collectives ship half the bytes."""
    from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision

    from lightning_paradyse.lightning.strategy import autocast_dtype
    from lightning_paradyse.planning.planner import make_planner

    assert autocast_dtype(MixedPrecision("bf16-mixed", "cpu")) == torch.bfloat16
    assert autocast_dtype(MixedPrecision("16-mixed", "cpu")) == torch.float16
    assert autocast_dtype(Precision()) is None and autocast_dtype(DoublePrecision()) is None
    assert autocast_dtype(MixedPrecision("bf16-mixed", "cpu"), torch.float64) is None  # autocast leaves float64 alone
    dims = dims_from_config(CONFIGS["llama-tiny"], 4)
    mixed = make_planner(dims, 2, 10**9, CLUSTER, compute_bytes=2)
    plain = make_planner(dims, 2, 10**9, CLUSTER)
    assert mixed.model.dims.act_bytes == 2 and plain.model.dims.act_bytes == 4
    half = dims_from_config(CONFIGS["llama-tiny"], 2)  # bf16 parameters: what autocast's modes ship, byte for byte
    for mode, op in itertools.product(MODES, OPS):
        shipped, bf16 = (op_collectives(mode, op, 1000, 1, 2, d) for d in (mixed.model.dims, half))
        assert {k: phase_bytes(v) for k, v in shipped.items()} == {k: phase_bytes(v) for k, v in bf16.items()}
    assert (
        mixed.model.plan_cost(uniform_plan("tp_sp", 2), 512, 1)[1]
        < plain.model.plan_cost(uniform_plan("tp_sp", 2), 512, 1)[1]
    )


# --------------------------------------------------------------------------------------------------
# Sliding windows: priced by the work each mode really does for a windowed layer
# --------------------------------------------------------------------------------------------------


def _mask_pairs(seq_len: int, window: int | None, docs: tuple[int, ...]) -> int:
    """Brute force: the (query, key) pairs of the causal mask, within the window and the document."""
    from lightning_paradyse.modes.attention import in_window

    pos = torch.arange(seq_len)
    doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))  # [s] document ids
    allowed = in_window(pos, pos, window) if window is not None else pos[:, None] >= pos[None, :]
    return int((allowed & (doc[:, None] == doc[None, :])).sum())


def test_window_pairs_are_the_pairs_of_the_mask() -> None:
    from lightning_paradyse.cost.time import attention_pairs, window_pairs

    for s in range(1, 25):
        for w in range(1, 28):
            assert window_pairs(s, w) == _mask_pairs(s, w, (s,)), (s, w)
            if s > w:
                assert window_pairs(s, w) == s * w - w * (w - 1) // 2
    rng = np.random.default_rng(0)
    for _ in range(40):
        docs = tuple(int(n) for n in rng.integers(1, 12, int(rng.integers(1, 5))))
        for w in (None, 1, 3, 7, 50):
            assert attention_pairs(sum(docs), True, w, docs) == _mask_pairs(sum(docs), w, docs), (docs, w)
    assert attention_pairs(10, False) == 100 and attention_pairs(10, True, 3) == window_pairs(10, 3)
    with pytest.raises(ValueError, match="add up"):
        attention_pairs(10, True, 3, (4, 5))


def test_sdpa_pairs_are_what_full_attention_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call of the SDPA kernel the windowed path makes, counted: a causal call ``s(s+1)/2``, a masked query
    chunk its whole rectangle; and the chunk masks hold ``sdpa_pairs`` elements."""
    from lightning_paradyse.cost.time import sdpa_pairs
    from lightning_paradyse.modes import attention

    real = attention.F.scaled_dot_product_attention
    seen = {"pairs": 0, "mask": 0}

    def counting(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None, **kw: Any) -> torch.Tensor:
        tq, tk = q.shape[-2], k.shape[-2]
        seen["pairs"] += tq * (tq + 1) // 2 if kw.get("is_causal") else tq * tk
        seen["mask"] += 0 if mask is None else mask.numel()
        return real(q, k, v, mask, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting)
    for s in (1, 5, 16, 37):
        q, k, v = (torch.randn(1, 2, s, 4) for _ in range(3))
        for w in (None, 1, 4, 7, 16, 40):
            seen.update(pairs=0, mask=0)
            attention.full_attention(q, k, v, True, window=w)
            assert seen["pairs"] == sdpa_pairs(s, True, w), (s, w)
            assert seen["mask"] == (sdpa_pairs(s, True, w) if w is not None and s > w else 0)


def test_ring_tiles_are_the_tiles_ring_attention_computes() -> None:
    """:func:`ring_tiles` against :func:`doc_tiles` on every rank: the busiest rank's pairs by kind, the masked tiles
    per source; and the computed tiles' allowed pairs are exactly the window's."""
    from lightning_paradyse.cost.time import ring_tiles, window_pairs
    from lightning_paradyse.distributed.layout import SeqLayout
    from lightning_paradyse.modes.ring import doc_tiles
    from lightning_paradyse.modes.specs import SeqContext

    def area(q_sl: slice, k_sl: slice) -> int:
        return (q_sl.stop - q_sl.start) * (k_sl.stop - k_sl.start)

    for s, p in itertools.product((16, 37, 64), (1, 2, 3, 4)):
        ctx = SeqContext(SeqLayout.for_sequence(s, p, True), None)
        for w in (None, 1, 3, 5, 8, 20, 100):
            per_rank, allowed_pairs = [], 0
            for rank in range(p):
                pairs = diag = masked = most_masked = 0
                for src in range(p):
                    tiles = doc_tiles(ctx, rank, src, True, w)
                    for q_sl, k_sl, is_diag, allowed in tiles:
                        n = area(q_sl, k_sl)
                        pairs += n
                        diag += n if is_diag and allowed is None else 0
                        masked += n if allowed is not None else 0
                        if allowed is None:  # a whole tile in the past, or a causal diagonal tile
                            allowed_pairs += _diag_pairs(q_sl) if is_diag else n
                        else:
                            allowed_pairs += int(allowed.sum())
                    most_masked = max(most_masked, sum(a is not None for *_, a in tiles))
                per_rank.append((pairs, masked, diag, most_masked))
            want = max(per_rank, key=lambda r: r[:3])
            got = ring_tiles(s, p, True, w)
            assert (got.pairs, got.masked_pairs, got.diag_pairs, got.masked_tiles) == want, (s, p, w)
            assert allowed_pairs == (window_pairs(s, w) if w is not None else s * (s + 1) // 2), (s, p, w)


def _diag_pairs(q_sl: slice) -> int:
    n = q_sl.stop - q_sl.start
    return n * (n + 1) // 2


@pytest.mark.parametrize("mode", list(MODES))
def test_a_windowed_layer_is_priced_by_its_work(mode: str) -> None:
    """Cheaper than a full layer of the same length when the window is well inside it, the same when the window
    covers the sequence; the MLP and the collectives do not change (every ring hop still travels)."""
    dims = dims_from_config(CONFIGS["llama-7b"], 2)
    machine = CLUSTER.machine()
    s, p = 32768, 8
    for rc in (False, True):
        full = op_time(mode, "attention", rc, s, 1, p, dims, machine)
        for w in (512, 4096):
            windowed = op_time(mode, "attention", rc, s, 1, p, dims, machine, window=w)
            assert windowed.total() < full.total(), (w, rc)
            assert windowed.comm == full.comm
        for w in (s, 2 * s):
            assert op_time(mode, "attention", rc, s, 1, p, dims, machine, window=w) == full
            for op in OPS:
                assert segment_memory(mode, op, rc, s, 1, p, dims, window=w) == segment_memory(
                    mode, op, rc, s, 1, p, dims
                )
        assert op_time(mode, "mlp", rc, s, 1, p, dims, machine, window=512) == op_time(
            mode, "mlp", rc, s, 1, p, dims, machine
        )


def test_masked_ring_tiles_are_timed_at_the_explicit_kernel_rate() -> None:
    from lightning_paradyse.cost.time import Machine, op_work, ring_tiles, tile_side

    dims = dims_from_config(CONFIGS["llama-tiny"], 4)
    s, p, w = 4096, 4, 700
    tiles = ring_tiles(s, p, True, w)
    assert 0 < tiles.masked_pairs < tiles.pairs < ring_pairs(s, p, causal=True)
    work = op_work("ring", "attention", s, 1, p, dims, window=w)["forward"]
    per_pair = 4 * dims.head_dim * dims.n_heads
    assert (work.attn, work.attn_masked, work.attn_diag) == (
        per_pair * tiles.pairs,
        per_pair * tiles.masked_pairs,
        per_pair * tiles.diag_pairs,
    )
    side = tile_side(s, p, True)
    curves = {"tile_fwd": ((side, 8e9),), "tile_diag_fwd": ((side, 4e9),), "tile_mask_fwd": ((side, 1e9),)}
    machine = Machine("test", 1e12, 1e10, 1e10, 8e9, 8e9, curves=curves)
    from lightning_paradyse.cost.time import attn_seconds

    plain = work.attn - work.attn_masked - work.attn_diag
    want = plain / 8e9 + work.attn_diag / 4e9 + work.attn_masked / 1e9
    assert attn_seconds(machine, work, backward=False) == pytest.approx(want)
    older = dataclasses.replace(machine, curves={k: v for k, v in curves.items() if "mask" not in k})
    assert attn_seconds(older, work, backward=False) == pytest.approx(plain / 8e9 + (work.attn - plain) / 4e9)


def _windowed_segment(mode: str, s: int, window: int | None) -> tuple[int, int, int]:
    """``(saved, fwd, bwd)`` of layer 0's attention segment with ``window`` on one process, measured by the tracker."""
    from lightning_paradyse.calibration.measure import memory_of, segment_fn
    from lightning_paradyse.distributed.layout import SeqLayout
    from lightning_paradyse.graph.dispatch import AttentionDispatch
    from lightning_paradyse.modes.specs import SeqContext
    from lightning_paradyse.runtime.parallel import dispatchers

    torch.manual_seed(0)
    model = build_model(CONFIGS["llama-tiny"])
    parallelize(model, None)
    attn = next(m for _, m in dispatchers(model) if isinstance(m, AttentionDispatch) and m.layer == 0)
    attn.spec = dataclasses.replace(attn.spec, window=window)
    ctx = SeqContext(SeqLayout.for_sequence(s, 1, True), None)
    x0 = torch.randn(1, s, CONFIGS["llama-tiny"].hidden)
    runs = [memory_of(model, segment_fn(model, "attention", mode, False, ctx), x0) for _ in range(2)]
    return min(r[0] for r in runs), min(r[1] for r in runs), min(r[2] for r in runs)


def test_window_memory_follows_the_code() -> None:
    """Measured by the tracker (one process): the SDPA path's query chunks keep their float band masks and, in
    ``tp_sp``, their outputs beside the concatenation, exactly what the formulas add to the saved bytes; a ring
    tile the window crosses runs the explicit kernel, whose score tiles the formulas count (within 10%)."""
    dims = dims_from_config(CONFIGS["llama-tiny"], 4)
    s, w = 256, 32
    full, windowed = _windowed_segment("tp_sp", s, None), _windowed_segment("tp_sp", s, w)
    model_full, model_windowed = (
        segment_memory("tp_sp", "attention", False, s, 1, 1, dims, True, x) for x in (None, w)
    )
    assert windowed[0] - full[0] == model_windowed.saved.total - model_full.saved.total > 0
    ring = _windowed_segment("ring", s, w)
    modelled = segment_memory("ring", "attention", False, s, 1, 1, dims, True, w)
    assert ring[1] == pytest.approx(modelled.fwd.total, rel=0.1) and ring[2] == pytest.approx(
        modelled.bwd.total, rel=0.1
    )
    assert modelled.fwd.total > 4 * segment_memory("ring", "attention", False, s, 1, 1, dims, True).fwd.total


def test_windows_come_per_layer_from_the_dispatch_modules() -> None:
    """Qwen2 with ``max_window_layers=1``: a full layer, then a sliding one; the cost tables get a row per window."""
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    config = transformers.Qwen2Config(
        **small, num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=1
    )
    model = transformers.Qwen2ForCausalLM(config)
    parallelize(model, None)
    dims = dims_module(model)
    assert dims.windows == (None, 16) and dims.window(0) is None and dims.window(1) == 16
    cost = CostModel(dims, 1, CLUSTER.machine())
    assert cost.op_rows() == [("attention", None), ("mlp", None), ("attention", 16)]
    assert cost.positions() == (0, 1, 2, 1)
    with pytest.raises(ValueError, match="one per layer"):
        dataclasses.replace(dims, windows=(16,))
    assert dataclasses.replace(dims, windows=[None, None]).windows == ()  # no window anywhere: the plain model
    assert ModelDims(**json.loads(json.dumps(dataclasses.asdict(dims)))) == dims  # as a profile stores them


def test_an_mlp_the_block_computes_inline_is_priced_without_a_memory_gain_from_recomputation() -> None:
    """``nn.TransformerEncoderLayer`` computes its MLP itself (two linears rewritten one by one): the cost model reads
    its width from the up projection, and recomputing the linears saves none of what the block's activation between
    them keeps (priced no cheaper in memory than not recomputing, and slower): the planner never picks it to save
    memory."""
    model = EncoderLM(causal=True, hidden=96)
    parallelize(model, None)
    dims = dims_module(model)
    assert (dims.hidden, dims.ffn, dims.gated, dims.biases, dims.inline_mlp) == (96, 192, False, True, True)
    cost = CostModel(dims, 2, CLUSTER.machine())
    for mode in ("tp_sp", "ulysses", "ring"):
        plain, recomputed = cost.op_costs(mode, "mlp", 512, 2)
        assert recomputed.time_s > plain.time_s, mode
        assert recomputed.saved == plain.saved and recomputed.fwd >= plain.fwd and recomputed.bwd >= plain.bwd, mode
        assert cost.op_costs(mode, "mlp", 512, 2, recompute=(True,)) == (recomputed,)
        own = CostModel(dataclasses.replace(dims, inline_mlp=False), 2, CLUSTER.machine())  # an MLP module of its own
        assert own.op_cost(mode, "mlp", True, 512, 2).saved < plain.saved, mode  # there recomputing saves memory


def test_the_kernels_only_windows_call_are_measured_for_models_with_windows() -> None:
    """Masked ring tiles (explicit kernel) and the SDPA path's band-masked query chunks, at each window (capped at
    half the longest benchmarked length); and the SDPA path of a windowed layer is timed at the band kernel's rate."""
    from types import SimpleNamespace

    from lightning_paradyse.calibration.measure import bench_kernels
    from lightning_paradyse.cost.time import Machine, attn_seconds, op_work, sdpa_pairs

    settings = SimpleNamespace(batch=1, dtype="float32", device="cpu", kernel_lengths=(64,), kernel_seconds=0.0)
    dims = dims_from_config(dataclasses.replace(CONFIGS["llama-tiny"], n_layers=2), 4)
    plain = bench_kernels(dims, settings, 2)
    windowed = bench_kernels(dataclasses.replace(dims, windows=(16, 100)), settings, 2)
    assert not any("mask" in k or "band" in k for k in plain)
    added = {"tile_mask_fwd", "tile_mask_bwd", "gtile_mask_fwd", "gtile_mask_bwd", "sdpa_band_fwd", "sdpa_band_bwd"}
    assert set(windowed) == set(plain) | added and all(rate > 0 for k in added for _, rate in windowed[k])
    assert [size for size, _ in windowed["sdpa_band_fwd"]] == [32.0, 64.0]  # 2w for w = 16 and w = 100 -> 32

    work = op_work("tp_sp", "attention", 1000, 1, 2, dims, window=100)["forward"]
    assert (work.kernel, work.attn_size) == ("sdpa_band", 200)
    assert work.attn == 4 * dims.head_dim * dims.n_heads / 2 * sdpa_pairs(1000, True, 100)
    curves = {"sdpa_fwd": ((200, 4e9),), "sdpa_band_fwd": ((200, 2e9),)}
    machine = Machine("test", 1e12, 1e10, 1e10, 8e9, 8e9, curves=curves)
    assert attn_seconds(machine, work, backward=False) == pytest.approx(work.attn / 2e9)
    older = dataclasses.replace(machine, curves={"sdpa_fwd": ((200, 4e9),)})  # the causal kernel at 2w stands in
    assert attn_seconds(older, work, backward=False) == pytest.approx(work.attn / 4e9)
    assert op_work("tp_sp", "attention", 100, 1, 2, dims, window=100)["forward"].kernel == "sdpa"


AUTOCAST_TRAFFIC_MODELS = {  # k/v weights gathered by tp_sp at p = 4 (2 kv heads); biases gathered by ZeRO-3
    name: VOLUME_MODELS[name] for name in ("llama-kv2", "gpt-bias")
}


def _autocast_traffic(rank: int, world: int, length: int, batch: int) -> dict[tuple[str, str, str, bool], float]:
    """Bytes this rank sends in one forward (under bf16 autocast, float32 parameters) and backward of each segment
    of layer 0, in every mode, recomputed or not."""
    from lightning_paradyse.calibration.measure import segment_fn
    from lightning_paradyse.distributed.comm import CommCounter
    from lightning_paradyse.distributed.layout import SeqLayout
    from lightning_paradyse.modes.specs import SeqContext

    out = {}
    for name, config in AUTOCAST_TRAFFIC_MODELS.items():
        torch.manual_seed(0)
        model = build_model(config)
        parallelize(model, torch.distributed.group.WORLD)
        ctx = SeqContext(SeqLayout.for_sequence(length, world, True), torch.distributed.group.WORLD)
        for mode, op, rc in itertools.product(MODES, OPS, (False, True)):
            fn = segment_fn(model, op, mode, rc, ctx)
            x = torch.randn(batch, ctx.layout.local_len(rank), config.hidden, requires_grad=True)
            with CommCounter() as counter:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = fn(x)
                y.backward(torch.ones_like(y))
            out[(name, mode, op, rc)] = counter.total
    return out


def test_autocast_traffic_is_what_the_ranks_send() -> None:
    """Under autocast every mode's collectives per segment (forward, backward, the recomputation) are the bytes the
    ranks send, exactly (mean over ranks, algorithmic volume): activations and the matrices the modes cast before
    moving them in bf16; ``tp_sp``'s gathered k/v weights and ZeRO-3's biases as stored (float32: autocast casts
    them after the gather); every weight gradient summed in float32."""
    from tests.support.dist import run_distributed

    length, batch, p = 63, 2, 4
    per_rank = run_distributed(_autocast_traffic, p, length, batch, timeout=300)
    for name, config in AUTOCAST_TRAFFIC_MODELS.items():
        dims = dataclasses.replace(dims_from_config(config, 4), compute_bytes=2)
        for mode, op, rc in itertools.product(MODES, OPS, (False, True)):
            got = sum(r[(name, mode, op, rc)] for r in per_rank) / p
            phases = op_collectives(mode, op, length, batch, p, dims)
            want = sum(phase_bytes(phases[ph]) for ph in ("forward", "backward", *(("recompute",) if rc else ())))
            assert got == pytest.approx(want, rel=1e-9), (name, mode, op, rc)


@pytest.mark.parametrize("name", MODELS)
def test_a_modes_variants_priced_together_are_each_priced_alone(name: str) -> None:
    """The planner prices both variants of a mode in one go (:meth:`CostModel.op_costs`, sharing the shape, the core's
    bytes and the forward's and backward's seconds): the same numbers, bit for bit, as each variant alone."""
    dims = dims_from_config(CONFIGS[name])
    for p, compute in itertools.product((1, 2, 8), (None, 2)):
        model = CostModel(dataclasses.replace(dims, compute_bytes=compute), p, CLUSTER.machine())
        for mode, op, (s, b) in itertools.product(MODES, OPS, ((64, 3), (513, 1))):
            if not _feasible(mode, op, model.dims, p):
                continue
            together = model.op_costs(mode, op, s, b)
            assert together == tuple(model.op_cost(mode, op, rc, s, b) for rc in (False, True))
            assert model.op_costs(mode, op, s, b, recompute=(True,)) == together[1:]
