#!/usr/bin/env bash
# bench/cpu_speed.sh: the four CPU speed ratios of issue 17, side by side in one run on this machine,
# shardlab then its PyTorch peer (Debian's python3-torch, installed by hand) for each:
#   1. CNN step, FULL_SHARD at 2 ranks (1 thread each, global batch 64, Adam) / PyTorch DDP's (gloo,
#      the same net, batch and optimizer; bench/pytorch_ddp_cnn.py): median step time; target <= 1.0;
#   2. CNN training in 1 process (2 threads, batch 64, Adadelta), PyTorch's images/s / ours
#      (bench/pytorch_train_cnn.py; as a time ratio, target <= 1.0);
#   3. Llama tiny training in 1 process (2 threads, T 256, B 16, AdamW), tokens/s ours / PyTorch's
#      (bench/pytorch_train_llama.py with the tiny preset's sizes); target >= 1.2;
#   4. FULL_SHARD / NO_SHARD step time at 2 ranks; target <= 1.15.
# Both sides run dropout as the seed net does. STEPS (default 100) steps each; with OUT=DIR the raw
# outputs stay there. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${SHARDLAB_BUILD_DIR:-build}"
steps="${STEPS:-100}"
source bench/output_dir.sh
/usr/bin/python3 -c "import torch" 2>/dev/null || {
  echo "bench/cpu_speed.sh: needs Debian's python3-torch (apt-get install python3-torch)" >&2
  exit 1
}
mpirun=(mpirun --allow-run-as-root --oversubscribe)
cnn_step=(--optimizer adam --global-batch 64 --threads 1 --epochs 1 --steps "$steps" --limit-train $((64 * steps)))
summary() {  # metrics file, field: rank 0's summary field
  python3 -c "import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if r.get('rank') == 0 and sys.argv[2] in r][-1][sys.argv[2]])" "$1" "$2"
}

echo "== 1, 4: CNN step at 2 ranks"
for sharding in full none; do
  "${mpirun[@]}" -np 2 "$build_dir/apps/train_cnn" "${cnn_step[@]}" --sharding "$sharding" \
    --metrics "$out/cnn_$sharding.jsonl" >"$out/cnn_$sharding.log" 2>&1 || { cat "$out/cnn_$sharding.log"; exit 1; }
done
/usr/bin/python3 bench/pytorch_ddp_cnn.py --steps "$steps" >"$out/pytorch_ddp.log" 2>&1
full_ms=$(summary "$out/cnn_full.jsonl" median_step_ms)
none_ms=$(summary "$out/cnn_none.jsonl" median_step_ms)
ddp_ms=$(grep -oE "median step [0-9.]+ ms" "$out/pytorch_ddp.log" | grep -oE "[0-9.]+")

echo "== 2: CNN training, 1 process, 2 threads"
images=$((64 * steps))
"$build_dir/apps/train_cnn" --global-batch 64 --threads 2 --epochs 1 --limit-train "$images" --limit-test 1000 \
  --metrics "$out/cnn_alone.jsonl" >"$out/cnn_alone.log" 2>&1 || { cat "$out/cnn_alone.log"; exit 1; }
/usr/bin/python3 bench/pytorch_train_cnn.py --limit-train "$images" --threads 2 >"$out/pytorch_cnn.log" 2>&1
ours_img=$(python3 -c "import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if 'images_per_second' in r][-1]['images_per_second'])" "$out/cnn_alone.jsonl")
theirs_img=$(grep -oE "= [0-9.]+ images/s" "$out/pytorch_cnn.log" | grep -oE "[0-9.]+")

echo "== 3: Llama tiny training, 1 process, 2 threads"
"$build_dir/apps/train_llama" --config tiny --seq 256 --global-batch 16 --steps "$steps" --lr 1e-3 --warmup-steps 10 \
  --threads 2 --metrics "$out/llama.jsonl" >"$out/llama.log" 2>&1 || { cat "$out/llama.log"; exit 1; }
/usr/bin/python3 bench/pytorch_train_llama.py --hidden 40 --intermediate 96 --layers 2 --heads 4 --kv-heads 2 \
  --seq 256 --batch 16 --steps "$steps" --lr 1e-3 --warmup 10 --threads 2 >"$out/pytorch_llama.jsonl"
ours_tok=$(summary "$out/llama.jsonl" tokens_per_second)
theirs_tok=$(python3 -c "import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if 'summary' in r][-1]['tokens_per_second'])" "$out/pytorch_llama.jsonl")

python3 - "$full_ms" "$none_ms" "$ddp_ms" "$ours_img" "$theirs_img" "$ours_tok" "$theirs_tok" <<'PY' | tee "$out/ratios.txt"
import sys
full, none, ddp, ours_img, theirs_img, ours_tok, theirs_tok = map(float, sys.argv[1:])
rows = [
    ("1. CNN FULL_SHARD step at 2 ranks / PyTorch DDP's", full / ddp, "<= 1.00", full / ddp <= 1.0,
     f"{full:.1f} ms vs {ddp:.1f} ms"),
    ("2. CNN 1-process img/s, PyTorch's / ours", theirs_img / ours_img, "<= 1.00", theirs_img <= ours_img,
     f"{ours_img:.0f} vs {theirs_img:.0f} images/s"),
    ("3. Llama tiny tok/s, ours / PyTorch's", ours_tok / theirs_tok, ">= 1.20", ours_tok >= 1.2 * theirs_tok,
     f"{ours_tok:.0f} vs {theirs_tok:.0f} tokens/s"),
    ("4. CNN FULL_SHARD / NO_SHARD step at 2 ranks", full / none, "<= 1.15", full <= 1.15 * none,
     f"{full:.1f} ms vs {none:.1f} ms"),
]
for name, ratio, target, met, detail in rows:
    print(f"{name:<52} {ratio:6.3f}  target {target}  {'met' if met else 'NOT met'}  ({detail})")
PY
