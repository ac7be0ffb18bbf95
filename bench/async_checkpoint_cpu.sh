#!/usr/bin/env bash
# bench/async_checkpoint_cpu.sh: what checkpoints cost the training steps, synchronous against
# --async-checkpoint, side by side: the Llama of bench/llama_324m.json (324M parameters, the largest
# whose staging fits a 24 GB machine at 4 ranks beside training: each rank stages 0.97 GB of
# parameters and AdamW moments) at 4 ranks on the CPU, random tokens, 8 steps, a checkpoint every 2.
# Prints per run the saves, the time training was blocked per save and the median step; for the
# background run also the median step while a write was in flight against the others. With
# RESULTS_DIR=DIR the logs stay there. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prologue.sh
train=("$build_dir/apps/train_llama" --config bench/llama_324m.json --random-tokens --seq 32 --global-batch 4
  --steps 8 --threads 1 --checkpoint-every 2 --keep 1)
for mode in synchronous background; do
  extra=()
  if [ "$mode" = background ]; then extra=(--async-checkpoint --checkpoint-staging 3G); fi
  "${mpirun[@]}" -np 4 "${train[@]}" --checkpoint-dir "$out/ckpt-$mode" --metrics "$out/$mode.jsonl" \
    "${extra[@]}" >"$out/$mode.log" 2>&1 || { cat "$out/$mode.log"; exit 1; }
  rm -rf "$out/ckpt-$mode"
done
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
def summary(mode):
    records = [json.loads(line) for line in open(f"{out}/{mode}.jsonl")]
    return next(r for r in records if r.get("rank") == 0 and "checkpoint_blocked_seconds" in r)
sync, background = summary("synchronous"), summary("background")
for mode, s in (("synchronous", sync), ("background", background)):
    blocked = s["checkpoint_blocked_seconds"]
    print(f"{mode:12s}: {len(blocked)} saves, training blocked {statistics.median(blocked):.3f} s per save (median; "
          f"each: {', '.join(f'{b:.3f}' for b in blocked)}); median step {s['median_step_seconds']:.2f} s")
during, otherwise = background["median_step_seconds_during_saves"], background["median_step_seconds_otherwise"]
print(f"background: committed {statistics.median(background['checkpoint_committed_seconds']):.2f} s after each "
      f"start (median); median step {during:.2f} s with a write in flight, {otherwise:.2f} s otherwise "
      f"({during / otherwise:.2f}x)")
print(f"blocked per save, background / synchronous: "
      f"{statistics.median(background['checkpoint_blocked_seconds']) / statistics.median(sync['checkpoint_blocked_seconds']):.3f}")
PY
