"""``configure_optimizers`` compared on the plain and the rewritten model (``lightning/optimizer_settings.py``).

The whole path on 2 ranks is ``tests/exact``: case ``groups-by-module-type`` (minGPT's ``isinstance(m, nn.Linear)``
rule, refused) and the cases that group by name or build from ``named_parameters()`` (``named-groups*``,
``named-optimizer``), which must pass the check and stay exact. Here, the comparison itself.
"""

from __future__ import annotations

import pytest
import torch

from lightning_paradyse.lightning.optimizer_settings import check_settings, settings_of


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
    with pytest.raises(ValueError, match="n: in optimizer 0 on one process, 1 here"):
        check_settings(two, {id(a): "w", id(b): "n"}, plain)


def test_the_names_of_a_named_optimizer_are_no_setting() -> None:
    w = _params(1)[0]
    plain = settings_of([torch.optim.AdamW([("model.q_proj.weight", w)], lr=1e-3)], {id(w): "model.q_proj.weight"})
    q = _params(1)[0]
    mine = torch.optim.AdamW([("model.self_attn.q", q)], lr=1e-3)  # a group's param_names differ; its settings not
    check_settings([mine], {id(q): "model.q_proj.weight"}, plain)
