#!/usr/bin/env python3
"""tests/apps/micro_batch_tests.py: --micro-batches K, gradient accumulation in both training programs.

Usage: micro_batch_tests.py <mpirun> <train_llama> <train_cnn>

A step of K micro-batches trains what a step of one pass over the same global batch trains: the tiny
Llama at 2 ranks under every --micro-batch-sync (every, last, and reduce-scatter over NO_SHARD's
replicas), f32 and bf16, with --tp 2, and the CNN, each against the run without micro-batches (losses and gradient
norms within 1e-5 relative over 6 steps: only the order of the sums differs; in bf16 the first step so,
the later within bf16's rounding). In each, every rank's
collectives of a step are the plan's to the byte and the predicted training peak is within the
tolerance of the measured one; a micro-batch's activations are smaller than the whole batch's. With
--bitwise the micro-batches add into one exact sum: 1 rank in 4 micro-batches, 2 ranks in 2 and 2 in 1
are the same bits, and write the same model, as does a run saved at 2 ranks and resumed at 1 in 4
micro-batches. The refusals are named. Prints one line per check and
"micro_batch_app: N passed, N failed, N skipped"."""
import os
import re
import shutil
import sys
import tempfile

from golden import step_hex
from jobs import Checks, check_peak, read_metrics, run_job, same_bytes

STEPS = 6
LLAMA_ARGS = ["--config", "tiny", "--random-tokens", "--seq", "32", "--global-batch", "12", "--lr", "3e-3",
              "--threads", "1", "--steps", str(STEPS)]
CNN_DATA = "/usr/share/datasets/fashion-mnist"
CNN_ARGS = ["--limit-train", "640", "--limit-test", "64", "--global-batch", "64", "--threads", "1",
            "--steps", str(STEPS)]
TOLERANCE = 1e-5
# bf16 weights: the first step's gradient agrees as closely (the micro-batches add in f32), the later
# steps' within bf16's rounding, which Adam's steps on slightly other gradients reach.
BF16_TOLERANCE = 2e-3
# (name, extra flags of both runs, the accumulated run's flags).
LLAMA_RUNS = [("full, every", [], ["--micro-batches", "3"]),
              ("full, last", [], ["--micro-batches", "3", "--micro-batch-sync", "last"]),
              ("none, reduce-scatter", ["--sharding", "none"],
               ["--micro-batches", "2", "--micro-batch-sync", "reduce-scatter"]),
              ("grad_op bf16, last", ["--sharding", "grad_op", "--mixed-precision", "bf16"],
               ["--micro-batches", "2", "--micro-batch-sync", "last"]),
              ("--tp 2, every", ["--tp", "2"], ["--micro-batches", "3"])]
COLLECTIVES = re.compile(r"collectives of the last step: received (\d+) B, planned (\d+) B")


def main(mpirun, train_llama, train_cnn):
    check = Checks()
    skipped = 0
    with tempfile.TemporaryDirectory(prefix="micro_batch_tests.") as scratch:
        check_errors(mpirun, train_llama, check)
        for name, both, accumulated in LLAMA_RUNS:
            check_same_training(mpirun, train_llama, scratch, check, f"train_llama {name}", LLAMA_ARGS + both,
                                accumulated)
        check_bitwise(mpirun, train_llama, scratch, check)
        if os.path.isdir(CNN_DATA):
            check_same_training(mpirun, train_cnn, scratch, check, "train_cnn full, last", CNN_ARGS,
                                ["--micro-batches", "4", "--micro-batch-sync", "last"])
        else:
            skipped = 4
            print(f"skipped: {skipped} train_cnn checks, {CNN_DATA} is missing "
                  "(scripts/setup installs dataset-fashion-mnist)")
    return check.summary("micro_batch_app", skipped)


def train(mpirun, program, scratch, name, ranks, args):
    """(exit status, output, metrics records, saved model path)."""
    metrics = os.path.join(scratch, f"{name}.jsonl")
    model = os.path.join(scratch, f"{name}-model" + (".safetensors" if "cnn" in name else ""))
    code, output = run_job(mpirun, program, ranks, args + ["--metrics", metrics, "--save-model", model])
    return code, output, read_metrics(metrics) if code == 0 else [], model


def steps(records):
    """[(loss, grad_norm)] of rank 0, by step."""
    rows = {r["step"]: (r["loss"], r["grad_norm"]) for r in records if r.get("rank") == 0 and "loss" in r}
    return [rows[s] for s in sorted(rows)]


def close(a, b, tolerance=TOLERANCE):
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


def same_steps(one, many, bf16):
    """The steps agree: within TOLERANCE, or in bf16 the first so and the later within BF16_TOLERANCE."""
    if len(one) != STEPS or len(many) != STEPS:
        return False
    return all(close(a[0], b[0], BF16_TOLERANCE if bf16 and step > 0 else TOLERANCE)
               and close(a[1], b[1], BF16_TOLERANCE if bf16 and step > 0 else TOLERANCE)
               for step, (a, b) in enumerate(zip(one, many)))


def measured_peak(records):
    return next((r["train_peak_memory_bytes"] for r in records if r.get("rank") == 0
                 and "train_peak_memory_bytes" in r), None)


def check_same_training(mpirun, program, scratch, check, label, args, accumulated):
    slug = re.sub(r"[^a-z0-9]+", "-", label)
    explained = args + ["--explain"]
    code_1, output_1, whole, _ = train(mpirun, program, scratch, f"{slug}-1", 2, explained)
    code_k, output_k, parts, _ = train(mpirun, program, scratch, f"{slug}-k", 2, explained + accumulated)
    ok = code_1 == 0 and code_k == 0
    one, many = steps(whole), steps(parts)
    bf16 = "bf16" in args
    within = f"the first within {TOLERANCE}, the rest {BF16_TOLERANCE}" if bf16 else f"within {TOLERANCE}"
    check(f"{label}: {' '.join(accumulated)} trains the steps of one pass over the batch (losses and norms "
          f"{within} relative)",
          ok and same_steps(one, many, bf16),
          f"{output_1[-2000:]}\n{output_k[-2000:]}\none pass: {one}\nmicro-batches: {many}")
    traffic = [(int(received), int(planned)) for received, planned in COLLECTIVES.findall(output_k)]
    # FSDP's, and with --tp the tensor-parallel ranks' too.
    check(f"{label}: a step's collectives are the plan's to the byte",
          ok and len(traffic) == (2 if "--tp" in args else 1) and all(r == p for r, p in traffic),
          output_k[-2000:])
    check_peak(check, f"{label} {' '.join(accumulated)}", parts, 2)
    peak_1, peak_k = measured_peak(whole), measured_peak(parts)
    check(f"{label}: the micro-batches' training peak is below one pass's ({peak_k} B against {peak_1} B)",
          ok and peak_1 is not None and peak_k is not None and peak_k < peak_1)


def check_bitwise(mpirun, program, scratch, check):
    bitwise = LLAMA_ARGS + ["--bitwise", "--chunk", "3"]  # 4 chunks of the global batch of 12
    runs = [("np 1 in 4 micro-batches", 1, ["--micro-batches", "4"]),
            ("np 2 in 2 micro-batches", 2, ["--micro-batches", "2", "--micro-batch-sync", "last"]),
            ("np 2 hybrid:1 in 2 micro-batches", 2, ["--micro-batches", "2", "--sharding", "hybrid:1"]),
            ("np 2", 2, [])]
    results = [(name, train(mpirun, program, scratch, f"bitwise-{i}", ranks, bitwise + flags))
               for i, (name, ranks, flags) in enumerate(runs)]
    _, (code, output, records, model) = results[-1]
    reference = step_hex(records)
    check_bitwise_resume(mpirun, program, scratch, check, bitwise, model)
    for name, (run_code, run_output, run_records, run_model) in results[:-1]:
        values = step_hex(run_records)
        check(f"train_llama --bitwise: {name} has the 2-rank run's {STEPS} losses and norms bit for bit, and "
              "writes its model's bytes",
              code == 0 and run_code == 0 and len(values) == STEPS and values == reference
              and same_bytes(model, run_model),
              f"{run_output[-2000:]}\n{values}\n2 ranks: {reference}")


def check_bitwise_resume(mpirun, program, scratch, check, bitwise, whole):
    """Saved half-way by 2 ranks in one pass a step, resumed by 1 rank in 4 micro-batches: the model at
    the end is `whole`'s bytes (the uninterrupted 2-rank run's)."""
    checkpoints = os.path.join(scratch, "bitwise-resume-checkpoints")
    resumed = os.path.join(scratch, "bitwise-resume-model")
    first, output_1 = run_job(mpirun, program, 2, bitwise + ["--checkpoint-dir", checkpoints,
                                                             "--checkpoint-every", str(STEPS // 2)])
    shutil.rmtree(os.path.join(checkpoints, f"step-{STEPS:08d}"), ignore_errors=True)
    second, output_2 = run_job(mpirun, program, 1, bitwise + ["--micro-batches", "4", "--checkpoint-dir",
                                                              checkpoints, "--resume", "--save-model", resumed])
    check("train_llama --bitwise: saved at 2 ranks in one pass a step, resumed at 1 in 4 micro-batches, writes "
          "the same bytes", first == 0 and second == 0 and same_bytes(whole, resumed),
          f"{output_1[-2000:]}\n{output_2[-2000:]}")


def check_errors(mpirun, program, check):
    cases = [
        (["--micro-batches", "7"],
         "--micro-batches 7: rank 1 of 2 holds 6 samples of the global batch of 12, and every micro-batch "
         "needs one (at most --micro-batches 6 here)"),
        (["--micro-batches", "3", "--bitwise", "--chunk", "3"],
         "--micro-batches 3: rank 1 of 2 holds 2 chunks of the global batch of 12, and every micro-batch "
         "needs one (at most --micro-batches 2 here)"),
        (["--micro-batches", "3", "--micro-batch-sync", "reduce-scatter"],
         "--micro-batch-sync reduce-scatter: no unit of this run has replicas (--sharding full on 2 ranks)"),
        (["--micro-batches", "2", "--bitwise", "--chunk", "3", "--micro-batch-sync", "every"],
         "--micro-batch-sync every: --bitwise adds every micro-batch into one exact sum and reduces it once "
         "(--micro-batch-sync last); a reduction per micro-batch would round each"),
        (["--micro-batches", "1", "--micro-batch-sync", "last"],
         "--micro-batch-sync last: a step of one micro-batch (--micro-batches 1) reduces once either way"),
        (["--micro-batch-sync", "last"], "--micro-batch-sync requires --micro-batches"),
        (["--micro-batches", "2", "--micro-batch-sync", "sometimes"],
         "--micro-batch-sync: got 'sometimes', expected one of every, reduce-scatter, last"),
        (["--micro-batches", "0"], "--micro-batches: got '0', expected an integer >= 1"),
        # A what-if of more ranks holds fewer samples per rank.
        (["--micro-batches", "4", "--explain", "--world-size", "4"],
         "--micro-batches 4: rank 3 of 4 holds 3 samples of the global batch of 12"),
    ]
    for flags, message in cases:
        ranks = 1 if "--world-size" in flags else 2
        code, output = run_job(mpirun, program, ranks, LLAMA_ARGS + flags)
        check(f"train_llama {' '.join(flags)} at np {ranks}: refused, naming it", code not in (0, None)
              and message in output, output[-2000:])


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
