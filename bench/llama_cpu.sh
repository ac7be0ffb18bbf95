#!/usr/bin/env bash
# bench/llama_cpu.sh: CPU training speed of the Llama, side by side in one run on this machine:
# train_llama (1 process) and PyTorch (bench/pytorch_train_llama.py, Debian's python3-torch, which has
# no transformers: the project's reference Llama; bench/cpu_speed_peers.sh compares with Hugging Face's) on
# the same model (bench/llama_h256_l4.json: H256 L4 heads 8/2 I1024), fortunes as byte tokens,
# T256 B16, the same optimizer and schedule, 2 threads each, STEPS steps (default 300). Prints
# both median tokens/s, their ratio, and both loss curves (mean of every 25 steps). With RESULTS_DIR=DIR
# the raw per-step records stay there (shardlab.jsonl, shardlab.log, pytorch.jsonl). Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${STEPS:-300}"
threads="${THREADS:-2}"
source bench/prologue.sh

"$build_dir/apps/train_llama" --config bench/llama_h256_l4.json --seq 256 --global-batch 16 --steps "$steps" \
  --lr 1e-3 --warmup-steps 30 --threads "$threads" --metrics "$out/shardlab.jsonl" >"$out/shardlab.log" 2>&1 ||
  { cat "$out/shardlab.log"; exit 1; }
/usr/bin/python3 bench/pytorch_train_llama.py --model reference --steps "$steps" --lr 1e-3 --warmup 30 --threads "$threads" >"$out/pytorch.jsonl"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
ours = [json.loads(l) for l in open(f"{out}/shardlab.jsonl")]
theirs = [json.loads(l) for l in open(f"{out}/pytorch.jsonl")]
ours_summary = [r for r in ours if "median_step_seconds" in r][-1]
theirs_summary = [r for r in theirs if "summary" in r][-1]
ours_steps = {r["step"]: r["loss"] for r in ours if "loss" in r}
theirs_steps = {r["step"]: r["loss"] for r in theirs if "loss" in r}
print(f"shardlab: {ours_summary['tokens_per_second']:.0f} tok/s (median step {1e3 * ours_summary['median_step_seconds']:.1f} ms)")
print(f"pytorch {theirs_summary['torch']}: {theirs_summary['tokens_per_second']:.0f} tok/s "
      f"(median step {1e3 * theirs_summary['median_step_seconds']:.1f} ms)")
print(f"ratio shardlab / pytorch tokens/s: {ours_summary['tokens_per_second'] / theirs_summary['tokens_per_second']:.3f}")
print("step    shardlab  pytorch   (mean loss of the 25 steps ending there)")
last = max(ours_steps)
for end in range(25, last + 1, 25):
    window = range(end - 24, end + 1)
    mean = lambda losses: sum(losses[s] for s in window) / 25
    print(f"{end:>4}    {mean(ours_steps):.4f}    {mean(theirs_steps):.4f}")
PY
