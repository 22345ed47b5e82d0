"""The model's outputs as leaves of a gradient (what the step check differentiates the step's loss by; its refusal of
a loss scaled by its own detached value is the case ``self-normalised-loss`` of :mod:`tests.exact.cases`)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.nn as nn

from lightning_paradyse.runtime.output_leaves import OutputLeaves, collecting, leaf_gradients


class _Model(nn.Module):
    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.grad_inside = torch.is_grad_enabled()
        y = self.proj(x)
        return y if self.inner is None else self.inner(y)


def _hooked(model: nn.Module, leaves: OutputLeaves) -> None:
    model.register_forward_pre_hook(lambda mod, args: leaves.enter(), prepend=True)
    model.register_forward_hook(lambda mod, args, out: leaves.exit(out), always_call=True)


def test_the_outermost_call_runs_without_a_gradient_and_hands_back_a_copy_of_a_leaf() -> None:
    leaves = OutputLeaves()
    inner = _Model()
    outer = _Model(inner)
    _hooked(outer, leaves)
    _hooked(inner, leaves)
    x = torch.randn(2, 3, 4)  # [b, s, h]
    with torch.enable_grad():
        y = outer(x)
    assert not outer.grad_inside and not inner.grad_inside
    assert torch.is_grad_enabled()  # the process's mode back after the call
    assert len(leaves.leaves) == 1  # the outermost call's output only
    assert y.requires_grad and not y.is_leaf and y.grad_fn is not None  # a copy: the step may write into it
    y[:, 0] = 0.0  # in place, as a step may
    (grad,) = leaf_gradients((y * 3.0).sum(), leaves) or [None]
    assert grad is not None and torch.equal(grad[:, 1:], torch.full((2, 2, 4), 3.0))
    assert torch.equal(grad[:, 0], torch.zeros(2, 4))
    assert all(w.grad is None for w in outer.parameters())  # no backward through the model


def test_a_call_under_no_grad_is_left_alone_and_the_mode_comes_back() -> None:
    leaves = OutputLeaves()
    model = _Model()
    _hooked(model, leaves)
    with torch.enable_grad():
        with torch.no_grad():
            y = model(torch.randn(2, 3, 4))
        assert torch.is_grad_enabled()
    assert not y.requires_grad and leaves.leaves == []


def test_outputs_of_every_container_become_leaves_and_other_entries_stay() -> None:
    leaves = OutputLeaves()
    logits, ids, scalar = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.tensor(1.5)
    Out = namedtuple("Out", "logits ids loss")
    with torch.enable_grad():
        leaves.enter()
        got = leaves.exit(Out(logits, ids, scalar))
    assert isinstance(got, Out) and got.logits.requires_grad and got.ids is ids and got.loss is scalar
    hidden = (torch.randn(2, 3, 4), torch.randn(2, 3, 4))  # per layer
    mapping = OrderedDict(logits=logits, ids=ids, hidden_states=hidden)  # a ModelOutput is an OrderedDict: in place
    with torch.enable_grad():
        leaves.enter()
        same = leaves.exit(mapping)
    assert same is mapping and mapping["logits"].requires_grad and mapping["ids"] is ids
    assert isinstance(mapping["hidden_states"], tuple) and all(h.requires_grad for h in mapping["hidden_states"])
    assert len(leaves.leaves) == 4


def test_a_call_that_raised_puts_the_mode_back() -> None:
    leaves = OutputLeaves()

    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("inside")

    model = Failing()
    _hooked(model, leaves)
    with torch.enable_grad():
        with pytest.raises(RuntimeError, match="inside"):
            model(torch.randn(2, 3, 4))
        assert torch.is_grad_enabled()
    assert leaves.leaves == []


def test_leaf_gradients_are_none_without_a_loss_with_a_gradient() -> None:
    leaves = OutputLeaves()
    assert leaf_gradients(None, leaves) is None
    assert leaf_gradients(torch.tensor(1.0), leaves) is None  # no leaf
    with torch.enable_grad():
        leaves.enter()
        y = leaves.exit(torch.randn(2, 3, 4))
    assert leaf_gradients(y.sum().detach(), leaves) is None  # a loss without a gradient (computed inside the call)
    (unused,) = leaf_gradients(torch.ones((), requires_grad=True) * 2, leaves) or [0]
    assert unused is None


def test_collecting_sets_the_state_only_while_active() -> None:
    class State:
        leaves = None

    state, leaves = State(), OutputLeaves()
    with torch.no_grad(), collecting(state, leaves):
        assert state.leaves is leaves and torch.is_grad_enabled()
    assert state.leaves is None
    with torch.no_grad(), collecting(state, leaves, active=False):
        assert state.leaves is None and not torch.is_grad_enabled()
