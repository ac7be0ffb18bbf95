#!/usr/bin/env bash
# bench/checkpoint_cpu.sh: what sharded checkpoints cost for the small Llama (hidden 768, 12 layers,
# byte vocab: 103M parameters) trained by 4 ranks on the CPU. One step, then a checkpoint (each
# rank its pieces of the parameters and of AdamW's two moments) and the consolidated
# model.safetensors written by every rank in place (--save-model); then --resume at 4 ranks and
# at 2 ranks, from a warm page cache and, where this user may drop it (root), from a cold one.
# Next to them, side by side: 4 processes writing the same bytes with dd and fsync, the disk's
# floor for a save. Prints bytes per rank, each time and the save/dd ratio. With RESULTS_DIR=DIR the
# logs stay there. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prologue.sh
train=("$build_dir/apps/train_llama" --config small --seq 32 --global-batch 4 --threads 1 --limit-documents 200
  --checkpoint-dir "$out/ckpt")

drop_caches() {  # true when the page cache was dropped
  sync
  { echo 3 >/proc/sys/vm/drop_caches; } 2>/dev/null
}
run() {  # run LOG RANKS ARGS...: train_llama under mpirun, its output in LOG
  local log="$1" ranks="$2"
  shift 2
  "${mpirun[@]}" -np "$ranks" "${train[@]}" "$@" >"$out/$log" 2>&1 || { cat "$out/$log"; exit 1; }
}
seconds() {  # seconds WHAT LOG: the time train_llama logged for WHAT (saved checkpoint, loaded checkpoint, saved the model)
  grep "$1" "$out/$2" | head -1 | sed -E 's/.* in ([0-9.]+) s.*/\1/'
}

run save.log 4 --steps 1 --save-model "$out/model"
cp -r "$out/ckpt" "$out/ckpt-step1"
saved="$out/ckpt-step1/step-00000001"
cold=no
drop_caches && cold=yes
run resume4.log 4 --steps 2 --resume
rm -rf "$out/ckpt" && cp -r "$out/ckpt-step1" "$out/ckpt"
run resume4-warm.log 4 --steps 2 --resume
rm -rf "$out/ckpt" && cp -r "$out/ckpt-step1" "$out/ckpt"
cold2=no
drop_caches && cold2=yes
run resume2.log 2 --steps 2 --resume

bytes=$(stat -c %s "$saved/rank-00000-of-00004.bin")
dd_start=$(date +%s.%N)
for rank in 0 1 2 3; do
  dd if=/dev/zero of="$out/dd-$rank" bs=1M count=$((bytes / 1048576)) conv=fsync status=none &
done
wait
dd_seconds=$(echo "$(date +%s.%N) - $dd_start" | bc -l)
rm -f "$out"/dd-*

save=$(seconds "saved checkpoint" save.log)
echo "small Llama, 4 ranks on $(nproc) cores: $(grep -o 'model small with [0-9]* parameters' "$out/save.log")"
echo "checkpoint: $(ls "$saved" | wc -l) files:"
ls -l "$saved" | awk 'NR > 1 { printf "  %-26s %12d B\n", $9, $5 }'
echo "model.safetensors: $(stat -c %s "$out/model/model.safetensors") B"
echo "save (4 ranks):                         $save s"
echo "save_full_safetensors (4 ranks):        $(seconds "saved the model" save.log) s"
echo "load at 4 ranks, page cache dropped=$cold: $(seconds "loaded checkpoint" resume4.log) s"
echo "load at 4 ranks, warm page cache:       $(seconds "loaded checkpoint" resume4-warm.log) s"
echo "load at 2 ranks (4 -> 2), dropped=$cold2:  $(seconds "loaded checkpoint" resume2.log) s"
printf "dd of the same bytes, 4 writers, fsync: %.2f s (save / dd = %.2f)\n" "$dd_seconds" \
  "$(echo "$save / $dd_seconds" | bc -l)"
