#!/usr/bin/env bash
# bench/cpu_speed_peers.sh: shardlab's CPU speed against today's PyTorch (2.15, from the peers'
# environment that scripts/peers makes), eager and torch.compile'd (inductor), side by side:
#   1. the CNN in 1 process (2 threads, batch 64, Adadelta): images/s from the median step;
#   2. the CNN at 2 ranks, 1 thread each, global batch 64, Adam: train_cnn --sharding full against
#      PyTorch DDP over gloo (bench/pytorch_ddp_cnn.py: bucketed all_reduce): median step time;
#   2b. the same against PyTorch FSDP2's fully_shard on each layer and the root, over gloo
#      (bench/pytorch_ddp_cnn.py --fsdp2);
#   3. the Llama H256 L4 8/2 I1024 (bench/llama_h256_l4.json), T256 B16, AdamW, 1 process, 2 threads,
#      against what users run: Hugging Face transformers' LlamaForCausalLM with SDPA attention
#      (bench/pytorch_train_llama.py --model hf): tokens/s from the median step;
#   4. the same Llama at 2 ranks, 1 thread each: mpirun -np 2 train_llama --sharding full against
#      PyTorch FSDP2's fully_shard over gloo (bench/pytorch_fsdp2_llama.py: all_gather_into_tensor
#      and reduce_scatter_tensor per unit): tokens/s.
# Each figure is the median of ROUNDS rounds (default 5); a round runs the three sides of every case
# back to back, in the reverse order every other round, since a shared machine's speed drifts
# within minutes. Ratios are ours' speed over the peer's (above 1: shardlab is faster). A compiled
# peer's first step, which compiles (from scratch in round 1, from inductor's cache of this run
# after), is reported apart and left out of its median. CNN_STEPS
# (default 100) and LLAMA_STEPS (default 30) steps per run. CASES (default all: "cnn_alone cnn_ranks
# cnn_fsdp2 llama_alone llama_ranks") picks the cases. With RESULTS_DIR=DIR the raw outputs stay
# there. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
peers="${SHARDLAB_PEERS:-$HOME/.cache/shardlab-peers/venv}"
rounds="${ROUNDS:-5}" cnn_steps="${CNN_STEPS:-100}" llama_steps="${LLAMA_STEPS:-30}"
read -ra cases <<<"${CASES:-cnn_alone cnn_ranks cnn_fsdp2 llama_alone llama_ranks}"
for case in "${cases[@]}"; do
  case "$case" in
    cnn_alone | cnn_ranks | cnn_fsdp2 | llama_alone | llama_ranks) ;;
    *) echo "bench/cpu_speed_peers.sh: unknown case '$case' in CASES (cnn_alone, cnn_ranks, cnn_fsdp2, llama_alone, llama_ranks)" >&2
       exit 1 ;;
  esac
done
source bench/prologue.sh
python="$peers/bin/python"
[ -x "$python" ] || {
  echo "bench/cpu_speed_peers.sh: no peers' environment at $peers (run scripts/peers, or set SHARDLAB_PEERS)" >&2
  exit 1
}
images=$((64 * cnn_steps))
# Inductor's compiled kernels go to a cache of this run's own: the first round compiles from
# scratch, the later ones find their kernels there, as a user's second run would.
export TORCHINDUCTOR_CACHE_DIR="$out/inductor-cache"
rm -rf "$TORCHINDUCTOR_CACHE_DIR"

field() {  # metrics file, field: rank 0's last record that has it
  python3 -c "import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if r.get('rank', 0) == 0 and sys.argv[2] in r][-1][sys.argv[2]])" "$1" "$2"
}
summary() {  # a peer's JSON lines, field: its summary's
  python3 -c "import json,sys; print([r for r in map(json.loads, (l for l in open(sys.argv[1]) if l.startswith('{'))) if 'summary' in r][-1][sys.argv[2]])" "$1" "$2"
}
run() {  # log, command...: runs it, its output to the log; fails the script naming the log
  local log="$1"
  shift
  "$@" >"$log" 2>&1 || { tail -20 "$log" >&2; echo "bench/cpu_speed_peers.sh: failed: $*" >&2; exit 1; }
}
mode_flag() { [ "$1" = compile ] && echo --compile || true; }

# Each case prints "<figure> <first step s>" for a side: ours, eager or compile.
cnn_alone() {  # side, round: images/s
  local log="$out/cnn_alone-$1-$2"
  if [ "$1" = ours ]; then
    run "$log.log" "$build_dir/apps/train_cnn" --global-batch 64 --threads 2 --epochs 1 --steps "$cnn_steps" \
      --limit-train "$images" --limit-test 1000 --metrics "$log.jsonl"
    echo "$(python3 -c "print(64000 / $(field "$log.jsonl" median_step_ms))") 0"
  else
    run "$log.log" "$python" bench/pytorch_train_cnn.py --limit-train "$images" --threads 2 $(mode_flag "$1")
    local ms first
    ms=$(grep -oE "median step [0-9.]+ ms" "$log.log" | grep -oE "[0-9.]+")
    first=$(grep -oE "first step [0-9.]+ s" "$log.log" | grep -oE "[0-9.]+")
    echo "$(python3 -c "print(64000 / $ms)") $first"
  fi
}
cnn_ranks() {  # side, round: median step ms at 2 ranks, the peer under DDP
  cnn_at_two_ranks ddp "$@"
}
cnn_fsdp2() {  # side, round: the same, the peer under FSDP2
  cnn_at_two_ranks fsdp2 "$@"
}
cnn_at_two_ranks() {  # peer's wrapper (ddp or fsdp2), side, round: median step ms at 2 ranks
  local wrapper="$1"
  shift
  local log="$out/cnn_$wrapper-$1-$2"
  if [ "$1" = ours ]; then
    run "$log.log" "${mpirun[@]}" -np 2 "$build_dir/apps/train_cnn" --optimizer adam --global-batch 64 --threads 1 \
      --epochs 1 --steps "$cnn_steps" --limit-train "$images" --sharding full --metrics "$log.jsonl"
    echo "$(field "$log.jsonl" median_step_ms) 0"
  else
    run "$log.log" "$python" bench/pytorch_ddp_cnn.py --steps "$cnn_steps" $(mode_flag "$1") \
      $([ "$wrapper" = fsdp2 ] && echo --fsdp2 || true)
    echo "$(grep -oE "median step [0-9.]+ ms" "$log.log" | grep -oE "[0-9.]+") \
$(grep -oE "the first [0-9.]+ s" "$log.log" | grep -oE "[0-9.]+")"
  fi
}
llama_alone() {  # side, round: tokens/s
  local log="$out/llama_alone-$1-$2"
  if [ "$1" = ours ]; then
    run "$log.log" "$build_dir/apps/train_llama" --config bench/llama_h256_l4.json --seq 256 --global-batch 16 \
      --steps "$llama_steps" --lr 1e-3 --warmup-steps 10 --threads 2 --metrics "$log.jsonl"
    echo "$(field "$log.jsonl" tokens_per_second) 0"
  else
    run "$log.jsonl" "$python" bench/pytorch_train_llama.py --steps "$llama_steps" --warmup 10 --threads 2 \
      $(mode_flag "$1")
    echo "$(summary "$log.jsonl" tokens_per_second) $(summary "$log.jsonl" first_step_seconds)"
  fi
}
llama_ranks() {  # side, round: tokens/s at 2 ranks
  local log="$out/llama_ranks-$1-$2"
  if [ "$1" = ours ]; then
    run "$log.log" "${mpirun[@]}" -np 2 "$build_dir/apps/train_llama" --config bench/llama_h256_l4.json --seq 256 \
      --global-batch 16 --steps "$llama_steps" --lr 1e-3 --warmup-steps 10 --threads 1 --sharding full \
      --metrics "$log.jsonl"
    echo "$(field "$log.jsonl" tokens_per_second) 0"
  else
    run "$log.jsonl" "$python" bench/pytorch_fsdp2_llama.py --steps "$llama_steps" --warmup 10 $(mode_flag "$1")
    echo "$(summary "$log.jsonl" tokens_per_second) $(summary "$log.jsonl" first_step_seconds)"
  fi
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')" |
  tee "$out/machine.txt"
"$python" -c "import torch; print('peer: torch', torch.__version__)" | tee -a "$out/machine.txt"
: >"$out/rounds.txt"
for round in $(seq "$rounds"); do
  sides=(ours eager compile)
  [ $((round % 2)) -eq 0 ] && sides=(compile eager ours)
  for case in "${cases[@]}"; do
    for side in "${sides[@]}"; do
      echo "$round $case $side $("$case" "$side" "$round")" | tee -a "$out/rounds.txt"
    done
  done
done

python3 - "$out/rounds.txt" <<'PY' | tee "$out/ratios.txt"
import collections, statistics, sys
figures = collections.defaultdict(dict)  # (case, side) -> round -> (figure, first step)
for line in open(sys.argv[1]):
    round_, case, side, figure, first = line.split()
    figures[case, side][int(round_)] = (float(figure), float(first))
cases = [("cnn_alone", "1. CNN, 1 process, 2 threads", "images/s", False),
         ("cnn_ranks", "2. CNN, 2 ranks: FULL_SHARD vs DDP (gloo)", "ms per step", True),
         ("cnn_fsdp2", "2b. CNN, 2 ranks: FULL_SHARD vs FSDP2 (gloo)", "ms per step", True),
         ("llama_alone", "3. Llama H256 L4, 1 process, 2 threads", "tokens/s", False),
         ("llama_ranks", "4. Llama H256 L4, 2 ranks: full vs FSDP2 (gloo)", "tokens/s", False)]
rounds = sorted(next(iter(figures.values())))
print(f"medians of {len(rounds)} rounds; ratio = shardlab's speed / the peer's (above 1: shardlab faster)")
for case, name, unit, lower_is_faster in cases:
    if (case, "ours") not in figures:
        continue
    def speed_ratio(peer, r):
        ours, theirs = figures[case, "ours"][r][0], figures[case, peer][r][0]
        return theirs / ours if lower_is_faster else ours / theirs
    medians = {side: statistics.median(figures[case, side][r][0] for r in rounds) for side in ("ours", "eager", "compile")}
    eager = statistics.median(speed_ratio("eager", r) for r in rounds)
    compiled = statistics.median(speed_ratio("compile", r) for r in rounds)
    cold = figures[case, "compile"][rounds[0]][1]
    warm = statistics.median(figures[case, "compile"][r][1] for r in rounds[1:]) if len(rounds) > 1 else float("nan")
    print(f"{name:<50} ours {medians['ours']:9.1f}, eager {medians['eager']:9.1f}, compiled {medians['compile']:9.1f} "
          f"{unit}; vs eager {eager:5.3f} ({'>= 1' if eager >= 1 else 'BELOW 1'}), vs compiled {compiled:5.3f}; "
          f"compiled first step {cold:.1f} s (round 1, compiling), {warm:.1f} s (later rounds, cached)")
PY
