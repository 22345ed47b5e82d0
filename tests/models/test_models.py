"""Single-process unit tests of the reference models in :mod:`lightning_paradyse.models`."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_paradyse.models import (
    CONFIGS,
    GPT,
    GPTBlock,
    GPTConfig,
    Llama,
    LlamaBlock,
    LlamaConfig,
    RMSNorm,
    RotaryEmbedding,
    build_model,
)

TINY = ["llama-tiny", "llama-tiny-mha", "gpt-tiny", "bert-tiny"]
CAUSAL_TINY = ["llama-tiny", "llama-tiny-mha", "gpt-tiny"]


def _model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Llama | GPT:
    torch.manual_seed(seed)
    return build_model(name).to(dtype)


def _tokens(b: int, s: int, vocab: int = 128, seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, s), generator=g)


@pytest.mark.parametrize("name", TINY)
def test_forward_shape(name: str) -> None:
    model = _model(name)
    idx = _tokens(2, 17)
    logits = model(idx)
    assert logits.shape == (2, 17, CONFIGS[name].vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", TINY)
def test_loss_decreases(name: str) -> None:
    model = _model(name)
    idx = _tokens(4, 32)
    targets = _tokens(4, 32, seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        logits = model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # [b, s, v] -> [b*s, v]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    final = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).item()  # [b, s, v] -> [b*s, v]
    assert final < losses[0], losses
    assert losses[-1] < losses[0], losses


def test_build_model_types_and_init() -> None:
    assert isinstance(build_model("llama-tiny"), Llama)
    assert isinstance(build_model(CONFIGS["bert-tiny"]), GPT)
    torch.manual_seed(3)
    a = build_model("gpt-tiny")
    torch.manual_seed(3)
    b = build_model("gpt-tiny")
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    for name, p in a.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(p.std().item() - 0.02) < 0.005, name


def test_build_model_unknown_name() -> None:
    with pytest.raises(ValueError, match="llama-tiny"):
        build_model("no-such-model")
    with pytest.raises(TypeError):
        build_model(42)  # type: ignore[arg-type]


def test_module_structure() -> None:
    llama = build_model("llama-tiny")
    assert isinstance(llama, Llama)
    block = llama.layers[0]
    assert isinstance(block, LlamaBlock)
    assert isinstance(block.attn_norm, RMSNorm) and isinstance(block.mlp_norm, RMSNorm)
    attn = block.attn
    assert (attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.causal) == (12, 2, 8, True)
    assert attn.q.out_features == 96 and attn.k.out_features == 16 and attn.v.out_features == 16
    assert attn.o.in_features == 96 and attn.q.bias is None
    assert isinstance(attn.rotary, RotaryEmbedding)
    mlp = block.mlp
    assert mlp.gated and mlp.act is F.silu and mlp.gate is not None and mlp.up.bias is None
    assert (mlp.hidden, mlp.ffn) == (96, 192)
    assert llama.lm_head.bias is None and llama.lm_head.out_features == 128

    bert = build_model("bert-tiny")
    assert isinstance(bert, GPT)
    gblock = bert.layers[0]
    assert isinstance(gblock, GPTBlock)
    assert isinstance(gblock.attn_norm, nn.LayerNorm)
    assert gblock.attn.rotary is None and gblock.attn.causal is False and gblock.attn.q.bias is not None
    assert gblock.mlp.gate is None and gblock.mlp.act is F.gelu and not gblock.mlp.gated
    assert bert.pos_emb.num_embeddings == 1024
    assert bert.lm_head.bias is None


@pytest.mark.parametrize("name", CAUSAL_TINY)
def test_causal_prefix_matches_full(name: str) -> None:
    model = _model(name, dtype=torch.float64)
    idx = _tokens(2, 24)
    full = model(idx)
    for b in (1, 7, 16):
        prefix = model(idx[:, :b], positions=torch.arange(0, b))
        torch.testing.assert_close(prefix, full[:, :b], rtol=0, atol=1e-10)


def test_bidirectional_prefix_differs() -> None:
    model = _model("bert-tiny", dtype=torch.float64)
    idx = _tokens(2, 24)
    full = model(idx)
    prefix = model(idx[:, :8])
    assert not torch.allclose(prefix, full[:, :8])


def test_rotary_subset_property() -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim=16, theta=10000.0)
    t = 40
    q = torch.randn(2, 6, t, 16)  # [b, nq, t, d]
    k = torch.randn(2, 3, t, 16)  # [b, nk, t, d]
    q_full, k_full = rope(q, k, torch.arange(t))
    assert q_full.shape == q.shape and k_full.shape == k.shape
    # contiguous chunk not starting at 0
    q_part, k_part = rope(q[:, :, 5:19], k[:, :, 5:19], torch.arange(5, 19))
    torch.testing.assert_close(q_part, q_full[:, :, 5:19], rtol=0, atol=0)
    torch.testing.assert_close(k_part, k_full[:, :, 5:19], rtol=0, atol=0)
    # arbitrary (non-contiguous, unordered) subset
    sel = torch.tensor([33, 2, 17, 39, 0])
    q_sel, k_sel = rope(q[:, :, sel], k[:, :, sel], sel)
    torch.testing.assert_close(q_sel, q_full[:, :, sel], rtol=0, atol=0)
    torch.testing.assert_close(k_sel, k_full[:, :, sel], rtol=0, atol=0)
    assert len(list(rope.buffers())) == 0 and len(list(rope.parameters())) == 0


def test_rotary_properties() -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim=8)
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64)  # [b, nq, t, d]
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64)  # [b, nk, t, d]
    # position 0 is the identity
    q0, k0 = rope(q, k, torch.tensor([0]))
    torch.testing.assert_close(q0, q)
    torch.testing.assert_close(k0, k)
    # norms are preserved and scores depend only on the relative offset
    scores = []
    for m, n in [(3, 1), (10, 8), (502, 500)]:
        qm, _ = rope(q, q, torch.tensor([m]))
        _, kn = rope(k, k, torch.tensor([n]))
        torch.testing.assert_close(qm.norm(), q.norm())
        scores.append((qm * kn).sum())
    torch.testing.assert_close(scores[0], scores[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(scores[0], scores[2], rtol=0, atol=1e-5)
    # output dtype follows the input dtype
    qh, kh = rope(q.to(torch.bfloat16), k.to(torch.bfloat16), torch.tensor([7]))
    assert qh.dtype == kh.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["gpt-tiny", "bert-tiny"])
def test_gpt_pos_emb_uses_given_positions(name: str) -> None:
    model = _model(name, dtype=torch.float64)
    assert isinstance(model, GPT)
    idx = _tokens(2, 24)
    seen: list[Tensor] = []
    handle = model.layers[0].register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    a, b = 5, 9
    chunk = model(idx[:, a:b], positions=torch.arange(a, b))
    handle.remove()
    expected = model.tok_emb(idx[:, a:b]) + model.pos_emb.weight[a:b]  # [b, t, h] + [t, h]
    torch.testing.assert_close(seen[0], expected, rtol=0, atol=0)
    assert not torch.allclose(chunk, model(idx[:, a:b]))


def test_llama_positions_matter() -> None:
    model = _model("llama-tiny", dtype=torch.float64)
    idx = _tokens(2, 8)
    # rotary is relative: a constant shift leaves the output unchanged, a gap in the positions does not
    torch.testing.assert_close(model(idx), model(idx, positions=torch.arange(100, 108)), rtol=0, atol=1e-9)
    gapped = torch.tensor([0, 1, 2, 3, 10, 11, 12, 13])
    assert not torch.allclose(model(idx), model(idx, positions=gapped))


def test_llama_single_token_ignores_position() -> None:
    # a lone token attends only to itself (softmax weight 1), and rotary has no absolute effect, so a Llama
    # called on single-token chunks at their true positions equals the same tokens at position 0.
    model = _model("llama-tiny", dtype=torch.float64)
    idx = _tokens(1, 6)
    positions = torch.arange(300, 306)
    outs = [model(idx[:, j : j + 1], positions=positions[j : j + 1]) for j in range(6)]  # 6 x [1, 1, v]
    stacked = model(idx.T, positions=torch.tensor([0]))  # [6, 1] -> [6, 1, v]
    torch.testing.assert_close(torch.cat(outs, dim=1)[0], stacked[:, 0], rtol=0, atol=1e-10)


def _expand_gqa_into_mha(gqa: Llama, mha: Llama) -> None:
    """Copy ``gqa`` weights into ``mha``, repeating each kv head for the query heads that share it."""
    cfg = gqa.config
    group = cfg.n_heads // cfg.n_kv_heads
    d = cfg.head_dim
    state = gqa.state_dict()
    for key, value in list(state.items()):
        if key.endswith(("attn.k.weight", "attn.v.weight")):
            w = value.view(cfg.n_kv_heads, d, cfg.hidden)  # [nk*d, h] -> [nk, d, h]
            w = w.repeat_interleave(group, dim=0)  # [nk, d, h] -> [nq, d, h]
            state[key] = w.reshape(cfg.n_heads * d, cfg.hidden)  # [nq, d, h] -> [nq*d, h]
    mha.load_state_dict(state)


def test_gqa_equals_repeated_mha() -> None:
    gqa = _model("llama-tiny", dtype=torch.float64)
    assert isinstance(gqa, Llama)
    mha_cfg = dataclasses.replace(gqa.config, n_kv_heads=gqa.config.n_heads)
    mha = Llama(mha_cfg).double()
    _expand_gqa_into_mha(gqa, mha)
    idx = _tokens(2, 20)
    positions = torch.arange(20)
    torch.testing.assert_close(gqa(idx, positions), mha(idx, positions), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", TINY)
def test_num_params_matches_model(name: str) -> None:
    model = build_model(name)
    assert CONFIGS[name].num_params() == sum(p.numel() for p in model.parameters())


def test_num_params_planning_configs() -> None:
    # llama-7b has ~6.74B parameters; 70b ~69B; analytic only, never allocated
    assert 6.7e9 < CONFIGS["llama-7b"].num_params() < 6.8e9
    assert 68e9 < CONFIGS["llama-70b"].num_params() < 70e9
    gpt = CONFIGS["gpt-175b"]
    # 175B excluding the (here 1M-row) learned position embedding
    assert 174e9 < gpt.num_params() - gpt.max_seq_len * gpt.hidden < 176e9


_LLAMA_OK: dict[str, Any] = dict(
    vocab_size=128, n_layers=2, hidden=96, n_heads=12, n_kv_heads=2, ffn=192, max_seq_len=64
)
_GPT_OK: dict[str, Any] = dict(vocab_size=128, n_layers=2, hidden=96, n_heads=12, ffn=384, max_seq_len=64)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"hidden": 100}, r"hidden.*n_heads.*hidden=100.*n_heads=12"),
        ({"n_kv_heads": 5}, r"n_heads.*n_kv_heads.*n_heads=12.*n_kv_heads=5"),
        ({"vocab_size": 0}, r"vocab_size=0"),
        ({"n_layers": -1}, r"n_layers=-1"),
        ({"ffn": 0}, r"ffn=0"),
        ({"max_seq_len": 0}, r"max_seq_len=0"),
        ({"n_kv_heads": 0}, r"n_kv_heads=0"),
        ({"norm_eps": 0.0}, r"norm_eps=0.0"),
        ({"hidden": 36, "n_heads": 12}, r"head_dim=3"),
    ],
)
def test_llama_config_validation(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{**_LLAMA_OK, **overrides})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"hidden": 100}, r"hidden.*n_heads.*hidden=100.*n_heads=12"),
        ({"n_heads": 0}, r"n_heads=0"),
        ({"max_seq_len": -4}, r"max_seq_len=-4"),
    ],
)
def test_gpt_config_validation(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**_GPT_OK, **overrides})


def test_config_properties_and_frozen() -> None:
    llama = LlamaConfig(**_LLAMA_OK)
    assert llama.head_dim == 8
    gpt = GPTConfig(**_GPT_OK)
    assert gpt.head_dim == 8 and gpt.n_kv_heads == 12 and gpt.causal
    with pytest.raises(dataclasses.FrozenInstanceError):
        llama.hidden = 4  # type: ignore[misc]


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny"])
def test_positions_out_of_range(name: str) -> None:
    cfg = dataclasses.replace(CONFIGS[name], max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(cfg)
    idx = _tokens(1, 4)
    model(idx, positions=torch.arange(12, 16))  # last valid position is fine
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(idx, positions=torch.arange(13, 17))
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(_tokens(1, 17))
    with pytest.raises(ValueError, match=">= 0"):
        model(idx, positions=torch.arange(-1, 3))
    with pytest.raises(ValueError, match="one entry per token"):
        model(idx, positions=torch.arange(3))


def test_rmsnorm_dtype_and_value() -> None:
    norm = RMSNorm(8, eps=1e-6)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    x32 = x.float()
    ref = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y, ref.to(torch.bfloat16))
