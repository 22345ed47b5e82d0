"""``.ci/run`` fails when any step of the README's test command fails (the install, lint, types or the suite).

Under ``set -e`` a failure inside an ``&&`` list does not stop a bash script: a lint error once skipped the whole
suite while the smoke run after it set the exit status to 0. The script runs here on stubs of ``pip``, ``ruff``,
``mypy``, ``python`` and the smoke script (nothing is installed or tested).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("pip", "ruff", "mypy", "python")


def run_ci(tmp_path: Path, failing: str | None) -> tuple[int, bool]:
    """``.ci/run`` in a copy of its folder with every tool a stub that succeeds, but ``failing``, which exits 3;
    returns the exit status and whether the smoke script ran."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    marker = tmp_path / "smoke-ran"
    smoke = tmp_path / ".ci" / "smoke_torch211.sh"
    smoke.write_text(f"#!/usr/bin/env bash\ntouch {marker}\n")
    smoke.chmod(0o755)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for tool in TOOLS:
        stub = stubs / tool
        stub.write_text(f"#!/usr/bin/env bash\nexit {3 if tool == failing else 0}\n")
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, timeout=60)
    return done.returncode, marker.exists()


def test_ci_passes_when_every_step_passes(tmp_path: Path) -> None:
    assert run_ci(tmp_path, None) == (0, True)


@pytest.mark.parametrize("failing", TOOLS)
def test_ci_fails_at_the_first_failing_step(tmp_path: Path, failing: str) -> None:
    status, smoke_ran = run_ci(tmp_path, failing)
    assert status == 3, f"{failing} failed but .ci/run exited {status}"
    assert not smoke_ran, f"{failing} failed but .ci/run went on to the smoke run"
