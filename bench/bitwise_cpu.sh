#!/usr/bin/env bash
# bench/bitwise_cpu.sh: what --bitwise costs, against the same run without it, side by side: train_cnn at
# 2 ranks (Fashion-MNIST, global batch 64 in chunks of 16) and train_llama at 2 and 4 ranks (the
# 4-layer Llama of bench/llama_h256_l4.json on random tokens, global batch 16 of 128 tokens in chunks of 4),
# one thread per rank, the two modes alternating for ROUNDS rounds (default 5). Prints per case the
# median step time of each mode (the median over rounds of each run's median step), their ratio, rank 0's
# bytes received per step, its training peak and persistent model state, and the ratios of those. With
# RESULTS_DIR=DIR the logs stay there. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prologue.sh
rounds="${ROUNDS:-5}"
cnn=("$build_dir/apps/train_cnn" --limit-train 1920 --limit-test 64 --global-batch 64 --steps 20 --threads 1)
llama=("$build_dir/apps/train_llama" --config bench/llama_h256_l4.json --random-tokens --seq 128 --global-batch 16
  --steps 12 --threads 1)
cases=("cnn 2" "llama 2" "llama 4")
for round in $(seq 1 "$rounds"); do
  for case in "${cases[@]}"; do
    read -r program ranks <<<"$case"
    for mode in plain bitwise; do
      args=("${cnn[@]}")
      if [ "$program" = llama ]; then args=("${llama[@]}"); fi
      extra=()
      if [ "$mode" = bitwise ]; then extra=(--bitwise); fi
      if [ "$mode" = bitwise ] && [ "$program" = llama ]; then extra+=(--chunk 4); fi
      name="$program-np$ranks-$mode-$round"
      "${mpirun[@]}" -np "$ranks" "${args[@]}" "${extra[@]}" --metrics "$out/$name.jsonl" >"$out/$name.log" 2>&1 ||
        { cat "$out/$name.log"; exit 1; }
    done
  done
done
python3 - "$out" "$rounds" "${cases[@]}" <<'PY'
import json, statistics, sys
out, rounds, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def summary(name):
    """Rank 0's end-of-run record, its median step in ms (train_llama writes seconds)."""
    records = [json.loads(line) for line in open(f"{out}/{name}.jsonl")]
    end = next(r for r in records if r.get("rank") == 0 and "steps" in r and "step_bytes_received" in r)
    end.setdefault("median_step_ms", end.get("median_step_seconds", 0) * 1e3)
    return end
for case in cases:
    program, ranks = case.split()
    runs = {mode: [summary(f"{program}-np{ranks}-{mode}-{r}") for r in range(1, rounds + 1)]
            for mode in ("plain", "bitwise")}
    step = {mode: statistics.median(s["median_step_ms"] for s in runs[mode]) for mode in runs}
    last = {mode: runs[mode][-1] for mode in runs}
    def ratio(field):
        return last["bitwise"][field] / last["plain"][field]
    per_round = ", ".join("%.3f" % (b["median_step_ms"] / p["median_step_ms"])
                          for p, b in zip(runs["plain"], runs["bitwise"]))
    print(f"{program} np {ranks}: median step {step['plain']:.1f} ms without, {step['bitwise']:.1f} ms with --bitwise "
          f"({step['bitwise'] / step['plain']:.3f}x; per round: {per_round}); "
          f"bytes per step {last['plain']['step_bytes_received']} -> {last['bitwise']['step_bytes_received']} "
          f"({ratio('step_bytes_received'):.3f}x); training peak {last['plain']['train_peak_memory_bytes']} -> "
          f"{last['bitwise']['train_peak_memory_bytes']} B ({ratio('train_peak_memory_bytes'):.3f}x); persistent "
          f"{last['plain']['measured_persistent_bytes']} -> {last['bitwise']['measured_persistent_bytes']} B "
          f"({ratio('measured_persistent_bytes'):.3f}x)")
PY
