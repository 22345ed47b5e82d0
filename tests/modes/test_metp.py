"""``metp`` against a single-process float64 reference: outputs, input and weight-shard gradients,
parameters untouched, and the weight-ring traffic of the MLP. One gloo spawn per world size."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_paradyse.distributed.comm import CommCounter, all_gather_rows, all_reduce_sum
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.models.llama import RotaryEmbedding
from lightning_paradyse.modes.base import split_heads
from lightning_paradyse.modes.metp import MemoryEfficientTensorParallel
from lightning_paradyse.modes.specs import AttnSpec, AttnWeights, MlpSpec, MlpWeights, SeqContext, shard_rows
from tests.support.dist import run_distributed

H, N, D, B = 96, 12, 8, 2
RTOL = 1e-10
MODE = MemoryEfficientTensorParallel()


def _close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    """Relative error under ``rtol``; a reference that is zero by symmetry (the key bias without
    rotation shifts every score of a query equally) is compared absolutely."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape}/{got.dtype}"
    scale = want.norm().item()
    assert scale > 0 or name.endswith("dbk"), f"{name}: the reference is zero"
    err = (got - want).norm().item() / max(scale, 1.0)
    assert err < rtol, f"{name}: relative error {err:.3e}"


def _ctx(s: int, p: int, rank: int, causal: bool) -> SeqContext:
    group = dist.group.WORLD if p > 1 else None
    return SeqContext(SeqLayout.for_sequence(s, p, causal), group)


def _gather_out(y: torch.Tensor, layout: SeqLayout, group: Any) -> torch.Tensor:
    """All ranks' local outputs as one natural-order ``[b, s, h]``."""
    full = all_gather_rows(y.detach().transpose(0, 1).contiguous(), layout.local_lens, group)  # [s, b, h]
    return layout.unshard(list(full.split(list(layout.local_lens))), dim=0).transpose(0, 1)


def _params(ws: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    return {n: t.contiguous().requires_grad_() for n, t in ws.items() if t is not None}


def _check_params(params: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    for n, t in params.items():
        assert torch.equal(t.detach(), before[n]), f"parameter {n} was written"
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype, n
        assert t.grad.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), n


def _attention_case(p: int, rank: int, s: int, n_kv: int, causal: bool, bias: bool, rope: bool) -> None:
    torch.manual_seed(1000 + s + n_kv + 2 * causal)
    lin = {
        n: nn.Linear(H, r, bias=bias, dtype=torch.float64) for n, r in (("q", N * D), ("k", n_kv * D), ("v", n_kv * D))
    }
    lin["o"] = nn.Linear(N * D, H, bias=bias, dtype=torch.float64)
    x = torch.randn(B, s, H, dtype=torch.float64, requires_grad=True)
    wl = torch.randn(B, s, H, dtype=torch.float64)
    rot = RotaryEmbedding(D, 10000.0) if rope else None
    norm = nn.LayerNorm(D, dtype=torch.float64) if rope else None  # a q norm with parameters (Qwen3), with rope
    if norm is not None:
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.5)
    # reference: the whole sequence in one process
    q, k, v = (lin[n](x).view(B, s, -1, D).transpose(1, 2) for n in "qkv")
    if rot is not None and norm is not None:
        q, k = rot(norm(q), k, torch.arange(s))
    g = N // n_kv
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=causal)
    ref = lin["o"](o.transpose(1, 2).reshape(B, s, N * D))
    (ref * wl).sum().backward()
    # parallel
    ctx = _ctx(s, p, rank, causal)
    lay = ctx.layout
    full = {
        "q": lin["q"].weight,
        "k": lin["k"].weight,
        "v": lin["v"].weight,
        "o_t": lin["o"].weight.t(),
        "bq": lin["q"].bias,
        "bk": lin["k"].bias,
        "bv": lin["v"].bias,
    }
    params = _params({n: None if t is None else shard_rows(t.detach(), p, rank) for n, t in full.items()})
    bo = None if lin["o"].bias is None else lin["o"].bias.detach().clone().requires_grad_()
    before = {n: t.detach().clone() for n, t in params.items()}
    spec = AttnSpec(H, N, n_kv, D, causal)
    ref_norm: list[torch.Tensor] = []
    if rot is not None and norm is not None:  # the model's code before the attention, with a parameter

        def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> Any:
            q, k, v = (split_heads(t, D) for t in (q, k, v))  # [b, t, heads*d] -> [b, heads, t, d]
            q, k = rot(norm(q), k, positions)
            return q, k, v

        spec = replace(spec, prepare=prepare, prepare_params=tuple(norm.parameters()))
        ref_norm = [w.grad.clone() for w in norm.parameters() if w.grad is not None]
        norm.zero_grad()
    xl = lay.shard(x.detach(), rank).requires_grad_()
    y = MODE.attention(xl, AttnWeights(**params, bo=bo), spec, ctx)  # type: ignore[arg-type]
    (y * lay.shard(wl, rank)).sum().backward()
    case = f"attn s={s} kv={n_kv} causal={causal} bias={bias} rope={rope}"
    _close(f"{case} out", _gather_out(y, lay, ctx.group), ref.detach())
    _close(f"{case} dx", xl.grad, lay.shard(x.grad, rank))
    for n, t in params.items():
        _close(f"{case} d{n}", t.grad, shard_rows(full[n].grad if n != "o_t" else lin["o"].weight.grad.t(), p, rank))
    if bo is not None:
        _close(f"{case} dbo", all_reduce_sum(bo.grad, ctx.group), lin["o"].bias.grad)
    if norm is not None:  # each rank's tokens give a part of the norm's gradient; the parts sum to one process's
        for w, want in zip(norm.parameters(), ref_norm):
            _close(f"{case} dnorm", all_reduce_sum(w.grad, ctx.group), want)
    _check_params(params, before)


def _mlp_case(p: int, rank: int, s: int, f: int, gated: bool, bias: bool) -> dict[str, float]:
    torch.manual_seed(2000 + s + f + gated)
    up, down = nn.Linear(H, f, bias=bias, dtype=torch.float64), nn.Linear(f, H, bias=bias, dtype=torch.float64)
    gate = nn.Linear(H, f, bias=bias, dtype=torch.float64) if gated else None
    act = F.silu if gated else F.gelu
    x = torch.randn(B, s, H, dtype=torch.float64, requires_grad=True)
    wl = torch.randn(B, s, H, dtype=torch.float64)
    hid = act(gate(x)) * up(x) if gate is not None else act(up(x))
    ref = down(hid)
    (ref * wl).sum().backward()
    ctx = _ctx(s, p, rank, causal=False)
    lay = ctx.layout
    full = {
        "up": up.weight,
        "gate": None if gate is None else gate.weight,
        "down_t": down.weight.t(),
        "b_up": up.bias,
        "b_gate": None if gate is None else gate.bias,
    }
    params = _params({n: None if t is None else shard_rows(t.detach(), p, rank) for n, t in full.items()})
    before = {n: t.detach().clone() for n, t in params.items()}
    xl = lay.shard(x.detach(), rank).requires_grad_()
    with CommCounter() as counter:
        y = MODE.mlp(xl, MlpWeights(**params), MlpSpec(H, f, act, gated), ctx)  # type: ignore[arg-type]
        (y * lay.shard(wl, rank)).sum().backward()
    case = f"mlp s={s} f={f} gated={gated} bias={bias}"
    _close(f"{case} out", _gather_out(y, lay, ctx.group), ref.detach() - (0 if down.bias is None else down.bias))
    _close(f"{case} dx", xl.grad, lay.shard(x.grad, rank))
    for n, t in params.items():
        want = down.weight.grad.t() if n == "down_t" else full[n].grad  # type: ignore[union-attr]
        _close(f"{case} d{n}", t.grad, shard_rows(want, p, rank))
    _check_params(params, before)
    assert counter.calls["ring"] == 3 * (p - 1) and set(counter.bytes) <= {"ring"}, dict(counter.calls)
    total_bytes = sum(t.numel() for t in full.values() if t is not None) * 8
    return {"sent": counter.total, "model": 3 * (p - 1) / p * total_bytes}


def _attention_traffic(p: int, rank: int) -> dict[str, float]:
    """Bytes per collective kind for one forward+backward (s=64, n_kv=N, causal, biases)."""
    torch.manual_seed(7)
    ctx = _ctx(64, p, rank, True)
    full = {n: torch.randn(N * D, H, dtype=torch.float64) for n in ("q", "k", "v", "o_t")}
    params = _params({n: shard_rows(t, p, rank) for n, t in full.items()})
    xl = torch.randn(B, ctx.layout.local_len(rank), H, dtype=torch.float64, requires_grad=True)
    with CommCounter() as counter:
        MODE.attention(xl, AttnWeights(**params), AttnSpec(H, N, N, D, True), ctx).sum().backward()
    return dict(counter.bytes)


def _world_checks(rank: int, p: int) -> dict[str, Any]:
    kvs = [kv for kv in (12, 4, 3, 2, 1) if MODE.attention_infeasible(AttnSpec(H, N, kv, D, True), p) is None]
    for i, (s, kv, causal) in enumerate((s, kv, c) for s in (37, 64) for kv in kvs for c in (True, False)):
        _attention_case(p, rank, s, kv, causal, bias=i % 2 == 0, rope=i % 3 != 1)
    traffic = [
        _mlp_case(p, rank, s, f, gated, bias=gated == (s == 37))
        for s in (37, 64)
        for f in (192, 190)
        for gated in (True, False)
    ]
    return {"mlp": traffic, "attn": _attention_traffic(p, rank), "kvs": kvs}


@pytest.mark.dist
@pytest.mark.parametrize("p", [2, 3, 4])
def test_metp_matches_reference(p: int) -> None:
    results = run_distributed(_world_checks, p, timeout=120)
    for i in range(len(results[0]["mlp"])):  # the weight ring: 3*(p-1)/p of all packed bytes per rank
        mean = sum(r["mlp"][i]["sent"] for r in results) / p
        model = results[0]["mlp"][i]["model"]
        assert abs(mean - model) <= 0.1 * model, (mean, model)
    assert any(kv < p for kv in results[0]["kvs"])  # the gathered k/v path ran


def test_metp_single_process() -> None:
    """p == 1 needs no collective and computes the same math; float32 stays float32."""
    _attention_case(1, 0, 37, 4, True, bias=True, rope=True)
    _mlp_case(1, 0, 37, 190, True, bias=True)
    ctx = SeqContext(SeqLayout(16, 1), None)
    w = {n: torch.randn(r, H, requires_grad=True) for n, r in (("q", N * D), ("k", N * D), ("v", N * D))}
    y = MODE.attention(
        torch.randn(1, 16, H), AttnWeights(**w, o_t=torch.randn(N * D, H)), AttnSpec(H, N, N, D, False), ctx
    )
    assert y.dtype == torch.float32


def test_metp_infeasible_heads() -> None:
    spec = AttnSpec(H, N, 4, D, True)
    assert MODE.attention_infeasible(spec, 3) is not None
    assert MODE.attention_infeasible(AttnSpec(H, 10, 10, D, True), 4) is not None
    assert MODE.attention_infeasible(spec, 2) is None
