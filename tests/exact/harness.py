"""The differential harness: one LightningModule trained under ``ParaDySeStrategy`` and in plain Lightning.

A *case* (:class:`Case`) names a module, its data and the Trainer settings a user would switch on. It is trained
twice, in float64 (``precision="64-true"``, rounding ~1e-15):

* under ``ParaDySeStrategy`` on ``p`` ranks, inside one spawned gloo job that runs many cases one after the
  other (each Trainer call makes and destroys its own process group, all on one port, where the strategy keeps one
  rendezvous store for the process; a case that raised on any rank sends the next case to a fresh port), beside
  the other jobs (:class:`~tests.support.dist.Together`);
* in one plain Lightning process (``devices=1``, no strategy), in the test's own process.

A case may instead be *launched* (:func:`run_launched`): ``Trainer(devices=p)`` in the test's own process, whose
strategy starts its workers itself with its default start method (``spawn``: the module is pickled into fresh
interpreters), as from a notebook or a script without ``torchrun``.

Each run records what a user sees and what a resumed run continues from: every step's global loss, every
validation and test loss, what reached the loggers (every ``log_metrics`` call, a logger recording them and
``log_every_n_steps=1``: the modules log their losses with ``self.log`` inside their steps, as users do; the
strategy's own ``plan*`` and ``groups/*`` entries left out), and the checkpoint written at the end
(``trainer.save_checkpoint``: the model's state dict, the optimizer state, the schedulers). A case that must be
refused records the error instead.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import io
import os
import shutil
import tempfile
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import Logger
from torch import Tensor
from typing_extensions import override

from lightning_paradyse import ParaDySeStrategy
from lightning_paradyse.distributed.rendezvous import close_stores
from lightning_paradyse.distributed.spawn import run_distributed
from lightning_paradyse.lightning import collection
from tests.support.dist import free_port
from tests.support.lightning import quiet_trainer, strategy_environment

TOL = 1e-9
"""Relative error allowed in float64 (rounding is ~1e-15; a real difference is far larger)."""


@dataclass(frozen=True)
class Case:
    """One user path: how to build the module and the data, and the Trainer and strategy settings."""

    module: Callable[[], pl.LightningModule]
    data: Callable[[], Any]
    """The training loader (or ``(train, val)`` loaders)."""
    trainer: dict[str, Any] = field(default_factory=dict)
    strategy: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None
    """For a case that must be refused: a fragment of the error message (the run must raise it on every rank)."""
    test: bool = False
    """Also run ``trainer.test`` on the validation loader after the fit."""
    predict: Callable[[], Any] | None = None
    """A loader ``trainer.predict`` runs after the fit (and the test); its predictions are compared (each a tensor)."""
    validate: bool = False
    """Run ``trainer.validate`` on the validation loader before the fit (the module is rewritten there, not by it)."""
    fit: bool = True
    """``False``: no fit, only ``trainer.predict`` of :attr:`predict` (a model the strategy refuses to train)."""
    compare: bool = True
    """Compare with plain Lightning (``False``: random ops such as dropout; the case must only train)."""
    plans: tuple[str, ...] | None = None
    """The plan of every training step under the strategy, in order (``str(plan)``); ``None``: not checked."""
    splits: tuple[tuple[int, ...], ...] | None = None
    """Force the split of the ranks into groups of each grouped step (in turn; units dealt round robin) instead of
    the solver's: exactness must hold whatever the solver picks. ``None``: the solver decides."""


@dataclass
class Result:
    losses: list[float] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    test_losses: list[float] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)
    """The plan of every training step (under the strategy)."""
    groups: list[int] = field(default_factory=list)
    """The number of groups of every training step (under the strategy; 0: one group of every rank)."""
    checkpoint: dict[str, Any] = field(default_factory=dict)
    logged: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    """What reached the loggers: ``(step, metrics)`` per ``log_metrics`` call (the strategy's own entries left out)."""
    error: str | None = None
    world_size: int = 0
    """Ranks that trained (under the strategy: the group's size)."""
    predictions: list[list[Any]] = field(default_factory=list)
    """What ``trainer.predict`` returned (:attr:`Case.predict`), each prediction as nested lists (portable)."""
    caller: dict[str, Any] = field(default_factory=dict)
    """What the process that called ``fit`` holds after it, where that process trained or launched the workers
    (:func:`run_plain`, :func:`run_launched`): its module's weights (``weights``, their dtypes included: a second fit
    continues from them) and its torch stream (``rng``: a second fit or a later draw continues from it)."""


OWN_METRICS = ("plan", "groups/")
"""Prefixes of what the strategy's callback logs itself (the plain run has no such entries)."""


class _Logged(Logger):
    """A logger that records every ``log_metrics`` call into ``result.logged`` (on every rank; rank 0's is read)."""

    def __init__(self, result: Result) -> None:
        super().__init__()
        self.result = result

    @property
    @override
    def name(self) -> str:
        return "recorded"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        return None

    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        kept = {k: float(v) for k, v in metrics.items() if not k.startswith(OWN_METRICS)}
        if kept:
            self.result.logged.append((-1 if step is None else int(step), kept))


class _Record(pl.Callback):
    def __init__(self, result: Result, path: str) -> None:
        self.result, self.path = result, path

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *a: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.result.losses.append(float(loss))
        record = getattr(trainer.strategy, "step_record", None)
        if record is not None:
            self.result.plans.append(str(record.plan))
            self.result.groups.append(int(record.metrics.get("groups/count", 0)))

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *a: Any, **k: Any) -> None:
        if not trainer.sanity_checking:
            self.result.val_losses.append(float(outputs))

    @override
    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *a: Any, **k: Any) -> None:
        self.result.test_losses.append(float(outputs))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)  # collective under the strategy (shards consolidated), rank 0 writes
        if trainer.global_rank == 0:  # for a launching process, which sees none of its workers' callbacks
            recorded = {
                "losses": self.result.losses,
                "val_losses": self.result.val_losses,
                "plans": self.result.plans,
                "world_size": trainer.world_size,
                "logged": self.result.logged,
            }
            torch.save(recorded, self.path + ".losses")


def _loaders(data: Any) -> tuple[Any, Any]:
    return data if isinstance(data, tuple) else (data, None)


def run(case: Case, devices: int, strategy: Any, caller: bool = False) -> Result:
    """Train ``case`` with ``strategy`` (``"auto"`` for plain Lightning); the result as rank 0 sees it (``caller``:
    and as the calling process holds it, :attr:`Result.caller`)."""
    result = Result()
    # the default dtype is left float32, as a user's script leaves it: precision="64-true" makes the run float64 (a
    # float64 default here hid a replay outside Lightning's precision context until 2026-11-30)
    torch.set_default_dtype(torch.float32)
    try:
        pl.seed_everything(0, verbose=False)
        module = case.module()
        train, val = _loaders(case.data())
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "last.ckpt")
            settings = dict(max_steps=4, precision="64-true", num_sanity_val_steps=0, log_every_n_steps=1)
            settings |= dict(logger=_Logged(result)) | case.trainer
            callbacks = [_Record(result, path), *settings.pop("callbacks", [])]  # the case's own after ours
            trainer = quiet_trainer(devices, strategy, callbacks, **settings)
            if case.validate and val is not None:
                trainer.validate(module, val, verbose=False)
            if case.fit:
                trainer.fit(module, train, val)
            if caller:
                state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
                result.caller = {"weights": state, "rng": torch.get_rng_state()}
            if case.test and val is not None:
                trainer.test(module, val, verbose=False)
            if case.predict is not None:
                predictions = trainer.predict(module, case.predict())
                result.predictions = [p.detach().cpu().tolist() for p in predictions or []]
            if trainer.global_rank == 0 and os.path.exists(path):
                result.checkpoint = torch.load(path, weights_only=False)
            if not result.losses and os.path.exists(path + ".losses"):  # the workers were launched from here
                recorded = torch.load(path + ".losses", weights_only=False)
                result.losses, result.val_losses = recorded["losses"], recorded["val_losses"]
                result.plans, result.world_size = recorded["plans"], recorded["world_size"]
                result.logged = recorded["logged"]
    except Exception as err:  # a refused case: every rank must raise, before any collective hangs
        result.error = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}"
    finally:
        torch.set_default_dtype(torch.float32)
    return result


def _worker(
    rank: int, world: int, make: Callable[[], dict[str, Case]], store_dir: str, cache_dir: str | None = None
) -> dict[str, Result]:
    if cache_dir is not None:  # the job's own measured machines (:func:`job_cache`)
        os.environ["PARADYSE_CACHE_DIR"] = cache_dir
    # the port rank 0 picks, shared through a file of this start's own: ``run_distributed`` starts a job again when
    # its process group did not form on every rank, and a rank of the stopped start may have written its port to a
    # file shared by both starts, where a rank of the next start could read that stale port while its rank 0 served a
    # fresh one: the likely cause of a first case timed out at the rendezvous ("1/2 clients joined"; once in CI,
    # 2026-12-01)
    start = [uuid.uuid4().hex if rank == 0 else ""]
    dist.broadcast_object_list(start, src=0)  # over the job's own group, which strategy_environment leaves next
    store = dist.FileStore(os.path.join(store_dir, start[0]), world)
    strategy_environment(rank, world)
    if rank == 0:
        store.set("port", str(free_port()))
    # every call of every case (fit, validate, test, predict) on one port: the strategy keeps one store there for
    # the process, each call under a prefix of its own (distributed/rendezvous.py). A port per call made a new store and
    # rendezvous per call: 135 s for the 2-process job in the suite before, 126 s after
    os.environ["MASTER_PORT"] = str(int(store.get("port")))
    out = {}
    for name, case in make().items():
        with dealt_splits(case.splits):
            result = run(case, world, ParaDySeStrategy(**({"timeout": 60.0} | case.strategy)))
        out[name] = _portable(result) if rank == 0 else Result(error=result.error, predictions=result.predictions)
        # what the case left alive (modules it imported, caches) frozen out of the next cases' collections, as the fork
        # server froze its imports (tests/support/frozen.py): each case's setup collection scans only what the case
        # makes (it scanned every earlier case's survivors: 0.24 s a case). Here, not at import: the tests' own process
        # imports this module and must keep the strategy's own freeze and thaw
        gc.collect()
        gc.freeze()
        # the strategy leaves a process that froze objects itself as it is (collection.freeze returns False): this one
        # now has, for good, and the strategy's check counted the frozen objects one by one at every fit's setup (40-60
        # ms a fit), so its answer is given here: the 2-process job 156 s before, 137 s after
        collection.freeze = _froze_already
        _meet_anew_after_an_error(store, name, rank, world, result.error is not None)
    return out


def _froze_already() -> bool:
    """:func:`lightning_paradyse.lightning.collection.freeze`'s answer in a process that froze objects itself."""
    return False


def _meet_anew_after_an_error(store: dist.Store, name: str, rank: int, world: int, failed: bool) -> None:
    """After a case that raised on any rank, every rank closes its rendezvous store and the next case meets on a
    fresh port: a rank that raised may have stopped short of a call the others made (a test, a predict), and the
    ranks would then pair calls that differ under the store's per-call count (``distributed/rendezvous.py``)."""
    store.set(f"{name}/failed/{rank}", "1" if failed else "0")
    if not any(store.get(f"{name}/failed/{r}") == b"1" for r in range(world)):
        return
    close_stores()
    if rank == 0:
        store.set(f"{name}/next-port", str(free_port()))
    os.environ["MASTER_PORT"] = store.get(f"{name}/next-port").decode()


@contextlib.contextmanager
def dealt_splits(splits: tuple[tuple[int, ...], ...] | None) -> Iterator[None]:
    """Within the block, grouped steps split the ranks as ``splits`` say, in turn, the units dealt round robin (every
    step dealt anew: no split kept for a batch seen before,
    :data:`~lightning_paradyse.groups.runner.DECISIONS_KEPT`)."""
    from lightning_paradyse.groups import runner, solver

    if splits is None:
        yield
        return
    calls = [0]

    def deal(lengths: Any, world: int, cost: Any, **kwargs: Any) -> solver.Assignment:
        sizes = splits[calls[0] % len(splits)]
        calls[0] += 1
        members: list[list[int]] = [[] for _ in sizes]
        for i in range(len(lengths)):
            members[i % len(sizes)].append(i)
        times = tuple(float(cost(tuple(lengths[i] for i in m), g) or 0.0) if m else 0.0 for m, g in zip(members, sizes))
        return solver.Assignment(sizes, tuple(tuple(m) for m in members), times)

    real, kept = solver.assign, runner.DECISIONS_KEPT
    solver.assign, runner.DECISIONS_KEPT = deal, 0  # type: ignore[assignment]
    try:
        yield
    finally:
        solver.assign, runner.DECISIONS_KEPT = real, kept


def _portable(result: Result) -> Result:
    """Tensors as bytes: the queue back to the parent would pass them as shared memory of a process that exits."""
    buffer = io.BytesIO()
    torch.save(result.checkpoint, buffer)
    result.checkpoint = {"bytes": buffer.getvalue()}
    return result


def _restored(result: Result) -> Result:
    if "bytes" in result.checkpoint:
        result.checkpoint = torch.load(io.BytesIO(result.checkpoint["bytes"]), weights_only=False)
    return result


def run_parallel(
    make: Callable[[], dict[str, Case]], world: int, timeout: float = 600.0, cache_dir: str | None = None
) -> dict[str, Result]:
    """Every case of ``make()`` (a module-level function, or a ``functools.partial`` of one: the spawned ranks call
    it) under the strategy on ``world`` ranks, in one spawned job; rank 0's results (every rank's error, if only some
    raised: a refusal must happen on every rank). ``cache_dir``: where the job keeps the machines ``plan="auto"``
    measures (default: the test session's)."""
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_distributed(_worker, world, make, tmp, cache_dir, timeout=timeout)
    results = {name: _restored(r) for name, r in per_rank[0].items()}
    for name in results:
        errors = [r[name].error for r in per_rank]
        if any(errors) and not all(errors):
            results[name].error = f"only ranks {[i for i, e in enumerate(errors) if e]} raised: {errors}"
        elif any(errors) and len({_last_line(e) for e in errors}) > 1:  # what each rank met, not rank 0's alone
            others = "".join(f"\nrank {i}: {_last_line(e)}" for i, e in enumerate(errors) if i)
            results[name].error = f"{errors[0]}\nthe other ranks raised otherwise:{others}"
        for i, other in enumerate(r[name].predictions for r in per_rank):  # every rank predicts every batch
            if differences(Result(predictions=other), Result(predictions=results[name].predictions)):
                results[name].error = f"rank {i}'s predictions differ from rank 0's"
    return results


def _last_line(error: str | None) -> str:
    """An error's last line (its type and message, after the traceback)."""
    lines = (error or "").strip().splitlines()
    return lines[-1] if lines else ""


def job_cache(root: str, name: str) -> str:
    """A folder of its own for a spawned job's measured machines (``run_parallel(cache_dir=...)``), ``root/name``,
    holding a copy of the test session's so far (read, not measured again). Jobs that run side by side (the 2-rank
    cases cut in two) would otherwise share one: a job that read another's measurement, written while it ran, could
    plan a case's second run (``plan="auto"`` measures on first use) unlike its first."""
    cache = os.path.join(root, name)
    os.makedirs(cache)
    for kept in glob.glob(os.path.join(os.environ.get("PARADYSE_CACHE_DIR", ""), "machine-*.json")):
        shutil.copy(kept, cache)
    return cache


def run_launched(case: Case, devices: int) -> Result:
    """The case under the strategy's own launcher, started from this process with its default start method (the
    module is pickled into ``devices`` fresh workers); rank 0's losses and checkpoint (not test losses)."""
    _clear_distributed_environment()
    try:
        return run(case, devices, ParaDySeStrategy(**({"timeout": 60.0} | case.strategy)), caller=True)
    finally:
        _clear_distributed_environment()  # the launcher exports its port here


def _clear_distributed_environment() -> None:
    for var in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        os.environ.pop(var, None)


def run_plain(case: Case) -> Result:
    """The case in one plain Lightning process (``devices=1``, no strategy)."""
    _clear_distributed_environment()
    return run(case, 1, "auto", caller=True)


def _float64(values: Any) -> Tensor:
    """Recorded numbers (losses, logged values, predictions as nested lists) as a float64 tensor. Not the default
    dtype: float32 in a test's process, where rounding both sides to float32 hid a difference below about 6e-8
    relative from the 1e-9 comparison (until 2026-12-01), and float64 for a moment where another thread fits under
    ``precision="64-true"``."""
    return torch.tensor(values, dtype=torch.float64)


def rel(a: Tensor, b: Tensor) -> float:
    """Relative error of ``a`` against ``b`` (exact zero when both are zero)."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()  # a GPU run's plain checkpoint holds CUDA tensors
    scale = float(b.norm())
    return float((a - b).norm()) / scale if scale > 0 else float((a - b).norm())


def differences(ours: Result, plain: Result, tol: float = TOL) -> list[str]:
    """Every way ``ours`` differs from ``plain`` by more than ``tol`` (relative), as readable lines."""
    bad: list[str] = []
    for what, a, b in (
        ("train losses", ours.losses, plain.losses),
        ("val losses", ours.val_losses, plain.val_losses),
        ("test losses", ours.test_losses, plain.test_losses),
    ):
        if len(a) != len(b):
            bad.append(f"{what}: {len(a)} against {len(b)}")
        elif a and rel(_float64(a), _float64(b)) > tol:
            bad.append(f"{what}: {a} against {b}")
    bad += _logged_differences(ours.logged, plain.logged, tol)
    if len(ours.predictions) != len(plain.predictions):
        bad.append(f"predictions: {len(ours.predictions)} batches against {len(plain.predictions)}")
    for i, (a, b) in enumerate(zip(ours.predictions, plain.predictions)):
        mine, one = _float64(a), _float64(b)
        if mine.shape != one.shape:
            bad.append(f"predictions of batch {i}: shape {tuple(mine.shape)} against {tuple(one.shape)}")
        elif rel(mine, one) > tol:
            bad.append(f"predictions of batch {i}: {rel(mine, one):.2e}")
    mine, ref = ours.checkpoint.get("state_dict", {}), plain.checkpoint.get("state_dict", {})
    if list(mine) != list(ref):
        missing, extra = sorted(set(ref) - set(mine)), sorted(set(mine) - set(ref))
        bad.append(f"state_dict keys differ (or their order): missing {missing}, extra {extra}")
    bad += [f"weight {k}: {rel(mine[k], v):.2e}" for k, v in ref.items() if k in mine and rel(mine[k], v) > tol]
    pairs = zip(ours.checkpoint.get("optimizer_states", []), plain.checkpoint.get("optimizer_states", []))
    for i, (o, r) in enumerate(pairs):
        bad += _optimizer_differences(i, o, r, tol)
    if ours.checkpoint.get("lr_schedulers") != plain.checkpoint.get("lr_schedulers"):
        bad.append("lr scheduler states differ")
    bad += _kept_tensor_differences(ours.checkpoint, plain.checkpoint, tol)
    if ours.caller and plain.caller:
        bad += _caller_differences(ours.caller, plain.caller, tol)
    return bad


def _caller_differences(ours: dict[str, Any], plain: dict[str, Any], tol: float) -> list[str]:
    """The calling process's module and stream after the fit (:attr:`Result.caller`): the same dtypes, weights
    within ``tol``, the same stream (the launcher hands back rank 0's weights and streams: until 2026-11-30 the module
    kept its float32 and the stream stayed where it was before the fit)."""
    mine, ref = ours["weights"], plain["weights"]
    if list(mine) != list(ref):
        return [f"the caller's module holds other weights: {sorted(set(mine) ^ set(ref))[:4]}"]
    bad = [f"the caller's {k}: {mine[k].dtype} against {v.dtype}" for k, v in ref.items() if mine[k].dtype != v.dtype]
    bad += [f"the caller's {k}: {rel(mine[k], v):.2e}" for k, v in ref.items() if rel(mine[k], v) > tol]
    if not torch.equal(ours["rng"], plain["rng"]):
        bad.append("the caller's torch stream after the fit differs from one process's")
    return bad


def _kept_tensor_differences(ours: dict[str, Any], plain: dict[str, Any], tol: float) -> list[str]:
    """The module's own dicts of tensors in the checkpoint (``on_save_checkpoint``: an average of the weights): the
    same keys in the same order, every tensor within ``tol``."""
    bad: list[str] = []
    for key, ref in plain.items():
        if key == "state_dict" or not isinstance(ref, dict) or not ref:
            continue
        if not all(isinstance(v, Tensor) for v in ref.values()):
            continue
        mine = ours.get(key, {})
        if list(mine) != list(ref):
            bad.append(f"checkpoint[{key!r}] keys differ (or their order): {list(mine)[:4]} against {list(ref)[:4]}")
        for k, v in ref.items():
            if k not in mine:
                continue
            if mine[k].shape != v.shape:
                bad.append(f"checkpoint[{key!r}][{k}]: shape {tuple(mine[k].shape)} against {tuple(v.shape)}")
            elif rel(mine[k], v) > tol:
                bad.append(f"checkpoint[{key!r}][{k}]: {rel(mine[k], v):.2e}")
    return bad


def _logged_differences(
    ours: list[tuple[int, dict[str, float]]], plain: list[tuple[int, dict[str, float]]], tol: float
) -> list[str]:
    """What reached the loggers: the same calls (steps and names, in order) and every value within ``tol``."""
    if [(step, sorted(m)) for step, m in ours] != [(step, sorted(m)) for step, m in plain]:
        return [f"logged metrics differ: {ours} against {plain}"]
    return [
        f"logged {name} at step {step}: {value} against {m_plain[name]}"
        for (step, m), (_, m_plain) in zip(ours, plain)
        for name, value in m.items()
        if rel(_float64(value), _float64(m_plain[name])) > tol
    ]


def _optimizer_differences(i: int, ours: dict[str, Any], plain: dict[str, Any], tol: float) -> list[str]:
    bad = []
    if [g["params"] for g in ours["param_groups"]] != [g["params"] for g in plain["param_groups"]]:
        bad.append(f"optimizer {i}: parameter groups differ")
    strip = [{k: v for k, v in g.items() if k != "params"} for g in plain["param_groups"]]
    if [{k: v for k, v in g.items() if k != "params"} for g in ours["param_groups"]] != strip:
        bad.append(f"optimizer {i}: group options differ")
    if sorted(ours["state"]) != sorted(plain["state"]):
        bad.append(f"optimizer {i}: state entries {sorted(ours['state'])} against {sorted(plain['state'])}")
        return bad
    for index, entry in plain["state"].items():
        for key, value in entry.items():
            mine = ours["state"][index].get(key)
            if isinstance(value, Tensor) and (mine is None or mine.shape != value.shape or rel(mine, value) > tol):
                why = "missing" if mine is None else "shape" if mine.shape != value.shape else f"{rel(mine, value):.2e}"
                bad.append(f"optimizer {i} state[{index}][{key}]: {why}")
    return bad
