#!/usr/bin/env python3
"""tests/apps/lr_schedule_tests.py: train_llama's learning-rate schedule (--warmup-steps, --lr-decay,
--decay-ratio, --min-lr-factor) against its closed form written out here.

Usage: lr_schedule_tests.py <train_llama>

Each per-step metrics record holds the lr the scheduler set after that step (the next step's). The
expected lr after k steps: warm-up from 0.1 x lr to lr over W steps (linear), then, of the S = steps - W
after it, the first S - D at lr (D = ratio x S rounded, at least 1) and the last D decaying to
min_factor x lr, by (1 + cos(pi t / D)) / 2 or linearly in t, the steps t into the decay. A checkpoint
of the stable part resumed with more --steps follows the longer schedule. Prints one
line per check and "lr_schedule_app: N passed, N failed, N skipped"."""
import math
import os
import shutil
import sys
import tempfile

from jobs import Checks, read_metrics, run_command

STEPS, WARMUP, LR = 12, 2, 1e-2


def expected(k, decay="cosine", ratio=1.0, min_factor=0.0, steps=STEPS):
    if k < WARMUP:
        return LR * (0.1 + 0.9 * k / WARMUP)
    after = steps - WARMUP
    length = min(max(math.floor(ratio * after + 0.5), 1), after)  # halves away from zero, as llround
    t = k - (WARMUP + after - length)
    if t < 0:
        return LR
    if decay == "linear":
        return LR * (1 + (min_factor - 1) * min(t, length) / length)
    return min_factor * LR + (LR - min_factor * LR) * (1 + math.cos(math.pi * t / length)) / 2


def main(program):
    check = Checks()
    cases = [("the default: cosine from the warm-up to 0", [], {}),
             ("--lr-decay linear: linearly to 0", ["--lr-decay", "linear"], {"decay": "linear"}),
             ("warm-up-stable-decay: --decay-ratio 0.5 --lr-decay linear --min-lr-factor 0.1",
              ["--decay-ratio", "0.5", "--lr-decay", "linear", "--min-lr-factor", "0.1"],
              {"decay": "linear", "ratio": 0.5, "min_factor": 0.1}),
             ("warm-up-stable-decay: --decay-ratio 0.3 --min-lr-factor 0.05, cosine (3 decaying steps)",
              ["--decay-ratio", "0.3", "--min-lr-factor", "0.05"], {"ratio": 0.3, "min_factor": 0.05})]
    with tempfile.TemporaryDirectory(prefix="lr_schedule_tests.") as scratch:
        for i, (name, flags, form) in enumerate(cases):
            metrics = os.path.join(scratch, f"{i}.jsonl")
            code, output = run_command([program, "--config", "tiny", "--random-tokens", "--seq", "16",
                                        "--global-batch", "4", "--steps", str(STEPS), "--warmup-steps", str(WARMUP),
                                        "--lr", str(LR), "--threads", "1", "--metrics", metrics] + flags)
            found = {r["step"]: r["lr"] for r in read_metrics(metrics) if "lr" in r}
            want = {k: expected(k, **form) for k in range(1, STEPS + 1)}
            check(f"{name}: every step's lr is the closed form's within 1e-12",
                  code == 0 and found.keys() == want.keys()
                  and all(abs(found[k] - want[k]) <= 1e-12 * LR for k in want),
                  f"{output[-1500:]}\nfound {found}\nwant {want}")
        check_resumed_decay(program, scratch, check)
    return check.summary("lr_schedule_app", 0)


def run(program, scratch, name, flags):
    metrics = os.path.join(scratch, f"{name}.jsonl")
    code, output = run_command([program, "--config", "tiny", "--seq", "16", "--global-batch", "4",
                                "--warmup-steps", str(WARMUP), "--lr", str(LR), "--threads", "1", "--metrics",
                                metrics] + flags)
    return code, output, {r["step"]: r["lr"] for r in read_metrics(metrics) if "lr" in r}


def check_resumed_decay(program, scratch, check):
    """A checkpoint of the stable part, resumed with more steps: the lr of the longer run's schedule."""
    checkpoints = os.path.join(scratch, "checkpoints")
    corpus = os.path.join(scratch, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as out:  # random tokens would draw a batch per --steps' step
        out.write("".join(f"document {i} {'word ' * (i % 7)}\n%\n" for i in range(64)))
    flags = ["--decay-ratio", "0.25", "--lr-decay", "linear", "--data", corpus]
    code, output, _ = run(program, scratch, "stable", flags + ["--steps", "8", "--checkpoint-dir", checkpoints,
                                                               "--checkpoint-every", "4"])
    longer = os.path.join(scratch, "longer")
    shutil.copytree(os.path.join(checkpoints, "step-00000004"), os.path.join(longer, "step-00000004"))
    resumed_code, resumed, found = run(program, scratch, "resumed", flags + ["--steps", "16", "--checkpoint-dir",
                                                                             longer, "--resume"])
    want = {k: expected(k, decay="linear", ratio=0.25, steps=16) for k in range(5, 17)}
    check("a checkpoint of the stable part resumed with --steps 16: the 16-step schedule's lr from step 5 on",
          code == 0 and resumed_code == 0 and found.keys() == want.keys()
          and all(abs(found[k] - want[k]) <= 1e-12 * LR for k in want),
          f"{output[-1000:]}\n{resumed[-1500:]}\nfound {found}\nwant {want}")


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
