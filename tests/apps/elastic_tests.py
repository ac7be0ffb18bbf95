#!/usr/bin/env python3
"""tests/apps/elastic_tests.py: scripts/train-elastic carries a job on with fewer ranks.

- train_cnn at 4 ranks, 60 steps, a checkpoint every 10: its highest rank killed (SIGKILL) once step
  23 is done, then again once step 43 is done after the first restart (each kill 3 steps after a
  checkpoint and 7 before the next, so that the lost run has steps beyond the checkpoint the job
  resumes from however late on a busy machine the kill lands). The launcher restarts at 3,
  then at 2 ranks, each time from the newest checkpoint, and the run finishes its 60 steps. The step
  losses after each restart equal, bit for bit, a plain --resume at that world size from that
  checkpoint; the first 3 (fewer where the kill landed late, at least 1) are within 1e-5 of those the
  lost run took from the same checkpoint (the
  curve goes on; rounding differences between world sizes grow with training, so later steps drift
  from the uninterrupted run: the largest difference is reported); the metrics record each restart.
- train_llama (tiny) at 2 ranks from a hostfile of 2 slots, cut to 1 slot before one kill (once step 13
  is done, a checkpoint every 10, 24 steps): one restart at 1 rank (the hostfile read again), the same
  checks.
- Refusals: no --checkpoint-dir; a failure that is no lost rank is not restarted; SIGTERM to the
  launcher stops the ranks cleanly (SIGUSR1 to mpirun), exit 75, no restart.

Usage: elastic_tests.py <mpirun> <train_cnn> <train_llama> <train-elastic>. Needs Fashion-MNIST and
Debian's fortunes (scripts/setup); without them their cases are skipped. Ends with "elastic: N
passed, N failed, N skipped".
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from jobs import Checks, read_metrics, read_metrics_so_far, run_timed

CNN_DATA = "/usr/share/datasets/fashion-mnist"
LLAMA_DATA = "/usr/share/games/fortunes"
RTOL = 1e-5
CONTINUITY_STEPS = 3  # steps after a restart that the lost run also took (from its last checkpoint)
MPIRUN_FLAGS = ["--allow-run-as-root", "--oversubscribe"]


class Case:
    """A program's training flags, its checkpoint interval, its steps, ranks, and the steps after which
    its highest rank is killed."""

    def __init__(self, name, program, args, every, steps, ranks, kills, hostfile=False):
        self.name, self.program, self.args, self.steps, self.ranks, self.kills = name, program, args, steps, ranks, kills
        self.checkpoints = ["--checkpoint-every", str(every), "--keep", "100"]  # every one kept to resume from
        # The world size from a hostfile that each kill shrinks by a slot first (a cluster listing the
        # machines still up), instead of --np.
        self.hostfile = hostfile


def cnn_case(program):
    return Case("train_cnn", program, ["--limit-train", "640", "--limit-test", "200", "--global-batch", "64",
                                       "--epochs", "6", "--threads", "1", "--steps", "60"], 10, 60, 4, (23, 43))


def llama_case(program):
    return Case("train_llama", program, ["--config", "tiny", "--seq", "48", "--global-batch", "12",
                                         "--limit-documents", "240", "--lr", "3e-3", "--threads", "1", "--steps",
                                         "24"], 10, 24, 2, (13,), hostfile=True)


def segments(records):
    """The rank-0 step losses of each run of the job, in order, split at the restart records; and those."""
    runs, restarts = [{}], []
    for r in records:
        if "restart" in r:
            restarts.append(r)
            runs.append({})
        elif r.get("rank") == 0 and "loss" in r and "step" in r:
            runs[-1][r["step"]] = r["loss"]
    return runs, restarts


def rank_pid(marker, rank, world):
    """The pid of the job's process of `rank` at world size `world`, by the job's marker variable."""
    wanted = [f"SHARDLAB_ELASTIC_TEST={marker}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode(),
              f"OMPI_COMM_WORLD_SIZE={world}".encode()]
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                items = environ.read().split(b"\0")
        except OSError:
            continue
        if all(w in items for w in wanted):
            return int(entry)
    return None


def run_elastic(elastic, mpirun, case, scratch):
    """Runs the case under train-elastic, killing the highest rank once each kill step is done (after the
    previous restart); (exit status, output, metrics path, directory, seconds from each kill to its
    restart record, from each restart record to the next run's first step)."""
    directory, metrics = os.path.join(scratch, f"{case.name}-ckpt"), os.path.join(scratch, f"{case.name}.jsonl")
    marker = uuid.uuid4().hex
    env = dict(os.environ, SHARDLAB_ELASTIC_TEST=marker, SHARDLAB_COLLECTIVE_TIMEOUT="120")
    hostfile = os.path.join(scratch, f"{case.name}-hosts")

    def list_slots(slots):
        with open(hostfile, "w", encoding="utf-8") as f:
            f.write(f"# the machines still up\nlocalhost slots={slots}\n")

    list_slots(case.ranks)
    size = ["--hostfile", hostfile] if case.hostfile else ["--np", str(case.ranks)]
    command = [elastic, *size, "--max-restarts", str(len(case.kills)), "--mpirun", mpirun,
               *MPIRUN_FLAGS, "--", case.program, *case.args, *case.checkpoints, "--checkpoint-dir", directory,
               "--metrics", metrics]
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           errors="replace")
    output = []
    reader = subprocess_reader(job, output)
    began, detect, restart = time.monotonic(), [], []
    for k, kill_step in enumerate(case.kills):
        world = case.ranks - k
        killed = pid = None
        while job.poll() is None and time.monotonic() - began < 300:
            runs, restarts = segments(read_metrics_so_far(metrics))
            if killed is None and len(restarts) == k and runs[-1]:
                # The rank is found once the run logs its first step, not at the kill step: searching /proc
                # then took long enough for a fast run to pass its next checkpoint, leaving the resumed run
                # no step in common with the lost one.
                pid = pid or rank_pid(marker, world - 1, world)
                if pid and max(runs[-1]) >= kill_step:
                    list_slots(world - 1)
                    os.kill(pid, signal.SIGKILL)
                    killed = time.monotonic()
            if killed is not None and len(restarts) > k:
                detect.append(time.monotonic() - killed)
                noted = time.monotonic()
                while job.poll() is None and not segments(read_metrics_so_far(metrics))[0][-1]:
                    time.sleep(0.01)
                restart.append(time.monotonic() - noted)
                break
            time.sleep(0.01)
    try:
        job.wait(timeout=max(1.0, 300 - (time.monotonic() - began)))
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
    reader.join()
    return job.returncode, "".join(output), metrics, directory, detect, restart


def subprocess_reader(job, output):
    """A thread that keeps the job's output drained into `output` while the test polls."""
    thread = threading.Thread(target=lambda: output.extend(job.stdout), daemon=True)
    thread.start()
    return thread


def check_case(check, mpirun, elastic, case, scratch):
    metrics = os.path.join(scratch, f"{case.name}-uninterrupted.jsonl")
    code, _, output = run_timed(mpirun, case.program, case.args + ["--metrics", metrics], ranks=case.ranks,
                                limit_s=240)
    reference = segments(read_metrics(metrics))[0][0]
    if code != 0 or len(reference) != case.steps:
        check(f"{case.name}: the uninterrupted run", False, f"exit {code}\n{output}")
        return
    code, output, metrics, directory, detect, restart = run_elastic(elastic, mpirun, case, scratch)
    runs, restarts = segments(read_metrics(metrics))
    sizes = [(r["from_world_size"], r["world_size"]) for r in restarts]
    expected_sizes = [(case.ranks - k, case.ranks - k - 1) for k in range(len(case.kills))]
    finished = code == 0 and sizes == expected_sizes and max(runs[-1], default=0) == case.steps
    times = ", ".join(f"restart {k + 1}: {d:.1f} s to notice, {r:.1f} s to the next run's first step"
                      for k, (d, r) in enumerate(zip(detect, restart)))
    check(f"{case.name}: {len(case.kills)} kill(s) at {case.ranks} ranks, restarted at "
          f"{' then '.join(str(s[1]) for s in sizes)}, the {case.steps} planned steps finished ({times})",
          finished, f"exit {code}, restarts {restarts}, last step {max(runs[-1], default=0)}\n{output}")
    if not finished:
        return
    for k, entry in enumerate(restarts):
        world, step, logged = entry["world_size"], entry["resume_step"], runs[k + 1]
        copy = os.path.join(scratch, f"{case.name}-from-{step}")
        shutil.copytree(os.path.join(directory, f"step-{step:08d}"), os.path.join(copy, f"step-{step:08d}"))
        plain_metrics = os.path.join(scratch, f"{case.name}-plain-{step}.jsonl")
        code, _, output = run_timed(mpirun, case.program, case.args + ["--checkpoint-dir", copy, "--resume",
                                                                       "--metrics", plain_metrics],
                                    ranks=world, limit_s=240)
        plain = segments(read_metrics(plain_metrics))[0][0]
        same = code == 0 and logged and min(logged) == step + 1 and all(plain.get(s) == v for s, v in logged.items())
        # The curve goes on: the first steps after the restart agree with those the lost run took from
        # the same checkpoint (its world size sums in another order: rounding differences, which grow
        # with training, so only the first few are held to RTOL; the largest over the part is reported).
        # A kill that lands late (a fast step on a busy machine) leaves fewer steps in common: each one is
        # held, at least one is needed.
        lost = runs[k]
        overlap = [s for s in sorted(logged) if s in lost][:CONTINUITY_STEPS]
        continuous = len(overlap) >= 1 and all(abs(logged[s] - lost[s]) <= RTOL * abs(lost[s]) for s in overlap)
        drift = max((abs(v - reference[s]) / abs(reference[s]) for s, v in logged.items()), default=0.0)
        check(f"{case.name}: after restart {k + 1} ({world} ranks from step {step}), steps {min(logged, default=0)}-"
              f"{max(logged, default=0)} equal a plain --resume at {world} ranks bit for bit; the first "
              f"{len(overlap)} within {RTOL:g} of the lost {entry['from_world_size']}-rank run's (at most "
              f"{drift:.1e} from the uninterrupted {case.ranks}-rank run over the part)", same and continuous,
              f"exit {code}\nelastic {logged}\nplain {plain}\nuninterrupted {reference}\n{output}")


def check_other_ends(check, mpirun, elastic, cnn, scratch):
    done = subprocess.run([elastic, "--np", "2", "--", cnn, "--steps", "2"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    check("no --checkpoint-dir: refused, exit 2", done.returncode == 2 and
          "train-elastic: the program needs --checkpoint-dir DIR" in done.stdout, done.stdout)
    for args, message in ((["--np", "0", "--", cnn], "train-elastic: --np must be at least 1, got 0"),
                          (["--np", "2", "--max-restarts", "-1", "--", cnn],
                           "--min-ranks must be at least 1 and --max-restarts at least 0, got 1 and -1"),
                          (["--np", "2"], "train-elastic: usage: train-elastic"),
                          (["--np", "2", "--"], "train-elastic: no program after --")):
        done = subprocess.run([elastic, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        check(f"train-elastic {' '.join(args[:-1] if args[-1] == cnn else args)}: refused, exit 2",
              done.returncode == 2 and message in done.stdout, done.stdout)
    directory = os.path.join(scratch, "refused-ckpt")
    done = subprocess.run([elastic, "--np", "2", "--mpirun", mpirun, *MPIRUN_FLAGS, "--", cnn, "--checkpoint-dir",
                           directory, "--global-batch", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)
    check("a job that fails by itself (a bad flag) is not restarted", done.returncode not in (0, 75)
          and "without losing a rank: not restarting" in done.stdout and "restart 1" not in done.stdout, done.stdout)

    # SIGTERM to the launcher (a scheduler stopping it): the ranks stop cleanly with their checkpoint,
    # and the launcher exits 75 without restarting.
    case = cnn_case(cnn)
    directory, metrics = os.path.join(scratch, "stopped-ckpt"), os.path.join(scratch, "stopped.jsonl")
    job = subprocess.Popen([elastic, "--np", "2", "--mpirun", mpirun, *MPIRUN_FLAGS, "--", cnn, *case.args,
                            "--checkpoint-dir", directory, "--metrics", metrics], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    output = []
    reader = subprocess_reader(job, output)
    began = time.monotonic()
    while job.poll() is None and time.monotonic() - began < 120:
        if any(r.get("step", 0) >= 3 for r in read_metrics_so_far(metrics)):
            job.send_signal(signal.SIGTERM)
            break
        time.sleep(0.01)
    code = job.wait(timeout=120)
    reader.join()
    text = "".join(output)
    stops = [r for r in read_metrics_so_far(metrics) if "stopped_by" in r and r.get("rank") == 0]
    check("SIGTERM to train-elastic: SIGUSR1 to mpirun, the ranks stop with their checkpoint, exit 75, no restart",
          code == 75 and len(stops) == 1 and f"train_cnn: stopped by SIGUSR1 after step {stops[0]['step']}" in text
          and "restart 1" not in text and os.path.isdir(os.path.join(directory, f"step-{stops[0]['step']:08d}")),
          f"exit {code}, stops {stops}\n{text}")


def main(mpirun, cnn, llama, elastic):
    check = Checks()
    skipped = 0
    with tempfile.TemporaryDirectory(prefix="elastic.") as scratch:
        if os.path.isdir(CNN_DATA):
            check_case(check, mpirun, elastic, cnn_case(cnn), scratch)
            check_other_ends(check, mpirun, elastic, cnn, scratch)
        else:
            print(f"skipped: 10 train_cnn cases, {CNN_DATA} is missing (scripts/setup installs dataset-fashion-mnist)")
            skipped += 10
        if os.path.isdir(LLAMA_DATA):
            check_case(check, mpirun, elastic, llama_case(llama), scratch)
        else:
            print(f"skipped: 2 train_llama cases, {LLAMA_DATA} is missing (scripts/setup installs fortunes)")
            skipped += 2
    return check.summary("elastic", skipped)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: elastic_tests.py <mpirun> <train_cnn> <train_llama> <train-elastic>")
    sys.exit(main(*sys.argv[1:]))
