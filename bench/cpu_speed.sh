#!/usr/bin/env bash
# bench/cpu_speed.sh: the four CPU speed ratios, side by side on this machine, shardlab
# next to its PyTorch peer (Debian's python3-torch, installed by hand) for each:
#   1. CNN step, FULL_SHARD at 2 ranks (1 thread each, global batch 64, Adam) / PyTorch DDP's (gloo,
#      the same net with its dropout, batch and optimizer; bench/pytorch_ddp_cnn.py): median step
#      time; target <= 1.0;
#   2. CNN training in 1 process (2 threads, batch 64, Adadelta), PyTorch's images/s / ours
#      (bench/pytorch_train_cnn.py; as a time ratio, target <= 1.0);
#   3. Llama tiny training in 1 process (2 threads, T 256, B 16, AdamW), tokens/s ours / PyTorch's
#      (bench/pytorch_train_llama.py --model reference with the tiny preset's sizes: Debian's torch
#      has no transformers; bench/cpu_speed_peers.sh compares with Hugging Face's Llama); target >= 1.2;
#   4. FULL_SHARD / NO_SHARD step time at 2 ranks; target <= 1.15.
# A shared machine's speed drifts by 10% and more within minutes, so each ratio is the median of
# ROUNDS (default 3) rounds, each timing both sides back to back, the order alternating between
# rounds. Every run does STEPS (default 100) steps. With RESULTS_DIR=DIR the raw outputs stay there. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${STEPS:-100}" rounds="${ROUNDS:-3}"
source bench/prologue.sh
/usr/bin/python3 -c "import torch" 2>/dev/null || {
  echo "bench/cpu_speed.sh: needs Debian's python3-torch (apt-get install python3-torch)" >&2
  exit 1
}
images=$((64 * steps))

# Each runner writes its raw output to $out/<name>-<round>.* and prints its figure.
field() {  # metrics file, field: the last record's value that has it (rank 0's, where ranks write)
  python3 -c "import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if r.get('rank', 0) == 0 and sys.argv[2] in r][-1][sys.argv[2]])" "$1" "$2"
}
ours_step() {  # sharding, round: median step ms at 2 ranks
  local log="$out/cnn_$1-$2"
  "${mpirun[@]}" -np 2 "$build_dir/apps/train_cnn" --optimizer adam --global-batch 64 --threads 1 --epochs 1 \
    --steps "$steps" --limit-train "$images" --sharding "$1" --metrics "$log.jsonl" >"$log.log" 2>&1 ||
    { cat "$log.log" >&2; exit 1; }
  field "$log.jsonl" median_step_ms
}
pytorch_step() {  # round, flags: median step ms of PyTorch DDP
  local log="$out/pytorch_ddp$2-$1.log"
  /usr/bin/python3 bench/pytorch_ddp_cnn.py --steps "$steps" $2 >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
  grep -oE "median step [0-9.]+ ms" "$log" | grep -oE "[0-9.]+"
}
ours_images() {  # round: images/s of one process with 2 threads
  local log="$out/cnn_alone-$1"
  "$build_dir/apps/train_cnn" --global-batch 64 --threads 2 --epochs 1 --limit-train "$images" --limit-test 1000 \
    --metrics "$log.jsonl" >"$log.log" 2>&1 || { cat "$log.log" >&2; exit 1; }
  field "$log.jsonl" images_per_second
}
pytorch_images() {
  local log="$out/pytorch_cnn-$1.log"
  /usr/bin/python3 bench/pytorch_train_cnn.py --limit-train "$images" --threads 2 >"$log" 2>&1
  grep -oE "= [0-9.]+ images/s" "$log" | grep -oE "[0-9.]+"
}
ours_tokens() {
  local log="$out/llama-$1"
  "$build_dir/apps/train_llama" --config tiny --seq 256 --global-batch 16 --steps "$steps" --lr 1e-3 \
    --warmup-steps 10 --threads 2 --metrics "$log.jsonl" >"$log.log" 2>&1 || { cat "$log.log" >&2; exit 1; }
  field "$log.jsonl" tokens_per_second
}
pytorch_tokens() {
  local log="$out/pytorch_llama-$1.jsonl"
  /usr/bin/python3 bench/pytorch_train_llama.py --model reference --hidden 40 --intermediate 96 --layers 2 --heads 4 --kv-heads 2 \
    --seq 256 --batch 16 --steps "$steps" --lr 1e-3 --warmup 10 --threads 2 >"$log" 2>/dev/null
  python3 -c "import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if 'summary' in r][-1]['tokens_per_second'])" "$log"
}

: >"$out/rounds.txt"
for round in $(seq "$rounds"); do
  echo "== round $round of $rounds"
  if [ $((round % 2)) -eq 1 ]; then
    full=$(ours_step full "$round") none=$(ours_step none "$round") ddp=$(pytorch_step "$round" "")
    plain=$(pytorch_step "$round" --no-dropout)
    img=$(ours_images "$round") torch_img=$(pytorch_images "$round")
    tok=$(ours_tokens "$round") torch_tok=$(pytorch_tokens "$round")
  else
    plain=$(pytorch_step "$round" --no-dropout) ddp=$(pytorch_step "$round" "")
    none=$(ours_step none "$round") full=$(ours_step full "$round")
    torch_img=$(pytorch_images "$round") img=$(ours_images "$round")
    torch_tok=$(pytorch_tokens "$round") tok=$(ours_tokens "$round")
  fi
  echo "$round $full $none $ddp $plain $img $torch_img $tok $torch_tok" | tee -a "$out/rounds.txt"
done

python3 - "$out/rounds.txt" <<'PY' | tee "$out/ratios.txt"
import statistics, sys
rounds = [list(map(float, line.split()[1:])) for line in open(sys.argv[1]) if line.strip()]
def median(f):
    return statistics.median(f(*r) for r in rounds)
rows = [
    ("1. CNN FULL_SHARD step at 2 ranks / PyTorch DDP's", median(lambda f, n, d, p, i, ti, t, tt: f / d), "<=", 1.0,
     "ms", lambda f, n, d, p, i, ti, t, tt: (f, d)),
    ("2. CNN 1-process img/s, PyTorch's / ours", median(lambda f, n, d, p, i, ti, t, tt: ti / i), "<=", 1.0,
     "images/s", lambda f, n, d, p, i, ti, t, tt: (i, ti)),
    ("3. Llama tiny tok/s, ours / PyTorch's", median(lambda f, n, d, p, i, ti, t, tt: t / tt), ">=", 1.2,
     "tokens/s", lambda f, n, d, p, i, ti, t, tt: (t, tt)),
    ("4. CNN FULL_SHARD / NO_SHARD step at 2 ranks", median(lambda f, n, d, p, i, ti, t, tt: f / n), "<=", 1.15,
     "ms", lambda f, n, d, p, i, ti, t, tt: (f, n)),
]
print(f"medians of {len(rounds)} rounds (each round: both sides back to back)")
for name, ratio, sense, target, unit, pair in rows:
    met = ratio <= target if sense == "<=" else ratio >= target
    figures = ", ".join(f"{a:.1f} vs {b:.1f}" for a, b in (pair(*r) for r in rounds))
    print(f"{name:<52} {ratio:6.3f}  target {sense} {target:.2f}  {'met' if met else 'NOT met'}  ({unit} per round: {figures})")
print(f"(not a target: ours with dropout / PyTorch DDP without it: {median(lambda f, n, d, p, i, ti, t, tt: f / p):.3f})")
PY
