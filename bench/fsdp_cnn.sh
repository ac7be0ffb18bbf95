#!/usr/bin/env bash
# bench/fsdp_cnn.sh: the FSDP benchmark, side by side in one run on this machine:
# train_cnn at 2 ranks with FULL_SHARD and NO_SHARD and in 1 process (Adam, global batch 64,
# 1 thread per rank, 100 steps), then the PyTorch DDP peer when Debian's python3-torch is there.
# Prints each run's median step time, persistent model state and training peak per rank, and
# the ratios FULL_SHARD / NO_SHARD. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${STEPS:-100}"
common=(--optimizer adam --global-batch 64 --threads 1 --epochs 1 --steps "$steps" --limit-train $((64 * steps)))
source bench/prologue.sh

run() {  # name, then the command
  local name="$1"
  shift
  "$@" "${common[@]}" --metrics "$out/$name.jsonl" >"$out/$name.log" 2>&1
  python3 - "$name" "$out/$name.jsonl" <<'PY'
import json, sys
name, path = sys.argv[1], sys.argv[2]
summary = [r for r in map(json.loads, open(path)) if r.get("rank") == 0 and "median_step_ms" in r][-1]
print(f"{name:>6}: median step {summary['median_step_ms']:.1f} ms, persistent {summary['measured_persistent_bytes']} B, "
      f"training peak above the data {summary['train_peak_memory_bytes'] - summary['data_bytes']} B, "
      f"collectives per step {summary['step_bytes_received']} B")
json.dump(summary, open(f"{path}.summary", "w"))
PY
}

mpirun_2=("${mpirun[@]}" -np 2 "$build_dir/apps/train_cnn")
run full "${mpirun_2[@]}" --sharding full
run none "${mpirun_2[@]}" --sharding none
run alone "$build_dir/apps/train_cnn"
python3 - "$out" <<'PY'
import json, sys
s = {n: json.load(open(f"{sys.argv[1]}/{n}.jsonl.summary")) for n in ("full", "none", "alone")}
print(f"FULL_SHARD / NO_SHARD at 2 ranks: step time {s['full']['median_step_ms'] / s['none']['median_step_ms']:.3f}, "
      f"persistent memory {s['full']['measured_persistent_bytes'] / s['none']['measured_persistent_bytes']:.3f}; "
      f"FULL_SHARD / 1 process step time {s['full']['median_step_ms'] / s['alone']['median_step_ms']:.3f}")
PY
if /usr/bin/python3 -c "import torch" 2>/dev/null; then
  /usr/bin/python3 bench/pytorch_ddp_cnn.py --steps "$steps"
fi
