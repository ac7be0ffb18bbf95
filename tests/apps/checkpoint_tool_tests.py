#!/usr/bin/env python3
"""tests/apps/checkpoint_tool_tests.py: runs apps/checkpoint on the sharded checkpoint of a
train_llama run at 4 ranks (Debian's fortunes) and checks what its users rely on:

- info prints the world size, sharding, files with their sizes, tensors with shapes and chunk
  counts, the optimizer step and hyper-parameters, the run's extra JSON and the total bytes;
- consolidate writes, in one process, the very bytes of the run's --save-model model.safetensors
  (which every rank wrote its own shards into); --optimizer adds the slots after the parameters;
- convert writes a Hugging Face directory equal to --save-model's, which apps/generate samples from,
  with the run's tokenizer.json when it trained with --tokenizer bpe:VOCAB;
- a missing directory, a directory that is no checkpoint, a truncated rank file, a flipped byte
  (a CRC error naming the file), a checkpoint train_llama did not write and a bad command line
  each exit 1 with one clear message on stderr, and nothing is written.

Usage: checkpoint_tool_tests.py <mpirun> <train_llama> <checkpoint> <generate>. Without
/usr/share/games/fortunes (scripts/setup installs it) the cases that need a checkpoint are
skipped. Prints one line per check, then "checkpoint_tool: N passed, N failed, N skipped".
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

from jobs import Checks, LIMIT_S, run_command, run_job

DATA_DIR = "/usr/share/games/fortunes"
STEPS = 4
RANKS = 4
TRAIN_ARGS = ["--config", "tiny", "--seq", "48", "--global-batch", "12", "--limit-documents", "240",
              "--steps", str(STEPS), "--lr", "3e-3", "--threads", "1"]
NEEDS_CHECKPOINT = 16  # the checks skipped without the corpus


def run_tool(tool, args):
    """(exit status, stdout, stderr) of `checkpoint args`."""
    try:
        done = subprocess.run([tool] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=LIMIT_S,
                              text=True, errors="replace")
        return done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired:
        return None, "", f"(killed after {LIMIT_S} s)"


def read_bytes(path):
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def safetensors_names(path):
    """The tensor names of a safetensors file, in the order of their data."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda name: header[name]["data_offsets"][0])


def main(mpirun, train_llama, tool, generate):
    check = Checks()

    skipped = 0
    with tempfile.TemporaryDirectory(prefix="checkpoint_tool_tests.") as scratch:
        check_usage_errors(tool, scratch, check)
        if not os.path.isdir(DATA_DIR):
            skipped = NEEDS_CHECKPOINT
            print(f"skipped: {skipped} cases that need a checkpoint, {DATA_DIR} is missing "
                  "(scripts/setup installs fortunes)")
        else:
            checkpoint, saved = train(mpirun, train_llama, scratch, check)
            check_info(tool, checkpoint, check)
            check_consolidate(tool, checkpoint, saved, scratch, check)
            check_convert(tool, generate, checkpoint, saved, scratch, check)
            check_convert(tool, generate, *train(mpirun, train_llama, scratch, check, 2, "bpe:512"), scratch, check)
            check_refusals(tool, checkpoint, scratch, check)

    return check.summary("checkpoint_tool", skipped)


def refused(check, name, outcome, message):
    """Exit 1, nothing on stdout, `message` once on stderr."""
    code, out, err = outcome
    check(f"{name}: exit 1, explained once on stderr",
          code == 1 and out == "" and err.count(message) == 1, f"exit {code}, expected once: {message}\n{out}{err}")


def check_usage_errors(tool, scratch, check):
    refused(check, "no subcommand", run_tool(tool, []),
            "checkpoint: a subcommand is required: info, consolidate or convert")
    outcome = run_tool(tool, ["frobnicate", scratch])
    refused(check, "an unknown subcommand", outcome, "frobnicate")
    check("the unknown subcommand is named as unexpected", "arguments were not expected" in outcome[2], outcome[2])
    refused(check, "consolidate without its output", run_tool(tool, ["consolidate", scratch]), "out is required")
    missing = os.path.join(scratch, "missing")
    refused(check, "info of a missing directory", run_tool(tool, ["info", missing]),
            f"checkpoint: checkpoint_info: '{missing}': metadata.json is missing (No such file or directory): "
            "not a complete checkpoint")
    code, out, _ = run_tool(tool, ["--help"])
    check("--help lists the subcommands", code == 0 and all(s in out for s in ("info", "consolidate", "convert")),
          f"exit {code}\n{out}")


def train(mpirun, train_llama, scratch, check, ranks=RANKS, tokenizer="bytes"):
    directory = os.path.join(scratch, f"checkpoints_{tokenizer}")
    saved = os.path.join(scratch, f"saved_{tokenizer}")
    code, output = run_job(mpirun, train_llama, ranks, TRAIN_ARGS + ["--tokenizer", tokenizer, "--checkpoint-dir",
                                                                     directory, "--save-model", saved])
    checkpoint = os.path.join(directory, f"step-{STEPS:08d}")
    check(f"train_llama --tokenizer {tokenizer} at np {ranks} writes a checkpoint and --save-model",
          code == 0 and os.path.isfile(os.path.join(checkpoint, "metadata.json"))
          and os.path.isfile(os.path.join(saved, "model.safetensors")), f"exit {code}\n{output}")
    return checkpoint, saved


def check_info(tool, checkpoint, check):
    code, out, err = run_tool(tool, ["info", checkpoint])
    sizes = {name: os.path.getsize(os.path.join(checkpoint, name))
             for name in os.listdir(checkpoint) if name.endswith(".bin")}
    with open(os.path.join(checkpoint, "metadata.json"), encoding="utf-8") as f:
        tensors = json.load(f)["tensors"]
    expected = [f"saved over {RANKS} ranks, sharding full", "format: shardlab-sharded-checkpoint version 1",
                f"optimizer: step {STEPS}", "param_groups.0.lr = ", '"app":"train_llama"',
                f"total: {sum(sizes.values())} bytes in {RANKS} files", "model.embed_tokens.weight  [259, 40]  ",
                "optim.lm_head.weight.exp_avg_sq  [259, 40]  "]
    expected += [f"{name}  {size} bytes" for name, size in sizes.items()]
    for name, tensor in tensors.items():
        count = len(tensor["chunks"])
        shape = "[" + ", ".join(str(size) for size in tensor["shape"]) + "]"
        expected.append(f"  {name}  {shape}  {count} chunk{'' if count == 1 else 's'}\n")
    missing = [line for line in expected if line not in out]
    check("info prints the ranks, files, tensors, optimizer, extra and total",
          code == 0 and len(sizes) == RANKS and not missing and err == "", f"exit {code}, missing {missing}\n{out}{err}")


def check_consolidate(tool, checkpoint, saved, scratch, check):
    out_path = os.path.join(scratch, "consolidated.safetensors")
    code, out, err = run_tool(tool, ["consolidate", checkpoint, out_path])
    reference = read_bytes(os.path.join(saved, "model.safetensors"))
    check("consolidate equals the run's --save-model model.safetensors byte for byte",
          code == 0 and reference is not None and read_bytes(out_path) == reference, f"exit {code}\n{out}{err}")
    check("consolidate says what it wrote",
          out == f"checkpoint: wrote {out_path}: {os.path.getsize(out_path) if os.path.isfile(out_path) else -1} "
                 f"bytes, the parameters of {checkpoint}\n", out)

    everything = os.path.join(scratch, "with_optimizer.safetensors")
    code, out, err = run_tool(tool, ["consolidate", checkpoint, everything, "--optimizer"])
    names = safetensors_names(everything) if code == 0 else []
    parameters = safetensors_names(out_path) if os.path.isfile(out_path) else []
    slots = [f"optim.{name}.{slot}" for name in parameters for slot in ("exp_avg", "exp_avg_sq")]
    check("consolidate --optimizer writes the parameters, then every parameter's two AdamW slots",
          code == 0 and parameters and names == parameters + slots, f"exit {code}\n{names}\n{out}{err}")


def check_convert(tool, generate, checkpoint, saved, scratch, check):
    converted = os.path.join(scratch, "converted_" + os.path.basename(saved))
    code, out, err = run_tool(tool, ["convert", checkpoint, converted])
    # A BPE run's directory holds its tokenizer.json; a bytes run's needs none.
    expected = sorted(os.listdir(saved)) if os.path.isdir(saved) else []
    same = all(read_bytes(os.path.join(converted, name)) == read_bytes(os.path.join(saved, name)) for name in expected)
    files = sorted(os.listdir(converted)) if os.path.isdir(converted) else []
    check(f"convert writes {', '.join(expected)} equal to --save-model's",
          code == 0 and files == expected and "config.json" in files and same, f"exit {code}, files {files}\n{out}{err}")
    written = "model.safetensors, config.json" + (", tokenizer.json" if "tokenizer.json" in expected else "")
    check("convert says what it wrote", out == f"checkpoint: wrote {converted}: {written}, from {checkpoint}\n", out)
    code, output = run_command([generate, converted, "--prompt", "Q:", "--samples", "2", "--tokens", "16"])
    check(f"generate samples twice from {os.path.basename(converted)}", code == 0 and output.count("--- sample") == 2,
          f"exit {code}\n{output}")


def corrupted(checkpoint, scratch, name, corrupt):
    """A copy of the checkpoint with `corrupt(copy)` applied."""
    copy = os.path.join(scratch, name)
    shutil.copytree(checkpoint, copy)
    corrupt(copy)
    return copy


def check_refusals(tool, checkpoint, scratch, check):
    second = "rank-00001-of-00004.bin"

    def truncate(copy):
        with open(os.path.join(copy, second), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(copy, second)) - 4)

    def flip(copy):
        with open(os.path.join(copy, second), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0x01]))

    def not_train_llama(copy):
        path = os.path.join(copy, "metadata.json")
        with open(path, encoding="utf-8") as f:
            metadata = json.load(f)
        metadata["extra"] = {"epoch": 3}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(metadata, f)

    def tokenizer_not_text(copy):
        path = os.path.join(copy, "metadata.json")
        with open(path, encoding="utf-8") as f:
            metadata = json.load(f)
        metadata["extra"]["tokenizer_json"] = {"model": {}}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(metadata, f)

    out_path = os.path.join(scratch, "refused.safetensors")
    truncated = corrupted(checkpoint, scratch, "truncated", truncate)
    refused(check, "consolidate of a truncated rank file", run_tool(tool, ["consolidate", truncated, out_path]),
            f"file '{second}' (tensor ")
    flipped = corrupted(checkpoint, scratch, "flipped", flip)
    outcome = run_tool(tool, ["consolidate", flipped, out_path])
    refused(check, "consolidate of a flipped byte", outcome, f"file '{second}' (tensor ")
    check("the flipped byte is a CRC32 error", "fails its CRC32 check" in outcome[2], outcome[2])
    foreign = corrupted(checkpoint, scratch, "foreign", not_train_llama)
    refused(check, "convert of a checkpoint train_llama did not write",
            run_tool(tool, ["convert", foreign, os.path.join(scratch, "refused_dir")]),
            f"checkpoint: '{foreign}' is not a train_llama checkpoint: its metadata.json's extra has app missing")
    broken = corrupted(checkpoint, scratch, "tokenizer_not_text", tokenizer_not_text)
    refused(check, "convert of a checkpoint whose tokenizer.json is not text",
            run_tool(tool, ["convert", broken, os.path.join(scratch, "refused_tokenizer")]),
            f"checkpoint: {broken}: metadata.json: extra.tokenizer_json is a JSON object, expected the text of a "
            "tokenizer.json")
    saved_dir = os.path.join(scratch, "saved_bytes")
    refused(check, "info of a directory that is no checkpoint", run_tool(tool, ["info", saved_dir]),
            f"checkpoint_info: '{saved_dir}': metadata.json is missing")
    left = [name for name in os.listdir(scratch) if name.startswith("refused")]
    check("the refusals wrote nothing", left == [], f"left: {left}")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: checkpoint_tool_tests.py <mpirun> <train_llama> <checkpoint> <generate>")
    sys.exit(main(*sys.argv[1:]))
