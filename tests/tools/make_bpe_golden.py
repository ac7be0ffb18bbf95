#!/usr/bin/env python3
"""tests/tools/make_bpe_golden.py: writes the Hugging Face side of the golden files
tests/data/test_bpe.cpp compares against, in tests/data/golden/, with Hugging Face's tokenizers
(the Rust library through its Python binding; made with 0.23.3). Run by hand, with the peers'
environment (scripts/peers), and commit the output; never run by the build or CI:
  ~/.cache/shardlab-peers/venv/bin/python tests/tools/make_bpe_golden.py

Inputs: bpe_corpus.txt, and bpe_ours_512.json, what BpeTokenizer::train makes of the corpus (its
lines, min_frequency 0, vocab 512; test_bpe.cpp checks it still makes exactly that file).
Outputs:
  bpe_hf_full.json     HF's BpeTrainer run on the corpus (train: one sequence per line, newline
                       kept) with the ByteLevel pre-tokenizer and the default trainer (no special
                       tokens, no initial alphabet, min_frequency 0, vocab 30000): until no pair is
                       left, hence the test comparing merges, not ids.
  bpe_hf_512.json      HF's merges from bpe_hf_full.json, in order, on the vocabulary
                       BpeTrainer(vocab_size=512, special_tokens=[BOT, EOT, PAD],
                       initial_alphabet=ByteLevel.alphabet()) starts from, until 512 tokens: what that
                       trainer makes, since its ties go to the smaller (left id, right id) and the
                       specials and the larger alphabet shift ids without reordering them. Built with
                       models.BPE and saved by HF.
  bpe_golden_ids.json  the ids HF gives each of `TEXTS` with bpe_hf_512.json and with
                       bpe_ours_512.json (no special tokens added).
"""
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "golden")
CORPUS = os.path.join(GOLDEN, "bpe_corpus.txt")
SPECIALS = ["[BOT]", "[EOT]", "[PAD]"]
VOCAB_SIZE = 512
TEXTS = [
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
]


def byte_level(tokenizer):
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def main():
    full = byte_level(Tokenizer(models.BPE()))
    full.train([CORPUS], trainers.BpeTrainer(show_progress=False))
    full.save(os.path.join(GOLDEN, "bpe_hf_full.json"), pretty=False)
    with open(os.path.join(GOLDEN, "bpe_hf_full.json"), encoding="utf-8") as file:
        full_merges = json.load(file)["model"]["merges"]

    vocab = {}
    for token in SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord):
        vocab.setdefault(token, len(vocab))
    merges = []
    for left, right in full_merges:
        if len(vocab) >= VOCAB_SIZE:
            break
        merges.append((left, right))
        vocab.setdefault(left + right, len(vocab))
    small = byte_level(Tokenizer(models.BPE(vocab, merges)))
    small.add_special_tokens(SPECIALS)
    small.save(os.path.join(GOLDEN, "bpe_hf_512.json"), pretty=False)

    def ids(name):
        tokenizer = Tokenizer.from_file(os.path.join(GOLDEN, name))
        return [tokenizer.encode(text, add_special_tokens=False).ids for text in TEXTS]

    result = {"texts": TEXTS, "hf_512": ids("bpe_hf_512.json"), "ours_512": ids("bpe_ours_512.json")}
    with open(os.path.join(GOLDEN, "bpe_golden_ids.json"), "w", encoding="utf-8") as file:
        file.write(json.dumps(result, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
