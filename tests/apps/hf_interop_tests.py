#!/usr/bin/env python3
"""tests/apps/hf_interop_tests.py: Hugging Face's own code reads what shardlab writes, and shardlab
reads what Hugging Face writes, checked with the real transformers and tokenizers:

- shardlab -> Hugging Face: a tiny Llama trained by train_llama --save-model, with byte tokens and
  with a BPE tokenizer it learned, loads in transformers.LlamaForCausalLM.from_pretrained: its
  logits on a line it never saw are shardlab's (generate --logits) within 1e-4, its loss the same
  within 1e-5 (relative), and greedy generation gives the same ids; AutoTokenizer.from_pretrained
  on the BPE directory encodes every document of the corpus to shardlab's ids (bench_tokenizer
  --save-ids) and decodes them back to the document. Saved at 2 ranks in bf16 cut into files of
  at most 20 KiB, the directory is cut as huggingface_hub's split_torch_state_dict_into_shards
  (save_pretrained's) cuts the same tensors, holds what from_pretrained then loads, and gives the
  same logits.
- Hugging Face -> shardlab: a LlamaForCausalLM with a random config (grouped-query attention,
  untied and tied embeddings, the tied one with rope_theta 500000 and Llama 3's rope scaling, as
  Llama-3.2-1B) and a tokenizer trained by tokenizers' own BpeTrainer, saved by
  save_pretrained in bf16 as sharded safetensors with their index, loads in generate and
  train_llama --init-from: the same logits within 1e-4, the same greedy ids.

It needs the peers' environment (scripts/peers) and runs only when SHARDLAB_PEERS names it: then
it runs itself with that environment's python; otherwise it exits 77 (meson: skipped, and counted
as one skipped check). CI never sets it. Usage: hf_interop_tests.py <train_llama> <generate> <bench_tokenizer>. Prints one line
per check, then "hf_interop: N passed, N failed, N skipped".
"""
import json
import os
import re
import subprocess
import sys
import tempfile

SKIPPED = 77
FORTUNES = "/usr/share/games/fortunes"
HELD_OUT = "Q: What does a sharded model say to its gathered self?\nA: Long time no see."
TRAIN_ARGS = ["--config", "tiny", "--seq", "64", "--global-batch", "8", "--limit-documents", "400", "--steps", "40",
              "--lr", "3e-3", "--threads", "2"]
LOGIT_TOLERANCE = 1e-4
LOSS_TOLERANCE = 1e-5
NEW_TOKENS = 24


def skip(why):
    """Ends the test as skipped (meson's exit status 77), with the summary line that counts it."""
    print(f"hf_interop: skipped: {why}")
    print("hf_interop: 0 passed, 0 failed, 1 skipped")
    sys.exit(SKIPPED)


def in_peers_environment():
    """Runs this script again with the peers' python, unless it is that python; skips when
    SHARDLAB_PEERS is unset."""
    peers = os.environ.get("SHARDLAB_PEERS", "")
    if not peers:
        skip("SHARDLAB_PEERS does not name the peers' environment (scripts/peers makes it)")
    python = os.path.join(peers, "bin", "python")
    if os.path.realpath(sys.prefix) == os.path.realpath(peers):
        return
    if not os.access(python, os.X_OK):
        sys.exit(f"hf_interop: SHARDLAB_PEERS='{peers}' has no bin/python: run scripts/peers to make it")
    os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:]])


class Checks:
    def __init__(self):
        self.passed = self.failed = 0

    def __call__(self, name, ok, detail=""):
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
        if not ok and detail:
            print("  " + str(detail).replace("\n", "\n  ")[-4000:])
        self.passed += ok
        self.failed += not ok

    def summary(self):
        print(f"hf_interop: {self.passed} passed, {self.failed} failed, 0 skipped")
        return 1 if self.failed else 0


def run(command):
    # A sample may end inside a character: its text is shown, not decoded strictly.
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            check=False)
    return result.returncode, result.stdout


def shardlab_scores(generate, directory, text, scratch):
    """generate --logits on `text`: (its ids, logits [tokens, vocab] as a float32 tensor, the loss it
    printed), or None with the output when it failed."""
    import torch
    from safetensors.torch import load_file

    path = os.path.join(scratch, "logits.safetensors")
    code, output = run([generate, directory, "--prompt", text, "--logits", path])
    printed = re.search(r"loss ([-\d.e+]+)", output)
    if code != 0 or printed is None:
        return None, output
    tensors = load_file(path)
    return (tensors["ids"].tolist(), tensors["logits"].to(torch.float32), float(printed.group(1))), output


def shardlab_greedy(generate, directory, prompt):
    code, output = run([generate, directory, "--prompt", prompt, "--samples", "1", "--temperature", "0",
                        "--tokens", str(NEW_TOKENS), "--print-ids"])
    found = re.search(r"^ids: (.*)$", output, re.M)
    return ([int(i) for i in found.group(1).split()] if code == 0 and found else None), output


def hf_scores(model, ids):
    """The logits of `ids` in one forward, and the mean loss of each next id."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].to(torch.float32)
    loss = F.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:])).item()
    return logits, loss


def hf_greedy(model, ids, eos_id, pad_id):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos_id, pad_token_id=pad_id)
    new = out[0, len(ids):].tolist()
    # shardlab's generate stops before the stop token; Hugging Face's keeps it.
    return new[:new.index(eos_id)] if eos_id in new else new


def compare_model(check, name, generate, directory, hf_model, encode, special_ids, scratch):
    """Logits, loss and greedy ids of `hf_model` against shardlab's generate on `directory`.
    `encode`: text -> ids without special tokens, as Hugging Face's tokenizer (or bytes) gives them;
    `special_ids`: BOT, EOT (the stop token) and PAD."""
    bot, eot, pad = special_ids
    scored, output = shardlab_scores(generate, directory, HELD_OUT, scratch)
    if scored is None:
        check(f"{name}: generate --logits runs", False, output)
        return
    our_ids, our_logits, our_loss = scored
    ids = [bot] + encode(HELD_OUT)
    check(f"{name}: shardlab and Hugging Face tokenize the held-out line alike", our_ids == ids,
          f"shardlab {our_ids}\nHugging Face {ids}")
    hf_logits, hf_loss = hf_scores(hf_model, ids)
    difference = (hf_logits - our_logits).abs().max().item() if hf_logits.shape == our_logits.shape else float("inf")
    check(f"{name}: logits of the held-out line within {LOGIT_TOLERANCE} (max |difference| {difference:.2e})",
          difference <= LOGIT_TOLERANCE, f"shapes {tuple(hf_logits.shape)} {tuple(our_logits.shape)}")
    check(f"{name}: the same loss on the held-out line (shardlab {our_loss:.7f}, Hugging Face {hf_loss:.7f})",
          abs(our_loss - hf_loss) <= LOSS_TOLERANCE * abs(hf_loss))
    prompt = HELD_OUT.split("\n")[0]
    ours, output = shardlab_greedy(generate, directory, prompt)
    theirs = hf_greedy(hf_model, [bot] + encode(prompt), eot, pad)
    check(f"{name}: greedy generation gives the same {len(theirs)} ids", ours == theirs,
          f"shardlab {ours}\nHugging Face {theirs}\n{output}")


def shardlab_to_hf(check, train_llama, generate, bench_tokenizer, scratch):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    for kind, extra in (("bytes", []), ("bpe", ["--tokenizer", "bpe:512"])):
        directory = os.path.join(scratch, f"shardlab-{kind}")
        code, output = run([train_llama, *TRAIN_ARGS, *extra, "--save-model", directory])
        if code != 0:
            check(f"train_llama --save-model ({kind})", False, output)
            continue
        name = f"shardlab -> Hugging Face ({kind})"
        model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        if kind == "bytes":
            compare_model(check, name, generate, directory, model, lambda text: list(text.encode()),
                          (256, 257, 258), scratch)
            continue
        tokenizer = AutoTokenizer.from_pretrained(directory)
        check_corpus_ids(check, bench_tokenizer, directory, tokenizer, scratch)
        compare_model(check, name, generate, directory, model,
                      lambda text: tokenizer.encode(text, add_special_tokens=False),
                      [tokenizer.convert_tokens_to_ids(t) for t in ("[BOT]", "[EOT]", "[PAD]")], scratch)


def sharded_save_to_hf(check, train_llama, generate, scratch):
    """train_llama at 2 ranks, --save-model cut into files in bf16: huggingface_hub's cut of its
    tensors, and the same logits."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    name = "shardlab -> Hugging Face (2 ranks, bf16, cut into files of 20 KiB)"
    directory = os.path.join(scratch, "shardlab-sharded")
    code, output = run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", train_llama, *TRAIN_ARGS,
                        "--save-model", directory, "--save-model-max-file-size", "20K", "--save-model-dtype", "bf16"])
    if code != 0:
        check(f"{name}: train_llama --save-model", False, output)
        return
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        check(f"{name}: config.json names the weights' dtype", json.load(f)["torch_dtype"] == "bfloat16")
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with open(os.path.join(directory, "model.safetensors.index.json"), encoding="utf-8") as f:
        index = json.load(f)
    # huggingface_hub's own cut of the tensors in the model's order (transformers' modules', as
    # shardlab's; transformers 5 sorts the names before cutting, so its files cut elsewhere; either
    # reads the other's) under the same bound.
    files = sorted(set(index["weight_map"].values()))
    loaded = {key: tensor for file in files for key, tensor in load_file(os.path.join(directory, file)).items()}
    ours = {key: loaded[key] for key in model.state_dict() if key in loaded}
    split = split_torch_state_dict_into_shards(ours, max_shard_size=20 * 1024)
    check(f"{name}: huggingface_hub cuts the same tensors into the same {len(files)} files",
          split.tensor_to_filename == index["weight_map"] and len(files) > 3 and
          split.metadata["total_size"] == index["metadata"]["total_size"],
          f"shardlab {index}\nhuggingface_hub {split.tensor_to_filename} {split.metadata}")
    expected = {key: tensor.to(torch.bfloat16) for key, tensor in model.state_dict().items()}
    different = [key for key in sorted(set(loaded) | set(expected))
                 if key not in loaded or key not in expected or not torch.equal(loaded[key], expected[key])]
    check(f"{name}: the files hold what from_pretrained loads, each tensor once", not different, f"{different}")
    compare_model(check, name, generate, directory, model, lambda text: list(text.encode()), (256, 257, 258),
                  scratch)


def check_corpus_ids(check, bench_tokenizer, directory, tokenizer, scratch):
    """Every document of the corpus: Hugging Face's ids are shardlab's, and decode back to it."""
    documents_path = os.path.join(scratch, "documents.json")
    ids_path = os.path.join(scratch, "ids.json")
    code, output = run([bench_tokenizer, "--tokenizer", os.path.join(directory, "tokenizer.json"), "--passes", "1",
                        "--save-documents", documents_path, "--save-ids", ids_path])
    if code != 0:
        check("bench_tokenizer --save-ids", False, output)
        return
    with open(documents_path, encoding="utf-8") as f:
        documents = json.load(f)
    with open(ids_path, encoding="utf-8") as f:
        ours = json.load(f)
    # A few fortunes are Latin-1, not UTF-8: the documents file holds them with U+FFFD, so their
    # text is not what shardlab encoded; they are left out.
    valid = [i for i, document in enumerate(documents) if "\ufffd" not in document]
    theirs = tokenizer([documents[i] for i in valid], add_special_tokens=False)["input_ids"]
    mismatched = [i for i, ids in zip(valid, theirs) if ids != ours[i]]
    check(f"AutoTokenizer.from_pretrained: the {len(valid)} UTF-8 documents of the corpus ({len(documents)} in all) "
          f"encode to shardlab's ids", not mismatched and len(valid) > 1000,
          f"{len(mismatched)} differ, the first: {documents[mismatched[0]][:200]!r}" if mismatched else "")
    undecoded = [i for i, ids in zip(valid, theirs) if tokenizer.decode(ids) != documents[i]]
    check("AutoTokenizer: every document's ids decode back to it", not undecoded,
          f"{len(undecoded)} differ" if undecoded else "")


def hf_tokenizer(documents, directory):
    """A byte-level BPE tokenizer trained by tokenizers' own BpeTrainer, saved as Hugging Face saves
    one (tokenizer.json and its configuration)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(documents, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                      pad_token="<pad>")
    wrapped.save_pretrained(directory)
    return wrapped


def hf_to_shardlab(check, train_llama, generate, bench_tokenizer, scratch):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    documents_path = os.path.join(scratch, "corpus.json")
    code, output = run([bench_tokenizer, "--vocab", "300", "--passes", "1", "--save-documents", documents_path])
    if code != 0:
        check("bench_tokenizer --save-documents", False, output)
        return
    with open(documents_path, encoding="utf-8") as f:
        documents = [d for d in json.load(f) if "\ufffd" not in d]
    for tied in (False, True):
        # The tied model is shaped like Llama-3.2-1B: rope_theta 500000 and Llama 3's rope scaling (with a
        # short original context, so that the head dim of 16 has pairs kept, divided and blended).
        rope = dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE) if tied else dict(rope_theta=10000.0)
        name = (f"Hugging Face -> shardlab ({'tied' if tied else 'untied'} embeddings, GQA 4/2, bf16, sharded"
                f"{', Llama 3 rope scaling' if tied else ''})")
        directory = os.path.join(scratch, f"hf-{'tied' if tied else 'untied'}")
        tokenizer = hf_tokenizer(documents, directory)
        bot, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             rms_norm_eps=1e-5, **rope, tie_word_embeddings=tied,
                             initializer_range=0.2, bos_token_id=bot, eos_token_id=eos, pad_token_id=pad)
        torch.manual_seed(3 + tied)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory, max_shard_size="100KB")
        files = sorted(os.listdir(directory))
        check(f"{name}: save_pretrained wrote an index and several shards",
              "model.safetensors.index.json" in files and
              sum(f.startswith("model-") and f.endswith(".safetensors") for f in files) > 1, f"{files}")
        # The reference: the saved bf16 weights, computed in f32 as shardlab computes them.
        model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        compare_model(check, name, generate, directory, model,
                      lambda text: tokenizer.encode(text, add_special_tokens=False), (bot, eos, pad), scratch)
        code, output = run([train_llama, "--init-from", directory, "--seq", "64", "--global-batch", "8",
                            "--limit-documents", "100", "--steps", "2", "--threads", "2"])
        check(f"{name}: train_llama --init-from trains from it", code == 0 and "median step" in output, output)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def main(train_llama, generate, bench_tokenizer):
    in_peers_environment()
    if not os.path.isdir(FORTUNES):
        skip(f"{FORTUNES} is missing (Debian package fortunes)")
    import tokenizers
    import torch
    import transformers

    torch.set_num_threads(2)
    print(f"hf_interop: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"tokenizers {tokenizers.__version__}")
    check = Checks()
    with tempfile.TemporaryDirectory(prefix="hf_interop.") as scratch:
        shardlab_to_hf(check, train_llama, generate, bench_tokenizer, scratch)
        sharded_save_to_hf(check, train_llama, generate, scratch)
        hf_to_shardlab(check, train_llama, generate, bench_tokenizer, scratch)
    return check.summary()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: hf_interop_tests.py <train_llama> <generate> <bench_tokenizer>")
    sys.exit(main(*(os.path.abspath(p) for p in sys.argv[1:])))
