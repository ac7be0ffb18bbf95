#!/usr/bin/env bash
# bench/compare_builds.sh OLD_BUILD NEW_BUILD: two builds of shardlab (e.g. a worktree of the
# previous commit's build and this one's), timed side by side on this machine in ROUNDS rounds
# (default 3) whose order alternates: the CNN's FULL_SHARD step at 2 ranks (1 thread each, Adam,
# global batch 64, 100 steps; median ms), the CNN in 1 process (2 threads, 6400 images; images/s)
# and the tiny Llama (2 threads, T 256, B 16, 100 steps; tokens/s). Prints each round's figures and
# the median of each new / old ratio. With RESULTS_DIR=DIR the raw outputs stay there. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
old="${1:?usage: bench/compare_builds.sh OLD_BUILD NEW_BUILD}" new="${2:?usage: bench/compare_builds.sh OLD_BUILD NEW_BUILD}"
rounds="${ROUNDS:-3}"
source bench/prologue.sh

field() {  # metrics file, field: rank 0's last record that has it
  python3 -c "import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if r.get('rank', 0) == 0 and sys.argv[2] in r][-1][sys.argv[2]])" "$1" "$2"
}
run() {  # what, build, tag: one figure
  local log="$out/$1-$3"
  case "$1" in
    step) "${mpirun[@]}" -np 2 "$2/apps/train_cnn" --optimizer adam --global-batch 64 --threads 1 --epochs 1 \
            --steps 100 --limit-train 6400 --sharding full --metrics "$log.jsonl" >"$log.log" 2>&1
          field "$log.jsonl" median_step_ms ;;
    images) "$2/apps/train_cnn" --global-batch 64 --threads 2 --epochs 1 --limit-train 6400 --limit-test 1000 \
              --metrics "$log.jsonl" >"$log.log" 2>&1
            field "$log.jsonl" images_per_second ;;
    tokens) "$2/apps/train_llama" --config tiny --seq 256 --global-batch 16 --steps 100 --lr 1e-3 \
              --warmup-steps 10 --threads 2 --metrics "$log.jsonl" >"$log.log" 2>&1
            field "$log.jsonl" tokens_per_second ;;
  esac
}

: >"$out/rounds.txt"
for round in $(seq "$rounds"); do
  for what in step images tokens; do
    if [ $((round % 2)) -eq 1 ]; then
      o=$(run "$what" "$old" "old-$round") n=$(run "$what" "$new" "new-$round")
    else
      n=$(run "$what" "$new" "new-$round") o=$(run "$what" "$old" "old-$round")
    fi
    echo "round $round $what old $o new $n" | tee -a "$out/rounds.txt"
  done
done
python3 - "$out/rounds.txt" <<'PY' | tee "$out/ratios.txt"
import statistics, sys
rows = [line.split() for line in open(sys.argv[1]) if line.strip()]
for what in ("step", "images", "tokens"):
    ratios = [float(r[6]) / float(r[4]) for r in rows if r[2] == what]
    print(f"{what}: new / old median {statistics.median(ratios):.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios)})")
PY
