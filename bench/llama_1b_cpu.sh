#!/usr/bin/env bash
# bench/llama_1b_cpu.sh: a 1B Llama at its real size on one CPU machine, no rank ever holding the
# whole model. transformers writes a random LlamaForCausalLM of the 1b preset's shape (TinyLlama's:
# 1.1B parameters, grouped-query attention) in bf16, cut by save_pretrained into files of 500 MB;
# train_llama --init-from reads it at 4 ranks (each rank only its shards' elements, widened to
# f32), trains 3 steps on random tokens with SGD without momentum and saves the model in f32 cut into
# files of 2 GB, every rank writing its own ranges; transformers loads that directory and scores a fixed prompt, set
# against shardlab's generate --logits of the same directory. Prints per rank the peak resident
# memory (VmHWM) beside the plan's predicted peak (--explain), the seconds per step, the load and
# the save as train_llama logs them, and the largest logit difference. SGD: AdamW's 8 more bytes per element make the plan's
# peak 5.74 GiB per rank, 23 GiB for the 4, more than a 24 GB machine leaves them (`--explain` says
# so before step 1); SGD without momentum keeps none. Needs the peers' environment (scripts/peers)
# and about 17 GB of memory. With RESULTS_DIR=DIR the logs stay there. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/prologue.sh
python="${SHARDLAB_PEERS:-$HOME/.cache/shardlab-peers/venv}/bin/python"
[[ -x $python ]] || { echo "llama_1b_cpu.sh: no peers' environment at $python (scripts/peers makes it)" >&2; exit 1; }
hf="$out/hf-1b" saved="$out/shardlab-1b"

"$python" - "$hf" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                     num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                     rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
torch.manual_seed(0)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(sys.argv[1], max_shard_size="500MB")
PY
echo "transformers wrote $(ls "$hf"/model-*.safetensors | wc -l) weight files, $(du -sh "$hf" | cut -f1)"

"${mpirun[@]}" -np 4 "$build_dir/apps/train_llama" --init-from "$hf" --random-tokens --seq 32 --global-batch 4 \
  --steps 3 --optimizer sgd --momentum 0 --lr 1e-3 --threads 1 --explain --metrics "$out/train.jsonl" --save-model "$saved" \
  --save-model-max-file-size 2G >"$out/train.log" 2>&1 || { cat "$out/train.log"; exit 1; }
grep -E "read each rank's shards|training peak per rank, predicted|saved the model" "$out/train.log"

generate=("$build_dir/apps/generate" "$saved" --threads 2 --tokenizer bytes)
"${generate[@]}" --prompt "A sharded model says" --logits "$out/logits.safetensors" >"$out/generate.log"

"$python" - "$out" "$saved" <<'PY'
import json, sys, torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM
out, saved = sys.argv[1], sys.argv[2]
records = [json.loads(line) for line in open(f"{out}/train.jsonl")]
steps = [r["step_seconds"] for r in records if r.get("rank") == 0 and "loss" in r]
summaries = sorted((r for r in records if "peak_resident_bytes" in r), key=lambda r: r["rank"])
for s in summaries:
    predicted = s["predicted_peak"]
    print(f"rank {s['rank']}: peak resident {s['peak_resident_bytes'] / 2**30:.2f} GiB; plan's predicted "
          f"training peak {predicted['total'] / 2**30:.2f} GiB, persistent {s['persistent_bytes'] / 2**30:.2f} GiB")
print(f"steps: {', '.join(f'{t:.1f}' for t in steps)} s")
scored = load_file(f"{out}/logits.safetensors")
model = LlamaForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
with torch.no_grad():
    theirs = model(scored["ids"].reshape(1, -1)).logits[0]
difference = (theirs - scored["logits"]).abs().max().item()
print(f"transformers' logits of the {scored['ids'].numel()} prompt ids against shardlab's: max |difference| "
      f"{difference:.2e}")
PY
