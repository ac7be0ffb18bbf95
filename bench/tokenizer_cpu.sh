#!/usr/bin/env bash
# bench/tokenizer_cpu.sh: BpeTokenizer encode throughput over Debian's fortunes (trained to 4096 by
# apps/bench_tokenizer, one thread, word cache cold and warm) and, side by side, Hugging Face
# tokenizers' (npm package `tokenizers`, the Rust library) on the same tokenizer.json and the same
# documents: encode() one document at a time (one thread at a time, as ours) and encodeBatch() (all
# cores). HF runs when HF_TOKENIZERS_NODE_MODULES names a node_modules folder holding `tokenizers`
# (e.g. after `cd /tmp/hf && npm install tokenizers`). Prints MB/s and the ratio. With RESULTS_DIR=DIR the
# files stay there. Not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${SHARDLAB_BUILD_DIR:-build}"
source bench/output_dir.sh

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
"$build_dir/apps/bench_tokenizer" --vocab 4096 --save "$out/tokenizer.json" --save-documents "$out/documents.json" \
  | tee "$out/ours.txt"
ours=$(grep 'encode warm cache' "$out/ours.txt" | sed -E 's/.*: ([0-9.]+) MB\/s.*/\1/')

if [ -z "${HF_TOKENIZERS_NODE_MODULES:-}" ] || ! command -v node >/dev/null; then
  echo "HF tokenizers: skipped (set HF_TOKENIZERS_NODE_MODULES to a node_modules with tokenizers, and install node)"
  exit 0
fi
NODE_PATH="$HF_TOKENIZERS_NODE_MODULES" node - "$out/tokenizer.json" "$out/documents.json" <<'JS' | tee "$out/hf.txt"
const fs = require("fs");
const { Tokenizer } = require("tokenizers");
const version = require("tokenizers/package.json").version;
const [file, documentsFile] = process.argv.slice(2);
const documents = JSON.parse(fs.readFileSync(documentsFile, "utf8"));
const bytes = documents.reduce((sum, d) => sum + Buffer.byteLength(d, "utf8"), 0);
const median = (xs) => xs.slice().sort((a, b) => a - b)[Math.floor(xs.length / 2)];
const options = { addSpecialTokens: false };
async function time(label, run) {
  const tokenizer = Tokenizer.fromFile(file);
  await run(tokenizer);  // warm-up: fills HF's word cache as our warm passes do
  const times = [];
  let tokens = 0;
  for (let pass = 0; pass < 5; ++pass) {
    const start = process.hrtime.bigint();
    tokens = await run(tokenizer);
    times.push(Number(process.hrtime.bigint() - start) / 1e9);
  }
  const s = median(times);
  console.log(`HF ${label}: ${(bytes / s / 1e6).toFixed(2)} MB/s, ${(tokens / s).toFixed(0)} tokens/s (median of 5 passes, ${s.toFixed(3)} s each)`);
}
(async () => {
  console.log(`HF tokenizers ${version} (node ${process.version}), ${documents.length} documents, ${bytes} bytes`);
  await time("encode, one document at a time", async (t) => {
    let n = 0;
    for (const d of documents) n += (await t.encode(d, null, options)).getIds().length;
    return n;
  });
  await time("encodeBatch, all cores", async (t) => {
    const encodings = await t.encodeBatch(documents, options);
    return encodings.reduce((n, e) => n + e.getIds().length, 0);
  });
})();
JS
hf=$(grep 'one document at a time' "$out/hf.txt" | sed -E 's/.*: ([0-9.]+) MB\/s.*/\1/')
echo "ours (warm, 1 thread) / HF encode (one document at a time): $(echo "scale=2; $ours / $hf" | bc -l)x"
