#!/usr/bin/env bash
# bench/step_time_cpu.sh: the step time --explain predicts before step 1 against the step the run
# measures, on this machine: train_cnn (Fashion-MNIST, its global batch of 64 over the ranks) and
# train_llama (bench/llama_h256_l4.json, 8 sequences of 128 tokens a rank) at 1 and 2
# ranks, one thread each, every sharding (full, grad_op, optimizer, none, hybrid:1) with prefetch 1 and
# 0, ROUNDS runs each (default 5). Each run traces three steps for its exposed communication. The
# device's rates are measured once at the start (--recalibrate, on a run of its own) and come from the
# cache after: never from the runs predicted. Prints per case the medians over the runs of the measured
# and predicted step, the error, and the exposed communication as a share of the step, measured (rank
# 0's traced steps) and predicted, with whether the step is within 20% and the share within 10 points.
# With MICRO_BATCHES=K every run takes its steps in K micro-batches (--micro-batches K, each reducing),
# with MICRO_BATCH_SYNC=last too. With RESULTS_DIR=DIR the logs and metrics stay
# there. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prologue.sh
rounds="${ROUNDS:-5}"
accumulation=()
if [ "${MICRO_BATCHES:-1}" -gt 1 ]; then
  accumulation=(--micro-batches "$MICRO_BATCHES")
  if [ -n "${MICRO_BATCH_SYNC:-}" ]; then accumulation+=(--micro-batch-sync "$MICRO_BATCH_SYNC"); fi
fi
export SHARDLAB_CACHE_DIR="$out/cache"
cnn=("$build_dir/apps/train_cnn" --limit-train 4000 --limit-test 64 --steps 30 --threads 1)
llama=("$build_dir/apps/train_llama" --config bench/llama_h256_l4.json --seq 128 --steps 20 --threads 1)
shardings=(full grad_op optimizer none hybrid:1)
# The rates, measured by runs of their own (one per world size: ranks sharing the host measure together).
for ranks in 1 2; do
  "${mpirun[@]}" -np "$ranks" -x SHARDLAB_CACHE_DIR "${cnn[@]}" --steps 1 --explain --recalibrate \
    >"$out/calibrate-np$ranks.log" 2>&1 || { cat "$out/calibrate-np$ranks.log"; exit 1; }
done
cases=()
for ranks in 1 2; do
  for program in cnn llama; do
    for sharding in "${shardings[@]}"; do
      for prefetch in 1 0; do cases+=("$program $ranks $sharding $prefetch"); done
    done
  done
done
for round in $(seq 1 "$rounds"); do
  for case in "${cases[@]}"; do
    read -r program ranks sharding prefetch <<<"$case"
    args=("${cnn[@]}")
    if [ "$program" = llama ]; then args=("${llama[@]}" --global-batch $((8 * ranks))); fi
    name="$program-np$ranks-${sharding/:/}-prefetch$prefetch-$round"
    "${mpirun[@]}" -np "$ranks" -x SHARDLAB_CACHE_DIR "${args[@]}" "${accumulation[@]}" --sharding "$sharding" \
      --prefetch "$prefetch" --explain --trace "$out/trace-$name" --trace-steps 12:14 --metrics "$out/$name.jsonl" >"$out/$name.log" 2>&1 ||
      { cat "$out/$name.log"; exit 1; }
    rm -rf "$out/trace-$name"
  done
done
python3 - "$out" "$rounds" "${cases[@]}" <<'PY'
import json, statistics, sys
out, rounds, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def figures(name):
    """Rank 0's measured median step, predicted step, and exposed shares (measured, predicted)."""
    records = [json.loads(line) for line in open(f"{out}/{name}.jsonl")]
    end = next(r for r in records if r.get("rank") == 0 and "predicted_step" in r)
    traced = [r for r in records if r.get("rank") == 0 and "traced_step" in r]
    predicted = end["predicted_step"]
    measured_share = statistics.median(r["exposed_communication_seconds"] / r["step_seconds"] for r in traced)
    return (end["median_step_seconds"], predicted["step_seconds"], measured_share,
            predicted["exposed_communication_seconds"] / predicted["step_seconds"])
print(f"{'case':<28} {'measured ms':>11} {'predicted ms':>12} {'error':>7} {'exposed: measured':>17} "
      f"{'predicted':>9} {'points':>6}  within")
inside = 0
for case in cases:
    program, ranks, sharding, prefetch = case.split()
    runs = [figures(f"{program}-np{ranks}-{sharding.replace(':', '')}-prefetch{prefetch}-{r}")
            for r in range(1, rounds + 1)]
    measured, predicted, share, predicted_share = (statistics.median(run[i] for run in runs) for i in range(4))
    error = (predicted - measured) / measured
    points = 100 * (predicted_share - share)
    ok = abs(error) <= 0.20 and abs(points) <= 10
    inside += ok
    print(f"{program} np{ranks} {sharding} prefetch {prefetch:<6} {1e3 * measured:>11.1f} {1e3 * predicted:>12.1f} "
          f"{100 * error:>+6.1f}% {100 * share:>16.1f}% {100 * predicted_share:>8.1f}% {points:>+6.1f}  "
          f"{'yes' if ok else 'no'}")
print(f"{inside} of {len(cases)} cases within 20% (step) and 10 points (exposed communication)")
PY
