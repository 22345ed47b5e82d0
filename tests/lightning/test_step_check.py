"""The one-time step check's parts (its whole run on Hugging Face models and a mixture of experts, and its refusal of
a step that shifts its own targets, are cases of :mod:`tests.exact.cases`)."""

from __future__ import annotations

import warnings
from collections import deque

import pytest
import torch
import torch.nn as nn

from lightning_paradyse.lightning.step_check import (
    check_step_losses,
    kept_attributes,
    prefix_batch,
    step_check_tolerance,
    whole_plan,
)
from lightning_paradyse.modes.plan import parse_plan, uniform_plan


def test_the_whole_run_keeps_each_ops_mode_without_recomputation() -> None:
    """On a group of one every mode computes the plain op, so each op keeps the step's own mode (a mixture of experts
    run whole takes ulysses or ring, never tp_sp); recomputation is dropped (the check keeps no gradient)."""
    plan = parse_plan([{"attention": "tp_sp", "mlp": "ulysses", "recompute": True}, "ring"], 2)
    assert whole_plan(plan) == parse_plan([{"attention": "tp_sp", "mlp": "ulysses"}, "ring"], 2)
    assert whole_plan(uniform_plan("metp", 3)) == uniform_plan("metp", 3)


def test_the_probe_is_every_tensors_first_tokens() -> None:
    batch = {"input_ids": torch.arange(12).view(2, 6), "positions": torch.arange(6), "scale": torch.ones(3)}
    cut = prefix_batch(batch, 2, 6, 4)
    assert cut["input_ids"].tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]
    assert cut["positions"].tolist() == [0, 1, 2, 3]
    assert cut["scale"] is batch["scale"]  # not per token: untouched
    assert prefix_batch((batch["input_ids"],), 2, 6, 2)[0].shape == (2, 2)


def test_losses_that_differ_beyond_the_tolerance_name_the_fix() -> None:
    tol = step_check_tolerance(torch.float64, "64-true")
    check_step_losses(2.0, 2.0 * (1 + tol / 2), tol)
    named = r"computes something across the tokens.*loss_reduction='sum'.*check_step=False"
    with pytest.raises(ValueError, match=named):
        check_step_losses(2.0, 2.0 * (1 + 2 * tol), tol)
    assert step_check_tolerance(torch.float32, "bf16-mixed") > step_check_tolerance(torch.float32, "32-true")


def test_the_modules_own_attributes_are_put_back_after_the_check() -> None:
    """What a step commonly does to the module's own attributes leaves no trace of the check's extra calls: a list it
    appends its loss to (Lightning 2's way to an epoch's mean), nested containers, a counter, an accumulator changed
    in place; the containers stay the same objects (references held elsewhere see their content). An attribute the
    step sets once (a hook's handle) stays, and so do containers of other types (a Hugging Face output refuses
    ``update``) and inference tensors (what validation leaves under ``inference_mode``)."""

    class Frozen(dict):  # type: ignore[type-arg]
        def update(self, *args: object, **kwargs: object) -> None:
            raise TypeError("frozen")

    module = nn.Linear(2, 2)
    outs: list[torch.Tensor] = [torch.tensor(1.0)]
    kept = {"train": [1], "seen": {"a"}, "pair": ([2], 3), "last": deque([4], maxlen=2)}
    with torch.inference_mode():
        last_val = torch.tensor(7.0)
    module.outs, module.kept, module.n, module.total, module.handle = outs, kept, 5, torch.zeros(()), None
    module.frozen, module.last_val = Frozen(a=1), last_val
    restore = kept_attributes(module)
    module.outs.append(torch.tensor(2.0))
    module.kept["train"].append(2)
    module.kept["seen"].add("b")
    module.kept["pair"][0].append(9)
    module.kept["last"].append(5)
    module.kept["new"] = []
    module.n += 1
    module.total += 3.0
    module.handle = "registered"
    module.added = "x"
    dict.__setitem__(module.frozen, "b", 2)
    module.last_val = torch.tensor(8.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing it tries to put back fails
        restore()
    assert module.outs is outs and [float(t) for t in outs] == [1.0]
    assert module.kept is kept and kept == {"train": [1], "seen": {"a"}, "pair": ([2], 3), "last": deque([4])}
    assert module.n == 5 and float(module.total) == 0.0
    assert (module.handle, module.added, dict(module.frozen), float(module.last_val)) == (
        "registered",
        "x",
        {"a": 1, "b": 2},
        8.0,
    )
