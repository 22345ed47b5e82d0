#!/usr/bin/env bash
# Smoke run on torch 2.11, the oldest torch pyproject.toml allows (what GPU images ship): a fresh virtual
# environment in a temporary folder with torch 2.11.0 (the registry's default build, CUDA; it runs on CPU),
# Lightning 2.6.6 and the test tools, the project installed with --no-deps, then a subset of the suite:
# the collectives, devices and backends, the float64 exactness cases at p=2 (and two ranks sharing one device),
# MoE with the default grouped-GEMM experts, and the strategy's in-process tests and spawned fit.
# About 2-3 minutes (most of it the install); the tests alone stop after SMOKE_TIMEOUT seconds (default 900).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
PYTHON="${PYTHON:-python}"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/paradyse-torch211.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

"$PYTHON" -m venv "$tmp/venv"
py="$tmp/venv/bin/python"
"$py" -m pip install -q torch==2.11.0
"$py" -m pip install -q lightning==2.6.6 "torchmetrics>=1.4" "jsonargparse[signatures]>=4.30" "transformers>=4.56" \
    "pytest>=8" "pytest-timeout>=2.3"
"$py" -m pip install -q --no-deps -e .
"$py" -c "import torch, lightning; assert torch.__version__.startswith('2.11.'), torch.__version__; \
print('smoke: torch', torch.__version__, 'lightning', lightning.__version__)"

# -p no:cacheprovider: nothing written into the tree; PYTHONPATH unset: only the venv's packages
env -u PYTHONPATH timeout --kill-after=30 "${SMOKE_TIMEOUT:-900}" "$py" -m pytest -q -p no:cacheprovider --timeout=300 \
    tests/distributed/test_comm.py tests/distributed/test_devices.py \
    tests/exact/test_exact.py::test_two_processes_equal_plain_lightning \
    tests/exact/test_exact.py::test_ranks_sharing_one_device_equal_plain_lightning \
    tests/graph/test_families.py::test_mixture_of_experts_with_the_default_grouped_gemm_kernels_matches_single_process \
    tests/lightning/test_strategy.py -k "not three_processes"
