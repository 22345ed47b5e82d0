"""What keeps training exact, on one process: optimizer refusal, clip interception, replica schedule, rank streams,
rotary and window refusals.

The distributed behaviour (the global norm over shards, replicas compared across ranks, refusals on every rank)
is proven against plain Lightning in ``tests/exact``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_paradyse.runtime import parallel
from lightning_paradyse.runtime.exactness import (
    ClipInterception,
    attention_window,
    check_optimizers,
    check_rotary,
    check_window,
    replica_check_due,
)
from tests.exact.cases import Lamb


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    return params


def test_elementwise_optimizers_pass_and_whole_tensor_ones_are_refused_by_name() -> None:
    params = _params()
    check_optimizers([torch.optim.AdamW(params), torch.optim.SGD(params, lr=0.1), torch.optim.RMSprop(params)])
    for optimizer, name in ((torch.optim.Adafactor(params), "Adafactor"), (Lamb(params), "Lamb")):
        with pytest.raises(ValueError, match=f"cannot train with {name}: .*whole"):
            check_optimizers([optimizer])

    class Lion(torch.optim.SGD):  # an update of its own: unknown until allowed by name
        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad.sign(), alpha=-group["lr"])

    with pytest.raises(ValueError, match=r"elementwise_optimizers=\['Lion'\]"):
        check_optimizers([Lion(params, lr=0.1)])
    check_optimizers([Lion(params, lr=0.1)], allowed=["Lion"])


def test_a_subclass_that_changes_only_the_defaults_is_its_base() -> None:
    """A recipe's ``class MyAdamW(AdamW)`` with other defaults updates as AdamW does: accepted (it was refused as an
    unknown optimizer until 2026-12-02, probe 19); one that overrides any method is unknown."""
    params = _params()

    class RecipeAdamW(torch.optim.AdamW):
        def __init__(self, params: Any, lr: float = 3e-4) -> None:
            super().__init__(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)

    class Deeper(RecipeAdamW):
        pass

    class Fresh(torch.optim.Adamax):  # torch wraps the step it finds in the first instance's class for its profiler
        pass

    assert "step" not in vars(Fresh)
    check_optimizers([RecipeAdamW(params), Deeper(params), Fresh(params)])

    class Grouped(torch.optim.AdamW):
        def _init_group(self, *args: Any, **kwargs: Any) -> Any:
            return super()._init_group(*args, **kwargs)

    with pytest.raises(ValueError, match="does not know whether the optimizer Grouped"):
        check_optimizers([Grouped(params)])


def test_clip_interception_is_torchs_own_without_shards_and_restores_it() -> None:
    original = torch.nn.utils.clip_grad_norm_
    params, reference = _params(), _params()
    original_total = torch.nn.utils.get_total_norm
    intercept = ClipInterception(lambda: set(), lambda: None, lambda: set())
    intercept.start()
    try:
        assert torch.nn.utils.clip_grad_norm_ is not original
        assert torch.nn.utils.get_total_norm is not original_total
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    finally:
        intercept.stop()
    assert torch.nn.utils.clip_grad_norm_ is original and torch.nn.utils.clip_grad.clip_grad_norm_ is original
    assert torch.nn.utils.get_total_norm is original_total
    assert torch.equal(total, original_total([p.grad for p in reference]))
    expected = original(reference, 0.5)
    assert torch.equal(norm, expected) and all(torch.equal(a.grad, b.grad) for a, b in zip(params, reference))


def test_whole_model_clip_on_one_process_equals_torchs() -> None:
    params, reference = _params(), _params()
    sharded = {id(params[0])}  # one "shard": on one process it is the whole tensor
    for norm_type in (2.0, 1.0, float("inf")):
        norm = parallel.clip_grad_norm(params, 0.5, sharded, None, norm_type)
        expected = torch.nn.utils.clip_grad_norm_(reference, 0.5, norm_type)
        torch.testing.assert_close(norm, expected)
        for a, b in zip(params, reference):
            torch.testing.assert_close(a.grad, b.grad)


def test_total_norm_of_sharded_grads_on_one_process_equals_torchs() -> None:
    params = _params()
    grads = [p.grad for p in params]
    intercept = ClipInterception(lambda: {id(params[0])}, lambda: None, lambda: {id(params[0].grad)})
    intercept.start()
    try:
        totals = [torch.nn.utils.get_total_norm(grads, norm_type) for norm_type in (2.0, 1.0, float("inf"))]
    finally:
        intercept.stop()
    for total, norm_type in zip(totals, (2.0, 1.0, float("inf"))):
        torch.testing.assert_close(total, torch.nn.utils.get_total_norm(grads, norm_type))


def test_replicas_are_checked_on_the_first_steps_then_every_n() -> None:
    assert [s for s in range(1, 200) if replica_check_due(s, 50)] == [1, 2, 3, 50, 100, 150]
    assert not any(replica_check_due(s, 0) for s in range(1, 10))


def test_call_dependent_rotary_and_sliding_windows_are_found_in_hugging_face_models() -> None:
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    small |= dict(num_key_value_heads=2)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    check_rotary(llama)
    assert attention_window(llama) is None
    dynamic = transformers.LlamaConfig(**small, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope_type='dynamic'.*fixed\s+frequencies"):
        check_rotary(transformers.LlamaForCausalLM(dynamic))
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**small, sliding_window=24))
    assert attention_window(mistral) == (24, "MistralConfig.sliding_window")
    check_window(24, attention_window(mistral))
    with pytest.raises(ValueError, match=r"length 25 is longer than .* span of 24 tokens.*max_seq_len=24"):
        check_window(25, attention_window(mistral))
    qwen_full = transformers.Qwen2Config(**small, sliding_window=16)  # use_sliding_window=False by default
    assert attention_window(transformers.Qwen2ForCausalLM(qwen_full)) is None
    qwen = transformers.Qwen2Config(**small, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert attention_window(transformers.Qwen2ForCausalLM(qwen))[0] == 16  # type: ignore[index]
    # once the rewrite found the windows (every mode applies them), only what the modes do not apply counts
    assert attention_window(mistral, windows_applied=True) is None
    rewritten = transformers.MistralForCausalLM(transformers.MistralConfig(**small, sliding_window=24))
    parallel.parallelize(rewritten, None)
    assert parallel.attention_windows(rewritten) == [24, 24]


def test_rotary_per_layer_type_and_chunked_attention_are_found() -> None:
    class Rotary(torch.nn.Module):
        def __init__(self, rope_type: Any) -> None:
            super().__init__()
            self.rope_type = rope_type

    check_rotary(torch.nn.Sequential(Rotary({"sliding_attention": "default", "full_attention": "linear"})))
    with pytest.raises(ValueError, match="dynamic"):
        check_rotary(torch.nn.Sequential(Rotary({"sliding_attention": "default", "full_attention": "dynamic"})))
    with pytest.raises(ValueError, match="longrope"):
        check_rotary(torch.nn.Sequential(Rotary("longrope")))

    class Model(torch.nn.Module):
        def __init__(self, **config: Any) -> None:
            super().__init__()
            self.config = SimpleNamespace(**config)

    chunked = Model(attention_chunk_size=64, layer_types=["chunked_attention", "full_attention"])
    assert attention_window(chunked) == (64, "SimpleNamespace.attention_chunk_size")
    assert attention_window(Model(attention_chunk_size=64, layer_types=["full_attention"])) is None
    assert attention_window(Model(sliding_window=32, attention_chunk_size=64)) == (32, "SimpleNamespace.sliding_window")
    chunk_and_window = Model(sliding_window=32, attention_chunk_size=64)
    assert attention_window(chunk_and_window, windows_applied=True) == (64, "SimpleNamespace.attention_chunk_size")
