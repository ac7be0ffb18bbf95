#!/usr/bin/env python3
"""tests/apps/fault_suite_tests.py: real training runs that go wrong, under mpirun, and what users
must get from them: the job ends within its time limit with a non-zero exit and a message that
names the cause, the previous checkpoint is intact, and resuming it continues the losses of the
uninterrupted run bit for bit.

Faults (train_cnn at np 2, checkpoints every 2 steps; SHARDLAB_INJECT_FAULT, dist/comm/fault_injection.h,
picks the collective):
- SIGKILL of rank 1 inside a collective (its 5th reduce-scatter of fc1: step 5);
- SIGKILL of rank 1 from outside mid-step (once step 5 is done) and mid-save (once a save of step
  4 or later is under way), and with --async-checkpoint while a save is written in the background
  (its temporary directory left uncommitted: the save before it resumes);
- rank 1 hangs before a collective: rank 0's watchdog names the collective and ends the job;
- a full disk (a 20 MiB tmpfs, room for one checkpoint) during the second save: every rank names
  the file and the error;
- an unreadable data file (a directory where the IDX file should be) on every rank (named once,
  as every error that all ranks meet while building), and on rank 1 only (rank 1 names it and
  ends the job at once instead of leaving rank 0 in a collective until the watchdog).

Non-finite steps: NaN injected into one rank's reduce-scatter (step 3) skips that step on every
rank, counted and logged, with model and optimizer state left bit for bit as they were; with
--max-skipped-steps 0 the run stops there naming the newest checkpoint, which resumes bit for bit;
Adadelta at lr 1e30 diverges for good and stops after --max-skipped-steps; the Llama skips too.

Usage: fault_suite_tests.py <mpirun> <train_cnn> <train_llama>. Needs Fashion-MNIST (scripts/setup);
without it the cases are skipped. Ends with "fault_suite: N passed, N failed, N skipped".
"""
import filecmp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from jobs import Checks, complete_steps, finish, rank0_losses, ranks_of, read_metrics, run_timed, start

DATA_DIR = "/usr/share/datasets/fashion-mnist"
# 10 steps per epoch; 8 steps in all, a checkpoint every 2.
ARGS = ["--limit-train", "640", "--limit-test", "200", "--global-batch", "64", "--epochs", "2", "--threads", "1"]
STEPS = 8
CASES = 12


class Suite:
    def __init__(self, mpirun, cnn, llama, scratch, check):
        self.mpirun, self.cnn, self.llama, self.scratch, self.check = mpirun, cnn, llama, scratch, check
        metrics = self.path("reference.jsonl")
        code, _, output = run_timed(mpirun, cnn, ARGS + ["--steps", str(STEPS), "--metrics", metrics])
        self.reference = rank0_losses(metrics)
        if code != 0 or sorted(self.reference) != list(range(1, STEPS + 1)):
            raise RuntimeError(f"the uninterrupted run failed: exit {code}\n{output}")

    def path(self, name):
        return os.path.join(self.scratch, name)

    def resumes(self, name, directory, newest):
        """Whether `directory`'s newest complete checkpoint is step `newest` and resuming it gives
        the uninterrupted run's losses bit for bit; (ok, detail)."""
        metrics = self.path(f"{name}-resumed.jsonl")
        found = complete_steps(directory)
        code, _, output = run_timed(self.mpirun, self.cnn, ARGS + ["--steps", str(STEPS), "--checkpoint-dir", directory,
                                                             "--resume", "--metrics", metrics])
        resumed = rank0_losses(metrics)
        ok = (found and found[-1] == newest and code == 0 and sorted(resumed) == list(range(newest + 1, STEPS + 1))
              and all(resumed[s] == self.reference[s] for s in resumed))
        return ok, f"complete {found}, resumed exit {code}: {resumed}\nreference {self.reference}\n{output}"

    def fault(self, name, args, env_extra, limit_s, messages, newest, directory=None):
        """Runs a faulty job, checks its end, then that the checkpoint left resumes."""
        directory = directory or self.path(name)
        code, seconds, output = run_timed(self.mpirun, self.cnn, ARGS + ["--steps", str(STEPS), "--checkpoint-dir",
                                                                   directory, "--checkpoint-every", "2"] + args,
                                    env_extra, limit_s)
        missing = [m for m in messages if m not in output]
        ended = code not in (0, None) and seconds <= limit_s and not missing
        resumed, detail = self.resumes(name, directory, newest) if ended else (False, "")
        self.check(f"{name}: ends in {seconds:.1f} s (limit {limit_s} s) with exit {code}, the cause named; "
                   f"step {newest}'s checkpoint resumes bit for bit", ended and resumed,
                   f"missing {missing}\n{output}\n{detail}")

    def killed_from_outside(self, name, ready, limit_s=60, attempts=4, args=(), landed_when=None):
        """Kills rank 1 with SIGKILL once ready(directory, metrics) holds; returns (code, seconds,
        output, directory) of the attempt where the kill landed (and landed_when(directory) held
        after it), or None."""
        for attempt in range(attempts):
            directory, metrics = self.path(f"{name}-{attempt}"), self.path(f"{name}-{attempt}.jsonl")
            began = time.monotonic()
            job = start(self.mpirun, self.cnn, ARGS + ["--steps", str(STEPS), "--checkpoint-dir", directory,
                                                       "--checkpoint-every", "2", "--metrics", metrics, *args])
            landed = False
            while job.poll() is None and time.monotonic() - began < limit_s:
                if ready(directory, metrics):
                    victim = ranks_of(job.pid).get(1)
                    if victim:
                        os.kill(victim, signal.SIGKILL)
                        landed = True
                    break
                time.sleep(0.0005)
            code, seconds, output = finish(job, began, limit_s)
            if landed and code not in (0, None) and (landed_when is None or landed_when(directory)):
                return code, seconds, output, directory
        return None


def check_faults(suite, check):
    mpirun = suite.mpirun
    suite.fault("rank 1 killed inside a collective (step 5's reduce-scatter of fc1)", [],
                {"SHARDLAB_INJECT_FAULT": "kill:rank=1:call=5:tag=fc1"}, 60,
                ["[rank 1] fault injection: killing myself with SIGKILL in reduce_scatter(f32,",
                 "exited on signal 9"], newest=4)

    suite.fault("rank 1 hangs before step 5's reduce-scatter of fc1", [],
                {"SHARDLAB_INJECT_FAULT": "hang:rank=1:call=5:tag=fc1", "SHARDLAB_COLLECTIVE_TIMEOUT": "3"}, 60,
                ["[rank 1] fault injection: hanging before reduce_scatter(f32,",
                 f"[rank 0] collective watchdog on host {socket.gethostname()}: #"], newest=4)

    # From outside: rank 0 writes step 5's record after its step; rank 1 is then in step 6.
    def after_step_5(directory, metrics):
        return 5 in rank0_losses(metrics)

    for name, ready, newest in (
            ("rank 1 killed by SIGKILL mid-step (step 6)", after_step_5, 4),
            ("rank 1 killed by SIGKILL mid-save (step 4 or 6)",
             lambda directory, metrics: os.path.isdir(directory) and any(
                 ".tmp-" in n and int(n[5:13]) >= 4 for n in os.listdir(directory)), None)):
        killed = suite.killed_from_outside(name, ready)
        if killed is None:
            check(f"{name}: the kill landed before the job ended", False)
            continue
        code, seconds, output, directory = killed
        saved = complete_steps(directory)
        expected = newest if newest is not None else (saved[-1] if saved else -1)
        # mid-save: the save under way is not complete, the one before it is.
        ok = seconds <= 60 and "exited on signal 9" in output and (newest is not None or expected in (2, 4))
        resumed, detail = suite.resumes(name.split(" (")[0].replace(" ", "_"), directory, expected) if ok else (
            False, "")
        check(f"{name}: ends in {seconds:.1f} s with exit {code}, mpirun names the killed rank; step {expected}'s "
              f"checkpoint resumes bit for bit", ok and resumed, f"{output}\n{detail}")

    check_background_save_killed(suite, check)
    check_full_disk(suite, check)
    check_unreadable_data(suite, check)


def saves_under_way(directory):
    """The steps of the temporary directories of saves in `directory` (step-00000004.tmp-<id>)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n[5:13]) for n in os.listdir(directory) if ".tmp-" in n)


def check_background_save_killed(suite, check):
    """--async-checkpoint: rank 1 killed once a save of step 4 or later has begun, and found after the
    job still uncommitted (its temporary directory left, no metadata.json): the save before it resumes."""
    name = "rank 1 killed by SIGKILL during a background save (--async-checkpoint)"

    def in_flight(directory):
        complete = complete_steps(directory)
        return any(step >= 4 and step not in complete for step in saves_under_way(directory))

    killed = suite.killed_from_outside(name, lambda directory, metrics: any(s >= 4 for s in saves_under_way(directory)),
                                       args=["--async-checkpoint"], landed_when=in_flight)
    if killed is None:
        check(f"{name}: the kill landed while a save was in flight", False)
        return
    code, seconds, output, directory = killed
    saved, uncommitted = complete_steps(directory), saves_under_way(directory)
    newest = saved[-1] if saved else -1
    resumed, detail = suite.resumes("background-save", directory, newest) if newest >= 2 else (False, "")
    check(f"{name}: ends in {seconds:.1f} s with exit {code}, the save of step {uncommitted} left "
          f"uncommitted; step {newest}'s checkpoint resumes bit for bit",
          seconds <= 60 and "exited on signal 9" in output and resumed, f"complete {saved}\n{output}\n{detail}")


def check_full_disk(suite, check):
    mount = suite.path("small-disk")
    os.makedirs(mount)
    # A checkpoint of the CNN is 14.4 MB: the second one does not fit beside the first.
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", mount],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if mounted.returncode != 0:
        check("a full disk during a save: mounting a 20 MiB tmpfs", False, mounted.stdout)
        return
    try:
        directory = os.path.join(mount, "checkpoints")
        code, seconds, output = run_timed(suite.mpirun, suite.cnn, ARGS + ["--steps", str(STEPS), "--checkpoint-dir",
                                                                     directory, "--checkpoint-every", "2"])
        named = all(f"[rank {r}] train_cnn: " in output for r in range(2)) and "No space left on device" in output
        copy = suite.path("small-disk-copy")  # resuming saves again: on a disk with room
        shutil.copytree(directory, copy, ignore=shutil.ignore_patterns("*.tmp-*"))
    finally:
        subprocess.run(["umount", mount], check=False)
    ok = code not in (0, None) and seconds <= 60 and named
    resumed, detail = suite.resumes("full-disk", copy, 2) if ok else (False, "")
    check(f"a full disk during step 4's save: ends in {seconds:.1f} s with exit {code}, every rank names the error; "
          "step 2's checkpoint resumes bit for bit", ok and resumed, f"{output}\n{detail}")


def check_unreadable_data(suite, check):
    data = suite.path("data")
    os.makedirs(data)
    for name in os.listdir(DATA_DIR):
        os.symlink(os.path.join(DATA_DIR, name), os.path.join(data, name))
    unreadable = os.path.join(data, "train-images-idx3-ubyte.gz")
    os.remove(unreadable)
    os.mkdir(unreadable)  # unreadable even for root, which chmod 000 is not
    message = f"train_cnn: read_idx: '{unreadable}' is not a readable gzip or IDX file: Is a directory"
    code, seconds, output = run_timed(suite.mpirun, suite.cnn, ARGS + ["--steps", "2", "--data", data], limit_s=30)
    check(f"an unreadable data file on every rank: exit {code} in {seconds:.1f} s, named once",
          code == 1 and output.count(message) == 1, output)

    # Rank 1 alone (another machine's disk): mpirun's MPMD form gives it another --data.
    command = [suite.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "1", suite.cnn] + ARGS + [
        "--steps", "2", ":", "-np", "1", suite.cnn] + ARGS + ["--steps", "2", "--data", data]
    began = time.monotonic()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
                          env=dict(os.environ, SHARDLAB_COLLECTIVE_TIMEOUT="120"))
    seconds = time.monotonic() - began
    ok = (done.returncode != 0 and seconds <= 20 and f"[rank 1] {message}" in done.stdout
          and "[rank 1] train_cnn: the other ranks did not fail alike: ending the job" in done.stdout)
    check(f"an unreadable data file on rank 1 only: rank 1 names it and ends the job in {seconds:.1f} s "
          f"(exit {done.returncode}), long before the collective timeout", ok, done.stdout)


def shard_files(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".bin"))


def check_non_finite(suite, check):
    nan_at_3 = {"SHARDLAB_INJECT_FAULT": "nan:rank=1:call=3:tag=fc1"}  # step 3's gradient of fc1
    directory, metrics = suite.path("nan"), suite.path("nan.jsonl")
    code, _, output = run_timed(suite.mpirun, suite.cnn, ARGS + ["--steps", "5", "--checkpoint-dir", directory,
                                                           "--checkpoint-every", "1", "--keep", "9", "--metrics",
                                                           metrics], nan_at_3)
    records = read_metrics(metrics)
    skipped = sorted({(r["rank"], r["step"]) for r in records if r.get("skipped")})
    summary = [r for r in records if "skipped_steps" in r]
    before, after = os.path.join(directory, "step-00000002"), os.path.join(directory, "step-00000003")
    unchanged = (os.path.isdir(after) and shard_files(before) == shard_files(after) == [
        "rank-00000-of-00002.bin", "rank-00001-of-00002.bin"] and all(
        filecmp.cmp(os.path.join(before, n), os.path.join(after, n), shallow=False) for n in shard_files(after)))
    ok = (code == 0 and output.count("train_cnn: step 3 skipped: the loss (") == 1 and "gradient norm (nan)" in output
          and skipped == [(0, 3), (1, 3)] and [r["skipped_steps"] for r in summary] == [1, 1]
          and "train_cnn: 1 steps skipped for a non-finite loss or gradient norm" in output and unchanged)
    check("NaN in one rank's reduce-scatter at step 3: every rank skips step 3 (logged once, counted in the "
          "metrics), its model and optimizer shards stay bit for bit, and training goes on", ok,
          f"exit {code}, skipped {skipped}, summary {summary}, unchanged {unchanged}\n{output}")

    directory = suite.path("nan-stop")
    code, _, output = run_timed(suite.mpirun, suite.cnn, ARGS + ["--steps", "5", "--checkpoint-dir", directory,
                                                           "--checkpoint-every", "1", "--max-skipped-steps", "0"],
                          nan_at_3)
    message = (f"train_cnn: stopped at step 3: the loss ({suite.reference[3]}) or the gradient norm (nan) was not "
               "finite for 1 steps in a row (steps 3 to 3), more than --max-skipped-steps 0; the model is as after "
               f"step 2 (a skipped step changes nothing), and the newest checkpoint is {directory}/step-00000002: "
               "resume from it with --resume, perhaps with a lower --lr")
    stopped = code == 1 and all(f"[rank {r}] {message}" in output for r in range(2))
    resumed, detail = suite.resumes("nan-stop", directory, 2) if stopped else (False, "")
    check("--max-skipped-steps 0: the first non-finite step stops the run on every rank, naming the newest "
          "checkpoint, which resumes bit for bit", stopped and resumed, f"exit {code}\n{output}\n{detail}")

    code, _, output = run_timed(suite.mpirun, suite.cnn, ARGS + ["--steps", "6", "--lr", "1e30",
                                                           "--max-skipped-steps", "2"])
    check("Adadelta at lr 1e30: steps 2 and 3 are skipped, step 4 stops the run on every rank (no checkpoint "
          "to name)", code == 1 and output.count("skipped: the loss (") == 2 and all(
              f"[rank {r}] train_cnn: stopped at step 4: " in output and "(steps 2 to 4), more than "
              "--max-skipped-steps 2" in output for r in range(2))
          and "there is no checkpoint to resume from (no --checkpoint-dir)" in output, f"exit {code}\n{output}")

    metrics = suite.path("llama-nan.jsonl")
    code, _, output = run_timed(suite.mpirun, suite.llama, ["--config", "tiny", "--steps", "4", "--global-batch", "4",
                                                      "--seq", "32", "--limit-documents", "200", "--threads", "1",
                                                      "--metrics", metrics],
                          {"SHARDLAB_INJECT_FAULT": "nan:rank=0:call=2:tag=model.layers.0"})
    skipped = sorted({r["step"] for r in read_metrics(metrics) if r.get("skipped")})
    check("train_llama: NaN in a decoder layer's reduce-scatter at step 2 skips that step and training goes on",
          code == 0 and skipped == [2] and "train_llama: step 2 skipped:" in output, f"exit {code}\n{output}")


def main(mpirun, cnn, llama):
    check = Checks()
    if not os.path.isdir(DATA_DIR):
        print(f"skipped: {CASES} cases, {DATA_DIR} is missing (scripts/setup installs dataset-fashion-mnist)")
        return check.summary("fault_suite", CASES)
    with tempfile.TemporaryDirectory(prefix="fault_suite.") as scratch:
        suite = Suite(mpirun, cnn, llama, scratch, check)
        check_faults(suite, check)
        check_non_finite(suite, check)
    return check.summary("fault_suite", 0)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: fault_suite_tests.py <mpirun> <train_cnn> <train_llama>")
    sys.exit(main(*sys.argv[1:]))
