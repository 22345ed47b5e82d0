"""Bad input fails early with an error that names the problem, before any collective runs (no processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.graph.dispatch import AttentionDispatch, MlpDispatch
from lightning_paradyse.models import build_model
from lightning_paradyse.modes import MODES, get_mode
from lightning_paradyse.modes.plan import parse_plan, uniform_plan
from lightning_paradyse.modes.specs import AttnSpec, SeqContext
from lightning_paradyse.runtime.parallel import check_plan, configure, dispatchers, parallelize

HEAD_SHARDED = ("tp_sp", "ulysses", "metp")
COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_reduce",
    "broadcast",
    "reduce",
    "batch_isend_irecv",
    "isend",
    "irecv",
    "send",
    "recv",
)


@pytest.fixture
def collectives(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record (instead of running) every collective called through ``torch.distributed``."""
    calls: list[str] = []
    for name in COLLECTIVES:
        if hasattr(dist, name):

            def fake(*args: object, _name: str = name, **kwargs: object) -> None:
                calls.append(_name)
                raise RuntimeError(f"collective {_name} called")

            monkeypatch.setattr(dist, name, fake)
    return calls


class _FakeGroupContext(SeqContext):
    """A context that claims a group of ``world`` ranks without any process group."""

    @property
    def p(self) -> int:
        return self.layout.world

    @property
    def rank(self) -> int:
        return 0


# -- sequence shorter than the group ------------------------------------------------------------------


@pytest.mark.parametrize(("s", "p"), [(3, 4), (2, 8), (5, 6)])
def test_world_larger_than_sequence(s: int, p: int, collectives: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        SeqLayout.for_sequence(s, p, causal=True)
    assert f"{s} tokens" in str(err.value) and f"{p} ranks" in str(err.value)
    assert collectives == []


# -- head counts a mode cannot split ------------------------------------------------------------------


def _spec(n_heads: int, n_kv: int) -> AttnSpec:
    return AttnSpec(hidden=n_heads * 8, n_heads=n_heads, n_kv_heads=n_kv, head_dim=8, causal=True)


@pytest.mark.parametrize("mode", HEAD_SHARDED)
def test_heads_not_divisible_by_group(mode: str) -> None:
    reason = get_mode(mode).attention_infeasible(_spec(12, 12), 5)
    assert reason is not None
    assert mode in reason and "12" in reason and "5" in reason
    assert get_mode("ring").attention_infeasible(_spec(12, 12), 5) is None


@pytest.mark.parametrize("mode", HEAD_SHARDED)
def test_kv_heads_not_spreadable(mode: str) -> None:
    reason = get_mode(mode).attention_infeasible(_spec(12, 2), 3)
    assert reason is not None
    assert "2 key/value heads" in reason and "3" in reason
    assert get_mode("ring").attention_infeasible(_spec(12, 2), 3) is None


@pytest.mark.parametrize(("n", "n_kv", "p"), [(12, 12, 1), (12, 12, 4), (12, 2, 4), (12, 2, 2), (12, 1, 3), (12, 4, 2)])
def test_feasible_head_counts(n: int, n_kv: int, p: int) -> None:
    for name, mode in MODES.items():
        assert mode.attention_infeasible(_spec(n, n_kv), p) is None, name


def test_ring_rejects_heads_not_grouped() -> None:
    reason = get_mode("ring").attention_infeasible(_spec(12, 5), 2)
    assert reason is not None and "12" in reason and "5" in reason


def _parallel(name: str) -> nn.Module:
    model = build_model(name)
    assert parallelize(model, None) == ["layers.0", "layers.1"]
    return model


def test_every_mode_runs_every_mlp() -> None:
    model = _parallel("llama-tiny")
    mlps = [op for _, op in dispatchers(model) if isinstance(op, MlpDispatch)]
    assert len(mlps) == 2
    for p in (1, 2, 3, 5, 7):
        for name in MODES:
            assert all(op.infeasible(name, p) is None for op in mlps), (name, p)
    attn = [op for _, op in dispatchers(model) if isinstance(op, AttentionDispatch)]
    assert attn[0].infeasible("ulysses", 3) is not None and attn[0].infeasible("ring", 3) is None


# -- plans that do not fit the model or the group -----------------------------------------------------


@pytest.mark.parametrize("mode", HEAD_SHARDED)
def test_check_plan_names_layer_and_reason(mode: str, collectives: list[str]) -> None:
    model = _parallel("gpt-tiny")  # 12 heads
    with pytest.raises(ValueError) as err:
        check_plan(model, uniform_plan(mode, 2), p=5)
    message = str(err.value)
    assert "layer 0" in message and mode in message and "12" in message and "5" in message
    check_plan(model, uniform_plan("ring", 2), p=5)  # ring splits the sequence, not the heads
    check_plan(model, uniform_plan(mode, 2), p=4)
    # only the second layer is infeasible: the message names it
    mixed = parse_plan(["ring", {"attention": mode, "mlp": "ring"}], 2)
    with pytest.raises(ValueError, match="layer 1"):
        check_plan(model, mixed, p=5)
    # the MLP may use the mode even where its attention cannot
    check_plan(model, parse_plan([{"attention": "ring", "mlp": mode}] * 2, 2), p=5)
    assert collectives == []


def test_check_plan_gqa_kv_heads(collectives: list[str]) -> None:
    model = _parallel("llama-tiny")  # 12 heads, 2 kv heads
    with pytest.raises(ValueError) as err:
        check_plan(model, uniform_plan("ulysses", 2), p=3)
    assert "layer 0" in str(err.value) and "2 key/value heads" in str(err.value)
    check_plan(model, uniform_plan("ulysses", 2), p=4)
    check_plan(model, uniform_plan("ring", 2), p=3)
    assert collectives == []


def test_configure_fails_before_any_collective(collectives: list[str]) -> None:
    model = _parallel("llama-tiny")
    ctx = _FakeGroupContext(SeqLayout.for_sequence(24, 3, causal=True), None)
    assert ctx.p == 3
    with pytest.raises(ValueError, match="layer 0"):
        configure(model, ctx, uniform_plan("tp_sp", 2))
    assert all(op.op_plan is None for _, op in dispatchers(model))  # nothing half-configured
    assert collectives == []


def test_check_plan_wrong_length(collectives: list[str]) -> None:
    model = _parallel("gpt-tiny")
    with pytest.raises(ValueError) as err:
        check_plan(model, uniform_plan("ring", 3), p=2)
    assert "3 layers" in str(err.value) and "2 blocks" in str(err.value)
    with pytest.raises(ValueError) as err:
        parse_plan(["ring"] * 3, 2)
    assert "3 entries" in str(err.value) and "2 layers" in str(err.value)
    assert collectives == []


def test_unknown_mode_name() -> None:
    with pytest.raises(ValueError) as err:
        get_mode("ringg")
    assert "ringg" in str(err.value) and all(name in str(err.value) for name in MODES)
    with pytest.raises(ValueError, match="ringg"):
        parse_plan([{"attention": "ringg", "mlp": "ring"}], 1)


# -- blocks the rewrite cannot understand -------------------------------------------------------------


class _Attention(nn.Module):
    """Multi-head attention over 16 features; ``with_out=False`` returns it without an output projection."""

    def __init__(self, with_out: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.o = nn.Linear(16, 16) if with_out else None
        self.n_heads, self.head_dim = 2, 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, 2, 8).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 16)
        return y if self.o is None else self.o(y)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _MlpOnly(nn.Module):
    """A block without attention."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = _Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class _NoOutputBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = _Attention(with_out=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class _GoodBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(16), nn.LayerNorm(16)
        self.attn = _Attention(with_out=True)
        self.mlp = _Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _Stack(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


@pytest.mark.parametrize(
    ("bad", "role"),
    [(_MlpOnly, "attention"), (_NoOutputBlock, "output projection")],
)
def test_unreadable_block_names_block_and_missing_role(bad: type[nn.Module], role: str) -> None:
    model = _Stack(_GoodBlock(), bad())
    with pytest.raises(ValueError) as err:
        parallelize(model, None, blocks="layers")
    message = str(err.value)
    assert "layers.1" in message and bad.__name__ in message and role in message
    assert "layers.0" not in message


def test_readable_blocks_parallelize() -> None:
    model = _Stack(_GoodBlock(), _GoodBlock())
    assert parallelize(model, None, blocks="layers") == ["layers.0", "layers.1"]
    assert len(dispatchers(model)) == 4


def test_no_block_list_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="blocks"):
        parallelize(nn.Sequential(nn.Linear(4, 4)), None)
    with pytest.raises(ValueError, match="nope"):
        parallelize(build_model("gpt-tiny"), None, blocks="nope")


def test_model_needs_configure_and_matching_tokens() -> None:
    model = _parallel("gpt-tiny")
    tokens = torch.randint(0, 128, (1, 6))
    with pytest.raises(RuntimeError, match="configured"):
        model(tokens)
    configure(model, SeqContext(SeqLayout(6, 1), None), uniform_plan("ring", 2))
    assert model(tokens).shape == (1, 6, 128)
    with pytest.raises(ValueError, match=r"7 tokens|seq_len=7"):
        model(torch.randint(0, 128, (1, 7)))
