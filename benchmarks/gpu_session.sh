#!/usr/bin/env bash
# One lent GPU machine's whole check in one command (about 9 minutes): the rows of benchmarks/gpu_check.py in two
# chains sharing the GPU, each on 4 of the 16 cores, and the quick preset at 8 processes on the other 8 cores with
# the GPU hidden (then the main job and a profile there). Each row's line is printed as it ends, the tables last;
# every row's whole output is packed into $OUT/logs.tgz. Run from the repository root on the GPU machine, after
# the install line of the GPU notes (jsonargparse's wheels):
#   bash benchmarks/gpu_session.sh [seconds every chain ends within, default 540]
set -u
limit=${1:-540}
out=${OUT:-/tmp/gpu_session}
logs=$(mktemp -d)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/device.txt" 2>&1
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)" >>"$out/device.txt"
deadline=$((SECONDS + limit))  # every chain ends by then, whatever its rows
check() {  # check CORES ARGS...: gpu_check.py on those cores until the deadline
  local left=$((deadline - SECONDS))
  ((left > 0)) || return 124
  timeout "$left" taskset -c "$1" python3 benchmarks/gpu_check.py "${@:2}" --log-dir "$logs"
}
# the CPU benchmark first on its 8 cores (about 3 minutes), then two short GPU rows there
(check 8-15 --device cpu --only quick-p8-cpu; check 8-15 --only main-job,profile) \
  >"$logs/chain-cpu.txt" 2>&1 &
check 0-3 --only host-syncs,exact-p2,exact-p4,exact-shared >"$logs/chain-a.txt" 2>&1 &
check 4-7 --only bf16,families-p2,memory-tp_sp,memory-ulysses,memory-ring,memory-metp,moe-defaults,hf-yaml \
  >"$logs/chain-b.txt" 2>&1 &
wait
tar czf "$out/logs.tgz" -C "$logs" .
cat "$out/device.txt"
for chain in a b cpu; do
  echo "== chain $chain"
  grep -E '^\[gpu_check\] .*: (pass|FAIL)|^\| |^gpu_check on' "$logs/chain-$chain.txt"
done
