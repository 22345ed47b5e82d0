"""Commands run side by side as separate processes, each writing into a log file of its own."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

K = TypeVar("K")


def run_at_once(
    commands: Mapping[K, list[str]],
    folder: Path,
    cwd: Path,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> dict[K, tuple[int, str]]:
    """Start every command at once, wait for all of them (``timeout`` seconds each), and return each one's exit status
    and output, keyed like ``commands``. Output goes to ``folder/<key>.log``, a file rather than a pipe, so no process
    blocks waiting for a reader. A process still running after the wait (it timed out) is killed, not left behind."""
    procs = {}
    for key, cmd in commands.items():
        with (folder / f"{key}.log").open("w") as log:
            procs[key] = subprocess.Popen(
                cmd, cwd=cwd, env=None if env is None else dict(env), stdout=log, stderr=subprocess.STDOUT
            )
    try:
        for proc in procs.values():
            proc.wait(timeout=timeout)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return {key: (proc.returncode, (folder / f"{key}.log").read_text()) for key, proc in procs.items()}
