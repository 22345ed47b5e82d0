"""Steps on groups of different sizes (1, 2 and 4 at once) equal one process training every sequence.

Four gloo processes hold the 1/4 shards. Each step splits them into aligned groups (``4``, ``2+2``,
``2+1+1``, ``1+1+1+1``, and a split with an idle group), gives every group its own sequences packed
into one (document-aware attention, positions restarting per document) and its own plan (every mode,
mixed plans, recomputation), and combines the gradients with :mod:`lightning_paradyse.groups`. The
reference runs each sequence alone through the plain model; loss and every gradient must match within
the mode-test tolerances. A second step on the same model checks that gradients accumulate onto the
shards and that the shard parameters are untouched by a step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_paradyse.distributed import comm
from lightning_paradyse.distributed.comm import all_reduce_sum
from lightning_paradyse.distributed.layout import SeqLayout
from lightning_paradyse.groups import GroupSet, blocks, check_sizes, enter_group, exit_group
from lightning_paradyse.models import build_model
from lightning_paradyse.modes import MODES
from lightning_paradyse.modes.plan import LayerPlan, OpPlan, Plan, random_plan
from lightning_paradyse.modes.specs import SeqContext
from lightning_paradyse.runtime.parallel import (
    configure,
    consolidated,
    feasible_modes,
    is_causal,
    parallelize,
    reduce_replicated_grads,
)
from lightning_paradyse.tools.mode_check import grad_errors, tolerance_failures
from tests.runtime.test_packing import pack
from tests.support.dist import run_distributed

LENGTHS = [37, 9, 17, 23, 6, 13]

STEPS: list[tuple[tuple[int, ...], list[list[int]]]] = [
    ((4,), [[0, 1, 2, 3, 4, 5]]),  # one group of 4: everything packed
    ((2, 2), [[0, 4], [1, 2, 3, 5]]),
    ((2, 1, 1), [[0], [1, 2], [3, 4, 5]]),  # sizes 2 and 1 at once
    ((1, 1, 1, 1), [[0], [1, 4], [2, 5], [3]]),
    ((2, 1, 1), [[0, 2, 3], [1, 4, 5], []]),  # an idle group
]


def _plan_for(model: torch.nn.Module, g: int, pick: int) -> Plan:
    """A feasible plan on ``g`` ranks: uniform modes in turn, then mixed ones with recomputation."""
    feasible = feasible_modes(model, g, list(MODES))
    if pick < len(MODES):
        mode = list(MODES)[pick]
        return Plan(
            tuple(
                LayerPlan(OpPlan(mode if mode in a else a[0]), OpPlan(mode if mode in b else b[0], recompute=True))
                for a, b in feasible
            )
        )
    mixed = random_plan(len(feasible), list(MODES), seed=pick)
    return Plan(
        tuple(
            LayerPlan(
                layer.attention if layer.attention.mode in a else OpPlan(a[0], layer.attention.recompute),
                layer.mlp if layer.mlp.mode in b else OpPlan(b[0], layer.mlp.recompute),
            )
            for layer, (a, b) in zip(mixed.layers, feasible)
        )
    )


def _reference(plain: torch.nn.Module, docs: list[torch.Tensor], count: int) -> tuple[torch.Tensor, dict[str, Any]]:
    reference = copy.deepcopy(plain)
    loss = sum(F.cross_entropy(reference(d[None], torch.arange(len(d)))[0, :-1], d[1:], reduction="sum") for d in docs)
    assert isinstance(loss, torch.Tensor)
    (loss / count).backward()
    return (loss / count).detach(), {n: w.grad for n, w in reference.named_parameters() if w.grad is not None}


def _group_step(
    model: torch.nn.Module,
    groups: GroupSet,
    sizes: tuple[int, ...],
    members: list[list[int]],
    docs: list[torch.Tensor],
    count: int,
    pick: int,
    replicated: bool = True,
) -> torch.Tensor:
    """One step of this rank's group; returns this rank's share of the loss."""
    index, pg = groups.mine(sizes)
    g = sizes[index]
    rank = groups.rank - blocks(sizes)[index].start
    enter_group(model, groups.world, sizes)
    loss = torch.zeros(())
    mine = [docs[j] for j in members[index]]
    if mine:
        tokens, targets, positions, doc_ids = pack(mine)
        layout = SeqLayout.for_sequence(len(tokens), g, is_causal(model))
        configure(model, SeqContext(layout, pg, doc_ids), _plan_for(model, g, pick + index))
        logits = model(layout.shard(tokens[None], rank), layout.shard(positions, rank, dim=0))
        loss = F.cross_entropy(logits[0], layout.shard(targets, rank, dim=0), reduction="sum") / count
        loss.backward()
    exit_group(model, groups.world, sizes, replicated)
    return loss.detach()


def _worker(rank: int, world: int, name: str) -> list[tuple[str, Any]]:
    group = dist.group.WORLD
    groups = GroupSet(group)
    torch.manual_seed(7)
    plain = build_model(name)
    docs = [torch.randint(0, 128, (n,)) for n in LENGTHS]
    count = sum(len(d) - 1 for d in docs)
    ref_loss, ref_grads = _reference(plain, docs, count)
    template = copy.deepcopy(plain)
    parallelize(template, group)
    out: list[tuple[str, Any]] = []
    for pick, (sizes, members) in enumerate(STEPS):
        check_sizes(sizes, world)
        model = copy.deepcopy(template)
        before = {n: w.detach().clone() for n, w in model.named_parameters()}
        loss = all_reduce_sum(_group_step(model, groups, sizes, members, docs, count, pick), group)
        label = f"{name} groups={sizes} docs={members}"
        errors = grad_errors(consolidated(model, group, True), ref_grads)
        out.append((label, (float(abs(loss - ref_loss) / ref_loss), errors)))
        unchanged = all(torch.equal(before[n], w.detach()) for n, w in model.named_parameters())
        assert unchanged, f"{label}: a step changed a parameter"
        if pick == 2:  # two micro-batches on different splits accumulate; replicated gradients reduced once
            model = copy.deepcopy(template)
            args = (docs, count, pick)
            loss2 = _group_step(model, groups, sizes, members, *args, replicated=False)
            loss2 = loss2 + _group_step(model, groups, (1, 1, 1, 1), STEPS[3][1], *args, replicated=False)
            reduce_replicated_grads(model, group)
            loss2 = all_reduce_sum(loss2, group)
            doubled = {n: 2 * r for n, r in ref_grads.items()}
            errors = grad_errors(consolidated(model, group, True), doubled)
            out.append((f"{label} + accumulated", (float(abs(loss2 - 2 * ref_loss) / ref_loss), errors)))
    return out


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny"])
def test_mixed_group_sizes_match_single_process(name: str) -> None:
    results = run_distributed(_worker, 4, name, timeout=300)[0]
    assert len(results) == len(STEPS) + 1
    bad = tolerance_failures(results, torch.float32)
    assert not bad, "\n".join(bad)


def test_group_sizes_are_checked() -> None:
    check_sizes((4, 2, 1, 1), 8)
    assert [list(r) for r in blocks((4, 2, 1, 1))] == [[0, 1, 2, 3], [4, 5], [6], [7]]
    with pytest.raises(ValueError, match="powers of two"):
        check_sizes((3, 1), 4)
    with pytest.raises(ValueError, match="sum to 3"):
        check_sizes((2, 1), 4)
    with pytest.raises(ValueError, match="largest first"):
        check_sizes((1, 2, 1), 4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_numbers_riding_on_the_return_arrive_exactly_in_any_gradient_dtype(dtype: torch.dtype) -> None:
    from lightning_paradyse.groups.exchange import pack_float64, unpack_float64

    numbers = torch.tensor([1e-3 / 3, 2.7182818284590455, -7.5e200], dtype=torch.float64)  # no bf16 holds these
    packed = pack_float64(numbers, dtype)
    assert packed.dtype == dtype
    rows = torch.stack([packed, packed.flip(0).flip(0)])  # [2, k'], as the return delivers one row per rank
    assert torch.equal(unpack_float64(rows), numbers.expand(2, -1))


def _header(rank: int) -> list[int]:
    """A rank's own int64 header: NaN bit patterns in a float32 and a bf16 view included (they must arrive bit for
    bit whatever the weights' dtype)."""
    return [0x7FC07FC07FC07FC0 + rank, -1 - rank, -(2**62) + 12345 * rank]


def _gather_worker(rank: int, world: int, dtype: torch.dtype) -> list[str]:
    """Every split's shards cut out of the weights gathered with the agreement, against the all-to-all's."""
    from lightning_paradyse.groups.exchange import drop_group, gather_whole, whole_dtype
    from lightning_paradyse.runtime.parallel import dispatchers

    group = dist.group.WORLD
    torch.manual_seed(7)
    model = build_model("llama-tiny").to(dtype)
    parallelize(model, group)
    assert whole_dtype(model, group) == dtype
    splits = [s for s, _ in STEPS] + [(1, 1, 1, 1)] if world == 4 else [(2, 1), (1, 1, 1)]  # 3: uneven shards
    wrong = []
    for sizes, at_once in [(s, False) for s in splits] + [(s, True) for s in splits]:  # gloo's ring, one all-to-all
        comm.GATHER_AT_ONCE = at_once  # alike on every rank, as the strategy's setup agrees it
        enter_group(model, group, sizes)
        moved = {(name, key): w.clone() for name, op in dispatchers(model) for key, w in op.group_shards.items()}
        drop_group(model)
        every, whole = gather_whole(model, group, torch.tensor(_header(rank)))
        comm.GATHER_AT_ONCE = False
        if every.tolist() != [_header(r) for r in range(world)]:
            wrong.append(f"{sizes} (at once: {at_once}): headers {every.tolist()}")
        enter_group(model, group, sizes, whole)
        cut = {(name, key): w for name, op in dispatchers(model) for key, w in op.group_shards.items()}
        drop_group(model)
        if cut.keys() != moved.keys():
            wrong.append(f"{sizes} (at once: {at_once}): pieces {sorted(cut)} against {sorted(moved)}")
        wrong += [
            f"{sizes} (at once: {at_once}): {key}"
            for key in moved
            if key in cut
            and not (torch.equal(cut[key], moved[key]) and cut[key].requires_grad == moved[key].requires_grad)
        ]
    return wrong


@pytest.mark.parametrize(("world", "dtype"), [(4, torch.float32), (4, torch.bfloat16), (3, torch.float32)])
def test_the_weights_gathered_with_the_agreement_give_every_split_its_shards(world: int, dtype: torch.dtype) -> None:
    """After a data-parallel step the step's agreement gathers the whole weights (its sizes fixed by the layout);
    every split's ``1/g`` shards cut out of them equal, bit for bit, what the split's own all-to-all moves (3 ranks:
    shards of uneven rows)."""
    for wrong in run_distributed(_gather_worker, world, dtype, timeout=180):
        assert not wrong, wrong


def _return_worker(rank: int, world: int, dtype: torch.dtype) -> list[str]:
    """The gradients a data-parallel split returns, by the flat sum and by the general path, on the same inputs."""
    import lightning_paradyse.groups.exchange as exchange
    from lightning_paradyse.runtime.parallel import dispatchers

    group = dist.group.WORLD
    torch.manual_seed(7)
    model = build_model("llama-tiny").to(dtype)
    parallelize(model, group)
    sizes = (1,) * world
    gen = torch.Generator().manual_seed(rank)
    results = []
    summed = exchange._sum_whole
    calls = []
    exchange._sum_whole = lambda *args: calls.append(1) or summed(*args)  # type: ignore[assignment]
    for flat in (True, False):
        exchange._read_whole, real = (exchange._read_whole if flat else lambda routes: False), exchange._read_whole
        try:
            model.zero_grad(set_to_none=True)
            enter_group(model, group, sizes)
            for _, op in dispatchers(model):  # every rank's own gradients of the whole weights it read
                for w in op.group_shards.values():
                    w.grad = torch.randn(w.shape, generator=gen).to(dtype)
            gen = torch.Generator().manual_seed(rank)  # the same draws for the second path
            numbers = torch.tensor([rank + 0.25, -1.0 / 3.0], dtype=torch.float64)
            every = exit_group(model, group, sizes, replicated=False, extra=numbers)
            results.append(({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, every))
        finally:
            exchange._read_whole = real
    exchange._sum_whole = summed  # type: ignore[assignment]
    (flat_grads, flat_every), (general_grads, general_every) = results
    wrong = [] if calls == [1] else [f"the flat sum ran {len(calls)} times, not once"]
    wrong += [] if flat_grads.keys() == general_grads.keys() and flat_grads else ["gradient names"]
    wrong += [n for n in flat_grads if n in general_grads and not torch.equal(flat_grads[n], general_grads[n])]
    if flat_every is None or general_every is None or not torch.equal(flat_every, general_every):
        wrong.append("numbers")
    return wrong


@pytest.mark.parametrize(("world", "dtype"), [(2, torch.float32), (2, torch.bfloat16), (3, torch.float32)])
def test_a_data_parallel_return_sums_on_one_buffer_as_the_general_path_does(world: int, dtype: torch.dtype) -> None:
    """The flat sum of a data-parallel split's gradient return gives, bit for bit, the general path's gradients
    (every rank's part added in rank order, bf16 summed in float32) and the numbers riding on it (3 ranks: shards
    of uneven rows)."""
    for wrong in run_distributed(_return_worker, world, dtype, timeout=180):
        assert not wrong, wrong
