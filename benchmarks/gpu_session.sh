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
check() {  # check CORES ARGS...: gpu_check.py on those cores until the deadline (killed 15 s after it)
  local left=$((deadline - SECONDS))
  ((left > 0)) || return 124
  timeout -k 15 "$left" taskset -c "$1" python3 benchmarks/gpu_check.py "${@:2}" --log-dir "$logs"
}
chain() {  # chain NAME CORES ARGS...: one check, its output and its exit status kept under the chain's name
  check "${@:2}" >>"$logs/chain-$1.txt" 2>&1
  echo "exit $? (${*:3})" >>"$logs/chain-$1.status"
}
# the CPU benchmarks first on its 8 cores (about 4 minutes), then two short GPU rows there (the profile's GPU timings
# then share the GPU with the other chains: the row checks that it runs, not its numbers)
pids=()
(chain cpu 8-15 --device cpu --only quick-p8-cpu,step-p8-cpu; chain cpu 8-15 --only main-job,profile) &
pids+=($!)
chain a 0-3 --only host-syncs,exact-p2,exact-p4,exact-shared &
pids+=($!)
chain b 4-7 --only bf16,families-p2,memory-tp_sp,memory-ulysses,memory-ring,memory-metp,moe-defaults,hf-yaml &
pids+=($!)
(while sleep 30; do tar czf "$out/logs.tgz" -C "$logs" . 2>/dev/null; done) &  # what is done comes back even if cut
packer=$!
wait "${pids[@]}"
kill "$packer" 2>/dev/null
tar czf "$out/logs.tgz" -C "$logs" .
cat "$out/device.txt"
for name in a b cpu; do
  echo "== chain $name: $(tr '\n' ';' <"$logs/chain-$name.status" 2>/dev/null)"
  grep -E '^\[gpu_check\] |^\| |^gpu_check on' "$logs/chain-$name.txt" | grep -v ' \.\.\.$'
  last=$(grep -E '^\[gpu_check\] .* \.\.\.$' "$logs/chain-$name.txt" | tail -1)
  [ -z "$last" ] || grep -qF "${last% ...}:" "$logs/chain-$name.txt" || echo "${last% ...}: cut by the deadline"
done
