#!/usr/bin/env python3
"""tests/apps/validation_tests.py: train_llama's validation loss (--validation-split, --validation-data,
--eval-every).

Usage: validation_tests.py <mpirun> <train_llama>

On a corpus written here (60 documents), the tiny Llama:
- with the training file as its own validation set, one step over all of it at --lr 0 (no update): the
  validation loss after step 1 is the step's training loss (another path: no-grad forwards of other
  sizes, summed on the host), within 1e-6 relative;
- the same validation losses at 1, 2 and 3 ranks, under --tp 2 and in --micro-batches 2, within 1e-6;
  with --bitwise the same bits at 1, 2 and 3 ranks;
- --validation-split 10 holds out 6 of the 60 documents (54 train), the same ones at any world size;
- --eval-every 2 over 5 steps validates after steps 2, 4 and 5, and the summary holds the last;
- validating does not change training: the losses, and the measured training peak, of a run without it;
- a run resumed from a checkpoint validates as the run without the stop; a resume with another split is
  refused, naming it;
- --eval-only of the saved model (--init-from) and of the last checkpoint (--resume) gives the trained
  run's final validation loss and takes no step;
- the refusals of bad input name it.
Prints one line per check and "validation_app: N passed, N failed, N skipped"."""
import math
import os
import shutil
import sys
import tempfile

from jobs import Checks, read_metrics, run_job

TOLERANCE = 1e-6
DOCUMENTS = 60
BASE = ["--config", "tiny", "--seq", "32", "--threads", "1", "--separator", "%"]


def write_corpus(path):
    """DOCUMENTS documents of a few words each, separated by "%" lines, different lengths (padding)."""
    words = ["shard", "gather", "reduce", "scatter", "rank", "step", "loss", "unit", "prefetch", "bucket"]
    with open(path, "w", encoding="utf-8") as out:
        for i in range(DOCUMENTS):
            length = 3 + (i * 7) % 11
            out.write(" ".join(words[(i * 3 + j * j) % len(words)] for j in range(length)) + "\n%\n")


def train(mpirun, program, scratch, name, ranks, args):
    """(exit status, output, metrics records)."""
    metrics = os.path.join(scratch, f"{name}.jsonl")
    code, output = run_job(mpirun, program, ranks, BASE + args + ["--metrics", metrics])
    return code, output, read_metrics(metrics) if code == 0 else []


def validations(records):
    """{step: validation loss} of rank 0."""
    return {r["step"]: r["validation_loss"] for r in records if r.get("rank") == 0 and "validation_tokens" in r}


def losses(records):
    return {r["step"]: r["loss"] for r in records if r.get("rank") == 0 and "loss" in r}


def summary(records):
    return next((r for r in records if r.get("rank") == 0 and "median_step_seconds" in r), {})


def close(a, b, tolerance=TOLERANCE):
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


def all_close(reference, other):
    return bool(reference) and reference.keys() == other.keys() and all(
        close(reference[s], other[s]) for s in reference)


def main(mpirun, program):
    check = Checks()
    with tempfile.TemporaryDirectory(prefix="validation_tests.") as scratch:
        corpus = os.path.join(scratch, "corpus.txt")
        write_corpus(corpus)
        check_against_training_loss(mpirun, program, scratch, corpus, check)
        check_world_sizes(mpirun, program, scratch, corpus, check)
        check_split_and_schedule(mpirun, program, scratch, corpus, check)
        check_resume(mpirun, program, scratch, corpus, check)
        check_eval_only(mpirun, program, scratch, corpus, check)
        check_errors(mpirun, program, scratch, corpus, check)
    return check.summary("validation_app", 0)


def check_against_training_loss(mpirun, program, scratch, corpus, check):
    # One step over all 60 sequences at lr 0: the parameters after it are those it computed its loss with.
    args = ["--data", corpus, "--validation-data", corpus, "--global-batch", str(DOCUMENTS), "--steps", "1",
            "--lr", "0"]
    code, output, records = train(mpirun, program, scratch, "same-set", 2, args)
    trained, validated = losses(records).get(1), validations(records).get(1)
    check("the training file as validation set, one step at --lr 0: the validation loss is the step's "
          f"training loss within {TOLERANCE} ({validated} against {trained})",
          code == 0 and trained is not None and validated is not None and close(trained, validated),
          output[-2000:])
    record = next((r for r in records if r.get("rank") == 0 and "validation_perplexity" in r), {})
    check("the perplexity is exp of the loss, over the set's non-padding targets",
          validated is not None and close(record.get("validation_perplexity", 0), math.exp(validated), 1e-12)
          and record.get("validation_tokens", 0) > 0, str(record))


def check_world_sizes(mpirun, program, scratch, corpus, check):
    args = ["--data", corpus, "--validation-split", "20", "--global-batch", "12", "--steps", "4", "--eval-every",
            "2", "--lr", "3e-3"]
    runs = {}
    for name, ranks, extra in [("np 1", 1, []), ("np 2", 2, []), ("np 3", 3, []), ("np 2 --tp 2", 2, ["--tp", "2"]),
                               ("np 2 --micro-batches 2", 2, ["--micro-batches", "2"]),
                               ("np 2 --sharding grad_op", 2, ["--sharding", "grad_op"])]:
        code, output, records = train(mpirun, program, scratch, f"world-{ranks}-{len(extra)}-{name[-3:]}", ranks,
                                      args + extra)
        runs[name] = (code, output, validations(records))
    reference = runs["np 1"][2]
    check("np 1 validates after steps 2 and 4", sorted(reference) == [2, 4], runs["np 1"][1][-2000:])
    for name, (code, output, found) in runs.items():
        if name == "np 1":
            continue
        check(f"{name}: the validation losses of np 1 within {TOLERANCE}",
              code == 0 and all_close(reference, found), f"{output[-2000:]}\n{found}\nnp 1: {reference}")
    bitwise = ["--data", corpus, "--validation-split", "20", "--global-batch", "12", "--steps", "2", "--bitwise",
               "--chunk", "3"]
    exact = {}
    for ranks in (1, 2, 3):
        code, output, records = train(mpirun, program, scratch, f"bitwise-{ranks}", ranks, bitwise)
        exact[ranks] = (code, output, validations(records))
    check("--bitwise: the validation loss at 1, 2 and 3 ranks is the same bits",
          all(code == 0 for code, _, _ in exact.values()) and len(exact[1][2]) == 1
          and exact[1][2] == exact[2][2] == exact[3][2],
          "\n".join(f"np {r}: {v[2]}\n{v[1][-1500:]}" for r, v in exact.items()))


def check_split_and_schedule(mpirun, program, scratch, corpus, check):
    base = ["--data", corpus, "--validation-split", "10", "--global-batch", "6", "--steps", "5", "--lr", "3e-3"]
    code, output, records = train(mpirun, program, scratch, "split", 2, base + ["--eval-every", "2", "--explain"])
    check("--validation-split 10: 54 documents train, 6 validate",
          code == 0 and "train_llama: 54 documents, 54 sequences" in output
          and "validation set of 6 sequences" in output, output[-2000:])
    found = validations(records)
    check("--eval-every 2 over 5 steps: after steps 2, 4 and 5, the summary holding the last",
          sorted(found) == [2, 4, 5] and summary(records).get("validation_loss") == found.get(5), str(found))
    plain_code, plain_output, plain = train(mpirun, program, scratch, "split-plain", 2, base + ["--explain"])
    check("validating changes no training loss (the same run without --eval-every: bit for bit)",
          code == 0 and plain_code == 0 and losses(records) == losses(plain) and len(losses(plain)) == 5,
          plain_output[-2000:])
    peak = summary(records).get("train_peak_memory_bytes")
    check(f"validating leaves the measured training peak as it is ({peak} B)",
          peak is not None and peak == summary(plain).get("train_peak_memory_bytes"),
          f"{peak} against {summary(plain).get('train_peak_memory_bytes')}")
    one_code, one_output, one = train(mpirun, program, scratch, "split-np1", 1, base + ["--eval-every", "2"])
    check("the split is the same at 1 rank: the same validation losses within 1e-6",
          one_code == 0 and all_close(found, validations(one)), one_output[-2000:])


def check_resume(mpirun, program, scratch, corpus, check):
    saved, resumed_dir = os.path.join(scratch, "saved"), os.path.join(scratch, "resumed")
    base = ["--data", corpus, "--validation-split", "10", "--global-batch", "6", "--steps", "4", "--lr", "3e-3",
            "--eval-every", "2"]
    whole_code, whole_output, whole = train(mpirun, program, scratch, "whole", 2,
                                            base + ["--checkpoint-dir", saved, "--checkpoint-every", "2"])
    # The run stopped after step 2: its checkpoint of step 2 alone.
    shutil.copytree(os.path.join(saved, "step-00000002"), os.path.join(resumed_dir, "step-00000002"))
    code, output, resumed = train(mpirun, program, scratch, "resumed", 2,
                                  base + ["--checkpoint-dir", resumed_dir, "--resume"])
    check("a run resumed at step 2 validates after step 4 as the run without the stop (within 1e-6)",
          whole_code == 0 and code == 0 and sorted(validations(resumed)) == [4]
          and close(validations(resumed)[4], validations(whole).get(4, 0)),
          f"{whole_output[-1500:]}\n{output[-1500:]}\n{validations(resumed)} against {validations(whole)}")
    other = [arg if arg != "10" else "20" for arg in base]
    code, output, _ = train(mpirun, program, scratch, "other-split", 2, other + ["--checkpoint-dir", saved,
                                                                              "--resume"])
    check("--resume with another --validation-split: refused, naming it",
          code not in (0, None) and "--resume: validation_split was 10.0 when" in output and "now 20.0" in output,
          output[-2000:])


def check_eval_only(mpirun, program, scratch, corpus, check):
    saved, model = os.path.join(scratch, "eval-saved"), os.path.join(scratch, "eval-model")
    split = ["--data", corpus, "--validation-split", "10", "--global-batch", "6"]
    code, output, trained = train(mpirun, program, scratch, "eval-trained", 2,
                                  split + ["--steps", "4", "--lr", "3e-3", "--checkpoint-dir", saved,
                                           "--save-model", model])
    final = validations(trained).get(4)
    runs = [("--init-from the saved model at np 1", 1, ["--init-from", model], 0),
            ("--resume of the last checkpoint at np 2", 2, BASE[:2] + ["--checkpoint-dir", saved, "--resume"], 4)]
    for name, ranks, flags, step in runs:
        metrics = os.path.join(scratch, f"eval-only-{ranks}.jsonl")
        # --init-from brings its own config: the preset's --config is left out.
        args = [a for a in BASE if a not in ("--config", "tiny")] + split + flags + ["--eval-only", "--metrics",
                                                                                    metrics]
        run_code, run_output = run_job(mpirun, program, ranks, args)
        found = validations(read_metrics(metrics))
        check(f"--eval-only, {name}: the trained run's final validation loss within {TOLERANCE}, no step",
              code == 0 and run_code == 0 and final is not None and list(found) == [step]
              and close(found[step], final) and not losses(read_metrics(metrics)),
              f"{output[-1000:]}\n{run_output[-2000:]}\n{found} against {final}")


def check_errors(mpirun, program, scratch, corpus, check):
    args = ["--data", corpus, "--global-batch", "6", "--steps", "1"]
    missing = os.path.join(scratch, "no-such-file")
    cases = [
        (["--eval-every", "2"], "--eval-every 2: there is no validation set (--validation-split or --validation-data)"),
        (["--validation-split", "0"], "--validation-split: got '0', expected a number > 0"),
        (["--validation-split", "100"],
         "--validation-split 100: the percent of the documents held out must be above 0 and below 100"),
        (["--validation-split", "99.5"],
         "--validation-split 99.5: holding out 60 of the 60 documents leaves none to train on"),
        (["--validation-split", "10", "--validation-data", corpus], "--validation-split excludes --validation-data"),
        (["--validation-data", missing], missing),
        (["--eval-every", "0", "--validation-split", "10"], "--eval-every: got '0', expected an integer >= 1"),
        (["--eval-only"], "--eval-only: there is no validation set (--validation-split or --validation-data)"),
        (["--eval-only", "--validation-split", "10", "--save-model", os.path.join(scratch, "m")],
         "--eval-only takes no step: --save-model is training's"),
        (["--eval-only", "--validation-split", "10", "--eval-every", "2"],
         "--eval-only takes no step: --eval-every is training's"),
        (["--eval-only", "--validation-split", "10", "--checkpoint-dir", os.path.join(scratch, "c")],
         "--eval-only saves nothing: --checkpoint-dir is read with --resume"),
    ]
    for flags, message in cases:
        code, output = run_job(mpirun, program, 1, BASE + args + flags)
        check(f"train_llama {' '.join(flags)}: refused, naming it", code not in (0, None) and message in output,
              output[-2000:])
    code, output = run_job(mpirun, program, 1, ["--config", "tiny", "--random-tokens", "--steps", "1",
                                                "--validation-split", "10"])
    check("--random-tokens with --validation-split: refused, naming both",
          code not in (0, None) and "--validation-split excludes --random-tokens" in output, output[-2000:])


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
