#!/usr/bin/env python3
"""tests/apps/train_cnn_tests.py: runs apps/train_cnn under mpirun on Fashion-MNIST and checks
what its users rely on:

- exact parity: 6 steps of the same global batch (dropout included) give every step's loss, the
  mean over the global batch, within 1e-5 of the 1-process run, at 1, 2 and 4 ranks and for
  every sharding strategy;
- evaluation split over ranks (with a padded last batch) gives the 1-process test loss and
  accuracy;
- a global batch that does not split over the ranks, and an unknown sharding, exit 1 with a
  message printed once;
- every rank writes its metrics records, each carrying its "rank".

Usage: train_cnn_tests.py <mpirun> <train_cnn>. Needs the dataset from scripts/setup
(/usr/share/datasets/fashion-mnist); without it every case is skipped. Prints one line per
check, then "train_cnn_app: N passed, N failed, N skipped".
"""
import os
import sys
import tempfile

from jobs import read_metrics, run_job

DATA_DIR = "/usr/share/datasets/fashion-mnist"
STEPS = 6
PARITY_ARGS = ["--steps", str(STEPS), "--limit-train", "768", "--global-batch", "64",
               "--test-batch-size", "1000", "--threads", "1"]
# (ranks, sharding) for the parity runs; (1, "full") is the reference.
PARITY_RUNS = [(1, "full"), (2, "full"), (4, "full"), (2, "none"), (2, "grad_op"), (2, "hybrid:1"),
               (4, "hybrid:2")]
RTOL = 1e-5


def step_losses(records, rank):
    """{step: loss} of one rank's per-step records."""
    return {r["step"]: r["loss"] for r in records if r.get("rank") == rank and "loss" in r}


def close(actual, expected):
    return abs(actual - expected) <= RTOL * abs(expected)  # NaN compares false: it fails


def main(mpirun, program):
    results = []

    def check(name, ok, detail=""):
        print(f"{'ok' if ok else 'FAILED'}: {name}{'' if ok or not detail else chr(10) + detail}")
        results.append(ok)

    # Options are checked before the data loads: these run with or without the data set.
    code, output = run_job(mpirun, program, 4, ["--global-batch", "10", "--steps", "1"])
    message = "train_cnn: global batch: 10 does not split evenly over 4 ranks"
    check("np 4 --global-batch 10 exits 1, explained once", code == 1 and output.count(message) == 1,
          f"exit {code}\n{output}")

    code, output = run_job(mpirun, program, 2, ["--sharding", "half", "--steps", "1"])
    message = "train_cnn: sharding 'half' is not one of full, grad_op, none, hybrid:G"
    check("np 2 --sharding half exits 1, naming the value once", code == 1 and output.count(message) == 1,
          f"exit {code}\n{output}")

    skipped = 0
    if not os.path.isdir(DATA_DIR):
        skipped = len(PARITY_RUNS) - 1 + 2
        print(f"skipped: {skipped} cases that train, {DATA_DIR} is missing "
              "(scripts/setup installs dataset-fashion-mnist)")
    else:
        with tempfile.TemporaryDirectory(prefix="train_cnn_tests.") as scratch:
            train_and_check(mpirun, program, scratch, check)

    passed = sum(results)
    failed = len(results) - passed
    print(f"train_cnn_app: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


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


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: train_cnn_tests.py <mpirun> <train_cnn>")
    sys.exit(main(sys.argv[1], sys.argv[2]))
