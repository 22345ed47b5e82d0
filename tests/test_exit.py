"""A finished spawn fit leaves no process group behind, so its workers exit cleanly.

``dist.destroy_process_group`` only unregisters a group; a gloo group that something still refers to lives on with
its worker threads until the interpreter finalizes, and a worker still holding the last collective's work then
aborts the process (``terminate called without an active exception``) after a finished fit. The strategy's teardown
drops every reference of its own first; ``benchmarks/exit_check.py`` checks in each worker that the group is gone
(exit status 2 if not, 1 for an abnormal exit).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.dist
@pytest.mark.parametrize("plan", ["metp"])  # the plan of the report (every plan keeps the group alike)
def test_spawn_fit_releases_process_group(plan: str) -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/exit_check.py", "--fits", "1", "--plan", plan, "--check-release"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
