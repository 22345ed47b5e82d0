"""``configure_optimizers`` compared on the plain and the rewritten model (``lightning/optimizer_settings.py``).

The whole path on 2 ranks is ``tests/exact``: case ``groups-by-module-type`` (minGPT's ``isinstance(m, nn.Linear)``
rule, refused) and the cases that group by name or build from ``named_parameters()`` (``named-groups*``,
``named-optimizer``), which must pass the check and stay exact. Here, the comparison itself.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_paradyse.lightning.optimizer_settings import check_settings, plain_settings, settings_of


def _params(n: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(2)) for _ in range(n)]


def _adamw(decay: list[torch.nn.Parameter], rest: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)


def test_the_same_settings_per_plain_parameter_pass() -> None:
    w, b = _params(2)
    plain = settings_of([_adamw([w], [b])], {id(w): "q_proj.weight", id(b): "q_proj.bias"})
    q0, q1, bias = _params(3)  # two shards of one weight, in another order and other groups' order
    groups = [{"params": [bias], "weight_decay": 0.0}, {"params": [q1, q0], "weight_decay": 0.1}]
    mine = torch.optim.AdamW(groups, lr=1e-3)
    check_settings([mine], {id(q0): "q_proj.weight", id(q1): "q_proj.weight", id(bias): "q_proj.bias"}, plain)


def test_a_shard_with_other_settings_is_refused_by_name() -> None:
    w, n = _params(2)
    plain = settings_of([_adamw([w], [n])], {id(w): "q_proj.weight", id(n): "norm.weight"})
    q0, q1, norm = _params(3)
    mine = _adamw([q0], [q1, norm])  # the rule missed one shard
    with pytest.raises(ValueError, match=r"1 parameter\(s\).*q_proj.weight: weight_decay=0.0 here, 0.1 on one process"):
        check_settings([mine], {id(q0): "q_proj.weight", id(q1): "q_proj.weight", id(norm): "norm.weight"}, plain)


def test_a_parameter_left_out_or_in_another_optimizer_is_refused() -> None:
    w, n = _params(2)
    plain = settings_of([_adamw([w], [n])], {id(w): "w", id(n): "n"})
    a, b = _params(2)
    with pytest.raises(ValueError, match="n: optimized on one process, in no optimizer here"):
        check_settings([_adamw([a], [])], {id(a): "w", id(b): "n"}, plain)
    two = [_adamw([a], []), _adamw([], [b])]
    with pytest.raises(ValueError, match=r"n: in optimizer\(s\) \[0\] on one process, \[1\] here"):
        check_settings(two, {id(a): "w", id(b): "n"}, plain)


def test_the_names_of_a_named_optimizer_are_no_setting() -> None:
    w = _params(1)[0]
    plain = settings_of([torch.optim.AdamW([("model.q_proj.weight", w)], lr=1e-3)], {id(w): "model.q_proj.weight"})
    q = _params(1)[0]
    mine = torch.optim.AdamW([("model.self_attn.q", q)], lr=1e-3)  # a group's param_names differ; its settings not
    check_settings([mine], {id(q): "model.q_proj.weight"}, plain)


def test_a_parameter_in_two_optimizers_and_implementation_flags_pass() -> None:
    w = _params(1)[0]
    one = [torch.optim.SGD([w], lr=0.1, foreach=False), torch.optim.SGD([w], lr=0.2)]
    plain = settings_of(one, {id(w): "w"})
    a, b = _params(2)  # two shards; fused picked by the device (the GPU here, the host before the rewrite)
    mine = [torch.optim.SGD([a, b], lr=0.1, foreach=True), torch.optim.SGD([a, b], lr=0.2)]
    check_settings(mine, {id(a): "w", id(b): "w"}, plain)


class _TensorLr(pl.LightningModule):
    """A tensor learning rate kept on the module, which a scheduler's constructor fills in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.lr = torch.tensor(1e-3)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return [optimizer], [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1)]


def test_the_extra_call_leaves_the_module_as_it_was() -> None:
    module = _TensorLr()
    module.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    plain = plain_settings(module, torch.device("cpu"))
    assert module.lr == torch.tensor(1e-3)  # the scheduler filled it with 1e-4 in the extra call: put back
    assert {name for name in plain} == {"layer.weight", "layer.bias"}
