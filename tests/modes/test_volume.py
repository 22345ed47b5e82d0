"""The communication-volume formulas (``lightning_paradyse.modes.volume``) against measured traffic.

Measured: every rank counts the bytes it sends (``CommCounter``, algorithmic volume) during one
forward + backward of a one-layer parallelized model, and the mean over ranks is compared with
``op_volume``. Per op, the block's dispatch module for the op runs alone (norm, then the mode's core,
with and without activation recomputation); per layer, the whole model runs a uniform plan (no
replicated-gradient or loss all-reduce is issued, so nothing needs excluding).

Cases: Llama GQA (kv heads divisible by p), Llama with 2 kv heads (replicated kv heads and gathered
k/v weights at p = 4), a GPT with biases (MHA); lengths divisible and not divisible by p, batch 1 and 2,
float32, and bf16 for the float32 dK/dV accumulators of the rings. One gloo spawn per world size.

Tolerance: the counter records algorithmic volume and the mean over ranks of uneven chunks is exact,
so the formulas hold to rounding. ``REL_TOL`` is far tighter than the 10% the cost model needs, so a
formula that forgets a bias or a pass fails. The pure tests reproduce the published numbers of
reference/peers.md, section 4.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lightning_paradyse.distributed import comm
from lightning_paradyse.distributed.comm import CommCounter
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.graph.dispatch import AttentionDispatch, MlpDispatch
from lightning_paradyse.models import GPTConfig, LlamaConfig, build_model, lm_loss_sum
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.plan import OPS, OpPlan, uniform_plan
from lightning_paradyse.modes.specs import AttnSpec, MlpSpec, SeqContext
from lightning_paradyse.modes.volume import op_bytes, op_traffic, op_volume
from lightning_paradyse.runtime.parallel import configure, dispatchers, is_causal, parallelize
from tests.support.dist import run_distributed

REL_TOL = 1e-9

MODELS: dict[str, LlamaConfig | GPTConfig] = {
    "llama-gqa": LlamaConfig(vocab_size=64, n_layers=1, hidden=96, n_heads=12, n_kv_heads=4, ffn=192, max_seq_len=1024),
    "llama-kv2": LlamaConfig(vocab_size=64, n_layers=1, hidden=96, n_heads=12, n_kv_heads=2, ffn=192, max_seq_len=1024),
    "gpt-bias": GPTConfig(vocab_size=64, n_layers=1, hidden=96, n_heads=12, ffn=384, max_seq_len=1024),
}


@dataclass(frozen=True)
class Case:
    """One model, batch shape and dtype; every mode, op and recompute flag is measured on it."""

    model: str
    seq_len: int
    batch: int
    dtype: str = "float32"

    @property
    def label(self) -> str:
        return f"{self.model}/s={self.seq_len}/b={self.batch}/{self.dtype}"


CASES = [
    Case("llama-gqa", 256, 1),
    Case("llama-kv2", 251, 2),
    Case("gpt-bias", 250, 1),
    Case("llama-gqa", 64, 1, "bfloat16"),
]

Key = tuple[str, str, str, str, bool]
"""(case label, level ``op``/``layer``, mode, op or ``both``, recompute)."""


def _ops(model: nn.Module) -> tuple[AttentionDispatch, MlpDispatch]:
    ops = [op for _, op in dispatchers(model)]
    attn = next(op for op in ops if isinstance(op, AttentionDispatch))
    mlp = next(op for op in ops if isinstance(op, MlpDispatch))
    return attn, mlp


def _op_fn(model: nn.Module, op: str, mode: str, rc: bool, ctx: SeqContext) -> Callable[[torch.Tensor], torch.Tensor]:
    """The op as the rewritten block runs it: norm, then the dispatch module in ``mode``."""
    block = model.layers[0]
    attn, mlp = _ops(model)
    target = attn if op == "attention" else mlp
    target.configure(ctx, OpPlan(mode, rc))
    if op == "attention":
        return lambda x: attn(block.attn_norm(x), ctx.positions())
    return lambda x: mlp(block.mlp_norm(x))


def _op_bytes_sent(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    """Bytes this rank sends in one forward + backward of ``fn``."""
    xi = x.clone().requires_grad_()
    with CommCounter() as counter:
        y = fn(xi)
        y.backward(torch.ones_like(y))
    return counter.total


def _measure_ops(model: nn.Module, case: Case, ctx: SeqContext, dtype: torch.dtype) -> dict[Key, float]:
    hidden = _ops(model)[0].spec.hidden
    x = torch.randn(case.batch, ctx.layout.local_len(ctx.rank), hidden, dtype=dtype)
    return {
        (case.label, "op", mode, op, rc): _op_bytes_sent(_op_fn(model, op, mode, rc, ctx), x)
        for mode in MODES
        for op in OPS
        for rc in (False, True)
    }


def _measure_layers(model: nn.Module, case: Case, ctx: SeqContext, tokens: torch.Tensor) -> dict[Key, float]:
    """Bytes this rank sends in one step of the whole one-layer model under a uniform plan."""
    layout, rank = ctx.layout, ctx.rank
    local, targets = layout.shard(tokens[:, :-1], rank), layout.shard(tokens[:, 1:], rank)
    out: dict[Key, float] = {}
    for mode in MODES:
        for rc in (False, True):
            configure(model, ctx, uniform_plan(mode, 1, recompute=rc))
            with CommCounter() as counter:
                lm_loss_sum(model, local, targets, ctx.positions()).backward()
            out[(case.label, "layer", mode, "both", rc)] = counter.total
    return out


def _worker(rank: int, world: int, cases: list[Case]) -> dict[Key, float]:
    group = dist.group.WORLD
    out: dict[Key, float] = {}
    for case in cases:
        torch.manual_seed(0)
        dtype = getattr(torch, case.dtype)
        model = build_model(MODELS[case.model]).to(dtype)
        parallelize(model, group)
        ctx = SeqContext(SeqLayout.for_sequence(case.seq_len, world, is_causal(model)), group)
        tokens = torch.randint(0, 64, (case.batch, case.seq_len + 1))
        out.update(_measure_ops(model, case, ctx, dtype))
        out.update(_measure_layers(model, case, ctx, tokens))
    return out


@functools.cache
def _measured(p: int) -> dict[Key, float]:
    """Mean over ranks of the bytes each rank sent, for every case (one spawn per world size)."""
    per_rank = run_distributed(_worker, p, CASES, timeout=120)
    return {key: sum(r[key] for r in per_rank) / p for key in per_rank[0]}


@functools.cache
def _specs(model: str) -> tuple[AttnSpec, MlpSpec, bool]:
    plain = build_model(MODELS[model])
    parallelize(plain, None)
    attn, mlp = _ops(plain)
    return attn.spec, mlp.spec, attn.opt("q_bias") is not None


def _predicted(case: Case, p: int, mode: str, op: str, rc: bool) -> float:
    attn, mlp, biases = _specs(case.model)
    dtype_bytes = torch.empty((), dtype=getattr(torch, case.dtype)).element_size()
    ops = OPS if op == "both" else (op,)
    return sum(
        op_bytes(
            mode,
            o,
            seq_len=case.seq_len,
            batch=case.batch,
            p=p,
            attn=attn,
            mlp=mlp,
            dtype_bytes=dtype_bytes,
            biases=biases,
            recompute=rc,
        )
        for o in ops
    )


@pytest.mark.dist
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("p", [2, 4])
def test_formulas_match_measured_bytes(p: int, mode: str) -> None:
    measured = _measured(p)
    rows, bad = [], []
    for (label, level, m, op, rc), got in sorted(measured.items()):
        if m != mode:
            continue
        case = next(c for c in CASES if c.label == label)
        want = _predicted(case, p, mode, op, rc)
        err = abs(got - want) / max(want, 1.0)
        row = f"{label:<32} {level:<5} {op:<9} rc={rc!s:<5} measured {got:>12.0f}  predicted {want:>12.0f}  {err:.1e}"
        rows.append(row)
        if err > REL_TOL or want <= 0:
            bad.append(row)
    assert len(rows) == len(CASES) * (2 * len(OPS) + 2)
    assert not bad, f"p={p} {mode}: formula and measurement differ\n" + "\n".join(bad)


# ---------------------------------------------------------------------------------------------------
# Pure tests: the published numbers and the structure of the formulas
# ---------------------------------------------------------------------------------------------------

H, P, D = 4096, 8, 128
BIG_MLP = MlpSpec(hidden=H, ffn=4 * H, act=F.gelu)


def _attn(n_kv: int) -> AttnSpec:
    return AttnSpec(hidden=H, n_heads=H // D, n_kv_heads=n_kv, head_dim=D, causal=True)


def _per_token(mode: str, op: str, n_kv: int, dtype_bytes: int = 2, s: int = 8 * 8192) -> tuple[float, float]:
    """(activation bytes per global token, weight bytes) per device of one op, forward + backward."""
    v = op_volume(mode, op, seq_len=s, batch=1, p=P, attn=_attn(n_kv), mlp=BIG_MLP, dtype_bytes=dtype_bytes)
    return v.activations / s, v.weights


@pytest.mark.parametrize("n_kv", [32, 8])
def test_published_table(n_kv: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """reference/peers.md section 4, h = 4096, P = 8, bf16 (the GQA column has h_kv = 1024), its gradients summed in
    bf16 as the table assumes (``grad_reduce_dtype="param"``); by default they travel in float32 (below)."""
    zero3_default = _per_token("ulysses", "attention", 32)[1] + _per_token("ulysses", "mlp", 32)[1]
    assert zero3_default == pytest.approx(12 * H**2 * (2 + 2 + 4) * (P - 1) / P)  # gather, re-gather, f32 grads
    monkeypatch.setattr(comm, "GRAD_REDUCE_DTYPE", None)
    tp_sp = _per_token("tp_sp", "attention", n_kv)[0] + _per_token("tp_sp", "mlp", n_kv)[0]
    assert tp_sp == pytest.approx(57_344)  # 16*h*(P-1)/P
    assert _per_token("ulysses", "attention", n_kv)[0] == pytest.approx({32: 7_168, 8: 4_480}[n_kv])
    # 12*h_kv*(P-1)/P assumes 2-byte dK/dV; in float32 everything, accumulators included, is 4 bytes
    ring_fp32 = _per_token("ring", "attention", n_kv, dtype_bytes=4)[0]
    assert ring_fp32 == pytest.approx(2 * {32: 43_008, 8: 10_752}[n_kv])
    zero3 = _per_token("ulysses", "attention", 32)[1] + _per_token("ulysses", "mlp", 32)[1]
    assert zero3 == pytest.approx(3 * 2 * 12 * H**2 * (P - 1) / P)  # 1.06 GB per layer per micro-batch
    metp = _per_token("metp", "attention", 32)[1] + _per_token("metp", "mlp", 32)[1]
    assert metp == pytest.approx(zero3)  # no biases: the same ~12h^2 elements, three times


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("op", OPS)
def test_weights_are_length_independent_and_activations_linear(mode: str, op: str) -> None:
    def vol(s: int, b: int, p: int = 4) -> tuple[float, float]:
        v = op_volume(mode, op, seq_len=s, batch=b, p=p, attn=_attn(8), mlp=BIG_MLP, dtype_bytes=2, biases=True)
        return v.activations, v.weights

    assert vol(4096, 1)[1] == vol(999, 3)[1]
    assert vol(4096, 2)[0] == pytest.approx(2 * vol(4096, 1)[0])
    assert vol(4096, 1)[0] == pytest.approx(4 * vol(1024, 1)[0])
    assert vol(4096, 1, p=1) == (0.0, 0.0)
    traffic = op_traffic(mode, op, seq_len=4096, batch=1, p=4, attn=_attn(8), mlp=BIG_MLP, dtype_bytes=2)
    assert traffic.forward.total > 0 and traffic.backward.total >= traffic.forward.total


def test_unknown_mode_or_op_is_refused() -> None:
    kwargs = dict(seq_len=16, batch=1, p=2, attn=_attn(8), mlp=BIG_MLP, dtype_bytes=2)
    with pytest.raises(ValueError, match="no volume formula"):
        op_bytes("zero", "mlp", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no volume formula"):
        op_bytes("ring", "norm", **kwargs)  # type: ignore[arg-type]
