#!/usr/bin/env node
// tests/tools/make_bpe_golden.js: writes the Hugging Face side of the golden files
// tests/data/test_bpe.cpp compares against, in tests/data/golden/, with HF tokenizers' official
// Node binding (npm package `tokenizers`, the Rust library; made with 0.23.2). Run by hand and
// commit the output; never run by the build or CI:
//   (mkdir -p /tmp/hf && cd /tmp/hf && npm install tokenizers)
//   NODE_PATH=/tmp/hf/node_modules node tests/tools/make_bpe_golden.js
//
// Inputs: bpe_corpus.txt, and bpe_ours_512.json, what BpeTokenizer::train makes of the corpus
// (its lines, min_frequency 0, vocab 512; test_bpe.cpp checks it still makes exactly that file).
// Outputs:
//   bpe_hf_full.json  HF's BpeTrainer run on the corpus (train_from_files: one sequence per line,
//                     newline kept) with the ByteLevel pre-tokenizer until no pair is left. The
//                     Node binding trains only with the default trainer (no special tokens, no
//                     initial alphabet, min_frequency 0, vocab 30000), hence "until no pair is
//                     left" and the test comparing merges, not ids.
//   bpe_hf_512.json   HF's merges from bpe_hf_full.json, in order, on the vocabulary
//                     BpeTrainer(vocab_size=512, special_tokens=[BOT, EOT, PAD],
//                     initial_alphabet=ByteLevel.alphabet()) starts from, until 512 tokens: what
//                     that trainer makes, since its ties go to the smaller (left id, right id) and
//                     the specials and the larger alphabet shift ids without reordering them.
//                     Built with BPE.init and saved by HF.
//   bpe_golden_ids.json  the ids HF gives each of `texts` with bpe_hf_512.json and with
//                     bpe_ours_512.json (no special tokens added).
const fs = require("fs");
const path = require("path");
const { Tokenizer, BPE, byteLevelPreTokenizer, byteLevelAlphabet } = require("tokenizers");

const golden = path.join(__dirname, "..", "data", "golden");
const corpus = path.join(golden, "bpe_corpus.txt");
const specials = ["[BOT]", "[EOT]", "[PAD]"];
const vocabSize = 512;

// The Node binding has no ByteLevel decoder constructor: set it in the JSON, which HF then reads back.
function saveWithDecoder(tokenizer, file) {
  const temp = file + ".tmp";
  tokenizer.save(temp);
  const json = JSON.parse(fs.readFileSync(temp, "utf8"));
  json.decoder = { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true };
  fs.writeFileSync(temp, JSON.stringify(json));
  Tokenizer.fromFile(temp).save(file);  // HF reads it and writes it in its own format
  fs.unlinkSync(temp);
}

const full = new Tokenizer(BPE.empty());
full.setPreTokenizer(byteLevelPreTokenizer(false));
full.train([corpus]);
saveWithDecoder(full, path.join(golden, "bpe_hf_full.json"));
const fullMerges = JSON.parse(fs.readFileSync(path.join(golden, "bpe_hf_full.json"), "utf8")).model.merges;

const vocab = {};
let size = 0;
const add = (token) => {
  if (!(token in vocab)) vocab[token] = size++;
};
specials.forEach(add);
[...byteLevelAlphabet()].sort((a, b) => a.codePointAt(0) - b.codePointAt(0)).forEach(add);
const merges = [];
for (const [left, right] of fullMerges) {
  if (size >= vocabSize) break;
  merges.push([left, right]);
  add(left + right);
}
const small = new Tokenizer(BPE.init(vocab, merges));
small.setPreTokenizer(byteLevelPreTokenizer(false));
small.addSpecialTokens(specials);
saveWithDecoder(small, path.join(golden, "bpe_hf_512.json"));

const texts = [
  "Hello world",
  "The quick brown fox jumps over the lazy dog.",
  "they're we've I'm you'll he'd it's don't 'tis O'Neil",
  "Digits 1234567890 and 3.14159 and 1,000,000",
  "punctuation!!! ... ?!? (parens) [brackets] {braces} --dash--",
  "   leading spaces, trailing spaces   ",
  "tabs\tand\nnewlines\n\n\nend\n",
  "multiple     spaces between words",
  "héllo wörld ça va Ünïcödé",
  "日本語のテキスト 東京 2024年",
  "emoji 🙂🙂 👍🏽 and ∑∫ π≈3",
  "a[EOT]b[BOT][PAD]c [EOT] d",
  "[EOT][EOT]x[BO[BOT]T]",
  "Debian GNU/Linux: apt-get install fortune-mod",
  "",
];

async function ids(file) {
  const tokenizer = Tokenizer.fromFile(file);
  const out = [];
  for (const text of texts) out.push((await tokenizer.encode(text, null, { addSpecialTokens: false })).getIds());
  return out;
}

(async () => {
  const result = {
    texts,
    hf_512: await ids(path.join(golden, "bpe_hf_512.json")),
    ours_512: await ids(path.join(golden, "bpe_ours_512.json")),
  };
  fs.writeFileSync(path.join(golden, "bpe_golden_ids.json"), JSON.stringify(result, null, 1) + "\n");
})();
