"""Graph rewriting, pass by pass, on traced blocks of every accepted family (single process).

The tracer records a block's data flow; each role-finding pass is checked on the traced graph of the
package's Llama and GPT blocks, a Hugging Face ``LlamaDecoderLayer`` and a
``torch.nn.TransformerEncoderLayer``. Blocks that cannot be understood are rejected with the block's
name and the missing role, and a block the passes misunderstand is caught by verification instead of
running wrongly.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_paradyse.graph.dispatch import AttentionDispatch, ColumnDispatch, MlpDispatch, RowDispatch
from lightning_paradyse.graph.passes import RoleError, find_attention, find_mlp
from lightning_paradyse.graph.rewrite import EXAMPLE_LEN, example_inputs, rewrite_block
from lightning_paradyse.graph.trace import trace_block
from lightning_paradyse.models import build_model
from lightning_paradyse.runtime.parallel import check_modes_feasible, consolidated, find_blocks, parallelize
from tests.support.families import CausalAttention, EncoderLM, hf_llama

transformers = pytest.importorskip("transformers")


def _trace(block: nn.Module):  # type: ignore[no-untyped-def]
    args, kwargs = example_inputs(block, "block")
    return trace_block(block, args, kwargs)


def test_trace_records_dataflow_of_reference_block() -> None:
    trace = _trace(build_model("llama-tiny").layers[0])
    modules = [str(n.target) for n in trace.nodes("call_module")]
    assert modules == [
        "attn_norm",
        "attn.q",
        "attn.k",
        "attn.v",
        "attn.rotary",
        "attn.o",
        "mlp_norm",
        "mlp.gate",
        "mlp.up",
        "mlp.down",
    ]
    sdpa = [n for n in trace.nodes("call_function") if n.target is F.scaled_dot_product_attention]
    assert len(sdpa) == 1 and sdpa[0].meta["stack"] == ("", "attn")
    assert sdpa[0].meta["shape"] == (1, 12, EXAMPLE_LEN, 8)
    assert set(trace.inputs) == {"x", "positions"}


def test_attention_roles_of_each_family() -> None:
    llama = find_attention(_trace(build_model("llama-tiny").layers[0]))
    assert (llama.core, llama.q, llama.o, llama.n_heads, llama.n_kv_heads, llama.causal) == (
        "attn",
        "attn.q",
        "attn.o",
        12,
        2,
        True,
    )
    # the model's own code between projections and attention: here its rotary module, called with positions
    assert llama.program is not None and llama.program.modules == ("rotary",) and llama.token_dims == (0,)
    assert [s.target for s in llama.program.steps if s.kind == "module"] == ["rotary"]
    bert = find_attention(_trace(build_model("bert-tiny").layers[0]))
    assert bert.causal is False and bert.program is None  # a plain split into heads: nothing to replay
    hf = find_attention(_trace(hf_llama().model.layers[0]))
    assert (hf.core, hf.k, hf.n_kv_heads, hf.output_item, hf.output_len) == (
        "self_attn",
        "self_attn.k_proj",
        4,
        0,
        2,
    )
    assert hf.program is not None and hf.program.modules == () and not hf.program.mixes_heads
    assert [(r.name, r.item) for r in hf.positions] == [("position_embeddings", 0), ("position_embeddings", 1)]
    assert hf.token_dims == (1, 1)  # cos/sin are [b, t, d]
    tel = find_attention(_trace(EncoderLM(causal=False).encoder.layers[0]))
    assert (tel.kind, tel.core, tel.causal) == ("mha", "self_attn", None)


def test_mlp_roles_of_each_family() -> None:
    for block, expected in [
        (build_model("llama-tiny").layers[0], ("mlp", "mlp.up", "mlp.gate", "mlp.down")),
        (build_model("gpt-tiny").layers[0], ("mlp", "mlp.up", None, "mlp.down")),
        (hf_llama().model.layers[0], ("mlp", "mlp.up_proj", "mlp.gate_proj", "mlp.down_proj")),
        (EncoderLM(causal=True).encoder.layers[0], (None, "linear1", None, "linear2")),
    ]:
        trace = _trace(block)
        mlp = find_mlp(trace, find_attention(trace))
        assert (mlp.core, mlp.up, mlp.gate, mlp.down) == expected
        x = torch.linspace(-2.0, 2.0, 5)  # negative values too: a ReLU is not the identity on them
        assert not torch.equal(mlp.act(x), x)  # an activation, not the identity


def test_rewrite_installs_dispatch_modules_sharing_nothing_with_old_weights() -> None:
    block = hf_llama().model.layers[0]
    q_before = block.self_attn.q_proj.weight.detach().clone()
    ops = rewrite_block(block, "model.layers.0", 0, None)
    assert [type(op) for op in ops] == [AttentionDispatch, MlpDispatch]
    assert block.self_attn is ops[0] and block.mlp is ops[1]
    assert torch.equal(block.self_attn.q, q_before)  # group of one: the shard is the whole weight
    tel = EncoderLM(causal=True).encoder.layers[0]
    ops = rewrite_block(tel, "encoder.layers.0", 0, None)
    assert [type(op) for op in ops] == [AttentionDispatch, ColumnDispatch, RowDispatch]


def test_consolidated_state_loads_into_the_plain_model() -> None:
    for make in (lambda: build_model("gpt-tiny"), lambda: hf_llama(), lambda: EncoderLM(causal=True)):
        torch.manual_seed(0)
        plain = make()
        par = make()
        par.load_state_dict(plain.state_dict())
        parallelize(par, None)
        state = consolidated(par, None)
        assert set(state) == set(plain.state_dict())
        for name, value in plain.state_dict().items():
            assert torch.equal(state[name], value), name


def test_find_blocks_and_ambiguity() -> None:
    model = nn.Module()
    model.a = build_model("gpt-tiny").layers
    assert [n for n, _ in find_blocks(model, "a")] == ["a.0", "a.1"]
    model.b = build_model("gpt-tiny").layers
    with pytest.raises(ValueError, match="several lists of transformer blocks"):
        find_blocks(model)
    with pytest.raises(ValueError, match="blocks='nope'"):
        find_blocks(model, "nope")


class _QNormAttention(nn.Module):
    """Qwen3-style attention: a parameterised norm on q before the attention (the block's own code, replayed)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))
        self.q_norm = nn.LayerNorm(8)
        self.head_dim = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q(x).view(b, t, 4, 8)).transpose(1, 2)
        k, v = (m(x).view(b, t, 4, 8).transpose(1, 2) for m in (self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 32))


class _Block(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.attn = attn
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _InterleavedRope(nn.Module):
    """Attention rotated GPT-J style (pairs interleaved) from given cos/sin: not the rotate-half rule."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(32, 32, bias=False) for _ in range(4))
        self.head_dim = 8

    def forward(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, 4, 8).transpose(1, 2) for m in (self.q, self.k, self.v))

        def rot(y: torch.Tensor) -> torch.Tensor:
            pairs = torch.stack((-y[..., 1::2], y[..., ::2]), dim=-1).flatten(-2)
            return y * cos + pairs * sin

        out = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, 32))


class _RopeBlock(_Block):
    def forward(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), position_embeddings)
        return x + self.mlp(self.norm2(x))


class _TokenMixingAttention(_QNormAttention):
    """Queries mixed with the previous token's before the attention: no mode can run that on its part of the tokens."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, 4, 8).transpose(1, 2) for m in (self.q, self.k, self.v))
        q = q + q.roll(1, dims=2)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 32))


def test_unsupported_blocks_are_rejected_with_block_and_role() -> None:
    with pytest.raises(RoleError, match=r"block layers\.3 .*attn: the code between the projections .*mixes tokens"):
        rewrite_block(_Block(_TokenMixingAttention()), "layers.3", 3, None)
    plain_mlp = nn.Module()
    plain_mlp.layers = nn.ModuleList(
        [nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))]
    )
    with pytest.raises(ValueError, match="no list of transformer blocks"):
        parallelize(plain_mlp, None)


class _FixedLengthAttention(_QNormAttention):
    """Attention written for one sequence length: its own code fails on the rewrite's example inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (m(x).view(1, 5, 4, 8).transpose(1, 2) for m in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, 5, 32))


def test_an_error_of_the_blocks_own_code_is_a_named_rejection() -> None:
    with pytest.raises(RoleError, match=r"block layers\.1 \(_Block\): RuntimeError while tracing it .*blocks=") as info:
        rewrite_block(_Block(_FixedLengthAttention()), "layers.1", 1, None)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_peft_lora_on_the_projections_is_rewritten_and_what_the_modes_cannot_compute_is_refused() -> None:
    """LoRA as PEFT's docs show it (``get_peft_model`` of a Hugging Face model): each adapted projection keeps the
    base weight's shards and its adapter (``B`` sharded with the rows, ``A`` whole; transposed for ``o``), checked
    against the block in every mode by the rewrite's verification; peft's switch stays live; settings the modes do
    not compute are refused by name with the fix. Exactness of training: ``tests/exact`` cases ``lora-*``."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
    model = peft.get_peft_model(hf_llama(), config)
    ops = rewrite_block(model.base_model.model.model.layers[0], "layers.0", 0, None)
    attention = next(op for op in ops if isinstance(op, AttentionDispatch))
    assert set(attention.adapter_params) == {"q", "o_t"} and attention.spec.adapted
    assert attention.q_lora_b.shape == (attention.q.shape[0], 4)  # B [out, r]: the weight's rows
    assert attention.o_t_lora_a.shape == (attention.o_t.shape[0], 4)  # A_t [in, r]: the transposed weight's rows
    assert set(attention.replicated_sources.values()) >= {"self_attn.q_proj.lora_A.default.weight"}
    assert attention.sources["q"].name == "self_attn.q_proj.base_layer.weight"
    assert attention.infeasible("metp", 1) is not None and attention.infeasible("tp_sp", 1) is None
    with model.disable_adapter():  # peft finds the switch in the rewritten model
        assert attention.adapters() == {}
    assert set(attention.adapters()) == {"q", "o_t"}
    with pytest.raises(ValueError, match=r"merging a LoRA adapter .*merge_and_unload"):
        model.merge_adapter()
    whole = peft.get_peft_model(hf_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    parallelize(whole, None)
    check_modes_feasible(whole, 1, ["metp", "ring"])
    with pytest.raises(ValueError, match=r"modes=\['metp'\]\) can run layer 0's attention .*metp does not add LoRA"):
        check_modes_feasible(whole, 1, ["metp"])  # the planner's modes: the reason named before anything is measured
    for settings, named in (
        (dict(use_dora=True), "DoRA"),
        (dict(lora_dropout=0.1), r"lora_dropout > 0\): set LoraConfig\(lora_dropout=0.0\)"),
    ):
        refused = peft.get_peft_model(hf_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"], **settings))
        with pytest.raises(RoleError, match=rf"block layers\.0 .*self_attn\.q_proj is a LoRA layer with .*{named}"):
            rewrite_block(refused.base_model.model.model.layers[0], "layers.0", 0, None)


class _ScaledAttention(_QNormAttention):
    """Attention with its own softmax scale (as Granite's attention_multiplier)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, 4, 8).transpose(1, 2) for m in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.05)
        return self.o(out.transpose(1, 2).reshape(b, t, 32))


def test_an_attention_scale_is_carried_into_the_modes() -> None:
    ops = rewrite_block(_Block(_ScaledAttention()), "layers.0", 0, None)  # verified in float64 in every mode
    assert [op.spec.scale for op in ops if hasattr(op.spec, "scale")] == [0.05]


def test_the_blocks_own_code_before_the_attention_is_replayed() -> None:
    """A q norm (Qwen3) and an interleaved rotary (GPT-J): the block's own code runs in every mode (verified in
    float64 on a group of one); the norm's parameter stays replicated under its own name."""
    ops = rewrite_block(_Block(_QNormAttention()), "layers.0", 0, None)
    attn = ops[0]
    assert isinstance(attn, AttentionDispatch) and attn.roles.program is not None
    assert attn.roles.program.modules == ("q_norm",) and not attn.spec.mixes_heads
    assert "q_norm.weight" in dict(attn.named_parameters()) and "q_norm.weight" not in attn.sources
    rope = rewrite_block(_RopeBlock(_InterleavedRope()), "layers.0", 0, None)[0]
    assert isinstance(rope, AttentionDispatch) and [(r.index, r.item) for r in rope.roles.positions] == [(1, 0), (1, 1)]


class _AllHeadsNormAttention(_QNormAttention):
    """OLMo 2-style: one norm over every head's features of q, before the split into heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q_norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q(x)).view(b, t, 4, 8).transpose(1, 2)
        k, v = (m(x).view(b, t, 4, 8).transpose(1, 2) for m in (self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 32))


def test_code_mixing_heads_makes_the_head_splitting_modes_infeasible() -> None:
    attn = rewrite_block(_Block(_AllHeadsNormAttention()), "layers.0", 0, None)[0]
    assert attn.spec.mixes_heads
    assert all("mixes heads" in str(attn.infeasible(mode, 2)) for mode in ("tp_sp", "metp"))
    assert attn.infeasible("ulysses", 2) is None and attn.infeasible("ring", 2) is None


class _PostScaledAttention(_QNormAttention):
    """The attention output scaled before the output projection: the passes do not look there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, 4, 8).transpose(1, 2) for m in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2.0
        return self.o(out.transpose(1, 2).reshape(b, t, 32))


def test_misunderstood_block_is_caught_by_verification() -> None:
    with pytest.raises(RoleError, match="does not reproduce the original"):
        rewrite_block(_Block(_PostScaledAttention()), "layers.0", 0, None)


def test_sequential_mlp_is_understood() -> None:
    block = _Block(_QNormAttention())
    block.attn.q_norm = nn.Identity()  # now a plain attention
    ops = rewrite_block(block, "layers.0", 0, None)
    assert isinstance(ops[1], MlpDispatch) and ops[1].core_path == "mlp"
    assert operator.eq(ops[1].spec.ffn, 64)


class _DropoutTailAttention(CausalAttention):
    """An attention whose module ends with functional dropout called positionally (``F.dropout(x, p, training)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(super().forward(x), 0.5, self.training)


class _DropoutTailBlock(nn.Module):
    def __init__(self, hidden: int = 24) -> None:
        super().__init__()
        self.attn = _DropoutTailAttention(hidden, 4)
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.down(F.gelu(self.up(x)))


def test_functional_dropout_after_the_output_projection_follows_the_modules_mode() -> None:
    """A tail's functional dropout, its ``training`` given positionally, is trained as the module is: random in
    training mode, the identity in eval mode (never the mode the block happened to be traced in)."""
    block = _DropoutTailBlock()
    ops = rewrite_block(block, "block", 0, None)
    attn = next(op for op in ops if isinstance(op, AttentionDispatch))
    assert attn.roles.tail is not None and [s.kind for s in attn.roles.tail.steps] == ["dropout"]
    from lightning_paradyse.distributed.layout import SeqLayout
    from lightning_paradyse.modes.plan import OpPlan
    from lightning_paradyse.modes.specs import SeqContext

    for op in ops:
        op.configure(SeqContext(SeqLayout(6, 1), None), OpPlan("tp_sp"))
    x = torch.randn(1, 6, 24)
    block.eval()
    assert torch.equal(block(x), block(x))
    block.train()
    assert not torch.equal(block(x), block(x))


class _Experts(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, hidden, hidden) * 0.1)  # [experts, h, h]


class _NoFloat64Experts(nn.Module):
    """A mixture of experts whose kernel has no float64 (as grouped GEMMs): the block is traced in float32."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, 2, bias=False)
        self.experts = _Experts(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            raise RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double")
        gate = torch.softmax(self.gate(x), dim=-1)  # [b, t, 2]
        out = torch.einsum("bth,ehk->btek", x, self.experts.weight)  # [b, t, 2, h]
        return (out * gate[..., None]).sum(2)  # [b, t, h]


class _UpcastAttention(CausalAttention):
    """Attention whose code between the projections and the attention casts q and k to float32 on purpose."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (f(x).view(b, t, self.num_heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        q, k = q.to(torch.float32), k.to(torch.float32)
        y = F.scaled_dot_product_attention(q, k, v.to(q.dtype), is_causal=True)  # [b, n, t, d]
        return self.o(y.to(x.dtype).transpose(1, 2).reshape(b, t, h))  # type: ignore[no-any-return]


class _NoFloat64Block(nn.Module):
    def __init__(self, upcast: bool, hidden: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = (_UpcastAttention if upcast else CausalAttention)(hidden, heads)
        self.mlp = _NoFloat64Experts(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def test_a_block_without_float64_kernels_is_checked_in_float32_and_hidden_casts_are_refused() -> None:
    """Kernels without float64 (grouped-GEMM experts): the block is traced, probed and verified in float32 on the
    host. Its own casts to float32 would then be indistinguishable from the call's dtype (in bf16 training they would
    be replayed as bf16): refused by name instead of run wrongly."""
    torch.manual_seed(0)
    ops = rewrite_block(_NoFloat64Block(upcast=False), "layers.0", 0, None)
    assert any(isinstance(op, AttentionDispatch) for op in ops)
    with pytest.raises(RoleError, match=r"traced in torch.float32.*casts to torch.float32.*experts_implementation"):
        rewrite_block(_NoFloat64Block(upcast=True), "layers.0", 0, None)
