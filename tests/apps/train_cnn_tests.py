#!/usr/bin/env python3
"""tests/apps/train_cnn_tests.py: runs apps/train_cnn under mpirun on Fashion-MNIST and checks
what its users rely on:

- exact parity: 6 steps of the same global batch (dropout included) give every step's loss, the
  mean over the global batch, within 1e-5 of the 1-process run, at 1, 2, 3 and 4 ranks (3 ranks
  split the batch of 64 unevenly, 22/21/21) and for every sharding strategy;
- evaluation split over ranks (with a padded last batch) gives the 1-process test loss and
  accuracy;
- a global batch smaller than the ranks, and an unknown sharding, exit 1 with a message printed
  once;
- every rank writes its metrics records, each carrying its "rank";
- sharded checkpoints and --resume: 14 steps over epochs of 5 (dropout, evaluations and the
  learning-rate schedule between them) stopped at step 7, or at step 5 (an epoch's end), and
  resumed give the uninterrupted run's step losses, epoch lines and saved model bit for bit at
  np 2 and 4, and within float tolerance when saved at np 4 and resumed at np 2; a resume that
  changes the batch is refused;
- kill -9 of every rank during a save (at several points of it) leaves the previous checkpoint
  complete, and resuming from it gives the uninterrupted run's losses bit for bit;
- will it fit: the training peak --explain predicts (above the loaded data) is within 10% of the
  measured one on every rank at np 1-4 for every strategy; its dry forward/backwards change
  nothing (losses and saved model bit for bit as without --explain); --memory-limit at the peak
  trains, one byte under is refused before step 1 with one message;
- what-if: --explain --world-size N from fewer ranks (one, over an assumed link; two, over the measured
  one) prints the plan table and the plan's peak terms that a run at N ranks prints, with a step time,
  and trains nothing.

Usage: train_cnn_tests.py <mpirun> <train_cnn>. Needs the dataset from scripts/setup
(/usr/share/datasets/fashion-mnist); without it every case is skipped. Prints one line per
check, then "train_cnn_app: N passed, N failed, N skipped".
"""
import filecmp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from golden import check_golden
from trace_checks import check_trace_run
from jobs import Checks, check_dry_runs_change_nothing, LIMIT_S, check_memory_limit, check_peak, read_metrics, run_job

DATA_DIR = "/usr/share/datasets/fashion-mnist"
STEPS = 6
PARITY_ARGS = ["--steps", str(STEPS), "--limit-train", "768", "--global-batch", "64",
               "--test-batch-size", "1000", "--threads", "1"]
# (ranks, sharding) for the parity runs; (1, "full") is the reference.
PARITY_RUNS = [(1, "full"), (2, "full"), (3, "full"), (4, "full"), (2, "none"), (2, "grad_op"), (2, "hybrid:1"),
               (4, "hybrid:2"), (2, "optimizer"), (3, "optimizer")]
RTOL = 1e-5
# The parity runs whose every step's loss and gradient norm are held to the bit by a golden file.
GOLDEN_RUNS = [(1, "full"), (2, "full"), (3, "full"), (2, "none"), (2, "grad_op"), (2, "optimizer"), (4, "hybrid:2")]
# Saved at one world size and resumed at another: the gradient sums' order differs at every step, and
# the rounding differences grow with training (1.1e-5 by step 14 with OpenBLAS's AVX-512 sgemm).
CROSS_WORLD_RTOL = 1e-4
# Resume runs: epochs of 320 / 64 = 5 steps, 14 steps in all.
RESUME_ARGS = ["--limit-train", "320", "--limit-test", "200", "--global-batch", "64", "--epochs", "3",
               "--threads", "1"]
RESUME_STEPS = 14


def step_losses(records, rank):
    """{step: loss} of one rank's per-step records."""
    return {r["step"]: r["loss"] for r in records if r.get("rank") == rank and "loss" in r}


def close(actual, expected, rtol=RTOL):
    return abs(actual - expected) <= rtol * abs(expected)  # NaN compares false: it fails


def main(mpirun, program):
    check = Checks()

    # Options are checked before the data loads: these run with or without the data set.
    code, output = run_job(mpirun, program, 4, ["--global-batch", "3", "--steps", "1"])
    message = "train_cnn: global batch: 3 is smaller than the 4 ranks (every rank needs a sample per step)"
    check("np 4 --global-batch 3 exits 1, explained once", code == 1 and output.count(message) == 1,
          f"exit {code}\n{output}")

    code, output = run_job(mpirun, program, 2, ["--sharding", "half", "--steps", "1"])
    message = "train_cnn: sharding 'half' is not one of full, grad_op, optimizer, none, hybrid:G"
    check("np 2 --sharding half exits 1, naming the value once", code == 1 and output.count(message) == 1,
          f"exit {code}\n{output}")

    skipped = 0
    if not os.path.isdir(DATA_DIR):
        skipped = (len(PARITY_RUNS) - 1 + len(GOLDEN_RUNS) + 2 + 7 + len(KILL_STEPS) + len(FIT_RUNS) + 1 + 4 +
                   TRACE_CHECKS + 2 + len(WHAT_IF_RUNS))
        print(f"skipped: {skipped} cases that train, {DATA_DIR} is missing "
              "(scripts/setup installs dataset-fashion-mnist)")
    else:
        with tempfile.TemporaryDirectory(prefix="train_cnn_tests.") as scratch:
            train_and_check(mpirun, program, scratch, check)
            check_resume(mpirun, program, scratch, check)
            check_kill_during_save(mpirun, program, scratch, check)
            check_will_it_fit(mpirun, program, scratch, check)
            check_what_if(mpirun, program, check)
            check_traces(mpirun, program, scratch, check)
            check_detect_anomaly(mpirun, program, check)

    return check.summary("train_cnn_app", skipped)


def train_and_check(mpirun, program, scratch, check):
    """The cases that train: step-loss parity, metrics records, evaluation over ranks."""
    runs = {}
    for ranks, sharding in PARITY_RUNS:
        metrics = os.path.join(scratch, f"np{ranks}_{sharding.replace(':', '_')}.jsonl")
        code, output = run_job(mpirun, program, ranks,
                               PARITY_ARGS + ["--sharding", sharding, "--metrics", metrics])
        runs[(ranks, sharding)] = (code, output, read_metrics(metrics))

    ref_code, ref_output, ref_records = runs[(1, "full")]
    expected = step_losses(ref_records, 0)
    if ref_code != 0 or sorted(expected) != list(range(1, STEPS + 1)):
        check("the 1-process reference run", False,
              f"exit {ref_code}, steps {sorted(expected)}\n{ref_output}")
    else:
        for (ranks, sharding), (code, output, records) in runs.items():
            if ranks == 1:
                continue
            losses = step_losses(records, 0)
            wrong = [f"step {s}: {losses.get(s)} vs {expected[s]}" for s in expected
                     if s not in losses or not close(losses[s], expected[s])]
            check(f"np {ranks} --sharding {sharding}: {STEPS} step losses equal the 1-process run's "
                  f"within {RTOL:g}", code == 0 and not wrong,
                  f"exit {code}; " + "; ".join(wrong) + "\n" + output)

    for ranks, sharding in GOLDEN_RUNS:
        check_golden(check, "train_cnn_steps.json", f"train_cnn np {ranks} --sharding {sharding}",
                     runs[(ranks, sharding)][2])

    # Metrics: every record carries its rank, and every rank wrote all its step records.
    code, output, records = runs[(4, "full")]
    ranks_seen = sorted({r["rank"] for r in records if "rank" in r})
    per_rank_steps = {rank: sorted(step_losses(records, rank)) for rank in range(4)}
    ok = (code == 0 and records and all("rank" in r for r in records) and ranks_seen == [0, 1, 2, 3]
          and all(steps == list(range(1, STEPS + 1)) for steps in per_rank_steps.values()))
    check("np 4: every metrics record carries its rank; every rank wrote every step", ok,
          f"exit {code}, ranks {ranks_seen}, steps by rank {per_rank_steps}")

    # Evaluation: 1001 test images over 4 ranks leaves ranks 1-3 without rows in the second
    # batch; they forward a padded row that must not count.
    evaluated = {}
    for ranks in (1, 4):
        metrics = os.path.join(scratch, f"eval_np{ranks}.jsonl")
        code, output = run_job(mpirun, program, ranks,
                               ["--epochs", "1", "--limit-train", "256", "--limit-test", "1001",
                                "--threads", "1", "--metrics", metrics])
        epochs = [r for r in read_metrics(metrics) if r.get("rank") == 0 and "epoch" in r]
        evaluated[ranks] = (code, output, epochs[0] if epochs else {})
    (code1, _, one), (code4, output4, four) = evaluated[1], evaluated[4]
    ok = (code1 == 0 and code4 == 0 and one and four and one["accuracy"] == four["accuracy"]
          and close(four["test_loss"], one["test_loss"]))
    check("np 4 evaluates 1001 test images (padded batches) as 1 process does", ok,
          f"exit {code1}/{code4}: {one} vs {four}\n{output4}")


def epoch_lines(output):
    return [line for line in output.splitlines() if line.startswith(("Train Epoch", "Test set"))]


def check_resume(mpirun, program, scratch, check):
    reference = {}
    for ranks in (2, 4):
        metrics, model = os.path.join(scratch, f"whole_np{ranks}.jsonl"), os.path.join(scratch, f"whole_np{ranks}.st")
        code, output = run_job(mpirun, program, ranks, RESUME_ARGS + ["--steps", str(RESUME_STEPS), "--metrics",
                                                                      metrics, "--save-model", model])
        reference[ranks] = (code, output, step_losses(read_metrics(metrics), 0), model)

    for save_ranks, resume_ranks in ((2, 2), (4, 4), (4, 2)):
        directory = os.path.join(scratch, f"checkpoints_{save_ranks}_{resume_ranks}")
        # Saves step 5 (the end of epoch 1, before its evaluation) and step 7 (where it stops).
        code1, _ = run_job(mpirun, program, save_ranks, RESUME_ARGS + ["--steps", "7", "--checkpoint-dir", directory,
                                                                        "--checkpoint-every", "5"])
        kept = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        ref_code, ref_output, expected, ref_model = reference[resume_ranks]
        for resumed_step in (7, 5):
            # Each resume saves its last step: it goes on from a copy of what the first run left.
            copy = f"{directory}_from_{resumed_step}"
            shutil.copytree(directory, copy, dirs_exist_ok=True)
            if resumed_step == 5:
                shutil.rmtree(os.path.join(copy, "step-00000007"), ignore_errors=True)
            metrics = os.path.join(scratch, f"resumed_{save_ranks}_{resume_ranks}_{resumed_step}.jsonl")
            model = metrics.replace(".jsonl", ".st")
            code2, output = run_job(mpirun, program, resume_ranks,
                                    RESUME_ARGS + ["--steps", str(RESUME_STEPS), "--checkpoint-dir", copy,
                                                   "--resume", "--metrics", metrics, "--save-model", model])
            losses = step_losses(read_metrics(metrics), 0)
            # The epochs the resumed run finishes print what the uninterrupted run printed.
            lines = epoch_lines(output)
            same_lines = lines == epoch_lines(ref_output)[-len(lines):] and len(lines) == (4 if resumed_step == 5
                                                                                            else 2)
            if save_ranks == resume_ranks:
                how = "steps, epoch lines and model equal the uninterrupted run's bit for bit"
                equal = (all(losses[s] == expected.get(s) for s in losses) and same_lines
                         and filecmp.cmp(model, ref_model, shallow=False))
            else:
                # Another world size sums the gradient average in another order.
                how = f"step losses equal the uninterrupted run's within {CROSS_WORLD_RTOL:g}"
                equal = all(close(losses[s], expected[s], CROSS_WORLD_RTOL) for s in losses if s in expected)
            ok = (code1 == 0 and ref_code == 0 and code2 == 0 and kept == ["step-00000005", "step-00000007"]
                  and equal and sorted(losses) == list(range(resumed_step + 1, RESUME_STEPS + 1))
                  and f"resumed from {copy}/step-{resumed_step:08d}" in output)
            check(f"save at np {save_ranks}, resume at np {resume_ranks} from step {resumed_step}: {how}", ok,
                  f"exit {code1}/{ref_code}/{code2}, kept {kept}\n{losses}\n{expected}\n{output}")

    directory = os.path.join(scratch, "checkpoints_2_2")  # steps 5 and 7, as the first run left it
    code, output = run_job(mpirun, program, 2, RESUME_ARGS + ["--steps", str(RESUME_STEPS), "--global-batch", "32",
                                                               "--checkpoint-dir", directory, "--resume"])
    message = f"train_cnn: --resume: global_batch was 64 when '{directory}/step-00000007' was saved, now 32"
    check("--resume with another --global-batch fails, explained once", code == 1 and output.count(message) == 1,
          f"exit {code}\n{output}")


# Each kill lands in a save of at least this step, at a different point of it (seconds after its
# temporary directory appears).
KILL_STEPS = ((2, 0.0), (4, 0.004), (6, 0.008))
KILL_ATTEMPTS = 4  # a save may finish before the kill lands: then try again


def child_processes(pid):
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as stat:
                if entry.isdigit() and int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry))
        except (OSError, ValueError):
            continue
    return children


def kill_during_save(mpirun, program, directory, step, delay):
    """Starts a job saving every step, kills every rank with SIGKILL once a save of `step` or later
    is under way; returns the temporary directory that was being written, or None when the save
    completed first (or the job ended)."""
    command = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", program] + RESUME_ARGS + [
        "--steps", "30", "--checkpoint-dir", directory, "--checkpoint-every", "1", "--keep", "3"]
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    temp = None
    try:
        deadline = time.monotonic() + LIMIT_S
        while job.poll() is None and time.monotonic() < deadline:
            names = os.listdir(directory) if os.path.isdir(directory) else []
            saving = [n for n in names if ".tmp-" in n and int(n[5:13]) >= step]
            if saving:
                time.sleep(delay)
                # mpirun's ranks are its children, outside its process group: kill each, as a
                # machine that loses power would.
                for rank in child_processes(job.pid):
                    os.kill(rank, signal.SIGKILL)
                temp = saving[0]
                break
            time.sleep(0.0005)
    finally:
        if job.poll() is None:
            for rank in child_processes(job.pid):
                os.kill(rank, signal.SIGKILL)
        job.wait()
    return temp if temp and os.path.isdir(os.path.join(directory, temp)) else None


def check_kill_during_save(mpirun, program, scratch, check):
    metrics = os.path.join(scratch, "unkilled.jsonl")
    code, output = run_job(mpirun, program, 2, RESUME_ARGS + ["--steps", "30", "--epochs", "6", "--metrics", metrics])
    expected = step_losses(read_metrics(metrics), 0)
    for step, delay in KILL_STEPS:
        directory = os.path.join(scratch, f"killed_{step}")
        temp = None
        for _ in range(KILL_ATTEMPTS):
            shutil.rmtree(directory, ignore_errors=True)
            temp = kill_during_save(mpirun, program, directory, step, delay)
            if temp:
                break
        complete = sorted(n for n in os.listdir(directory) if ".tmp-" not in n) if os.path.isdir(directory) else []
        newest = int(complete[-1][5:]) if complete else 0
        resumed_metrics = os.path.join(scratch, f"resumed_after_kill_{step}.jsonl")
        code2, output2 = run_job(mpirun, program, 2, RESUME_ARGS + [
            "--steps", str(newest + 2), "--epochs", "6", "--checkpoint-dir", directory, "--resume", "--metrics",
            resumed_metrics])
        losses = step_losses(read_metrics(resumed_metrics), 0)
        ok = (code == 0 and temp is not None and newest >= step - 1 and code2 == 0
              and f"resumed from {directory}/step-{newest:08d}" in output2
              and sorted(losses) == [newest + 1, newest + 2] and all(losses[s] == expected.get(s) for s in losses)
              and not os.path.exists(os.path.join(directory, temp)))
        check(f"kill -9 of every rank {delay * 1000:g} ms into the save of step {step} or later: the previous "
              f"checkpoint resumes bit for bit", ok,
              f"exit {code}/{code2}, mid-save {temp}, complete {complete}\n{losses}\n{expected}\n{output2}")


# (ranks, sharding) of the predicted-peak runs: every strategy at np 1-4.
FIT_RUNS = [(ranks, sharding) for ranks in (1, 2, 3, 4)
            for sharding in ("full", "grad_op", "optimizer", "none", "hybrid:2" if ranks % 2 == 0 else "hybrid:1")]
FIT_ARGS = ["--steps", "2", "--limit-train", "96", "--limit-test", "100", "--global-batch", "24", "--threads", "1"]


def check_will_it_fit(mpirun, program, scratch, check):
    for ranks, sharding in FIT_RUNS:
        metrics = os.path.join(scratch, f"fit-{ranks}-{sharding}.jsonl")
        code, output = run_job(mpirun, program, ranks, FIT_ARGS + ["--sharding", sharding, "--explain",
                                                                   "--metrics", metrics])
        if code != 0:
            check(f"np {ranks} {sharding} --explain trains", False, f"exit {code}\n{output}")
            continue
        check_peak(check, f"np {ranks} {sharding}", read_metrics(metrics), ranks)

    check_dry_runs_change_nothing(check, mpirun, program, 2, FIT_ARGS + ["--steps", "3"], scratch,
                                  lambda path: path)
    check_memory_limit(check, mpirun, program, 2, FIT_ARGS, scratch)


# (ranks predicted, sharding, ranks predicting them, assumed link flags).
WHAT_IF_RUNS = [(2, "hybrid:2", 1, ["--link-bandwidth", "50", "--link-latency", "20"]),
                (3, "full", 1, ["--link-bandwidth", "50", "--link-latency", "20"]),
                (4, "hybrid:2", 2, [])]


def planned_lines(output):
    """The plan table (from its title to the gradient accumulation line) and the peak's plan terms."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("FSDP plan:")), None)
    if start is None:
        return None
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("gradient accumulation"))
    terms = [line for line in lines if line.lstrip().startswith(("persistent:", "gathered parameters",
                                                                   "unsharded gradients"))]
    return lines[start:end + 1] + terms


def check_what_if(mpirun, program, check):
    for ranks, sharding, predicting, link in WHAT_IF_RUNS:
        args = FIT_ARGS + ["--sharding", sharding, "--explain"]
        code, real = run_job(mpirun, program, ranks, args)
        code2, what_if = run_job(mpirun, program, predicting, args + ["--world-size", str(ranks)] + link)
        expected, predicted = planned_lines(real), planned_lines(what_if)
        header = f"what-if, predicted and not run: this run on {ranks} ranks, rank 0 with {24 // ranks} of"
        check(f"--explain --world-size {ranks} --sharding {sharding} at np {predicting}: the plan and the peak's "
              f"plan terms that np {ranks} prints, a step time, nothing trained",
              code == 0 and code2 == 0 and expected is not None and predicted == expected and header in what_if
              and "step time per rank, predicted:" in what_if and "epoch 1" not in what_if
              and "median step" not in what_if,
              f"exit {code}/{code2}\n{real}\n{what_if}")


# The checks check_traces makes (skipped without the data set): the run, trace_checks.check_trace's
# for 2 ranks, and the two refusals.
TRACE_CHECKS = 28


def check_traces(mpirun, program, scratch, check):
    check_trace_run(mpirun, program, "train_cnn", PARITY_ARGS, scratch, check)


def check_detect_anomaly(mpirun, program, check):
    """Adadelta at lr 1e30 makes step 1's update huge, and step 2's forward overflows to inf and
    then NaN: --detect-anomaly names the op on every rank (the same op) and the job exits 1. Which
    op comes first depends on where the sums overflow, and so on the BLAS kernel OpenBLAS picks for
    the CPU (conv2d's sgemm under OPENBLAS_CORETYPE=Haswell, dropout's mul with the AVX-512 one);
    tests/autograd/test_anomaly.cpp checks that the first one is named."""
    code, output = run_job(mpirun, program, 2, PARITY_ARGS + ["--lr", "1e30", "--detect-anomaly"])
    named = [re.search(rf"\[rank {rank}\] train_cnn: detect_anomaly: the forward of '([a-z_0-9]+)' produced \d+ NaN of \d+ elements in its output \[[\d, ]+\] f32 "
                       r"\(the first at flat index \d+\)", output) for rank in range(2)]
    same = all(named) and named[0].group(1) == named[1].group(1)
    for rank in range(2):
        check(f"--lr 1e30 --detect-anomaly: rank {rank} names the op that made the first NaN (the same on both ranks), "
              "and the job exits 1", code == 1 and named[rank] and same, f"exit {code}\n{output}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: train_cnn_tests.py <mpirun> <train_cnn>")
    sys.exit(main(sys.argv[1], sys.argv[2]))
