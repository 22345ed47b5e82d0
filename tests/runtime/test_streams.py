"""The random streams of a training step (``runtime/streams.py``): the model's calls on the rank's own, the step's code
on the process's. Through Lightning on 2 ranks: ``tests/exact`` cases ``random-branch-in-step`` and ``dropout``."""

from __future__ import annotations

import torch

from lightning_paradyse.runtime.streams import CallStreams, rng_state, set_rng_state

CPU = torch.device("cpu")


def _step(rank: int, fail: bool = False) -> dict[str, torch.Tensor]:
    """A step as the strategy runs it: a draw of the step's own, two model calls (the second nesting a third), a draw
    after them."""
    torch.manual_seed(7)
    streams = CallStreams()
    out: dict[str, torch.Tensor] = {}
    with streams.step_of(7, rank, step=3, device=CPU):
        out["before"] = torch.rand(2)
        streams.enter()
        out["call 0"] = torch.rand(4)
        streams.exit()
        streams.enter()
        streams.enter()  # nested in the call: the same stream goes on
        out["call 1"] = torch.rand(4)
        streams.exit()
        streams.exit()
        out["after"] = torch.rand(2)
        if fail:
            streams.enter()  # a call that raises before its exit: put back at the step's end
            torch.rand(3)
    out["next"] = torch.rand(2)
    return out


def test_the_model_calls_draw_per_rank_and_the_step_as_one_process() -> None:
    ranks = [_step(0), _step(1)]
    for key in ("before", "after", "next"):  # the step's own draws: every rank alike, as without the strategy's calls
        assert torch.equal(ranks[0][key], ranks[1][key])
    for key in ("call 0", "call 1"):  # each call its own stream, per rank
        assert not torch.equal(ranks[0][key], ranks[1][key])
    assert not torch.equal(ranks[0]["call 0"], ranks[0]["call 1"])
    torch.manual_seed(7)
    plain = torch.rand(2), torch.rand(2), torch.rand(2)  # one process's draws without the model's calls
    assert torch.equal(ranks[0]["before"], plain[0]) and torch.equal(ranks[0]["after"], plain[1])
    assert torch.equal(_step(0)["call 1"], ranks[0]["call 1"])  # reproducible (a resumed step draws the same)


def test_a_call_that_never_returned_is_put_back_at_the_steps_end() -> None:
    assert torch.equal(_step(0, fail=True)["next"], _step(0)["next"])


def test_outside_a_step_the_calls_draw_from_the_process() -> None:
    streams = CallStreams()
    torch.manual_seed(3)
    streams.enter()
    drawn = torch.rand(3)
    streams.exit()
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(3))


def test_states_round_trip() -> None:
    state = rng_state(CPU)
    first = torch.rand(3)
    set_rng_state(state, CPU)
    assert torch.equal(torch.rand(3), first)
