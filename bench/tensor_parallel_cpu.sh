#!/usr/bin/env bash
# bench/tensor_parallel_cpu.sh: 2-D parallelism side by side on 4 ranks of this machine's CPU: train_llama
# at (dp, tp) = (4, 1), (2, 2) and (1, 4) for a small Llama (hidden 64, 8 heads, 4 key/value heads) and
# a larger one (hidden 256, 4 layers, 8/4 heads), each 12 steps of 8 sequences of 128 bytes. Prints, per
# run, tokens/s (median step), the persistent model state and the peak memory per rank, and rank 0's
# bytes received per step on each dimension, measured (the plan's, which --explain checks, are equal).
# With RESULTS_DIR=DIR the logs and metrics stay there. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prologue.sh

printf '%-28s %-8s %10s %14s %14s %14s %14s\n' config "dp x tp" "tokens/s" "persistent B" "peak B" "dp B/step" \
  "tp B/step"
for config in bench/llama_h64_heads8_kv4.json bench/llama_h256_l4_kv4.json; do
  for tp in 1 2 4; do
    name="$(basename "$config" .json)-tp$tp"
    "${mpirun[@]}" -np 4 "$build_dir/apps/train_llama" --config "$config" --tp "$tp" --steps 12 --seq 128 \
      --global-batch 8 --limit-documents 400 --threads 1 --explain --metrics "$out/$name.jsonl" \
      >"$out/$name.log" 2>&1 || { cat "$out/$name.log"; exit 1; }
    python3 - "$out/$name.jsonl" "$(basename "$config" .json)" "$((4 / tp)) x $tp" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8")]
final = [r for r in records if "measured_persistent_bytes" in r and r.get("rank") == 0][-1]
print(f"{sys.argv[2]:<28} {sys.argv[3]:<8} {final['tokens_per_second']:10.0f} {final['persistent_bytes']:14d} "
      f"{final['peak_memory_bytes']:14d} {final['step_bytes_received']:14d} {final.get('tensor_parallel_step_bytes', 0):14d}")
PY
  done
done
