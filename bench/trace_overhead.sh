#!/usr/bin/env bash
# bench/trace_overhead.sh: what tracing costs, and the overlap it shows. (1) apps/bench_trace: ns per
# trace site with recording off and per event with it on; (2) train_llama tiny at np 2 (the shortest
# step, so the worst case), RUNS pairs of runs, in alternating order, without --trace and with every
# step after the first traced (--trace-steps 2:STEPS): median step of each, the ratio per pair, and the
# events a step records (from rank 0's trace file) times the per-event costs of (1) as a share of the step;
# (3) the traced overlap % of train_llama and train_cnn at 2 and 4 ranks with --prefetch 0, 1, 2.
# With RESULTS_DIR=DIR the raw output stays there.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prologue.sh
runs="${RUNS:-5}" steps="${STEPS:-30}"
llama=("$build_dir/apps/train_llama" --config tiny --seq 48 --global-batch 12 --limit-documents 240 --threads 1)
cnn=("$build_dir/apps/train_cnn" --steps 6 --limit-train 768 --global-batch 64 --test-batch-size 1000 --threads 1)
median_ms() { grep "median step" | sed -E 's/.*median step ([0-9.]+) ms.*/\1/'; }
{
  "$build_dir/apps/bench_trace"
  off_run() { "${mpirun[@]}" -np 2 "${llama[@]}" --steps "$steps" 2>&1 | median_ms; }
  on_run() {
    "${mpirun[@]}" -np 2 "${llama[@]}" --steps "$steps" --trace "$out/llama-on" --trace-steps "2:$steps" 2>&1 |
      median_ms
  }
  # The order alternates: a run that always went second (caches, page cache, frequency) would be
  # charged to tracing.
  for run in $(seq "$runs"); do
    if [ $((run % 2)) -eq 1 ]; then
      off=$(off_run) on=$(on_run) order="off first"
    else
      on=$(on_run) off=$(off_run) order="on first"
    fi
    echo "pair $run ($order): median step off $off ms, on $on ms, on/off $(python3 -c "print(f'{$on / $off:.3f}')")"
  done
} | tee "$out/overhead.txt"
python3 - "$out/overhead.txt" "$out/llama-on/trace-rank0.json" "$((steps - 1))" <<'PY' | tee -a "$out/overhead.txt"
import json, re, statistics, sys
text = open(sys.argv[1]).read()
off_ns = float(re.search(r"recording off: ([\d.]+) ns", text).group(1))
# The dearer of the two kinds of event, for every event: an upper bound.
on_ns = max(float(ns) for ns in re.findall(r"recording on: ([\d.]+) ns", text))
pairs = [tuple(map(float, p)) for p in re.findall(r"off ([\d.]+) ms, on ([\d.]+) ms", text)]
events = [e for e in json.load(open(sys.argv[2]))["traceEvents"] if e["ph"] != "M"]
per_step = len(events) / int(sys.argv[3])
step_ms = statistics.median(off for off, _ in pairs)
print(f"events recorded per step (rank 0): {per_step:.0f}; median step off {step_ms:.2f} ms, "
      f"on {statistics.median(on for _, on in pairs):.2f} ms, median on/off ratio {statistics.median(on / off for off, on in pairs):.3f}")
print(f"tracing off: {per_step:.0f} sites x {off_ns:.2f} ns = {per_step * off_ns / 1e3:.2f} us per step, "
      f"{100 * per_step * off_ns / (step_ms * 1e6):.4f}% of the step")
print(f"tracing on: {per_step:.0f} events x {on_ns:.1f} ns = {per_step * on_ns / 1e3:.1f} us per step, "
      f"{100 * per_step * on_ns / (step_ms * 1e6):.2f}% of the step")
PY
for ranks in 2 4; do
  for prefetch in 0 1 2; do
    "${mpirun[@]}" -np "$ranks" "${llama[@]}" --steps 5 --prefetch "$prefetch" --trace "$out/llama-np$ranks-p$prefetch" \
      --trace-steps 3:5 2>&1 | grep "traced step" | sed "s/^/np $ranks prefetch $prefetch: /"
    "${mpirun[@]}" -np "$ranks" "${cnn[@]}" --prefetch "$prefetch" --trace "$out/cnn-np$ranks-p$prefetch" \
      --trace-steps 3:5 2>&1 | grep "traced step" | sed "s/^/np $ranks prefetch $prefetch: /"
  done
done | tee "$out/overlap.txt"
