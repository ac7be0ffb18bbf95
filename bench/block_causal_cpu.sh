#!/usr/bin/env bash
# bench/block_causal_cpu.sh: what --block-causal costs or saves against --pack alone, and whether --explain
# predicts it: train_llama with bench/llama_h256_l4.json's model (its positions raised to 2048) on 3000 of
# Debian's fortunes packed into sequences of SEQ (default 1024) byte tokens, global batch 4, 1 process, 2
# threads, STEPS steps (default 8), ROUNDS rounds (default 3) with the two runs in alternating order. Each
# run prints its median step, the step --explain predicted and attention's kernel time (--profile).
# With RESULTS_DIR=DIR the raw output stays there.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prologue.sh
rounds="${ROUNDS:-3}" steps="${STEPS:-8}" seq="${SEQ:-1024}"
python3 - bench/llama_h256_l4.json "$out/config.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["max_position_embeddings"] = 2048
json.dump(config, open(sys.argv[2], "w"), indent=2)
PY
train() {  # name, flags...: one run's log and its summary line
  local name="$1"
  shift
  "$build_dir/apps/train_llama" --config "$out/config.json" --seq "$seq" --global-batch 4 --steps "$steps" \
    --threads 2 --data /usr/share/games/fortunes --limit-documents 3000 --pack --explain --profile "$@" \
    > "$out/$name.log" 2>&1
  local step attention
  step=$(grep -oE "step time: measured [0-9.]+ ms, predicted [0-9.]+ ms \([-+0-9.]+%\)" "$out/$name.log")
  attention=$(grep -E "^  attention +[0-9.]+ +[0-9.]+%" "$out/$name.log" | awk '{print $2}')
  echo "$name: $step; attention $attention ms a step"
}
{
  for round in $(seq "$rounds"); do
    if [ $((round % 2)) -eq 1 ]; then
      train "pack-$round"
      train "block-causal-$round" --block-causal
    else
      train "block-causal-$round" --block-causal
      train "pack-$round"
    fi
  done
} | tee "$out/summary.txt"
