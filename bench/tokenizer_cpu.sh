#!/usr/bin/env bash
# bench/tokenizer_cpu.sh: BpeTokenizer's training and encode speed over Debian's fortunes (trained to
# 4096 by apps/bench_tokenizer, one thread, word cache cold and warm) and, side by side, Hugging Face
# tokenizers' (the Rust library through its Python binding, from the peers' environment that
# scripts/peers makes) on the same documents: BpeTrainer to the same vocabulary, then the same
# tokenizer.json encoded one document at a time (encode) and all at once (encode_batch), with one
# thread (RAYON_NUM_THREADS=1, as ours) and with every core. Prints MB/s and the ratios. With
# RESULTS_DIR=DIR the files stay there. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
peers="${SHARDLAB_PEERS:-$HOME/.cache/shardlab-peers/venv}"
source bench/prologue.sh
[ -x "$peers/bin/python" ] || {
  echo "bench/tokenizer_cpu.sh: no peers' environment at $peers (run scripts/peers, or set SHARDLAB_PEERS)" >&2
  exit 1
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
"$build_dir/apps/bench_tokenizer" --vocab 4096 --save "$out/tokenizer.json" --save-documents "$out/documents.json" \
  | tee "$out/ours.txt"

hf() {  # threads, then the output file
  RAYON_NUM_THREADS="$1" "$peers/bin/python" - "$out/tokenizer.json" "$out/documents.json" "$1" <<'PY' | tee "$2"
import json, statistics, sys, time
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

path, documents_path, threads = sys.argv[1:]
documents = json.load(open(documents_path, encoding="utf-8"))
size = sum(len(d.encode()) for d in documents)
print(f"HF tokenizers {tokenizers.__version__} (Python {sys.version.split()[0]}), {threads} thread(s), "
      f"{len(documents)} documents, {size} bytes")

def train():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["[BOT]", "[EOT]", "[PAD]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer

def timed(label, run, passes=5):
    run()  # warm-up: fills the word cache, as our warm passes
    times, tokens = [], 0
    for _ in range(passes):
        start = time.perf_counter()
        tokens = run()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    print(f"HF {label}: {size / seconds / 1e6:.2f} MB/s, {tokens / seconds:.0f} tokens/s "
          f"(median of {passes} passes, {seconds:.3f} s each)")

start = time.perf_counter()
trained = train()
print(f"HF trained BpeTrainer (vocab {trained.get_vocab_size()}) in {time.perf_counter() - start:.3f} s")
tokenizer = Tokenizer.from_file(path)
timed("encode, one document at a time",
      lambda: sum(len(tokenizer.encode(d, add_special_tokens=False).ids) for d in documents))
timed("encode_batch", lambda: sum(len(e.ids) for e in tokenizer.encode_batch(documents, add_special_tokens=False)))
PY
}
hf 1 "$out/hf-1-thread.txt"
hf "$(nproc)" "$out/hf-all-cores.txt"

python3 - "$out" <<'PY' | tee "$out/ratios.txt"
import re, sys
out = sys.argv[1]
def figure(file, pattern):
    return float(re.search(pattern, open(f"{out}/{file}").read()).group(1))
ours = figure("ours.txt", r"encode warm cache: ([\d.]+) MB/s")
ours_cold = figure("ours.txt", r"encode cold cache: ([\d.]+) MB/s")
ours_train = figure("ours.txt", r"trained .* in ([\d.]+) s")
for file, threads in (("hf-1-thread.txt", "1 thread"), ("hf-all-cores.txt", "every core")):
    single = figure(file, r"one document at a time: ([\d.]+) MB/s")
    batch = figure(file, r"encode_batch: ([\d.]+) MB/s")
    train = figure(file, r"in ([\d.]+) s")
    print(f"HF with {threads}: ours (1 thread, warm) / HF encode one at a time {ours / single:.2f}x, "
          f"/ HF encode_batch {ours / batch:.2f}x; ours cold / HF one at a time {ours_cold / single:.2f}x; "
          f"training time HF / ours {train / ours_train:.2f}x")
PY
