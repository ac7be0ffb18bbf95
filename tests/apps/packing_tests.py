#!/usr/bin/env python3
"""tests/apps/packing_tests.py: train_llama --pack, the documents in one stream cut into sequences.

Usage: packing_tests.py <mpirun> <train_llama>

On a corpus written here, with byte tokens: the number of packed sequences is the stream's, counted here
from the documents ([BOT] + bytes + [EOT] each, a window every --seq ids, the last partial one dropped),
every target a real token (the validation set's too); 1 and 2 ranks train the same losses within 1e-5;
a resume must pack as the run it continues did;
a corpus too short for one sequence is refused, naming the counts. --block-causal: its losses differ
from --pack's where sequences hold several documents, and equal them (within 1e-6) on a corpus whose
documents each fill a sequence exactly; 2 and 3 ranks, --tp 2 and --micro-batches 2 train the 1-rank
losses (the documents follow the rows), --bitwise the same bits at 1 and 2 ranks, the validation set
attends by documents too, a resume must keep the mask, and without --pack it is refused by name. Prints one line per check and
"packing_app: N passed, N failed, N skipped"."""
import os
import re
import sys
import tempfile

from jobs import Checks, read_metrics, run_job

TOLERANCE = 1e-5
SEQ = 16
BASE = ["--config", "tiny", "--seq", str(SEQ), "--threads", "1", "--separator", "%", "--lr", "3e-3"]


def write_corpus(path, count):
    """`count` documents of different lengths, separated by "%" lines; returns their texts."""
    words = ["shard", "gather", "reduce", "scatter", "rank", "step", "loss", "unit", "prefetch", "bucket"]
    documents = [" ".join(words[(i * 3 + j * j) % len(words)] for j in range(1 + (i * 5) % 9))
                 for i in range(count)]
    with open(path, "w", encoding="utf-8") as out:
        out.write("".join(f"{d}\n%\n" for d in documents))
    return documents


def packed_sequences(documents):
    ids = sum(len(d.encode()) + 2 for d in documents)  # [BOT] + bytes + [EOT]
    return (ids - 1) // SEQ


def losses(records):
    return {r["step"]: r["loss"] for r in records if r.get("rank") == 0 and "loss" in r}


def train(mpirun, program, scratch, name, ranks, args):
    metrics = os.path.join(scratch, f"{name}.jsonl")
    code, output = run_job(mpirun, program, ranks, BASE + args + ["--metrics", metrics])
    return code, output, read_metrics(metrics) if code == 0 else []


def main(mpirun, program):
    check = Checks()
    with tempfile.TemporaryDirectory(prefix="packing_tests.") as scratch:
        corpus = os.path.join(scratch, "corpus.txt")
        documents = write_corpus(corpus, 50)
        args = ["--data", corpus, "--global-batch", "8", "--steps", "4", "--pack"]
        code, output, one = train(mpirun, program, scratch, "np1", 1, args)
        expected = packed_sequences(documents)
        check(f"--pack: 50 documents make the {expected} sequences of their stream",
              code == 0 and f"train_llama: 50 documents, {expected} packed sequences of {SEQ} tokens" in output,
              output[-2000:])
        two_code, two_output, two = train(mpirun, program, scratch, "np2", 2, args)
        check(f"--pack at 2 ranks trains the losses of 1 rank within {TOLERANCE}",
              code == 0 and two_code == 0 and len(losses(one)) == 4 and losses(one).keys() == losses(two).keys()
              and all(abs(a - losses(two)[s]) <= TOLERANCE * abs(a) for s, a in losses(one).items()),
              f"{two_output[-2000:]}\n{losses(one)}\n{losses(two)}")
        code, output, _ = train(mpirun, program, scratch, "unpacked", 1, args[:-1])
        check("without --pack: a sequence per document (clipped: the packed stream holds every id)",
              code == 0 and "train_llama: 50 documents, 50 sequences" in output and expected != 50, output[-2000:])
        code, output, _ = train(mpirun, program, scratch, "validation", 1, args + ["--validation-split", "20"])
        held = re.search(r"validation set of (\d+) sequences \((\d+) target tokens", output)
        check("--pack with --validation-split: the validation set packed too, every target a token",
              code == 0 and held is not None and int(held.group(2)) == int(held.group(1)) * SEQ, output[-2000:])
        check_resume(mpirun, program, scratch, check, args)
        check_block_causal(mpirun, program, scratch, check, args, one)
        short = os.path.join(scratch, "short.txt")
        write_corpus(short, 1)
        code, output = run_job(mpirun, program, 1, BASE + ["--data", short, "--steps", "1", "--global-batch", "1",
                                                          "--pack"])
        check("a corpus too short for one packed sequence: refused, naming the counts",
              code not in (0, None) and "PretrainingDataset: the 1 documents pack into 7 ids, fewer than one "
              f"sequence of {SEQ} and its next id" in output, output[-2000:])
    return check.summary("packing_app", 0)


def check_resume(mpirun, program, scratch, check, args):
    checkpoints = os.path.join(scratch, "checkpoints")
    code, output, _ = train(mpirun, program, scratch, "saved", 2, args + ["--checkpoint-dir", checkpoints])
    resumed_code, resumed, _ = train(mpirun, program, scratch, "unpacked-resume", 2,
                                     args[:-1] + ["--steps", "6", "--checkpoint-dir", checkpoints, "--resume"])
    check("--resume without --pack from a packed run: refused, naming it",
          code == 0 and resumed_code not in (0, None) and "--resume: pack was true when" in resumed
          and "now none" in resumed, f"{output[-1500:]}\n{resumed[-1500:]}")
    resumed_code, resumed, _ = train(mpirun, program, scratch, "packed-resume", 2,
                                     args + ["--steps", "6", "--checkpoint-dir", checkpoints, "--resume"])
    check("--resume with --pack continues", resumed_code == 0 and "resumed from" in resumed, resumed[-1500:])


def same_losses(first, second, tolerance):
    return (len(first) > 0 and first.keys() == second.keys()
            and all(abs(a - second[s]) <= tolerance * abs(a) for s, a in first.items()))


def check_block_causal(mpirun, program, scratch, check, args, packed):
    blocked_args = args + ["--block-causal"]
    code, output, one = train(mpirun, program, scratch, "block-causal", 1, blocked_args)
    check("--block-causal: the log says so, and the losses differ from --pack's (sequences hold several "
          "documents)",
          code == 0 and "packed block-causal sequences" in output and losses(one).keys() == losses(packed).keys()
          and all(abs(a - losses(packed)[s]) > 1e-4 for s, a in losses(one).items()),
          f"{output[-1500:]}\n{losses(one)}\n{losses(packed)}")
    for name, ranks, extra in (("np2", 2, []), ("np3", 3, []), ("tp2", 2, ["--tp", "2"]),
                               ("micro", 1, ["--micro-batches", "2"])):
        code, output, other = train(mpirun, program, scratch, f"block-causal-{name}", ranks, blocked_args + extra)
        check(f"--block-causal at {ranks} rank(s) {' '.join(extra)}: the 1-rank losses within {TOLERANCE}",
              code == 0 and same_losses(losses(one), losses(other), TOLERANCE),
              f"{output[-1500:]}\n{losses(one)}\n{losses(other)}")
    bitwise = [train(mpirun, program, scratch, f"block-causal-bitwise-{ranks}", ranks, blocked_args + ["--bitwise"])
               for ranks in (1, 2)]
    check("--block-causal --bitwise: the same bits at 1 and 2 ranks",
          all(code == 0 for code, _, _ in bitwise) and same_losses(losses(bitwise[0][2]), losses(bitwise[1][2]), 0),
          "\n".join(output[-1000:] for _, output, _ in bitwise))
    validated = [train(mpirun, program, scratch, f"validation-{name}", 1,
                       args + flags + ["--validation-split", "20", "--steps", "1", "--lr", "0"])
                 for name, flags in (("packed", []), ("blocked", ["--block-causal"]))]
    # The same model at --lr 0, the same held-out ids: any difference is the mask's.
    found = [[r["validation_loss"] for r in records if "validation_loss" in r] for _, _, records in validated]
    check("--block-causal's validation loss attends by documents too (not --pack's)",
          all(code == 0 for code, _, _ in validated) and all(found)
          and abs(found[0][0] - found[1][0]) > 1e-9,
          "\n".join(output[-1000:] for _, output, _ in validated) + f"\n{found}")
    check_aligned_documents(mpirun, program, scratch, check)
    checkpoints = os.path.join(scratch, "block-causal-checkpoints")
    code, output, _ = train(mpirun, program, scratch, "block-causal-saved", 1,
                            blocked_args + ["--checkpoint-dir", checkpoints])
    resumed_code, resumed, _ = train(mpirun, program, scratch, "block-causal-dropped", 1,
                                     args + ["--steps", "6", "--checkpoint-dir", checkpoints, "--resume"])
    check("--resume without --block-causal from a block-causal run: refused, naming it",
          code == 0 and resumed_code not in (0, None) and "--resume: block_causal was true when" in resumed
          and "now none" in resumed, f"{output[-1500:]}\n{resumed[-1500:]}")
    code, output = run_job(mpirun, program, 1, BASE + args[:-1] + ["--block-causal"])
    check("--block-causal without --pack: refused by name",
          code not in (0, None) and "--block-causal requires --pack" in output, output[-1500:])


def check_aligned_documents(mpirun, program, scratch, check):
    """Documents of SEQ ids each ([BOT] + SEQ - 2 bytes + [EOT]): every sequence's inputs are one document,
    which block-causal attention leaves whole."""
    corpus = os.path.join(scratch, "aligned.txt")
    with open(corpus, "w", encoding="utf-8") as out:
        out.write("".join(f"{chr(97 + i % 26) * (SEQ - 2)}\n%\n" for i in range(40)))
    runs = [train(mpirun, program, scratch, f"aligned-{len(flags)}", 1,
                  ["--data", corpus, "--global-batch", "8", "--steps", "3", "--pack"] + flags)
            for flags in ([], ["--block-causal"])]
    check("--block-causal on documents that each fill a sequence: --pack's losses within 1e-6",
          all(code == 0 for code, _, _ in runs) and same_losses(losses(runs[0][2]), losses(runs[1][2]), 1e-6),
          "\n".join(f"{output[-1000:]}\n{losses(records)}" for _, output, records in runs))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
