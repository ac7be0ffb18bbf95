#!/usr/bin/env bash
# bench/what_if_1b.sh: what `--explain --world-size N` predicts for the 1b Llama preset on GPUs this
# machine does not have: bf16 gathers and compute with f32 reductions, one sequence of 2048 tokens a GPU,
# on 8 GPUs over an NVLink-class link and on 64 over an InfiniBand-class one (full sharding, and hybrid
# sharding in groups of 8). The dry step runs here, on one process; the device and the link are assumed:
# dense kernels at 600 TFLOP/s, memory at 2800 GB/s and 4 us a kernel call (an H100 SXM: 989 TFLOP/s
# dense bf16 and 3350 GB/s at peak, of which training's GEMMs and copies reach about 60% and 85%), NVLink
# 350 GB/s with 10 us a collective, InfiniBand (400 Gb/s a GPU) 40 GB/s with 30 us. Prints per case rank
# 0's predicted step, its exposed communication, what limits it and its training peak. With
# RESULTS_DIR=DIR the logs and metrics stay there. Not a test: about 6 minutes and 12 GB on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prologue.sh
device=(--peak-tflops 600 --memory-bandwidth 2800 --launch-overhead 4)
nvlink=(--link-bandwidth 350 --link-latency 10)
infiniband=(--link-bandwidth 40 --link-latency 30)
cases=("8 full nvlink" "64 full infiniband" "64 hybrid:8 infiniband")
for case in "${cases[@]}"; do
  read -r ranks sharding link <<<"$case"
  if [ "$link" = nvlink ]; then link_args=("${nvlink[@]}"); else link_args=("${infiniband[@]}"); fi
  name="np$ranks-${sharding/:/}-$link"
  "$build_dir/apps/train_llama" --config 1b --seq 2048 --global-batch "$ranks" --random-tokens --steps 1 \
    --mixed-precision bf16 --sharding "$sharding" --explain --world-size "$ranks" "${device[@]}" "${link_args[@]}" \
    --metrics "$out/$name.jsonl" >"$out/$name.log" 2>&1 || { cat "$out/$name.log"; exit 1; }
done
python3 - "$out" "${cases[@]}" <<'PY'
import json, sys
out, cases = sys.argv[1], sys.argv[2:]
print(f"{'GPUs':>4} {'sharding':<9} {'link':<10} {'step ms':>8} {'compute ms':>10} {'exposed':>8} {'limited by':<13} "
      f"{'peak GiB':>8} {'received GB':>11}")
for case in cases:
    ranks, sharding, link = case.split()
    record = next(json.loads(line) for line in open(f"{out}/np{ranks}-{sharding.replace(':', '')}-{link}.jsonl"))
    step = record["what_if"]["predicted_step"]
    total, exposed = step["step_seconds"], step["exposed_communication_seconds"]
    print(f"{ranks:>4} {sharding:<9} {link:<10} {1e3 * total:>8.1f} {1e3 * (total - exposed):>10.1f} "
          f"{100 * exposed / total:>7.1f}% {step['limited_by']:<13} "
          f"{record['what_if']['predicted_peak']['total'] / 2**30:>8.2f} "
          f"{record['what_if']['planned_step_bytes'] / 1e9:>11.2f}")
PY
