#!/usr/bin/env python3
"""tests/apps/bitwise_tests.py: --bitwise, the same bits at any world size and sharding.

Usage: bitwise_tests.py <mpirun> <train_llama> <train_cnn>

train_llama (the tiny Llama on random token ids, global batch 12 in chunks of 3) at 1-4 ranks over
every sharding, in f32 and in bf16, and train_cnn (Fashion-MNIST, global batch 64 in chunks of 16) at
1-4 ranks: every step's loss and gradient norm of rank 0, as float.hex, equal the 1-rank run's over 20
steps. Saved at 4 ranks and resumed at 2, and saved at 3 and resumed at 1, the model written at the end
is byte for byte the uninterrupted 1-rank run's (4 -> 2 and 3 -> 1). Each has its control: the same runs without --bitwise
differ in some bit. The mode's refusals (--chunk without --bitwise, chunks that do not cut the batch,
fewer chunks than ranks, --tp, a resume with other chunks) are named. Prints one line per check and
"bitwise_app: N passed, N failed, N skipped"."""
import os
import shutil
import sys
import tempfile

from golden import step_hex
from jobs import Checks, read_metrics, run_job, same_bytes

STEPS = 20
LLAMA_ARGS = ["--config", "tiny", "--random-tokens", "--seq", "32", "--global-batch", "12", "--lr", "3e-3",
              "--threads", "1"]
CNN_DATA = "/usr/share/datasets/fashion-mnist"
CNN_ARGS = ["--limit-train", "1280", "--limit-test", "64", "--global-batch", "64", "--threads", "1"]
# (ranks, sharding, mixed precision): 3 ranks hold 2, 1 and 1 chunks of the Llama's 4.
LLAMA_RUNS = [(2, "full", "none"), (3, "full", "none"), (4, "full", "none"), (2, "grad_op", "none"),
              (3, "none", "none"), (2, "optimizer", "none"), (4, "hybrid:2", "none"),
              (2, "full", "bf16"), (3, "grad_op", "bf16"), (4, "hybrid:2", "bf16")]
CNN_RUNS = [(2, "full"), (3, "full"), (4, "full"), (4, "hybrid:2")]


def main(mpirun, train_llama, train_cnn):
    check = Checks()
    skipped = 0
    with tempfile.TemporaryDirectory(prefix="bitwise_tests.") as scratch:
        check_errors(mpirun, train_llama, check)
        check_llama(mpirun, train_llama, scratch, check)
        if os.path.isdir(CNN_DATA):
            check_cnn(mpirun, train_cnn, scratch, check)
        else:
            skipped = len(CNN_RUNS) + 4
            print(f"skipped: {skipped} train_cnn cases, {CNN_DATA} is missing "
                  "(scripts/setup installs dataset-fashion-mnist)")
    return check.summary("bitwise_app", skipped)


def train(mpirun, program, scratch, name, ranks, args):
    """(rank 0's {step: [loss, norm]} in hexadecimal, the model it saved at the end), or (None, path) where
    the run failed (a check says so)."""
    metrics = os.path.join(scratch, f"{name}.jsonl")
    # train_cnn saves one file, train_llama a directory.
    model = os.path.join(scratch, f"{name}-model" + (".safetensors" if "cnn" in name else ""))
    code, output = run_job(mpirun, program, ranks, args + ["--metrics", metrics, "--save-model", model])
    if code != 0:
        print(f"{name}: exit {code}\n{output}")
        return None, model
    return step_hex(read_metrics(metrics)), model


def check_equal_runs(check, what, reference, runs):
    """Every run's step values are the reference's (and there are STEPS of them), its model the same bytes."""
    values, model = reference
    for name, (run_values, run_model) in runs:
        check(f"{what}: {name} has the 1-rank run's {STEPS} losses and norms bit for bit, and writes its model's bytes",
              run_values is not None and len(run_values) == STEPS and run_values == values
              and same_bytes(model, run_model),
              f"{name}: {run_values}\n1 rank: {values}")


def check_llama(mpirun, program, scratch, check):
    steps = ["--steps", str(STEPS)]
    bitwise = LLAMA_ARGS + ["--bitwise", "--chunk", "3"]
    for precision in ("none", "bf16"):
        reference = train(mpirun, program, scratch, f"llama-1-{precision}", 1,
                          bitwise + steps + ["--mixed-precision", precision])
        runs = [(f"np {ranks} {sharding} {precision}",
                 train(mpirun, program, scratch, f"llama-{ranks}-{sharding}-{precision}", ranks,
                       bitwise + steps + ["--sharding", sharding, "--mixed-precision", precision]))
                for ranks, sharding, mp in LLAMA_RUNS if mp == precision]
        check_equal_runs(check, f"train_llama --bitwise ({precision})", reference, runs)
    check_control_and_resumes(mpirun, program, scratch, check, "train_llama", LLAMA_ARGS, bitwise, 3,
                              os.path.join(scratch, "llama-1-none-model"))


def check_control_and_resumes(mpirun, program, scratch, check, label, plain, bitwise, ranks, whole):
    """Without --bitwise, `ranks` ranks differ from 1 in some step's bits, and a run saved at 4 ranks and
    resumed at 2 writes other bytes than 1 rank; with it, runs saved at 4 and 3 ranks and resumed at 2 and
    1 write `whole`, the 1-rank model, byte for byte."""
    steps = ["--steps", str(STEPS)]
    plain_1, plain_model = train(mpirun, program, scratch, f"{label}-plain-1", 1, plain + steps)
    plain_n, _ = train(mpirun, program, scratch, f"{label}-plain-{ranks}", ranks, plain + steps)
    check(f"{label} without --bitwise: {ranks} ranks differ from 1 in some step's bits",
          plain_1 is not None and plain_n is not None and plain_1 != plain_n)
    check_resumed_model(mpirun, program, scratch, check, label, plain, 4, 2, plain_model, expect_equal=False)
    for saved_at, resumed_at in ((4, 2), (3, 1)):
        check_resumed_model(mpirun, program, scratch, check, label, bitwise, saved_at, resumed_at, whole)


def check_resumed_model(mpirun, program, scratch, check, label, args, saved_at, resumed_at, whole, expect_equal=True):
    """Saved at step STEPS / 2 by `saved_at` ranks and resumed by `resumed_at` to step STEPS: the model
    written is `whole`'s bytes, an uninterrupted 1-rank run's (or, for a control, not)."""
    name = f"{label}-{saved_at}-to-{resumed_at}{'' if expect_equal else '-plain'}"
    checkpoints = os.path.join(scratch, f"{name}-checkpoints")
    resumed = os.path.join(scratch, f"{name}-model" + (".safetensors" if whole.endswith(".safetensors") else ""))
    # The whole run saves at both steps (random token ids are drawn for every step of --steps), and
    # its last checkpoint is removed: the resume continues from the middle.
    first, output_1 = run_job(mpirun, program, saved_at,
                              args + ["--steps", str(STEPS), "--checkpoint-dir", checkpoints, "--checkpoint-every",
                                      str(STEPS // 2)])
    shutil.rmtree(os.path.join(checkpoints, f"step-{STEPS:08d}"), ignore_errors=True)
    second, output_2 = run_job(mpirun, program, resumed_at,
                               args + ["--steps", str(STEPS), "--checkpoint-dir", checkpoints, "--resume",
                                       "--save-model", resumed])
    same = first == 0 and second == 0 and os.path.exists(whole) and same_bytes(whole, resumed)
    mode = "--bitwise" if expect_equal else "without --bitwise"
    verdict = "the same bytes as" if expect_equal else "other bytes than"
    check(f"{label} {mode}: saved at {saved_at} ranks, resumed at {resumed_at}, writes {verdict} one rank's model",
          first == 0 and second == 0 and same == expect_equal, f"{output_1}\n{output_2}")


def check_cnn(mpirun, program, scratch, check):
    steps = ["--steps", str(STEPS)]
    bitwise = CNN_ARGS + ["--bitwise"]  # the default chunk: 16 of 64
    reference = train(mpirun, program, scratch, "cnn-1", 1, bitwise + steps)
    runs = [(f"np {ranks} {sharding}", train(mpirun, program, scratch, f"cnn-{ranks}-{sharding}", ranks,
                                             bitwise + steps + ["--sharding", sharding]))
            for ranks, sharding in CNN_RUNS]
    check_equal_runs(check, "train_cnn --bitwise", reference, runs)
    check_control_and_resumes(mpirun, program, scratch, check, "train_cnn", CNN_ARGS, bitwise, 4,
                              os.path.join(scratch, "cnn-1-model.safetensors"))


def check_errors(mpirun, program, check):
    cases = [
        (1, ["--chunk", "3"], "--chunk requires --bitwise"),
        (2, ["--bitwise", "--chunk", "5"], "train_llama: global batch: 12 does not cut into chunks of 5"),
        (4, ["--bitwise", "--chunk", "6"],
         "train_llama: global batch: 12 in chunks of 6 makes 2 chunks, fewer than the 4 ranks (every rank needs a "
         "whole chunk per step)"),
        (2, ["--bitwise", "--tp", "2"],
         "train_llama: --bitwise is not supported with --tp 2: tensor parallelism's all-reduces add in an order "
         "that depends on the ranks"),
    ]
    for ranks, args, message in cases:
        code, output = run_job(mpirun, program, ranks, LLAMA_ARGS + args + ["--steps", "1"])
        check(f"np {ranks} {' '.join(args)} fails, explained", code not in (0, None) and message in output,
              f"exit {code}, expected: {message}\n{output}")
    with tempfile.TemporaryDirectory(prefix="bitwise_resume.") as checkpoints:
        saved, output = run_job(mpirun, program, 2, LLAMA_ARGS + ["--bitwise", "--chunk", "3", "--steps", "2",
                                                                  "--checkpoint-dir", checkpoints,
                                                                  "--checkpoint-every", "1"])
        shutil.rmtree(os.path.join(checkpoints, "step-00000002"), ignore_errors=True)
        code, resumed = run_job(mpirun, program, 2, LLAMA_ARGS + ["--bitwise", "--chunk", "2", "--steps", "2",
                                                                  "--checkpoint-dir", checkpoints, "--resume"])
        message = "was trained with --bitwise in chunks of 3, this run cuts chunks of 2 (--chunk)"
        check("a bitwise checkpoint resumed with other chunks is refused, named",
              saved == 0 and code not in (0, None) and message in resumed, f"{output}\n{resumed}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(*sys.argv[1:]))
