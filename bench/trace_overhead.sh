#!/usr/bin/env bash
# bench/trace_overhead.sh: train_llama tiny at np 2, median step without --trace and with every step
# after the first traced (--trace-steps 2:STEPS), RUNS runs each; then the traced overlap % of
# train_llama and train_cnn at 2 and 4 ranks with --prefetch 0, 1, 2. Raw output to $1 (a directory).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bench/trace_overhead.sh OUTPUT_DIR}"
mkdir -p "$out"
runs="${RUNS:-3}" steps="${STEPS:-30}"
mpirun=(mpirun --allow-run-as-root --oversubscribe)
llama=(build/apps/train_llama --config tiny --seq 48 --global-batch 12 --limit-documents 240 --threads 1)
cnn=(build/apps/train_cnn --steps 6 --limit-train 768 --global-batch 64 --test-batch-size 1000 --threads 1)
for run in $(seq "$runs"); do
  "${mpirun[@]}" -np 2 "${llama[@]}" --steps "$steps" 2>&1 | grep "median step" | sed "s/^/off run $run: /"
  "${mpirun[@]}" -np 2 "${llama[@]}" --steps "$steps" --trace "$out/llama-on" --trace-steps "2:$steps" 2>&1 |
    grep "median step" | sed "s/^/on  run $run: /"
done | tee "$out/overhead.txt"
for ranks in 2 4; do
  for prefetch in 0 1 2; do
    "${mpirun[@]}" -np "$ranks" "${llama[@]}" --steps 5 --prefetch "$prefetch" --trace "$out/llama-np$ranks-p$prefetch" \
      --trace-steps 3:5 2>&1 | grep "traced step" | sed "s/^/np $ranks prefetch $prefetch: /"
    "${mpirun[@]}" -np "$ranks" "${cnn[@]}" --prefetch "$prefetch" --trace "$out/cnn-np$ranks-p$prefetch" \
      --trace-steps 3:5 2>&1 | grep "traced step" | sed "s/^/np $ranks prefetch $prefetch: /"
  done
done | tee "$out/overlap.txt"
