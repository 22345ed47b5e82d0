"""Spawn local gloo process groups with hard timeouts (used by ``cli.py check`` and the tests).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes (spawn), each with
one thread and a gloo process group over a file store, runs ``fn(rank, world_size, *args)`` in each
and returns the list of per-rank results. A failing assertion on any rank fails the call with that
rank's traceback; a rank that hangs (a mismatched collective) makes the call fail after ``timeout``
seconds instead of hanging the suite.

A job whose process group fails to form (gloo's ``connectFullMesh`` drops a connection now and then on a loaded
machine, before ``fn`` runs on any rank) is started again on a fresh store, up to :data:`INIT_TRIES` times in all;
a failure inside ``fn`` is never retried.

``fn`` must be a module-level function (it is pickled by reference). Each worker is a fresh interpreter
(``spawn``) unless :func:`use_forkserver` was called: then workers are forked from one server process that
imported the given modules once (the test suite does this: a job starts in ~0.2 s instead of 3-6 s of imports).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_START: dict[str, Any] = {"method": "spawn"}
"""How :func:`run_distributed` starts its workers (see :func:`use_forkserver`)."""

INIT_TRIES = 3
"""How many times :func:`run_distributed` starts a job whose process group failed to form."""

_OK, _FAILED, _INIT_FAILED = "ok", "failed", "init failed"
"""What a worker reports with its rank: its result, the traceback of ``fn``, or the traceback of the group's set-up."""


def use_forkserver(preload: Sequence[str]) -> None:
    """Start the workers of later :func:`run_distributed` calls from a fork server that imports ``preload`` once.

    Call it before the first call (the server starts then and keeps its modules); modules that raise
    ``ImportError`` are skipped (any other error stops the server). The server forks before any process group or
    thread exists, so each worker starts clean; each worker takes the caller's environment at the call.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    _START["method"] = "forkserver"


COPY_TRIES = 100
"""How many times :func:`environ_now` copies an environment that changes under it."""


def environ_now(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of this process's environment (or of ``environ``). A job started from a thread (side by side with
    others) copies it while another thread may set or delete a variable: the copy then raises (``RuntimeError``: the
    mapping changed size during iteration; ``KeyError``: a variable listed is gone), and is made again (up to
    :data:`COPY_TRIES` times: an error that comes back every time is raised)."""
    source = os.environ if environ is None else environ
    for _ in range(COPY_TRIES - 1):
        try:
            return dict(source)
        except (RuntimeError, KeyError):
            continue
    return dict(source)


def _worker(
    rank: int,
    world: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out: Any,
    environ: dict[str, str],
    backend: str = "gloo",
) -> None:
    os.environ.clear()  # the caller's environment now (a fork server's workers inherit the server's otherwise)
    os.environ.update(environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    stage = _INIT_FAILED
    try:
        if backend == "nccl":  # each rank on its own GPU, current before the first collective
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        stage = _FAILED
        result = fn(rank, world, *args)
        out.put((rank, _OK, result))
    except BaseException:  # report every failure, including assertion errors, to the parent
        out.put((rank, stage, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs: list[Any], out: Any, results: dict[int, Any], errors: list[str], timeout: float) -> bool:
    """Gather one report per rank; stop at the first failure, a dead child or the timeout.

    Returns whether every failure seen was a process group that did not form (the job may be started again). After
    the first failure it waits a moment for the other ranks' reports: the first one is often only the echo of
    another rank's crash ("connection closed by peer")."""
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        try:
            rank, status, value = out.get(timeout=0.5)
        except queue.Empty:
            dead = [r for r, proc in enumerate(procs) if proc.exitcode not in (None, 0) and r not in results]
            if dead:
                errors.append(f"rank(s) {dead} exited with code {[procs[r].exitcode for r in dead]} before reporting")
                return False
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(results))
                errors.append(
                    f"timed out after {timeout:.0f} s: ranks {missing} did not finish "
                    f"(a mismatched or hanging collective?)"
                )
                return False
            continue
        if status == _OK:
            results[rank] = value
            continue
        statuses = [status]
        errors.append(f"rank {rank} {status}:\n{value}")
        settle = time.monotonic() + 2.0  # the other ranks are probably blocked in a collective: do not wait long
        while time.monotonic() < settle and len(statuses) + len(results) < len(procs):
            try:
                rank, status, value = out.get(timeout=max(settle - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if status == _OK:
                results[rank] = value
            else:
                statuses.append(status)
                errors.append(f"rank {rank} {status}:\n{value}")
        return all(s == _INIT_FAILED for s in statuses)
    return False


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo; ``backend="nccl"``: rank ``r`` on GPU
    ``r``); return the per-rank results.

    A job whose process group did not form on every rank is stopped and started again (up to ``INIT_TRIES`` times),
    with the same ``args``: a rank of the stopped start may have run ``fn`` already, so what ``fn`` writes outside
    the job (a file of ``args``) must be named per start (e.g. by a name rank 0 broadcasts first)."""
    for attempt in range(1, INIT_TRIES + 1):
        results, errors, again = _run_once(fn, world_size, args, timeout, backend)
        if not errors:
            return [results[r] for r in range(world_size)]
        if not again or attempt == INIT_TRIES:
            break
        print(f"run_distributed: the process group did not form (try {attempt} of {INIT_TRIES}); starting again")
    tries = f" (the process group did not form in {INIT_TRIES} tries)" if again else ""
    raise AssertionError("\n".join(errors) + tries)


def _run_once(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float, backend: str
) -> tuple[dict[int, Any], list[str], bool]:
    """One start of the job on a fresh store: (results by rank, errors, whether only the set-up failed)."""
    ctx = mp.get_context(_START["method"])
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, init_file, fn, args, out, environ_now(), backend), daemon=True
            )
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        again = False
        try:
            again = _collect(procs, out, results, errors, timeout)
        finally:
            for proc in procs:
                proc.join(timeout=5 if not errors else 0.5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return results, errors, again
